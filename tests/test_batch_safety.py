"""A request runs with its own adapter or fails loudly: batches of another pool, stale batches, the
unload/evict contract, bad names and inputs, and a concurrency storm, all through the public API.

CPU, fp32, the vectorised torch path unless a test says otherwise; outputs are checked against the fp32
oracle fed the adapters' own tensors, so a batch that ran with another adapter's weights is a mismatch.
"""

from __future__ import annotations

import gc

import pytest
import torch
from test_pool import LAYERS, make_adapter, make_base, make_pool, make_routing

from moelora import FusedMoEWithLoRA, MoELoRABatchInfo
from moelora.pool import AdapterLoadError
from moelora.reference import reference_moe

LAYER = LAYERS[0]
TOL = dict(atol=1e-5, rtol=1e-5)


def run(pool, batch, x, weights, ids, w13, w2, path="torch"):
    return FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=LAYER, path=path)(x, weights, ids, batch)


def oracle(adapters, names, x, weights, ids, w13, w2):
    """Reference output of one token per entry of ``names`` (adapter name or None)."""
    order = sorted({n for n in names if n is not None})
    per_token = [-1 if n is None else order.index(n) for n in names]
    loras = [adapters[n] for n in order]
    return reference_moe(x, w13, w2, weights, ids, adapters=loras, token_adapter=per_token)


def test_batch_of_another_pool_is_refused():
    # Two pools of the same shapes: before, the layer ran the foreign batch with its own slot 0.
    x, w13, w2 = make_base(3)
    weights, ids = make_routing(3)
    mine, other = make_pool(max_loras=2), make_pool(max_loras=2)
    mine.add_adapter_weights("a", {LAYER: make_adapter(4, 1.0)})
    other.add_adapter_weights("b", {LAYER: make_adapter(4, 3.0)})
    foreign = other.prepare_batch(["b", None, "b"])
    with pytest.raises(ValueError, match="built by another pool"):
        run(mine, foreign, x, weights, ids, w13, w2)
    with pytest.raises(ValueError, match="out= was built by another pool"):
        mine.prepare_batch(["a", None, None], out=foreign)
    # A batch assembled by hand has no pool to vouch for its slots.
    by_hand = MoELoRABatchInfo(
        token_slots=torch.zeros(3, dtype=torch.int32), slot_ranks=mine.slot_ranks,
        slot_scalings=mine.slot_scalings, num_tokens=3, has_lora=True, max_rank=4, slots_used=(0,),
        adapter_names=("a",), seq_lens=(3,))
    with pytest.raises(ValueError, match="no pool"):
        run(mine, by_hand, x, weights, ids, w13, w2)
    with pytest.raises(TypeError, match="MoELoRABatchInfo"):
        run(mine, {"token_slots": 0}, x, weights, ids, w13, w2)


@pytest.mark.parametrize("keep", ["released", "kept"])  # the old contract refused the unload when kept
def test_stale_batch_is_refused_then_refreshed_in_place(keep):
    x, w13, w2 = make_base(3)
    weights, ids = make_routing(3)
    pool = make_pool(max_loras=1)
    adapters = {"a": make_adapter(4, 1.0), "b": make_adapter(8, 2.5)}
    pool.add_adapter_weights("a", {LAYER: adapters["a"]})
    batch = pool.prepare_batch(["a", None, "a"])
    tensor = batch.token_slots
    if keep == "released":
        batch.release()
    pool.unload_adapter("a")  # explicit unload wins over the live batch
    assert not pool.is_current(batch)
    pool.add_adapter_weights("b", {LAYER: adapters["b"]})  # same slot 0, new weights
    assert pool.slot_of("b") == 0
    with pytest.raises(ValueError, match=r"stale batch: adapter 'a' .*slot 0 now holds 'b'.*prepare_batch"):
        run(pool, batch, x, weights, ids, w13, w2)
    refreshed = pool.prepare_batch(["b", None, "b"], out=batch)
    assert refreshed is batch and batch.token_slots is tensor  # CUDA-graph replay keeps its tensor
    out = run(pool, batch, x, weights, ids, w13, w2)
    torch.testing.assert_close(out, oracle(adapters, ["b", None, "b"], x, weights, ids, w13, w2), **TOL)


def test_released_batch_is_refused_after_lru_eviction():
    x, w13, w2 = make_base(2)
    weights, ids = make_routing(2)
    pool = make_pool(max_loras=1)
    pool.add_adapter_weights("a", {LAYER: make_adapter(4, 1.0)})
    batch = pool.prepare_batch(["a", "a"])
    with pytest.raises(AdapterLoadError, match="used by live batches"):
        pool.add_adapter_weights("b", {LAYER: make_adapter(4, 1.0)})  # eviction protects a live batch
    batch.release()
    pool.add_adapter_weights("b", {LAYER: make_adapter(4, 1.0)})  # now "a" may go
    with pytest.raises(ValueError, match="stale batch: adapter 'a'"):
        run(pool, batch, x, weights, ids, w13, w2)
    emptied = pool.prepare_batch(["b"])
    pool.unload_adapter("b")
    with pytest.raises(ValueError, match=r"stale batch: adapter 'b' .*slot 0 is now empty"):
        run(pool, emptied, x[:1], weights[:1], ids[:1], w13, w2)


def test_stale_batch_holds_nothing_of_the_new_adapter():
    # The stale batch's hold on slot 0 must neither protect nor be taken from the slot's next adapter.
    pool = make_pool(max_loras=1)
    pool.add_adapter_weights("a", {LAYER: make_adapter(4, 1.0)})
    stale = pool.prepare_batch(["a"])
    pool.unload_adapter("a")
    pool.add_adapter_weights("b", {LAYER: make_adapter(4, 1.0)})
    assert pool.users_of("b") == 0
    live = pool.prepare_batch(["b"])
    del stale
    gc.collect()
    assert pool.users_of("b") == 1  # the stale batch's finalizer did not release the live one's hold
    with pytest.raises(AdapterLoadError, match="used by live batches"):
        pool.add_adapter_weights("c", {LAYER: make_adapter(4, 1.0)})
    live.release()
    pool.add_adapter_weights("c", {LAYER: make_adapter(4, 1.0)})
    assert pool.adapters() == ["c"]


def test_pinned_adapter_refuses_unload_and_keeps_its_batches_current():
    pool = make_pool(max_loras=2)
    pool.add_adapter_weights("a", {LAYER: make_adapter(4, 1.0)})
    pool.pin("a")
    batch = pool.prepare_batch(["a"])
    with pytest.raises(ValueError, match="'a' is pinned; unpin it before unloading"):
        pool.unload_adapter("a")
    assert pool.is_current(batch) and pool.adapters() == ["a"]


def test_host_tier_adapter_with_no_tokens_takes_no_slot():
    # Was a KeyError: a host-tier adapter named with sequence length 0 was looked up in the slots.
    pool = make_pool(max_loras=1)
    pool.max_cpu_loras = 2
    pool.add_adapter_weights("a", {LAYER: make_adapter(4, 1.0)})
    pool.add_adapter_weights("b", {LAYER: make_adapter(4, 1.0)})  # "a" goes to the host tier
    batch = pool.prepare_batch(["a", "b", None], [0, 2, 1])
    assert batch.token_slots.tolist() == [0, 0, -1] and batch.slots_used == (0,)
    assert pool.adapters() == ["b"] and pool.host_adapters() == ["a"]


def test_bringing_back_two_host_tier_adapters_never_loses_one():
    # Placing the first evicts a resident adapter into the host tier, which used to push the second
    # wanted adapter out of it before it was placed (a KeyError under concurrent use).
    x, w13, w2 = make_base(2)
    weights, ids = make_routing(2)
    pool = make_pool(max_loras=2)
    pool.max_cpu_loras = 2
    adapters = {n: make_adapter(2 + 2 * i, 0.5 + i) for i, n in enumerate(["h2", "h1", "r1", "r2"])}
    for n in adapters:
        pool.add_adapter_weights(n, {LAYER: adapters[n]})
    assert pool.host_adapters() == ["h2", "h1"] and pool.adapters() == ["r1", "r2"]
    batch = pool.prepare_batch(["h1", "h2"])
    assert sorted(pool.adapters()) == ["h1", "h2"]
    out = run(pool, batch, x, weights, ids, w13, w2)
    torch.testing.assert_close(out, oracle(adapters, ["h1", "h2"], x, weights, ids, w13, w2), **TOL)


@pytest.mark.parametrize("names, match", [
    ([5, "zz"], r"adapter names must be str or None, got \[5\]"),  # was a TypeError from sorting
    ([["a"]], r"adapter names must be str or None, got \[\['a'\]\]"),  # was unhashable-type
    (7, "one entry per sequence"),
])
def test_prepare_batch_refuses_names_that_are_not_str(names, match):
    pool = make_pool(max_loras=1)
    pool.add_adapter_weights("a", {LAYER: make_adapter(4, 1.0)})
    with pytest.raises(TypeError, match=match):
        pool.prepare_batch(names)
    assert pool.users_of("a") == 0


def test_refused_in_place_update_changes_nothing():
    # The token count is checked before a host-tier adapter is brought back (which could evict).
    pool = make_pool(max_loras=1)
    pool.max_cpu_loras = 1
    pool.add_adapter_weights("a", {LAYER: make_adapter(4, 1.0)})
    pool.add_adapter_weights("b", {LAYER: make_adapter(4, 1.0)})
    batch = pool.prepare_batch([None, None])
    with pytest.raises(ValueError, match="out= holds 2 tokens but this batch has 3"):
        pool.prepare_batch(["a"], [3], out=batch)
    assert pool.adapters() == ["b"] and pool.host_adapters() == ["a"]


@pytest.mark.parametrize("bad, err, match", [
    ("x_int", TypeError, "x must be one of float16, bfloat16, float32, float64, got torch.int64"),
    ("ids_float", TypeError, "topk_ids must be int32 or int64, got torch.float32"),
    ("ids_bool", TypeError, "topk_ids must be int32 or int64, got torch.bool"),
    ("x_hidden", ValueError, r"x must be \(num_tokens, H=48\) to match the experts' w13"),
])
def test_torch_path_refuses_bad_inputs_like_the_triton_path(bad, err, match):
    x, w13, w2 = make_base(3)
    weights, ids = make_routing(3)
    pool = make_pool(max_loras=1)
    pool.add_adapter_weights("a", {LAYER: make_adapter(4, 1.0)})
    batch = pool.prepare_batch(["a", None, "a"])
    if bad == "x_int":
        x = x.long()
    elif bad == "ids_float":
        ids = ids.float()
    elif bad == "ids_bool":
        ids = ids.bool()
    else:
        x = x[:, :40]
    with pytest.raises(err, match=match):
        run(pool, batch, x, weights, ids, w13, w2)


@pytest.mark.parametrize("with_lora", [False, True])
def test_torch_path_expert_ids_outside_range_contribute_nothing(with_lora):
    # -1 (expert-parallel "not mine"), E and 10**6 (router bugs) at random positions.
    x, w13, w2 = make_base(5)
    weights, ids = make_routing(5, top_k=3)
    bad = ids.clone()
    for t, j, v in ((0, 1, -1), (1, 0, 6), (3, 2, 10**6), (4, 0, -7)):
        bad[t, j] = v
    pool = make_pool(max_loras=1)
    adapters = {"a": make_adapter(4, 1.5)}
    pool.add_adapter_weights("a", {LAYER: adapters["a"]})
    names = ["a", None, "a", "a", None] if with_lora else [None] * 5
    out = run(pool, pool.prepare_batch(names), x, weights, bad.long(), w13, w2)
    kept = weights.masked_fill(bad != ids, 0.0)  # the same pairs with weight 0 contribute nothing
    torch.testing.assert_close(out, oracle(adapters, names, x, kept, ids, w13, w2), **TOL)
    torch.testing.assert_close(oracle(adapters, names, x, weights, bad, w13, w2), out, **TOL)


@pytest.mark.interpreter
@pytest.mark.parametrize("inplace", [False, True])
def test_column_major_x_on_the_triton_path(inplace):
    # A transposed view (column-major x) used to fail with a message about ``out``; it runs as a copy, and
    # in place writes the result back into the caller's strided tensor.
    from triton_ops import fused_experts

    x, w13, w2 = make_base(7)
    weights, ids = make_routing(7, top_k=2)
    want = fused_experts(x.contiguous(), w13, w2, weights, ids)
    strided = x.t().contiguous().t()
    assert not strided.is_contiguous()
    got = fused_experts(strided, w13, w2, weights, ids, inplace=inplace)
    torch.testing.assert_close(got, want, **TOL)
    if inplace:
        assert got is strided and not strided.is_contiguous()
