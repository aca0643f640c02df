"""The layer's launch cache (``triton_ops.launch.LaunchCache``): plans made once per key and compiled
binaries launched without Triton's per-call binding give the same bits as an uncached call, including
after the inputs' specialization changes (a misaligned x: a binary of its own)."""

from __future__ import annotations

import pytest
import torch
from test_lora_layer import make_adapter, make_base, make_pool, make_routing

from moelora.layer import FusedMoEWithLoRA
from triton_ops import fused_experts
from triton_ops.launch import LaunchCache, active_cache, launch

F16, BF16 = torch.float16, torch.bfloat16


def layer_with_adapters(dtype, device, *, hidden=48, inter=40, experts=6, path="split"):
    """A layer (pool layer 3) whose pool holds adapters "a" and "b": ranks that differ per adapter (16, 5)."""
    pool = make_pool(dtype, max_loras=4, max_rank=16, num_experts=experts, hidden=hidden, inter=inter,
                     layer_ids=(3,), device=device)
    for name, rank in (("a", 16), ("b", 5)):
        pool.add_adapter_weights(name, make_adapter(rank, 2.0, dtype, layers=(3,), num_experts=experts,
                                                    hidden=hidden, inter=inter))
    w13, w2 = make_base(experts, hidden, inter, dtype, device)
    return FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=3, path=path)


def _layer_and_batch(dtype, device, m, *, hidden=48, inter=40, experts=6, top_k=2, path="split"):
    layer = layer_with_adapters(dtype, device, hidden=hidden, inter=inter, experts=experts, path=path)
    pool = layer.pool
    # Tokens with no adapter (None) beside both adapters.
    names = [("a", "b", None)[i % 3] for i in range(m)]
    batch = pool.prepare_batch(names)
    weights, ids = make_routing(m, experts, top_k, device=device)
    x = torch.randn(m, hidden, device=device).to(dtype)
    return layer, batch, x, weights, ids


def _uncached(layer, x, weights, ids, batch):
    """The same forward with a fresh cache each call: plans made and kernels bound anew."""
    layer.launch_cache = LaunchCache()
    return layer(x, weights, ids, batch)


def test_cache_is_scoped_and_reentrant():
    outer, inner = LaunchCache(), LaunchCache()
    assert active_cache() is None
    with outer:
        with inner:
            assert active_cache() is inner
        assert active_cache() is outer
        with outer:  # re-entered
            assert active_cache() is outer
        assert active_cache() is outer
    assert active_cache() is None


def test_plan_made_once_per_key():
    cache = LaunchCache()
    made = []
    for _ in range(3):
        assert cache.plan("k", lambda: made.append(1) or "plan") == "plan"
    assert made == [1]
    cache.clear()
    cache.plan("k", lambda: made.append(1) or "plan")
    assert made == [1, 1]


def test_launch_outside_a_cache_is_the_plain_launch():
    seen = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda **kwargs: seen.append((grid, kwargs))

    launch(Kernel(), (3,), n=1)
    assert seen == [((3,), {"n": 1})]


@pytest.mark.interpreter
@pytest.mark.parametrize("path", ["split", "fused"])
@pytest.mark.parametrize("m", [1, 7])  # one token: direct pairs; 7: the one-program alignment
def test_cached_layer_matches_uncached_interpreter(path, m):
    layer, batch, x, weights, ids = _layer_and_batch(F16, "cpu", m, path=path)
    ref = _uncached(layer, x, weights, ids, batch)
    cache = layer.launch_cache = LaunchCache()
    for _ in range(2):
        assert torch.equal(layer(x, weights, ids, batch), ref)
    assert cache.plans, "the forward planned through the layer's cache"
    base_ref = fused_experts(x, layer.w13, layer.w2, weights, ids)
    assert torch.equal(layer(x, weights, ids, None), base_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["split", "fused", "staged"])
# 1: direct decode pairs; 7: one-program alignment with the decode shrink; 300: three-launch alignment and
# the prefill shrinks (odd: partial blocks).
@pytest.mark.parametrize("m", [1, 7, 300])
def test_cached_layer_matches_uncached_gpu(path, m):
    layer, batch, x, weights, ids = _layer_and_batch(BF16, "cuda", m, hidden=2048, inter=768, experts=16,
                                                     top_k=6, path=path)
    ref = _uncached(layer, x, weights, ids, batch)
    base_ref = fused_experts(x, layer.w13, layer.w2, weights, ids)
    layer.launch_cache = LaunchCache()
    for _ in range(3):  # the first call records the binaries, the next ones launch them directly
        assert torch.equal(layer(x, weights, ids, batch), ref)
        assert torch.equal(layer(x, weights, ids, None), base_ref)
    # x one element off a 16-byte boundary: Triton specializes pointers on alignment, so this is a
    # specialization (and binary) of its own, not the aligned one launched on a misaligned pointer.
    shifted = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)[1:].view_as(x)
    shifted.copy_(x)
    for _ in range(2):
        assert torch.equal(layer(shifted, weights, ids, batch), ref)


@pytest.mark.interpreter
def test_interpreter_kernels_on_several_threads_each_run_whole():
    """The interpreter swaps ``triton.language`` for its own during a call: kernels called from several
    threads at once (a layer's forwards beside two threads of another kernel) run one at a time, each with
    the result it has alone."""
    import threading

    from triton_ops import silu_and_mul

    layer, batch, x, weights, ids = _layer_and_batch(F16, "cpu", 5)
    ref = layer(x, weights, ids, batch)
    act_in = torch.randn(9, 2 * 37)
    act_ref = silu_and_mul(act_in)
    errors: list[BaseException] = []
    start = threading.Barrier(3)

    def run(work):
        try:
            start.wait()
            for _ in range(12):
                work()
        except BaseException as err:  # noqa: BLE001 - reported by the test below
            errors.append(err)

    def layer_step():
        assert torch.equal(layer(x, weights, ids, batch), ref)

    def activation_step():
        assert torch.equal(silu_and_mul(act_in), act_ref)

    threads = [threading.Thread(target=run, args=(work,)) for work in (layer_step, activation_step,
                                                                         activation_step)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
