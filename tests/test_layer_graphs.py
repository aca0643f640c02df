"""``FusedMoEWithLoRA(cuda_graphs=True)``: eager calls replayed from a CUDA graph per token-count bucket (the
next power of two) give the bits of the eager forward of that many tokens, the extra rows routed nowhere,
with new inputs, new token -> adapter mappings and adapters rewritten in their slots between replays; stale
batches are still refused; calls inside an outer capture run eagerly."""

from __future__ import annotations

import pytest
import torch
from test_lora_layer import make_adapter, make_base, make_pool, make_routing

from moelora.layer import FusedMoEWithLoRA

gpu = pytest.mark.gpu
BF16 = torch.bfloat16
# Sizes past the kernels' tiles with odd parts: H 320 = 2.5 x 128, I 200 not a multiple of 64, 12 experts
# (not a power of two), top-k 6 (several experts a token).
H, INTER, E, TOP_K = 320, 200, 12, 6


def _setup(device, *, path="split", graph_max_tokens=512, dtype=BF16, sizes=(E, H, INTER)):
    experts, hidden, inter = sizes
    pool = make_pool(dtype, max_loras=4, max_rank=16, num_experts=experts, hidden=hidden, inter=inter,
                     layer_ids=(3,), device=device)
    # Ranks that differ per adapter.
    for name, rank in (("a", 16), ("b", 7)):
        pool.add_adapter_weights(name, make_adapter(rank, 2.0, dtype, layers=(3,), num_experts=experts,
                                                    hidden=hidden, inter=inter))
    w13, w2 = make_base(experts, hidden, inter, dtype, device)
    graphed = FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=3, path=path, cuda_graphs=True,
                               graph_max_tokens=graph_max_tokens)
    eager = FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=3, path=path)
    return pool, graphed, eager


def _inputs(m, device, seed, dtype=BF16, sizes=(E, H)):
    torch.manual_seed(seed)
    weights, ids = make_routing(m, sizes[0], TOP_K, device=device)
    return torch.randn(m, sizes[1], device=device).to(dtype), weights, ids


def _eager_padded(eager, pool, x, weights, ids, names, rows):
    """The eager forward of ``rows`` tokens whose first are the call's and the rest route nowhere, cut back
    to the call's rows: what a graph of ``rows`` tokens computes for the call."""
    m = x.shape[0]
    px = torch.cat([x, x.new_zeros(rows - m, x.shape[1])])
    pw = torch.cat([weights, weights.new_zeros(rows - m, weights.shape[1])])
    pids = torch.cat([ids, ids.new_full((rows - m, ids.shape[1]), -1)])
    batch = None if names is None else pool.prepare_batch(list(names) + [None] * (rows - m))
    return eager(px, pw, pids, batch)[:m]


def test_graph_bounds_are_checked():
    pool, _, _ = _setup("cpu")
    w13, w2 = make_base(E, H, INTER, BF16)
    for name in ("graph_max_tokens", "max_graphs"):
        for bad in (0, -3, 1.5, True):
            with pytest.raises(ValueError, match=f"{name} must be a positive int"):
                FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=3, cuda_graphs=True, **{name: bad})


def test_least_recently_replayed_graph_is_dropped():
    pool, graphed, _ = _setup("cpu")
    graphed.max_graphs = 2
    graphed._keep_graph("a", "graph a")
    graphed._keep_graph("b", "graph b")
    graphed._graphs.move_to_end("a")  # a replayed since b
    graphed._keep_graph("c", "graph c")
    assert list(graphed._graphs) == ["a", "c"]


def test_graphed_call_copies_a_calls_rows_and_returns_them_fresh():
    """A replay copies the call's rows into the graph's first rows, sets the rows a bigger call wrote past
    them back to no expert and no adapter, and returns a new tensor of the call's rows of the output; the
    row views are made once per token count.
    CPU tensors and a stand-in graph: the bookkeeping, not the capture (GPU tests replay real graphs)."""
    from moelora.batch_info import MoELoRABatchInfo
    from moelora.layer import _GraphedCall

    class Graph:
        replays = 0

        def replay(self):
            Graph.replays += 1

    rows, hidden, top_k = 8, 3, 2
    out = torch.arange(rows * hidden, dtype=torch.float32).view(rows, hidden)
    graphed = _GraphedCall(Graph(), torch.zeros(rows, hidden), torch.zeros(rows, top_k),
                           torch.full((rows, top_k), -1, dtype=torch.int32),
                           torch.full((rows,), -1, dtype=torch.int32), out)
    for m in (5, 8, 5):
        x = torch.randn(m, hidden)
        weights, ids = torch.rand(m, top_k), torch.randint(0, 4, (m, top_k), dtype=torch.int32)
        batch = MoELoRABatchInfo.__new__(MoELoRABatchInfo)
        object.__setattr__(batch, "token_slots", torch.arange(m, dtype=torch.int32))
        result = graphed.replay(x, weights, ids, batch)
        assert torch.equal(graphed.x[:m], x) and torch.equal(graphed.topk_weights[:m], weights)
        assert torch.equal(graphed.topk_ids[:m], ids)
        assert torch.equal(graphed.token_slots[:m], batch.token_slots)
        assert torch.equal(result, out[:m]) and result.data_ptr() != out.data_ptr()
        # rows past the call's route nowhere and use no adapter, whatever a bigger call wrote there
        assert (graphed.topk_ids[m:] == -1).all() and (graphed.token_slots[m:] == -1).all()
    assert Graph.replays == 3 and sorted(graphed._views) == [5, 8]


def test_cpu_tensors_run_eagerly():
    """No CUDA: the flag changes nothing (fp16: the interpreter's bf16 dot is not usable; sizes small for
    the interpreter, odd and past no tile: what is checked is that nothing is captured)."""
    sizes = (7, 40, 24)
    pool, graphed, eager = _setup("cpu", path="auto", dtype=torch.float16, sizes=sizes)
    x, weights, ids = _inputs(5, "cpu", 0, dtype=torch.float16, sizes=sizes[:2])
    batch = pool.prepare_batch(["a", None, "b", "a", "b"])
    for _ in range(3):
        assert torch.equal(graphed(x, weights, ids, batch), eager(x, weights, ids, batch))
    assert not graphed._graphs


@gpu
@pytest.mark.parametrize("path", ["split", "fused"])
# 1: direct decode pairs; 5 and 64: the one-program alignment (decode shrink); 200: three-launch alignment.
@pytest.mark.parametrize("m", [1, 5, 64, 200])
def test_replays_match_eager(path, m):
    pool, graphed, eager = _setup("cuda", path=path)
    names_by_call = [["a", "b", None], ["b", None, "a"], ["a"], [None, "b"]]
    for call, pattern in enumerate(names_by_call * 2):
        x, weights, ids = _inputs(m, "cuda", call)
        names = [pattern[i % len(pattern)] for i in range(m)]  # tokens with no adapter too
        batch = pool.prepare_batch(names)
        rows = 1 << (m - 1).bit_length()
        expected = _eager_padded(eager, pool, x, weights, ids, names, rows)
        assert torch.equal(graphed(x, weights, ids, batch), expected), call
        base = _eager_padded(eager, pool, x, weights, ids, None, rows)
        assert torch.equal(graphed(x, weights, ids, None), base)
        # The bucket's padding changes nothing beyond the kernels' tiles: the eager forward of the call's own
        # tokens agrees within bf16 rounding.
        torch.testing.assert_close(expected, eager(x, weights, ids, batch), atol=2e-2, rtol=2e-2)
    assert graphed._graphs, "later calls replayed a graph"


@gpu
def test_token_counts_share_graphs_by_power_of_two():
    """Calls of 1..40 tokens, each three times: seven graphs (of 1, 2, 4, 8, 16 and 32 rows, and of the bound,
    40, for 33..40 tokens), each call exact against its bucket's eager forward."""
    pool, graphed, eager = _setup("cuda", graph_max_tokens=40)
    for m in range(1, 41):
        x, weights, ids = _inputs(m, "cuda", m)
        names = [("a", "b", None)[i % 3] for i in range(m)]
        batch = pool.prepare_batch(names)
        rows = min(1 << (m - 1).bit_length(), 40)
        expected = _eager_padded(eager, pool, x, weights, ids, names, rows)
        for _ in range(3):
            assert torch.equal(graphed(x, weights, ids, batch), expected), m
    assert sorted(key[0] for key in graphed._graphs) == [1, 2, 4, 8, 16, 32, 40]


@gpu
def test_adapter_rewritten_between_replays():
    pool, graphed, eager = _setup("cuda")
    m = 9
    x, weights, ids = _inputs(m, "cuda", 3)
    names = ["a", "b", None] * 3
    batch = pool.prepare_batch(names)
    for _ in range(3):
        graphed(x, weights, ids, batch)
    slot = pool.slot_of("a")
    pool.unload_adapter("a")
    pool.add_adapter_weights("c", make_adapter(16, 0.5, BF16, layers=(3,), num_experts=E, hidden=H,
                                               inter=INTER))
    assert pool.slot_of("c") == slot
    with pytest.raises(ValueError, match="prepare_batch"):
        graphed(x, weights, ids, batch)  # the stale batch is refused before any replay
    batch = pool.prepare_batch(["c", "b", None] * 3, out=batch)
    out = graphed(x, weights, ids, batch)
    assert torch.equal(out, _eager_padded(eager, pool, x, weights, ids, ["c", "b", None] * 3, 16))


@gpu
def test_outputs_are_fresh_tensors():
    pool, graphed, _ = _setup("cuda")
    x, weights, ids = _inputs(4, "cuda", 1)
    batch = pool.prepare_batch(["a", "b", "a", None])
    outs = [graphed(x, weights, ids, batch) for _ in range(4)]
    x2, _, _ = _inputs(4, "cuda", 2)
    later = graphed(x2, weights, ids, batch)
    assert all(torch.equal(o, outs[0]) for o in outs[1:]), "a replay overwrote an earlier output"
    assert not torch.equal(later, outs[0])


@gpu
def test_inside_an_outer_capture_runs_eagerly():
    pool, graphed, eager = _setup("cuda")
    x, weights, ids = _inputs(3, "cuda", 4)
    batch = pool.prepare_batch(["a", None, "b"])
    expected = eager(x, weights, ids, batch)
    for _ in range(2):
        graphed(x, weights, ids, batch)  # the layer's own graph exists
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graphed(x, weights, ids, batch)
    torch.cuda.current_stream().wait_stream(side)
    outer = torch.cuda.CUDAGraph()
    with torch.cuda.graph(outer):
        captured = graphed(x, weights, ids, batch)
    outer.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, expected)


@gpu
def test_more_tokens_than_the_bound_run_eagerly():
    pool, graphed, eager = _setup("cuda", graph_max_tokens=8)
    x, weights, ids = _inputs(9, "cuda", 5)
    batch = pool.prepare_batch(["a", "b", None] * 3)
    for _ in range(3):
        assert torch.equal(graphed(x, weights, ids, batch), eager(x, weights, ids, batch))
    assert not graphed._graphs
