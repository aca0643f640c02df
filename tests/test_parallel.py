"""Tensor- and expert-parallel MoE LoRA layers (``moelora.parallel``).

A shard's layer returns that rank's partial output; the partial outputs of all ranks sum to the
single-process layer (the row-parallel down LoRA needs no communication of its own). Checked in one process
(the sum of the shards' outputs), over torch.distributed with gloo (2 and 4 spawned processes, the layer's own
all-reduce), and on 2 GPUs with NCCL (bf16, eager and in CUDA graphs)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moelora import AdapterLoadError, FusedMoEWithLoRA, LoRAProjection, MoELoRAMemoryPool, ReferenceLoRA
from moelora.parallel import MoEShard
from triton_ops.overrides import LAUNCH_OVERRIDES

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

F32 = torch.float32


def random_adapter(num_experts, hidden, inter, rank, seed, layers=(0,), skip_experts=()):
    """Every expert's gate/up/down with its own rank (rank, rank - 1, ...: ranks that differ per module) and
    scaling; experts in ``skip_experts`` have no LoRA."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for lid in layers:
        lora = ReferenceLoRA()
        for e in range(num_experts):
            if e in skip_experts:
                continue
            r = max(1, rank - e % 3)
            s = 0.5 + 0.1 * e
            lora.gate[e] = LoRAProjection(torch.randn(r, hidden, generator=gen) * 0.3,
                                          torch.randn(inter, r, generator=gen) * 0.3, s)
            lora.up[e] = LoRAProjection(torch.randn(r, hidden, generator=gen) * 0.3,
                                        torch.randn(inter, r, generator=gen) * 0.3, s)
            lora.down[e] = LoRAProjection(torch.randn(r, inter, generator=gen) * 0.3,
                                          torch.randn(hidden, r, generator=gen) * 0.3, 1.5 * s)
        out[lid] = lora
    return out


def make_case(num_experts=6, hidden=16, inter=12, m=9, top_k=2, seed=0, dtype=F32, device="cpu"):
    """Base weights, x and routing; drawn on ``device`` (the same numbers in every process on its GPU)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    scale = 1.0 / hidden**0.5

    def draw(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=F32)

    w13 = (draw(num_experts, 2 * inter, hidden) * scale).to(dtype)
    w2 = (draw(num_experts, hidden, inter) * inter**-0.5).to(dtype)
    x = draw(m, hidden).to(dtype)
    logits = draw(m, num_experts)
    logits[:, num_experts - 1] = -1e9  # an expert no token picks
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return w13, w2, x, weights, ids


ADAPTERS = {"a": 4, "b": 8}  # ranks that differ per adapter
NAMES = ["a", "b", None]  # tokens with no adapter


def build_pool(num_experts, hidden, inter, shard=None, dtype=F32, device="cpu", layers=(0,)):
    pool = MoELoRAMemoryPool(num_experts, hidden, inter, list(layers), max_loras=4, max_rank=8, dtype=dtype,
                             device=device, shard=shard)
    for i, (name, rank) in enumerate(ADAPTERS.items()):
        skip = (1,) if name == "b" else ()  # an expert without LoRA
        pool.add_adapter_weights(name, random_adapter(num_experts, hidden, inter, rank, seed=10 + i,
                                                      layers=layers, skip_experts=skip))
    return pool


def whole_layer_output(case, path="torch"):
    w13, w2, x, weights, ids = case
    pool = build_pool(w13.shape[0], x.shape[1], w2.shape[2], dtype=x.dtype, device=x.device)
    layer = FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=0, path=path)
    return layer(x, weights, ids, pool.prepare_batch([NAMES[t % 3] for t in range(x.shape[0])]))


def shard_output(case, shard, path="torch", calls=1, **layer_kw):
    """The shard's layer output (a list of ``calls`` outputs of the same layer when ``calls`` > 1)."""
    w13, w2, x, weights, ids = case
    pool = build_pool(w13.shape[0], x.shape[1], w2.shape[2], shard=shard, dtype=x.dtype, device=x.device)
    local_w13, local_w2 = shard.split_weights(w13, w2)
    layer = FusedMoEWithLoRA(local_w13, local_w2, pool=pool, layer_id=0, path=path, **layer_kw)
    batch = pool.prepare_batch([NAMES[t % 3] for t in range(x.shape[0])])
    outs = [layer(x, weights, ids, batch) for _ in range(calls)]
    return outs[0] if calls == 1 else outs


def shards(num_experts, inter, tp, ep, experts_of=None):
    return [MoEShard(num_experts, inter, tp_rank=t, tp_size=tp, ep_rank=p, ep_size=ep,
                     experts=None if experts_of is None else experts_of[p])
            for t in range(tp) for p in range(ep)]


# (tp, ep, experts per expert-parallel rank or None for contiguous)
LAYOUTS = [
    (2, 1, None),
    (1, 2, None),
    (2, 2, None),
    (3, 1, None),  # I = 12 in three shares of 4
    (1, 2, [[5, 0, 3], [1, 4, 2]]),  # an expert map, not contiguous, in its own order
]


@pytest.mark.parametrize("tp,ep,experts_of", LAYOUTS)
@pytest.mark.parametrize("top_k", [1, 2, 6])
def test_shards_sum_to_the_whole_layer(tp, ep, experts_of, top_k):
    case = make_case(top_k=top_k)
    want = whole_layer_output(case)
    got = sum(shard_output(case, shard) for shard in shards(6, 12, tp, ep, experts_of))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.interpreter
@pytest.mark.parametrize("path", ["split", "fused", "staged"])
@pytest.mark.parametrize("m", [1, 9])  # one token: direct pairs (other ranks' pairs in the GEMMs); 9: aligned
@pytest.mark.parametrize("sparse_align", ["0", "1"])  # one token's other-rank pairs: direct, or null blocks
def test_shards_sum_to_the_whole_layer_triton_interpreter(path, m, sparse_align, monkeypatch):
    monkeypatch.setitem(LAUNCH_OVERRIDES, "sparse_align", sparse_align)
    case = make_case(m=m, top_k=2, inter=16)
    case = tuple(t.half() if t.is_floating_point() and i != 3 else t for i, t in enumerate(case))
    want = whole_layer_output(case, path=path)
    got = sum(shard_output(case, shard, path=path).float() for shard in shards(6, 16, 2, 2))
    torch.testing.assert_close(got, want.float(), rtol=2e-2, atol=2e-2)


def test_expert_parallel_pool_holds_only_its_experts():
    full = build_pool(6, 16, 12)
    half = build_pool(6, 16, 12, shard=MoEShard(6, 12, ep_rank=1, ep_size=2))
    tp_half = build_pool(6, 16, 12, shard=MoEShard(6, 12, tp_rank=1, tp_size=2))
    # A unit (one rank row of one expert's four matrices) holds the shard's I columns: the whole I on an
    # expert-parallel rank, half of it on a tensor-parallel one. fp32.
    assert full.unit_bytes == half.unit_bytes == 3 * (16 + 12) * 4
    assert tp_half.unit_bytes == 3 * (16 + 6) * 4
    # The default arena holds max_loras adapters of max_rank on every local expert: half the experts, half
    # the units. Zero block (8 units) and tail (16 units) aside, nbytes is that many units.
    capacity = {p: p._units.total_units - p._units.reserved_units for p in (full, half, tp_half)}
    assert capacity[full] == 4 * 1 * 6 * 8 and capacity[half] * 2 == capacity[full]
    assert capacity[tp_half] == capacity[full]
    for p in (full, half, tp_half):
        assert p.nbytes == (8 + capacity[p] + 16) * p.unit_bytes
    # Each adapter takes a block of its rank per local expert it trains ("b" has no LoRA on expert 1).
    trained = {full: {"a": 6, "b": 5}, half: {"a": 3, "b": 3}, tp_half: {"a": 6, "b": 5}}
    for p, blocks in trained.items():
        report = p.memory_report()
        got = {m.name: (m.rank, m.blocks, m.bytes) for m in report.adapters}
        assert got == {n: (ADAPTERS[n], k, k * ADAPTERS[n] * p.unit_bytes) for n, k in blocks.items()}
        assert report.used_bytes == sum(k * ADAPTERS[n] for n, k in blocks.items()) * p.unit_bytes
    assert half.num_experts == 3 and half.intermediate_size == 12
    assert tp_half.num_experts == 6 and tp_half.intermediate_size == 6
    assert half.expert_map.tolist() == [-1, -1, -1, 0, 1, 2] and tp_half.expert_map is None
    # Expert 4 of adapter a is local expert 1 on ep rank 1: its gate A, whole.
    a = random_adapter(6, 16, 12, 4, seed=10)[0]
    r = a.gate[4].a.shape[0]
    torch.testing.assert_close(half.layer(0).dense().gate_up_a[half.slot_of("a"), 1, :r], a.gate[4].a)
    # The tensor-parallel rank 1 holds rows 6..11 of gate B and columns 6..11 of down A.
    slot = tp_half.slot_of("a")
    scale = a.gate[4].scaling / tp_half.slot_scaling_host[slot]
    tp_dense = tp_half.layer(0).dense()
    assert tp_dense.gate_up_b.shape == (4, 6, 2 * 6, 8) and tp_dense.down_a.shape == (4, 6, 8, 6)
    torch.testing.assert_close(tp_dense.gate_up_b[slot, 4, :6, :r], a.gate[4].b[6:] * scale)
    torch.testing.assert_close(tp_dense.down_a[slot, 4, :r], a.down[4].a[:, 6:])


def test_shard_and_split_refusals():
    with pytest.raises(ValueError, match="does not divide into tp_size"):
        MoEShard(6, 12, tp_rank=0, tp_size=5)
    with pytest.raises(ValueError, match="pass experts="):
        MoEShard(6, 12, ep_rank=0, ep_size=4)
    with pytest.raises(ValueError, match=r"tp_rank must be an int in \[0, 2\)"):
        MoEShard(6, 12, tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="distinct"):
        MoEShard(6, 12, ep_size=2, experts=[1, 1])
    with pytest.raises(ValueError, match="the shard splits E=8"):
        MoELoRAMemoryPool(6, 16, 12, [0], device="cpu", shard=MoEShard(8, 12))
    with pytest.raises(TypeError, match="MoEShard"):
        MoELoRAMemoryPool(6, 16, 12, [0], device="cpu", shard=(0, 2))
    with pytest.raises(ValueError, match="w13 must be"):
        MoEShard(6, 12, tp_size=2).split_weights(torch.zeros(6, 12, 16), torch.zeros(6, 16, 12))
    pool = build_pool(6, 16, 12, shard=MoEShard(6, 12, tp_rank=0, tp_size=2))

    def state():
        return [*(t.clone() for t in pool.layer(0).dense().tensors()), pool.blocks.clone(),
                pool.slot_ranks.clone(), pool.slot_scalings.clone()]

    before = state()
    bad = random_adapter(6, 16, 12, 4, seed=3)
    # Gate B with 13 rows: sliced to rows 0..5 it would look like a valid local B.
    bad[0].gate[2] = LoRAProjection(bad[0].gate[2].a, torch.zeros(13, 4), 1.0)
    with pytest.raises(AdapterLoadError, match=r"layer 0 gate expert 2: LoRA B must be \(I=12, r\)"):
        pool.add_adapter_weights("c", bad)
    bad = random_adapter(6, 16, 12, 4, seed=3)
    bad[0].down[7] = bad[0].down[0]  # expert 7 of 6: not "another rank's"
    with pytest.raises(AdapterLoadError, match="expert 7: expert out of range"):
        pool.add_adapter_weights("c", bad)
    assert all(torch.equal(b, a) for b, a in zip(before, state(), strict=True))
    assert "c" not in pool.adapters()
    with pytest.raises(ValueError, match="process_group"):
        FusedMoEWithLoRA(*MoEShard(6, 12, tp_size=2).split_weights(*make_case()[:2]), pool=pool, layer_id=0,
                         reduce_results=True)


def test_sharded_pools_load_their_share_of_a_peft_folder():
    """Each rank reads the whole PEFT adapter and keeps its part; the parts sum to the whole layer."""
    import adapters.make_adapters as mk

    cfg = mk.TINY_QWEN3_MOE
    e, h, i = cfg["num_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    lid = mk.MOE_LAYER_IDS[0]
    gen = torch.Generator().manual_seed(2)
    w13, w2 = torch.randn(e, 2 * i, h, generator=gen) * 0.2, torch.randn(e, h, i, generator=gen) * 0.2
    x = torch.randn(7, h, generator=gen)
    weights, ids = torch.softmax(torch.randn(7, e, generator=gen), -1).topk(2, dim=-1)
    names = ["sql", "chat", None, "math", "sql", None, "chat"]

    def run(shard):
        pool = MoELoRAMemoryPool(e, h, i, mk.MOE_LAYER_IDS, max_loras=3, max_rank=16, dtype=F32, device="cpu",
                                 shard=shard)
        for name in ("sql", "chat", "math"):
            report = pool.load_adapter(name, ROOT / "adapters" / name)
        weights13, weights2 = (w13, w2) if shard is None else shard.split_weights(w13, w2)
        layer = FusedMoEWithLoRA(weights13, weights2, pool=pool, layer_id=lid, path="torch")
        return layer(x, weights, ids, pool.prepare_batch(names)), report.pool_bytes

    want, full_bytes = run(None)
    for tp, ep in ((2, 1), (1, 2), (2, 2)):
        parts = [run(shard) for shard in shards(e, i, tp, ep)]
        torch.testing.assert_close(sum(out for out, _ in parts), want, rtol=1e-5, atol=1e-5)
        if tp == 1:  # each expert-parallel rank holds (and reports) 1/P of the adapter's pool bytes
            assert all(nbytes * ep == full_bytes for _, nbytes in parts)


# --------------------------------------------------------------------------------------------------
# torch.distributed: the layer's own all-reduce (gloo on CPUs, NCCL on GPUs)
# --------------------------------------------------------------------------------------------------


def _worker(rank, world, init_file, out_dir, tp, ep, backend, dtype_name, shape, top_k, graphs):
    dtype = getattr(torch, dtype_name)
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        num_experts, hidden, inter, m = shape
        case = make_case(num_experts, hidden, inter, m=m, top_k=top_k, dtype=dtype, device=device)
        shard = MoEShard(num_experts, inter, tp_rank=rank // ep, tp_size=tp, ep_rank=rank % ep, ep_size=ep)
        group = dist.new_group(list(range(world)))
        # With graphs: the first call runs eagerly, the second captures, the third replays.
        outs = shard_output(case, shard, path="auto", calls=3, process_group=group, reduce_results=True,
                            cuda_graphs=graphs)
        torch.save([o.cpu() for o in outs], Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_distributed(tp, ep, backend="gloo", dtype_name="float32", shape=(6, 16, 12, 9), top_k=2,
                    graphs=False):
    world = tp * ep
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_worker, args=(world, init_file, tmp, tp, ep, backend, dtype_name, shape, top_k, graphs),
                 nprocs=world, join=True)
        return [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(world)]


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2), (2, 2)])
def test_gloo_all_reduce_gives_every_rank_the_whole_layer(tp, ep):
    outs = run_distributed(tp, ep)
    want = whole_layer_output(make_case())
    for rank_outs in outs:
        torch.testing.assert_close(rank_outs[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2)])
@pytest.mark.parametrize("shape,top_k", [
    ((64, 2048, 1408, 37), 6),  # DeepSeek-V2-Lite layer, an odd token count
    ((128, 2048, 768, 64), 8),  # Qwen3-30B-A3B
    ((256, 7168, 2048, 16), 8),  # DeepSeek-V3
])
def test_nccl_two_gpus_match_one_gpu(tp, ep, shape, top_k):
    outs = run_distributed(tp, ep, backend="nccl", dtype_name="bfloat16", shape=shape, top_k=top_k,
                           graphs=True)
    num_experts, hidden, inter, m = shape
    want = whole_layer_output(make_case(num_experts, hidden, inter, m=m, top_k=top_k, dtype=torch.bfloat16,
                                        device="cuda"), path="auto").float().cpu()
    scale = want.abs().max()
    for rank_outs in outs:
        eager, captured, replayed = rank_outs
        assert torch.equal(captured, replayed) or (captured - replayed).abs().max() <= 0.02 * scale
        for got in (eager, replayed):
            # bf16 partial outputs rounded before the all-reduce: a few bf16 steps of the output scale.
            err = (got.float() - want).abs().max()
            assert err <= 0.02 * scale, f"max error {err} of output scale {scale}"


@pytest.mark.gpu
# One token and five (10 pairs): expert-parallel decode batches that align.
@pytest.mark.parametrize("m", [1, 5])
def test_expert_parallel_aligned_decode_gpu(m):
    """Experts past L2 (DeepSeek-V3's H and I) align an expert-parallel rank's decode tokens (other ranks'
    pairs in null blocks), the gate/up shrink inside the alignment's launch. The two ranks' outputs, summed,
    equal the whole layer's."""
    from triton_ops.fused_experts import plan_chunk

    hidden, inter = 7168, 2048
    plan = plan_chunk(m, 2, 2, hidden, inter, torch.bfloat16, torch.device("cuda"),
                      lora=SimpleNamespace(max_rank=8, num_adapters=2), lora_path="split", config=None,
                      combine=True, sparse_routing=True)
    assert not plan.direct and plan.decode_shrink
    case = make_case(num_experts=4, hidden=hidden, inter=inter, m=m, top_k=2, dtype=torch.bfloat16,
                     device="cuda")
    want = whole_layer_output(case, path="split").float()
    got = sum(shard_output(case, shard, path="split").float() for shard in shards(4, inter, 1, 2))
    scale = want.abs().max()
    # Each rank's bf16 output is rounded before the sum: a few bf16 steps of the output scale.
    assert (got - want).abs().max() <= 0.02 * scale


def test_bench_parallel_dry_run():
    """The benchmark script under torchrun, 2 CPU processes with gloo (torch path), a tiny shape."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "benchmarks" / "bench_parallel.py"), "--dry-run", "--ep", "2"],
        capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| tiny | 80 |" in result.stdout and "(0.50) |" in result.stdout  # 1/2 of the LoRA bytes per rank


def test_bench_ep_dispatch_dry_run(tmp_path):
    """The all-reduce vs all-to-all communication benchmark under torchrun, 2 CPU processes with gloo."""
    import subprocess

    out = tmp_path / "ep.json"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "benchmarks" / "bench_ep_dispatch.py"), "--dry-run", "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    import json

    records = json.loads(out.read_text())["records"]
    assert [r["M"] for r in records] == [1, 8, 80]
    for r in records:
        assert 1.0 <= r["ranks_per_token"] <= 2.0
        # A ring all-reduce sends (P-1)/P of the tensor twice; the gather + reduce-scatter the same.
        assert r["allreduce_bytes"] == r["M"] * r["H"] * 4  # fp32 dry run, P = 2
        kinds = ("allreduce", "replicated_a2a", "gather_rs", "sharded_a2a")
        assert all(r[f"{kind}_us"] > 0 for kind in kinds)
    assert "| tiny | 80 |" in out.with_suffix(".md").read_text()


def test_ep_dispatch_splits():
    """Dispatch rows: a token travels once to each other rank holding one of its experts."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_ep_dispatch",
                                                  ROOT / "benchmarks" / "bench_ep_dispatch.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # 8 experts on 2 ranks (0-3 on rank 0); 5 tokens, owners 0, 0, 0, 1, 1.
    ids = torch.tensor([[0, 1], [0, 5], [6, 7], [2, 3], [4, 0]])
    owners = bench.token_owners(5, 2)
    assert owners.tolist() == [0, 0, 0, 1, 1]
    mask = bench.destination_mask(ids, 8, 2)
    assert mask.tolist() == [[True, False], [True, True], [False, True], [True, False], [True, True]]
    # Rank 0 sends tokens 1 and 2 to rank 1; rank 1 sends tokens 3 and 4 to rank 0.
    assert bench.a2a_splits(mask, owners, 0) == ([0, 2], [0, 2])
    send1, recv1 = bench.a2a_splits(mask, owners, 1)
    assert send1 == [2, 0] and recv1 == [2, 0]
    assert bench.token_owners(1, 2).tolist() == [0]  # one token: rank 1 owns none


def test_expert_parallel_decode_aligns_one_token():
    """An expert-parallel layer's token has pairs of other ranks' experts (id -1): aligned, they take null
    blocks that read nothing, instead of a direct GEMM program each (which would run on expert 0)."""
    from triton_ops.fused_experts import plan_chunk

    # DeepSeek-V3's experts (88 MB of bf16 weights each) are aligned; Qwen3-30B-A3B's (9 MB) stay direct,
    # their re-reads of expert 0 hit L2.
    kw = dict(rows=1, top_k=8, num_experts=64, hidden=7168, intermediate=2048, dtype=torch.bfloat16,
              device=torch.device("cpu"), lora=None, lora_path="fused", config=None, combine=True)
    dense, sparse = plan_chunk(**kw), plan_chunk(**kw, sparse_routing=True)
    assert dense.direct and dense.fused_sum
    assert not sparse.direct and not sparse.fused_sum
    kw.update(hidden=2048, intermediate=768)
    assert plan_chunk(**kw, sparse_routing=True).direct


@pytest.mark.parametrize("ep", ["1", "2"])  # experts by I share (packed_colwise/rowwise), or by expert
def test_demo_tensor_parallel_under_torchrun(ep):
    """``torchrun --nproc-per-node 2 -m moelora demo --tp 2 [--ep 2]``: transformers loads the tiny
    Qwen3-MoE with its tensor-parallel (and expert-parallel) plan (gloo), attach() serves each rank's share
    of every expert and adapter, and every request of the mixed batches (with hot-loads and an eviction)
    matches PEFT run unsharded."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
         "moelora", "demo", "--tp", "2", "--ep", ep, "--device", "cpu"],
        capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "2 cpu processes, tensor parallel" in result.stdout
    assert ("experts expert-parallel" in result.stdout) == (ep == "2")
    assert "all requests match PEFT" in result.stdout and "✗" not in result.stdout


@pytest.fixture
def one_rank_mesh(tmp_path):
    """A one-process gloo group and its 1-D CPU device mesh (DTensors need a mesh)."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_attach_reads_transformers_sharding(one_rank_mesh):
    """``_sharding_of`` turns the DTensor layouts of transformers' tensor- and expert-parallel plans into a
    MoEShard and refuses every other layout with its reason."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from moelora.integrations.transformers import _sharding_of

    def experts(w13, w2):
        module = nn.Module()
        module.gate_up_proj, module.down_proj = w13, w2
        return module

    model = nn.Module()
    w13, w2 = torch.randn(4, 8, 6), torch.randn(4, 6, 4)
    assert _sharding_of("e", experts(w13, w2), model) is None  # plain tensors: not sharded

    def dt(t, *placements):
        return distribute_tensor(t, one_rank_mesh, list(placements))

    shard, group = _sharding_of("e", experts(dt(w13, Shard(1)), dt(w2, Shard(2))), model)
    assert (shard.num_experts, shard.intermediate_size, shard.tp_size, shard.ep_size) == (4, 4, 1, 1)
    assert group is not None
    with pytest.raises(NotImplementedError, match="sharded as"):
        _sharding_of("e", experts(dt(w13, Replicate()), dt(w2, Replicate())), model)
    with pytest.raises(NotImplementedError, match="only one of gate_up_proj and down_proj is sharded"):
        _sharding_of("e", experts(dt(w13, Shard(1)), w2), model)
    # Expert parallel: served only where the expert-parallel ranks are the model's tensor-parallel ranks.
    by_expert = experts(dt(w13, Shard(0)), dt(w2, Shard(0)))
    with pytest.raises(NotImplementedError, match="hold different batches"):
        _sharding_of("e", by_expert, model)
    model._device_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    shard, _ = _sharding_of("e", by_expert, model)
    assert shard.experts == (0, 1, 2, 3) and shard.ep_size == 1
