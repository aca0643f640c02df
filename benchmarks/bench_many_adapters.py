"""Throughput with many resident adapters of mixed ranks, and resident adapters per GB of adapter memory.

    PYTHONPATH=. python benchmarks/bench_many_adapters.py --out benchmarks/results/bench_many_adapters_DEVICE

For each model shape (one MoE layer, bf16), ``N`` adapters are loaded into a real ``MoELoRAMemoryPool``
(``add_adapter_weights``; ranks cycle 8, 16, 32, 64, every expert trained) and a batch of ``M`` tokens
spread over them (uniform or zipf popularity, ``moelora.bench.token_slots_for``) runs through
``FusedMoEWithLoRA`` (path "auto"). Each point is the median of CUDA-graph replays with L2 flushed before
each (``moelora.bench.graph_rounds_us``), timed interleaved with the one-adapter batch of the same M
(one adapter of rank 64: the costliest of the mix) and the base layer; throughput relative to one adapter
is ``t(1 adapter) / t(N adapters)``.

Adapters per GB (host arithmetic, no GPU): a full model's adapter of each rank takes
``layers x E x rank`` arena units (``MoELoRAMemoryPool.unit_bytes_for``); the dense slot layout every
adapter took before takes ``layers x E x max_rank`` whatever its rank. Reported for the mix above, for
rank 8 alone, and for ESFT-style adapters training an eighth of the experts.

Writes ``OUT.json`` and ``OUT.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moelora import FusedMoEWithLoRA, MoELoRAMemoryPool  # noqa: E402
from moelora.bench import MODELS, graph_rounds_us, make_routing, make_weights, token_slots_for  # noqa: E402
from moelora.reference import LoRAProjection, ReferenceLoRA  # noqa: E402

RANKS = (8, 16, 32, 64)
# Full models' MoE layer counts (config.json num_hidden_layers minus dense layers).
MOE_LAYERS = {"qwen3-30b-a3b": 48, "deepseek-v2-lite": 26}


def adapter(shape, rank: int, pool_rng: torch.Tensor) -> dict[int, ReferenceLoRA]:
    """One layer's adapter of ``rank`` on every expert, its tensors views of ``pool_rng`` (the values do
    not matter to the timing; views keep 128 adapters' host generation cheap)."""
    lora = ReferenceLoRA()
    h, i = shape.H, shape.I
    for e in range(shape.E):
        for mod, (in_f, out_f) in (("gate", (h, i)), ("up", (h, i)), ("down", (i, h))):
            a = pool_rng[: rank * in_f].view(rank, in_f)
            b = pool_rng[rank * in_f : rank * in_f + out_f * rank].view(out_f, rank)
            getattr(lora, mod)[e] = LoRAProjection(a=a, b=b, scaling=0.5)
    return {0: lora}


def adapters_per_gb(shape, layers: int) -> dict[str, float]:
    unit = MoELoRAMemoryPool.unit_bytes_for(shape.H, shape.I, torch.bfloat16)
    dense = layers * shape.E * max(RANKS) * unit  # a slot of the dense layout at max rank 64
    mix = sum(layers * shape.E * r * unit for r in RANKS) / len(RANKS)
    r8 = layers * shape.E * 8 * unit
    esft = layers * max(1, shape.E // 8) * 16 * unit
    return {"dense_slot_gb": dense / 1e9, "per_gb_dense": 1e9 / dense, "per_gb_mix": 1e9 / mix,
            "per_gb_rank8": 1e9 / r8, "per_gb_esft_rank16": 1e9 / esft, "mix_gain": dense / mix,
            "rank8_gain": dense / r8, "esft_gain": dense / esft}


def bench_model(name: str, ms: list[int], ns: list[int], popularities: list[str], rounds: int,
                warmup_ms: float, rep_ms: float) -> list[dict]:
    shape = MODELS[name]
    dev, dtype = torch.device("cuda"), torch.bfloat16
    w13, w2 = make_weights(shape, dtype, dev, seed=0)
    max_n = max(ns)
    unit = MoELoRAMemoryPool.unit_bytes_for(shape.H, shape.I, dtype)
    need_units = sum(shape.E * RANKS[k % len(RANKS)] for k in range(max_n)) + shape.E * max(RANKS)
    pool = MoELoRAMemoryPool(num_experts=shape.E, hidden_size=shape.H, intermediate_size=shape.I,
                             layer_ids=[0], max_loras=max_n + 1, max_rank=max(RANKS), dtype=dtype,
                             device=dev, arena_bytes=need_units * unit)
    rng = torch.randn(max(RANKS) * (2 * shape.H + 2 * shape.I), dtype=dtype) * 0.02
    names = [f"a{k}" for k in range(max_n)]
    for k, n in enumerate(names):
        pool.add_adapter_weights(n, adapter(shape, RANKS[k % len(RANKS)], rng))
    pool.add_adapter_weights("one64", adapter(shape, 64, rng))
    layer = FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=0, path="auto", cuda_graphs=False)
    report = pool.memory_report()
    print(f"{name}: {max_n + 1} adapters resident, arena {report.arena_bytes / 1e9:.2f} GB, used "
          f"{report.used_bytes / 1e9:.2f} GB", flush=True)
    records = []
    for m in ms:
        weights, ids = make_routing(m, shape, 100 + m, dev)
        x = torch.randn(m, shape.H, device=dev, dtype=dtype)
        one = pool.prepare_batch(["one64"] * m)
        for n in ns:
            for pop in popularities:
                if n == 1 and pop != popularities[0]:
                    continue
                slots = token_slots_for(m, n, pop, seed=7 * m + n).tolist()
                batch = pool.prepare_batch([names[s] for s in slots])
                calls = [lambda: layer(x, weights, ids, None),  # noqa: B023
                         lambda: layer(x, weights, ids, one),  # noqa: B023
                         lambda: layer(x, weights, ids, batch)]  # noqa: B023
                (base, single, many), _ = graph_rounds_us(calls, warmup_ms, rep_ms, rounds=rounds)
                mid = sorted(range(rounds), key=lambda r: many[r] / single[r])[rounds // 2]
                rec = {"model": name, "M": m, "N": n, "popularity": pop, "ranks": list(RANKS),
                       "base_us": base[mid], "one_adapter_us": single[mid], "n_adapters_us": many[mid],
                       "throughput_vs_one": single[mid] / many[mid],
                       "ranks_in_batch": sorted({RANKS[s % len(RANKS)] for s in slots})}
                records.append(rec)
                print(f"  M={m} N={n} {pop}: base {base[mid]:.1f} us, one r64 {single[mid]:.1f}, "
                      f"N {many[mid]:.1f} -> {rec['throughput_vs_one']:.3f}", flush=True)
                batch.release()
        one.release()
    pool.close()
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MOE_LAYERS), choices=list(MOE_LAYERS))
    parser.add_argument("--M", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--N", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--popularity", nargs="+", default=["uniform", "zipf"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=25.0)
    parser.add_argument("--rep", type=float, default=100.0)
    parser.add_argument("--out", required=True, help="output path without extension")
    args = parser.parse_args()
    memory = {name: adapters_per_gb(MODELS[name], MOE_LAYERS[name]) for name in args.models}
    records = []
    for name in args.models:
        records += bench_model(name, args.M, args.N, args.popularity, args.rounds, args.warmup, args.rep)
    device = torch.cuda.get_device_name()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"device": device, "records": records, "memory": memory}
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = [f"# Many resident adapters, {device}, bf16, one MoE layer, ranks cycling {list(RANKS)}", "",
             "Throughput relative to one rank-64 adapter at the same M (median of interleaved rounds).", "",
             "| model | M | N | popularity | base µs | 1 adapter µs | N adapters µs | throughput vs 1 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['model']} | {r['M']} | {r['N']} | {r['popularity']} | {r['base_us']:.1f} | "
                     f"{r['one_adapter_us']:.1f} | {r['n_adapters_us']:.1f} | {r['throughput_vs_one']:.3f} |")
    lines += ["", "Resident adapters per GB of adapter memory, whole model (bf16, max rank 64):", "",
              "| model | dense slot (GB) | per GB, dense slots | per GB, mix 8/16/32/64 | per GB, rank 8 | "
              "per GB, ESFT (E/8 experts, rank 16) |", "|---|---|---|---|---|---|"]
    for name, mem in memory.items():
        lines.append(f"| {name} | {mem['dense_slot_gb']:.2f} | {mem['per_gb_dense']:.2f} | "
                     f"{mem['per_gb_mix']:.2f} ({mem['mix_gain']:.1f}x) | {mem['per_gb_rank8']:.2f} "
                     f"({mem['rank8_gain']:.1f}x) | {mem['per_gb_esft_rank16']:.2f} "
                     f"({mem['esft_gain']:.1f}x) |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
