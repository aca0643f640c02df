"""Adapter lifecycle of the pool: LRU eviction, pins, live batches, host tier, async loads, threads.

CPU, fp32, the vectorised torch path as the forward; outputs are checked against the fp32 oracle fed
the adapters' own tensors, so a slot that was overwritten under a live batch shows up as a mismatch.
"""

from __future__ import annotations

import gc
import random
import threading
import types

import pytest
import torch
from test_pool import LAYERS, make_adapter, make_base, make_pool, make_routing

from moelora import FusedMoEWithLoRA, MoELoRAMemoryPool, StaleBatchError
from moelora.pool import AdapterLoadError
from moelora.reference import reference_moe

LAYER = LAYERS[0]


def forward_and_reference(pool, adapters, names, w13, w2, gen_seed):
    """Runs one batch (one token per name) and returns (output, reference) for it."""
    torch.manual_seed(gen_seed)
    batch = pool.prepare_batch(names)
    x = torch.randn(len(names), w13.shape[2])
    weights, ids = make_routing(len(names), top_k=2)
    layer = FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=LAYER, path="torch")
    out = layer(x, weights, ids, batch)
    order = sorted({n for n in names if n is not None})
    loras = [adapters[n][LAYER] for n in order]
    per_token = [-1 if n is None else order.index(n) for n in names]
    ref = reference_moe(x, w13, w2, weights, ids, adapters=loras, token_adapter=per_token)
    batch.release()
    return out, ref


def test_lru_eviction_order_and_touch():
    pool = make_pool(max_loras=2)
    a, b, c = (make_adapter(4, 1.0) for _ in range(3))
    pool.add_adapter_weights("a", {LAYER: a})
    pool.add_adapter_weights("b", {LAYER: b})
    pool.prepare_batch(["a"]).release()  # "a" used more recently than "b"
    pool.add_adapter_weights("c", {LAYER: c})
    assert pool.adapters() == ["a", "c"] and "b" not in pool  # no host tier: "b" is gone


def test_pinned_and_live_batches_are_never_evicted():
    pool = make_pool(max_loras=2)
    pool.add_adapter_weights("a", {LAYER: make_adapter(4, 1.0)})
    pool.add_adapter_weights("b", {LAYER: make_adapter(4, 1.0)})
    pool.pin("a")
    batch = pool.prepare_batch(["b"])
    assert pool.users_of("b") == 1
    with pytest.raises(AdapterLoadError, match="pinned or used by live batches"):
        pool.add_adapter_weights("c", {LAYER: make_adapter(4, 1.0)})
    with pytest.raises(ValueError, match="'a' is pinned; unpin it before unloading"):
        pool.unload_adapter("a")  # an explicit unload is refused only for a pin
    del batch
    gc.collect()
    assert pool.users_of("b") == 0  # a dropped batch releases its slots by itself
    pool.add_adapter_weights("c", {LAYER: make_adapter(4, 1.0)})
    assert sorted(pool.adapters()) == ["a", "c"]
    pool.unpin("a")
    pool.add_adapter_weights("d", {LAYER: make_adapter(4, 1.0)})
    assert sorted(pool.adapters()) == ["c", "d"]


def test_in_place_batch_update_moves_the_hold():
    pool = make_pool(max_loras=2)
    pool.add_adapter_weights("a", {LAYER: make_adapter(4, 1.0)})
    pool.add_adapter_weights("b", {LAYER: make_adapter(4, 1.0)})
    batch = pool.prepare_batch(["a", None])
    assert pool.users_of("a") == 1 and pool.users_of("b") == 0
    pool.prepare_batch([None, "b"], out=batch)
    assert pool.users_of("a") == 0 and pool.users_of("b") == 1


def test_host_tier_serves_evicted_adapters_without_the_caller_reloading():
    x, w13, w2 = make_base(3)
    pool = make_pool(max_loras=1)
    pool.max_cpu_loras = 2
    adapters = {n: {LAYER: make_adapter(r, 0.5 + r / 8)} for n, r in (("a", 4), ("b", 8))}
    pool.add_adapter_weights("a", adapters["a"])
    pool.add_adapter_weights("b", adapters["b"])  # evicts "a" into the host tier
    assert pool.adapters() == ["b"] and pool.host_adapters() == ["a"] and "a" in pool
    out, ref = forward_and_reference(pool, adapters, ["a", None, "a"], w13, w2, 1)  # brings "a" back
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert pool.adapters() == ["a"] and pool.host_adapters() == ["b"]
    with pytest.raises(ValueError, match="unknown adapter"):
        pool.prepare_batch(["zzz"])


def test_one_batch_can_never_evict_its_own_adapters():
    pool = make_pool(max_loras=1)
    pool.max_cpu_loras = 2
    pool.add_adapter_weights("a", {LAYER: make_adapter(4, 1.0)})
    pool.add_adapter_weights("b", {LAYER: make_adapter(4, 1.0)})
    with pytest.raises(AdapterLoadError, match="pinned or used by live batches"):
        pool.prepare_batch(["a", "b"])  # two adapters, one slot
    assert pool.users_of("b") == 0  # nothing left held by the failed batch


def test_storm_of_loads_and_evictions_while_forwarding():
    """Threads load, unload and evict at random while the main thread runs forwards: every output
    equals the reference of its own batch's adapters, and no adapter is evicted under a live batch."""
    x, w13, w2 = make_base(4)
    pool = make_pool(max_loras=3)
    pool.max_cpu_loras = 4
    names = [f"ad{i}" for i in range(6)]
    adapters = {n: {LAYER: make_adapter(2 + 2 * i, 0.5 + 0.25 * i)} for i, n in enumerate(names)}
    for n in names[:3]:
        pool.add_adapter_weights(n, adapters[n])
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn(seed):
        rng = random.Random(seed)
        while not stop.is_set():
            n = rng.choice(names)
            try:
                if rng.random() < 0.3 and pool.is_resident(n):
                    pool.unload_adapter(n)
                elif not pool.is_resident(n):
                    pool.add_adapter_weights(n, adapters[n])
            except (AdapterLoadError, ValueError):
                pass  # in use, pinned-out or raced: refused cleanly, which is what we want
            except BaseException as err:  # noqa: BLE001
                errors.append(err)

    threads = [threading.Thread(target=churn, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    rng = random.Random(0)
    checked = 0
    try:
        for step in range(60):
            batch_names = [rng.choice([*names, None]) for _ in range(3)]
            try:
                out, ref = forward_and_reference(pool, adapters, batch_names, w13, w2, step)
            except (ValueError, AdapterLoadError):
                continue  # an adapter was unloaded meanwhile, or no slot could be freed: clean refusal
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
            checked += 1
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors
    assert checked >= 20


def test_async_load_on_cpu_publishes_when_done(tmp_path, monkeypatch):
    """The async API on a CPU pool (the CUDA side-stream copy is covered by the GPU test)."""
    import moelora.stager as stager_module

    pool = make_pool(max_loras=2)
    pool.max_cpu_loras = 2
    adapter = {LAYER: make_adapter(4, 2.0)}
    calls = []

    def fake_read(path, **kw):
        calls.append(path)
        return adapter, types.SimpleNamespace(path=str(path), dtype="float32")

    monkeypatch.setattr(stager_module, "read_peft_adapter", fake_read)
    future = pool.load_adapter_async("a", tmp_path)
    report = future.result(timeout=30)
    assert report.path == str(tmp_path) and report.dtype == "float32"  # the pool's dtype (fp32 here)
    assert pool.is_resident("a") and len(calls) == 1
    pool.unload_adapter("a")  # keeps the host copy
    pool.load_adapter("a", tmp_path)
    assert len(calls) == 1  # served from the host tier: the files were not read again
    with pytest.raises(AdapterLoadError, match="already loaded"):
        pool.load_adapter_async("a", tmp_path).result(timeout=30)
    pool.close()


def test_async_load_in_the_load_process(tmp_path):
    """``load_process=True``: an async load staged in the spawned process fills the slots exactly as a load
    in this process; a bad adapter's AdapterLoadError comes back with its message and the pool unchanged."""
    import shutil
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "adapters"
    sys.path.insert(0, str(root.parent))
    import adapters.make_adapters as mk

    cfg = mk.TINY_QWEN3_MOE
    kw = dict(num_experts=cfg["num_experts"], hidden_size=cfg["hidden_size"],
              intermediate_size=cfg["moe_intermediate_size"], layer_ids=mk.MOE_LAYER_IDS, max_loras=2,
              max_rank=16, dtype=torch.bfloat16, device="cpu")
    in_process = MoELoRAMemoryPool(**kw)
    in_process.load_adapter("sql", root / "sql")
    with pytest.raises(ValueError, match="build it with load_process=True"):
        in_process.start_load_process()
    pool = MoELoRAMemoryPool(**kw, load_process=True)
    try:
        pool.start_load_process()  # started ahead of the first load, which then finds it running
        started = pool._load_worker._process
        assert started.poll() is None
        report = pool.load_adapter_async("sql", root / "sql").result(timeout=120)
        assert pool._load_worker._process is started
        assert report.dtype == "bfloat16" and pool.adapter_slots == {"sql": 0}
        assert pool.memory_report().adapters[0] == in_process.memory_report().adapters[0]
        for lid in mk.MOE_LAYER_IDS:
            for got, want in zip(pool.layer(lid).dense().tensors(), in_process.layer(lid).dense().tensors(),
                                 strict=True):
                assert torch.equal(got, want)
        assert torch.equal(pool.blocks, in_process.blocks)

        def state():
            dense = [t.clone() for lid in mk.MOE_LAYER_IDS for t in pool.layer(lid).dense().tensors()]
            return [*dense, pool.blocks.clone(), pool.slot_ranks.clone(), pool.slot_scalings.clone()]

        before = state()
        bad = tmp_path / "bad"
        shutil.copytree(root / "sql", bad)
        (bad / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
        with pytest.raises(AdapterLoadError, match="adapter_model.safetensors"):
            pool.load_adapter_async("bad", bad).result(timeout=120)
        after = state()
        assert pool.adapter_slots == {"sql": 0} and len(before) == len(after)
        assert all(map(torch.equal, before, after))
        # What the worker is sent: the pool's sizes, a tensor- or expert-parallel shard among them.
        import pickle

        from moelora.parallel import MoEShard
        from moelora.stager import AdapterStager

        sharded = MoELoRAMemoryPool(**{**kw, "max_loras": 1}, shard=MoEShard(
            cfg["num_experts"], cfg["moe_intermediate_size"], ep_rank=1, ep_size=2))
        sent = pickle.loads(pickle.dumps(AdapterStager.sizes_of(sharded)))
        assert (sent.shard, sent.num_experts, sent.layer_ids) == (sharded.shard, sharded.num_experts,
                                                                  sharded.layer_ids)
        pool._load_worker._process.kill()  # a worker that died is started again
        pool._load_worker._process.wait()
        pool.load_adapter_async("chat", root / "chat").result(timeout=120)
        assert pool.adapter_slots == {"sql": 0, "chat": 1}
    finally:
        pool.close()


@pytest.mark.gpu
def test_gpu_async_load_while_forwarding():
    """An adapter loaded from a PEFT dir on a side stream while CUDA-graph forwards run: the running
    batch's outputs never change, the new adapter is visible only once complete, and its outputs
    match a synchronous load of the same files."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "adapters"
    import sys

    sys.path.insert(0, str(root.parent))
    import adapters.make_adapters as mk

    cfg = mk.TINY_QWEN3_MOE
    experts = mk.tiny_qwen3_moe_experts()
    lid = mk.MOE_LAYER_IDS[0]
    kw = dict(
        num_experts=cfg["num_experts"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["moe_intermediate_size"],
        layer_ids=mk.MOE_LAYER_IDS,
        max_loras=2,
        max_rank=16,
        dtype=torch.bfloat16,
        device="cuda",
    )
    pool = MoELoRAMemoryPool(**kw, max_cpu_loras=2)
    pool.load_adapter("sql", root / "sql")
    w13 = experts[lid]["w13"].to("cuda", torch.bfloat16)
    w2 = experts[lid]["w2"].to("cuda", torch.bfloat16)
    layer = FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=lid)
    x = torch.randn(8, cfg["hidden_size"], device="cuda", dtype=torch.bfloat16)
    weights, ids = make_routing(8, experts=cfg["num_experts"], top_k=2)
    weights, ids = weights.cuda(), ids.cuda()
    batch = pool.prepare_batch(["sql"] * 8)
    expected = layer(x, weights, ids, batch).clone()
    future = pool.load_adapter_async("chat", root / "chat")
    assert not future.done() or pool.is_resident("chat")
    while not future.done():
        torch.testing.assert_close(layer(x, weights, ids, batch), expected, atol=0, rtol=0)
    future.result()
    chat_out = layer(x, weights, ids, pool.prepare_batch(["chat"] * 8))
    sync_pool = MoELoRAMemoryPool(**kw)
    sync_pool.load_adapter("chat", root / "chat")
    sync_layer = FusedMoEWithLoRA(w13, w2, pool=sync_pool, layer_id=lid)
    torch.testing.assert_close(chat_out, sync_layer(x, weights, ids, sync_pool.prepare_batch(["chat"] * 8)))
    pool.close()


def test_memory_report():
    """Arena bytes per adapter at its rank for the experts it trains, arena use and fragmentation, tiers,
    pins and live batches."""
    import json

    from moelora import PoolMemoryReport

    pool = MoELoRAMemoryPool(num_experts=6, hidden_size=48, intermediate_size=40, layer_ids=[3, 7],
                             max_loras=2, max_rank=16, dtype=torch.float32, device="cpu", max_cpu_loras=2)
    # A unit: one rank row of gate/up A (2 x 48), gate/up B^T (2 x 40), down A (40), down B^T (48), fp32.
    unit = 3 * (48 + 40) * 4
    assert pool.unit_bytes == unit
    capacity = 2 * 2 * 6 * 16  # the default arena: two slots of rank 16, every expert of both layers
    assert pool._units.total_units - pool._units.reserved_units == capacity
    # Rank 4 on every expert of one layer; rank 16 on two experts of layer 3 and all six of layer 7.
    pool.add_adapter_weights("small", {3: make_adapter(4, 1.0)})
    pool.add_adapter_weights("big", {3: make_adapter(16, 0.5, experts=[0, 5]), 7: make_adapter(16, 0.5)})
    pool.pin("small")
    batch = pool.prepare_batch(["big", None])
    report = pool.memory_report()
    assert isinstance(report, PoolMemoryReport)
    assert (report.slots, report.free_slots) == (2, 0)
    assert report.arena_bytes == pool.nbytes and report.table_bytes == 2 * 2 * 6 * 4  # (layers, L, E) int32
    # Host stacks of all six experts of each layer an adapter has, at its rank: gate/up/down A and B.
    per_layer = {r: 6 * r * (48 + 40) * 2 + 6 * r * (40 + 48) for r in (4, 16)}
    small, big = report.adapters
    assert (small.name, small.tier, small.slot, small.pinned, small.users, small.rank) == (
        "small", "gpu", 0, True, 0, 4)
    assert (big.name, big.slot, big.pinned, big.users, big.rank) == ("big", 1, False, 1, 16)
    # Arena: a block of `rank` units per (layer, expert) trained, nothing for the others.
    assert (small.blocks, small.bytes) == (6, 6 * 4 * unit)
    assert (big.blocks, big.bytes) == (2 + 6, 8 * 16 * unit)
    assert small.host_bytes == per_layer[4] * 4 and big.host_bytes == 2 * per_layer[16] * 4
    assert report.used_bytes == small.bytes + big.bytes == (24 + 128) * unit
    assert report.free_bytes + report.used_bytes == capacity * unit
    # The arena's free space (units [16, 400)) after the two loads: small's blocks take 16..32 and
    # 384..392 (order-2 blocks split from the two order-4 blocks), big's take 32..160; free are the
    # aligned blocks 392..400 (8 units), 160..192, 192..256 and 256..384. All but the first take a
    # rank-16 block.
    assert report.largest_free_bytes == 128 * unit
    assert report.max_rank_free_bytes == (232 - 8) * unit
    assert report.fragmentation == pytest.approx(8 / 232)
    assert report.staging_bytes == 0 and report.host_tier_bytes == 0  # on the CPU: no pinned staging
    batch.release()
    pool.unpin("small")
    pool.add_adapter_weights("third", {3: make_adapter(8, 1.0)})  # evicts "small" (least recent) to the host
    report = pool.memory_report()
    assert [(a.name, a.tier, a.slot, a.rank, a.blocks, a.bytes) for a in report.adapters] == [
        ("third", "gpu", 0, 8, 6, 6 * 8 * unit), ("big", "gpu", 1, 16, 8, 8 * 16 * unit),
        ("small", "host", None, 4, 6, 0)]
    assert report.adapters[2].host_bytes == small.host_bytes
    assert report.host_tier_bytes == small.host_bytes
    assert report.used_bytes == (48 + 128) * unit
    assert report.free_bytes == (capacity - 48 - 128) * unit
    # small's blocks merged back; third's rank-8 blocks fill whole 16-unit blocks two by two: every free
    # block takes a rank-16 block.
    assert report.max_rank_free_bytes == report.free_bytes and report.fragmentation == 0.0
    json.dumps(report.as_dict())  # dashboards take it as JSON


def test_staging_refusals():
    """A staging buffer whose chunk cannot hold one expert of the widest stack is refused before any pinned
    memory is allocated, naming the size that would do; staging_bytes must be a positive int."""
    from moelora.staging import PinnedStaging

    with pytest.raises(ValueError, match="one expert of a rank-64 LoRA stack takes 100: give "
                                         "staging_bytes of at least 400"):
        PinnedStaging(64, widest_row=100, what="a rank-64 LoRA stack")
    with pytest.raises(ValueError, match="staging_bytes must be an int of at least 4"):
        PinnedStaging(2, widest_row=1, what="x")
    with pytest.raises(ValueError, match="staging_bytes must be a positive int, got -1"):
        MoELoRAMemoryPool(num_experts=6, hidden_size=48, intermediate_size=40, layer_ids=[3], device="cpu",
                          staging_bytes=-1)


@pytest.mark.gpu
def test_gpu_staging_chunks_write_the_same_slots():
    """Slots written through a staging buffer of one expert a chunk (every stack in many chunks, each chunk
    reused many times in one write), synchronously, asynchronously and from the host tier, hold exactly the
    bytes of slots written from pageable memory."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "adapters"
    sys.path.insert(0, str(root.parent))
    import adapters.make_adapters as mk

    cfg = mk.TINY_QWEN3_MOE
    hidden, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    kw = dict(num_experts=cfg["num_experts"], hidden_size=hidden, intermediate_size=inter,
              layer_ids=mk.MOE_LAYER_IDS, max_loras=2, max_rank=16, dtype=torch.bfloat16, device="cuda",
              max_cpu_loras=2)
    one_expert = 16 * max(hidden, inter) * 2
    staged = MoELoRAMemoryPool(**kw, staging_bytes=4 * one_expert)
    pageable = MoELoRAMemoryPool(**kw, pin_host_memory=False)
    assert staged.memory_report().staging_bytes == 4 * one_expert
    assert pageable.memory_report().staging_bytes == 0
    for pool in (staged, pageable):
        pool.load_adapter("sql", root / "sql")
        pool.load_adapter_async("chat", root / "chat").result(timeout=60)
        pool.load_adapter("math", root / "math")  # evicts "sql" to the host tier
        pool.prepare_batch(["sql"]).release()  # back from the host tier, evicting "chat"
        pool.close()
    torch.cuda.synchronize()
    assert staged.adapter_slots == pageable.adapter_slots == {"math": 0, "sql": 1}
    assert torch.equal(staged.blocks, pageable.blocks)
    assert torch.equal(staged.slot_ranks, pageable.slot_ranks)
    for lid in mk.MOE_LAYER_IDS:
        for got, want in zip(staged.layer(lid).dense().tensors(), pageable.layer(lid).dense().tensors(),
                             strict=True):
            assert torch.equal(got, want)


def _slow_reads(monkeypatch, adapters):
    """Makes the stager's reads wait for ``gate`` (set it to let them finish); returns the gate."""
    import moelora.stager as stager_module

    gate = threading.Event()

    def read(path, **kw):
        assert gate.wait(timeout=30)
        return {LAYER: adapters[path.name]}, types.SimpleNamespace(path=str(path), dtype="float32")

    monkeypatch.setattr(stager_module, "read_peft_adapter", read)
    return gate


def test_a_name_is_loaded_once_even_while_an_async_load_runs(tmp_path, monkeypatch):
    """Was: a sync load of a name while its async load ran published it twice (two slots, one name), after
    which the pool listed an adapter it then called not loaded."""
    adapters = {"a": make_adapter(4, 1.0)}
    (tmp_path / "a").mkdir()
    gate = _slow_reads(monkeypatch, adapters)
    pool = make_pool(max_loras=2)
    future = pool.load_adapter_async("a", tmp_path / "a")
    assert pool.state().loading == ("a",)
    with pytest.raises(AdapterLoadError, match="'a' is already being loaded"):
        pool.add_adapter_weights("a", {LAYER: adapters["a"]})
    with pytest.raises(AdapterLoadError, match="'a' is already being loaded"):
        pool.load_adapter_async("a", tmp_path / "a").result(timeout=5)
    with pytest.raises(ValueError, match=r"adapter\(s\) \['a'\] still loading") as refused:
        pool.prepare_batch(["a"])
    assert "loaded adapters: []" in str(refused.value)
    gate.set()
    future.result(timeout=30)
    state = pool.state()
    assert state.resident == ("a",) and state.loading == () and pool.adapters() == ["a"]
    pool.close()


def test_unload_cancels_an_async_load(tmp_path, monkeypatch):
    adapters = {"a": make_adapter(4, 1.0), "b": make_adapter(8, 2.0)}
    for n in adapters:
        (tmp_path / n).mkdir()
    gate = _slow_reads(monkeypatch, adapters)
    pool = make_pool(max_loras=1)
    future = pool.load_adapter_async("a", tmp_path / "a")
    pool.unload_adapter("a")  # explicit unload wins: the load under way is cancelled
    assert pool.state().loading == ()
    gate.set()
    with pytest.raises(AdapterLoadError, match=r"load of adapter 'a' was cancelled: unload_adapter\('a'\)"):
        future.result(timeout=30)
    assert pool.adapters() == [] and pool.free_slots == [0]
    assert pool.memory_report().used_bytes == 0
    pool.load_adapter("b", tmp_path / "b")  # the slot and the arena are whole again
    assert pool.adapters() == ["b"]
    pool.close()


def test_refusals_never_contradict_the_state():
    pool = make_pool(max_loras=1)
    pool.max_cpu_loras = 1
    pool.add_adapter_weights("a", {LAYER: make_adapter(4, 1.0)})
    pool.add_adapter_weights("b", {LAYER: make_adapter(4, 1.0)})  # "a" to the host tier
    with pytest.raises(ValueError, match=r"'a' is not loaded \(it is in the host tier\); loaded adapters: "
                                         r"\['b'\], host tier: \['a'\]"):
        pool.pin("a")
    with pytest.raises(ValueError, match=r"unknown adapter\(s\) \['z'\]; loaded adapters: \['b'\]"):
        pool.prepare_batch(["a", "z"])


def test_oversized_batches_are_refused_before_allocating():
    pool = make_pool(max_loras=1)
    pool.add_adapter_weights("a", {LAYER: make_adapter(4, 1.0)})
    with pytest.raises(ValueError, match="2147483647 a batch's int32 token index can address"):
        pool.prepare_batch(["a"], [2**40])
    with pytest.raises(ValueError, match="int32 token index"):
        pool.prepare_batch(["a", None], [2**31 - 1, 1])
    assert pool.state().users == {"a": 0}


def test_refresh_keeps_the_step_after_an_unload():
    """A serving loop whose adapter was unloaded between prepare_batch and the forward refreshes the batch
    in place from the host tier and loses nothing; once the adapter is gone for good, refresh says so."""
    x, w13, w2 = make_base(3)
    weights, ids = make_routing(3)
    pool = make_pool(max_loras=2)
    pool.max_cpu_loras = 1
    adapters = {"a": make_adapter(4, 1.0), "b": make_adapter(8, 0.5)}
    for n, lora in adapters.items():
        pool.add_adapter_weights(n, {LAYER: lora})
    layer = FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=LAYER, path="torch")
    batch = pool.prepare_batch(["a", None, "b"])
    tensor = batch.token_slots
    assert pool.refresh(batch) is False  # current: nothing to do
    pool.unload_adapter("a")  # to the host tier
    with pytest.raises(StaleBatchError, match="call pool.refresh"):
        layer(x, weights, ids, batch)
    assert pool.refresh(batch) is True and batch.token_slots is tensor and pool.is_current(batch)
    out = layer(x, weights, ids, batch)
    want = reference_moe(x, w13, w2, weights, ids, adapters=[adapters["a"], adapters["b"]],
                         token_adapter=[0, -1, 1])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    pool.unload_adapter("a")
    pool.unload_adapter("a")  # out of the host tier too: gone
    with pytest.raises(ValueError, match=r"unknown adapter\(s\) \['a'\]; loaded adapters: \['b'\]"):
        pool.refresh(batch)
    assert not pool.is_current(batch) and pool.state().users == {"b": 1}
