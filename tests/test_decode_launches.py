"""Decode launches: one token's GEMMs without the alignment (``decode_direct_pairs``) and its top-k sum at
the end of GEMM2 (``fused_topk_sum``).

Both only change which launches run, never the arithmetic: every output must be bit for bit the one of
the four-launch path (alignment, GEMM1, GEMM2, top-k sum), which the switches ``decode_direct=0``
and ``fused_sum=0`` bring back, and within tolerance of the fp32 oracle. Spies on the alignment and
sum launches check that each mode really runs (or skips) them, so a comparison of two identical
launch sequences cannot pass for one of the modes.

CPU tests run the kernels in the Triton interpreter (fp32/fp16, tiny odd shapes); the ``gpu`` tests run
bf16 at model shapes, eager and replayed from CUDA graphs (the arrival counters are zeroed by GEMM1 on
every replay, so a second replay with new routing must still be exact). Their fp32 oracle is
``reference_moe_grouped`` on the GPU (``reference_moe``'s math a group of pairs at a time, checked against it
in tests/test_reference.py): ``reference_moe``'s per-pair CPU loop took most of a GPU test's time at model
shapes.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import replace

import pytest
import torch

from moelora.bench import warm_up_on_side_stream
from moelora.reference import LoRAProjection, ReferenceLoRA, reference_moe, reference_moe_grouped
from triton_ops.configs import GemmConfig, get_moe_config
from triton_ops.fused_moe import TopkSumOperands, invoke_fused_moe_kernel
from triton_ops.lora_epilogues import LORA_SLOT_RANGE
from triton_ops.moe_align import moe_align_block_size
from triton_ops.moe_lora import moe_lora_a
from triton_ops.overrides import LAUNCH_OVERRIDES
from triton_ops.shrink_reduce import pack_shrink_partials, reduce_shrink_splits

# The module, not the function of the same name that triton_ops re-exports.
fe = importlib.import_module("triton_ops.fused_experts")

interpreter = pytest.mark.interpreter
gpu = pytest.mark.gpu

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPE_IDS = {F32: "fp32", F16: "fp16", BF16: "bf16"}
TOL = {F32: 1e-4, F16: 1e-2, BF16: 1e-2}
SWITCHES = ("decode_direct", "fused_sum")
MODES = [("1", "1"), ("1", "0"), ("0", "1"), ("0", "0")]  # (direct, fused sum); ("0", "0") = four launches


def make_inputs(m, num_experts, top_k, hidden, inter, dtype, device="cpu", seed=0):
    gen = torch.Generator(device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    x = randn(m, hidden).to(dtype)
    w13 = (randn(num_experts, 2 * inter, hidden) / math.sqrt(hidden)).to(dtype)
    w2 = (randn(num_experts, hidden, inter) / math.sqrt(inter)).to(dtype)
    logits = randn(m, num_experts)
    weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    weights = (weights / weights.sum(-1, keepdim=True)).contiguous()
    return x, w13, w2, weights, ids.to(torch.int32).contiguous()


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


class LaunchSpy:
    """Counts the alignment and top-k sum launches ``fused_experts`` makes (wrapping its module names)."""

    def __init__(self, monkeypatch):
        self.calls = {"align": 0, "align+shrink": 0, "shrink only": 0, "sum": 0, "down shrink": 0,
                      "down gemv": 0}

        def count(attr, key_of_call):
            original = getattr(fe, attr)

            def counted(*args, **kwargs):
                self.calls[key_of_call(kwargs)] += 1
                return original(*args, **kwargs)

            monkeypatch.setattr(fe, attr, counted)

        count("moe_align_block_size", lambda kwargs: "align")
        count("moe_align_with_gate_up_shrink",
              lambda kwargs: "align+shrink" if kwargs.get("align", True) else "shrink only")
        count("moe_sum_reduce", lambda kwargs: "sum")
        count("moe_lora_a", lambda kwargs: "down shrink")
        count("one_token_down_shrink", lambda kwargs: "down gemv")

    def take(self):
        calls, self.calls = self.calls, dict.fromkeys(self.calls, 0)
        return calls


def run_modes(monkeypatch, fn):
    """fn() under each (direct, fused sum) mode: {mode: (output, launch counts)}."""
    spy = LaunchSpy(monkeypatch)
    results = {}
    for direct, fused in MODES:
        monkeypatch.setitem(LAUNCH_OVERRIDES, "decode_direct", direct)
        monkeypatch.setitem(LAUNCH_OVERRIDES, "fused_sum", fused)
        out = fn()
        results[(direct, fused)] = (out.clone(), spy.take())
    return results


def expected_launches(m, top_k, *, lora=False, down_launch=False):
    """Alignment, sum and down-shrink launches of each mode at a decode size (<= 128 pairs). With
    ``down_launch`` (the down shrink does not fit GEMM1's epilogue) it is a launch of its own: for one
    token a GEMV on the routed pairs ("down gemv"), else one that walks the aligned blocks."""
    expected = {}
    for direct, fused in MODES:
        is_direct = direct == "1" and m == 1
        calls = {"align": 0, "align+shrink": 0, "shrink only": 0, "sum": 0,
                 "down shrink": int(down_launch and not is_direct),
                 "down gemv": int(down_launch and is_direct)}
        if lora:
            calls["shrink only" if is_direct else "align+shrink"] = 1
        elif not is_direct:
            calls["align"] = 1
        calls["sum"] = int(top_k > 1 and not (fused == "1" and m == 1))
        expected[(direct, fused)] = calls
    return expected


# ------------------------------------------------------------------------------------ base, interpreter


@pytest.mark.parametrize("dtype", [F32, F16], ids=DTYPE_IDS.get)
# M=1: no alignment and the sum in GEMM2; 3: an odd few tokens (pairs may share an expert: the switches
# change nothing); 21 x top-6 = 126 pairs, the largest decode batch under 128 at this top-k. top-k 1
# (GEMM2 writes the output: no sum), 2, 6, 8; E=10 is not a power of two and, at M=1 and top-k < 8,
# leaves experts no token picks.
@pytest.mark.parametrize("m", [1, 3, 21])
@pytest.mark.parametrize("top_k", [1, 2, 6, 8])
@interpreter
def test_base_decode_modes_bit_equal(monkeypatch, dtype, m, top_k):
    if m == 21 and top_k == 8:
        m = 16  # 128 pairs: still decode
    x, w13, w2, weights, ids = make_inputs(m, 10, top_k, 48, 40, dtype, seed=m * 10 + top_k)
    results = run_modes(monkeypatch, lambda: fe.fused_experts(x, w13, w2, weights, ids))
    reference = results[("0", "0")][0]
    ref = reference_moe(x, w13, w2, weights, ids)
    assert rel_err(reference, ref) <= TOL[dtype]
    for mode, (out, calls) in results.items():
        assert calls == expected_launches(m, top_k)[mode], f"mode {mode}: launches {calls}"
        assert torch.equal(out, reference), f"mode {mode} differs from the four-launch path"


@pytest.mark.parametrize("top_k", [2, 6])
@interpreter
def test_fused_sum_writes_every_output_inplace(monkeypatch, top_k):
    # inplace: the output buffer starts as x itself, so an output the fused sum failed to write keeps x's
    # value and differs from the four-launch result (a fresh torch.empty could reuse memory that holds it).
    m = 1
    x, w13, w2, weights, ids = make_inputs(m, 10, top_k, 40, 24, F32, seed=3)
    monkeypatch.setitem(LAUNCH_OVERRIDES, "fused_sum", "0")
    expected = fe.fused_experts(x.clone(), w13, w2, weights, ids)
    monkeypatch.setitem(LAUNCH_OVERRIDES, "fused_sum", "1")
    target = x.clone()
    out = fe.fused_experts(target, w13, w2, weights, ids, inplace=True)
    assert out.data_ptr() == target.data_ptr()
    assert torch.equal(out, expected)


@interpreter
def test_prefill_keeps_alignment_and_sum_launches(monkeypatch):
    # 22 tokens x top-6 = 132 pairs: past the decode size, so both launches stay whatever the switches say.
    x, w13, w2, weights, ids = make_inputs(22, 10, 6, 40, 24, F32, seed=5)
    results = run_modes(monkeypatch, lambda: fe.fused_experts(x, w13, w2, weights, ids))
    for mode, (out, calls) in results.items():
        assert calls == {"align": 1, "align+shrink": 0, "shrink only": 0, "sum": 1, "down shrink": 0,
                         "down gemv": 0}, mode
        assert torch.equal(out, results[("0", "0")][0])


@interpreter
def test_counters_are_zeroed_by_gemm1(monkeypatch):
    # The counters come from torch.empty: GEMM1 must zero whatever they hold before GEMM2 counts on them.
    m, top_k, hidden, inter = 3, 2, 40, 24
    x, w13, w2, weights, ids = make_inputs(m, 10, top_k, hidden, inter, F32, seed=11)
    monkeypatch.setitem(LAUNCH_OVERRIDES, "fused_sum", "0")
    expected = fe.fused_experts(x, w13, w2, weights, ids)
    sorted_ids, expert_ids, num_post_padded = fe.moe_align_block_size(ids, 16, 10)
    align = dict(sorted_ids=sorted_ids, expert_ids=expert_ids, num_post_padded=num_post_padded)
    cfg = GemmConfig(block_m=16, block_n=16, block_k=32)
    n_tiles = math.ceil(hidden / cfg.block_n)
    topk_sum = TopkSumOperands(out=torch.full((m, hidden), float("nan")),
                               counters=torch.full((n_tiles,), 123, dtype=torch.int32), top_k=top_k)
    activated = torch.empty(m * top_k, inter)
    pair_out = torch.empty(m * top_k, hidden)
    invoke_fused_moe_kernel(x, w13, activated, topk_weights=None, a_row_div=top_k, config=cfg,
                            activation="silu", zero_counters=topk_sum, **align)
    assert torch.equal(topk_sum.counters, torch.zeros(n_tiles, dtype=torch.int32))
    invoke_fused_moe_kernel(activated, w2, pair_out, topk_weights=weights.reshape(-1), a_row_div=1,
                            config=cfg, topk_sum=topk_sum, **align)
    blocks = int(num_post_padded.item()) // cfg.block_m
    assert torch.equal(topk_sum.counters, torch.full((n_tiles,), blocks, dtype=torch.int32))
    torch.testing.assert_close(topk_sum.out, expected, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------ LoRA, interpreter


def lora_inputs(m, num_experts, hidden, inter, dtype, *, ranks=(8, 16), pool_rank=16, slots_per_token=None,
                seed=0, device="cpu"):
    """Pool buffers with adapters of different ranks in slots 0, 2, 3, ... (slot 1 idle; two adapters by
    default) and the oracle's view (fp32, on ``device`` too)."""
    gen = torch.Generator(device).manual_seed(seed)
    adapter_slots = (0, *range(2, len(ranks) + 1))
    num_slots = len(ranks) + 1
    gate_up_a = torch.zeros(num_slots, num_experts, 2 * pool_rank, hidden, device=device)
    gate_up_b = torch.zeros(num_slots, num_experts, 2 * inter, pool_rank, device=device)
    down_a = torch.zeros(num_slots, num_experts, pool_rank, inter, device=device)
    down_b = torch.zeros(num_slots, num_experts, hidden, pool_rank, device=device)
    adapters = []
    for slot, rank in zip(adapter_slots, ranks, strict=True):
        def proj(n_in, n_out, rank=rank):
            a = torch.randn(rank, n_in, generator=gen, device=device) / math.sqrt(n_in)
            b = torch.randn(n_out, rank, generator=gen, device=device) / math.sqrt(rank)
            return LoRAProjection(a, b, 1.5)
        lora = ReferenceLoRA(gate={}, up={}, down={})
        for e in range(num_experts):
            lora.gate[e], lora.up[e] = proj(hidden, inter), proj(hidden, inter)
            lora.down[e] = proj(inter, hidden)
            gate_up_a[slot, e, :rank] = lora.gate[e].a
            gate_up_a[slot, e, pool_rank:pool_rank + rank] = lora.up[e].a
            gate_up_b[slot, e, :inter, :rank] = lora.gate[e].b
            gate_up_b[slot, e, inter:, :rank] = lora.up[e].b
            down_a[slot, e, :rank] = lora.down[e].a
            down_b[slot, e, :, :rank] = lora.down[e].b
        adapters.append(lora)
    # Tokens cycle through slot 0, no adapter, then the other adapters' slots (the first token has one).
    cycle = (0, -1, *adapter_slots[1:])
    slots = ([cycle[t % len(cycle)] for t in range(m)] if slots_per_token is None
             else list(slots_per_token))
    inputs = fe.MoELoRAInputs(
        token_slots=torch.tensor(slots, dtype=torch.int32, device=device),
        gate_up_a=gate_up_a.to(dtype), gate_up_b=gate_up_b.to(dtype), down_a=down_a.to(dtype),
        down_b=down_b.to(dtype),
        slot_ranks=torch.tensor([ranks[0], 0, *ranks[1:]], dtype=torch.int32, device=device),
        slot_scalings=torch.full((num_slots,), 1.5, device=device),
        max_rank=max(rank for slot, rank in zip(adapter_slots, ranks, strict=True) if slot in slots),
        num_adapters=len({s for s in slots if s >= 0}),
    )
    adapter_of_slot = {slot: index for index, slot in enumerate(adapter_slots)} | {-1: -1}
    per_token = [adapter_of_slot[s] for s in slots]
    return inputs, adapters, per_token


@pytest.mark.parametrize("dtype", [F32, F16], ids=DTYPE_IDS.get)
# M=1: the shrink launch without the alignment; M=7 with top-6 (42 pairs): aligned decode, fused sum.
@pytest.mark.parametrize("m", [1, 7])
@pytest.mark.parametrize("top_k", [2, 6])
@interpreter
def test_lora_split_decode_modes_bit_equal(monkeypatch, dtype, m, top_k):
    num_experts, hidden, inter = 9, 48, 40
    x, w13, w2, weights, ids = make_inputs(m, num_experts, top_k, hidden, inter, dtype, seed=m + top_k)
    lora, adapters, per_token = lora_inputs(m, num_experts, hidden, inter, dtype, seed=m)
    results = run_modes(monkeypatch, lambda: fe.fused_experts(x, w13, w2, weights, ids, lora=lora,
                                                              lora_path="split"))
    reference = results[("0", "0")][0]
    ref = reference_moe(x.float(), w13.float(), w2.float(), weights, ids, adapters=adapters,
                        token_adapter=per_token)
    base = reference_moe(x.float(), w13.float(), w2.float(), weights, ids)
    assert rel_err(ref, base) > 0.1, "the adapters must change the output, or the check is vacuous"
    assert rel_err(reference, ref) <= TOL[dtype]
    down_launch = results[("0", "0")][1]["down shrink"] == 1
    for mode, (out, calls) in results.items():
        expected = expected_launches(m, top_k, lora=True, down_launch=down_launch)[mode]
        assert calls == expected, f"mode {mode}: launches {calls}"
        assert torch.equal(out, reference), f"mode {mode} differs from the four-launch path"


# One token, a rank-64 adapter, I in 32-column GEMM1 tiles. I=500: 16 x 64 partial columns, at the
# few-pair limit (MAX_DECODE_DOWN_PARTIALS, 64 x 16), so GEMM1 writes the down shrink (Qwen3-30B rank 64
# at M=1: 12 tiles). I=520: 17 x 64 columns, one tile past it, so the down shrink is a GEMV launch of its
# own on the routed pairs (DeepSeek-V2-Lite rank 64 at M=1: 22 tiles; Mixtral-8x7B: 448). Neither needs
# the alignment.
@pytest.mark.parametrize(("inter", "expected_calls"), [
    (500, {"align": 0, "align+shrink": 0, "shrink only": 1, "sum": 0, "down shrink": 0, "down gemv": 0}),
    (520, {"align": 0, "align+shrink": 0, "shrink only": 1, "sum": 0, "down shrink": 0, "down gemv": 1}),
], ids=["in-gemm1", "own-launch"])
@pytest.mark.parametrize("top_k", [1, 2, 6])
@interpreter
def test_one_token_rank_64_down_shrink_placement(monkeypatch, inter, expected_calls, top_k):
    num_experts, hidden = 9, 48
    x, w13, w2, weights, ids = make_inputs(1, num_experts, top_k, hidden, inter, F32, seed=2)
    lora, adapters, per_token = lora_inputs(1, num_experts, hidden, inter, F32, ranks=(40, 64), pool_rank=64,
                                            slots_per_token=[2])
    spy = LaunchSpy(monkeypatch)
    out = fe.fused_experts(x, w13, w2, weights, ids, lora=lora, lora_path="split")
    calls = spy.take()
    assert calls == expected_calls, calls
    ref = reference_moe(x, w13, w2, weights, ids, adapters=adapters, token_adapter=per_token)
    assert rel_err(out, ref) <= TOL[F32]


def test_one_token_shrink_splits_rule(monkeypatch):
    """Fewer K splits only where GEMM1 leaves idle SMs for at least four programs a pair but not for the
    usual count; no GPU (0 SMs) keeps the usual; the switch keeps it too, and a bad value is refused."""
    monkeypatch.delitem(LAUNCH_OVERRIDES, "one_token_shrink_fit", raising=False)
    rule = fe.one_token_shrink_splits
    assert rule(8, 8, 96, 132) == 4  # Qwen3-30B-A3B M=1: 12 GEMM1 tiles a pair leave 36 SMs for 8 pairs
    assert rule(6, 8, 132, 132) == 8  # DeepSeek-V2-Lite: GEMM1 on every SM
    assert rule(8, 8, 256, 132) == 8  # DeepSeek-V3: more GEMM1 programs than SMs
    assert rule(8, 8, 110, 132) == 8  # 22 idle SMs: two a pair, under the floor
    assert rule(2, 8, 4, 132) == 8  # room for the usual 8 and more
    assert rule(3, 8, 2, 19) == 5  # prime SM count, odd pairs: 17 idle // 3
    assert rule(8, 8, 96, 0) == 8  # CPU
    monkeypatch.setitem(LAUNCH_OVERRIDES, "one_token_shrink_fit", "0")
    assert rule(8, 8, 96, 132) == 8
    monkeypatch.setitem(LAUNCH_OVERRIDES, "one_token_shrink_fit", "yes")
    with pytest.raises(ValueError, match="one_token_shrink_fit"):
        rule(8, 8, 96, 132)


@pytest.mark.parametrize("dtype", [F32, F16], ids=DTYPE_IDS.get)
# Top-k 2 and 6 (E=9: experts no pair picks). H=456 (fp32, K tile 64) and H=1000 (fp16, K tile 128): 8 K
# tiles, so the usual 8 splits, and 5 a pair leave the last split empty (it must write zeros).
@pytest.mark.parametrize("top_k", [2, 6])
@interpreter
def test_one_token_fewer_shrink_splits_match_oracle(monkeypatch, dtype, top_k):
    """One token's gate/up shrink cut to the splits that fit the SMs GEMM1 leaves idle (five a pair here,
    through a pretended SM count) still gives the oracle's output, with or without the alignment, and
    the same bits both ways (the alignment's path takes the same splits)."""
    num_experts, inter = 9, 40
    hidden = 456 if dtype == F32 else 1000
    x, w13, w2, weights, ids = make_inputs(1, num_experts, top_k, hidden, inter, dtype, seed=top_k)
    lora, adapters, per_token = lora_inputs(1, num_experts, hidden, inter, dtype, seed=top_k)
    cfg = get_moe_config(1, num_experts, hidden, inter, top_k, dtype, x.device, lora=True)
    gemm1_programs = top_k * math.ceil(inter / cfg.gemm1.block_n)
    monkeypatch.setattr(fe, "sm_count", lambda device: gemm1_programs + 5 * top_k)
    splits = []
    shrink = fe.moe_align_with_gate_up_shrink

    def spied_shrink(*args, **kwargs):
        splits.append(kwargs["out"].shape[1])
        return shrink(*args, **kwargs)

    monkeypatch.setattr(fe, "moe_align_with_gate_up_shrink", spied_shrink)
    outs = {}
    for direct in ("1", "0"):
        monkeypatch.setitem(LAUNCH_OVERRIDES, "decode_direct", direct)
        outs[direct] = fe.fused_experts(x, w13, w2, weights, ids, lora=lora, lora_path="split")
    assert splits == [5, 5]
    assert torch.equal(outs["1"], outs["0"])
    ref = reference_moe(x.float(), w13.float(), w2.float(), weights, ids, adapters=adapters,
                        token_adapter=per_token)
    assert rel_err(outs["1"], ref) <= TOL[dtype]
    base = reference_moe(x.float(), w13.float(), w2.float(), weights, ids)
    assert rel_err(ref, base) > 0.1, "the adapter must change the output, or the check is vacuous"


# ------------------------------------------------------------------------------------------- errors


def test_switches_reject_bad_values(monkeypatch):
    for name in SWITCHES:
        monkeypatch.setitem(LAUNCH_OVERRIDES, name, "yes")
        with pytest.raises(ValueError, match=name):
            fe.decode_direct_pairs(1) if name == SWITCHES[0] else fe.fused_topk_sum(1, 8)
        monkeypatch.delitem(LAUNCH_OVERRIDES, name)
    assert fe.decode_direct_pairs(1) and not fe.decode_direct_pairs(2)
    assert fe.fused_topk_sum(1, 8) and not fe.fused_topk_sum(2, 8) and not fe.fused_topk_sum(1, 1)


@interpreter
def test_launch_wrapper_rejects_bad_decode_operands():
    x, w13, w2, weights, ids = make_inputs(1, 10, 2, 40, 24, F32)
    act = torch.empty(2, 24)
    cfg = GemmConfig(block_m=16, block_n=16, block_k=32)
    kw = dict(topk_weights=None, a_row_div=2, config=cfg, activation="silu")
    with pytest.raises(ValueError, match="alignment .* or direct_ids"):
        invoke_fused_moe_kernel(x, w13, act, **kw)
    with pytest.raises(ValueError, match=r"direct_ids must be the flat topk_ids \(2,\)"):
        invoke_fused_moe_kernel(x, w13, act, direct_ids=ids, **kw)
    bad_counters = TopkSumOperands(out=torch.empty(1, 40), counters=torch.zeros(3), top_k=2)
    with pytest.raises(TypeError, match="int32"):
        invoke_fused_moe_kernel(x, w13, act, direct_ids=ids.reshape(-1), zero_counters=bad_counters, **kw)
    short = TopkSumOperands(out=torch.empty(1, 40), counters=torch.zeros(2, dtype=torch.int32), top_k=2)
    with pytest.raises(ValueError, match=r"counters \(3,\)"):
        invoke_fused_moe_kernel(act, w2, torch.empty(2, 40), topk_weights=None, a_row_div=1, config=cfg,
                                direct_ids=ids.reshape(-1), topk_sum=short)


def test_shrink_overlap_switch(monkeypatch):
    """``shrink_overlap`` defaults to on where dependent launch exists (never on the CPU or in the
    interpreter); a value other than 0/1 is refused by name."""
    from triton_ops.pdl import decode_shrink_overlap

    monkeypatch.delitem(LAUNCH_OVERRIDES, "shrink_overlap", raising=False)
    assert not decode_shrink_overlap(torch.device("cpu"))
    monkeypatch.setitem(LAUNCH_OVERRIDES, "shrink_overlap", "1")
    assert not decode_shrink_overlap(torch.device("cpu"))
    monkeypatch.setitem(LAUNCH_OVERRIDES, "shrink_overlap", "yes")
    with pytest.raises(ValueError, match="shrink_overlap"):
        decode_shrink_overlap(torch.device("cpu"))


@interpreter
def test_overlap_operands_are_checked():
    # The late wait is only safe when the launch before wrote nothing but the shrink partials, and it
    # needs sm_90+: both wrappers say so instead of launching.
    from triton_ops.decode_shrink import moe_align_with_gate_up_shrink

    x, w13, w2, weights, ids = make_inputs(1, 10, 2, 40, 24, F32)
    lora, _, _ = lora_inputs(1, 10, 40, 24, F32)
    act = torch.empty(2, 24)
    cfg = GemmConfig(block_m=16, block_n=16, block_k=32)
    with pytest.raises(ValueError, match="late_wait needs lora.shrunk"):
        invoke_fused_moe_kernel(x, w13, act, topk_weights=None, a_row_div=2, config=cfg, activation="silu",
                                direct_ids=ids.reshape(-1), late_wait=True)
    out = torch.empty(2, 1, 32)
    with pytest.raises(ValueError, match="release_next needs align=False"):
        moe_align_with_gate_up_shrink(ids, 16, 10, x, lora.gate_up_a, lora.token_slots, lora.slot_ranks,
                                      rank_block=16, out=out, release_next=True)
    with pytest.raises(ValueError, match="sm_90"):
        moe_align_with_gate_up_shrink(ids, 16, 10, x, lora.gate_up_a, lora.token_slots, lora.slot_ranks,
                                      rank_block=16, out=out, align=False, release_next=True)
    # The prefill shrink's release (prefill_shrink_overlap) needs sm_90+ too.
    sorted_ids, expert_ids, num_post_padded = moe_align_block_size(ids, 16, 10)
    with pytest.raises(ValueError, match="sm_90"):
        moe_lora_a(x, lora.gate_up_a, lora.token_slots, lora.slot_ranks, sorted_ids=sorted_ids,
                   expert_ids=expert_ids, num_post_padded=num_post_padded, block_m=16, top_k=2, x_row_div=2,
                   rank_block=16, gated=True, out=out, release_next=True)
    with pytest.raises(ValueError, match="sm_90"):
        reduce_shrink_splits(torch.zeros(2, 2, 32), lora.token_slots, slot_row_div=2, release_next=True)


def record_overlap_launches(monkeypatch, *, drop_flags=False):
    """The list ``fused_experts``' shrink, split-sum and GEMM launches are appended to, in order, as
    (kind, flag): ("shrink", release_next), ("reduce", release_next), ("gemm", late_wait); a pack launch
    (``pack_shrink_partials``, the split sum's place for ``lora_ext_expand``) as ("pack", release_next). With
    ``drop_flags`` the flags are recorded, then not passed on (the interpreter has no dependent launch)."""
    events = []

    def recording(fn, kind, flag):
        def launch(*args, **kwargs):
            events.append((kind, kwargs.get(flag, False)))
            if drop_flags and flag in kwargs:
                kwargs[flag] = False
            return fn(*args, **kwargs)
        return launch

    for name, kind, flag in (("moe_lora_a", "shrink", "release_next"),
                             ("reduce_shrink_splits", "reduce", "release_next"),
                             ("pack_shrink_partials", "pack", "release_next"),
                             ("invoke_fused_moe_kernel", "gemm", "late_wait")):
        monkeypatch.setattr(fe, name, recording(getattr(fe, name), kind, flag))
    return events


def check_overlap_plan(events, *, overlap, through_sum):
    """Asserts the launch plan of one prefill layer call: two shrinks and two GEMMs; with the overlap on,
    a GEMM waits late exactly when the launch before it released it, which a shrink does unless a split
    sum follows it below ``overlap_through_split_sum``'s pairs and rank (``through_sum`` False), and a split
    sum does exactly when the shrink before it did. Returns the GEMMs' late-wait flags."""
    kinds = [kind for kind, _ in events]
    assert kinds.count("gemm") == 2 and kinds.count("shrink") == 2, events
    for i, (kind, flag) in enumerate(events):
        if kind == "gemm":
            expected = overlap and (events[i - 1][0] == "shrink" or through_sum)
            assert flag == expected and events[i - 1][1] == expected, events
        elif kind in ("reduce", "pack"):
            assert flag == events[i - 1][1] == (overlap and through_sum), events
    return [flag for kind, flag in events if kind == "gemm"]


# 40 tokens x top-4 = 160 routed pairs (past decode): with the split-sum threshold at 100 the GEMMs overlap
# through the sums, at 1000 only where no sum follows the shrink, unless the rank tile is 64 (adapters of
# ranks 8/16 -> tile 16, 40/64 -> tile 64). K of 96 and 72 (block_k 32 for fp32): the shrinks split K, so
# the forced sums ("1") run.
@pytest.mark.parametrize("min_pairs", [100, 1000])
@pytest.mark.parametrize("ranks", [(8, 16), (40, 64)], ids=["rank-tile-16", "rank-tile-64"])
# "pack": both GEMMs take the packed shrink (``lora_ext_expand`` forced), whose launch stands where the split
# sum would.
@pytest.mark.parametrize("reduce", ["0", "1", "pack"],
                         ids=["partials-in-gemm", "split-sum-launch", "pack-launch"])
@interpreter
def test_prefill_overlap_plan(monkeypatch, min_pairs, ranks, reduce):
    """Which launches release the next and which GEMMs wait late, past decode, with the overlap on (forced
    here: the interpreter has no dependent launch, so the flags are recorded and then dropped): each GEMM
    waits late exactly when the launch before it released it; a split sum releases only after a shrink
    that did, and only from ``PREFILL_OVERLAP_SPLIT_SUM_MIN_PAIRS`` pairs or
    ``PREFILL_OVERLAP_SPLIT_SUM_MIN_RANK`` rank columns on. The output is the oracle's."""
    m, top_k, num_experts, hidden, inter = 40, 4, 6, 96, 72
    x, w13, w2, weights, ids = make_inputs(m, num_experts, top_k, hidden, inter, F32, seed=3)
    lora, adapters, per_token = lora_inputs(m, num_experts, hidden, inter, F32, seed=3, ranks=ranks,
                                            pool_rank=ranks[1])
    monkeypatch.setattr(fe, "prefill_shrink_overlap", lambda device: True)
    monkeypatch.setattr(importlib.import_module("triton_ops.plan"), "PREFILL_OVERLAP_SPLIT_SUM_MIN_PAIRS",
                        min_pairs)
    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_reduce_splits", reduce if reduce != "pack" else "0")
    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_ext", "1" if reduce == "pack" else "0")
    events = record_overlap_launches(monkeypatch, drop_flags=True)
    out = fe.fused_experts(x, w13, w2, weights, ids, lora=lora, lora_path="split")
    check_overlap_plan(events, overlap=True, through_sum=m * top_k >= min_pairs or ranks[1] == 64)
    kinds = [kind for kind, _ in events]
    assert kinds.count("reduce") == (2 if reduce == "1" else 0), events
    assert kinds.count("pack") == (2 if reduce == "pack" else 0), events
    ref = reference_moe(x, w13, w2, weights, ids, adapters=adapters, token_adapter=per_token)
    assert rel_err(out, ref) <= TOL[F32]


def one_partial_shrink_plan(monkeypatch, ranks, seed):
    """160 routed pairs (40 tokens, top-4, K of 96 and 72 with block_k 32: a shrink would split K) with
    ``ranks``' adapters, the overlap on and split sums forced. Returns ``run()``, which calls the layer and
    gives (output, oracle, [(splits, slot_programs) of each moe_lora_a launch], launch events)."""
    m, top_k, num_experts, hidden, inter = 40, 4, 6, 96, 72
    x, w13, w2, weights, ids = make_inputs(m, num_experts, top_k, hidden, inter, F32, seed=seed)
    lora, adapters, per_token = lora_inputs(m, num_experts, hidden, inter, F32, seed=seed, ranks=ranks,
                                            pool_rank=max(ranks))
    assert lora.num_adapters == len(ranks)
    monkeypatch.setattr(fe, "prefill_shrink_overlap", lambda device: True)
    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_reduce_splits", "1")
    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_ext", "0")
    events = record_overlap_launches(monkeypatch, drop_flags=True)
    launches, shrink = [], fe.moe_lora_a

    def counting_shrink(*args, **kwargs):
        launches.append((kwargs["out"].shape[1], kwargs["slot_programs"]))
        return shrink(*args, **kwargs)

    monkeypatch.setattr(fe, "moe_lora_a", counting_shrink)

    def run():
        launches.clear()
        out = fe.fused_experts(x, w13, w2, weights, ids, lora=lora, lora_path="split")
        ref = reference_moe(x, w13, w2, weights, ids, adapters=adapters, token_adapter=per_token)
        return out, ref, list(launches), events

    return run


# Each prefill shrink walking all of K (``one_split_shrink`` forced). Four adapters of rank tile 64 take
# four passes over K (one slot a pass), the most ``one_split_shrink`` allows.
@pytest.mark.parametrize("ranks", [(8, 16), (40, 64), (40, 64, 24, 64)],
                         ids=["rank-tile-16", "rank-tile-64", "rank-tile-64-four-passes"])
@interpreter
def test_one_split_shrink_plan(monkeypatch, ranks):
    """A one-pass shrink writes one partial per pair, so no split sum follows it even where one is forced,
    and each GEMM, overlapping the shrink before it directly, waits late; the output is the oracle's."""
    run = one_partial_shrink_plan(monkeypatch, ranks, seed=5)
    monkeypatch.setitem(LAUNCH_OVERRIDES, "one_split_shrink", "1")
    # Four adapters would take the slot-program shrink at these pairs.
    monkeypatch.setitem(LAUNCH_OVERRIDES, "slot_program_shrink", "0")
    out, ref, launches, events = run()
    assert launches == [(1, False), (1, False)], launches
    assert check_overlap_plan(events, overlap=True, through_sum=False) == [True, True], events
    assert "reduce" not in [kind for kind, _ in events], events
    assert rel_err(out, ref) <= TOL[F32]


# Four adapters (slots 0, 2, 3, 4): past decode, short of the one-pass rule's pairs, so each shrink would
# split K; it runs a program per slot of each block over all of K.
@pytest.mark.parametrize("ranks", [(8, 16, 16, 4), (40, 64, 24, 64)], ids=["rank-tile-16", "rank-tile-64"])
@interpreter
def test_slot_program_shrink_plan(monkeypatch, ranks):
    """A shrink of a program per slot writes one partial per pair, so no split sum follows it even where
    one is forced, and each GEMM, overlapping the shrink before it directly, waits late; the output is the
    oracle's, whatever the slots each block holds."""
    assert len(ranks) == fe.SLOT_PROGRAM_SHRINK_MIN_ADAPTERS
    run = one_partial_shrink_plan(monkeypatch, ranks, seed=6)
    out, ref, launches, events = run()
    assert launches == [(1, True), (1, True)], launches
    assert check_overlap_plan(events, overlap=True, through_sum=False) == [True, True], events
    assert "reduce" not in [kind for kind, _ in events], events
    assert rel_err(out, ref) <= TOL[F32]
    # Forced off, the same batch splits K again (and sums the splits).
    monkeypatch.setitem(LAUNCH_OVERRIDES, "slot_program_shrink", "0")
    _, _, launches, _ = run()
    assert [programs for _, programs in launches] == [False, False] and launches[0][0] > 1, launches


@interpreter
def test_slot_program_shrink_rule(monkeypatch):
    """A program per slot from four adapters on, short of Mixtral's K, over the one pass only for fewer
    pairs and from five adapters; the switch forces it for any known adapter count, and ``moe_lora_a``
    refuses it beside a split of K or without the adapter count."""
    many = fe.SLOT_PROGRAM_OVER_ONE_PASS_MAX_PAIRS

    def rule(adapters, longest_k=7168, pairs=384, one_pass=False):  # DeepSeek-V3's hidden size; M=64
        return fe.slot_program_shrink(adapters, longest_k, pairs, one_pass)

    few = fe.SLOT_PROGRAM_SHRINK_MIN_ADAPTERS - 1
    assert rule(few + 1) and rule(8) and rule(4, pairs=4 * many)  # in place of split K at any pairs
    # M=256 of DeepSeek-V2-Lite (1536 pairs): over the one pass from five adapters, four keep the one pass
    assert rule(5, pairs=many - 1, one_pass=True) and rule(8, pairs=many - 1, one_pass=True)
    assert not rule(4, pairs=many - 1, one_pass=True)
    assert rule(4, pairs=many - 1)  # where the one pass does not hold, four already take it
    assert not rule(8, pairs=many, one_pass=True)  # from M=256 of Qwen3-30B-A3B on, the one pass stays
    assert not rule(few) and not rule(1) and not rule(0)
    assert not rule(8, longest_k=14336)  # Mixtral-8x7B's intermediate size
    monkeypatch.setitem(LAUNCH_OVERRIDES, "slot_program_shrink", "1")
    assert rule(1, longest_k=14336, pairs=4 * many, one_pass=True) and not rule(0)  # 0: adapters unknown
    monkeypatch.setitem(LAUNCH_OVERRIDES, "slot_program_shrink", "0")
    assert not rule(8)
    monkeypatch.setitem(LAUNCH_OVERRIDES, "slot_program_shrink", "on")
    with pytest.raises(ValueError, match="slot_program_shrink must be 0 or 1"):
        rule(8)
    m, top_k, num_experts, hidden, inter = 40, 4, 6, 96, 72
    x, *_, ids = make_inputs(m, num_experts, top_k, hidden, inter, F32, seed=6)
    lora, *_ = lora_inputs(m, num_experts, hidden, inter, F32, seed=6, ranks=(8, 16, 16, 4))
    sorted_ids, expert_ids, num_post_padded = fe.moe_align_block_size(ids, 16, num_experts)
    for splits, adapters in ((2, 4), (1, 0)):
        out = torch.empty(m * top_k, splits, 32)
        with pytest.raises(ValueError, match="slot_programs needs one split and the adapter count"):
            fe.moe_lora_a(x, lora.gate_up_a, lora.token_slots, lora.slot_ranks, sorted_ids=sorted_ids,
                          expert_ids=expert_ids, num_post_padded=num_post_padded, block_m=16, top_k=top_k,
                          x_row_div=top_k, rank_block=16, gated=True, out=out, num_adapters=adapters,
                          slot_programs=True)


def test_one_split_shrink_rule(monkeypatch):
    """Where a prefill shrink walks all of K (``fused_experts.one_split_shrink``): from the pairs where the
    GEMMs overlap through the split sums, when the block's slots fit two 64-column passes (four from
    ``ONE_SPLIT_SHRINK_MANY_PASSES_MIN_PAIRS`` pairs), the alignment gives enough programs and no K is
    Mixtral's; the switch forces it either way."""
    pairs = fe.PREFILL_OVERLAP_SPLIT_SUM_MIN_PAIRS
    many = fe.ONE_SPLIT_SHRINK_MIN_ROW_PROGRAMS

    def rule(pairs=pairs, rank_block=16, adapters=4, programs=many, longest_k=2048):  # DeepSeek-V2-Lite's K
        return fe.one_split_shrink(pairs, rank_block, adapters, programs, longest_k)

    assert rule() and rule(rank_block=64, adapters=1) and rule(longest_k=7168)  # DeepSeek-V3's hidden
    assert rule(adapters=8) and rule(rank_block=64, adapters=2)  # two 64-column passes over K
    assert not rule(pairs=pairs - 1)  # M=64-like batches keep split K
    assert not rule(adapters=9) and not rule(rank_block=64, adapters=3)  # three passes and more
    many_pairs = fe.ONE_SPLIT_SHRINK_MANY_PASSES_MIN_PAIRS  # DeepSeek-V2-Lite M=1024 has 6144
    assert not rule(pairs=many_pairs - 1, rank_block=64, adapters=4)  # M=256 keeps split K at four passes
    assert rule(pairs=many_pairs, rank_block=64, adapters=4) and rule(pairs=many_pairs, adapters=16)
    assert not rule(pairs=many_pairs, rank_block=64, adapters=5)  # five passes
    assert not rule(adapters=0)  # adapters unknown
    assert not rule(programs=many - 1)  # few experts: few programs
    assert not rule(longest_k=14336)  # Mixtral-8x7B's intermediate size
    monkeypatch.setitem(LAUNCH_OVERRIDES, "one_split_shrink", "1")
    assert rule(pairs=1, rank_block=64, adapters=8, programs=1, longest_k=14336)
    monkeypatch.setitem(LAUNCH_OVERRIDES, "one_split_shrink", "0")
    assert not rule()
    monkeypatch.setitem(LAUNCH_OVERRIDES, "one_split_shrink", "yes")
    with pytest.raises(ValueError, match="one_split_shrink must be 0 or 1"):
        rule()


# 7 tokens x top-6 = 42 routed pairs: an aligned decode (the gate/up shrink rides in the alignment's launch).
# Rank tile 64 over I=600 (at least 5 GEMM1 N tiles: 320 partial columns) is too many down-shrink partials
# for GEMM1's epilogue, so the down shrink is a launch (moe_lora_a), which GEMM2 overlaps when it is on.
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
@interpreter
def test_aligned_decode_down_overlap_plan(monkeypatch, overlap):
    m, top_k, num_experts, hidden, inter = 7, 6, 9, 48, 600
    x, w13, w2, weights, ids = make_inputs(m, num_experts, top_k, hidden, inter, F32, seed=4)
    lora, adapters, per_token = lora_inputs(m, num_experts, hidden, inter, F32, seed=4, ranks=(40, 64),
                                            pool_rank=64)
    monkeypatch.setattr(fe, "prefill_shrink_overlap", lambda device: overlap)
    events = record_overlap_launches(monkeypatch, drop_flags=True)
    out = fe.fused_experts(x, w13, w2, weights, ids, lora=lora, lora_path="split")
    # GEMM1 follows the alignment's launch (plain); the down shrink releases GEMM2, which waits late.
    assert events == [("gemm", False), ("shrink", overlap), ("gemm", overlap)], events
    ref = reference_moe(x, w13, w2, weights, ids, adapters=adapters, token_adapter=per_token)
    assert rel_err(out, ref) <= TOL[F32]


# M=1: the one-row prologue (its rank masks apply after the K-loop); M=7 top-6 (42 pairs): the aligned
# decode's prefetch; M=23 top-6 (138 pairs): past decode, shrink launches and the small-tile prefetch. Each
# with the prefetch's uses deferred past the K-loop (LORA_DEFERRED, the default where the partials are one
# chunk at rank tile 16: ``defer_lora_prologue``) and not.
@pytest.mark.parametrize("m", [1, 7, 23])
@pytest.mark.parametrize("defer", ["1", "0"])
@interpreter
def test_lora_nan_past_rank_never_read(monkeypatch, m, defer):
    """A pool's rank rows and columns past each slot's real rank (and an idle slot) may hold anything (a
    user's buffers need not be zeroed there): NaN in them must not reach the output, whichever prologue
    loads the B tiles and whenever the rank masks apply."""
    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_defer", defer)
    num_experts, top_k, hidden, inter = 9, 6, 48, 40
    x, w13, w2, weights, ids = make_inputs(m, num_experts, top_k, hidden, inter, F32, seed=m)
    lora, adapters, per_token = lora_inputs(m, num_experts, hidden, inter, F32, seed=m, ranks=(8, 16))
    rank, pool_rank = 8, 16  # slot 0 has rank 8 in a rank-16 pool; slot 1 is idle
    nan = float("nan")
    for slot, first in ((0, rank), (1, 0)):
        lora.gate_up_a[slot, :, first:pool_rank] = nan
        lora.gate_up_a[slot, :, pool_rank + first:] = nan
        lora.gate_up_b[slot, :, :, first:] = nan
        lora.down_a[slot, :, first:] = nan
        lora.down_b[slot, :, :, first:] = nan
    out = fe.fused_experts(x, w13, w2, weights, ids, lora=lora, lora_path="split")
    ref = reference_moe(x, w13, w2, weights, ids, adapters=adapters, token_adapter=per_token)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= TOL[F32]


# M=7 top-6 (42 pairs, the aligned decode) and M=23 (138 pairs, past decode): the deferred prologue
# (LORA_DEFERRED) gives the prefetching prologue's bits, ranks 8 and 16 mixed and tokens without an adapter.
@pytest.mark.parametrize("m", [7, 23])
@interpreter
def test_deferred_prologue_gives_the_prefetched_bits(monkeypatch, m):
    from triton_ops import plan
    from triton_ops.lora_epilogues import LORA_DEFERRED, LORA_PREFETCHED

    variants = []
    original = plan.lora_variant

    def recording(**kwargs):
        variants.append(original(**kwargs))
        return variants[-1]

    monkeypatch.setattr(plan, "lora_variant", recording)
    num_experts, top_k, hidden, inter = 9, 6, 48, 40
    x, w13, w2, weights, ids = make_inputs(m, num_experts, top_k, hidden, inter, F32, seed=m)
    lora, adapters, per_token = lora_inputs(m, num_experts, hidden, inter, F32, seed=m, ranks=(8, 16))
    outs = {}
    for defer in ("1", "0"):
        monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_defer", defer)
        variants.clear()
        outs[defer] = fe.fused_experts(x, w13, w2, weights, ids, lora=lora, lora_path="split")
        taken, other = ((LORA_DEFERRED.value, LORA_PREFETCHED.value) if defer == "1"
                        else (LORA_PREFETCHED.value, LORA_DEFERRED.value))
        assert taken in variants and other not in variants, variants
    assert torch.equal(outs["1"], outs["0"])
    ref = reference_moe(x, w13, w2, weights, ids, adapters=adapters, token_adapter=per_token)
    assert rel_err(outs["1"], ref) <= TOL[F32]


# Past decode (M=23 x top-6 = 138 pairs, M=45 x top-4 = 180), both GEMMs expanding by the slot range from
# packed shrinks (forced on the interpreter's small tiles): slots 0 and 2 in every block and slot 1, loaded
# but used by no token, between them; ranks 8 and 16 in a rank-16 pool, a third of the tokens without an
# adapter; NaN past each slot's rank and in slot 1 must not reach the output.
@pytest.mark.parametrize("m, top_k, stages", [(23, 6, ""), (45, 4, "2")])
@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
@interpreter
def test_slot_range_expand_matches_oracle(monkeypatch, m, top_k, stages, dtype):
    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_ext", "1")
    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_ext_stages", stages)  # "2": the loop over slots pipelined
    packs = []
    original = fe.pack_shrink_partials

    def counting(partials, *args, **kwargs):
        packs.append(partials.shape[2])
        return original(partials, *args, **kwargs)

    monkeypatch.setattr(fe, "pack_shrink_partials", counting)
    num_experts, hidden, inter = 9, 48, 40
    x, w13, w2, weights, ids = make_inputs(m, num_experts, top_k, hidden, inter, dtype, seed=m)
    lora, adapters, per_token = lora_inputs(m, num_experts, hidden, inter, dtype, seed=m, ranks=(8, 16))
    nan = float("nan")
    for slot, first in ((0, 8), (1, 0)):
        lora.gate_up_a[slot, :, first:16] = nan
        lora.gate_up_a[slot, :, 16 + first:] = nan
        lora.gate_up_b[slot, :, :, first:] = nan
        lora.down_a[slot, :, first:] = nan
        lora.down_b[slot, :, :, first:] = nan
    # Slot 1, between the used ones, now holds an adapter no token uses: its B (NaN here) inside the
    # blocks' slot range must not be read at all (bytes follow the slots present, not the range).
    lora.slot_ranks[1] = 16
    lora.gate_up_b[1] = nan
    lora.down_b[1] = nan
    out = fe.fused_experts(x, w13, w2, weights, ids, lora=lora, lora_path="split")
    ref = reference_moe(x.float(), w13.float(), w2.float(), weights, ids, adapters=adapters,
                        token_adapter=per_token)
    assert packs == [32, 16], packs  # gate/up (2 x rank tile), then down: both GEMMs took the packed shrink
    assert torch.isfinite(out.float()).all()
    assert rel_err(out.float(), ref) <= TOL[dtype]


# A pool of 71 slots (70 adapters, ranks 8 and 16): tokens use slots 0, 62, 66 and 70 (and none), so the
# blocks' slot ranges run across the first 63-slot presence word into the second; slots 63-65 hold
# adapters no token uses, their B NaN: the slot-range expand must not read them, past slot 62 as before it.
@interpreter
def test_slot_range_expand_skips_unused_slots_past_the_first_presence_word(monkeypatch):
    from triton_ops import plan

    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_ext", "1")
    m, top_k, num_experts, hidden, inter = 45, 4, 5, 48, 40  # 180 pairs: past decode, packed shrinks
    x, w13, w2, weights, ids = make_inputs(m, num_experts, top_k, hidden, inter, F32, seed=5)
    ranks = [16 if k % 2 == 0 else 8 for k in range(70)]
    used = (0, 62, 66, 70)
    tokens = [(-1, *used)[t % 5] for t in range(m)]
    lora, adapters, per_token = lora_inputs(m, num_experts, hidden, inter, F32, seed=5, ranks=ranks,
                                            slots_per_token=tokens)
    for slot in (63, 64, 65):
        lora.gate_up_b[slot] = float("nan")
        lora.down_b[slot] = float("nan")
    variants = []
    original = plan.lora_variant
    monkeypatch.setattr(plan, "lora_variant", lambda **kw: variants.append(original(**kw)) or variants[-1])
    out = fe.fused_experts(x, w13, w2, weights, ids, lora=lora, lora_path="split")
    ref = reference_moe(x, w13, w2, weights, ids, adapters=adapters, token_adapter=per_token)
    assert variants == [LORA_SLOT_RANGE.value] * 2, variants
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= TOL[F32]


@interpreter
def test_pack_shrink_partials_matches_torch():
    """The packed shrink is the split sum times the token's slot scaling, rounded to the GEMM's dtype, 0
    for tokens without an adapter. 37 pairs of 2 per token (19 tokens: the last pair has no token
    partner), 3 splits, width 32; the partials of rows without an adapter hold NaN (never written)."""
    gen = torch.Generator().manual_seed(3)
    partials = torch.randn(37, 3, 32, generator=gen)
    token_slots = torch.tensor([(0, -1, 2, 1)[t % 4] for t in range(19)], dtype=torch.int32)
    scalings = torch.tensor([0.5, 2.0, 1.5])
    row_slots = token_slots.repeat_interleave(2)[:37].long()
    partials[row_slots < 0] = float("nan")
    packed = pack_shrink_partials(partials, token_slots, scalings, slot_row_div=2, dtype=F16)
    expected = partials.sum(1) * scalings[row_slots.clamp_min(0)][:, None]
    expected[row_slots < 0] = 0.0
    assert packed.dtype == F16 and packed.shape == (37, 32)
    torch.testing.assert_close(packed, expected.to(F16), rtol=0, atol=0)
    with pytest.raises(ValueError, match="slot_scalings must be fp32"):
        pack_shrink_partials(partials, token_slots, scalings.double(), slot_row_div=2, dtype=F16)


def test_slot_range_expand_rule(monkeypatch):
    """Where the slot-range expand runs (``fused_moe.lora_ext_expand``): GEMM2 only, prefill tiles of 64
    rows and up that hold two blocks an SM, K-loops shorter than Mixtral's (14336), batches of two
    adapters and more; the switch forces it."""
    from triton_ops import fused_moe

    def rule(config, gated=False, num_adapters=4, K=1408):  # K: DeepSeek-V2-Lite's GEMM2
        return fused_moe.lora_ext_expand(config, gated=gated, num_adapters=num_adapters, K=K)

    two_blocks = GemmConfig(128, 128, 64, 8, 8, 3)  # DeepSeek-V2-Lite M=1024 GEMM2 (96 KiB)
    one_block = GemmConfig(128, 256, 64, 8, 8, 4)  # Qwen3-30B-A3B M=1024 GEMM2 (192 KiB)
    assert rule(two_blocks)
    assert not rule(two_blocks, gated=True) and not rule(two_blocks, num_adapters=1)
    assert not rule(two_blocks, K=14336)
    assert not rule(one_block) and not rule(GemmConfig(32, 128, 128, 8, 4, 3))
    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_ext", "1")
    assert rule(one_block, gated=True, num_adapters=1, K=14336)
    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_ext", "0")
    assert not rule(two_blocks)
    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_ext", "gemm1")  # GEMM1 forced, GEMM2 left to the rule
    assert rule(one_block, gated=True, num_adapters=1) and rule(two_blocks) and not rule(one_block)
    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_ext", "gemm2")
    assert rule(one_block) and not rule(two_blocks, gated=True)
    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_ext", "yes")
    with pytest.raises(ValueError, match="lora_ext must be 0, 1, gemm1 or gemm2"):
        rule(two_blocks)
    # Stacked columns per dot: two rank-16 slots, one slot from rank tile 32 on, no more than the adapters.
    assert fused_moe.lora_ext_cols(16, 4) == 32 and fused_moe.lora_ext_cols(16, 1) == 16
    assert fused_moe.lora_ext_cols(64, 4) == 64


def packed_gemm2_launch(monkeypatch, **lora_changes):
    """Launches a GEMM2 on a packed shrink (rank tile 64, 4 slots, 128x128 tiles) with the kernel caught
    on meta tensors (nothing runs); returns the launches' keyword arguments and the config."""
    from triton_ops import fused_moe

    launches = []

    class Caught:
        def __getitem__(self, grid):
            return lambda **kwargs: launches.append(kwargs)

    monkeypatch.setattr(fused_moe, "_fused_moe_kernel", Caught())
    meta = dict(device="meta", dtype=torch.bfloat16)
    pairs, num_experts, hidden, inter, rank, slots = 600, 8, 256, 192, 64, 4
    config = GemmConfig(128, 128, 64, 8, 8, 3)
    lora = fused_moe.LoRAOperands(
        token_slots=torch.empty(pairs // 6, dtype=torch.int32, device="meta"),
        lora_a=torch.empty(slots, num_experts, rank, inter, **meta),
        lora_b=torch.empty(slots, num_experts, hidden, rank, **meta),
        slot_ranks=torch.empty(slots, dtype=torch.int32, device="meta"),
        slot_scalings=torch.empty(slots, dtype=torch.float32, device="meta"), top_k=6, rank_block=rank,
        num_adapters=4, packed=torch.empty(pairs, rank, **meta))
    max_padded = pairs + num_experts * 127
    invoke_fused_moe_kernel(
        torch.empty(pairs, inter, **meta), torch.empty(num_experts, hidden, inter, **meta),
        torch.empty(pairs, hidden, **meta), topk_weights=None, a_row_div=1, config=config,
        lora=replace(lora, **lora_changes),
        sorted_ids=torch.empty(max_padded, dtype=torch.int32, device="meta"),
        expert_ids=torch.empty(max_padded // 128 + 1, dtype=torch.int32, device="meta"),
        num_post_padded=torch.empty(1, dtype=torch.int32, device="meta"))
    return launches, config


def test_slot_range_expand_is_planned_for_a_packed_shrink(monkeypatch):
    """A GEMM2 given the packed shrink takes the slot-range expand."""
    from triton_ops import fused_moe

    launches, _ = packed_gemm2_launch(monkeypatch)
    assert fused_moe.lora_plan_fields(launches[-1])["variant"] == LORA_SLOT_RANGE.value


@pytest.mark.parametrize(
    "change, message",
    [(dict(packed=torch.empty(600, 64, device="meta")), r"lora.packed must be torch.bfloat16 \(600, 64\)"),
     (dict(packed=torch.empty(600, 32, dtype=torch.bfloat16, device="meta")), r"\(pairs, rank_block\)"),
     (dict(shrunk=torch.empty(600, 1, 64, device="meta")), "lora.packed replaces lora.shrunk")],
    ids=["fp32", "half-width", "with-partials"])
def test_packed_shrink_of_the_wrong_form_is_refused(monkeypatch, change, message):
    """A packed shrink of the wrong dtype or width, or given beside the partials it replaces, is refused
    before any launch, saying what was expected."""
    with pytest.raises(ValueError, match=message):
        packed_gemm2_launch(monkeypatch, **change)


def test_one_row_rule(monkeypatch):
    """When a direct-pair GEMM takes the one-row prologue (``plan.one_row_lora``): never without
    the prefetch or off the direct pairs; partials read before the K-loop only as one chunk (held raw
    through it); a launch that waits late only while its grid is one program per SM; the switch turns
    it off."""
    from triton_ops import plan

    # An H100's 132 SMs, whatever runs the test.
    monkeypatch.setattr(plan, "_fits_one_wave", lambda programs, device: programs <= 132)

    def rule(**kw):
        args = dict(direct=True, prefetch=True, late_wait=False, splits=16, split_chunk=16, programs=256,
                    device=torch.device("cuda"))
        return plan.one_row_lora(**(args | kw))

    assert rule() and not rule(direct=False) and not rule(prefetch=False)
    # Two chunks of partials before the loop (DeepSeek-V3's 32 down partials): the general prefetch.
    assert not rule(splits=32)
    # Waiting late, the partials are read after the loop (any count), but only one program per SM
    # (DeepSeek-V3 M=1 GEMM1: 256 programs keeps the general prefetch).
    assert rule(late_wait=True, splits=64, programs=132) and not rule(late_wait=True, programs=256)
    monkeypatch.setitem(LAUNCH_OVERRIDES, "one_row_lora", "0")
    assert not rule()


# ---------------------------------------------------------------------------------------------- GPU

# (E, top_k, H, I): DeepSeek-V2-Lite, Qwen3-30B-A3B, Mixtral-8x7B (top-2, 8 experts: at M=16 every expert
# gets several pairs).
GPU_SHAPES = {"deepseek-v2-lite": (64, 6, 2048, 1408), "qwen3-30b-a3b": (128, 8, 2048, 768),
              "mixtral-8x7b": (8, 2, 4096, 14336)}


def captured(fn):
    warm_up_on_side_stream(fn)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@gpu
@pytest.mark.parametrize("name", list(GPU_SHAPES))
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("with_lora", [False, True], ids=["base", "lora"])
def test_gpu_decode_modes_bit_equal_and_graph_replays(monkeypatch, name, m, with_lora):
    num_experts, top_k, hidden, inter = GPU_SHAPES[name]
    x, w13, w2, weights, ids = make_inputs(m, num_experts, top_k, hidden, inter, BF16, device="cuda", seed=m)
    lora = None
    if with_lora:
        lora, adapters, per_token = lora_inputs(m, num_experts, hidden, inter, BF16, seed=m, device="cuda")

    def layer():
        return fe.fused_experts(x, w13, w2, weights, ids, lora=lora, lora_path="split")

    results = run_modes(monkeypatch, layer)
    reference = results[("0", "0")][0]
    kw = dict(adapters=adapters, token_adapter=per_token) if with_lora else {}
    ref = reference_moe_grouped(x, w13, w2, weights, ids, **kw)
    err = rel_err(reference, ref)
    print(f"{name} M={m} lora={with_lora}: rel L2 vs fp32 oracle {err:.2e}")
    assert torch.isfinite(reference).all() and err <= TOL[BF16]
    # Mixtral's 448 GEMM1 N tiles are too many partials for GEMM1 to write GEMM2's down shrink.
    down_launch = with_lora and results[("0", "0")][1]["down shrink"] == 1
    for mode, (out, calls) in results.items():
        expected = expected_launches(m, top_k, lora=with_lora, down_launch=down_launch)[mode]
        assert calls == expected, f"mode {mode}: launches {calls}"
        assert torch.equal(out, reference), f"mode {mode} differs from the four-launch path"

    # Default modes in a CUDA graph: replays with new routing (the counters re-zeroed each time).
    monkeypatch.delitem(LAUNCH_OVERRIDES, "decode_direct", raising=False)
    monkeypatch.delitem(LAUNCH_OVERRIDES, "fused_sum", raising=False)
    graph, graph_out = captured(layer)
    for seed in (101, 202):
        routing = make_inputs(m, num_experts, top_k, 8, 8, BF16, device="cuda", seed=seed)
        new_weights, new_ids = routing[3], routing[4]
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        monkeypatch.setitem(LAUNCH_OVERRIDES, "decode_direct", "0")
        monkeypatch.setitem(LAUNCH_OVERRIDES, "fused_sum", "0")
        eager = layer()
        monkeypatch.delitem(LAUNCH_OVERRIDES, "decode_direct", raising=False)
        monkeypatch.delitem(LAUNCH_OVERRIDES, "fused_sum", raising=False)
        assert torch.equal(graph_out, eager), f"replay with routing seed {seed} differs"


# (E, top_k, H, I) for the overlap test: two model shapes, and a small one whose GEMM1 K-loop (256 columns)
# is about as short as the shrink, so a GEMM1 that read the partials before they were written would do so.
# Mixtral-8x7B and "small-gemv" (rank 64 over at least 33 GEMM1 N tiles, whatever the default tile) have a
# down-shrink launch of their own, which GEMM2 overlaps the same way.
OVERLAP_SHAPES = dict(GPU_SHAPES, small=(16, 4, 256, 128), **{"small-gemv": (16, 4, 256, 4160)})
DOWN_GEMV_SHAPES = ("mixtral-8x7b", "small-gemv")


@gpu
@pytest.mark.parametrize("name", ["deepseek-v2-lite", "qwen3-30b-a3b", "small", *DOWN_GEMV_SHAPES])
def test_gpu_shrink_overlap_bit_equal_over_replays(monkeypatch, name):
    """One token with an adapter: GEMM1 launched dependently on the gate/up shrink (waiting for it after
    its K-loop), and GEMM2 on the down shrink where that is a launch, give bit for bit what the plain
    launches give, in replays with new x, routing and adapter slot each time (a replay that read the last
    replay's partials would differ)."""
    from triton_ops.pdl import dependent_launch_supported

    if not dependent_launch_supported(torch.device("cuda")):
        pytest.skip("dependent launch needs sm_90 or later")
    num_experts, top_k, hidden, inter = OVERLAP_SHAPES[name]
    x, w13, w2, weights, ids = make_inputs(1, num_experts, top_k, hidden, inter, BF16, device="cuda", seed=5)
    ranks = dict(ranks=(40, 64), pool_rank=64) if name == "small-gemv" else {}
    lora, _, _ = lora_inputs(1, num_experts, hidden, inter, BF16, seed=5, device="cuda", **ranks)
    down_gemv = name in DOWN_GEMV_SHAPES
    late_waits = []
    invoke = fe.invoke_fused_moe_kernel

    def spied_invoke(*args, **kwargs):
        late_waits.append(kwargs.get("late_wait", False))
        return invoke(*args, **kwargs)

    monkeypatch.setattr(fe, "invoke_fused_moe_kernel", spied_invoke)

    def layer():
        return fe.fused_experts(x, w13, w2, weights, ids, lora=lora, lora_path="split")

    monkeypatch.setitem(LAUNCH_OVERRIDES, "shrink_overlap", "1")
    graph, graph_out = captured(layer)
    assert late_waits[-2:] == [True, down_gemv], "GEMM1 must wait late, GEMM2 only after a down-shrink launch"
    gen = torch.Generator("cuda").manual_seed(9)
    for step in range(12):
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda").to(BF16))
        new_ids = torch.randperm(num_experts, generator=gen, device="cuda")[:top_k].to(torch.int32)
        ids.copy_(new_ids.view(1, top_k))
        lora.token_slots.fill_((0, 2, -1)[step % 3])
        graph.replay()
        torch.cuda.synchronize()
        monkeypatch.setitem(LAUNCH_OVERRIDES, "shrink_overlap", "0")
        eager = layer()
        assert late_waits[-2:] == [False, False]
        monkeypatch.setitem(LAUNCH_OVERRIDES, "shrink_overlap", "1")
        assert torch.isfinite(eager).all()
        assert torch.equal(graph_out, eager), f"replay {step} differs from the plain launches"


def replays_match_plain_launches(monkeypatch, layer, x, ids, lora, num_experts, *, seed, check_plain):
    """Captures ``layer`` (with ``prefill_shrink_overlap=1`` set) in a CUDA graph and replays it 6
    times with new x, routing and token slots; each replay must be bit for bit the eager layer with the
    overlap off, whose launch plan ``check_plain()`` asserts."""
    m, top_k = ids.shape
    graph, graph_out = captured(layer)
    gen = torch.Generator("cuda").manual_seed(seed)
    for step in range(6):
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda").to(BF16))
        new_ids = torch.stack([torch.randperm(num_experts, generator=gen, device="cuda")[:top_k]
                               for _ in range(m)]).to(ids.dtype)
        ids.copy_(new_ids)
        # Rotate the slots (0, none, 2) by the step, so every row's adapter changes between replays.
        slots = [(0, -1, 2)[(t + step) % 3] for t in range(m)]
        lora.token_slots.copy_(torch.tensor(slots, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        monkeypatch.setitem(LAUNCH_OVERRIDES, "prefill_shrink_overlap", "0")
        eager = layer()
        check_plain()
        monkeypatch.setitem(LAUNCH_OVERRIDES, "prefill_shrink_overlap", "1")
        assert torch.isfinite(eager).all()
        assert torch.equal(graph_out, eager), f"replay {step} differs from the plain launches"


# (name, M, rank): a few decode tokens (at most 128 pairs, aligned) whose down shrink is a launch of its own:
# DeepSeek-V2-Lite M=16 rank 64 (22 GEMM1 N tiles x 64 partial columns), Mixtral M=16 (448 tiles), and the
# small shape with I=4160 at M=7 (28 pairs, over 33 tiles x 64), whose GEMM2 K-loop is short.
DECODE_DOWN_OVERLAP_POINTS = [("deepseek-v2-lite", 16, 64), ("mixtral-8x7b", 16, 16), ("small-gemv", 7, 64)]


def overlap_case(name, m, rank, *, seed):
    """The overlap GPU tests' setup: skips without dependent launch and returns
    ``make_inputs``' (x, w13, w2, weights, ids) and ``lora_inputs``' (lora, adapters, per_token) for the
    ``OVERLAP_SHAPES`` entry; rank 64 means adapters of ranks 40 and 64 in a rank-64 pool."""
    from triton_ops.pdl import dependent_launch_supported

    if not dependent_launch_supported(torch.device("cuda")):
        pytest.skip("dependent launch needs sm_90 or later")
    num_experts, top_k, hidden, inter = OVERLAP_SHAPES[name]
    inputs = make_inputs(m, num_experts, top_k, hidden, inter, BF16, device="cuda", seed=seed)
    ranks = dict(ranks=(40, 64), pool_rank=64) if rank == 64 else {}
    return inputs, lora_inputs(m, num_experts, hidden, inter, BF16, seed=seed, device="cuda", **ranks)


@gpu
@pytest.mark.parametrize(("name", "m", "rank"), DECODE_DOWN_OVERLAP_POINTS)
def test_gpu_aligned_decode_down_overlap_bit_equal_over_replays(monkeypatch, name, m, rank):
    """A few aligned decode tokens: GEMM2 launched dependently on the down-shrink launch (waiting for it
    after its K-loop) gives bit for bit what the plain launches give, in graph replays with new x, routing
    and token slots each time, and matches the fp32 oracle."""
    (x, w13, w2, weights, ids), (lora, adapters, per_token) = overlap_case(name, m, rank, seed=8)
    num_experts = OVERLAP_SHAPES[name][0]
    events = record_overlap_launches(monkeypatch)

    def layer():
        events.clear()
        return fe.fused_experts(x, w13, w2, weights, ids, lora=lora, lora_path="split")

    monkeypatch.setitem(LAUNCH_OVERRIDES, "prefill_shrink_overlap", "1")
    eager_overlap = layer()
    assert events == [("gemm", False), ("shrink", True), ("gemm", True)], events
    ref = reference_moe_grouped(x, w13, w2, weights, ids, adapters=adapters, token_adapter=per_token)
    err = rel_err(eager_overlap, ref)
    assert torch.isfinite(eager_overlap).all() and err <= TOL[BF16], f"rel L2 vs fp32 oracle {err:.2e}"

    def check_plain():
        assert events == [("gemm", False), ("shrink", False), ("gemm", False)], events

    replays_match_plain_launches(monkeypatch, layer, x, ids, lora, num_experts, seed=12,
                                 check_plain=check_plain)


# (name, M): past decode (more than 128 pairs), so the shrinks are launches over the alignment. "small" has
# a GEMM1 K-loop of 256 columns, about as short as the shrink, so a GEMM that read the partials before
# they were written would do so; the model shapes have enough tokens that every expert gets pairs of
# both adapters and of tokens without one. Rank 64 (adapters of ranks 40 and 64): the GEMMs overlap their
# shrinks through the split sums below PREFILL_OVERLAP_SPLIT_SUM_MIN_PAIRS too (M=64 of DeepSeek-V2-Lite:
# 384 pairs).
PREFILL_OVERLAP_POINTS = [("small", 40, 16), ("deepseek-v2-lite", 300, 16), ("qwen3-30b-a3b", 300, 16),
                          ("small", 40, 64), ("deepseek-v2-lite", 64, 64)]


@gpu
# The small shape's short K-loops; DeepSeek-V2-Lite at 1800 pairs (past the split-sum pair threshold).
@pytest.mark.parametrize(("name", "m", "rank"), [("small", 40, 16), ("deepseek-v2-lite", 300, 16)])
def test_gpu_prefill_pack_overlap_bit_equal_over_replays(monkeypatch, name, m, rank):
    """Both GEMMs expanding by the slot range (``lora_ext=1``): each waits late for the pack launch
    that took the split sum's place (it releases the GEMM, then waits for the shrink), bit for bit the
    plain launches over graph replays with new x, routing and slots, and the fp32 oracle's values."""
    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_ext", "1")
    (x, w13, w2, weights, ids), (lora, adapters, per_token) = overlap_case(name, m, rank, seed=12)
    num_experts, top_k = OVERLAP_SHAPES[name][:2]
    events = record_overlap_launches(monkeypatch)
    through_sum = fe.overlap_through_split_sum(m * top_k, rank)

    def layer():
        events.clear()
        return fe.fused_experts(x, w13, w2, weights, ids, lora=lora, lora_path="split")

    monkeypatch.setitem(LAUNCH_OVERRIDES, "prefill_shrink_overlap", "1")
    eager_overlap = layer()
    late = check_overlap_plan(events, overlap=True, through_sum=through_sum)
    assert [kind for kind, _ in events].count("pack") == 2 and late == [through_sum] * 2, events
    ref = reference_moe_grouped(x, w13, w2, weights, ids, adapters=adapters, token_adapter=per_token)
    err = rel_err(eager_overlap, ref)
    assert torch.isfinite(eager_overlap).all() and err <= TOL[BF16], f"rel L2 vs fp32 oracle {err:.2e}"
    replays_match_plain_launches(
        monkeypatch, layer, x, ids, lora, num_experts, seed=13,
        check_plain=lambda: check_overlap_plan(events, overlap=False, through_sum=through_sum))


@gpu
@pytest.mark.parametrize(("name", "m", "rank"), PREFILL_OVERLAP_POINTS)
@pytest.mark.parametrize("reduce", ["0", "1", "one-split", "slot-programs"], ids=[
    "partials-in-gemm", "split-sum-launch", "one-split-shrink", "slot-program-shrink"])
def test_gpu_prefill_shrink_overlap_bit_equal_over_replays(monkeypatch, name, m, rank, reduce):
    """Past decode, with ``prefill_shrink_overlap=1``: each GEMM launched dependently on the shrink
    before it (waiting for it after its K-loop) gives bit for bit what the plain launches give, in graph
    replays with new x, routing and token slots each time (a replay that read the previous replay's
    partials would differ); also with a split-sum launch between a shrink and its GEMM (it releases the
    GEMM, then waits for the shrink). The epilogues read the partials (the slot-range expand's pack launch
    has a test of its own)."""
    # "one-split": each shrink walks all of K (``one_split_shrink``), so no split sum follows it;
    # "slot-programs": likewise, a program per slot of each block (``slot_program_shrink``).
    one_pass = reduce in ("one-split", "slot-programs")
    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_reduce_splits", "1" if one_pass else reduce)
    monkeypatch.setitem(LAUNCH_OVERRIDES, "one_split_shrink", "1" if reduce == "one-split" else "0")
    monkeypatch.setitem(LAUNCH_OVERRIDES, "slot_program_shrink", "1" if reduce == "slot-programs" else "0")
    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_ext", "0")
    (x, w13, w2, weights, ids), (lora, adapters, per_token) = overlap_case(name, m, rank, seed=7)
    num_experts, top_k = OVERLAP_SHAPES[name][:2]
    events = record_overlap_launches(monkeypatch)
    through_sum = fe.overlap_through_split_sum(m * top_k, rank)

    def layer():
        events.clear()
        return fe.fused_experts(x, w13, w2, weights, ids, lora=lora, lora_path="split")

    monkeypatch.setitem(LAUNCH_OVERRIDES, "prefill_shrink_overlap", "1")
    eager_overlap = layer()
    # Each GEMM overlaps its shrink; past a split-sum launch only from enough pairs (small: 160) or rank on.
    late = check_overlap_plan(events, overlap=True, through_sum=through_sum)
    if reduce != "1" or rank == 64:  # no split-sum launch, or overlapped through it: both GEMMs wait late
        assert late == [True, True], events
    if one_pass:
        assert "reduce" not in [kind for kind, _ in events], events
    if reduce == "1" and name != "small":  # 384 / 1800 / 2400 pairs; K 2048 / 1408: the shrinks split K
        assert through_sum and ("reduce", True) in events, events
    ref = reference_moe_grouped(x, w13, w2, weights, ids, adapters=adapters, token_adapter=per_token)
    err = rel_err(eager_overlap, ref)
    assert torch.isfinite(eager_overlap).all() and err <= TOL[BF16], f"rel L2 vs fp32 oracle {err:.2e}"
    replays_match_plain_launches(
        monkeypatch, layer, x, ids, lora, num_experts, seed=11,
        check_plain=lambda: check_overlap_plan(events, overlap=False, through_sum=through_sum))


# Past decode (M=45 x top-4 = 180 pairs, 97 x top-2, 150 x top-1), the LoRA launches apart from the GEMMs on
# pairs grouped by (expert, adapter): the split path's shrinks, every LoRA launch of the staged path. 12
# adapters of ranks 1-16 (slot 1 idle), a fifth of the tokens without one, an expert id outside [0, E) (the
# null run), a routed scaling factor, and the routing weight on the input for one case. Each row's shrink
# and gate/up expand are its own dots whichever block holds it (the K splits may differ); the staged down
# delta joins GEMM2's rows before the top-k sum instead of after it (another rounding order).
@pytest.mark.parametrize("m, top_k, on_input", [(45, 4, False), (97, 2, True), (150, 1, False)])
@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("path", ["staged", "split"])
@interpreter
def test_lora_by_adapter_matches_the_oracle(monkeypatch, m, top_k, on_input, dtype, path):
    from triton_ops import plan

    num_experts, hidden, inter = 9, 48, 40
    x, w13, w2, weights, ids = make_inputs(m, num_experts, top_k, hidden, inter, dtype, seed=m)
    ids[3, 0] = num_experts + 2  # the null run: contributes nothing on both alignments
    ranks = (16, 8, 1, 3, 16, 8, 5, 16, 2, 12, 16, 7)
    rng = torch.Generator().manual_seed(m)
    choice = torch.randint(-3, len(ranks), (m,), generator=rng).tolist()
    adapter_slots = (0, *range(2, len(ranks) + 1))
    slots = [adapter_slots[c] if c >= 0 else -1 for c in choice]
    lora, adapters, per_token = lora_inputs(m, num_experts, hidden, inter, dtype, seed=m, ranks=ranks,
                                            slots_per_token=slots)
    taken = []
    original = fe.align_by_adapter
    monkeypatch.setattr(fe, "align_by_adapter", lambda *a, **kw: taken.append(a[2]) or original(*a, **kw))
    kwargs = dict(routed_scaling_factor=1.5, apply_router_weight_on_input=on_input)
    outs = {}
    for by_adapter in ("0", "1"):
        monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_by_adapter", by_adapter)
        outs[by_adapter] = fe.fused_experts(x, w13, w2, weights, ids, lora=lora, lora_path=path, **kwargs)
    assert taken == [plan.ADAPTER_BLOCK_M]  # only the forced run grouped the pairs by adapter
    ref = reference_moe(x.float(), w13.float(), w2.float(), weights, ids, adapters=adapters,
                        token_adapter=per_token, **kwargs)
    for out in outs.values():
        assert torch.isfinite(out).all()
        assert rel_err(out.float(), ref) <= TOL[dtype]
    if dtype == F32:
        torch.testing.assert_close(outs["1"], outs["0"], rtol=1e-5, atol=1e-6)


# The staged path on (expert, adapter) blocks with each expand program walking all of a block's columns
# (``expand_whole_rows``) against one 64-column tile a program: the same tiles, partial sums and dots in
# the same order, so the same bits. N spans whole and partial tiles (gate/up 80, down 130); 12 adapters, a
# fifth of the tokens without one, the routing weight on the input for one case.
@pytest.mark.parametrize("m, top_k, on_input, dtype, device", [
    pytest.param(45, 4, False, F32, "cpu", marks=interpreter, id="fp32"),
    pytest.param(97, 2, True, F16, "cpu", marks=interpreter, id="fp16-on_input"),
    pytest.param(45, 4, False, BF16, "cuda", marks=pytest.mark.gpu, id="bf16-cuda"),
    pytest.param(97, 2, True, BF16, "cuda", marks=pytest.mark.gpu, id="bf16-cuda-on_input")])
def test_expands_walking_whole_rows_give_the_same_bits(monkeypatch, m, top_k, on_input, dtype, device):
    from triton_ops import moe_lora

    num_experts, hidden, inter = 9, 130, 80
    x, w13, w2, weights, ids = make_inputs(m, num_experts, top_k, hidden, inter, dtype, device=device, seed=m)
    ranks = (16, 8, 1, 3, 16, 8, 5, 16, 2, 12, 16, 7)
    rng = torch.Generator().manual_seed(m)
    choice = torch.randint(-3, len(ranks), (m,), generator=rng).tolist()
    adapter_slots = (0, *range(2, len(ranks) + 1))
    slots = [adapter_slots[c] if c >= 0 else -1 for c in choice]
    lora, _, _ = lora_inputs(m, num_experts, hidden, inter, dtype, seed=m, ranks=ranks, slots_per_token=slots,
                             device=device)
    cols = []
    real_launch = moe_lora.launch

    def spy(kernel, grid, **kwargs):
        if "cols_per_program" in kwargs:
            cols.append((kwargs["cols_per_program"], grid[0]))
        return real_launch(kernel, grid, **kwargs)

    monkeypatch.setattr(moe_lora, "launch", spy)
    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_by_adapter", "1")
    outs = {}
    for whole in ("0", "1"):
        monkeypatch.setitem(LAUNCH_OVERRIDES, "expand_whole_rows", whole)
        outs[whole] = fe.fused_experts(x, w13, w2, weights, ids, lora=lora, lora_path="staged",
                                       apply_router_weight_on_input=on_input)
    # gate/up then down, one tile a program, then whole rows (a third of the programs for down's 3 tiles)
    assert [c for c, _ in cols] == [64, 64, 128, 192]
    assert cols[0][1] == 2 * cols[2][1] and cols[1][1] == 3 * cols[3][1]
    assert torch.isfinite(outs["1"]).all()
    assert torch.equal(outs["1"], outs["0"])
