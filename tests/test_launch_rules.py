"""The launch rules see a batch's adapter count through ``launch_adapter_count``: for every count they
decide the same as for the exact one, so batches that differ only there share launches, traces and graphs."""

from __future__ import annotations

import importlib
import itertools

import pytest

pytest.importorskip("triton")

from triton_ops.configs import GemmConfig, MoEConfig  # noqa: E402

# The modules, not the functions triton_ops exports under their names.
fe = importlib.import_module("triton_ops.fused_experts")
fm = importlib.import_module("triton_ops.fused_moe")
plan = importlib.import_module("triton_ops.plan")
RANK_BLOCKS = (16, 32, 64)
COUNTS = range(0, 100)
TILES = [GemmConfig(m, n, 64, num_warps=w, num_stages=s)
         for m, n, w, s in ((16, 64, 4, 4), (32, 128, 4, 3), (64, 64, 4, 3), (64, 128, 8, 3),
                            (128, 128, 8, 3), (128, 256, 8, 3))]


def _rules(n: int) -> list:
    """Every decision the launches take from the adapter count ``n``."""
    decisions = []
    multi = MoEConfig(TILES[0], TILES[0], lora_by_rank=((16, MoEConfig(TILES[1], TILES[1])),),
                      lora_multi_by_rank=((16, MoEConfig(TILES[2], TILES[2])),))
    for rank_block in RANK_BLOCKS:
        decisions.append(multi.for_lora(rank_block, n))
        for rows in (1, 3, 16, 64):
            decisions.append(fm.lora_slot_group(rank_block, n, rows))
        decisions.append(fm.lora_ext_cols(rank_block, n))
        shrinks = itertools.product((64, 1024, 4096, 16384), (8, 512), (768, 8192))
        for pairs, row_programs, longest_k in shrinks:
            decisions.append(fe.one_split_shrink(pairs, rank_block, n, row_programs, longest_k))
        for tile, gated, k in itertools.product(TILES, (False, True), (768, 14336)):
            decisions.append(fm.lora_tile_slot_group(tile, rank_block, n, 64, gated=gated, K=k))
            decisions.append(fm.lora_ext_expand(tile, gated=gated, num_adapters=n, K=k))
            for numel in (8, 4096):
                decisions.append(fm.lora_prefetch_pays(tile, numel=numel, num_adapters=n,
                                                       rank_block=rank_block))
    for longest_k, pairs, one_pass in itertools.product((768, 8192), (512, 4096), (False, True)):
        decisions.append(fe.slot_program_shrink(n, longest_k, pairs, one_pass))
    decisions.append(plan.lora_by_adapter(n))
    for rows in (1, 256, 1024, 4096):
        decisions.append(plan.auto_path_needs_trained_share(rows, n))
        for share in (0.05, 0.125, 0.5, 1.0):
            decisions.append(plan.auto_lora_path(rows, n, share))
    return decisions


@pytest.mark.parametrize("n", COUNTS)
def test_rules_decide_the_same_for_the_planned_count(n):
    planned = fm.launch_adapter_count(n)
    assert _rules(planned) == _rules(n), (n, planned)
    # The slot-program shrink runs min(count, rows) programs a block: with the planned count a few more,
    # which find no slot left and end (the last one takes whatever the others left: complete either way).
    assert planned >= min(n, 64)


def test_planned_counts_are_few():
    assert sorted({fm.launch_adapter_count(n) for n in COUNTS}) == [0, 1, 2, 3, 4, 8, 16, 32, 64]


@pytest.mark.parametrize("n", COUNTS)
def test_trained_share_is_asked_for_exactly_where_it_can_change_the_path(n):
    for rows in (1, 255, 256, 1023, 1024, 4096):
        differs = plan.auto_lora_path(rows, n, 0.0) != plan.auto_lora_path(rows, n, 1.0)
        assert plan.auto_path_needs_trained_share(rows, n) == differs, (rows, n)
