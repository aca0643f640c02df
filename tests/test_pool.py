"""Tests of the adapter memory pool, the batch info and the vectorised PyTorch path (CPU, fp32).

The pool + :func:`moe_lora_forward_torch` are checked against the loop-based oracle
:func:`moelora.reference.reference_moe` fed the adapters' original tensors, so a wrong layout, a
rank-padding leak, a wrong per-module scaling or a wrong slot mapping all show up as a mismatch.
Shapes are small and odd on purpose (see the comment at each one).
"""

from __future__ import annotations

import math

import pytest
import torch

from moelora.batch_info import MoELoRABatchInfo
from moelora.pool import AdapterLoadError, LoRALayerBuffers, MoELoRAMemoryPool
from moelora.reference import LoRAProjection, ReferenceLoRA, reference_moe, reference_moe_from_pool
from moelora.torch_path import moe_lora_forward_torch

F32 = torch.float32

# H=48, I=40: not powers of two and H != I, so a swapped gate/up/down shape or an H/I mix-up fails.
# E=6: not a power of two; with top-k 6 every token visits every expert.
H, I, E = 48, 40, 6  # noqa: E741  (I = intermediate size, as in docs/design.md)
# Layer ids 3 and 7: non-contiguous model indices (DeepSeek's first layers are dense), so a pool that
# indexes its layers by position instead of by id fails.
LAYERS = (3, 7)
# max_rank 16 with adapters of rank 4/8/16 and 2: padding beyond the real rank is exercised.
MAX_RANK = 16
DIMS = {"gate": (H, I), "up": (H, I), "down": (I, H)}  # (in, out)


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def make_base(m, experts=E, dtype=F32):
    x = torch.randn(m, H, dtype=dtype)
    w13 = torch.randn(experts, 2 * I, H, dtype=dtype) / H**0.5
    w2 = torch.randn(experts, H, I, dtype=dtype) / I**0.5
    return x, w13, w2


def make_routing(m, experts=E, top_k=2, avoid=()):
    """Distinct experts per token, never an expert in ``avoid``; weights not normalised."""
    allowed = torch.tensor([e for e in range(experts) if e not in avoid])
    ids = torch.stack([allowed[torch.randperm(len(allowed))[:top_k]] for _ in range(m)]).to(torch.int32)
    weights = torch.rand(m, top_k) + 0.25
    return weights, ids


def make_proj(rank, proj, scaling):
    """A LoRA whose delta is of the order of the base weight, so nonlinear effects are visible."""
    in_f, out_f = DIMS[proj]
    return LoRAProjection(
        a=torch.randn(rank, in_f) / in_f**0.5, b=torch.randn(out_f, rank) / rank**0.5, scaling=scaling
    )


def make_adapter(rank, scaling, experts=range(E), modules=("gate", "up", "down"), pattern=None):
    """``pattern``: {(expert, module): (rank, scaling)} overrides, like PEFT's rank/alpha_pattern."""
    lora = ReferenceLoRA()
    pattern = pattern or {}
    for e in experts:
        for mod in modules:
            r, s = pattern.get((e, mod), (rank, scaling))
            getattr(lora, mod)[e] = make_proj(r, mod, s)
    return lora


def make_pool(max_loras=4, experts=E, dtype=F32, max_rank=MAX_RANK):
    return MoELoRAMemoryPool(
        num_experts=experts,
        hidden_size=H,
        intermediate_size=I,
        layer_ids=list(LAYERS),
        max_loras=max_loras,
        max_rank=max_rank,
        dtype=dtype,
        device="cpu",
    )


def three_adapters(experts=E):
    """Ranks 4/8/16 in a max-rank-16 pool, with per-module rank/scaling patterns and partial coverage.

    Returns {name: {layer_id: ReferenceLoRA}}.
    """
    last = experts - 1
    return {
        # plain: rank 4 everywhere, all experts and projections; other weights in layer 7.
        "a": {lid: make_adapter(4, 0.5, experts=range(experts)) for lid in LAYERS},
        # rank 8 with rank_pattern/alpha_pattern-style exceptions: some modules rank 2 with their
        # own scaling, one with a larger rank-8 scaling. Only layer 3: layer 7 gets no delta.
        "b": {
            3: make_adapter(
                8,
                2.0,
                experts=range(experts),
                pattern={(1, "gate"): (2, 0.75), (1, "down"): (2, 3.0), (last, "up"): (8, -1.25)},
            )
        },
        # rank 16 = max_rank, only gate+down, only some experts (the last one among them), and the
        # first module's scaling (expert 0 gate) differs from the rest.
        "c": {
            lid: make_adapter(
                16,
                0.125,
                experts=[0, 2, last],
                modules=("gate", "down"),
                pattern={(0, "gate"): (16, 0.4)},
            )
            for lid in LAYERS
        },
    }


def snapshot(pool):
    # The dense gather of every layer (what every slot reads), the raw arena rows behind it, and the
    # block table: byte for byte.
    bufs = {(lid, i): t.clone() for lid, b in pool.layers.items() for i, t in enumerate(b.dense().tensors())}
    bufs.update({("arena", i): w.data.clone() for i, w in enumerate(pool.layer(LAYERS[0]).tensors())})
    bufs["blocks"] = pool.blocks.clone()
    return (
        bufs,
        pool.slot_ranks.clone(),
        pool.slot_scalings.clone(),
        list(pool.slot_rank_host),
        list(pool.slot_scaling_host),
        dict(pool.adapter_slots),
        list(pool.slot_adapters),
    )


def assert_same_snapshot(a, b):
    bufs_a, *rest_a = a
    bufs_b, *rest_b = b
    assert bufs_a.keys() == bufs_b.keys()
    for k in bufs_a:
        assert torch.equal(bufs_a[k], bufs_b[k]), f"buffer {k} changed"
    assert torch.equal(rest_a[0], rest_b[0]) and torch.equal(rest_a[1], rest_b[1])
    assert rest_a[2:] == rest_b[2:]


def assert_close_scaled(got, want, tol=1e-5):
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=tol * max(scale, 1e-30))


def reference_for(pool, adapters_by_name, lid, batch, x, w13, w2, weights, ids, **kw):
    """reference_moe with the original adapter tensors, indexed by the pool's slots."""
    per_slot = [None] * pool.max_loras
    for name, layers in adapters_by_name.items():
        per_slot[pool.slot_of(name)] = layers.get(lid, ReferenceLoRA())
    return reference_moe(x, w13, w2, weights, ids, adapters=per_slot, token_adapter=batch.token_slots, **kw)


# --------------------------------------------------------------------------------------------------
# Pool + torch path vs the oracle
# --------------------------------------------------------------------------------------------------


# E=6 with top-k 1/2/6 (6 = every expert); E=64 top-k 2/6: most experts get no token at all.
@pytest.mark.parametrize("experts,top_k", [(6, 1), (6, 2), (6, 6), (64, 2), (64, 6)])
def test_torch_path_matches_reference(experts, top_k):
    pool = make_pool(experts=experts)
    adapters = three_adapters(experts)
    for name, layers in adapters.items():
        pool.add_adapter_weights(name, layers)
    assert [pool.slot_of(n) for n in "abc"] == [0, 1, 2]
    assert pool.slot_rank_host[:3] == [4, 8, 16]
    # slot scaling = the first module's (layer 3, expert 0, gate), others rescaled into B.
    assert pool.slot_scaling_host[:3] == [0.5, 2.0, 0.4]

    # 13 tokens (prime) in 7 sequences, with no-adapter sequences between adapter ones.
    names = ["a", None, "b", "c", None, "a", "b"]
    seq_lens = [3, 1, 2, 1, 2, 2, 2]
    batch = pool.prepare_batch(names, seq_lens)
    m = sum(seq_lens)
    x, w13, w2 = make_base(m, experts)
    # The last expert is never routed to when top-k < E, although every adapter has weights there.
    avoid = () if top_k == experts else (experts - 1,)
    weights, ids = make_routing(m, experts, top_k, avoid=avoid)
    if top_k > 1:
        ids[4, 1] = -1  # an expert filtered out (expert parallelism): contributes nothing

    for lid in LAYERS:
        got = moe_lora_forward_torch(x, w13, w2, weights, ids, pool.layer(lid), batch)
        want = reference_for(pool, adapters, lid, batch, x, w13, w2, weights, ids)
        assert got.dtype == F32
        assert_close_scaled(got, want)
        # The pool-layout oracle reads the same buffers the torch path does.
        buf = pool.layer(lid)
        want_pool = reference_moe_from_pool(
            x, w13, w2, weights, ids, batch.token_slots, *buf.dense().tensors(), pool.slot_ranks,
            pool.slot_scalings,
        )
        assert_close_scaled(got, want_pool)

        # Tokens without an adapter get exactly the base output.
        base = moe_lora_forward_torch(x, w13, w2, weights, ids, None, None)
        no_lora = batch.token_slots < 0
        assert torch.equal(got[no_lora], base[no_lora])
        # ... and the adapters do change the others (the test would be vacuous otherwise).
        assert (got[~no_lora] - base[~no_lora]).abs().max() > 1e-2 * base.abs().max()


# rsf != 1, weight on the input (top-k 1 as in Llama-4), and the exact-erf gelu.
@pytest.mark.parametrize(
    "kw,top_k",
    [
        ({"routed_scaling_factor": 2.5}, 2),
        ({"apply_router_weight_on_input": True}, 1),
        ({"activation": "gelu", "routed_scaling_factor": 0.75}, 6),
    ],
)
def test_torch_path_options(kw, top_k):
    pool = make_pool()
    adapters = three_adapters()
    for name, layers in adapters.items():
        pool.add_adapter_weights(name, layers)
    batch = pool.prepare_batch(["c", None, "a", "b"], [2, 3, 1, 3])  # 9 tokens
    x, w13, w2 = make_base(9)
    weights, ids = make_routing(9, top_k=top_k)
    got = moe_lora_forward_torch(x, w13, w2, weights, ids, pool.layer(3), batch, **kw)
    want = reference_for(pool, adapters, 3, batch, x, w13, w2, weights, ids, **kw)
    assert_close_scaled(got, want)


def test_no_adapter_batch_is_exactly_base():
    pool = make_pool()
    for name, layers in three_adapters().items():
        pool.add_adapter_weights(name, layers)
    batch = pool.prepare_batch([None, None, None], [4, 1, 6])  # 11 tokens, no adapter at all
    assert not batch.has_lora and batch.max_rank == 0 and batch.slots_used == ()
    x, w13, w2 = make_base(11)
    weights, ids = make_routing(11, top_k=2)
    base = moe_lora_forward_torch(x, w13, w2, weights, ids, None, None)
    assert torch.equal(moe_lora_forward_torch(x, w13, w2, weights, ids, pool.layer(7), batch), base)
    assert torch.equal(moe_lora_forward_torch(x, w13, w2, weights, ids, pool.layer(7), None), base)
    assert_close_scaled(base, reference_moe(x, w13, w2, weights, ids))


def test_bf16_pool_and_activations():
    # bf16 pool + bf16 activations: the output is bf16 and close to the fp32 oracle of the same
    # (bf16-rounded) weights.
    pool = make_pool(dtype=torch.bfloat16)
    adapters = three_adapters()
    for name, layers in adapters.items():
        pool.add_adapter_weights(name, layers)
    batch = pool.prepare_batch(["a", "b", None, "c"], [2, 2, 1, 2])
    x, w13, w2 = make_base(7)
    weights, ids = make_routing(7, top_k=2)
    got = moe_lora_forward_torch(
        x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids, pool.layer(3), batch
    )
    assert got.dtype == torch.bfloat16
    want = reference_moe_from_pool(
        x.bfloat16(),
        w13.bfloat16(),
        w2.bfloat16(),
        weights,
        ids,
        batch.token_slots,
        *pool.layer(3).dense().tensors(),
        pool.slot_ranks,
        pool.slot_scalings,
    )
    assert_close_scaled(got.float(), want, tol=1e-2)


# --------------------------------------------------------------------------------------------------
# Slot layout, reuse
# --------------------------------------------------------------------------------------------------


def test_layout_and_per_module_scaling():
    pool = make_pool()
    lora = make_adapter(8, 2.0, experts=[1], pattern={(1, "up"): (4, 0.5)})
    slot = pool.add_adapter_weights("x", {7: lora})
    buf, R = pool.layer(7).dense(), MAX_RANK
    assert torch.equal(buf.gate_up_a[slot, 1, :8], lora.gate[1].a)
    assert torch.equal(buf.gate_up_a[slot, 1, R : R + 4], lora.up[1].a)
    assert torch.equal(buf.gate_up_b[slot, 1, :I, :8], lora.gate[1].b)
    # up's own scaling 0.5 is folded into its B: 0.5 / 2.0 of it, in the slot scaling 2.0.
    assert torch.equal(buf.gate_up_b[slot, 1, I:, :4], lora.up[1].b * 0.25)
    assert torch.equal(buf.down_a[slot, 1, :8], lora.down[1].a)
    assert torch.equal(buf.down_b[slot, 1, :, :8], lora.down[1].b)
    assert pool.slot_rank_host[slot] == 8 and int(pool.slot_ranks[slot]) == 8
    assert pool.slot_scaling_host[slot] == 2.0 and float(pool.slot_scalings[slot]) == 2.0
    # Nothing else of the slot is written: layer 3 and every other expert are zero, and point at the
    # zero block; only (layer 7, expert 1) has arena rows.
    assert all(not t[slot].any() for t in pool.layer(3).dense().tensors())
    mask = torch.ones(E, dtype=torch.bool)
    mask[1] = False
    assert all(not t[slot, mask].any() for t in buf.tensors())
    assert not pool.layer(3).blocks[slot].any() and not pool.layer(7).blocks[slot, mask].any()
    assert pool.layer(7).blocks[slot, 1] > 0
    assert not buf.gate_up_a[slot, 1, 8:R].any() and not buf.gate_up_a[slot, 1, R + 4 :].any()


def test_slot_reuse_leaves_no_stale_weights():
    pool = make_pool(max_loras=2)
    ptrs = (pool.slot_ranks.data_ptr(), pool.slot_scalings.data_ptr())
    other = {lid: make_adapter(8, 1.0) for lid in LAYERS}
    pool.add_adapter_weights("other", other)  # slot 0
    big = {lid: make_adapter(16, 0.3) for lid in LAYERS}
    slot = pool.add_adapter_weights("big", big)
    assert slot == 1
    pool.unload_adapter("big")
    assert "big" not in pool and pool.adapters() == ["other"]
    assert pool.slot_rank_host[slot] == 0 and int(pool.slot_ranks[slot]) == 0
    # The emptied slot reads zeros everywhere: every (layer, expert) of it points at the zero block.
    assert not pool.blocks[:, slot].any()
    assert all(not t[slot].any() for lid in LAYERS for t in pool.layer(lid).dense().tensors())

    # The new adapter covers fewer experts, only gate/up, and only layer 3.
    small = {3: make_adapter(4, 0.7, experts=[0, 3], modules=("gate", "up"))}
    assert pool.add_adapter_weights("small", small) == slot
    assert (pool.slot_ranks.data_ptr(), pool.slot_scalings.data_ptr()) == ptrs
    assert pool.slot_rank_host[slot] == 4 and int(pool.slot_ranks[slot]) == 4
    R = MAX_RANK
    buf3 = pool.layer(3).dense()
    assert not buf3.gate_up_a[slot, :, 4:R].any() and not buf3.gate_up_a[slot, :, R + 4 :].any()
    assert not buf3.gate_up_b[slot, :, :, 4:].any()
    assert not buf3.down_a[slot].any() and not buf3.down_b[slot].any()
    for e in (1, 2, 4, 5):
        assert all(not t[slot, e].any() for t in buf3.tensors())
    assert all(not t[slot].any() for t in pool.layer(7).dense().tensors())
    # Layer 7 and the untrained experts of layer 3 point at the zero block.
    assert not pool.layer(7).blocks[slot].any()
    assert not pool.layer(3).blocks[slot, [1, 2, 4, 5]].any() and pool.layer(3).blocks[slot, [0, 3]].all()

    adapters = {"other": other, "small": small}
    batch = pool.prepare_batch(["small", None, "other", "small"], [3, 2, 2, 4])
    x, w13, w2 = make_base(11)
    weights, ids = make_routing(11, top_k=2)
    for lid in LAYERS:
        got = moe_lora_forward_torch(x, w13, w2, weights, ids, pool.layer(lid), batch)
        assert_close_scaled(got, reference_for(pool, adapters, lid, batch, x, w13, w2, weights, ids))


def test_rank_zero_and_empty_adapter():
    pool = make_pool()
    # A rank-0 module contributes nothing and does not decide the slot scaling.
    lora = ReferenceLoRA(gate={0: make_proj(0, "gate", 9.0)}, up={0: make_proj(3, "up", 0.5)})
    slot = pool.add_adapter_weights("z", {3: lora})
    assert pool.slot_rank_host[slot] == 3 and pool.slot_scaling_host[slot] == 0.5
    slot = pool.add_adapter_weights("empty", {})
    assert pool.slot_rank_host[slot] == 0
    batch = pool.prepare_batch(["empty"], [2])
    assert batch.has_lora and batch.max_rank == 0


# --------------------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------------------


def _full_adapter():
    return {lid: make_adapter(8, 0.5) for lid in LAYERS}


def _corrupt_last(fn):
    """A valid adapter whose LAST module (layer 7, expert E-1, down) is replaced by ``fn(proj)``.

    Everything before it is valid, so a pool that writes while validating would be caught.
    """

    def build():
        layers = _full_adapter()
        layers[7].down[E - 1] = fn(layers[7].down[E - 1])
        return layers

    return build


def _with(layers_fn):
    def build():
        layers = _full_adapter()
        layers_fn(layers)
        return layers

    return build


def _nan_b(p):
    b = p.b.clone()
    b[3, 1] = float("nan")
    return LoRAProjection(p.a, b, p.scaling)


def _inf_a(p):
    a = p.a.clone()
    a[0, 0] = float("inf")
    return LoRAProjection(a, p.b, p.scaling)


REFUSALS = [
    ("bad layer id", _with(lambda ls: ls.__setitem__(99, make_adapter(4, 0.5))), ["layer 99", "[3, 7]"]),
    ("expert >= E", _with(lambda ls: ls[7].up.__setitem__(E, make_proj(4, "up", 0.5))), ["up", "expert 6"]),
    (
        "negative expert",
        _with(lambda ls: ls[3].gate.__setitem__(-1, make_proj(4, "gate", 0.5))),
        ["gate", "expert -1"],
    ),
    (
        "wrong A shape",
        _corrupt_last(lambda p: LoRAProjection(torch.randn(8, H), p.b, p.scaling)),
        ["layer 7 expert 5 down", "wrong shape (8, 48)", "(r, 40)"],
    ),
    (
        "wrong B shape",
        _corrupt_last(lambda p: LoRAProjection(p.a, torch.randn(I, 8), p.scaling)),
        ["layer 7 expert 5 down", "wrong shape (40, 8)", "(48, r)"],
    ),
    (
        "rank > max_rank",
        _corrupt_last(lambda p: make_proj(17, "down", 0.5)),
        ["layer 7 expert 5 down", "rank 17", "max_rank 16"],
    ),
    (
        "a/b rank mismatch",
        _corrupt_last(lambda p: LoRAProjection(torch.randn(4, I), torch.randn(H, 5), p.scaling)),
        ["rank mismatch", "rank 4", "rank 5"],
    ),
    ("NaN", _corrupt_last(_nan_b), ["layer 7 expert 5 down", "B", "NaN"]),
    ("Inf", _corrupt_last(_inf_a), ["layer 7 expert 5 down", "A", "Inf"]),
    (
        "non-float",
        _corrupt_last(lambda p: LoRAProjection(torch.ones(8, I, dtype=torch.int32), p.b, p.scaling)),
        ["layer 7 expert 5 down", "float", "int32"],
    ),
    ("NaN scaling", _corrupt_last(lambda p: LoRAProjection(p.a, p.b, math.nan)), ["scaling", "finite"]),
    ("not a LoRAProjection", _corrupt_last(lambda p: (p.a, p.b)), ["LoRAProjection", "tuple"]),
    ("not a ReferenceLoRA", _with(lambda ls: ls.__setitem__(3, {})), ["layer 3", "ReferenceLoRA"]),
]


@pytest.fixture
def loaded_pool():
    """A pool with one adapter ('base', slot 0), a batch using it, and that batch's output."""
    pool = make_pool(max_loras=3)
    pool.add_adapter_weights("base", {lid: make_adapter(6, 1.5) for lid in LAYERS})
    batch = pool.prepare_batch(["base", None], [4, 3])
    x, w13, w2 = make_base(7)
    weights, ids = make_routing(7, top_k=2)

    def run():
        return moe_lora_forward_torch(x, w13, w2, weights, ids, pool.layer(7), batch)

    return pool, run, run()


@pytest.mark.parametrize("label,build,fragments", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals_leave_pool_unchanged(loaded_pool, label, build, fragments):
    pool, run, out_before = loaded_pool
    # A previously used-then-freed slot 1 holds stale bytes: the refusal must not touch them either.
    pool.add_adapter_weights("tmp", {lid: make_adapter(16, 0.2) for lid in LAYERS})
    pool.unload_adapter("tmp")
    before = snapshot(pool)
    with pytest.raises(AdapterLoadError) as info:
        pool.add_adapter_weights("new", build())
    assert isinstance(info.value, ValueError)
    msg = str(info.value)
    for frag in fragments:
        assert frag in msg, f"{label}: {frag!r} not in {msg!r}"
    assert "'new'" in msg  # names the adapter
    assert_same_snapshot(before, snapshot(pool))
    assert "new" not in pool
    assert torch.equal(run(), out_before)


def test_duplicate_name_and_full_pool_refused(loaded_pool):
    pool, run, out_before = loaded_pool
    before = snapshot(pool)
    with pytest.raises(AdapterLoadError, match="'base' is already loaded"):
        pool.add_adapter_weights("base", _full_adapter())
    assert_same_snapshot(before, snapshot(pool))

    pool.add_adapter_weights("two", _full_adapter())
    pool.add_adapter_weights("three", _full_adapter())
    # Nothing evictable: "base" pinned, "two" and "three" used by a live batch.
    pool.pin("base")
    live = pool.prepare_batch(["two", "three"])
    before = snapshot(pool)
    with pytest.raises(AdapterLoadError, match=r"all 3 slots hold adapters that are pinned or used by live"):
        pool.add_adapter_weights("four", _full_adapter())
    assert_same_snapshot(before, snapshot(pool))
    assert torch.equal(run(), out_before)
    # Released, "two" is the least recently used evictable adapter and gives its slot to "four".
    live.release()
    slot_two = pool.slot_of("two")
    assert pool.add_adapter_weights("four", _full_adapter()) == slot_two
    assert "two" not in pool and pool.is_resident("base") and pool.is_resident("three")


def test_fp16_overflow_refused():
    # 1e6 fits fp32 but not fp16 (max 65504): refused rather than stored as Inf.
    pool = make_pool(dtype=torch.float16)
    before = snapshot(pool)
    p = make_proj(4, "gate", 0.5)
    lora = ReferenceLoRA(gate={2: LoRAProjection(p.a, p.b * 1e6, 0.5)})
    overflow = r"layer 3 expert 2 gate: LoRA B overflows the pool dtype float16"
    with pytest.raises(AdapterLoadError, match=overflow):
        pool.add_adapter_weights("big", {3: lora})
    assert_same_snapshot(before, snapshot(pool))


# --------------------------------------------------------------------------------------------------
# prepare_batch
# --------------------------------------------------------------------------------------------------


def _pool_with_abc():
    pool = make_pool()
    for name, layers in three_adapters().items():
        pool.add_adapter_weights(name, layers)
    return pool


def test_prepare_batch_expansion_and_fields():
    pool = _pool_with_abc()  # a -> 0 (rank 4), b -> 1 (rank 8), c -> 2 (rank 16)
    batch = pool.prepare_batch(["b", None, "a", "b"], [2, 3, 1, 0])
    assert isinstance(batch, MoELoRABatchInfo)
    assert batch.token_slots.dtype == torch.int32 and batch.token_slots.device == pool.slot_ranks.device
    assert batch.token_slots.tolist() == [1, 1, -1, -1, -1, 0]
    assert batch.num_tokens == 6
    assert batch.has_lora and batch.max_rank == 8 and batch.slots_used == (0, 1)
    assert batch.adapter_names == ("b", None, "a", "b") and batch.seq_lens == (2, 3, 1, 0)
    assert batch.slot_ranks is pool.slot_ranks and batch.slot_scalings is pool.slot_scalings

    # Default: one token per sequence (decode). A 0-length sequence's adapter is not "used".
    dec = pool.prepare_batch(["c", None, "a"])
    assert dec.token_slots.tolist() == [2, -1, 0] and dec.seq_lens == (1, 1, 1)
    assert dec.max_rank == 16 and dec.slots_used == (0, 2)
    assert pool.prepare_batch(["c"], [0]).has_lora is False

    empty = pool.prepare_batch([])
    assert empty.num_tokens == 0 and empty.token_slots.shape == (0,) and not empty.has_lora


def test_prepare_batch_errors():
    pool = _pool_with_abc()
    unknown = r"unknown adapter\(s\) \['zz'\]; loaded adapters: \['a', 'b', 'c'\]"
    with pytest.raises(ValueError, match=unknown):
        pool.prepare_batch(["a", "zz"])
    with pytest.raises(ValueError, match="seq_lens has 1 entries for 2 sequences"):
        pool.prepare_batch(["a", None], [3])
    with pytest.raises(ValueError, match="non-negative ints"):
        pool.prepare_batch(["a"], [-1])
    with pytest.raises(ValueError, match="not a str"):
        pool.prepare_batch("a")


def test_prepare_batch_out_in_place():
    pool = _pool_with_abc()
    batch = pool.prepare_batch(["a", None], [3, 2])
    tensor, ptr = batch.token_slots, batch.token_slots.data_ptr()
    new = pool.prepare_batch([None, "c", "b"], [1, 1, 3], out=batch)
    assert new is batch and new.token_slots is tensor and new.token_slots.data_ptr() == ptr
    assert tensor.tolist() == [-1, 2, 1, 1, 1]
    assert new.max_rank == 16 and new.slots_used == (1, 2) and new.has_lora
    assert new.adapter_names == (None, "c", "b") and new.seq_lens == (1, 1, 3)

    cleared = pool.prepare_batch([None], [5], out=batch)
    assert tensor.tolist() == [-1] * 5 and not cleared.has_lora and cleared.max_rank == 0
    assert cleared.slots_used == ()

    with pytest.raises(ValueError, match="out= holds 5 tokens but this batch has 4"):
        pool.prepare_batch(["a"], [4], out=batch)
    assert tensor.tolist() == [-1] * 5


def test_prepare_batch_out_unchanged_mapping():
    """The same names again (a decode step whose rows did not change) keep the batch as it is, still
    touching its adapters for the LRU; once a slot of it changed, the batch is rebuilt."""
    pool = _pool_with_abc()
    batch = pool.prepare_batch(["a", None, "c", "a"])
    tensor = batch.token_slots
    state = (tensor.tolist(), batch.slots_used, batch.slot_generations, pool.state().users)
    pool.prepare_batch(["b"], [1])  # b becomes the most recent
    again = pool.prepare_batch(["a", None, "c", "a"], out=batch)
    assert again is batch and (tensor.tolist(), batch.slots_used, batch.slot_generations,
                                pool.state().users) == state
    assert pool.state().resident[-2:] == ("a", "c"), "the batch's adapters were touched"
    # c unloaded and loaded again (another slot generation, maybe another slot): the same names rebuild.
    pool.unload_adapter("c")
    pool.add_adapter_weights("c", three_adapters()["c"])
    refreshed = pool.prepare_batch(["a", None, "c", "a"], out=batch)
    assert pool.is_current(refreshed)
    assert tensor.tolist() == [pool.slot_of("a"), -1, pool.slot_of("c"), pool.slot_of("a")]


# --------------------------------------------------------------------------------------------------
# Pool construction, queries
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"num_experts": 0}, r"num_experts must be a positive int, got 0"),
        ({"hidden_size": -4}, r"hidden_size must be a positive int, got -4"),
        ({"intermediate_size": 40.0}, r"intermediate_size must be a positive int, got 40.0"),
        ({"max_loras": 0}, r"max_loras must be a positive int"),
        ({"max_rank": True}, r"max_rank must be a positive int, got True"),
        ({"dtype": torch.float64}, r"dtype must be one of \['float32', 'float16', 'bfloat16'\]"),
        ({"dtype": torch.int8}, r"dtype must be one of"),
        ({"layer_ids": []}, r"at least one MoE layer"),
        ({"layer_ids": [1, 2, 1]}, r"layer_ids must be unique, \[1\] appear"),
        ({"layer_ids": [1, -2]}, r"non-negative ints, got \[-2\]"),
        ({"layer_ids": [1, "2"]}, r"non-negative ints, got \['2'\]"),
        ({"layer_ids": 3}, r"layer_ids must be a sequence of ints"),
    ],
)
def test_constructor_validation(kw, match):
    args = {
        "num_experts": E,
        "hidden_size": H,
        "intermediate_size": I,
        "layer_ids": [1],
        "max_loras": 2,
        "max_rank": 4,
        "dtype": F32,
        "device": "cpu",
    }
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        MoELoRAMemoryPool(**args)


def test_pool_basics():
    pool = make_pool(max_loras=3, dtype=torch.bfloat16)
    assert pool.layer_ids == LAYERS and pool.dtype == torch.bfloat16 and pool.device == torch.device("cpu")
    L, R = 3, MAX_RANK
    # One unit = one rank row of the four matrices of one (layer, expert): gate/up A (2H), gate/up B^T
    # (2I), down A (I), down B^T (H), in bf16.
    assert pool.unit_bytes == 3 * (H + I) * 2
    # The default arena holds L adapters of max_rank training every expert of every layer (the dense
    # layout's size), plus the zero block (R units) and a tail of max(16, R) units.
    capacity = L * len(LAYERS) * E * R
    assert pool._units.total_units - pool._units.reserved_units == capacity
    assert pool.nbytes == (R + capacity + max(16, R)) * pool.unit_bytes
    report = pool.memory_report()
    assert report.arena_bytes == pool.nbytes and report.used_bytes == 0
    assert report.free_bytes == capacity * pool.unit_bytes
    assert report.table_bytes == len(LAYERS) * L * E * 4
    assert pool.blocks.shape == (len(LAYERS), L, E) and pool.blocks.dtype == torch.int32
    buf = pool.layer(3)
    assert isinstance(buf, LoRALayerBuffers)
    assert buf.blocks.shape == (L, E) and not buf.blocks.any()
    assert [w.max_rank for w in buf.tensors()] == [R] * 4
    assert [w.cols for w in buf.tensors()] == [H, 2 * I, I, H]
    dense = buf.dense()
    assert dense.gate_up_a.shape == (L, E, 2 * R, H) and dense.gate_up_b.shape == (L, E, 2 * I, R)
    assert dense.down_a.shape == (L, E, R, I) and dense.down_b.shape == (L, E, H, R)
    assert all(t.dtype == torch.bfloat16 and not t.any() for t in dense.tensors())
    assert all(w.dtype == torch.bfloat16 and not w.data.any() for w in buf.tensors())
    assert pool.slot_ranks.dtype == torch.int32 and pool.slot_scalings.dtype == F32
    bad_layer = r"layer 4 is not a MoE layer of this pool; valid layer ids: \[3, 7\]"
    with pytest.raises(ValueError, match=bad_layer):
        pool.layer(4)

    pool.add_adapter_weights("p", {3: make_adapter(2, 1.0, experts=[0])})
    assert "p" in pool and "q" not in pool and pool.adapters() == ["p"] and pool.slot_of("p") == 0
    with pytest.raises(ValueError, match=r"adapter 'q' is not loaded; loaded adapters: \['p'\]"):
        pool.slot_of("q")
    with pytest.raises(ValueError, match="'q' is not loaded"):
        pool.unload_adapter("q")
    pool.unload_adapter("p")
    assert pool.adapters() == [] and pool.free_slots == [0, 1, 2]
