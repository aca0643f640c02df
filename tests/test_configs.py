"""Launch configs: every committed tuned entry, fitted to the LoRA variants, fits a Hopper block's shared
memory.

A config tuned for the base GEMMs says nothing of the LoRA A tiles the inline shrink stages beside them;
the H100 table first met this (Mixtral M=256, 128x64x128 x 3 stages, rank 64: 288 KiB asked, 227 KiB
there). These tests need no GPU: the estimate is checked against every JSON, and one kernel is compiled
for sm_90 with Triton's bundled ptxas to check the estimate against what the compiler allocates.
"""

import importlib
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from triton_ops.configs import (
    _CONFIG_DIR,
    MAX_SHARED_BYTES,
    GemmConfig,
    MoEConfig,
    _load_tuned,
    default_moe_config,
    get_moe_config,
    pipeline_smem_bytes,
)
from triton_ops.fused_experts import _with_lora_tiles, fused_experts
from triton_ops.fused_moe import lora_plan_fields
from triton_ops.lora_epilogues import LORA_DEFERRED, LORA_ONE_ROW, LORA_PREFETCHED
from triton_ops.overrides import LAUNCH_OVERRIDES

TUNED_FILES = sorted(_CONFIG_DIR.glob("*.json"))
# The benchmark scripts (resource_report, tune_moe) are imported by some tests below.
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))


def test_there_are_tuned_files_for_both_hopper_parts():
    names = " ".join(path.name for path in TUNED_FILES)
    assert "NVIDIA_H100" in names and "NVIDIA_H200" in names


@pytest.mark.parametrize("path", TUNED_FILES, ids=lambda p: p.stem)
@pytest.mark.parametrize("rank_block", [16, 32, 64])  # 64: the widest rank tile the pools use
def test_fused_lora_configs_fit_shared_memory(path, rank_block):
    for m, cfg in _load_tuned(str(path)):
        fitted = _with_lora_tiles(cfg, rank_block=rank_block)
        for gemm, tiles in ((fitted.gemm1, 2), (fitted.gemm2, 1)):
            need = pipeline_smem_bytes(gemm, b_tiles=tiles, lora_cols=tiles * rank_block)
            assert need <= MAX_SHARED_BYTES, (path.name, m, gemm, need)
            assert gemm.num_stages >= 2 and gemm.block_k >= 32


def test_fit_keeps_configs_that_already_fit():
    small = MoEConfig(GemmConfig(16, 64, 128, 1, 4, 3), GemmConfig(16, 64, 128, 1, 4, 3))
    assert _with_lora_tiles(small, rank_block=16) == small


def test_fit_drops_stages_before_block_k():
    h100_mixtral = MoEConfig(GemmConfig(128, 64, 128, 8, 8, 3), GemmConfig(128, 128, 128, 8, 8, 3))
    fitted = _with_lora_tiles(h100_mixtral, rank_block=64)
    # 3 stages x (128x128 + 2x128x64 + 2x128x64) x 2 B = 288 KiB -> 2 stages = 192 KiB.
    assert fitted.gemm1 == GemmConfig(128, 64, 128, 8, 8, 2)
    # GEMM2: 3 x (128x128 + 128x128 + 128x64) x 2 B = 240 KiB -> 2 stages = 160 KiB.
    assert fitted.gemm2 == GemmConfig(128, 128, 128, 8, 8, 2)


def _resource_report(*args: str) -> subprocess.CompletedProcess:
    script = BENCHMARKS / "resource_report.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    return run


def test_estimate_matches_the_compiler():
    """The estimate is what Triton allocates for the fused GEMMs: compiled for sm_90 on this machine (no
    GPU) by benchmarks/resource_report.py, in a process of its own since the tests run interpreted."""
    run = _resource_report("--model", "mixtral-8x7b", "--M", "256", "--rank", "64", "--device-name",
                           "NVIDIA_H100_80GB_HBM3", "--only", "fused")
    reported = dict(re.findall(r"(gemm[12]) fused .* smem +([0-9.]+) KiB", run.stdout))
    cfg = _load_tuned(str(_CONFIG_DIR / "E=8,N=14336,device_name=NVIDIA_H100_80GB_HBM3,dtype=bf16.json"))
    fitted = _with_lora_tiles(dict(cfg)[256], rank_block=64)
    assert float(reported["gemm1"]) * 1024 == pipeline_smem_bytes(fitted.gemm1, b_tiles=2, lora_cols=128)
    assert float(reported["gemm2"]) * 1024 == pipeline_smem_bytes(fitted.gemm2, b_tiles=1, lora_cols=64)


# The kernel's LoRA variants that load the first slot's operands before the K-loop.
PREFETCHING_VARIANTS = (LORA_ONE_ROW.value, LORA_PREFETCHED.value, LORA_DEFERRED.value)


@pytest.mark.parametrize("model,prefetch", [("deepseek-v2", False), ("qwen3-30b-a3b", True)])
def test_decode_down_prefetch_only_within_one_wave(model, prefetch):
    """M=1 with the heuristic 16x64x128 x 4-stage GEMM1: DeepSeek-V2 has 6 x 24 = 144 programs (> 132
    SMs), Qwen3-30B 8 x 12 = 96. The down-A prefetch takes 2 KiB more shared memory, 112 -> 114 KiB on
    Triton 3.6, one block per SM instead of two: past one wave that cost DeepSeek-V2 108.5 -> 117.1 us
    on an H200, so there it is off (the launch decision is checked here; the Triton of CI allocates
    differently, so the compiled sizes are not)."""
    from resource_report import gemm_launches

    from moelora.bench import MODELS

    shape = MODELS[model]
    cfg = default_moe_config(1, shape.E, shape.H, shape.I, shape.top_k, torch.bfloat16)
    launch = lora_plan_fields(dict(gemm_launches(model, 1, 16, 1, cfg))["gemm1 split+down"])
    assert launch["down_shrink"] and launch["variant"] in PREFETCHING_VARIANTS
    assert launch["down_prefetch"] is prefetch


def test_prefetch_switch(monkeypatch):
    """lora_prefetch=0: no epilogue operand is prefetched (to compare on a GPU)."""
    from resource_report import gemm_launches

    from moelora.bench import MODELS

    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_prefetch", "0")
    shape = MODELS["qwen3-30b-a3b"]
    cfg = default_moe_config(1, shape.E, shape.H, shape.I, shape.top_k, torch.bfloat16)
    launches = dict(gemm_launches("qwen3-30b-a3b", 1, 16, 1, cfg))
    for name in ("gemm1 split", "gemm1 split+down", "gemm2 split"):
        plan = lora_plan_fields(launches[name])
        assert plan["variant"] not in PREFETCHING_VARIANTS and not plan["down_prefetch"]


@pytest.mark.parametrize("gemm,expected", [
    (GemmConfig(16, 64, 128, 1, 4, 4), True),  # decode tile
    (GemmConfig(32, 64, 128, 8, 4, 3), True),  # Mixtral-8x7B M=64
    (GemmConfig(128, 256, 64, 8, 8, 4), False),  # Qwen3-30B M=1024 GEMM2: one block per SM
    (GemmConfig(128, 64, 64, 8, 8, 3), False),  # its GEMM1: two blocks per SM
    (GemmConfig(64, 128, 64, 8, 4, 3), False),
])
def test_prefetch_rule(monkeypatch, gemm, expected):
    """The split epilogue's operands are prefetched on tiles of up to 32 rows only; "0" turns it off."""
    from triton_ops.fused_moe import lora_prefetch_pays

    monkeypatch.delitem(LAUNCH_OVERRIDES, "lora_prefetch", raising=False)
    assert lora_prefetch_pays(gemm) is expected
    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_prefetch", "1")
    assert lora_prefetch_pays(gemm) is expected
    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_prefetch", "0")
    assert lora_prefetch_pays(gemm) is False


def test_prefetch_rule_many_adapters_past_decode(monkeypatch):
    """16-row tiles past decode skip the prefetch for batches of 4+ adapters at rank tile 16 (a block holds
    several adapters' rows there); decode batches, fewer adapters, rank 64 and 32-row tiles keep it."""
    from triton_ops.fused_moe import lora_prefetch_pays

    monkeypatch.delitem(LAUNCH_OVERRIDES, "lora_prefetch", raising=False)
    m64 = GemmConfig(16, 32, 128, 1, 4, 5)  # Qwen3-30B-A3B M=64 GEMM1 (512 routed pairs)
    m64_32 = GemmConfig(32, 64, 128, 8, 4, 3)  # Mixtral-8x7B M=64: 32-row tiles (lost without it)

    def pays(gemm, numel=512, num_adapters=4, rank_block=16):
        return lora_prefetch_pays(gemm, numel=numel, num_adapters=num_adapters, rank_block=rank_block)

    assert not pays(m64) and not pays(m64, num_adapters=8)
    assert pays(m64, numel=128)  # decode (M=16 of Qwen3-30B-A3B): 4 adapters lost 2.3 % without it
    assert pays(m64, num_adapters=3) and pays(m64, num_adapters=0)  # 0: unknown, the usual rule
    assert pays(m64, rank_block=64) and pays(m64_32)
    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_prefetch", "1")
    assert pays(m64)
    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_prefetch", "yes")
    with pytest.raises(ValueError, match="lora_prefetch must be 0 or 1"):
        pays(m64)


def test_lora_entry_round_trip_and_lookup(monkeypatch):
    base = MoEConfig(GemmConfig(128, 64, 128, 8, 8, 3), GemmConfig(128, 128, 128, 8, 8, 3))
    lora = MoEConfig(GemmConfig(128, 64, 64, 8, 8, 3), GemmConfig(128, 256, 64, 8, 8, 4))
    entry = replace(base, lora=lora).to_dict()
    assert entry["lora"]["gemm2"]["BLOCK_SIZE_N"] == 256 and "BLOCK_SIZE_M" not in entry["gemm2"]
    parsed = MoEConfig.from_dict(entry)
    assert parsed == replace(base, lora=lora) and parsed.for_lora() == lora and lora.for_lora() == lora
    with pytest.raises(ValueError, match="lora"):
        MoEConfig.from_dict({**entry, "lora": {**entry["lora"], "lora": entry["lora"]}})
    monkeypatch.setenv("MOELORA_MOE_CONFIG", json.dumps(entry))
    args = (1024, 8, 4096, 14336, 2, torch.bfloat16)
    assert get_moe_config(*args) == parsed
    assert get_moe_config(*args, lora=True) == lora


def test_lora_by_rank_entry(monkeypatch):
    """``lora_by_rank`` replaces ``lora`` at its rank tile only (DeepSeek-V2-Lite M=1 on the H100: GEMM1
    16x128 won at rank 16 and lost at rank 64); it survives the JSON round trip, bad keys are refused."""
    base = MoEConfig(GemmConfig(16, 32, 128, 1, 4, 4), GemmConfig(16, 32, 128, 1, 4, 5))
    lora = MoEConfig(GemmConfig(16, 64, 128, 1, 4, 3), GemmConfig(16, 32, 128, 1, 4, 4))
    rank16 = MoEConfig(GemmConfig(16, 128, 128, 1, 4, 3), GemmConfig(16, 32, 128, 1, 4, 4))
    entry = replace(base, lora=lora, lora_by_rank=((16, rank16),)).to_dict()
    assert entry["lora_by_rank"]["16"]["BLOCK_SIZE_N"] == 128
    parsed = MoEConfig.from_dict(json.loads(json.dumps(entry)))
    assert parsed.for_lora(16) == rank16 and parsed.for_lora(64) == lora and parsed.for_lora() == lora
    assert replace(parsed, lora=None).for_lora(64) == replace(parsed, lora=None)  # no lora: the base's
    monkeypatch.setenv("MOELORA_MOE_CONFIG", json.dumps(entry))
    args = (1, 64, 2048, 1408, 6, torch.bfloat16)
    assert get_moe_config(*args, lora=True, rank_block=16) == rank16
    assert get_moe_config(*args, lora=True, rank_block=64) == lora
    for bad in ({"24": entry["lora"]}, {"8": entry["lora"]}, {"r16": entry["lora"]}):
        with pytest.raises(ValueError, match="rank tiles"):
            MoEConfig.from_dict({**entry, "lora_by_rank": bad})
    with pytest.raises(ValueError, match="lora_by_rank"):
        MoEConfig.from_dict({**entry, "lora_by_rank": {"16": {**entry["lora"], "lora_by_rank": {}}}})
    with pytest.raises(ValueError, match="maps rank tiles"):
        MoEConfig.from_dict({**entry, "lora_by_rank": [entry["lora"]]})


def test_lora_multi_by_rank_entry(monkeypatch):
    """``lora_multi_by_rank`` serves batches of two adapters or more at its rank tile, ahead of
    ``lora_by_rank`` (Qwen3-30B-A3B M=1024 rank 64 on the H100: 64-row tiles won with 4 and 8 adapters, lost
    with one); one adapter or an unknown count (0) keeps the single tiles; it survives the JSON round trip
    and bad keys or nesting are refused."""
    base = MoEConfig(GemmConfig(128, 64, 64, 8, 8, 3), GemmConfig(128, 256, 64, 8, 8, 4))
    rank64 = MoEConfig(GemmConfig(128, 128, 64, 8, 8, 4), GemmConfig(128, 256, 64, 8, 8, 4))
    multi64 = MoEConfig(GemmConfig(64, 64, 64, 8, 4, 4), GemmConfig(64, 128, 64, 8, 4, 4))
    entry = replace(base, lora_by_rank=((64, rank64),), lora_multi_by_rank=((64, multi64),)).to_dict()
    assert entry["lora_multi_by_rank"]["64"]["BLOCK_SIZE_M"] == 64
    parsed = MoEConfig.from_dict(json.loads(json.dumps(entry)))
    assert [parsed.for_lora(64, n) for n in (0, 1, 2, 8)] == [rank64, rank64, multi64, multi64]
    assert parsed.for_lora(16, 4) is parsed  # no LoRA tiles at rank tile 16: the entry's own
    monkeypatch.setenv("MOELORA_MOE_CONFIG", json.dumps(entry))
    args = (1024, 128, 2048, 768, 8, torch.bfloat16)
    assert get_moe_config(*args, lora=True, rank_block=64) == rank64
    assert get_moe_config(*args, lora=True, rank_block=64, num_adapters=4) == multi64
    assert get_moe_config(*args, num_adapters=4) == parsed  # the base path: no LoRA tiles
    with pytest.raises(ValueError, match="rank tiles"):
        MoEConfig.from_dict({**entry, "lora_multi_by_rank": {"48": entry["lora_multi_by_rank"]["64"]}})
    with pytest.raises(ValueError, match="may not hold"):
        MoEConfig.from_dict({**entry, "lora_multi_by_rank": {"64": {**entry["lora_multi_by_rank"]["64"],
                                                                    "lora_by_rank": {}}}})
    with pytest.raises(ValueError, match="may not hold"):
        MoEConfig.from_dict({**entry, "lora": {**entry["lora_by_rank"]["64"], "lora_multi_by_rank": {}}})
    with pytest.raises(ValueError, match="maps rank tiles"):
        MoEConfig.from_dict({**entry, "lora_multi_by_rank": [entry["lora_by_rank"]["64"]]})
    # with_lora_tiles(multi=True) writes (and replaces) only the multi-adapter tiles at their rank tile.
    again = base.with_lora_tiles(rank64, 64).with_lora_tiles(rank64, 64, multi=True)
    again = again.with_lora_tiles(multi64, 64, multi=True)
    assert again == MoEConfig.from_dict(entry)
    with pytest.raises(ValueError, match="rank tile"):
        base.with_lora_tiles(multi64, multi=True)
    with pytest.raises(ValueError, match="may not hold"):
        base.with_lora_tiles(again, 64, multi=True)


def _spy_gemm_launches(monkeypatch) -> list:
    """The GEMM configs fused_experts launches, in order, from here on (the launches still run)."""
    fused_experts_module = importlib.import_module("triton_ops.fused_experts")
    launched = []
    real_invoke = fused_experts_module.invoke_fused_moe_kernel

    def spy(*args, config, **kwargs):
        launched.append(config)
        return real_invoke(*args, config=config, **kwargs)

    monkeypatch.setattr(fused_experts_module, "invoke_fused_moe_kernel", spy)
    return launched


def _split_case(seed: int):
    """40 tokens, top-4 of 4 experts, two adapters of ranks 5 and 16 in a rank-16 pool of 3 slots (fp32):
    test_lora_kernels.make_case's inputs, reference and base reference."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_lora_kernels import make_case

    return make_case(m=40, hidden=64, inter=48, num_experts=4, top_k=4, ranks=(5, 16), max_rank=16,
                     num_slots=3, dtype=torch.float32, gen=torch.Generator().manual_seed(seed))


@pytest.mark.interpreter
def test_split_path_takes_the_multi_adapter_tiles(monkeypatch):
    """The split path asks for the tiles of its batch's adapter count (``lora.num_adapters``, host-known):
    one adapter runs the rank tile's tiles, three the multi-adapter ones; each output matches the
    reference (a tile changes no result)."""
    launched = _spy_gemm_launches(monkeypatch)
    # 40 tokens x top-4 over 4 experts: 40 rows an expert, so 16- and 32-row blocks both see several slots.
    (x, w13, w2), weights, ids, lora, ref, _ = _split_case(seed=7)
    single = MoEConfig(GemmConfig(32, 16, 32, 1, 4, 2), GemmConfig(32, 64, 32, 1, 4, 2))
    multi = MoEConfig(GemmConfig(16, 32, 32, 1, 4, 2), GemmConfig(16, 16, 32, 1, 4, 2))
    config = MoEConfig(GemmConfig(16, 64, 32, 1, 4, 2), GemmConfig(16, 64, 32, 1, 4, 2),
                       lora_by_rank=((16, single),), lora_multi_by_rank=((16, multi),))
    scale = ref.abs().max()
    for hint, tiles in ((1, single), (3, multi)):
        launched.clear()
        out = fused_experts(x, w13, w2, weights, ids, lora=replace(lora, num_adapters=hint),
                            lora_path="split", config=config)
        assert launched == [tiles.gemm1, tiles.gemm2]
        torch.testing.assert_close(out, ref, atol=2e-5 * scale, rtol=1e-4)
    launched.clear()
    monkeypatch.setenv("MOELORA_MOE_CONFIG", json.dumps(config.to_dict()))  # the lookup's path
    fused_experts(x, w13, w2, weights, ids, lora=replace(lora, num_adapters=3), lora_path="split")
    assert launched == [multi.gemm1, multi.gemm2]


@pytest.mark.interpreter
def test_split_path_launches_the_lora_tiles(monkeypatch):
    """A config with a ``lora`` entry: the split LoRA path runs its tiles (alignment and both GEMMs), the
    base path the entry's own; both outputs still match the reference."""
    launched = _spy_gemm_launches(monkeypatch)
    (x, w13, w2), weights, ids, lora, ref, base_ref = _split_case(seed=5)
    base_tiles = MoEConfig(GemmConfig(16, 32, 32, 1, 4, 2), GemmConfig(16, 32, 32, 1, 4, 2))
    lora_tiles = MoEConfig(GemmConfig(32, 16, 32, 1, 4, 2), GemmConfig(32, 64, 32, 1, 4, 2))
    config = replace(base_tiles, lora=lora_tiles)
    scale = ref.abs().max()
    out = fused_experts(x, w13, w2, weights, ids, lora=lora, lora_path="split", config=config)
    assert launched == [lora_tiles.gemm1, lora_tiles.gemm2]
    torch.testing.assert_close(out, ref, atol=2e-5 * scale, rtol=1e-4)
    launched.clear()
    out = fused_experts(x, w13, w2, weights, ids, config=config)
    assert launched == [base_tiles.gemm1, base_tiles.gemm2]
    torch.testing.assert_close(out, base_ref, atol=2e-5 * scale, rtol=1e-4)


@pytest.mark.interpreter
def test_lora_tuner_search(monkeypatch):
    """tune_moe.py --lora-rank: the search keeps the best of the layer timings it asks for (a fake timer
    here: the tuner times on a GPU), per BLOCK_SIZE_M GEMM1 first, then GEMM2; its adapters run."""
    import tune_moe

    gen = torch.Generator().manual_seed(3)
    num_experts, top_k, hidden, inter, m = 4, 4, 64, 48, 40
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    lora = tune_moe.lora_inputs(m, w13, 16, 3, gen)
    x = torch.randn(m, hidden, generator=gen)
    weights, ids = torch.topk(torch.softmax(torch.randn(m, num_experts, generator=gen), -1), top_k, -1)
    with_lora = fused_experts(x, w13, w2, weights, ids.int(), lora=lora, lora_path="split")
    assert (with_lora - fused_experts(x, w13, w2, weights, ids.int())).abs().max() > 1e-3

    def small_candidates(num_tokens, k, e, gemm):
        return [GemmConfig(bm, bn, 32, 1, 4, 2) for bm in (16, 32) for bn in (16, 32)]

    seen = []
    monkeypatch.setattr(tune_moe, "candidates", small_candidates)
    monkeypatch.setattr(tune_moe, "fused_experts", lambda *args, config, **kwargs: seen.append(config))

    def cost(cfg):  # fastest: 32-row blocks, GEMM1 16 wide, GEMM2 32 wide
        return 10.0 + (cfg.block_m != 32) + (cfg.gemm1.block_n != 16) + 0.5 * (cfg.gemm2.block_n != 32)

    def fake_timer(fn):
        fn()
        return cost(seen[-1])

    base = MoEConfig(GemmConfig(16, 32, 32, 1, 4, 2), GemmConfig(16, 16, 32, 1, 4, 2))
    best, best_us, base_us = tune_moe.tune_lora_point(m, w13, w2, top_k, base, 16, 3, gen, timer=fake_timer)
    assert base_us == cost(base) and best_us == 10.0 == cost(best)
    assert best == MoEConfig(GemmConfig(32, 16, 32, 1, 4, 2), GemmConfig(32, 32, 32, 1, 4, 2))


def test_with_lora_tiles_by_rank_and_as_lora():
    """MoEConfig.with_lora_tiles (tune_moe.py --lora-by-rank, lora_tile_sweep.py --write-dir): tiles go under
    their rank tile, replacing only that one, or (rank tile 0) become the entry's "lora"."""
    base = MoEConfig(GemmConfig(16, 32, 128, 1, 4, 4), GemmConfig(16, 32, 128, 1, 4, 5))
    lora = MoEConfig(GemmConfig(16, 64, 128, 1, 4, 3), GemmConfig(16, 32, 128, 1, 4, 4))
    wide = MoEConfig(GemmConfig(16, 128, 128, 1, 4, 3), GemmConfig(16, 32, 128, 1, 4, 4))
    entry = base.with_lora_tiles(lora).with_lora_tiles(lora, 64)
    entry = entry.with_lora_tiles(base, 16).with_lora_tiles(wide, 16)
    assert entry.lora_by_rank == ((16, wide), (64, lora)) and entry.lora == lora
    assert MoEConfig.from_dict(entry.to_dict()).for_lora(16) == wide
    as_lora = entry.with_lora_tiles(wide)
    assert as_lora.for_lora(32) == wide and as_lora.for_lora(64) == lora
    with pytest.raises(ValueError, match="may not hold"):
        base.with_lora_tiles(entry, 16)


@pytest.mark.interpreter
def test_ab_env_runs_b_under_its_switches(monkeypatch, capsys):
    """benchmarks/ab_env.py (dry run, interpreter): B's launches see --env, A's and base's the launch
    overrides as they were, which are restored afterwards. M=80 x top-2: 160 pairs, the prefill split path
    with its epilogue prefetch decision; 3 adapters: blocks with several slots."""
    import ab_env

    import triton_ops.plan as plan_module

    seen = []
    real = plan_module.lora_prefetch_pays

    def spy(*args, **kwargs):
        seen.append(LAUNCH_OVERRIDES.get("lora_prefetch"))
        return real(*args, **kwargs)

    monkeypatch.setattr(plan_module, "lora_prefetch_pays", spy)
    monkeypatch.delitem(LAUNCH_OVERRIDES, "lora_prefetch", raising=False)
    assert ab_env.main(["--dry-run", "--env", "lora_prefetch=0", "--M", "80", "--adapters", "3",
                        "--rounds", "2"]) == 0
    assert "lora_prefetch" not in LAUNCH_OVERRIDES
    # Two rounds x two timed calls (the dry run's median of two) of A and of B, two split-path GEMMs each.
    assert seen.count("0") == seen.count(None) == 8
    table = capsys.readouterr().out
    assert "B: lora_prefetch=0" in table and "| tiny | 80 | 16 | 3 |" in table
    with pytest.raises(SystemExit, match="NAME=VALUE"):
        ab_env.parse_env(["lora_prefetch"])


def test_lora_tile_sweep_candidates():
    """benchmarks/lora_tile_sweep.py: every candidate differs from the current tiles, keeps its GROUP_SIZE_M,
    and both GEMMs of a candidate share one BLOCK_M (one alignment feeds them). M=64: 16-row tiles, where a
    GEMM2 candidate equal to the current one must drop out; M=256: a 16- and a 64-row GEMM1 candidate
    change GEMM2's BLOCK_M too; M=4096: 128-row tiles."""
    import lora_tile_sweep

    cases = {
        64: MoEConfig(GemmConfig(16, 32, 256, 1, 4, 5), GemmConfig(16, 32, 128, 1, 4, 5)),
        256: MoEConfig(GemmConfig(32, 64, 128, 8, 4, 4), GemmConfig(32, 128, 128, 8, 4, 3)),
        4096: MoEConfig(GemmConfig(128, 64, 64, 8, 4, 3), GemmConfig(128, 256, 64, 8, 8, 4)),
    }
    for m, current in cases.items():
        configs = lora_tile_sweep.candidate_configs(m, current)
        assert configs.pop("current") == current
        assert configs and current not in configs.values()
        for label, cfg in configs.items():
            assert cfg.gemm1.block_m == cfg.gemm2.block_m, label
            changed = cfg.gemm1 if label.startswith("gemm1") else cfg.gemm2
            kept = cfg.gemm2 if label.startswith("gemm1") else cfg.gemm1
            assert changed.group_m == (current.gemm1 if label.startswith("gemm1") else current.gemm2).group_m
            if label.startswith("gemm2"):
                assert kept == current.gemm1
            else:
                assert kept == replace(current.gemm2, block_m=cfg.gemm1.block_m)
    assert "gemm2 16x32x128 w4 s5" not in lora_tile_sweep.candidate_configs(64, cases[64])
    small = lora_tile_sweep.candidate_configs(256, cases[256])
    assert small["gemm1 64x64x64 w4 s3"].gemm2.block_m == 64


def test_lora_tile_sweep_picks_by_the_worst_adapter_count():
    """lora_tile_sweep.py --write-dir: the winner is judged at its worst adapter count, must beat the current
    tiles' worst by --min-gain, and must have run at every count."""
    import lora_tile_sweep

    runs = {1: {"current": 0.10, "a": 0.07, "b": 0.05, "c": 0.01},
            4: {"current": 0.20, "a": 0.17, "b": 0.19}}  # c could not run with 4 adapters
    assert lora_tile_sweep.pick_winner(runs, 0.01) == "a"  # b is better with 1 adapter, a at its worst
    assert lora_tile_sweep.pick_winner(runs, 0.05) is None  # a gains 3 points, not 5
    assert lora_tile_sweep.pick_winner({1: {"current": 0.1, "a": 0.2}}, 0.0) is None


def test_lora_tile_sweep_records_into_a_copy(tmp_path):
    """lora_tile_sweep.py --write-dir: the file is copied from the tuned one, the winner goes into the entry
    the lookup takes for that M (the nearest; ties to the smaller M), under its rank tile or as "lora",
    and the tuned file itself is left alone."""
    import lora_tile_sweep

    base = MoEConfig(GemmConfig(16, 32, 128, 1, 4, 4), GemmConfig(16, 32, 128, 1, 4, 5))
    prefill = MoEConfig(GemmConfig(128, 64, 64, 8, 8, 3), GemmConfig(128, 128, 64, 8, 8, 3))
    wide = MoEConfig(GemmConfig(128, 128, 64, 8, 8, 4), GemmConfig(128, 256, 64, 8, 8, 4))
    source = tmp_path / "tuned" / "f.json"
    source.parent.mkdir()
    source.write_text(json.dumps({"1": base.to_dict(), "1024": prefill.to_dict()}, indent=1) + "\n")
    before = source.read_text()
    out = tmp_path / "cand" / "f.json"
    assert lora_tile_sweep.record_lora_tiles(out, source, 900, wide, 16, base) == (
        "1024", prefill.with_lora_tiles(wide, 16))
    # 512 is as far from 1 as from 1024: the lookup takes the smaller M, and so does the sweep.
    assert lora_tile_sweep.record_lora_tiles(out, source, 512, wide, 0, base)[0] == "1"
    written = {m: MoEConfig.from_dict(entry) for m, entry in json.loads(out.read_text()).items()}
    assert written["1024"] == prefill.with_lora_tiles(wide, 16) and written["1"] == base.with_lora_tiles(wide)
    assert source.read_text() == before
    # No tuned file to start from: one entry at the swept M, the base tiles given.
    fresh = tmp_path / "fresh" / "f.json"
    assert lora_tile_sweep.record_lora_tiles(fresh, tmp_path / "none.json", 64, wide, 64, base)[0] == "64"
    assert MoEConfig.from_dict(json.loads(fresh.read_text())["64"]).for_lora(64) == wide
    # --multi: the winner goes under "lora_multi_by_rank", the single tiles of the entry stay.
    key, entry = lora_tile_sweep.record_lora_tiles(out, source, 1024, base, 16, base, multi=True)
    assert key == "1024" and entry.for_lora(16, 4) == base and entry.for_lora(16, 1) == wide



def test_lora_tile_sweep_refuses_multi_without_several_adapters():
    """--multi sweeps the tiles of batches with several adapters: a one-adapter count, or --as-lora (which
    has no rank tile to hold them), is refused with a message before anything runs (no GPU needed)."""
    import lora_tile_sweep

    with pytest.raises(SystemExit, match="--adapters must all be >= 2, got \\[1, 4\\]"):
        lora_tile_sweep.main(["--multi", "--adapters", "1", "4"])
    with pytest.raises(SystemExit, match="does not go with --as-lora"):
        lora_tile_sweep.main(["--multi", "--adapters", "4", "8", "--as-lora"])

def test_launch_overrides(monkeypatch):
    """Overrides force a launch rule (to compare on a GPU): unset, the rule's value; a value it takes, that
    value; anything else, or an unknown name, a ValueError naming the override and what it expects."""
    from triton_ops import overrides
    from triton_ops.fused_experts import MAX_DECODE_DOWN_PARTIALS, decode_down_partials_limit

    monkeypatch.delitem(LAUNCH_OVERRIDES, "decode_down_partials", raising=False)
    assert overrides.count("decode_down_partials") is None
    assert decode_down_partials_limit() == MAX_DECODE_DOWN_PARTIALS
    monkeypatch.setitem(LAUNCH_OVERRIDES, "decode_down_partials", "32")
    assert decode_down_partials_limit() == 32
    monkeypatch.setitem(LAUNCH_OVERRIDES, "decode_down_partials", "-1")
    with pytest.raises(ValueError, match="decode_down_partials must be a non-negative integer, got '-1'"):
        decode_down_partials_limit()
    monkeypatch.delitem(LAUNCH_OVERRIDES, "decode_down_partials")
    with pytest.raises(ValueError, match="unknown launch override 'lora_exp'"):
        overrides.parse(["lora_exp=1"])
    with pytest.raises(ValueError, match="launch override lora_ext must be 0, 1, gemm1 or gemm2, got 'on'"):
        overrides.parse(["lora_ext=on"])
    with pytest.raises(ValueError, match="NAME=VALUE"):
        overrides.parse(["lora_ext"])
    with overrides.applied({"lora_ext": "gemm2"}):
        assert overrides.value("lora_ext") == "gemm2"
    assert "lora_ext" not in LAUNCH_OVERRIDES


def test_environment_variables_are_few():
    """The library reads at most six environment variables (docs/architecture.md lists them); launch
    variants are launch overrides, not variables."""
    root = Path(__file__).resolve().parents[1]
    names = set()
    for folder in ("moelora", "triton_ops", "tests"):
        for source in (root / folder).rglob("*.py"):
            names |= set(re.findall(r"MOELORA_[A-Z0-9_]+", source.read_text()))
    assert names <= {"MOELORA_MOE_CONFIG", "MOELORA_MOE_CONFIG_DIR", "MOELORA_CACHE_DIR",
                     "MOELORA_NATIVE_LAUNCH", "MOELORA_LAUNCH_TRACE", "MOELORA_STORM_SECONDS"}, names
    table = (root / "docs" / "architecture.md").read_text()
    assert all(f"`{name}`" in table for name in names), names
