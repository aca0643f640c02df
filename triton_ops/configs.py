"""Launch configurations for the fused MoE GEMMs: tuned JSON first, then a heuristic.

Lookup order for ``get_moe_config``:
  1. ``MOELORA_MOE_CONFIG``: a JSON object (or a path to a JSON file holding one) that forces the config,
     e.g. ``{"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1}``.
  2. Tuned files ``configs/E={E},N={I},device_name={device},dtype={dtype}.json`` beside this module (or in
     ``MOELORA_MOE_CONFIG_DIR``), keyed by M; the entry for the nearest M is used.
     ``MOELORA_MOE_CONFIG=heuristic`` skips them (to compare against the heuristic, or while tuning).
  3. The heuristic of ``default_moe_config`` (seed 000 §3, adjusted for the fused activation).

A config entry holds BLOCK_SIZE_M/N/K, GROUP_SIZE_M, num_warps, num_stages and may carry a ``"gemm2"``
object overriding N/K/GROUP/warps/stages for the down projection (BLOCK_SIZE_M is shared, because the
token alignment is computed once for both GEMMs). It may also carry a ``"lora"`` object, a whole entry of
its own, for the layer with adapters on the split path (``get_moe_config(..., lora=True)``): a tile tuned
for the base GEMMs alone need not be the best once every tile also expands adapter deltas
(``benchmarks/tune_moe.py --lora-rank``). A ``"lora_by_rank"`` object maps a rank tile (16, 32, 64, ...: the
pool's max rank rounded up to a power of two, at least 16) to an entry that replaces ``"lora"`` at that rank
tile (``benchmarks/lora_tile_sweep.py`` finds them): the best tile at rank 16 need not be the best at 64.
A ``"lora_multi_by_rank"`` object, keyed the same way, holds the tiles of batches with two adapters or more
(the caller's host-known ``num_adapters``), ahead of ``"lora_by_rank"`` there: a prefill sequence is one
adapter's and an expert's rows stay in token order, so smaller blocks hold fewer adapters, and each adapter
in a block costs its epilogues an expand, while one adapter may run best on the larger tile.
For GEMM1 BLOCK_SIZE_N counts columns of the activated output: the program reads gate and up tiles of that
width each.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

_CONFIG_DIR = Path(__file__).parent / "configs"
_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
# An entry's LoRA tiles: ``lora`` (any rank tile), per rank tile, per rank tile for several adapters.
_LORA_KEYS = ("lora", "lora_by_rank", "lora_multi_by_rank")
# From this many distinct adapters in a batch, ``lora_multi_by_rank`` tiles apply.
MULTI_ADAPTER_TILES_MIN_ADAPTERS = 2


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3

    @classmethod
    def from_dict(cls, raw: dict, base: GemmConfig | None = None) -> GemmConfig:
        unknown = set(raw) - set(_KEYS) - {"gemm2", *_LORA_KEYS}
        if unknown:
            raise ValueError(f"unknown MoE config keys {sorted(unknown)}; expected a subset of {_KEYS}")
        fields = {
            "block_m": raw.get("BLOCK_SIZE_M"),
            "block_n": raw.get("BLOCK_SIZE_N"),
            "block_k": raw.get("BLOCK_SIZE_K"),
            "group_m": raw.get("GROUP_SIZE_M"),
            "num_warps": raw.get("num_warps"),
            "num_stages": raw.get("num_stages"),
        }
        fields = {k: int(v) for k, v in fields.items() if v is not None}
        if base is not None:
            return replace(base, **fields)
        missing = {"block_m", "block_n", "block_k"} - set(fields)
        if missing:
            raise ValueError("a MoE config needs BLOCK_SIZE_M, BLOCK_SIZE_N and BLOCK_SIZE_K")
        return cls(**fields)

    def to_dict(self) -> dict:
        return dict(zip(_KEYS, (self.block_m, self.block_n, self.block_k, self.group_m,
                                self.num_warps, self.num_stages), strict=True))


@dataclass(frozen=True)
class MoEConfig:
    """Configs of the two GEMMs of one fused MoE call; they share block_m (one alignment)."""

    gemm1: GemmConfig
    gemm2: GemmConfig
    lora: MoEConfig | None = None  # the split LoRA path's own tiles, when tuned apart
    # Split LoRA tiles for one rank tile each, in place of ``lora`` there: ((rank tile, tiles), ...).
    lora_by_rank: tuple[tuple[int, MoEConfig], ...] = ()
    # The same for batches of MULTI_ADAPTER_TILES_MIN_ADAPTERS adapters or more, ahead of ``lora_by_rank``.
    lora_multi_by_rank: tuple[tuple[int, MoEConfig], ...] = ()

    @property
    def block_m(self) -> int:
        return self.gemm1.block_m

    @classmethod
    def from_dict(cls, raw: dict) -> MoEConfig:
        gemm1 = GemmConfig.from_dict(raw)
        gemm2 = GemmConfig.from_dict(raw.get("gemm2", {}), base=gemm1)
        if gemm2.block_m != gemm1.block_m:
            raise ValueError("gemm2 may not change BLOCK_SIZE_M: both GEMMs share one token alignment")
        lora = raw.get("lora")
        nested = [lora or {}]
        tiles_by_key = {}
        for key in _LORA_KEYS[1:]:
            by_rank = raw.get(key, {})
            if not isinstance(by_rank, dict):
                raise ValueError(f"\"{key}\" maps rank tiles to entries, got {type(by_rank).__name__}")
            nested += by_rank.values()
            rank_tiles = []
            for rank_key, entry in by_rank.items():
                if not str(rank_key).isdigit() or int(rank_key) < 16 or int(rank_key) & (int(rank_key) - 1):
                    raise ValueError(f"\"{key}\" keys are rank tiles (16, 32, 64, ...), got {rank_key!r}")
                rank_tiles.append((int(rank_key), entry))
            tiles_by_key[key] = rank_tiles
        for entry in nested:
            if isinstance(entry, dict) and set(entry) & set(_LORA_KEYS):
                raise ValueError("a LoRA entry may not hold another \"lora\", \"lora_by_rank\" or "
                                 "\"lora_multi_by_rank\" entry")
        return cls(gemm1, gemm2, cls.from_dict(lora) if lora is not None else None,
                   *(tuple(sorted((rank, cls.from_dict(entry)) for rank, entry in tiles_by_key[key]))
                     for key in _LORA_KEYS[1:]))

    def to_dict(self) -> dict:
        """The JSON entry ``from_dict`` reads (gemm2 minus the shared BLOCK_SIZE_M; lora when set)."""
        entry = self.gemm1.to_dict()
        entry["gemm2"] = {k: v for k, v in self.gemm2.to_dict().items() if k != "BLOCK_SIZE_M"}
        if self.lora is not None:
            entry["lora"] = self.lora.to_dict()
        for key in _LORA_KEYS[1:]:
            if getattr(self, key):
                entry[key] = {str(rank): tiles.to_dict() for rank, tiles in getattr(self, key)}
        return entry

    def with_lora_tiles(self, tiles: MoEConfig, rank_block: int = 0, *, multi: bool = False) -> MoEConfig:
        """This entry with ``tiles`` as its split LoRA tiles: under ``lora_by_rank`` at ``rank_block``
        (replacing what was there), or as ``lora`` (every rank tile without its own) when 0; with ``multi``
        under ``lora_multi_by_rank`` at ``rank_block`` (batches of several adapters; needs a rank tile)."""
        if tiles.lora is not None or tiles.lora_by_rank or tiles.lora_multi_by_rank:
            raise ValueError("LoRA tiles may not hold \"lora\", \"lora_by_rank\" or \"lora_multi_by_rank\" "
                             "entries of their own")
        if not rank_block:
            if multi:
                raise ValueError("tiles for several adapters go under a rank tile (16, 32, 64, ...), got 0")
            return replace(self, lora=tiles)
        field = "lora_multi_by_rank" if multi else "lora_by_rank"
        kept = tuple((rank, cfg) for rank, cfg in getattr(self, field) if rank != rank_block)
        return replace(self, **{field: tuple(sorted((*kept, (rank_block, tiles))))})

    def for_lora(self, rank_block: int = 0, num_adapters: int = 0) -> MoEConfig:
        """The tiles for the layer with adapters (split path) at this rank tile: with ``num_adapters`` (the
        batch's distinct adapters, 0 when unknown) of MULTI_ADAPTER_TILES_MIN_ADAPTERS or more its
        ``lora_multi_by_rank`` entry, else its ``lora_by_rank`` entry, else the tuned ``lora`` entry, else
        these (0: any rank tile, the ``lora`` entry)."""
        if num_adapters >= MULTI_ADAPTER_TILES_MIN_ADAPTERS:
            for rank, tiles in self.lora_multi_by_rank:
                if rank == rank_block:
                    return tiles
        for rank, tiles in self.lora_by_rank:
            if rank == rank_block:
                return tiles
        return self.lora if self.lora is not None else self


# Shared memory one block may use on Hopper (H100/H200: 227 KiB) and Ada/Ampere data-centre parts; the
# pipeline estimate below leaves room under it for the epilogue's layout-conversion scratch.
MAX_SHARED_BYTES = 227 * 1024
# What an SM holds (H100/H200: 228 KiB), of which each resident block reserves 1 KiB.
SM_SHARED_BYTES = 228 * 1024
BLOCK_RESERVED_SHARED_BYTES = 1024


def blocks_per_sm_by_shared(shared_bytes: int) -> int:
    """Blocks that fit on an SM as far as shared memory goes (each also reserves 1 KiB)."""
    return SM_SHARED_BYTES // (shared_bytes + BLOCK_RESERVED_SHARED_BYTES)


def pipeline_smem_bytes(gemm: GemmConfig, *, b_tiles: int, lora_cols: int = 0, elem_bytes: int = 2) -> int:
    """Shared memory of a GEMM's software pipeline: ``num_stages`` copies of the A tile, ``b_tiles`` B
    tiles (2 for gate/up) and, with an inline LoRA shrink, ``lora_cols`` columns of LoRA A per stage."""
    per_stage = gemm.block_m * gemm.block_k + b_tiles * gemm.block_k * gemm.block_n + gemm.block_k * lora_cols
    return gemm.num_stages * per_stage * elem_bytes


def env_switch(name: str, default: bool) -> bool:
    """An on/off environment switch: ``NAME=1`` on, ``NAME=0`` off, unset ``default``; anything else is a
    mistake worth saying."""
    value = os.environ.get(name, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return default if value == "" else value == "1"


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype's name in tuned file names; float8_e4m3fn weights are the block-scaled W8A8 GEMMs, uint8
    ones MXFP4 blocks (W4A16: ``triton_ops.mxfp4``)."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
            torch.float8_e4m3fn: "fp8_w8a8", torch.uint8: "mxfp4_w4a16"}[dtype]


def device_name(device: torch.device | None = None) -> str:
    if not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name(device).replace(" ", "_")


def config_file_name(num_experts: int, intermediate: int, device: str, dtype: torch.dtype) -> str:
    return f"E={num_experts},N={intermediate},device_name={device},dtype={dtype_name(dtype)}.json"


@functools.lru_cache(maxsize=64)
def _load_tuned(path: str) -> tuple[tuple[int, MoEConfig], ...]:
    with open(path) as f:
        raw = json.load(f)
    return tuple(sorted((int(m), MoEConfig.from_dict(cfg)) for m, cfg in raw.items()))


def _forced_config() -> MoEConfig | None:
    forced = os.environ.get("MOELORA_MOE_CONFIG")
    if not forced or forced == "heuristic":
        return None
    text = Path(forced).read_text() if not forced.lstrip().startswith("{") else forced
    return MoEConfig.from_dict(json.loads(text))


def tuned_config_path(num_experts: int, intermediate: int, device: str, dtype: torch.dtype) -> Path:
    """The tuned file the lookup reads for this shape and device (in ``MOELORA_MOE_CONFIG_DIR`` when set)."""
    config_dir = Path(os.environ.get("MOELORA_MOE_CONFIG_DIR", _CONFIG_DIR))
    return config_dir / config_file_name(num_experts, intermediate, device, dtype)


def nearest_tuned_m(token_counts: Iterable[int], num_tokens: int) -> int:
    """The tuned M whose entry serves ``num_tokens``: the nearest, the smaller one on a tie."""
    return min(sorted(token_counts), key=lambda m: abs(m - num_tokens))


def tuned_moe_config(
    num_tokens: int, num_experts: int, intermediate: int, dtype: torch.dtype, device: str
) -> MoEConfig | None:
    """The tuned entry nearest to ``num_tokens`` for this shape and device, or None."""
    if os.environ.get("MOELORA_MOE_CONFIG") == "heuristic":
        return None
    path = tuned_config_path(num_experts, intermediate, device, dtype)
    if not path.is_file():
        return None
    entries = dict(_load_tuned(str(path)))
    return entries[nearest_tuned_m(entries, num_tokens)]


def default_moe_config(
    num_tokens: int, num_experts: int, hidden: int, intermediate: int, top_k: int, dtype: torch.dtype
) -> MoEConfig:
    """Heuristic: decode-sized batches stream weights (small BLOCK_M, deep pipelines); larger batches
    want square tensor-core tiles. Pairs per expert decides which regime we are in."""
    pairs_per_expert = num_tokens * top_k / num_experts
    if dtype == torch.float32:
        # fp32 tiles take twice the shared memory: keep them small.
        gemm1 = GemmConfig(16 if pairs_per_expert <= 16 else 32, 32, 32, 1, 4, 2)
        return MoEConfig(gemm1, replace(gemm1, block_n=64))
    if pairs_per_expert <= 4:
        gemm1 = GemmConfig(16, 64, 128, 1, 4, 4)
        gemm2 = GemmConfig(16, 64, 128, 1, 4, 4)
    elif pairs_per_expert <= 32:
        gemm1 = GemmConfig(32, 64, 64, 8, 4, 4)
        gemm2 = GemmConfig(32, 128, 64, 8, 4, 4)
    elif pairs_per_expert <= 96:
        gemm1 = GemmConfig(64, 64, 64, 8, 4, 4)
        gemm2 = GemmConfig(64, 128, 64, 8, 8, 4)
    else:
        gemm1 = GemmConfig(128, 64, 64, 8, 8, 4)
        gemm2 = GemmConfig(128, 128, 64, 8, 8, 4)
    return MoEConfig(gemm1, gemm2)


def get_moe_config(
    num_tokens: int,
    num_experts: int,
    hidden: int,
    intermediate: int,
    top_k: int,
    dtype: torch.dtype,
    device: torch.device | None = None,
    lora: bool = False,
    rank_block: int = 0,
    num_adapters: int = 0,
) -> MoEConfig:
    """Forced config, else tuned JSON for this device, else the heuristic (see the module docstring);
    with ``lora`` the entry's LoRA tiles for ``rank_block`` and ``num_adapters`` distinct adapters in the
    batch (0: unknown, taken as one; ``MoEConfig.for_lora``) where it has them."""
    forced = _forced_config()
    if forced is not None:
        return forced.for_lora(rank_block, num_adapters) if lora else forced
    on_gpu = device is not None and torch.device(device).type == "cuda"
    if on_gpu:
        tuned = tuned_moe_config(num_tokens, num_experts, intermediate, dtype, device_name(device))
        if tuned is not None:
            return tuned.for_lora(rank_block, num_adapters) if lora else tuned
    return default_moe_config(num_tokens, num_experts, hidden, intermediate, top_k, dtype)
