"""Throughput with many resident adapters of mixed ranks, and resident adapters per GB of adapter memory.

    PYTHONPATH=. python benchmarks/bench_many_adapters.py --out benchmarks/results/bench_many_adapters_DEVICE

For each model shape (one MoE layer, bf16), ``N`` adapters are loaded into a real ``MoELoRAMemoryPool``
(``add_adapter_weights``; ranks cycle 8, 16, 32, 64, every expert trained, or with ``--trained F`` a
fixed random fraction F of them per adapter, the one-adapter reference too) and a batch of ``M`` tokens
spread over them (uniform or zipf popularity, ``moelora.bench.token_slots_for``; or, with ``--mixed D+P``,
a serving step of D decode tokens, each its own sequence, and one P-token prefill chunk of one adapter,
both drawn by the popularity: ``step_slots``) runs through
``FusedMoEWithLoRA`` (path "auto"). Each point is the median of CUDA-graph replays with L2 flushed before
each (``moelora.bench.graph_rounds_us``), timed interleaved with the one-adapter batch of the same M
(one adapter of rank 64: the costliest of the mix) and the base layer; throughput relative to one adapter
is ``t(1 adapter) / t(N adapters)``.

Adapters per GB (host arithmetic, no GPU): a full model's adapter of each rank takes
``layers x E x rank`` arena units (``MoELoRAMemoryPool.unit_bytes_for``); the dense slot layout every
adapter took before takes ``layers x E x max_rank`` whatever its rank. Reported for the mix above, for
rank 8 alone, and for ESFT-style adapters training an eighth of the experts.

``--ab NAME=VALUE`` (launch overrides, ``triton_ops.overrides``) also times the N-adapter batch on a second
layer captured with those overrides set, in the same rounds: ``ab_us`` and ``ab_over_rule`` (its time over
the rules' time, the median over rounds) in each record, for deciding a launch rule on these cells.
``--ab-path staged`` runs that second layer on the staged LoRA path (for its own rules, e.g.
``--ab-path staged --ab lora_by_adapter=1``; without it, ``lora_by_adapter=1`` moves only the split path's
shrinks).

Writes ``OUT.json``, ``OUT.md`` and ``OUT.png``; ``--render JSON`` re-renders a result (and its floors).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moelora import FusedMoEWithLoRA, MoELoRAMemoryPool  # noqa: E402
from moelora.bench import (  # noqa: E402
    MODELS,
    device_peaks,
    graph_rounds_us,
    make_routing,
    make_weights,
    popularity_weights,
    token_slots_for,
)
from moelora.reference import LoRAProjection, ReferenceLoRA  # noqa: E402
from triton_ops import overrides  # noqa: E402

RANKS = (8, 16, 32, 64)
# Full models' MoE layer counts (config.json num_hidden_layers minus dense layers).
MOE_LAYERS = {"qwen3-30b-a3b": 48, "deepseek-v2-lite": 26}


ONE = -1  # trained_experts' index of the one-adapter reference


def trained_experts(index: int, num_experts: int, fraction: float) -> list[int]:
    """The experts adapter ``index`` (``ONE``: the one-adapter reference) trains: all of them, or a fixed
    random ``fraction`` of them (at least one), as ESFT-style adapters train a few."""
    if fraction >= 1:
        return list(range(num_experts))
    gen = torch.Generator().manual_seed(1000 + index)
    count = max(1, round(fraction * num_experts))
    return sorted(torch.randperm(num_experts, generator=gen)[:count].tolist())


def adapter(shape, rank: int, pool_rng: torch.Tensor, experts: list[int] | None = None
            ) -> dict[int, ReferenceLoRA]:
    """One layer's adapter of ``rank`` on ``experts`` (default every expert), its tensors views of
    ``pool_rng`` (the values do not matter to the timing; views keep 128 adapters' host generation
    cheap)."""
    lora = ReferenceLoRA()
    h, i = shape.H, shape.I
    for e in range(shape.E) if experts is None else experts:
        for mod, (in_f, out_f) in (("gate", (h, i)), ("up", (h, i)), ("down", (i, h))):
            a = pool_rng[: rank * in_f].view(rank, in_f)
            b = pool_rng[rank * in_f : rank * in_f + out_f * rank].view(out_f, rank)
            getattr(lora, mod)[e] = LoRAProjection(a=a, b=b, scaling=0.5)
    return {0: lora}


def step_slots(m: int, n: int, popularity: str, decode: int = 0) -> torch.Tensor:
    """(M,) int32 slot of each token of a point: ``token_slots_for``, or with ``decode`` > 0 a mixed
    serving step: ``decode`` one-token sequences, each drawing its adapter by the popularity, then one
    prefill chunk of the other M - decode tokens, all of the adapter drawn for it."""
    if not decode:
        return token_slots_for(m, n, popularity, seed=7 * m + n)
    if not 0 < decode < m:
        raise ValueError(f"a mixed step needs 0 < decode tokens < M, got {decode} of {m}")
    gen = torch.Generator().manual_seed(7 * m + n + decode)
    rows = torch.multinomial(popularity_weights(n, popularity), decode + 1, replacement=True,
                             generator=gen).to(torch.int32)
    return torch.cat([rows[:decode], rows[decode:].expand(m - decode)])


def floor_bytes(shape, m: int, n: int, popularity: str, one_rank: int | None = None,
                decode: int = 0, trained: float = 1.0) -> int:
    """Bytes a call must move at least: the routed experts' base weights, each distinct (adapter, expert)
    pair's LoRA rows once (``rank`` units) where the adapter trains the expert (``trained_experts``), x
    and the output. ``one_rank``: every token on one adapter of that rank instead of the N-adapter mix.
    Same routing and slots as the timed point."""
    _, ids = make_routing(m, shape, 100 + m, torch.device("cpu"))
    slots = step_slots(m, n, popularity, decode).long()
    elem, unit = 2, MoELoRAMemoryPool.unit_bytes_for(shape.H, shape.I, torch.bfloat16)
    experts = torch.unique(ids.long())
    base = experts.numel() * 3 * shape.H * shape.I * elem + 2 * m * shape.H * elem
    if one_rank is not None:
        own = set(trained_experts(ONE, shape.E, trained))
        return base + sum(e in own for e in experts.tolist()) * one_rank * unit
    pairs = torch.unique(slots[:, None] * shape.E + ids.long()).tolist()
    owns = {s: set(trained_experts(s, shape.E, trained)) for s in {p // shape.E for p in pairs}}
    ranks = [RANKS[p // shape.E % len(RANKS)] for p in pairs if p % shape.E in owns[p // shape.E]]
    return base + sum(ranks) * unit


def add_roofline(records: list[dict], hbm_tbps: float) -> None:
    """Each record's floor (µs at ``hbm_tbps``) for N adapters and for one rank-64 adapter, the best
    throughput ratio the bytes allow, and the fraction of it reached."""
    for r in records:
        shape = MODELS[r["model"]]
        decode, trained = r.get("decode", 0), r.get("trained", 1.0)
        many = floor_bytes(shape, r["M"], r["N"], r["popularity"], decode=decode, trained=trained)
        one = floor_bytes(shape, r["M"], r["N"], r["popularity"], one_rank=64, decode=decode, trained=trained)
        r["floor_us"] = many / hbm_tbps / 1e6
        r["one_adapter_floor_us"] = one / hbm_tbps / 1e6
        r["floor_throughput_vs_one"] = one / many
        r["of_floor_ratio"] = r["throughput_vs_one"] / r["floor_throughput_vs_one"]


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
                warmup_ms: float, rep_ms: float, mixed: list[tuple[int, int]] = (),
                ab: dict[str, str] | None = None, ab_path: str = "auto", trained: float = 1.0) -> list[dict]:
    """Every (M, N, popularity) point, then every mixed step (decode, prefill) of ``mixed`` at each N; with
    ``ab`` (launch overrides) the N-adapter batch also on a layer of path ``ab_path`` captured with them
    set. ``trained``: the fraction of the experts each adapter trains (``trained_experts``)."""
    shape = MODELS[name]
    dev, dtype = torch.device("cuda"), torch.bfloat16
    w13, w2 = make_weights(shape, dtype, dev, seed=0)
    max_n = max(ns)
    unit = MoELoRAMemoryPool.unit_bytes_for(shape.H, shape.I, dtype)
    owns = {k: trained_experts(k, shape.E, trained) for k in [*range(max_n), ONE]}
    need_units = (sum(len(owns[k]) * RANKS[k % len(RANKS)] for k in range(max_n))
                  + len(owns[ONE]) * max(RANKS) + shape.E * max(RANKS))
    pool = MoELoRAMemoryPool(num_experts=shape.E, hidden_size=shape.H, intermediate_size=shape.I,
                             layer_ids=[0], max_loras=max_n + 1, max_rank=max(RANKS), dtype=dtype,
                             device=dev, arena_bytes=need_units * unit)
    rng = torch.randn(max(RANKS) * (2 * shape.H + 2 * shape.I), dtype=dtype) * 0.02
    names = [f"a{k}" for k in range(max_n)]
    for k, n in enumerate(names):
        pool.add_adapter_weights(n, adapter(shape, RANKS[k % len(RANKS)], rng, owns[k]))
    pool.add_adapter_weights("one64", adapter(shape, 64, rng, owns[ONE]))
    layer = FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=0, path="auto", cuda_graphs=False)
    # Its own launch cache: the overrides are read when it first plans a token count, inside ``applied``.
    layer_b = (FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=0, path=ab_path, cuda_graphs=False) if ab
               else None)
    report = pool.memory_report()
    print(f"{name}: {max_n + 1} adapters resident, arena {report.arena_bytes / 1e9:.2f} GB, used "
          f"{report.used_bytes / 1e9:.2f} GB", flush=True)
    records = []
    for m, decode in [(m, 0) for m in ms] + [(d + p, d) for d, p in mixed]:
        weights, ids = make_routing(m, shape, 100 + m, dev)
        x = torch.randn(m, shape.H, device=dev, dtype=dtype)
        one = pool.prepare_batch(["one64"] * m)
        for n in ns:
            for pop in popularities:
                if n == 1 and pop != popularities[0]:
                    continue
                if decode and n == 1:
                    continue  # a mixed step of one adapter is the one-adapter point itself
                slots = step_slots(m, n, pop, decode).tolist()
                batch = pool.prepare_batch([names[s] for s in slots])
                calls = [lambda: layer(x, weights, ids, None),  # noqa: B023
                         lambda: layer(x, weights, ids, one),  # noqa: B023
                         lambda: layer(x, weights, ids, batch)]  # noqa: B023
                if ab:
                    def forced():
                        with overrides.applied(ab):
                            return layer_b(x, weights, ids, batch)  # noqa: B023

                    calls.append(forced)
                times, _ = graph_rounds_us(calls, warmup_ms, rep_ms, rounds=rounds)
                base, single, many = times[:3]
                mid = sorted(range(rounds), key=lambda r: many[r] / single[r])[rounds // 2]
                rec = {"model": name, "M": m, "decode": decode, "N": n, "popularity": pop,
                       "ranks": list(RANKS), "trained": trained,
                       "base_us": base[mid], "one_adapter_us": single[mid], "n_adapters_us": many[mid],
                       "throughput_vs_one": single[mid] / many[mid],
                       "ranks_in_batch": sorted({RANKS[s % len(RANKS)] for s in slots})}
                ab_note = ""
                if ab:
                    ratios = sorted(b / a for a, b in zip(many, times[3], strict=True))
                    rec |= {"ab": dict(ab), "ab_path": ab_path, "ab_us": times[3][mid],
                            "ab_over_rule": ratios[rounds // 2]}
                    ab_note = f", forced {times[3][mid]:.1f} ({rec['ab_over_rule']:.3f}x)"
                records.append(rec)
                print(f"  {step_label(rec)} N={n} {pop}: base {base[mid]:.1f} us, one r64 {single[mid]:.1f}, "
                      f"N {many[mid]:.1f} -> {rec['throughput_vs_one']:.3f}{ab_note}", flush=True)
                batch.release()
        one.release()
    pool.close()
    return records


def step_label(record: dict) -> str:
    """A point's M as the tables show it: ``M=1024``, or ``192 decode + 1856 prefill``."""
    decode = record.get("decode", 0)
    return f"{decode} decode + {record['M'] - decode} prefill" if decode else f"M={record['M']}"


def render(result: dict, out: Path) -> None:
    """``OUT.md`` (the tables) and ``OUT.png`` (throughput against N per model and M) of a result."""
    records, memory, device = result["records"], result["memory"], result["device"]
    lines = [f"# Many resident adapters, {device}, bf16, one MoE layer, ranks cycling {list(RANKS)}", "",
             "Throughput relative to one rank-64 adapter at the same M (median of interleaved rounds); "
             "the N = 1 row is one rank-8 adapter. Floor: the bytes the call must move (routed experts, each "
             "distinct (adapter, expert) pair's LoRA rows once) at the HBM peak; 'floor ratio' is the best "
             "throughput ratio those bytes allow, 'of floor' the share of it reached.", "",
             "| model | M | N | popularity | base µs | 1 adapter (r64) µs | N adapters µs | "
             "throughput vs 1 | floor ratio | of floor |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['model']} | {step_label(r).removeprefix('M=')} | {r['N']} | {r['popularity']} | "
                     f"{r['base_us']:.1f} | "
                     f"{r['one_adapter_us']:.1f} | {r['n_adapters_us']:.1f} | {r['throughput_vs_one']:.3f} | "
                     f"{r['floor_throughput_vs_one']:.3f} | {r['of_floor_ratio']:.2f} |")
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in records))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for step in dict.fromkeys(step_label(r) for r in records if r["model"] == model):
            for pop, style in (("uniform", "-"), ("zipf", "--")):
                here = [r for r in records if r["model"] == model and step_label(r) == step
                        and (r["popularity"] == pop or r["N"] == 1)]
                pts = sorted((r["N"], r["throughput_vs_one"], r["floor_throughput_vs_one"]) for r in here)
                if len(pts) < 2:
                    continue
                line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o",
                                label=f"{step} {pop}")
                ax.plot([p[0] for p in pts], [p[2] for p in pts], style, color=line.get_color(), alpha=0.3)
        ax.axhline(0.85, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("resident adapters in the batch (N)")
        ax.set_ylabel("throughput vs one rank-64 adapter")
        ax.set_title(f"{model} ({device}); faint: byte floor")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MOE_LAYERS), choices=list(MOE_LAYERS))
    parser.add_argument("--M", type=int, nargs="+", default=[64, 256, 1024, 2048, 4096])
    parser.add_argument("--mixed", nargs="*", default=["192+1856"], metavar="D+P",
                        help="mixed serving steps: D decode tokens and a P-token prefill chunk "
                             "(default 192+1856)")
    parser.add_argument("--N", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--popularity", nargs="+", default=["uniform", "zipf"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=25.0)
    parser.add_argument("--rep", type=float, default=100.0)
    parser.add_argument("--render", type=Path, default=None,
                        help="re-render OUT.md/.png (and the floors) from this JSON instead of measuring")
    parser.add_argument("--ab", nargs="+", default=[], metavar="NAME=VALUE",
                        help="launch overrides: also time each N-adapter batch with them set")
    parser.add_argument("--ab-path", choices=("auto", "split", "staged"), default="auto",
                        help="the --ab layer's LoRA path (default auto)")
    parser.add_argument("--trained", type=float, default=1.0, metavar="FRACTION",
                        help="the fraction of the experts each adapter trains (ESFT-style: 0.125; "
                             "default: all)")
    parser.add_argument("--out", required=True, help="output path without extension")
    args = parser.parse_args()
    if not 0 < args.trained <= 1:
        parser.error(f"--trained takes a fraction in (0, 1], got {args.trained}")
    if args.ab_path != "auto" and not args.ab:
        parser.error("--ab-path needs --ab NAME=VALUE (the overrides its layer runs with)")
    try:
        ab = overrides.parse(args.ab)
    except ValueError as err:
        parser.error(str(err))
    try:
        mixed = [tuple(int(v) for v in step.split("+")) for step in args.mixed]
    except ValueError:
        parser.error(f"--mixed takes D+P token counts (e.g. 192+1856), got {args.mixed}")
    if any(len(step) != 2 or min(step) < 1 for step in mixed):
        parser.error(f"--mixed takes D+P with D, P >= 1, got {args.mixed}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.render is not None:
        result = json.loads(args.render.read_text())
    else:
        memory = {name: adapters_per_gb(MODELS[name], MOE_LAYERS[name]) for name in args.models}
        records = []
        for name in args.models:
            records += bench_model(name, args.M, args.N, args.popularity, args.rounds, args.warmup, args.rep,
                                   mixed=mixed, ab=ab, ab_path=args.ab_path, trained=args.trained)
        result = {"device": torch.cuda.get_device_name(), "records": records, "memory": memory}
    add_roofline(result["records"], device_peaks(result["device"])["hbm_tbps"])
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    render(result, out)


if __name__ == "__main__":
    main()
