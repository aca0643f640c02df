"""Tests for ``moelora.layer.FusedMoEWithLoRA`` on adapters served from a ``MoELoRAMemoryPool``.

Every path ("fused", "staged" and "torch"; "auto" where it matters) is checked against the fp32 oracle
``moelora.reference.reference_moe`` fed the SAME ``ReferenceLoRA`` objects that were loaded into the pool
with ``pool.add_adapter_weights``, so the test covers the pool layout (slots, zero padding, per-module
rescaling), the batch info and the kernels together. Each comparison also checks that the adapters
change the reference output by a lot, so a path that ignored the LoRA could not pass.

CPU tests that run Triton kernels are marked ``interpreter`` one by one (``pytest.param(...,
marks=interpreter)``): conftest skips ``interpreter`` tests on a CUDA machine without TRITON_INTERPRET=1
and ``gpu`` tests under the interpreter, so a module-wide mark would never let the GPU tests run. The
interpreter is slow, so CPU shapes are tiny and odd; dtypes are fp32 and fp16 only (the Triton 3.9
interpreter's bf16 ``tl.dot`` is broken). bf16 is covered by the ``gpu`` tests at DeepSeek-V2-Lite
shapes, which print their errors (``pytest -s``).
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from moelora.layer import FusedMoEWithLoRA
from moelora.pool import MoELoRAMemoryPool
from moelora.reference import LoRAProjection, ReferenceLoRA, reference_moe
from triton_ops import fused_experts
from triton_ops.overrides import LAUNCH_OVERRIDES

interpreter = pytest.mark.interpreter
gpu = pytest.mark.gpu

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPE_IDS = {F32: "fp32", F16: "fp16", BF16: "bf16"}

# Max error, both as ||out-ref||/||ref|| and as max|out-ref| / max|ref|, against the fp32 oracle.
TOL = {F32: 1e-4, F16: 1e-2, BF16: 1e-2}

# The pool's MoE layers are model layers 1 and 3 (DeepSeek's first layers are dense); the layer under
# test is 3, not the pool's first, and every adapter gets different weights on layer 1, so reading the
# wrong layer's buffers shows.
LAYER_IDS = (1, 3)
LAYER = 3

# Odd CPU sizes: H=48 and I=40 are not multiples of the 32/64-wide K and N tiles (tail masking in every
# GEMM and LoRA tile); E=6 is not a power of two.
H, INTER, E = 48, 40, 6

TRITON_PATHS = [pytest.param(p, marks=interpreter) for p in ("fused", "split", "staged")]
ALL_PATHS = [*TRITON_PATHS, "torch"]


# --------------------------------------------------------------------------------------------- helpers


def rand_projection(rank, in_f, out_f, scaling, dtype, device="cpu"):
    """One LoRA module with a ~ randn/sqrt(in), b ~ randn/sqrt(r): ``s·B(A x)`` is O(s) for O(1) x, as
    big as the base projection's output, so the delta is clearly visible. The values are rounded to
    ``dtype`` (kept as fp32) so that the oracle sees exactly what the pool holds."""
    a = torch.randn(rank, in_f, device=device) / math.sqrt(in_f)
    b = torch.randn(out_f, rank, device=device) / math.sqrt(max(rank, 1))
    return LoRAProjection(a.to(dtype).float(), b.to(dtype).float(), float(scaling))


def make_lora(
    num_experts,
    hidden,
    inter,
    rank,
    scaling,
    dtype,
    *,
    experts=None,
    projs=("gate", "up", "down"),
    module_rank=None,
    device="cpu",
):
    """One layer's adapter. ``experts``: which experts get a LoRA (default all); ``projs``: which of
    gate/up/down; ``module_rank(e, proj) -> (rank, scaling)`` overrides the adapter's rank and scaling for
    one module (PEFT rank_pattern / alpha_pattern)."""
    lora = ReferenceLoRA()
    dims = {"gate": (hidden, inter), "up": (hidden, inter), "down": (inter, hidden)}
    for e in range(num_experts) if experts is None else experts:
        for p in projs:
            r, s = module_rank(e, p) if module_rank is not None else (rank, scaling)
            getattr(lora, p)[e] = rand_projection(r, *dims[p], s, dtype, device)
    return lora


def make_adapter(rank, scaling, dtype, *, layers=LAYER_IDS, num_experts=E, hidden=H, inter=INTER, **kw):
    """``{layer_id: ReferenceLoRA}`` for ``pool.add_adapter_weights``, different random weights per layer."""
    return {lid: make_lora(num_experts, hidden, inter, rank, scaling, dtype, **kw) for lid in layers}


def make_pool(
    dtype,
    *,
    max_loras=6,
    max_rank=16,
    num_experts=E,
    hidden=H,
    inter=INTER,
    layer_ids=LAYER_IDS,
    device="cpu",
):
    return MoELoRAMemoryPool(
        num_experts=num_experts,
        hidden_size=hidden,
        intermediate_size=inter,
        layer_ids=layer_ids,
        max_loras=max_loras,
        max_rank=max_rank,
        dtype=dtype,
        device=device,
    )


def make_base(num_experts, hidden, inter, dtype, device="cpu"):
    """Base experts scaled by 1/sqrt(fan_in) so activations and outputs stay O(1)."""
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device=device) / math.sqrt(hidden)).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, device=device) / math.sqrt(inter)).to(dtype)
    return w13, w2


def make_routing(m, num_experts, k, *, unused=(), device="cpu"):
    """Softmax top-k routing, renormalised; experts in ``unused`` are never picked."""
    logits = torch.randn(m, num_experts, device=device)
    if unused:
        logits[:, list(unused)] = float("-inf")
    weights, ids = torch.softmax(logits, dim=-1).topk(k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    return weights.float().contiguous(), ids.to(torch.int32).contiguous()


def token_adapters(names, seq_lens, adapters, layer=LAYER):
    """The oracle's view of a batch: (adapter list, per-token index into it, -1 = no adapter)."""
    order = sorted({n for n in names if n is not None})
    idx = {n: i for i, n in enumerate(order)}
    per_token = []
    for n, length in zip(names, seq_lens, strict=True):
        per_token += [-1 if n is None else idx[n]] * length
    return [adapters[n][layer] for n in order], per_token


def rel_errors(out, ref):
    diff = (out.float() - ref.float()).abs()
    rel_l2 = (diff.norm() / ref.float().norm().clamp_min(1e-30)).item()
    rel_max = (diff.max() / ref.float().abs().max().clamp_min(1e-30)).item()
    return rel_l2, rel_max


def assert_matches(out, ref, tol, what=""):
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out.float()).all(), f"{what}: non-finite output"
    rel_l2, rel_max = rel_errors(out, ref)
    assert rel_l2 <= tol and rel_max <= tol, (
        f"{what}: rel L2 err {rel_l2:.3g}, rel max err {rel_max:.3g} > {tol}"
    )


def assert_lora_visible(ref, base, per_token, min_rel=0.1):
    """Each adapter used in the batch changes its tokens' reference output by >= min_rel (relative L2):
    the comparison with the oracle is not vacuous."""
    slots = torch.tensor(per_token)
    for a in sorted(set(per_token) - {-1}):
        rows = slots == a
        rel = ((ref[rows] - base[rows]).norm() / base[rows].norm()).item()
        assert rel >= min_rel, f"adapter {a} changes the reference by only {rel:.3g}: test would be vacuous"


def run_and_check(
    pool,
    adapters,
    names,
    seq_lens,
    x,
    w13,
    w2,
    topk_weights,
    topk_ids,
    *,
    path,
    tol,
    rsf=1.0,
    on_input=False,
    check_visible=True,
):
    """Runs the layer on ``prepare_batch(names, seq_lens)``, compares with ``reference_moe`` on the same
    adapters; returns (out, ref, base_ref)."""
    batch = pool.prepare_batch(names, seq_lens)
    layer = FusedMoEWithLoRA(
        w13,
        w2,
        pool=pool,
        layer_id=LAYER,
        path=path,
        routed_scaling_factor=rsf,
        apply_router_weight_on_input=on_input,
    )
    out = layer(x, topk_weights, topk_ids, batch)
    assert out.dtype == x.dtype and out.shape == x.shape
    loras, per_token = token_adapters(names, seq_lens, adapters)
    kw = dict(routed_scaling_factor=rsf, apply_router_weight_on_input=on_input)
    ref = reference_moe(x, w13, w2, topk_weights, topk_ids, adapters=loras, token_adapter=per_token, **kw)
    base = reference_moe(x, w13, w2, topk_weights, topk_ids, **kw)
    if check_visible:
        assert_lora_visible(ref, base, per_token)
    assert_matches(out, ref, tol, f"path={path}")
    return out, ref, base


# ---------------------------------------------------------------------- mixed adapters vs the oracle

# 3 adapters of ranks 4/8/16 in a max-rank-16 pool (so two of them are zero-padded), different scalings;
# "idle" is loaded (slot 1, between the used ones) but used by no token: reading the wrong slot shows.
# "a" appears in two non-adjacent sequences, and two sequences have no adapter.
MIXED_RANKS = {"a": (4, 2.0), "idle": (16, 3.0), "b": (8, 0.5), "c": (16, 1.0)}
MIXED_NAMES = ["a", None, "b", "c", None, "a"]
MIXED_LENS = [3, 2, 1, 4, 1, 2]  # 13 tokens: seq_lens > 1, and an odd token count


def load_mixed(dtype, *, num_experts=E):
    pool = make_pool(dtype, num_experts=num_experts)
    adapters = {}
    for name, (rank, scaling) in MIXED_RANKS.items():
        adapters[name] = make_adapter(rank, scaling, dtype, num_experts=num_experts)
        pool.add_adapter_weights(name, adapters[name])
    return pool, adapters


@pytest.mark.parametrize("path", ALL_PATHS)
@pytest.mark.parametrize("dtype", [F32, F16], ids=DTYPE_IDS.get)
# top_k 1: GEMM2 writes the output directly (no top-k sum); 2: the common case; 6 = E: every token picks
# every expert.
@pytest.mark.parametrize("top_k", [1, 2, 6])
def test_mixed_adapters_match_reference(path, dtype, top_k):
    pool, adapters = load_mixed(dtype)
    m = sum(MIXED_LENS)
    x = torch.randn(m, H).to(dtype)
    w13, w2 = make_base(E, H, INTER, dtype)
    # Expert 4 gets no token when top_k < E: the alignment and the LoRA kernels must skip it.
    topk_weights, topk_ids = make_routing(m, E, top_k, unused=(4,) if top_k < E else ())
    run_and_check(
        pool, adapters, MIXED_NAMES, MIXED_LENS, x, w13, w2, topk_weights, topk_ids, path=path, tol=TOL[dtype]
    )


def with_out_of_range_ids(topk_ids, num_experts, seed):
    """``topk_ids`` with -1 (an expert-parallel "not mine" marker), E and 10**6 (router bugs) put at random
    positions (about a third of the pairs, at least one of each)."""
    gen = torch.Generator().manual_seed(seed)
    bad_values = torch.tensor([-1, num_experts, 10**6], dtype=topk_ids.dtype)
    picks = bad_values[torch.randint(3, topk_ids.shape, generator=gen)].to(topk_ids.device)
    where = (torch.rand(topk_ids.shape, generator=gen) < 0.35).to(topk_ids.device)
    out = torch.where(where, picks, topk_ids)
    out.view(-1)[: min(3, out.numel())] = bad_values[: min(3, out.numel())].to(out.device)
    return out


# M=1: decode without alignment (each pair its own program); 7: the one-program alignment; 70 with top-2
# (140 pairs): the three-launch alignment. top_k 1: GEMM2 writes the output itself; 6 = E.
@pytest.mark.parametrize("path", [*ALL_PATHS, pytest.param("base", marks=interpreter)])
@pytest.mark.parametrize("m,top_k", [(1, 2), (7, 2), (70, 2), (7, 1), (7, 6)])
def test_expert_ids_outside_range_contribute_nothing(path, m, top_k):
    pool, adapters = load_mixed(F32)
    names, lens = split_batch(m, ["a", None, "b", "c"])
    x = torch.randn(m, H)
    w13, w2 = make_base(E, H, INTER, F32)
    topk_weights, topk_ids = make_routing(m, E, top_k)
    bad_ids = with_out_of_range_ids(topk_ids, E, seed=m * 7 + top_k)
    if path == "base":
        layer = FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=LAYER)
        batch = loras = per_token = None
    else:
        layer = FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=LAYER, path=path)
        batch = pool.prepare_batch(names, lens)
        loras, per_token = token_adapters(names, lens, adapters)
    out = layer(x, topk_weights, bad_ids, batch)
    # The same routing with those pairs' weights at 0: what "contributes nothing" means.
    kept = topk_weights.masked_fill(bad_ids != topk_ids, 0.0)
    ref = reference_moe(x, w13, w2, kept, topk_ids, adapters=loras, token_adapter=per_token)
    assert_matches(out, ref, TOL[F32], f"path={path}")


@pytest.mark.parametrize("path", ALL_PATHS)
def test_mixed_adapters_64_experts(path):
    # E=64 (DeepSeek-V2-Lite's expert count) with 13 tokens x top-6: most experts get zero or one pair,
    # and experts 10..29 get none at all, so many alignment blocks are padding only.
    num_experts = 64
    pool, adapters = load_mixed(F32, num_experts=num_experts)
    m = sum(MIXED_LENS)
    x = torch.randn(m, H)
    w13, w2 = make_base(num_experts, H, INTER, F32)
    topk_weights, topk_ids = make_routing(m, num_experts, 6, unused=range(10, 30))
    run_and_check(
        pool, adapters, MIXED_NAMES, MIXED_LENS, x, w13, w2, topk_weights, topk_ids, path=path, tol=TOL[F32]
    )


# --------------------------------------------------------------------------- no adapter in the batch


@pytest.mark.parametrize("path", TRITON_PATHS)
@pytest.mark.parametrize("dtype", [F32, F16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize(
    "names, seq_lens",
    [
        (None, None),  # batch=None
        ([None, None], [4, 3]),  # only tokens without adapter
        (["a", None], [0, 7]),  # an adapter named by an empty sequence: still no token uses it
    ],
    ids=["batch-none", "all-none", "empty-adapter-seq"],
)
def test_no_adapter_batch_is_base_bit_for_bit(path, dtype, names, seq_lens):
    pool, _ = load_mixed(dtype)
    m = 7
    x = torch.randn(m, H).to(dtype)
    w13, w2 = make_base(E, H, INTER, dtype)
    topk_weights, topk_ids = make_routing(m, E, 2)
    batch = None if names is None else pool.prepare_batch(names, seq_lens)
    if batch is not None:
        assert not batch.has_lora and batch.max_rank == 0
    layer = FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=LAYER, path=path, routed_scaling_factor=2.5)
    out = layer(x, topk_weights, topk_ids, batch)
    expected = fused_experts(x, w13, w2, topk_weights, topk_ids, routed_scaling_factor=2.5)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("path", TRITON_PATHS)
@pytest.mark.parametrize("dtype", [F32, F16], ids=DTYPE_IDS.get)
def test_tokens_without_adapter_get_base_output(path, dtype):
    """docs/design.md §1: a token with no adapter gets the base MoE output, also inside a batch with adapters.

    Both paths add nothing for slot -1 rows: the fused path runs the base GEMMs unchanged, the staged path
    keeps the raw GEMM1 output in fp32 so its activation sees what the base epilogue sees. Bit for bit."""
    pool, _ = load_mixed(dtype)
    m = sum(MIXED_LENS)
    x = torch.randn(m, H).to(dtype)
    w13, w2 = make_base(E, H, INTER, dtype)
    topk_weights, topk_ids = make_routing(m, E, 2)
    batch = pool.prepare_batch(MIXED_NAMES, MIXED_LENS)
    none = batch.token_slots == -1
    out = FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=LAYER, path=path)(x, topk_weights, topk_ids, batch)
    base = fused_experts(x, w13, w2, topk_weights, topk_ids)
    assert torch.equal(out[none], base[none])
    assert not torch.allclose(out[~none].float(), base[~none].float(), rtol=0.05, atol=0.05)


# ----------------------------------------------------------------------------------------- slot reuse


@pytest.mark.parametrize("path", ALL_PATHS)
def test_slot_reused_after_larger_rank_adapter(path):
    dtype = F32
    pool = make_pool(dtype, max_loras=2, max_rank=16)
    big = make_adapter(16, 1.0, dtype)
    slot = pool.add_adapter_weights("big", big)
    pool.unload_adapter("big")
    small = make_adapter(4, 2.0, dtype)
    assert pool.add_adapter_weights("small", small) == slot
    # The pool itself: nothing of "big" survives beyond rank 4 in the reused slot.
    r = pool.max_rank
    for layer in pool.layers.values():
        buf = layer.dense()
        assert not buf.gate_up_a[slot, :, 4:r].any() and not buf.gate_up_a[slot, :, r + 4 :].any()
        assert not buf.gate_up_b[slot, :, :, 4:].any()
        assert not buf.down_a[slot, :, 4:].any() and not buf.down_b[slot, :, :, 4:].any()

    names, lens = ["small", None], [5, 3]
    m = sum(lens)
    x = torch.randn(m, H)
    w13, w2 = make_base(E, H, INTER, dtype)
    topk_weights, topk_ids = make_routing(m, E, 2)
    _, ref_small, _ = run_and_check(
        pool, {"small": small}, names, lens, x, w13, w2, topk_weights, topk_ids, path=path, tol=TOL[dtype]
    )
    # Stale "big" weights would have given a very different answer.
    loras, per_token = token_adapters(["big", None], lens, {"big": big})
    ref_big = reference_moe(x, w13, w2, topk_weights, topk_ids, adapters=loras, token_adapter=per_token)
    assert (ref_big - ref_small).norm() > 0.1 * ref_small.norm()


# ------------------------------------------------------- per-module ranks and partial coverage


def _pattern_rank(e, proj):
    # rank_pattern/alpha_pattern style: experts 1 and 4 have rank 2 with their own scaling, expert 2's down
    # has an odd rank (5), expert 0's gate (the pool's first module, which sets the slot scaling) has a
    # scaling unlike the rest, so every other module's B is rescaled by the pool.
    if e == 0 and proj == "gate":
        return 8, 4.0
    if e in (1, 4):
        return 2, 3.0
    if e == 2 and proj == "down":
        return 5, 1.5
    return 8, 0.5


@pytest.mark.parametrize("path", ALL_PATHS)
@pytest.mark.parametrize("dtype", [F32, F16], ids=DTYPE_IDS.get)
def test_per_module_ranks_and_partial_adapters(path, dtype):
    adapters = {
        "pattern": make_adapter(8, 0.5, dtype, module_rank=_pattern_rank),
        # Only experts 1 and 3 (and only on layer 3): tokens routed elsewhere get base outputs there.
        "some_experts": make_adapter(6, 1.0, dtype, experts=(1, 3), layers=(LAYER,)),
        "down_only": make_adapter(4, 2.0, dtype, projs=("down",)),
        "gate_up_only": make_adapter(4, 2.0, dtype, projs=("gate", "up")),
        # Gate without up: the gate and up halves of the gate_up buffers must stay apart.
        "gate_only": make_adapter(3, 2.0, dtype, projs=("gate",)),
        # Weights on layer 1 only: on layer 3 its tokens get exactly the base output.
        "other_layer": make_adapter(8, 1.0, dtype, layers=(1,)),
    }
    pool = make_pool(dtype, max_loras=len(adapters), max_rank=16)
    for name, layers in adapters.items():
        pool.add_adapter_weights(name, layers)
    adapters["other_layer"][LAYER] = ReferenceLoRA()

    names = [*adapters, None]
    lens = [2, 3, 2, 2, 2, 2, 1]
    m = sum(lens)
    x = torch.randn(m, H).to(dtype)
    w13, w2 = make_base(E, H, INTER, dtype)
    topk_weights, topk_ids = make_routing(m, E, 2)
    out, ref, base = run_and_check(
        pool,
        adapters,
        names,
        lens,
        x,
        w13,
        w2,
        topk_weights,
        topk_ids,
        path=path,
        tol=TOL[dtype],
        check_visible=False,
    )

    _, per_token = token_adapters(names, lens, adapters)
    order = sorted(n for n in names if n is not None)
    slots = torch.tensor(per_token)
    for name in order:
        rows = slots == order.index(name)
        rel = ((ref[rows] - base[rows]).norm() / base[rows].norm()).item()
        if name == "other_layer":
            assert rel == 0.0
        else:
            assert rel >= 0.05, f"adapter {name} changes the reference by only {rel:.3g}"


# ----------------------------------------------------------------- rsf and weight on the input


@pytest.mark.parametrize("path", [*ALL_PATHS, pytest.param("auto", marks=interpreter)])
@pytest.mark.parametrize(
    "rsf, top_k, on_input",
    [(2.5, 2, False), (1.0, 1, True), (2.5, 1, True)],  # DeepSeek-V3's rsf; top-1 models (Llama-4 style)
    ids=["rsf2.5-k2", "on_input-k1", "rsf2.5-on_input-k1"],
)
def test_routed_scaling_and_weight_on_input(path, rsf, top_k, on_input):
    dtype = F32
    pool, adapters = load_mixed(dtype)
    m = sum(MIXED_LENS)
    x = torch.randn(m, H)
    w13, w2 = make_base(E, H, INTER, dtype)
    topk_weights, topk_ids = make_routing(m, E, top_k)
    if top_k == 1:
        # Routing weights far from 1, so applying the weight on the input (before the SiLU) differs from
        # applying it on the output.
        topk_weights = torch.rand(m, 1) * 0.7 + 0.2
    run_and_check(
        pool,
        adapters,
        MIXED_NAMES,
        MIXED_LENS,
        x,
        w13,
        w2,
        topk_weights,
        topk_ids,
        path=path,
        tol=TOL[dtype],
        rsf=rsf,
        on_input=on_input,
    )


# ---------------------------------------------------------------------------- per-slot rank cost


# 16: the rank-4 adapter is zero-padded up to the pool's rank; 64: the rank tile of the batch (16) is
# smaller than the pool's rank.
@pytest.mark.parametrize("pool_rank", [16, 64])
@interpreter
def test_rank_tile_follows_batch_not_pool(pool_rank, monkeypatch):
    dtype = F32
    pool = make_pool(dtype, max_loras=3, max_rank=pool_rank)
    adapters = {"r4": make_adapter(4, 2.0, dtype), "r16": make_adapter(16, 1.0, dtype)}
    for name, layers in adapters.items():
        pool.add_adapter_weights(name, layers)

    fe = importlib.import_module("triton_ops.fused_experts")
    tiles = []
    real_rank_block = fe.lora_rank_block
    monkeypatch.setattr(fe, "lora_rank_block", lambda r: tiles.append(real_rank_block(r)) or tiles[-1])

    names, lens = ["r4", None, "r4"], [3, 2, 4]
    m = sum(lens)
    x = torch.randn(m, H)
    w13, w2 = make_base(E, H, INTER, dtype)
    topk_weights, topk_ids = make_routing(m, E, 2)
    batch = pool.prepare_batch(names, lens)
    assert batch.max_rank == 4  # the real rank of the one slot in use, not the pool's 16/64 nor "r16"'s
    outs = {}
    for path in ("fused", "split", "staged"):
        outs[path], _, _ = run_and_check(
            pool, adapters, names, lens, x, w13, w2, topk_weights, topk_ids, path=path, tol=TOL[dtype]
        )
    # The batch's rank tile (rank 4 -> 16), not the pool's 64: the layer plans for the tile (its launches
    # are the same for every batch of that tile).
    assert tiles and set(tiles) == {16}, f"rank tiles {tiles}, expected the batch's 16"
    assert_matches(outs["fused"], outs["staged"], 1e-5, "fused vs staged")

    tiles.clear()
    names = ["r4", "r16", None]
    assert pool.prepare_batch(names, lens).max_rank == 16
    run_and_check(
        pool, adapters, names, lens, x, w13, w2, topk_weights, topk_ids, path="staged", tol=TOL[dtype]
    )
    assert set(tiles) == {16}


# ------------------------------------------------------------------------------------------ errors


def test_errors_are_clear(monkeypatch):
    dtype = F32
    pool, _ = load_mixed(dtype)
    w13, w2 = make_base(E, H, INTER, dtype)
    x = torch.randn(5, H)
    topk_weights, topk_ids = make_routing(5, E, 2)

    # A batch prepared for 6 tokens, x has 5: no path may silently read past token_slots.
    batch6 = pool.prepare_batch(["a", None], [4, 2])
    for path in ("fused", "staged", "torch", "auto"):
        layer = FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=LAYER, path=path)
        with pytest.raises(ValueError, match="6 tokens"):
            layer(x, topk_weights, topk_ids, batch6)

    with pytest.raises(ValueError, match="w13"):
        FusedMoEWithLoRA(make_base(E, H, INTER + 8, dtype)[0], w2, pool=pool, layer_id=LAYER)
    with pytest.raises(ValueError, match="w13"):
        FusedMoEWithLoRA(make_base(E + 1, H, INTER, dtype)[0], w2, pool=pool, layer_id=LAYER)
    with pytest.raises(ValueError, match="w2"):
        FusedMoEWithLoRA(w13, w2.transpose(1, 2), pool=pool, layer_id=LAYER)
    with pytest.raises(TypeError, match="dtype"):
        FusedMoEWithLoRA(w13.half(), w2.half(), pool=pool, layer_id=LAYER)
    with pytest.raises(ValueError, match="layer 2"):
        FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=2)
    with pytest.raises(ValueError, match="path"):
        FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=LAYER, path="triton")

    # CPU tensors without the interpreter: a forced Triton path is refused before any launch, "auto"
    # falls back to the torch path. (The check reads TRITON_INTERPRET at call time; kernels already
    # imported are not re-created, and none is launched here.)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    batch5 = pool.prepare_batch(["a", None], [3, 2])
    for path in ("fused", "split", "staged"):
        layer = FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=LAYER, path=path)
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            layer(x, topk_weights, topk_ids, batch5)
    auto = FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=LAYER, path="auto")
    forced = FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=LAYER, path="torch")
    assert torch.equal(auto(x, topk_weights, topk_ids, batch5), forced(x, topk_weights, topk_ids, batch5))


# --------------------------------------------------------------------------------------------- GPU

# DeepSeek-V2-Lite MoE layer: 64 routed experts, top-6, hidden 2048, expert intermediate 1408.
DSV2_E, DSV2_K, DSV2_H, DSV2_I = 64, 6, 2048, 1408
GPU_ADAPTERS = ("a0", "a1", "a2", "a3")


@pytest.fixture
def fp32_highest():
    """The fp32 oracle must not use TF32."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(old)


@pytest.fixture(scope="module")
def dsv2():
    """Lazily built, per max_rank: (bf16 pool, fp32 pool with the same adapters, bf16 w13/w2, fp32 copies).

    The adapters are rounded to bf16 before loading, so both pools hold the same numbers and the fp32
    torch path on the fp32 pool is the exact math of the bf16 buffers. Every entry shares one set of base
    weights (3.3 GB with the fp32 copies): one copy per entry ran parallel GPU shards out of memory."""
    cache = {}
    base = []

    def get(max_rank, ranks=(16, 16, 16, 16)):
        if not base:
            torch.manual_seed(1234)
            w13, w2 = make_base(DSV2_E, DSV2_H, DSV2_I, BF16, device="cuda")
            base.extend((w13, w2, w13.float(), w2.float()))
        if (max_rank, ranks) not in cache:
            gen = torch.Generator().manual_seed(1234)
            pools = {}
            for dtype in (BF16, F32):
                pools[dtype] = make_pool(
                    dtype,
                    max_loras=5,
                    max_rank=max_rank,
                    num_experts=DSV2_E,
                    hidden=DSV2_H,
                    inter=DSV2_I,
                    layer_ids=(LAYER,),
                    device="cuda",
                )
            adapters = {}
            for i, (name, rank) in enumerate(zip(GPU_ADAPTERS, ranks, strict=True)):
                torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
                adapters[name] = make_adapter(
                    rank, 0.5 * (i + 1), BF16, layers=(LAYER,), num_experts=DSV2_E, hidden=DSV2_H,
                    inter=DSV2_I,
                )
                for pool in pools.values():
                    pool.add_adapter_weights(name, adapters[name])
            cache[max_rank, ranks] = (pools[BF16], pools[F32], adapters, *base)
        return cache[max_rank, ranks]

    yield get
    cache.clear()
    base.clear()
    torch.cuda.empty_cache()


def split_batch(m, names):
    """Sequences over ``m`` tokens cycling through ``names``: as even as possible, at most len(names)."""
    n = min(m, len(names))
    lens = [m // n + (i < m % n) for i in range(n)]
    return list(names[:n]), lens


def torch_oracle(pool32, w13_32, w2_32, x, topk_weights, topk_ids, names, lens, **kw):
    layer = FusedMoEWithLoRA(w13_32, w2_32, pool=pool32, layer_id=LAYER, path="torch", **kw)
    return layer(x.float(), topk_weights, topk_ids, pool32.prepare_batch(names, lens))


def force_layer_config(monkeypatch, config):
    """Every layer call in the test runs ``config``'s tiles, whatever M. The package re-exports
    ``fused_experts`` under the module's name: patch the module itself."""
    fused_experts_module = importlib.import_module("triton_ops.fused_experts")
    monkeypatch.setattr(fused_experts_module, "get_moe_config", lambda *args, **kwargs: config)


def check_bf16_layer_against_oracle(dsv2, m, path, label, max_rank=16, ranks=(16, 16, 16, 16)):
    """The bf16 layer on DeepSeek-V2-Lite shapes, m tokens in sequences over the 4 GPU adapters (of
    ``ranks``) and one without an adapter, against the fp32 torch oracle on the same adapters: finite,
    rel L2 within TOL[BF16]. Returns the batch it ran."""
    pool, pool32, _, w13, w2, w13_32, w2_32 = dsv2(max_rank, ranks)
    x = torch.randn(m, DSV2_H, device="cuda").to(BF16)
    topk_weights, topk_ids = make_routing(m, DSV2_E, DSV2_K, device="cuda")
    names, lens = split_batch(m, [*GPU_ADAPTERS, None])
    batch = pool.prepare_batch(names, lens)
    layer = FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=LAYER, path=path)
    out = layer(x, topk_weights, topk_ids, batch)
    ref = torch_oracle(pool32, w13_32, w2_32, x, topk_weights, topk_ids, names, lens)
    diff = (out.float() - ref).abs()
    rel_l2, rel_max = rel_errors(out, ref)
    print(f"\n{label}: max abs err {diff.max().item():.3e}, rel L2 {rel_l2:.3e}, rel max {rel_max:.3e}")
    assert torch.isfinite(out).all()
    assert rel_l2 <= TOL[BF16], f"rel L2 error {rel_l2:.3g} > {TOL[BF16]}"
    return batch


@gpu
@pytest.mark.parametrize("path", ["split", "fused", "staged", "base"])
# decode without alignment (M=1), the one-program alignment (16), and the three-launch one (300).
@pytest.mark.parametrize("m", [1, 16, 300])
def test_gpu_expert_ids_outside_range_contribute_nothing(dsv2, fp32_highest, path, m):
    """bf16 DeepSeek-V2-Lite shapes with -1, E and 10**6 among the ids: no NaN, no illegal access, and the
    result of the same routing without those pairs."""
    pool, pool32, _, w13, w2, w13_32, w2_32 = dsv2(16)
    x = torch.randn(m, DSV2_H, device="cuda").to(BF16)
    topk_weights, topk_ids = make_routing(m, DSV2_E, DSV2_K, device="cuda")
    bad_ids = with_out_of_range_ids(topk_ids, DSV2_E, seed=m)
    names, lens = split_batch(m, [*GPU_ADAPTERS, None]) if path != "base" else ([None], [m])
    layer = FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=LAYER, path="auto" if path == "base" else path)
    out = layer(x, topk_weights, bad_ids, pool.prepare_batch(names, lens))
    kept = topk_weights.masked_fill(bad_ids != topk_ids, 0.0)
    ref = torch_oracle(pool32, w13_32, w2_32, x, kept, topk_ids, names, lens)
    torch.cuda.synchronize()  # an illegal access surfaces here
    assert torch.isfinite(out).all()
    rel_l2, _ = rel_errors(out, ref)
    assert rel_l2 <= TOL[BF16], f"rel L2 error {rel_l2:.3g} > {TOL[BF16]}"


@gpu
def test_gpu_torch_path_oracle_matches_reference(dsv2, fp32_highest):
    """The fp32 torch path on the GPU is the oracle of the bf16 GPU tests: check it against reference_moe at
    the real shape (a few tokens, so the per-token loops of reference_moe stay cheap)."""
    _, pool32, adapters, _, _, w13_32, w2_32 = dsv2(16)
    names, lens = ["a2", None, "a0"], [2, 1, 2]
    m = sum(lens)
    x = torch.randn(m, DSV2_H, device="cuda").to(BF16)
    topk_weights, topk_ids = make_routing(m, DSV2_E, DSV2_K, device="cuda")
    kw = dict(routed_scaling_factor=2.5)
    out = torch_oracle(pool32, w13_32, w2_32, x, topk_weights, topk_ids, names, lens, **kw)
    loras, per_token = token_adapters(names, lens, adapters)
    ref = reference_moe(
        x, w13_32, w2_32, topk_weights, topk_ids, adapters=loras, token_adapter=per_token, **kw
    )
    base = reference_moe(x, w13_32, w2_32, topk_weights, topk_ids, **kw)
    assert_lora_visible(ref.cpu(), base.cpu(), per_token)
    rel_l2, rel_max = rel_errors(out.cpu(), ref.cpu())
    print(f"\ntorch fp32 GPU vs reference_moe: rel L2 {rel_l2:.2e}, rel max {rel_max:.2e}")
    assert_matches(out.cpu(), ref.cpu(), TOL[F32], "fp32 torch path on GPU")


@gpu
@pytest.mark.parametrize("path", ["split", "fused", "staged"])
@pytest.mark.parametrize("max_rank", [16, 64])  # 64: rank-16 adapters in a max-rank-64 pool (padded)
# decode (split: gate/up shrink in the alignment's launch, down shrink in GEMM1's epilogue), small batch
# (its own down shrink launch), 384 pairs of four adapters (split: a shrink program per slot of each
# block, ``slot_program_shrink``), prefill-sized (moe_lora_a with slot groups, stacked-slot epilogues).
@pytest.mark.parametrize("m", [1, 16, 64, 300])
def test_gpu_deepseek_v2_lite_bf16(dsv2, fp32_highest, path, max_rank, m):
    batch = check_bf16_layer_against_oracle(dsv2, m, path, f"{path} M={m} pool rank {max_rank}", max_rank)
    assert batch.max_rank == 16


@gpu
@pytest.mark.parametrize("prefetch", ["", "1"])
def test_gpu_split_small_tiles_many_adapters_prefetch(dsv2, fp32_highest, monkeypatch, prefetch):
    """16-row tiles past decode with four adapters (M=64: 384 routed pairs, blocks holding several slots)
    skip the epilogue prefetch by default ("1" keeps it, as before): both against the oracle."""
    from triton_ops.configs import GemmConfig, MoEConfig
    from triton_ops.fused_moe import lora_prefetch_pays

    small = MoEConfig(GemmConfig(16, 32, 128, 1, 4, 5), GemmConfig(16, 32, 128, 1, 4, 5))
    force_layer_config(monkeypatch, small)
    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_prefetch", prefetch)
    assert lora_prefetch_pays(small.gemm1, numel=384, num_adapters=4) is (prefetch == "1")
    label = f"split 16-row tiles x4 prefetch={prefetch or 'default'}"
    check_bf16_layer_against_oracle(dsv2, 64, "split", label)


@gpu
@pytest.mark.parametrize("ext, stages", [("", ""), ("1", ""), ("1", "3")])
def test_gpu_split_slot_range_expand(dsv2, fp32_highest, monkeypatch, ext, stages):
    """Tiles that hold two blocks an SM (DeepSeek-V2-Lite M=1024 on an H100): GEMM2 expands by the slot
    range from the packed shrink (``lora_ext_expand``; "1" forces GEMM1 too; ``lora_ext_stages`` pipelines
    the loop over the slots), bf16 against the oracle. M=300 x top-6 = 1800 pairs: the GEMMs overlap the
    shrinks through the pack launches on sm_90."""
    from triton_ops.configs import GemmConfig, MoEConfig
    from triton_ops.fused_moe import lora_ext_expand

    two_blocks = MoEConfig(GemmConfig(128, 64, 64, 8, 8, 3), GemmConfig(128, 128, 64, 8, 8, 3))
    force_layer_config(monkeypatch, two_blocks)
    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_ext", ext)
    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_ext_stages", stages)
    assert lora_ext_expand(two_blocks.gemm2, gated=False, num_adapters=4, K=DSV2_I)
    assert lora_ext_expand(two_blocks.gemm1, gated=True, num_adapters=4, K=DSV2_H) is (ext == "1")
    check_bf16_layer_against_oracle(dsv2, 300, "split",
                                    f"split slot-range expand ext={ext or 'rule'} stages={stages or 1}")


@gpu
@pytest.mark.parametrize("path", ["split", "fused", "staged"])
# 1: decode; 300: prefill-sized, several slots and rows without one per 128-row block.
@pytest.mark.parametrize("m", [1, 300])
# default: the tuned tiles (32-row at this size); big: 128x64 / 128x256 tiles, whose split epilogue goes
# 32 rank columns a dot at rank tile 64 (lora_rank_chunk), the second chunk past rank 40 and 3.
@pytest.mark.parametrize("tiles", ["default", "big"])
def test_gpu_deepseek_v2_lite_bf16_high_ranks(dsv2, fp32_highest, monkeypatch, path, m, tiles):
    """Adapters of ranks 64, 40, 16 and 3 in a max-rank-64 pool: rank tile 64, ranks that differ per slot
    and end inside a chunk."""
    from triton_ops.configs import GemmConfig, MoEConfig

    if tiles == "big":
        force_layer_config(monkeypatch, MoEConfig(GemmConfig(128, 64, 64, 8, 8, 3),
                                                  GemmConfig(128, 256, 64, 8, 8, 4)))
    label = f"{path} M={m} ranks 64/40/16/3 {tiles} tiles"
    batch = check_bf16_layer_against_oracle(dsv2, m, path, label, max_rank=64, ranks=(64, 40, 16, 3))
    assert batch.max_rank == 64  # a0, rank 64, is in every batch (m=1: the only sequence)


@gpu
@pytest.mark.parametrize("reduce", ["0", "1"])
def test_gpu_split_reduced_partials(dsv2, fp32_highest, monkeypatch, reduce):
    """The split path's shrink partials summed once by ``reduce_shrink_splits`` before the GEMMs read
    them, or by every GEMM tile (``lora_reduce_splits`` forced both ways), bf16 against the
    oracle. M=40 x top-6 = 240 pairs (past the decode launch) in 64 experts: few alignment blocks, so both
    shrinks split K; 4 rank-16 adapters plus a sequence without one. Four adapters would take a shrink
    program per slot, one partial a pair (``slot_program_shrink``), so that is switched off here, as is
    the one pass (off at 240 pairs anyway)."""
    from triton_ops import shrink_reduce

    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_reduce_splits", reduce)
    monkeypatch.setitem(LAUNCH_OVERRIDES, "slot_program_shrink", "0")
    monkeypatch.setitem(LAUNCH_OVERRIDES, "one_split_shrink", "0")
    fused_experts_module = importlib.import_module("triton_ops.fused_experts")
    splits_seen = []
    original = shrink_reduce.reduce_shrink_splits

    def counting(partials, *args, **kwargs):
        splits_seen.append(partials.shape[1])
        return original(partials, *args, **kwargs)

    monkeypatch.setattr(fused_experts_module, "reduce_shrink_splits", counting)
    check_bf16_layer_against_oracle(dsv2, 40, "split", f"split reduced partials={reduce}")
    assert len(splits_seen) == (2 if reduce == "1" else 0) and all(s > 1 for s in splits_seen)


@gpu
@pytest.mark.parametrize("path", ["split", "fused", "staged"])
def test_gpu_cuda_graph_replay_with_new_mapping(fp32_highest, path):
    dtype, m = BF16, 8
    # DeepSeek-V2-Lite shapes, ranks 4/8/32 and a late-loaded rank 8 in a max-rank-64 pool.
    pool, pool32 = (
        make_pool(pool_dtype, max_loras=4, max_rank=64, num_experts=DSV2_E, hidden=DSV2_H, inter=DSV2_I,
                  layer_ids=(LAYER,), device="cuda")
        for pool_dtype in (dtype, F32)
    )
    dims = dict(layers=(LAYER,), num_experts=DSV2_E, hidden=DSV2_H, inter=DSV2_I)
    adapters = {
        "r4": make_adapter(4, 2.0, dtype, **dims),
        "r8": make_adapter(8, 1.0, dtype, **dims),
        "r32": make_adapter(32, 0.5, dtype, **dims),
    }
    for name, layers in adapters.items():
        pool.add_adapter_weights(name, layers)
        pool32.add_adapter_weights(name, layers)
    w13, w2 = make_base(DSV2_E, DSV2_H, DSV2_I, dtype, device="cuda")
    w13_32, w2_32 = w13.float(), w2.float()
    layer = FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=LAYER, path=path)

    def inputs():
        x = torch.randn(m, DSV2_H, device="cuda").to(dtype)
        return (x, *make_routing(m, DSV2_E, DSV2_K, device="cuda"))

    # Capture with the largest-rank adapter in the batch: batch.max_rank sets the rank tile at capture.
    lens = [3, 2, 3]
    static_x, static_w, static_ids = inputs()
    batch = pool.prepare_batch(["r32", None, "r4"], lens)
    assert batch.max_rank == 32
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compiles the kernels and warms the allocator outside the capture
            layer(static_x, static_w, static_ids, batch)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_x, static_w, static_ids, batch)
    slots_ptr = batch.token_slots.data_ptr()

    # Replays: a new mapping with the largest-rank adapter moved; one with an adapter hot-loaded after the
    # capture into a free slot (the graph holds the pool's buffers and slot tables); no adapter at all.
    replays = [(["r4", "r32", "r8"], lens), (["late", None, "r8", "r4"], [2, 2, 1, 3]), ([None], [m])]
    late = make_adapter(8, 1.5, dtype, **dims)
    pool.add_adapter_weights("late", late)
    pool32.add_adapter_weights("late", late)
    for names, seq_lens in replays:
        x, w, ids = inputs()
        static_x.copy_(x)
        static_w.copy_(w)
        static_ids.copy_(ids)
        pool.prepare_batch(names, seq_lens, out=batch)
        assert batch.token_slots.data_ptr() == slots_ptr
        graph.replay()
        torch.cuda.synchronize()
        eager = layer(x, w, ids, pool.prepare_batch(names, seq_lens))
        ref = torch_oracle(pool32, w13_32, w2_32, x, w, ids, names, seq_lens)
        rel_eager, _ = rel_errors(static_out, eager)
        rel_ref, _ = rel_errors(static_out, ref)
        print(f"\n{path} graph replay {names}: rel L2 vs eager {rel_eager:.2e}, vs fp32 oracle {rel_ref:.2e}")
        # With no adapter at all, eager runs the base path; the graph still runs the LoRA kernels, which
        # add nothing for slot -1 rows, so the two agree as tightly as with adapters.
        tol_eager = 1e-3
        assert rel_eager <= tol_eager, f"graph replay differs from eager by {rel_eager:.3g} for {names}"
        assert rel_ref <= TOL[BF16], f"graph replay differs from the fp32 oracle by {rel_ref:.3g} for {names}"


def test_from_base_shares_the_module_weights():
    """An engine's fused-MoE module (SGLang/vLLM ``w13_weight``/``w2_weight``, or transformers 5's
    ``gate_up_proj``/``down_proj``) is wrapped without copying its expert weights."""
    pool, _ = load_mixed(F32)
    w13, w2 = make_base(E, H, INTER, F32)
    for names in (("w13_weight", "w2_weight"), ("gate_up_proj", "down_proj")):
        base = torch.nn.Module()
        setattr(base, names[0], torch.nn.Parameter(w13, requires_grad=False))
        setattr(base, names[1], torch.nn.Parameter(w2, requires_grad=False))
        layer = FusedMoEWithLoRA.from_base(base, pool=pool, layer_id=LAYER, path="torch")
        assert layer.w13.data_ptr() == w13.data_ptr() and layer.w2.data_ptr() == w2.data_ptr()
    with pytest.raises(TypeError, match="no \\(w13_weight, w2_weight\\)"):
        FusedMoEWithLoRA.from_base(torch.nn.Linear(2, 2), pool=pool, layer_id=LAYER)


def test_auto_path_rule():
    # "auto" runs split on the Triton side, decode included (its gate/up shrink rides in the alignment's
    # launch), except for prefill steps of dozens of adapters; the rules see launch_adapter_count's count.
    from triton_ops.plan import auto_lora_path

    few = ((1, 64), (1023, 64), (4096, 32), (4096, 1))
    assert [auto_lora_path(rows, n) for rows, n in few] == ["split"] * 4
    assert auto_lora_path(1024, 64) == auto_lora_path(8192, 64) == "staged"


@interpreter
def test_auto_path_takes_the_batch_into_account(monkeypatch):
    """The layer resolves "auto" per batch (host facts: its tokens and adapters): with the staged rule's
    bounds lowered to this batch, a batch of three adapters runs the staged path and gives what path="staged"
    gives, bit for bit; a batch of one adapter stays split."""
    from triton_ops import plan

    monkeypatch.setattr(plan, "AUTO_STAGED_MIN_ROWS", 8)
    monkeypatch.setattr(plan, "AUTO_STAGED_MIN_ADAPTERS", 3)
    pool, _ = load_mixed(F32)
    m = sum(MIXED_LENS)
    x = torch.randn(m, H)
    w13, w2 = make_base(E, H, INTER, F32)
    topk_weights, topk_ids = make_routing(m, E, 2)
    batch = pool.prepare_batch(MIXED_NAMES, MIXED_LENS)
    one = pool.prepare_batch(["a"], [m])
    outs = {}
    for path in ("auto", "staged", "split"):
        layer = FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=LAYER, path=path)
        outs[path] = layer(x, topk_weights, topk_ids, batch)
        if path == "auto":
            assert layer.resolve_path(x, batch) == "staged"
            assert layer.resolve_path(x, one) == "split"
    assert torch.equal(outs["auto"], outs["staged"])
    assert not torch.equal(outs["auto"], outs["split"])  # another rounding order: the paths do differ
