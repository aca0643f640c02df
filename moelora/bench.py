"""``moelora bench``: LoRA overhead of the MoE layer, t(base+LoRA) / t(base) - 1, per path, in one run.

For each model shape (E experts, top-k, hidden H, intermediate I), token count M, rank, adapter count and
adapter popularity this times

* ``base``: ``fused_experts`` without adapters (every record's ``base_us``),
* ``fused`` / ``split`` / ``staged``: the same call with every token on one of ``n_adapters`` adapters
  through that LoRA path, and ``auto``: the path ``triton_ops.plan.auto_lora_path`` picks for the batch
  (its time is reused when that path was timed already),
* ``naive``: a PyTorch loop over the routed experts with the LoRA applied per (expert, adapter) token
  group; it syncs, so it runs eagerly, and it is skipped when one call is estimated too slow.

Timing (GPU): each call is warmed up on a side stream, captured in a CUDA graph and its replays timed as
``triton.testing.do_bench`` does (median on CUDA events, L2 flushed before every replay), except that the
flush reads 256 MB instead of writing it (``cold_l2_time_ms``: a write flush leaves ~50 MB of dirty lines
whose write-back lands in the timed call; ``--l2-flush write`` restores it). Each LoRA path is timed
interleaved with the base (``cold_l2_times_ms``: a replay of each in turn), and its row's ``base_us`` is
that base, so an overhead compares two calls that ran under the same clocks; the ``base`` row is its own
timing. ``--dry-run``
runs tiny shapes (on CPU through Triton's interpreter when there is no GPU) timed with
``time.perf_counter``: it checks the pipeline, its numbers mean nothing.

Adapters: a ``max(8, n_adapters)``-slot pool of max_rank = the rank, random weights, scaling 2. Which
adapter a token uses: M <= 64 (decode): every token is its own sequence and draws its adapter (uniform,
or Zipf s=1.1 over the adapters); larger M (prefill): contiguous sequences, one per adapter, whose
lengths follow the popularity (uniform: M / n_adapters tokens each, as ``benchmarks/bench_lora.py`` did).

Bytes = distinct routed experts x 3*H*I*elem + activations in/out (2*M*H*elem) + the LoRA weights of
every distinct (adapter, routed expert) pair, 3*r*(H+I)*elem each; FLOPs = 2*M*k*3*H*I + M*k*6*r*(H+I).
Writes a markdown table to stdout, JSON + markdown + a PNG plot (overhead vs M) to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import gc
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from moelora.activations import GatedActivation, as_gated_activation
from moelora.bench_report import markdown_table, plot_overhead
from moelora.bench_timing import (  # noqa: F401  (the benchmarks import the timers from here)
    Progress,
    cold_l2_time_ms,
    cold_l2_times_ms,
    eager_time_us,
    graph_rounds_us,
    graph_time_us,
    graph_times_us,
    median_round,
    warm_up_on_side_stream,
)

__all__ = ["MODELS", "BenchError", "ModelShape", "load_config", "run_bench"]


class BenchError(ValueError):
    """A bad benchmark request (unknown model, unreadable or invalid --config, ...)."""


@dataclass(frozen=True)
class ModelShape:
    name: str
    E: int
    top_k: int
    H: int
    I: int  # noqa: E741
    # the experts' gated activation (a GatedActivation or a plain kind's name) and expert biases (gpt-oss)
    activation: Any = "silu"
    biases: bool = False


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("deepseek-v2-lite", 64, 6, 2048, 1408),
        ModelShape("deepseek-v2", 160, 6, 5120, 1536),
        ModelShape("deepseek-v3", 256, 8, 7168, 2048),
        ModelShape("qwen3-30b-a3b", 128, 8, 2048, 768),
        ModelShape("mixtral-8x7b", 8, 2, 4096, 14336),
        ModelShape("gpt-oss-20b", 32, 4, 2880, 2880,
                   activation=GatedActivation("clamped_swiglu", 7.0, 1.702, 1.0), biases=True),
    )
}
DRY_RUN_MODEL = ModelShape("tiny", 8, 2, 64, 48)

PATHS = ("naive", "base", "fused", "split", "staged", "auto")
LORA_PATHS = ("fused", "split", "staged")
DEFAULT_PATHS = ["base", "fused", "split", "staged", "auto"]
DEFAULT_M = [1, 16, 64, 256, 1024, 4096]
DEFAULT_RANKS = [16, 64]
DEFAULT_ADAPTERS = [1, 4]
# ``--quick``: three models, three M, rank 16, short timing loops (its run time: docs/performance.md).
QUICK = dict(models=["deepseek-v2-lite", "qwen3-30b-a3b", "deepseek-v3"], M=[1, 64, 1024], ranks=[16],
             adapters=[1, 4], paths=["base", "split", "auto"], warmup=10.0, rep=30.0)
DRY_RUN = dict(M=[1, 8, 80], ranks=[8], adapters=[1, 4], paths=list(PATHS))
DECODE_MAX_TOKENS = 64  # up to here every token is its own sequence
ZIPF_S = 1.1

# Dense bf16/fp16 tensor-core peak and HBM bandwidth (datasheets); first regex match wins.
PEAKS: list[tuple[str, float, float]] = [
    (r"H100.*PCIe", 2.0, 756.0),
    (r"H100.*NVL", 3.9, 835.0),
    (r"H100", 3.35, 989.0),
    (r"H200", 4.8, 989.0),
]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
REQUIRED_CONFIG_KEYS = ("name", "E", "top_k", "H", "I")


def device_peaks(device_name: str) -> dict[str, float | None]:
    for pattern, tbps, tflops in PEAKS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return {"hbm_tbps": tbps, "tc_tflops": tflops}
    return {"hbm_tbps": None, "tc_tflops": None}


def slugify(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------


def load_config(path: str | Path) -> ModelShape:
    """A model shape from a JSON file ``{"name": .., "E": .., "top_k": .., "H": .., "I": ..}``."""
    path = Path(path)
    if not path.is_file():
        raise BenchError(f"--config {path}: no such file")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BenchError(f"--config {path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        keys = ", ".join(REQUIRED_CONFIG_KEYS)
        raise BenchError(f"--config {path}: expected a JSON object with {keys}, got {type(data).__name__}")
    missing = [k for k in REQUIRED_CONFIG_KEYS if k not in data]
    if missing:
        raise BenchError(f"--config {path}: missing {', '.join(missing)} "
                         f"(needs {', '.join(REQUIRED_CONFIG_KEYS)})")
    unknown = sorted(set(data) - set(REQUIRED_CONFIG_KEYS))
    if unknown:
        raise BenchError(f"--config {path}: unknown keys {', '.join(unknown)}")
    if not isinstance(data["name"], str) or not data["name"].strip():
        raise BenchError(f"--config {path}: name must be a non-empty string")
    for key in REQUIRED_CONFIG_KEYS[1:]:
        v = data[key]
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise BenchError(f"--config {path}: {key} must be a positive integer, got {v!r}")
    if data["top_k"] > data["E"]:
        raise BenchError(f"--config {path}: top_k={data['top_k']} exceeds E={data['E']}")
    return ModelShape(data["name"].strip(), data["E"], data["top_k"], data["H"], data["I"])


def select_models(names: Sequence[str] | None, configs: Sequence[str] | None) -> list[ModelShape]:
    chosen: list[ModelShape] = []
    for raw in names or ():
        for name in filter(None, (n.strip() for n in raw.split(","))):
            key = name.lower()
            if key not in MODELS:
                raise BenchError(f"unknown model {name!r}; choose from {', '.join(MODELS)} "
                                 "or describe it with --config FILE.json")
            chosen.append(MODELS[key])
    chosen += [load_config(c) for c in configs or ()]
    return chosen


# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------


def make_routing(m: int, shape: ModelShape, seed: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """randn logits -> softmax -> top-k -> renormalise (CPU generator: the same on every device)."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(m, shape.E, generator=gen), dim=-1)
    weights, ids = torch.topk(probs, shape.top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(device).contiguous(), ids.to(device=device, dtype=torch.int32).contiguous()


def popularity_weights(n_adapters: int, popularity: str) -> torch.Tensor:
    if popularity == "zipf":
        p = torch.arange(1, n_adapters + 1, dtype=torch.float64) ** -ZIPF_S
    else:
        p = torch.ones(n_adapters, dtype=torch.float64)
    return p / p.sum()


def token_slots_for(m: int, n_adapters: int, popularity: str, seed: int) -> torch.Tensor:
    """(M,) int32 slot of each token, on the host.

    Decode (M <= 64): each token is its own sequence and draws an adapter from the popularity. Prefill:
    one contiguous sequence per adapter, of about M * p_i tokens (uniform: M / n_adapters each).
    """
    p = popularity_weights(n_adapters, popularity)
    if m <= DECODE_MAX_TOKENS:
        gen = torch.Generator().manual_seed(seed)
        return torch.multinomial(p, m, replacement=True, generator=gen).to(torch.int32)
    if popularity == "uniform":  # as benchmarks/bench_lora.py laid them out
        return (torch.arange(m) * n_adapters // m).to(torch.int32)
    bounds = torch.cumsum(p, 0) * m  # token t belongs to the first adapter whose bound exceeds t
    slots = torch.searchsorted(bounds, torch.arange(m, dtype=torch.float64) + 0.5, right=True)
    return slots.clamp_max(n_adapters - 1).to(torch.int32)


@dataclass
class LoRABuffers:
    """Random adapters in every slot: the dense tensors (docs/design.md §2, what the naive loop reads) and the
    same values in the pool's arena layout (``weights``: what the kernels read, as they do when serving)."""

    gate_up_a: torch.Tensor  # (L, E, 2R, H)
    gate_up_b: torch.Tensor  # (L, E, 2I, R)
    down_a: torch.Tensor  # (L, E, R, I)
    down_b: torch.Tensor  # (L, E, H, R)
    weights: dict[str, Any] = field(default_factory=dict)  # name -> triton_ops LoRAWeights


def make_lora_buffers(shape: ModelShape, rank: int, slots: int, dtype: torch.dtype, device: torch.device,
                      seed: int) -> LoRABuffers:
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*dims: int, fan_in: int) -> torch.Tensor:
        return torch.randn(*dims, device=device, dtype=dtype, generator=gen).mul_(fan_in**-0.5)

    buf = LoRABuffers(
        gate_up_a=rnd(slots, shape.E, 2 * rank, shape.H, fan_in=shape.H),
        gate_up_b=rnd(slots, shape.E, 2 * shape.I, rank, fan_in=rank),
        down_a=rnd(slots, shape.E, rank, shape.I, fan_in=shape.I),
        down_b=rnd(slots, shape.E, shape.H, rank, fan_in=rank),
    )
    buf.weights = arena_weights(buf)
    return buf


def arena_weights(buf: LoRABuffers) -> dict[str, Any]:
    """``buf``'s adapters laid out as ``MoELoRAMemoryPool`` stores them (moelora.pool): a zero block, then
    each slot's experts one rank-R block after the other, B transposed, read through a block table."""
    from triton_ops.lora_weights import arena_lora_weights

    slots, experts, two_r, hidden = buf.gate_up_a.shape
    rank, inter, dev, dtype = two_r // 2, buf.down_a.shape[3], buf.gate_up_a.device, buf.gate_up_a.dtype
    step = 1 << (rank - 1).bit_length()
    units = step * (1 + slots * experts)
    rows = units + max(16, step)
    kw = {"dtype": dtype, "device": dev}
    gate_up_a, gate_up_b = torch.zeros(2, rows, hidden, **kw), torch.zeros(rows, 2 * inter, **kw)
    down_a, down_b = torch.zeros(rows, inter, **kw), torch.zeros(rows, hidden, **kw)

    def blocks_of(arena: torch.Tensor) -> torch.Tensor:  # (L * E, rank, width) view of the slots' blocks
        return arena[step:units].unflatten(0, (slots * experts, step))[:, :rank]

    def rank_rows(t: torch.Tensor) -> torch.Tensor:  # (L, E, rank, width) -> (L * E, rank, width)
        return t.reshape(slots * experts, rank, t.shape[-1])

    blocks_of(gate_up_a[0]).copy_(rank_rows(buf.gate_up_a[:, :, :rank]))
    blocks_of(gate_up_a[1]).copy_(rank_rows(buf.gate_up_a[:, :, rank:]))
    blocks_of(gate_up_b).copy_(rank_rows(buf.gate_up_b.transpose(2, 3)))
    blocks_of(down_a).copy_(rank_rows(buf.down_a))
    blocks_of(down_b).copy_(rank_rows(buf.down_b.transpose(2, 3)))
    table = (step * (1 + torch.arange(slots * experts, device=dev))).to(torch.int32).view(slots, experts)
    return arena_lora_weights(gate_up_a, gate_up_b, down_a, down_b, table, rank)


def make_weights(shape: ModelShape, dtype: torch.dtype, device: torch.device,
                 seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.randn(shape.E, 2 * shape.I, shape.H, generator=gen, device=device, dtype=dtype)
    w2 = torch.randn(shape.E, shape.H, shape.I, generator=gen, device=device, dtype=dtype)
    return w13.mul_(shape.H**-0.5), w2.mul_(shape.I**-0.5)


def make_biases(shape: ModelShape, dtype: torch.dtype, device: torch.device,
                seed: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The experts' (E, 2I) and (E, H) biases of a shape that has them, else (None, None)."""
    if not shape.biases:
        return None, None
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    return (torch.randn(shape.E, 2 * shape.I, generator=gen, device=device, dtype=dtype).mul_(0.1),
            torch.randn(shape.E, shape.H, generator=gen, device=device, dtype=dtype).mul_(0.1))


def lora_inputs(buf: LoRABuffers, token_slots: torch.Tensor, n_slots: int, n_adapters: int, rank: int,
                device: torch.device) -> Any:
    """The benchmark's ``MoELoRAInputs``: slots [0, n_adapters) hold rank-``rank`` adapters (scaling 2),
    the rest of the ``n_slots`` are empty; ``token_slots`` (host) from ``token_slots_for``."""
    from triton_ops.fused_experts import MoELoRAInputs

    slot_ranks = torch.zeros(n_slots, dtype=torch.int32)
    slot_ranks[:n_adapters] = rank
    return MoELoRAInputs(
        token_slots=token_slots.to(device), **buf.weights, slot_ranks=slot_ranks.to(device),
        slot_scalings=torch.full((n_slots,), 2.0, device=device), max_rank=rank,
        num_adapters=int(torch.unique(token_slots).numel()), slots_checked=True,
    )


def dense_lora_inputs(lora: Any, buf: LoRABuffers) -> Any:
    """``lora`` reading ``buf``'s dense tensors (the naive loop's operands) instead of its arena."""
    return replace(lora, gate_up_a=buf.gate_up_a, gate_up_b=buf.gate_up_b, down_a=buf.down_a,
                   down_b=buf.down_b)


# --------------------------------------------------------------------------------------------------
# Naive baseline
# --------------------------------------------------------------------------------------------------


def naive_moe_lora(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, lora: Any = None, activation: Any = "silu",
                   w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch loop over the routed experts (base GEMMs per expert), LoRA per (expert, adapter) group.

    ``lora`` is a ``triton_ops.fused_experts.MoELoRAInputs`` with dense buffers (``dense_lora_inputs``) or
    None. One host sync for the group sizes.
    On CPU it computes in float32 (PyTorch's CPU half-precision GEMMs are very slow at these shapes).
    """
    cdt = torch.float32 if x.device.type == "cpu" else x.dtype
    act = as_gated_activation(activation)
    m, hidden = x.shape
    num_experts, inter, top_k = w13.shape[0], w2.shape[2], topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1).long()
    flat_w = topk_weights.reshape(-1).float()
    flat_tok = torch.arange(m, device=x.device).repeat_interleave(top_k)
    groups = 1
    key = flat_ids
    if lora is not None:
        groups = lora.gate_up_a.shape[0] + 1  # slot -1 (no adapter) .. L-1
        key = flat_ids * groups + lora.token_slots.long()[flat_tok] + 1
        ranks, scalings = lora.slot_ranks.tolist(), lora.slot_scalings.tolist()
        big_r = lora.gate_up_a.shape[2] // 2
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_experts * groups).tolist()  # syncs
    out = torch.zeros(m, hidden, dtype=torch.float32, device=x.device)
    start = 0
    for e in range(num_experts):
        sizes = counts[e * groups : (e + 1) * groups]
        n = sum(sizes)
        if n == 0:
            continue
        idx = order[start : start + n]
        start += n
        tok = flat_tok[idx]
        xe = x[tok].to(cdt)
        gu = xe @ w13[e].to(cdt).t()  # (n, 2I)
        if w13_bias is not None:
            gu += w13_bias[e].to(cdt)
        spans = []  # (rows, slot) of each adapter group of this expert
        if lora is not None:
            off = sizes[0]  # pairs without an adapter sort first
            for slot, size in enumerate(sizes[1:]):
                if size:
                    spans.append((slice(off, off + size), slot))
                off += size
        for rows, slot in spans:
            r, s = ranks[slot], scalings[slot]
            a = lora.gate_up_a[slot, e].to(cdt)
            b = lora.gate_up_b[slot, e].to(cdt)
            xg = xe[rows]
            d_gate = (xg @ a[:r].t()) @ b[:inter, :r].t()
            d_up = (xg @ a[big_r : big_r + r].t()) @ b[inter:, :r].t()
            gu[rows] += torch.cat([d_gate, d_up], dim=1) * s
        h = act(gu[:, :inter], gu[:, inter:])
        y = h @ w2[e].to(cdt).t()  # (n, H)
        if w2_bias is not None:
            y += w2_bias[e].to(cdt)
        for rows, slot in spans:
            r, s = ranks[slot], scalings[slot]
            da, db = lora.down_a[slot, e, :r].to(cdt), lora.down_b[slot, e, :, :r].to(cdt)
            y[rows] += (h[rows] @ da.t()) @ db.t() * s
        # A token meets an expert at most once, so tok has no repeats (index_add_ is very slow on CPU).
        out.index_put_((tok,), y.float() * flat_w[idx, None], accumulate=True)
    return out.to(x.dtype)


def naive_estimate_s(shape: ModelShape, m: int, experts: int, groups: int, rank: int) -> float:
    """Pessimistic guess of one naive GPU call: ~150 TFLOP/s GEMMs, ~100 µs per expert, ~60 µs per group."""
    flops = 2 * m * shape.top_k * (3 * shape.H * shape.I + 3 * rank * (shape.H + shape.I))
    return flops / 150e12 + experts * 100e-6 + groups * 60e-6


# --------------------------------------------------------------------------------------------------
# Benchmark
# --------------------------------------------------------------------------------------------------


@dataclass
class Settings:
    device: torch.device
    device_name: str
    dtype_name: str
    paths: list[str]
    warmup_ms: float
    rep_ms: float
    cpu_reps: int
    naive_max_s: float
    seed: int
    peaks: dict[str, float | None]
    pool_rank: int = 0  # > rank: adapters of `rank` in buffers sized for this max rank
    l2_flush: str = "read"  # how the timer empties L2 before each call (cold_l2_time_ms)
    rounds: int = 1  # interleaved (base, LoRA) timing rounds per point; the row is the median round's


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a32, b32 = a.float(), b.float()
    return float((a32 - b32).norm() / b32.norm().clamp_min(1e-12))


def _record(cfg: Settings, shape: ModelShape, m: int, path: str, base_us: float, lora_us: float | None,
            experts: int, **extra: Any) -> dict[str, Any]:
    """One output row: times, bytes/FLOPs and their rates (of the base+LoRA call), % of device peak."""
    elem = DTYPES[cfg.dtype_name].itemsize
    rank = extra.get("rank") or 0
    lora_pairs = extra.pop("lora_pairs", 0) if path != "base" else 0
    expert_bytes = experts * 3 * shape.H * shape.I * elem + 2 * m * shape.H * elem
    lora_bytes = lora_pairs * 3 * rank * (shape.H + shape.I) * elem
    flops = 2 * m * shape.top_k * 3 * shape.H * shape.I
    if path != "base":
        flops += m * shape.top_k * 6 * rank * (shape.H + shape.I)
    rec: dict[str, Any] = {
        "device": cfg.device_name, "model": shape.name, "E": shape.E, "top_k": shape.top_k, "H": shape.H,
        "I": shape.I, "M": m, "rank": None, "n_adapters": None, "popularity": None, "path": path,
        "resolved_path": None, "dtype": cfg.dtype_name, "base_us": base_us, "base_lora_us": lora_us,
    }
    rec.update(extra)
    t = None if lora_us is None else lora_us * 1e-6
    tbps = None if t is None else (expert_bytes + lora_bytes) / t / 1e12
    tflops = None if t is None else flops / t / 1e12
    hbm, tc = cfg.peaks["hbm_tbps"], cfg.peaks["tc_tflops"]
    rec.update(
        overhead=None if lora_us is None else lora_us / base_us - 1,
        tbps=tbps, pct_hbm_peak=None if tbps is None or hbm is None else 100 * tbps / hbm,
        tflops=tflops, pct_tc_peak=None if tflops is None or tc is None else 100 * tflops / tc,
        experts_touched=experts, lora_pairs_touched=lora_pairs, expert_bytes=expert_bytes,
        lora_bytes=lora_bytes, flops=flops,
    )
    return rec


def count_units(models: list[ModelShape], ms: list[int], ranks: list[int], adapters: list[int],
                popularities: list[str], paths: list[str]) -> int:
    lora_paths = [p for p in paths if p != "base"]
    combos = sum(1 for n in adapters for p in popularities if not _skip_popularity(n, p, popularities))
    return len(models) * len(ms) * (1 + len(ranks) * combos * len(lora_paths))


def _skip_popularity(n_adapters: int, popularity: str, popularities: list[str]) -> bool:
    """With one adapter every popularity is the same batch: keep only the first one asked for."""
    return n_adapters == 1 and popularity != popularities[0]


def bench_model(shape: ModelShape, ms: list[int], ranks: list[int], adapters: list[int],
                popularities: list[str], cfg: Settings, progress: Progress) -> list[dict[str, Any]]:
    device, dtype = cfg.device, DTYPES[cfg.dtype_name]
    n_slots = max(8, max(adapters))
    if device.type == "cuda":
        need = shape.E * 3 * shape.H * shape.I * dtype.itemsize
        # the LoRA twice: dense for the naive loop, the arena layout for the kernels
        need += 2 * n_slots * shape.E * 3 * max(*ranks, cfg.pool_rank) * (shape.H + shape.I) * dtype.itemsize
        free = torch.cuda.mem_get_info()[0]
        if need > 0.9 * free:
            print(f"[skip] {shape.name}: needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free",
                  file=sys.stderr)
            for _ in range(count_units([shape], ms, ranks, adapters, popularities, cfg.paths)):
                progress.step(f"{shape.name} skipped")
            return []

    w13, w2 = make_weights(shape, dtype, device, cfg.seed)
    biases = make_biases(shape, dtype, device, cfg.seed)
    buffers = {r: make_lora_buffers(shape, max(r, cfg.pool_rank), n_slots, dtype, device, cfg.seed + r)
               for r in ranks}
    records: list[dict[str, Any]] = []
    for m in ms:
        records += _bench_tokens(shape, m, w13, w2, biases, buffers, n_slots, adapters, popularities, cfg,
                                 progress)
    del w13, w2, buffers
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return records


def _bench_tokens(shape: ModelShape, m: int, w13: torch.Tensor, w2: torch.Tensor,
                  biases: tuple[torch.Tensor | None, torch.Tensor | None], buffers: dict[int, LoRABuffers],
                  n_slots: int, adapters: list[int], popularities: list[str],
                  cfg: Settings, progress: Progress) -> list[dict[str, Any]]:
    """Every record of one (model, M): the base once, then each rank x adapters x popularity x path."""
    from triton_ops.fused_experts import fused_experts
    from triton_ops.plan import auto_lora_path, launch_adapter_count

    device, dtype = cfg.device, DTYPES[cfg.dtype_name]
    on_gpu = device.type == "cuda"
    topk_weights, topk_ids = make_routing(m, shape, cfg.seed + m, device)
    ids_host = topk_ids.cpu().long()
    experts = int(torch.unique(ids_host).numel())
    gen = torch.Generator().manual_seed(cfg.seed + 7 * m + 1)
    x = torch.randn(m, shape.H, generator=gen).to(device=device, dtype=dtype)

    def time_call(fn: Callable[[], Any]) -> tuple[float, bool]:
        if on_gpu:
            return graph_time_us(fn, cfg.warmup_ms, cfg.rep_ms, cfg.l2_flush)
        return eager_time_us(fn, False, cfg.warmup_ms, cfg.rep_ms, cfg.cpu_reps), False

    def time_with_base(fn: Callable[[], Any]) -> tuple[float, float, bool, list[float] | None]:
        """(base µs, fn µs, graph used, each round's overhead or None for one round): the two timed
        interleaved, so the overhead compares calls that ran under the same clocks (``cold_l2_times_ms``);
        with several rounds, those of the median round (``median_round``)."""
        if on_gpu:
            (base, lora), (_, graph) = graph_rounds_us([moe, fn], cfg.warmup_ms, cfg.rep_ms, cfg.l2_flush,
                                                      rounds=cfg.rounds)
            base_us, us, overheads = median_round(base, lora)
            return base_us, us, graph, overheads if cfg.rounds > 1 else None
        return time_call(moe)[0], *time_call(fn), None

    def moe(lora: Any = None, path: str = "fused") -> torch.Tensor:
        return fused_experts(x, w13, w2, topk_weights, topk_ids, lora=lora, lora_path=path,
                             activation=shape.activation, w13_bias=biases[0], w2_bias=biases[1])

    def naive(lora: Any = None) -> torch.Tensor:
        return naive_moe_lora(x, w13, w2, topk_weights, topk_ids, lora, shape.activation, *biases)

    def eager(fn: Callable[[], Any]) -> float:
        return eager_time_us(fn, on_gpu, cfg.warmup_ms, cfg.rep_ms, cfg.cpu_reps, cfg.l2_flush)

    records: list[dict[str, Any]] = []
    base_us, base_graph = time_call(moe)
    if "base" in cfg.paths:
        records.append(_record(cfg, shape, m, "base", base_us, base_us, experts, cuda_graph=base_graph))
    progress.step(f"{shape.name} M={m} base")

    for rank, buf in buffers.items():
        for n_adapters in adapters:
            for popularity in popularities:
                if _skip_popularity(n_adapters, popularity, popularities):
                    continue
                slots_host = token_slots_for(m, n_adapters, popularity, cfg.seed + 13 * m + n_adapters)
                lora_pairs = int(torch.unique(slots_host.long()[:, None] * shape.E + ids_host).numel())
                lora = lora_inputs(buf, slots_host, n_slots, n_adapters, rank, device)
                auto = auto_lora_path(m, launch_adapter_count(n_adapters))
                point = dict(rank=rank, n_adapters=n_adapters, popularity=popularity, lora_pairs=lora_pairs,
                             pool_rank=max(rank, cfg.pool_rank))
                label = f"{shape.name} M={m} r={rank} n={n_adapters} {popularity}"
                timed: dict[str, tuple[float, float, bool]] = {}
                errs: dict[str, float] = {}
                reference = None
                for path in (p for p in cfg.paths if p != "base"):  # naive first: the reference
                    extra: dict[str, Any] = {"cuda_graph": False}
                    row_base_us = base_us  # the LoRA paths' rows carry the base timed beside them
                    if path == "naive":
                        est = naive_estimate_s(shape, m, experts, lora_pairs, rank)
                        if on_gpu and est > cfg.naive_max_s:
                            us = None
                            extra["note"] = f"skipped: estimated {est:.2f} s per call > --naive-max-s"
                        else:
                            dense = dense_lora_inputs(lora, buf)
                            reference = naive(dense)
                            us = eager(functools.partial(naive, dense))
                            extra["naive_base_us"] = eager(naive)
                    else:
                        resolved = auto if path == "auto" else path
                        if path == "auto":
                            extra["resolved_path"] = resolved
                        if resolved not in timed:
                            call = functools.partial(moe, lora, resolved)
                            if reference is not None:
                                errs[resolved] = rel_err(call(), reference)
                            timed[resolved] = time_with_base(call)
                        row_base_us, us, extra["cuda_graph"], overheads = timed[resolved]
                        if overheads is not None:
                            extra["overhead_rounds"] = overheads
                        if resolved in errs:
                            extra["rel_err_vs_naive"] = errs[resolved]
                    records.append(_record(cfg, shape, m, path, row_base_us, us, experts, **point, **extra))
                    progress.step(f"{label} {path}")
    return records


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


def _default_results_dir() -> Path:
    root = Path(__file__).resolve().parents[1]
    base = root if (root / "benchmarks").is_dir() else Path.cwd()
    return base / "benchmarks" / "results"


def _positive(name: str, values: list[int]) -> list[int]:
    bad = [v for v in values if v <= 0]
    if bad:
        raise BenchError(f"{name} must be positive, got {bad}")
    return list(dict.fromkeys(values))


def run_bench(args: argparse.Namespace) -> int:
    """Runs ``moelora bench`` (arguments as ``moelora.cli`` parses them); returns the exit code.

    Raises BenchError for a bad request. Whoever calls this without a GPU must have set
    TRITON_INTERPRET=1 before anything imported ``triton_ops`` (``moelora.cli`` does).
    """
    models = select_models(args.models, args.config)  # a bad request fails first, before any work
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    has_cuda = torch.cuda.is_available()
    if args.dry_run:
        on_gpu = has_cuda and not interpret
        if not on_gpu and not interpret:
            raise BenchError("--dry-run without a GPU needs TRITON_INTERPRET=1 set before triton_ops is "
                             "imported (moelora.cli does it)")
    else:
        if not has_cuda:
            raise BenchError("no CUDA GPU: timings need one; --dry-run checks the benchmark on CPU")
        if interpret:
            raise BenchError("TRITON_INTERPRET=1 is set: full-size shapes in the interpreter would take "
                             "hours; unset it, or use --dry-run")
        on_gpu = True

    quick = args.quick and not args.dry_run
    if not models:
        if args.dry_run:
            models = [DRY_RUN_MODEL]
        else:
            models = [MODELS[n] for n in (QUICK["models"] if quick else MODELS)]
    elif args.dry_run and args.models:
        print("[dry-run] named models replaced by the tiny shape (use --config for another small one)",
              file=sys.stderr)
        models = [DRY_RUN_MODEL] + [m for m in models if m not in MODELS.values()]
    ms = _positive("--M", args.M or (DRY_RUN["M"] if args.dry_run else QUICK["M"] if quick else DEFAULT_M))
    ranks = _positive("--ranks", args.ranks or (DRY_RUN["ranks"] if args.dry_run else
                                               QUICK["ranks"] if quick else DEFAULT_RANKS))
    adapters = _positive("--adapters", args.adapters or (DRY_RUN["adapters"] if args.dry_run else
                                                        QUICK["adapters"] if quick else DEFAULT_ADAPTERS))
    popularities = list(dict.fromkeys(args.popularity or ["uniform"]))
    paths = args.paths or (DRY_RUN["paths"] if args.dry_run else QUICK["paths"] if quick else DEFAULT_PATHS)
    paths = [p for p in PATHS if p in paths]  # canonical order: naive first (it is the reference)
    dtype_name = args.dtype or ("fp16" if not on_gpu else "bf16")
    if not on_gpu and dtype_name == "bf16":
        raise BenchError("bf16 needs the GPU: Triton's interpreter computes bf16 dot products wrongly; "
                         "use fp16")
    warmup = args.warmup if args.warmup is not None else (QUICK["warmup"] if quick or args.dry_run else 25.0)
    rep = args.rep if args.rep is not None else (QUICK["rep"] if quick or args.dry_run else 100.0)

    rounds = _positive("--rounds", [1 if getattr(args, "rounds", None) is None else args.rounds])[0]
    device = torch.device("cuda" if on_gpu else "cpu")
    device_name = torch.cuda.get_device_name() if on_gpu else "cpu (TRITON_INTERPRET=1)"
    cfg = Settings(device=device, device_name=device_name, dtype_name=dtype_name, paths=paths,
                   warmup_ms=warmup, rep_ms=rep, cpu_reps=1, naive_max_s=args.naive_max_s, seed=args.seed,
                   pool_rank=getattr(args, "pool_rank", None) or 0,
                   l2_flush=getattr(args, "l2_flush", None) or "read",
                   rounds=rounds,
                   peaks=device_peaks(device_name) if on_gpu else device_peaks(""))

    import triton

    now = dt.datetime.now(dt.timezone.utc)
    out = args.out or _default_results_dir() / f"bench_{slugify(device_name)}_{now:%Y%m%d-%H%M%S}.json"
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"moelora bench on {device_name}: torch {torch.__version__}, triton {triton.__version__}, "
          f"{dtype_name}; peaks {cfg.peaks['hbm_tbps']} TB/s, {cfg.peaks['tc_tflops']} TFLOP/s"
          + ("; DRY RUN (timings are meaningless)" if args.dry_run else ""), flush=True)

    total = count_units(models, ms, ranks, adapters, popularities, paths)
    progress = Progress(total, enabled=not args.no_progress)
    records: list[dict[str, Any]] = []
    threads = torch.get_num_threads()
    if not on_gpu:  # the interpreter is single-threaded; idle OpenMP threads only stall on a busy machine
        torch.set_num_threads(1)
    try:
        for shape in models:
            records += bench_model(shape, ms, ranks, adapters, popularities, cfg, progress)
    finally:
        torch.set_num_threads(threads)

    table = markdown_table(records)
    print()
    print(table)
    rounds_note = (f", in {cfg.rounds} rounds, the row the round of median overhead (overhead_rounds: "
                   "each round's)" if cfg.rounds > 1 else "")
    meta = {
        "benchmark": "moelora bench: MoE LoRA overhead t(base+LoRA)/t(base) - 1 per path",
        "device": device_name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "date": now.isoformat(timespec="seconds"),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"},
        "resolved": {"models": [asdict(m) for m in models], "M": ms, "ranks": ranks, "adapters": adapters,
                     "popularity": popularities, "paths": paths, "dtype": dtype_name, "warmup_ms": warmup,
                     "rep_ms": rep, "rounds": cfg.rounds, "dry_run": args.dry_run, "quick": quick},
        "peaks": cfg.peaks,
        "timing": ("CUDA graph (warm-up on a side stream), median of graph.replay on CUDA events, L2 "
                   f"flushed before each replay by a 256 MB {cfg.l2_flush} (do_bench's loop); each LoRA path "
                   "timed interleaved with the base (a replay of each in turn; its row's base µs is that "
                   f"base){rounds_note}; naive eager, same timer" if on_gpu else
                   "time.perf_counter of one call (Triton interpreter: not a performance number)"),
        "bytes_model": "distinct routed experts * 3*H*I*elem + 2*M*H*elem + distinct (adapter, expert) "
                       "pairs * 3*r*(H+I)*elem (LoRA paths)",
        "flops_model": "2*M*k*3*H*I + M*k*6*r*(H+I) (LoRA paths)",
        "adapters_model": f"M <= {DECODE_MAX_TOKENS}: a drawn adapter per token (one-token sequences); "
                          f"larger M: contiguous sequences sized by popularity (zipf s={ZIPF_S})",
    }
    out.write_text(json.dumps(dict(meta, records=records), indent=1) + "\n")
    md = out.with_suffix(".md")
    md.write_text(f"# moelora bench on {device_name} ({meta['date']})\n\n{meta['timing']}.\n\n{table}\n")
    png = out.with_suffix(".png")
    title = (f"LoRA overhead t(base+LoRA)/t(base) - 1 vs M; {device_name}, {dtype_name}\n"
             f"worst over n_adapters {adapters}, popularity {popularities}")
    wrote_png = plot_overhead(records, png, title)
    print(f"\nwrote {out}, {md.name}" + (f", {png.name}" if wrote_png else ""))
    return 0
