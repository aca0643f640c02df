"""Launch traces (``triton_ops.launch.LaunchTrace``): the layer records every launch of a call once per key
and replays them with the next calls' inputs put in. A replay must give the bits of the eager call on new
inputs (new values at new addresses, a new adapter mix of the same shape, adapters swapped in the pool),
and every call the trace cannot serve (misaligned or strided inputs, other dtypes) must run eagerly."""

from __future__ import annotations

import importlib

import pytest
import torch
from test_launch_cache import layer_with_adapters
from test_lora_layer import make_adapter, make_routing

from moelora.layer import FusedMoEWithLoRA
from triton_ops.launch import LaunchCache

F16, BF16 = torch.float16, torch.bfloat16
layer_module = importlib.import_module("moelora.layer")  # the fused_experts the layer calls


def _setup(dtype, device, *, hidden=48, inter=40, experts=6, top_k=2, path="split"):
    # Adapters of ranks 16 and 5; tokens with no adapter come from the batches below.
    layer = layer_with_adapters(dtype, device, hidden=hidden, inter=inter, experts=experts, path=path)
    return layer, layer.pool, top_k


def _inputs(m, layer, top_k, dtype, device, seed):
    torch.manual_seed(seed)
    experts, hidden = layer.w13.shape[0], layer.w13.shape[2]
    weights, ids = make_routing(m, experts, top_k, device=device)
    x = torch.randn(m, hidden, device=device).to(dtype)
    return x, weights, ids


def _eager(layer, x, weights, ids, batch, monkeypatch):
    """The same forward through ``fused_experts`` (traces off), on a layer sharing the weights and pool."""
    with monkeypatch.context() as patch:
        patch.setenv("MOELORA_LAUNCH_TRACE", "0")
        eager = FusedMoEWithLoRA(layer.w13, layer.w2, pool=layer.pool, layer_id=layer.layer_id,
                                 path=layer.path, activation=layer.activation)
        return eager(x, weights, ids, batch)


def _count_eager_calls(monkeypatch) -> list[int]:
    calls = []
    real = layer_module.fused_experts

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(layer_module, "fused_experts", counted)
    return calls


def _mix(step: int, m: int) -> list[str | None]:
    """Adapter names of an m-token batch at ``step``: the mix changes every step but keeps the rank tile and
    the adapter count (the same key); None: no adapter. One token keeps adapter "a" (alone, "b" would be
    another rank tile)."""
    if m == 1:
        return ["a"]
    mixes = (("a", "b", None), ("b", None, "a"), (None, "a", "b"))
    return [mixes[step][i % 3] for i in range(m)]


def _check_replays(layer, pool, top_k, dtype, device, m, monkeypatch, *, names_of):
    """Three calls of one key with new inputs each: the first records, the others replay; each equals the
    eager forward on the same inputs, bit for bit."""
    calls = _count_eager_calls(monkeypatch)
    for step in range(3):
        x, weights, ids = _inputs(m, layer, top_k, dtype, device, seed=step)
        batch = pool.prepare_batch(names_of(step))
        got = layer(x, weights, ids, batch)
        calls_before_ref = len(calls)
        ref = _eager(layer, x, weights, ids, batch, monkeypatch)
        assert torch.equal(got, ref), f"step {step}: max diff {(got.float() - ref.float()).abs().max()}"
        del calls[calls_before_ref:]
    assert len(calls) == 1, "the first call records; the next ones replay without fused_experts"
    assert len(layer.launch_cache.traces) == 1


@pytest.mark.interpreter
@pytest.mark.parametrize("path", ["split", "fused", "staged"])
# 1: direct decode pairs (no alignment); 7: the one-program alignment; 67 (x top-2 = 134 pairs): the
# three-launch alignment, whose scatter writes the sentinel past the padded end, and the prefill shrinks.
@pytest.mark.parametrize("m", [1, 7, 67])
def test_replay_matches_eager_on_new_inputs_interpreter(path, m, monkeypatch):
    layer, pool, top_k = _setup(F16, "cpu", path=path)
    _check_replays(layer, pool, top_k, F16, "cpu", m, monkeypatch, names_of=lambda step: _mix(step, m))


@pytest.mark.interpreter
def test_base_call_replays_interpreter(monkeypatch):
    layer, pool, top_k = _setup(F16, "cpu")
    calls = _count_eager_calls(monkeypatch)
    for step in range(3):
        x, weights, ids = _inputs(5, layer, top_k, F16, "cpu", seed=step)
        got = layer(x, weights, ids, None)
        assert torch.equal(got, _eager(layer, x, weights, ids, None, monkeypatch))
    assert len(calls) == 1 + 3  # one recording, three eager references


@pytest.mark.interpreter
def test_replay_reads_adapters_loaded_after_recording_interpreter(monkeypatch):
    """The trace holds the pool's buffers by pointer: an adapter loaded into a slot after the recording is
    what the replay reads."""
    layer, pool, top_k = _setup(F16, "cpu")
    x, weights, ids = _inputs(4, layer, top_k, F16, "cpu", seed=0)
    layer(x, weights, ids, pool.prepare_batch(["a", "b", "a", None]))
    pool.unload_adapter("b")
    pool.add_adapter_weights("c", make_adapter(5, 0.5, F16, layers=(3,), num_experts=6, hidden=48, inter=40))
    batch = pool.prepare_batch(["a", "c", "a", None])
    calls = _count_eager_calls(monkeypatch)
    got = layer(x, weights, ids, batch)
    assert not calls, "same key: replayed"
    assert torch.equal(got, _eager(layer, x, weights, ids, batch, monkeypatch))


@pytest.mark.interpreter
@pytest.mark.parametrize("case", ["misaligned_x", "strided_x", "bf16_weights", "strided_ids"])
def test_inputs_a_trace_cannot_take_as_they_are_interpreter(case, monkeypatch):
    """Strided inputs and other routing-weight dtypes are converted before the trace (as fused_experts
    would convert them) and replay; a misaligned x (Triton specialized the recorded binaries on aligned
    pointers) runs eagerly."""
    layer, pool, top_k = _setup(F16, "cpu")
    m = 5
    batch = pool.prepare_batch(["a", "b", None, "a", "b"])
    x, weights, ids = _inputs(m, layer, top_k, F16, "cpu", seed=1)
    layer(x, weights, ids, batch)  # records the aligned, contiguous call's trace
    if case == "misaligned_x":  # one fp16 element off a 16-byte boundary
        x = torch.empty(x.numel() + 1, dtype=F16)[1:].view_as(x).copy_(x)
    elif case == "strided_x":
        x = torch.empty(m, 2 * x.shape[1], dtype=F16)[:, ::2].copy_(x)
    elif case == "bf16_weights":  # transformers' routers hand the weights over in the model's dtype
        weights = weights.to(BF16)
    else:
        ids = torch.empty(m, 2 * top_k, dtype=ids.dtype)[:, ::2].copy_(ids)
    calls = _count_eager_calls(monkeypatch)
    got = layer(x, weights, ids, batch)
    assert len(calls) == (1 if case == "misaligned_x" else 0)
    assert len(layer.launch_cache.traces) == 1, "nothing new recorded"
    ref = _eager(layer, x.contiguous(), weights.float(), ids.contiguous(), batch, monkeypatch)
    assert torch.equal(got, ref)


@pytest.mark.interpreter
def test_switch_off_and_keys(monkeypatch):
    layer, pool, top_k = _setup(F16, "cpu")
    x, weights, ids = _inputs(3, layer, top_k, F16, "cpu", seed=0)
    monkeypatch.setenv("MOELORA_LAUNCH_TRACE", "0")
    layer(x, weights, ids, None)
    assert not layer.launch_cache.traces
    monkeypatch.delenv("MOELORA_LAUNCH_TRACE")
    layer.launch_cache.clear()  # switches are read once per cache
    layer(x, weights, ids, None)
    # Rank tile 16 with two adapters, then one adapter of rank 5: other launches, other keys.
    layer(x, weights, ids, pool.prepare_batch(["a", "b", None]))
    layer(x, weights, ids, pool.prepare_batch(["b", "b", None]))
    assert len(layer.launch_cache.traces) == 3
    layer.activation = "gelu"  # a layer setting the launches depend on
    layer(x, weights, ids, None)
    assert len(layer.launch_cache.traces) == 4


def test_trace_holds_no_tensors_and_is_bounded():
    """A trace keeps pointers' sources and offsets, never the tensors (which would keep every call's
    intermediates alive); the cache keeps at most ``max_traces``."""
    calls = []

    class Kernel:  # stands in for an interpreter kernel (no device caches)
        def __getitem__(self, grid):
            return lambda **kwargs: calls.append(kwargs)

    cache = LaunchCache(max_traces=2)
    x = torch.arange(8.0)
    for key in range(3):
        with cache, cache.recording([x]) as recorder:
            out = torch.empty(8)
            scratch = torch.empty(4)
            cache.launch(Kernel(), (1,), dict(x_ptr=x[2:], out_ptr=out, scratch_ptr=scratch, n=8))
        trace = recorder.trace(out)
        cache.keep_trace(key, trace)
    assert list(cache.traces) == [1, 2]
    (traced,) = trace.launches
    assert not any(isinstance(arg, torch.Tensor) for arg in traced.args)
    # x[2:] is input 0 at byte offset 8; the output is the last source, the scratch buffer in between.
    assert sorted(traced.pointers) == [(0, 0, 8), (1, 2, 0), (2, 1, 0)]
    new_x = torch.arange(8.0) + 100
    replayed_out = trace.replay([new_x])
    replayed = calls[-1]
    assert torch.equal(replayed["x_ptr"], new_x[2:])
    assert replayed["out_ptr"].data_ptr() == replayed_out.data_ptr() and replayed["n"] == 8


def test_tensors_inside_tuple_arguments_are_traced():
    """An operand's bundle (a tuple of pointer, strides, nested tuples) keeps its structure; its tensors
    become sources at their paths and come back as the replay's tensors."""
    calls = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda **kwargs: calls.append(kwargs)

    cache = LaunchCache()
    x = torch.arange(8.0)
    with cache, cache.recording([x]) as recorder:
        out = torch.empty(8)
        cache.launch(Kernel(), (1,), dict(a=(x[2:], 1, (out, 3)), n=8, CFG=(16, True)))
    trace = recorder.trace(out)
    (traced,) = trace.launches
    assert sorted(traced.pointers) == [((0, 0), 0, 8), ((0, 2, 0), 1, 0)]
    assert traced.args[0] == (None, 1, (None, 3)) and traced.args[2] == (16, True)
    new_x = torch.arange(8.0) + 100
    replayed_out = trace.replay([new_x])
    a = calls[-1]["a"]
    assert torch.equal(a[0], new_x[2:]) and a[1] == 1 and a[2][1] == 3
    assert a[2][0].data_ptr() == replayed_out.data_ptr() and calls[-1]["CFG"] == (16, True)


def test_untraceable_recordings():
    class Kernel:
        def __getitem__(self, grid):
            return lambda **kwargs: None

    cache = LaunchCache()
    x = torch.zeros(8)
    # Overlapping inputs: a pointer into both cannot be told apart at replay.
    with cache, cache.recording([x, x[4:]]) as recorder:
        out = torch.empty(8)
        cache.launch(Kernel(), (1,), dict(a=x[5:], out=out))
    assert recorder.trace(out) is None
    # An output that is an input (in place) or a view of a larger buffer is not a fresh output.
    with cache, cache.recording([x]) as recorder:
        cache.launch(Kernel(), (1,), dict(a=x))
    assert recorder.trace(x) is None
    with cache, cache.recording([x]) as recorder:
        big = torch.empty(16)
        cache.launch(Kernel(), (1,), dict(a=x, out=big[:8]))
    assert recorder.trace(big[:8]) is None
    with pytest.raises(RuntimeError, match="one call at a time"), cache.recording([x]), cache.recording([x]):
        pass


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["split", "fused", "staged"])
# 1: direct decode pairs; 7: one-program alignment with the decode shrink; 300: three-launch alignment,
# the prefill shrinks and their split sums (odd: partial blocks).
@pytest.mark.parametrize("m", [1, 7, 300])
# Replays through the native launcher (one C call per replay) and through Triton's launcher.
@pytest.mark.parametrize("native", ["1", "0"])
def test_replay_matches_eager_on_new_inputs_gpu(path, m, native, monkeypatch):
    monkeypatch.setenv("MOELORA_NATIVE_LAUNCH", native)
    layer, pool, top_k = _setup(BF16, "cuda", hidden=2048, inter=768, experts=16, top_k=6, path=path)
    _check_replays(layer, pool, top_k, BF16, "cuda", m, monkeypatch, names_of=lambda step: _mix(step, m))
    (trace,) = layer.launch_cache.traces.values()
    assert (trace.native_plan is not None) == (native == "1"), "every binary of the layer launches natively"
    calls = _count_eager_calls(monkeypatch)
    for step in range(2):  # the base call (no adapter) has a trace of its own
        x, weights, ids = _inputs(m, layer, top_k, BF16, "cuda", seed=10 + step)
        assert torch.equal(layer(x, weights, ids, None), _eager(layer, x, weights, ids, None, monkeypatch))
    assert len(calls) == 1 + 2


@pytest.mark.gpu
@pytest.mark.parametrize("native", ["1", "0"])
def test_replay_inside_cuda_graph_capture_gpu(native, monkeypatch):
    """A replay queued while a stream is captured is recorded by the capture like any launch."""
    monkeypatch.setenv("MOELORA_NATIVE_LAUNCH", native)
    layer, pool, top_k = _setup(BF16, "cuda", hidden=2048, inter=768, experts=16, top_k=6)
    batch = pool.prepare_batch(["a", "b", None, "a"])
    x, weights, ids = _inputs(4, layer, top_k, BF16, "cuda", seed=0)
    ref = layer(x, weights, ids, batch)  # records the trace
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        out = layer(x, weights, ids, batch)
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref)


@pytest.mark.interpreter
@pytest.mark.parametrize("path", ["staged", "split"])
def test_pairs_grouped_by_adapter_replay_interpreter(path, monkeypatch):
    """The LoRA launches on pairs grouped by (expert, adapter) (``lora_by_adapter``): that alignment is
    launches only, so the call replays from its trace like any other, bit for bit."""
    from triton_ops.overrides import LAUNCH_OVERRIDES

    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_by_adapter", "1")
    layer, pool, top_k = _setup(F16, "cpu", path=path)
    _check_replays(layer, pool, top_k, F16, "cpu", 67, monkeypatch, names_of=lambda step: _mix(step, 67))


@pytest.mark.interpreter
def test_calls_with_torch_work_between_launches_are_not_replayed_interpreter(monkeypatch):
    """A call whose device work includes torch operations between its launches (``not_replayable()``, here
    from inside the alignment) cannot be replayed from a trace: every call runs through ``fused_experts``
    (nothing is kept to replay) and equals the eager forward."""
    from triton_ops.launch import not_replayable

    fused = importlib.import_module("triton_ops.fused_experts")
    align = fused.moe_align_block_size
    monkeypatch.setattr(fused, "moe_align_block_size", lambda *a, **kw: not_replayable() or align(*a, **kw))
    layer, pool, top_k = _setup(F16, "cpu", path="staged")
    calls = _count_eager_calls(monkeypatch)
    for step in range(3):
        x, weights, ids = _inputs(67, layer, top_k, F16, "cpu", seed=step)
        batch = pool.prepare_batch(_mix(step, 67))
        got = layer(x, weights, ids, batch)
        assert torch.equal(got, _eager(layer, x, weights, ids, batch, monkeypatch))
    assert len(calls) == 6  # three calls and three eager references
    assert not layer.launch_cache.traces
