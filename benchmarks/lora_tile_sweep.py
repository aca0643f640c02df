"""Sweep the split LoRA layer's own tiles at a few points, each candidate timed interleaved with the base.

    python benchmarks/lora_tile_sweep.py --models qwen3-30b-a3b --M 16 64 --adapters 1 4

For each (model, M, adapters): the base layer (its tuned tiles) and the split LoRA layer with its current
tiles (``get_moe_config(..., lora=True)``) and with every candidate, all captured in CUDA graphs and timed
interleaved (``moelora.bench.cold_l2_times_ms``: one replay of each in turn, L2 emptied before each), so
clock drift falls on all of them alike. Printed: each one's overhead over the base. A GEMM1 candidate keeps
the current GEMM2 (with its BLOCK_M when theirs differ: one alignment feeds both), a GEMM2 candidate the
current GEMM1. Adapters, routing and inputs are those of ``moelora bench``.

``--write-dir DIR`` records each point's winner (the candidate with the lowest overhead at its worst over
``--adapters``, ahead of the current tiles' worst by ``--min-gain`` points or more) in DIR's copy of the
device's config file (copied from the tuned files the sweep read, ``MOELORA_MOE_CONFIG_DIR`` or
``triton_ops/configs/``, when DIR has none): under the entry the lookup uses for that M, as its
``"lora_by_rank"`` tiles at the swept rank tile, or with ``--as-lora`` as its ``"lora"`` tiles (every rank
tile without its own), or with ``--multi`` as its ``"lora_multi_by_rank"`` tiles at the swept rank tile (the
tiles of batches with two adapters or more: every ``--adapters`` count must then be at least 2, and the
current tiles are those such batches run). Then confirm them with ``benchmarks/ab_env.py --env
MOELORA_MOE_CONFIG_DIR=DIR`` (an interleaved A/B, which separates a real gain from one sweep's noise) and at
the other rank tile before copying a file into ``triton_ops/configs/``:

    python benchmarks/lora_tile_sweep.py --models deepseek-v2-lite --M 1024 4096 --write-dir /tmp/cand
    python benchmarks/ab_env.py --env MOELORA_MOE_CONFIG_DIR=/tmp/cand --models deepseek-v2-lite --M 1024 4096

``benchmarks/tune_moe.py --lora-rank`` searches the whole candidate space per point (compiles dominate);
this times a handful around the current tiles, cheap enough for several points in one device call. The
H100 ``"lora"`` entries of DeepSeek-V2-Lite (M=64, 256, 4096) and Qwen3-30B-A3B (M=16, 64) came from it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moelora.bench import (  # noqa: E402
    MODELS,
    LoRABuffers,
    cold_l2_times_ms,
    lora_inputs,
    make_lora_buffers,
    make_routing,
    make_weights,
    token_slots_for,
)
from moelora.bench_timing import _capture  # noqa: E402
from triton_ops.configs import (  # noqa: E402
    MULTI_ADAPTER_TILES_MIN_ADAPTERS,
    GemmConfig,
    MoEConfig,
    device_name,
    get_moe_config,
    nearest_tuned_m,
    tuned_config_path,
)
from triton_ops.fused_experts import fused_experts  # noqa: E402
from triton_ops.fused_moe import lora_rank_block  # noqa: E402

# (GEMM1 tiles, GEMM2 tiles) per regime, as (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages).
DECODE_SIZED = (  # M <= 128: 16-row blocks, few pairs per expert
    [(16, 64, 128, 4, 4), (16, 64, 256, 4, 3), (16, 32, 128, 4, 5), (16, 128, 128, 4, 3),
     (16, 32, 256, 4, 4), (16, 32, 256, 4, 5), (16, 64, 128, 4, 3)],
    [(16, 64, 128, 4, 4), (16, 64, 256, 4, 3), (16, 32, 128, 4, 5), (16, 128, 128, 4, 3),
     (16, 32, 256, 4, 4), (16, 64, 128, 4, 5)],
)
SMALL_PREFILL = (  # M <= 512: 32-row blocks
    [(32, 64, 128, 4, 3), (32, 64, 128, 4, 4), (32, 128, 64, 4, 4), (32, 128, 128, 8, 3),
     (32, 64, 64, 4, 4), (16, 64, 128, 4, 4), (64, 64, 64, 4, 3)],
    [(32, 128, 128, 4, 3), (32, 64, 128, 4, 4), (32, 128, 64, 4, 4), (32, 256, 64, 8, 3),
     (32, 128, 128, 8, 3)],
)
PREFILL = (  # 128-row blocks
    [(128, 64, 64, 8, 3), (128, 64, 64, 4, 3), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4),
     (128, 64, 128, 8, 3), (128, 64, 64, 8, 4)],
    [(128, 256, 64, 8, 4), (128, 128, 64, 8, 4), (128, 128, 64, 8, 3), (128, 128, 128, 8, 3),
     (128, 64, 64, 4, 4), (128, 256, 64, 8, 3)],
)


def _label(gemm: str, tile: GemmConfig) -> str:
    return f"{gemm} {tile.block_m}x{tile.block_n}x{tile.block_k} w{tile.num_warps} s{tile.num_stages}"


def parse_tile(text: str) -> tuple[int, int, int, int, int]:
    """``16x128x128w4s3`` as (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    match = re.fullmatch(r"(\d+)x(\d+)x(\d+)w(\d+)s(\d+)", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"a tile is BMxBNxBKwWsS (e.g. 16x128x128w4s3), got {text!r}")
    return tuple(int(group) for group in match.groups())  # type: ignore[return-value]


def candidate_configs(num_tokens: int, current: MoEConfig,
                      tiles: tuple[list, list] | None = None,
                      pairs: list[tuple[tuple, tuple]] = ()) -> dict[str, MoEConfig]:
    """The current tiles ("current") and every candidate that differs from them, by label. GEMM_SIZE_M
    stays the current one's; both GEMMs of a candidate share its BLOCK_M. ``tiles`` replaces the regime's
    (GEMM1, GEMM2) candidate lists; ``pairs`` adds candidates that change both GEMMs at once."""
    gemm1_tiles, gemm2_tiles = tiles or (DECODE_SIZED if num_tokens <= 128 else
                                         SMALL_PREFILL if num_tokens <= 512 else PREFILL)
    out = {"current": current}
    for (bm, bn, bk, warps, stages), (bm2, bn2, bk2, warps2, stages2) in pairs:
        if bm2 != bm:
            raise ValueError(f"a pair's GEMMs share BLOCK_M (one alignment feeds both): {bm} vs {bm2}")
        cfg = MoEConfig(GemmConfig(bm, bn, bk, current.gemm1.group_m, warps, stages),
                        GemmConfig(bm, bn2, bk2, current.gemm2.group_m, warps2, stages2))
        out[f"{_label('gemm1', cfg.gemm1)} + {_label('gemm2', cfg.gemm2)}"] = cfg
    for bm, bn, bk, warps, stages in gemm1_tiles:
        tile = GemmConfig(bm, bn, bk, current.gemm1.group_m, warps, stages)
        if tile != current.gemm1:
            out[_label("gemm1", tile)] = MoEConfig(tile, replace(current.gemm2, block_m=bm))
    for bm, bn, bk, warps, stages in gemm2_tiles:
        tile = GemmConfig(current.gemm2.block_m, bn, bk, current.gemm2.group_m, warps, stages)
        if bm == current.gemm2.block_m and tile != current.gemm2:
            out[_label("gemm2", tile)] = MoEConfig(current.gemm1, tile)
    return out


def pick_winner(overheads_by_adapters: dict[int, dict[str, float]], min_gain: float) -> str | None:
    """The label whose worst overhead over the adapter counts is lowest, when it beats the current tiles'
    worst by ``min_gain`` (a fraction: 0.01 is one point) or more; None otherwise. A candidate missing at
    some adapter count (it could not run there) is not one."""
    runs = list(overheads_by_adapters.values())
    labels = [label for label in runs[0] if all(label in run for run in runs)]
    worst = {label: max(run[label] for run in runs) for label in labels}
    best = min(worst, key=worst.get)
    if best == "current" or worst["current"] - worst[best] < min_gain:
        return None
    return best


def record_lora_tiles(path: Path, source: Path, num_tokens: int, tiles: MoEConfig, rank_block: int,
                      base: MoEConfig, *, multi: bool = False) -> tuple[str, MoEConfig]:
    """Writes ``tiles`` into the config file ``path`` (first copied from ``source`` when it is not there
    and ``source`` is) as the LoRA tiles of the entry the lookup takes for ``num_tokens``
    (``nearest_tuned_m``), under ``rank_block`` (0: as ``"lora"``; with ``multi`` in
    ``"lora_multi_by_rank"``); a file with no entries gets one at
    ``num_tokens`` with ``base`` as its base tiles. Returns the entry's key and the entry as written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file() and source.is_file():
        shutil.copyfile(source, path)
    entries = json.loads(path.read_text()) if path.is_file() else {}
    key = str(nearest_tuned_m(map(int, entries), num_tokens)) if entries else str(num_tokens)
    entry = (MoEConfig.from_dict(entries[key]) if key in entries else base).with_lora_tiles(tiles, rank_block,
                                                                                             multi=multi)
    entries[key] = entry.to_dict()
    path.write_text(json.dumps(dict(sorted(entries.items(), key=lambda kv: int(kv[0]))), indent=1) + "\n")
    return key, entry


def _capture_candidate(fn) -> torch.cuda.CUDAGraph | None:
    """``fn`` captured in a CUDA graph, or None when it cannot run here: the warm-up compiles the tile, and
    a tile that asks more shared memory than the device has raises there (not a candidate)."""
    try:
        return _capture(fn)
    except Exception as err:
        print(f"    skipped: {type(err).__name__}: {err}", file=sys.stderr)
        return None


def sweep_point(name: str, m: int, rank: int, adapters: int, seed: int, w13: torch.Tensor, w2: torch.Tensor,
                buffers: LoRABuffers, current: MoEConfig, tiles: tuple[list, list] | None = None,
                pairs: list[tuple[tuple, tuple]] = ()) -> dict[str, float]:
    """Overhead over the base layer of the ``current`` LoRA tiles and of each candidate around them, by
    label."""
    shape = MODELS[name]
    device, dtype = w13.device, w13.dtype
    weights, ids = make_routing(m, shape, m + seed, device)
    x = torch.randn(m, shape.H, generator=torch.Generator().manual_seed(7 * m + 1 + seed)).to(device, dtype)
    slots = token_slots_for(m, adapters, "uniform", 13 * m + adapters + seed)
    lora = lora_inputs(buffers, slots, 8, adapters, rank, device)
    base = _capture(lambda: fused_experts(x, w13, w2, weights, ids))
    if base is None:
        raise RuntimeError(f"{name} M={m}: the base layer could not be captured")
    labels, graphs = [], []
    for label, cfg in candidate_configs(m, current, tiles, pairs).items():
        graph = _capture_candidate(lambda cfg=cfg: fused_experts(x, w13, w2, weights, ids, lora=lora,
                                                                 lora_path="split", config=cfg))
        if graph is not None:
            labels.append(label)
            graphs.append(graph)
    times = cold_l2_times_ms([base.replay] + [g.replay for g in graphs], 25, 120)
    return {label: t / times[0] - 1 for label, t in zip(labels, times[1:], strict=True)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen3-30b-a3b"], choices=list(MODELS))
    parser.add_argument("--M", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gemm1", nargs="+", type=parse_tile, metavar="TILE",
                        help="GEMM1 candidates in place of the regime's, e.g. 16x128x128w4s3")
    parser.add_argument("--gemm2", nargs="+", type=parse_tile, metavar="TILE",
                        help="GEMM2 candidates in place of the regime's (BLOCK_M the current one's)")
    parser.add_argument("--pair", nargs=2, action="append", type=parse_tile, default=[], metavar="TILE",
                        help="a GEMM1 and a GEMM2 tile tried together (repeatable)")
    parser.add_argument("--write-dir", type=Path, metavar="DIR",
                        help="record each point's winner in DIR's copy of the config file (see above)")
    parser.add_argument("--min-gain", type=float, default=1.0,
                        help="points of overhead a winner must gain at its worst adapter count (default 1)")
    parser.add_argument("--as-lora", action="store_true",
                        help="with --write-dir: record winners as \"lora\" instead of under the rank tile")
    parser.add_argument("--multi", action="store_true",
                        help="sweep and record the tiles of batches with several adapters "
                             "(\"lora_multi_by_rank\"; every --adapters count >= 2)")
    args = parser.parse_args(argv)
    tiles = None
    if args.gemm1 or args.gemm2:
        tiles = (args.gemm1 or [], args.gemm2 or [])
    if min(args.M + args.adapters + [args.rank]) < 1:
        raise SystemExit("--M, --adapters and --rank must be >= 1")
    if args.multi and min(args.adapters) < MULTI_ADAPTER_TILES_MIN_ADAPTERS:
        raise SystemExit(f"--multi sweeps the tiles of batches with several adapters: --adapters must all be "
                         f">= {MULTI_ADAPTER_TILES_MIN_ADAPTERS}, got {args.adapters}")
    if args.multi and args.as_lora:
        raise SystemExit("--multi records under the swept rank tile: it does not go with --as-lora")
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("needs a CUDA GPU with compiled Triton (TRITON_INTERPRET unset)")
    pairs = [tuple(pair) for pair in args.pair]
    rank_block = lora_rank_block(args.rank)
    # The adapter count whose tiles the sweep starts from (and writes, with --write-dir).
    tiles_adapters = MULTI_ADAPTER_TILES_MIN_ADAPTERS if args.multi else 1
    for name in args.models:
        shape, device = MODELS[name], torch.device("cuda")
        w13, w2 = make_weights(shape, torch.bfloat16, device, args.seed)
        buffers = make_lora_buffers(shape, args.rank, 8, torch.bfloat16, device, 16)
        for m in args.M:
            current = get_moe_config(m, shape.E, shape.H, shape.I, shape.top_k, torch.bfloat16, device,
                                     lora=True, rank_block=rank_block, num_adapters=tiles_adapters)
            by_adapters = {}
            for adapters in args.adapters:
                overheads = by_adapters[adapters] = sweep_point(name, m, args.rank, adapters, args.seed, w13,
                                                                w2, buffers, current, tiles, pairs)
                best = min(overheads, key=overheads.get)
                print(f"{name} M={m} rank {args.rank} x{adapters}: best {best} "
                      f"({100 * overheads[best]:+.1f} %)", flush=True)
                for label, overhead in overheads.items():
                    print(f"    {label:32s} {100 * overhead:+6.1f} %", flush=True)
            if args.write_dir is None:
                continue
            winner = pick_winner(by_adapters, args.min_gain / 100)
            if winner is None:
                print(f"{name} M={m}: nothing beats the current tiles by {args.min_gain} points", flush=True)
                continue
            source = tuned_config_path(shape.E, shape.I, device_name(device), torch.bfloat16)
            chosen = candidate_configs(m, current, tiles, pairs)[winner]
            out = args.write_dir / source.name
            key, written = record_lora_tiles(
                out, source, m, chosen, 0 if args.as_lora else rank_block,
                get_moe_config(m, shape.E, shape.H, shape.I, shape.top_k, torch.bfloat16, device),
                multi=args.multi)
            print(f"{name} M={m}: wrote {winner} into {out} (entry {key})", flush=True)
            # Only a "lora" entry can be outranked: the rank tile's own tiles come first.
            if args.as_lora and written.for_lora(rank_block, tiles_adapters) != chosen:
                print(f"    note: the entry's own tiles for rank tile {rank_block} still take precedence "
                      "there over its \"lora\" tiles", flush=True)
        del w13, w2, buffers
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
