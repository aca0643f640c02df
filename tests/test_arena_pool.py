"""The pool's arena: adapters take their own rank's rows for the experts they train, every path reads
them through the block table, eviction makes room by bytes as well as by slots, and a storm of loads and
unloads of mixed-size adapters never serves a token another adapter's weights.

Each forward is checked against :func:`moelora.reference.reference_moe` fed the adapters' own tensors,
so a block table entry pointing at the wrong rows, a freed block read after reuse, or rows of a
neighbouring block read past a rank all show up as a mismatch.
"""

from __future__ import annotations

import random

import pytest
import torch

from moelora import FusedMoEWithLoRA
from moelora.pool import AdapterLoadError, MoELoRAMemoryPool
from moelora.reference import LoRAProjection, ReferenceLoRA, reference_moe

F32 = torch.float32

# H=24, I=20: H != I and neither a power of two, so a gate/up/down or B-transpose mix-up fails.
# E=5 (prime): an expert index used as a unit or a slot lands on the wrong rows.
H, I, E = 24, 20, 5  # noqa: E741  (I = intermediate size, as in docs/design.md)
# Non-contiguous model layer ids: a table indexed by id instead of position fails.
LAYERS = (1, 4)
DIMS = {"gate": (H, I), "up": (H, I), "down": (I, H)}  # (in, out)


def make_adapter(rank, experts, seed, layers=LAYERS, scaling=0.5, modules=("gate", "up", "down")):
    """{layer: ReferenceLoRA} training ``experts`` at ``rank``; deltas of the base weights' order."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for lid in layers:
        lora = ReferenceLoRA()
        for e in experts:
            for mod in modules:
                in_f, out_f = DIMS[mod]
                getattr(lora, mod)[e] = LoRAProjection(
                    a=torch.randn(rank, in_f, generator=gen) / in_f**0.5,
                    b=torch.randn(out_f, rank, generator=gen) / rank**0.5, scaling=scaling)
        out[lid] = lora
    return out


def make_base(seed=0, dtype=F32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    w13 = {lid: (torch.randn(E, 2 * I, H, generator=gen) / H**0.5).to(device, dtype) for lid in LAYERS}
    w2 = {lid: (torch.randn(E, H, I, generator=gen) / I**0.5).to(device, dtype) for lid in LAYERS}
    return w13, w2


def make_pool(max_loras=4, max_rank=16, arena_bytes=None, dtype=F32, device="cpu"):
    return MoELoRAMemoryPool(num_experts=E, hidden_size=H, intermediate_size=I, layer_ids=list(LAYERS),
                             max_loras=max_loras, max_rank=max_rank, dtype=dtype, device=device,
                             arena_bytes=arena_bytes)


def check_forward(pool, weights_of, names, base, *, path="torch", seed=0, tol=2e-4):
    """A mixed batch of ``names`` (None: no adapter) through every layer on ``path``, against the
    reference fed each adapter's own tensors. Routing covers every expert, trained or not. fp32: every
    element within ``tol``; bf16: the relative L2 error within ``tol`` (a wrong block is off by O(1))."""
    w13, w2 = base
    gen = torch.Generator().manual_seed(seed)
    dev, dtype = w13[LAYERS[0]].device, w13[LAYERS[0]].dtype
    m, top_k = len(names), 3
    x = torch.randn(m, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(m)]).to(torch.int32)
    topk_weights = torch.rand(m, top_k, generator=gen) + 0.25
    batch = pool.prepare_batch(list(names))
    for lid in LAYERS:
        layer = FusedMoEWithLoRA(w13[lid], w2[lid], pool=pool, layer_id=lid, path=path)
        got = layer(x.to(dev, dtype), topk_weights.to(dev), ids.to(dev), batch).float().cpu()
        adapters = [None if n is None else weights_of[n].get(lid) for n in names]
        want = reference_moe(x.to(dtype).float(), w13[lid].float().cpu(), w2[lid].float().cpu(), topk_weights,
                             ids, adapters=adapters, token_adapter=list(range(m)))
        if dtype == F32:
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        else:
            rel_l2 = float((got - want).norm() / want.norm())
            assert rel_l2 <= tol, f"layer {lid}, adapters {names}: relative L2 error {rel_l2:.3g} > {tol}"
    batch.release()


def test_adapters_take_their_own_rank_and_experts():
    """A rank-8 adapter of 2 experts in a max-rank-64 pool takes 2 x 2 blocks of 8 rows; untrained experts
    and other slots point at the zero block; a rank-12 adapter takes 12 rows a block, not 16."""
    pool = make_pool(max_rank=64)
    small = make_adapter(8, [1, 3], seed=1)
    odd = make_adapter(12, [0, 4], seed=2, layers=(4,))
    s_small = pool.add_adapter_weights("small", small)
    s_odd = pool.add_adapter_weights("odd", odd)
    report = {a.name: a for a in pool.memory_report().adapters}
    assert (report["small"].blocks, report["small"].bytes) == (4, 4 * 8 * pool.unit_bytes)
    assert (report["odd"].blocks, report["odd"].bytes) == (2, 2 * 12 * pool.unit_bytes)
    assert pool.memory_report().used_bytes == (4 * 8 + 2 * 12) * pool.unit_bytes
    for li in range(len(LAYERS)):
        row = pool.blocks[li, s_small]
        assert (row[[0, 2, 4]] == 0).all() and (row[[1, 3]] > 0).all()
    assert (pool.blocks[0, s_odd] == 0).all()  # layer 1: odd trains nothing there
    assert (pool.blocks[:, 2:] == 0).all()  # empty slots: the zero block
    dense = pool.layer(4).dense()
    torch.testing.assert_close(dense.gate_up_a[s_odd, 4, :12], odd[4].gate[4].a, rtol=0, atol=0)
    torch.testing.assert_close(dense.gate_up_b[s_odd, 4, I:, :12], odd[4].up[4].b, rtol=0, atol=0)
    torch.testing.assert_close(dense.down_b[s_odd, 4, :, :12], odd[4].down[4].b, rtol=0, atol=0)
    assert not dense.gate_up_a[s_odd, 4, 12:64].any() and not dense.down_a[s_odd, 1].any()
    check_forward(pool, {"small": small, "odd": odd}, ["small", "odd", None, "small", "odd"], make_base())


def test_each_layer_takes_its_own_rank():
    """rank_pattern across layers: rank 16 in layer 1, 4 in layer 4 (and one rank-2 module there). Layer 4's
    blocks take 4 rows, its table rank is 4, and both layers match the reference on every path."""
    pool = make_pool(max_rank=16)
    weights = make_adapter(16, range(E), seed=3, layers=(1,))
    weights.update(make_adapter(4, [0, 2], seed=4, layers=(4,)))
    weights[4].down[2] = make_adapter(2, [2], seed=5, layers=(4,), modules=("down",))[4].down[2]
    slot = pool.add_adapter_weights("p", weights)
    assert pool.layer_ranks[:, slot].tolist() == [16, 4] and int(pool.slot_ranks[slot]) == 16
    report = pool.memory_report().adapters[0]
    assert (report.blocks, report.bytes) == (E + 2, (E * 16 + 2 * 4) * pool.unit_bytes)
    dense = pool.layer(4).dense()
    torch.testing.assert_close(dense.down_b[slot, 2, :, :2], weights[4].down[2].b, rtol=0, atol=0)
    assert not dense.down_b[slot, 2, :, 2:].any() and not dense.gate_up_a[slot, 2, 4:16].any()
    base = make_base()
    for path in ("torch", "auto"):  # "auto": the Triton kernels in the interpreter
        check_forward(pool, {"p": weights}, ["p", None, "p"], base, path=path)


def test_default_arena_holds_max_loras_adapters_of_max_rank():
    """max_rank 12 (blocks aligned to 16): the default arena still fits max_loras full rank-12 adapters."""
    pool = make_pool(max_loras=3, max_rank=12)
    weights = {f"a{k}": make_adapter(12, range(E), seed=10 + k) for k in range(3)}
    for name, w in weights.items():
        pool.add_adapter_weights(name, w)
    assert pool.adapters() == list(weights)
    check_forward(pool, weights, ["a0", "a1", "a2", None], make_base())


def test_eviction_by_bytes_takes_the_least_recent_evictable():
    """An arena for two full rank-8 adapters and eight slots: a third evicts by bytes, never a pinned
    adapter or one a live batch uses; when nothing may go, the load is refused and nothing is evicted."""
    full = len(LAYERS) * E * 8  # units of one full rank-8 adapter
    pool = make_pool(max_loras=8, arena_bytes=2 * full * MoELoRAMemoryPool.unit_bytes_for(H, I, F32))
    weights = {n: make_adapter(8, range(E), seed=k) for k, n in enumerate("abcd")}
    pool.add_adapter_weights("a", weights["a"])
    pool.add_adapter_weights("b", weights["b"])
    pool.add_adapter_weights("c", weights["c"])  # a is the least recent
    assert sorted(pool.adapters()) == ["b", "c"] and len(pool.free_slots) == 6
    pool.pin("b")
    held = pool.prepare_batch(["c"])  # a live batch holds c
    before = (pool.adapters(), pool.blocks.clone(), [t.clone() for t in pool.layer(1).dense().tensors()])
    with pytest.raises(AdapterLoadError, match="arena_bytes"):
        pool.add_adapter_weights("d", weights["d"])
    assert pool.adapters() == before[0] and torch.equal(pool.blocks, before[1])
    assert all(torch.equal(x, y) for x, y in zip(before[2], pool.layer(1).dense().tensors(), strict=True))
    held.release()
    pool.add_adapter_weights("d", weights["d"])  # now c may go
    assert sorted(pool.adapters()) == ["b", "d"]
    check_forward(pool, {n: weights[n] for n in "bd"}, ["b", "d", None, "d"], make_base())


def test_hundreds_of_slots_keep_memory_bounded():
    """max_loras 300 with a small arena: the pool's device memory is the arena and a table row per slot,
    and forty one-expert adapters are resident together."""
    unit = MoELoRAMemoryPool.unit_bytes_for(H, I, F32)
    pool = make_pool(max_loras=300, max_rank=16, arena_bytes=40 * len(LAYERS) * 4 * unit)
    report = pool.memory_report()
    assert report.table_bytes == len(LAYERS) * 300 * E * 4
    assert report.arena_bytes < 2 * 40 * len(LAYERS) * 4 * unit
    weights = {f"x{k}": make_adapter(4, [k % E], seed=100 + k) for k in range(40)}
    for name, w in weights.items():
        pool.add_adapter_weights(name, w)
    assert len(pool.adapters()) == 40 and pool.memory_report().free_bytes == 0
    names = ["x0", "x7", None, "x13", "x39", "x21", "x7"]
    check_forward(pool, weights, names, make_base())


def test_arena_size_refusals():
    with pytest.raises(ValueError, match="arena_bytes must be an int of at least"):
        make_pool(arena_bytes=100)
    with pytest.raises(ValueError, match="arena_bytes must be an int"):
        make_pool(arena_bytes=1.5e9)


def _storm(pool, base, steps, *, seed, check_every=1, path="torch", triton_every=0, **tol):
    """``steps`` random loads (mixed ranks, experts and layers) and unloads; after every ``check_every``
    of them, a mixed batch of up to four resident adapters and a token without one is checked."""
    rng = random.Random(seed)
    weights, live, serial = {}, [], 0
    for step in range(steps):
        if live and (rng.random() < 0.45 or len(live) >= pool.max_loras):
            name = live.pop(rng.randrange(len(live)))
            if name in pool.adapters():
                pool.unload_adapter(name)
            del weights[name]
        else:
            serial += 1
            name = f"s{serial}"
            rank = rng.choice((2, 4, 8, 12, 16))
            experts = sorted(rng.sample(range(E), rng.randint(1, E)))
            layers = tuple(lid for lid in LAYERS if rng.random() < 0.8) or LAYERS[:1]
            weights[name] = make_adapter(rank, experts, seed=serial, layers=layers)
            pool.add_adapter_weights(name, weights[name])
            live.append(name)
            # Evictions by bytes or slots send adapters to nowhere (no host tier): forget them.
            for gone in [n for n in live if n not in pool.adapters()]:
                live.remove(gone)
                del weights[gone]
        report = pool.memory_report()
        assert report.used_bytes == sum(a.bytes for a in report.adapters)
        if live and step % check_every == 0:
            names = rng.sample(live, min(4, len(live))) + [None]
            use_path = "auto" if triton_every and step % triton_every == 0 else path
            check_forward(pool, weights, names, base, path=use_path, seed=step, **tol)
    return pool


def test_fragmentation_storm():
    """500 loads and unloads of adapters of rank 2-16 training random experts and layers, in an arena
    for about five full rank-16 adapters: blocks are freed and reused in every order. A forward every
    fourth step (torch path; the Triton kernels in the interpreter every 125 steps; the GPU test runs
    1000 steps and checks every one) matches the reference."""
    unit = MoELoRAMemoryPool.unit_bytes_for(H, I, F32)
    pool = make_pool(max_loras=12, max_rank=16, arena_bytes=5 * len(LAYERS) * E * 16 * unit)
    _storm(pool, make_base(), 500, seed=7, check_every=4, triton_every=125)
    assert pool.memory_report().used_bytes <= 5 * len(LAYERS) * E * 16 * unit


@pytest.mark.gpu
def test_fragmentation_storm_gpu():
    """The storm on the GPU in bf16, every forward through the Triton kernels ("auto")."""
    unit = MoELoRAMemoryPool.unit_bytes_for(H, I, torch.bfloat16)
    pool = make_pool(max_loras=12, max_rank=16, arena_bytes=5 * len(LAYERS) * E * 16 * unit,
                     dtype=torch.bfloat16, device="cuda")
    _storm(pool, make_base(dtype=torch.bfloat16, device="cuda"), 1000, seed=11, path="auto", tol=1e-2)
