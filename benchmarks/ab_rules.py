"""Interleaved A/B of every launch rule of the library, in one process: for each launch override
(``triton_ops.overrides.CHOICES``) the layer as the rules launch it against the layer with the override
forcing the rule's other answer, on the cells where the rule was decided. For deciding which rules to delete.

    python benchmarks/ab_rules.py --out benchmarks/results/ab_rules_NVIDIA_H200
    python benchmarks/ab_rules.py --rules lora_prefetch one_row_lora --rounds 3

:data:`RULES` holds, per override, the forced value (the rule's other answer; for a count, the value that
reverts the rule to its simpler form), the layer timed (``ab_env.py --layer``: ``lora``, ``base`` or
``staged``), the
experts (bf16, block-scaled FP8, or one rank of two expert-parallel ranks) and at most four cells (model, M,
rank, adapters), taken from the rule's docstring and its row in docs/performance.md ('Levers'). Each cell
is one ``ab_env.ab_point``: the base layer, the layer as the rules launch it (A) and the layer with the
override set while it is captured (B), each in a CUDA graph, timed in ``--rounds`` interleaved rounds.
t(forced)/t(rule) is ab_env's median over rounds of t(B)/t(A), with the rounds' range. FP8 and
expert-parallel rules run the same ``ab_point`` with its ``fused_experts`` bound to FP8 weights (quantized
per 128 x 128 block as ``bench_fp8.py`` does) or to one rank's routing (``sparse_routing``, the other rank's
experts as id -1, ``MoEShard``).

Verdict per rule: "keep" when forcing it loses at least 2 % (t(forced)/t(rule) >= ``KEEP_AT``, 1.02) on at
least one of its cells, the 2 % a kernel switch must earn (docs/performance.md, 'Levers'); else "delete
candidate"; "incomplete" when a cell failed and none reached 1.02. Where the rule gives the same answer as
the forced value on a cell (another device, a tile that changed) B is A and the ratio reads 1.0: the
verdict says what the cells measured, not why. Written: a markdown table on stdout and, with ``--out PATH``,
PATH.md and PATH.json (verdicts, every cell's ab_env record).

Cost: a cell times base, A and B in each round, each timing about ``--warmup`` + ``--rep`` ms of calls
(``cold_l2_time_ms``, 50 ms at the defaults): at 5 rounds about 0.75 s of timed loops a cell, under a
minute for the whole table. With weight set-up, graph captures and the Triton compiles of each variant's
first launch the whole run took under four minutes on an H200 at ``--rounds 3 --rep 30``.

``--dry-run`` checks the table (every override in ``CHOICES`` has an entry and no other, every forced value
is one ``overrides.parse`` accepts, every model is in ``moelora.bench.MODELS``), prints the plan and runs
the first cell of each rule once on ab_env's dry-run shape on the CPU (set TRITON_INTERPRET=1; the numbers
mean nothing). The table is checked before every run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ab_env  # noqa: E402
from bench_fp8 import BLOCK as FP8_BLOCK  # noqa: E402

from moelora.bench import DRY_RUN_MODEL, MODELS, ModelShape, make_weights  # noqa: E402
from moelora.parallel import MoEShard  # noqa: E402
from moelora.torch_path import quantize_fp8_blocks  # noqa: E402
from triton_ops import overrides  # noqa: E402
from triton_ops.fp8 import BlockFp8Weights  # noqa: E402

# A rule stays if forcing it the other way is this much slower on at least one of its cells.
KEEP_AT = 1.02

# Expert-parallel ranks of the "ep2" rules: this process times rank 0's half of the experts.
EP_SIZE = 2

# ab_env's dry run: token counts past this run as 8 tokens.
DRY_RUN_MAX_M = 80

Cell = tuple[str, int, int, int]  # (model, M, rank, adapters)
Layer = Literal["lora", "base", "staged"]
Experts = Literal["bf16", "fp8", "ep2"]
EXPERTS: tuple[str, ...] = ("bf16", "fp8", "ep2")


@dataclass(frozen=True)
class RuleCells:
    """One launch override's A/B: ``forced`` (its value for B), ``layer`` (``ab_env.py --layer``), ``rule``
    (the function that reads the override), ``cells`` (model, M, rank, adapters) and ``experts``: "bf16",
    "fp8" (block-scaled FP8 base weights) or "ep2" (rank 0 of two expert-parallel ranks)."""

    forced: str
    layer: Layer
    rule: str
    cells: tuple[Cell, ...]
    experts: Experts = "bf16"


V2L, V2, V3 = "deepseek-v2-lite", "deepseek-v2", "deepseek-v3"
QWEN, MIXTRAL = "qwen3-30b-a3b", "mixtral-8x7b"

# One token draws one adapter (ab_env's token_slots_for), so the M=1 cells take 1: more would time the same.
# Base-layer cells take rank 16, 1 adapter: the base layer reads no adapter.
RULES: dict[str, RuleCells] = {
    # cells: performance.md lever "two-launch decode" (base M=1, ab_env.py --layer base)
    "decode_direct": RuleCells("0", "base", "plan.decode_direct_pairs", (
        (V2L, 1, 16, 1), (QWEN, 1, 16, 1), (V2, 1, 16, 1), (V3, 1, 16, 1))),
    # cells: performance.md levers "one token's down shrink as a GEMV launch" (lost below 64 partials: Qwen3
    # rank 64) and "decode shrink in the alignment's launch" (DeepSeek-V2-Lite, 44 partials: rank 32 on the
    # H200's tiles); V2 and V3 rank 16 (24 and 32 partials there): the rule's scope, no measurement cited.
    # count 16: MAX_DOWN_PARTIALS, the bound at every other batch size: no wider bound at <= 32 pairs
    "decode_down_partials": RuleCells("16", "lora", "plan.decode_down_partials_limit", (
        (QWEN, 1, 64, 1), (V2L, 1, 32, 1), (V2, 1, 16, 1), (V3, 1, 16, 1))),
    # cells: performance.md lever "down shrink's first A tile before GEMM1's K-loop" (H200, M=1)
    "down_prefetch": RuleCells("0", "lora", "plan.plan_lora_epilogue (down_prefetch)", (
        (QWEN, 1, 16, 1), (QWEN, 1, 64, 1), (V2L, 1, 16, 1))),
    # cells: performance.md lever "unmasked K-loop where BLOCK_K divides K" (H200, base layer, M=1024)
    "even_k": RuleCells("0", "base", "fused_moe.invoke_fused_moe_kernel (EVEN_K)", (
        (MIXTRAL, 1024, 16, 1), (QWEN, 1024, 16, 1))),
    # cells: performance.md "Where the time goes" (staged path, (expert, adapter) blocks); not yet timed, so
    # the rule is off and "1" forces it on
    "expand_whole_rows": RuleCells("1", "staged", "plan.expand_whole_rows", (
        (QWEN, 256, 16, 32), (QWEN, 1024, 16, 32), (V2L, 1024, 16, 32))),
    # cells: performance.md lever "FP8 decode: dependent-launch chain" (FP8 base, M=1)
    "fp8_dependent_decode": RuleCells("0", "base", "pdl.dependent_fp8_decode", (
        (QWEN, 1, 16, 1), (V3, 1, 16, 1)), experts="fp8"),
    # cells: performance.md lever "FP8 with adapters: the bf16 file's LoRA tiles" (kept for one token, M=1)
    "fp8_lora_tiles": RuleCells("fp8", "lora", "plan.fp8_lora_takes_bf16_tiles", (
        (QWEN, 1, 16, 1), (V3, 1, 16, 1)), experts="fp8"),
    # cells: performance.md lever "FP8: one weight scale per tile and step" (FP8 base, M=1024 and 4096)
    "fp8_tile_scale": RuleCells("0", "base", "plan.tile_b_scale", (
        (QWEN, 1024, 16, 1), (QWEN, 4096, 16, 1), (V3, 1024, 16, 1), (V3, 4096, 16, 1)), experts="fp8"),
    # cells: performance.md lever "two-launch decode", its current A/B of the fused sum (--layer base, M=1)
    "fused_sum": RuleCells("0", "base", "plan.fused_topk_sum", (
        (QWEN, 1, 16, 1), (V2L, 1, 16, 1), (V3, 1, 16, 1), (MIXTRAL, 1, 16, 1))),
    # cells: performance.md "Pairs grouped by adapter, timed" (split path, 16 and 32 adapters; the rule
    # groups from nine on)
    "lora_by_adapter": RuleCells("0", "lora", "plan.lora_by_adapter", (
        (QWEN, 256, 16, 32), (QWEN, 1024, 16, 32), (V2L, 1024, 16, 32), (QWEN, 1024, 16, 16))),
    # cells: performance.md lever "32-column rank chunks at rank tile 64" (rank 64, 4 adapters)
    "lora_chunk_r": RuleCells("16", "lora", "plan.lora_rank_chunk", (
        (QWEN, 1024, 64, 4), (QWEN, 4096, 64, 4), (MIXTRAL, 1024, 64, 4), (V2L, 4096, 64, 4))),
    # cells: performance.md lever "deferred prologue" (H200: DeepSeek-V2-Lite M=16 lost 4-6 % without it)
    "lora_defer": RuleCells("0", "lora", "plan.defer_lora_prologue", (
        (V2L, 16, 16, 4), (V2L, 16, 16, 1), (QWEN, 16, 16, 4), (V2L, 64, 16, 4))),
    # cells: performance.md lever "slot-range expand from a packed shrink" (GEMM2, M=1024, 4 adapters; not
    # DeepSeek-V2-Lite rank 64, whose GEMM2 tile on the H200 holds one block an SM: no expand there)
    "lora_ext": RuleCells("0", "lora", "plan.lora_ext_expand", (
        (V2L, 1024, 16, 4), (V2, 1024, 64, 4), (V2, 1024, 16, 4))),
    # cells: chosen from the rule's scope, no measurement cited (lora_ext's rank-16 cells: rank tile 32 and
    # up take one slot anyway). count 1: one slot a dot, the expand without stacked slots
    "lora_ext_slots": RuleCells("1", "lora", "plan.lora_ext_cols", (
        (V2L, 1024, 16, 4), (V2L, 1024, 16, 2), (V2, 1024, 16, 4))),
    # cells: lora_ext's (the stages pipeline its loop over slots; a long loop needs dozens of adapters a
    # block, which bench_many_adapters.py --ab lora_ext_stages=2 times)
    "lora_ext_stages": RuleCells("2", "lora", "plan.lora_ext_stages", (
        (V2L, 1024, 16, 4), (V2, 1024, 64, 4))),
    # cells: performance.md lever "epilogue prefetch" (its small-tile measurement: decode and 32-row tiles);
    # the 16-row tiles' bound ("no prefetch on 16-row tiles with >= 4 adapters") is forced by "1", not here
    "lora_prefetch": RuleCells("0", "lora", "plan.lora_prefetch_pays", (
        (QWEN, 16, 16, 4), (MIXTRAL, 64, 16, 1), (V2L, 16, 16, 1))),
    # cells: performance.md lever "split-K partials summed once" (M=64 with 1 adapter: from 4 adapters the
    # slot-program shrink leaves no splits to sum)
    "lora_reduce_splits": RuleCells("0", "lora", "shrink_reduce.reduce_splits_pays", (
        (MIXTRAL, 256, 64, 4), (MIXTRAL, 1024, 16, 4), (V2L, 64, 16, 1), (QWEN, 64, 16, 1))),
    # cells: chosen from the rule's scope, no measurement cited (fused_experts' module docstring: chunks of
    # 32768 tokens bound the intermediate buffers: a memory rule, which a speed A/B does not decide).
    # count 1048576: one chunk for every cell here, i.e. no chunking
    "moe_chunk_tokens": RuleCells("1048576", "lora", "fused_experts._chunk_tokens", (
        (QWEN, 65536, 16, 4), (V2L, 65536, 16, 4))),
    # cells: performance.md lever "one-row LoRA prologue" (M=1, its current A/B one_row_lora=0)
    "one_row_lora": RuleCells("0", "lora", "plan.one_row_lora", (
        (QWEN, 1, 16, 1), (V2L, 1, 16, 1))),
    # cells: performance.md lever "one pass over K per shrink program" (1-2 adapters: from 4 the forced
    # split would give the shrink to slot_program_shrink instead)
    "one_split_shrink": RuleCells("0", "lora", "plan.one_split_shrink", (
        (V2L, 1024, 16, 1), (V2L, 1024, 64, 1), (V2L, 1024, 64, 2), (V2L, 256, 16, 1))),
    # cells: performance.md lever "one token's shrink fits idle SMs" (Qwen3-30B-A3B M=1, rank 16 and 64)
    "one_token_shrink_fit": RuleCells("0", "lora", "plan.one_token_shrink_splits", (
        (QWEN, 1, 16, 1), (QWEN, 1, 64, 1))),
    # cells: performance.md lever "GEMMs overlap prefill shrinks"
    "prefill_shrink_overlap": RuleCells("0", "lora", "pdl.prefill_shrink_overlap", (
        (QWEN, 1024, 16, 4), (QWEN, 1024, 64, 4), (V2L, 1024, 64, 4), (V2, 4096, 16, 4))),
    # cells: performance.md lever "GEMM1 overlaps the decode shrink" (M=1, 1 adapter)
    "shrink_overlap": RuleCells("0", "lora", "pdl.decode_shrink_overlap", (
        (QWEN, 1, 16, 1), (V2, 1, 16, 1), (V3, 1, 16, 1))),
    # cells: performance.md lever "a shrink program per slot" (M=64 over split K; M=256 over the one pass)
    "slot_program_shrink": RuleCells("0", "lora", "plan.slot_program_shrink", (
        (V2L, 64, 16, 8), (QWEN, 64, 16, 8), (V2L, 64, 64, 4), (V2L, 256, 16, 5))),
    # cells: performance.md "FP8 base experts", the swapped K-loop (16-row decode-batch blocks, FP8 base)
    "swap_ab": RuleCells("0", "base", "plan.swap_ab", (
        (V2L, 16, 16, 1), (QWEN, 64, 16, 1), (MIXTRAL, 16, 16, 1)), experts="fp8"),
    # cells: performance.md lever "expert-parallel decode aligns" (DeepSeek-V3); V2, Mixtral: rule's scope
    "sparse_align": RuleCells("0", "base", "plan.sparse_routing_aligns", (
        (V3, 1, 16, 1), (V2, 1, 16, 1), (MIXTRAL, 1, 16, 1)), experts="ep2"),
}


def check_rules(rules: dict[str, RuleCells]) -> None:
    """Raises ValueError unless ``rules`` has one entry per launch override, each forced value is one
    ``overrides.parse`` accepts, and each entry has 1-4 cells of known models with positive sizes."""
    missing = sorted(set(overrides.CHOICES) - set(rules))
    unknown = sorted(set(rules) - set(overrides.CHOICES))
    if missing or unknown:
        raise ValueError(f"one entry per launch override: missing {missing}, unknown {unknown}")
    for name, entry in rules.items():
        overrides.parse([f"{name}={entry.forced}"])
        if entry.layer not in ("lora", "base", "staged") or entry.experts not in EXPERTS:
            raise ValueError(f"{name}: layer must be lora, base or staged and experts one of {EXPERTS}")
        if not 1 <= len(entry.cells) <= 4:
            raise ValueError(f"{name}: 1 to 4 cells, got {len(entry.cells)}")
        for model, m, rank, adapters in entry.cells:
            if model not in MODELS:
                raise ValueError(f"{name}: unknown model {model!r}; known: {', '.join(MODELS)}")
            if min(m, rank, adapters) < 1:
                raise ValueError(f"{name}: M, rank and adapters must be >= 1, got {model, m, rank, adapters}")
            if entry.experts == "ep2" and MODELS[model].E % EP_SIZE:
                raise ValueError(f"{name}: {model}'s {MODELS[model].E} experts do not split into {EP_SIZE}")


@contextlib.contextmanager
def _bound(**attrs: Any) -> Iterator[None]:
    """ab_env's module globals ``attrs`` replaced inside the block (``ab_point`` looks them up as it runs)."""
    saved = {name: getattr(ab_env, name) for name in attrs}
    for name, value in attrs.items():
        setattr(ab_env, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(ab_env, name, value)


@contextlib.contextmanager
def experts_for(experts: Experts, shape: ModelShape, dtype: torch.dtype, device: torch.device,
                seed: int) -> Iterator[tuple[ModelShape, tuple[torch.Tensor, torch.Tensor]]]:
    """The shape and weights ``ab_env.ab_point`` takes for ``experts``, with its ``fused_experts`` (and
    routing) bound to them inside the block: bf16 (the run's dtype) as ab_env; FP8 weights quantized per
    ``FP8_BLOCK`` block; rank 0 of ``EP_SIZE`` expert-parallel ranks (its experts, the model's routing
    with the other ranks' experts as -1, ``sparse_routing``)."""
    if experts == "bf16":
        yield shape, make_weights(shape, dtype, device, seed)
    elif experts == "fp8":
        w13, w2 = make_weights(shape, dtype, device, seed)
        w13_q, w13_scale = quantize_fp8_blocks(w13, FP8_BLOCK)
        w2_q, w2_scale = quantize_fp8_blocks(w2, FP8_BLOCK)
        del w13, w2
        fp8 = BlockFp8Weights(w13_scale, w2_scale, FP8_BLOCK)
        with _bound(fused_experts=functools.partial(ab_env.fused_experts, fp8=fp8)):
            yield shape, (w13_q, w2_q)
    else:
        shard = MoEShard(shape.E, shape.I, ep_rank=0, ep_size=EP_SIZE)
        local = dataclasses.replace(shape, E=shard.local_num_experts)
        expert_map = shard.expert_map(device)
        model_routing = ab_env.make_routing

        def rank_routing(m: int, _local: ModelShape, seed: int,
                         device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
            weights, ids = model_routing(m, shape, seed, device)
            return weights, expert_map[ids.long()].contiguous()

        with _bound(fused_experts=functools.partial(ab_env.fused_experts, sparse_routing=True),
                    make_routing=rank_routing):
            yield local, make_weights(local, dtype, device, seed)


Run = tuple[str, Cell, Cell]  # (rule, its cell in RULES, the cell timed)


def plan_runs(names: list[str], dry_run: bool) -> list[tuple[Experts, ModelShape, list[Run]]]:
    """The cells to time, grouped by experts and model so that each group's weights are made once: every
    cell of ``names`` on the GPU; in a dry run the first cell of each rule, on ab_env's dry-run shape
    (M past ``DRY_RUN_MAX_M`` as 8 tokens)."""
    groups: dict[tuple[Experts, str], list[Run]] = {}
    for name in names:
        entry = RULES[name]
        for cell in entry.cells[:1] if dry_run else entry.cells:
            model, m, rank, adapters = cell
            if dry_run:
                model, m = DRY_RUN_MODEL.name, m if m <= DRY_RUN_MAX_M else 8
            groups.setdefault((entry.experts, model), []).append((name, cell, (model, m, rank, adapters)))
    return [(experts, DRY_RUN_MODEL if dry_run else MODELS[model], runs)
            for (experts, model), runs in groups.items()]


def run_cells(names: list[str], *, dry_run: bool, rounds: int, warmup_ms: float, rep_ms: float,
              seed: int) -> list[dict[str, Any]]:
    """ab_env's record of each planned cell, with the rule, its forced value and its cell in RULES; a cell
    that raised is recorded with ``error`` (and the run goes on)."""
    if dry_run:
        device, dtype = torch.device("cpu"), torch.float16
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
    groups = plan_runs(names, dry_run)
    total, done = sum(len(runs) for _, _, runs in groups), 0
    records: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for experts, shape, runs in groups:
        with experts_for(experts, shape, dtype, device, seed) as (point_shape, weights):
            for name, cell, (_, m, rank, adapters) in runs:
                entry, done = RULES[name], done + 1
                label = (f"[{done}/{total}] {name}={entry.forced} ({entry.layer}, {experts}) {shape.name} "
                         f"M={m} r={rank} x{adapters}")
                info = dict(rule=name, forced=entry.forced, experts=experts, cell=list(cell))
                try:
                    record = ab_env.ab_point(point_shape, m, rank, adapters, {name: entry.forced},
                                             rounds=rounds, device=device, dtype=dtype, weights=weights,
                                             seed=seed, warmup_ms=warmup_ms, rep_ms=rep_ms,
                                             base_layer=entry.layer == "base",
                                             lora_path="staged" if entry.layer == "staged" else "split")
                except Exception as err:  # a failing cell (out of memory, a launch error) leaves the others
                    error = f"{type(err).__name__}: {err}"
                    records.append(info | dict(model=shape.name, M=m, rank=rank, n_adapters=adapters,
                                               layer=entry.layer, error=error))
                    print(f"{label}: {error}", file=sys.stderr, flush=True)
                    continue
                records.append(info | record)
                print(f"{label}: t(forced)/t(rule) {record['b_over_a']:.3f} [{record['b_over_a_min']:.3f}, "
                      f"{record['b_over_a_max']:.3f}] ({time.perf_counter() - t0:.0f} s)", file=sys.stderr,
                      flush=True)
            del weights
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return records


def verdicts(names: list[str], records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per rule: its entry, its cells' t(forced)/t(rule) and the verdict (module docstring)."""
    out = {}
    for name in names:
        mine = [r for r in records if r["rule"] == name]
        ratios = [r["b_over_a"] for r in mine if "error" not in r]
        worst = max(ratios, default=None)
        if worst is not None and worst >= KEEP_AT:
            verdict = "keep"
        elif not ratios or len(ratios) < len(mine):
            verdict = "incomplete"
        else:
            verdict = "delete candidate"
        entry = RULES[name]
        out[name] = dict(forced=entry.forced, layer=entry.layer, experts=entry.experts, rule=entry.rule,
                         cells=[list(c) for c in entry.cells], max_ratio=worst, verdict=verdict,
                         errors=sum("error" in r for r in mine))
    return out


def markdown(summary: dict[str, dict[str, Any]], records: list[dict[str, Any]], header: str) -> str:
    lines = [header, "",
             "| override | forced | rule | layer | experts | max t(forced)/t(rule) | verdict |",
             "|---|---|---|---|---|---:|---|"]
    for name, s in summary.items():
        worst = "-" if s["max_ratio"] is None else f"{s['max_ratio']:.3f}"
        lines.append(f"| {name} | {s['forced']} | `{s['rule']}` | {s['layer']} | {s['experts']} | {worst} | "
                     f"{s['verdict']} |")
    lines += ["", "| override | forced | model | M | rank | adapters | t(rule) µs | t(forced) µs "
              "| t(forced)/t(rule) median [range] |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        head = f"| {r['rule']} | {r['forced']} | {r['model']} | {r['M']} | {r['rank']} | {r['n_adapters']} |"
        if "error" in r:
            lines.append(f"{head} - | - | error: {r['error'].splitlines()[0][:80]} |")
        else:
            lines.append(f"{head} {r['a_us']:.1f} | {r['b_us']:.1f} | {r['b_over_a']:.3f} "
                         f"[{r['b_over_a_min']:.3f}, {r['b_over_a_max']:.3f}] |")
    return "\n".join(lines) + "\n"


def print_plan(names: list[str], dry_run: bool) -> None:
    """The rules to A/B and their cells, on stderr."""
    cells = sum(len(runs) for _, _, runs in plan_runs(names, dry_run))
    print(f"plan: {len(names)} rules, {cells} cells" + (" (dry run: each rule's first cell on "
          f"{DRY_RUN_MODEL.name})" if dry_run else ""), file=sys.stderr)
    for name in names:
        e = RULES[name]
        cells = ", ".join(f"{model} M={m} r{rank} x{n}" for model, m, rank, n in e.cells)
        print(f"  {name}={e.forced} ({e.layer}, {e.experts}; {e.rule}): {cells}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rules", nargs="+", choices=list(RULES), metavar="NAME",
                        help="launch overrides to A/B (default: all)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per cell")
    parser.add_argument("--warmup", type=float, default=10.0, help="warm-up per timing, ms")
    parser.add_argument("--rep", type=float, default=40.0, help="measured time per timing, ms")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, metavar="PATH", help="write PATH.json and PATH.md")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the table, then each rule's first cell once on a tiny shape on the CPU "
                             "(TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    try:
        check_rules(RULES)
    except ValueError as err:
        raise SystemExit(f"RULES: {err}") from None
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    names = list(dict.fromkeys(args.rules or RULES))
    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--dry-run runs on CPU through the interpreter: set TRITON_INTERPRET=1")
        rounds, device_name = 1, "cpu (dry run)"
    else:
        if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
            raise SystemExit("needs a CUDA GPU with compiled Triton (TRITON_INTERPRET unset); see --dry-run")
        rounds, device_name = args.rounds, torch.cuda.get_device_name()
    print_plan(names, args.dry_run)
    records = run_cells(names, dry_run=args.dry_run, rounds=rounds, warmup_ms=args.warmup, rep_ms=args.rep,
                        seed=args.seed)
    order = {(name, tuple(cell)): i for i, (name, cell) in enumerate(
        (name, cell) for name in names for cell in RULES[name].cells)}
    records.sort(key=lambda r: order[r["rule"], tuple(r["cell"])])
    summary = verdicts(names, records)
    header = (f"Launch rules A/B on {device_name}, torch {torch.__version__}: t(forced)/t(rule), median over "
              f"{rounds} interleaved rounds [range]; keep at >= {KEEP_AT} on a cell"
              + ("; dry run: the numbers and verdicts mean nothing" if args.dry_run else ""))
    table = markdown(summary, records, header)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = dict(device=device_name, torch=torch.__version__, rounds=rounds, keep_at=KEEP_AT,
                       dry_run=args.dry_run, rules=summary, records=records)
        Path(f"{args.out}.json").write_text(json.dumps(payload, indent=1) + "\n")
        Path(f"{args.out}.md").write_text(table)
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    raise SystemExit(main())
