"""The LoRA kernels through ``fused_experts(lora=...)`` with forced launch configs, against the pool-layout
reference: covers tile shapes the layer's default configs never pick at test sizes (large BLOCK_N, which
makes the split path expand in 16-column rank chunks) and split-K shrinks with several partials."""

import importlib
from dataclasses import replace

import pytest
import torch

from moelora.reference import reference_moe_from_pool
from triton_ops import MoEConfig
from triton_ops.configs import GemmConfig
from triton_ops.decode_shrink import (
    decode_shrink_splits,
    moe_align_with_gate_up_shrink,
    one_token_down_shrink,
)
from triton_ops.fused_experts import MoELoRAInputs, fused_experts
from triton_ops.fused_moe import lora_slot_group
from triton_ops.moe_align import SINGLE_PROGRAM_MAX_PAIRS, moe_align_block_size
from triton_ops.moe_lora import moe_lora_a, shrink_k_splits
from triton_ops.overrides import LAUNCH_OVERRIDES

PATHS = ("fused", "split", "staged")
# The module (the package re-exports the function under the same name).
fused_experts_module = importlib.import_module("triton_ops.fused_experts")


def make_case(m, hidden, inter, num_experts, top_k, ranks, max_rank, num_slots, dtype, gen):
    x = torch.randn(m, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(m)]).int()
    weights = torch.rand(m, top_k, generator=gen)
    r = max_rank
    gate_up_a = torch.zeros(num_slots, num_experts, 2 * r, hidden)
    gate_up_b = torch.zeros(num_slots, num_experts, 2 * inter, r)
    down_a = torch.zeros(num_slots, num_experts, r, inter)
    down_b = torch.zeros(num_slots, num_experts, hidden, r)
    for slot, rank in enumerate(ranks):
        gate_up_a[slot, :, :rank] = torch.randn(num_experts, rank, hidden, generator=gen) / hidden**0.5
        gate_up_a[slot, :, r:r + rank] = torch.randn(num_experts, rank, hidden, generator=gen) / hidden**0.5
        gate_up_b[slot, :, :, :rank] = torch.randn(num_experts, 2 * inter, rank, generator=gen) / rank**0.5
        down_a[slot, :, :rank] = torch.randn(num_experts, rank, inter, generator=gen) / inter**0.5
        down_b[slot, :, :, :rank] = torch.randn(num_experts, hidden, rank, generator=gen) / rank**0.5
    slot_ranks = torch.tensor(list(ranks) + [0] * (num_slots - len(ranks)), dtype=torch.int32)
    scalings = torch.linspace(0.5, 2.0, num_slots)
    slots = torch.randint(-1, len(ranks), (m,), generator=gen, dtype=torch.int32)
    ref = reference_moe_from_pool(x, w13, w2, weights, ids, slots, gate_up_a, gate_up_b, down_a, down_b,
                                  slot_ranks, scalings)
    base = reference_moe_from_pool(x, w13, w2, weights, ids, torch.full_like(slots, -1), gate_up_a,
                                   gate_up_b, down_a, down_b, slot_ranks, scalings)
    cast = [t.to(dtype) for t in (x, w13, w2, gate_up_a, gate_up_b, down_a, down_b)]
    lora = MoELoRAInputs(slots, *cast[3:], slot_ranks, scalings, max(ranks))
    return cast[:3], weights, ids, lora, ref, base


def assert_matches_reference(out, ref, base):
    """fp32 kernels against the fp32 reference; the adapters must change the output by over 10 % of its
    scale, so a kernel that drops the LoRA delta cannot pass."""
    scale = ref.abs().max()
    assert (ref - base).abs().max() > 0.1 * scale
    torch.testing.assert_close(out, ref, atol=2e-5 * scale, rtol=1e-4)


@pytest.mark.interpreter
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "block_m,block_n,warps",
    [
        (16, 32, 4),  # two GEMM1 N tiles of I=40 (the last ragged): two down partials per pair
        (32, 256, 4),  # 32x256 > 32x128: the split path expands 16 rank columns at a time
        (32, 16, 1),  # three down partials, one warp: the partial sums go one split per 3-D load
    ],
)
def test_forced_tiles_and_rank_chunks(path, block_m, block_n, warps):
    gen = torch.Generator().manual_seed(7)
    # H=100: four fp32 K tiles of 32 with a ragged tail, so shrinks split K into several partials;
    # ranks 3 and 29 in a max-rank-32 pool: two rank chunks, the second one partly past a rank.
    (x, w13, w2), weights, ids, lora, ref, base = make_case(
        m=9, hidden=100, inter=40, num_experts=5, top_k=2, ranks=(29, 3), max_rank=32, num_slots=3,
        dtype=torch.float32, gen=gen,
    )
    assert shrink_k_splits(9 * 2 + 5 * (block_m - 1), block_m, 100, block_k=32) > 1
    gemm = GemmConfig(block_m, block_n, 32, 1, warps, 2)
    out = fused_experts(x, w13, w2, weights, ids, lora=lora, lora_path=path, config=MoEConfig(gemm, gemm))
    assert_matches_reference(out, ref, base)


@pytest.mark.interpreter
def test_rank_chunks_past_a_slots_rank():
    """The split epilogue's 16-column rank chunks, those past a slot's rank branched around: ranks 29 and
    3 in a max-rank-32 pool on 32x256 tiles (rank 3 skips its second chunk, 29 runs both)."""
    gen = torch.Generator().manual_seed(17)
    (x, w13, w2), weights, ids, lora, ref, base = make_case(
        m=9, hidden=100, inter=40, num_experts=5, top_k=2, ranks=(29, 3), max_rank=32, num_slots=3,
        dtype=torch.float32, gen=gen,
    )
    gemm = GemmConfig(32, 256, 32, 1, 4, 2)
    out = fused_experts(x, w13, w2, weights, ids, lora=lora, lora_path="split", config=MoEConfig(gemm, gemm))
    assert_matches_reference(out, ref, base)


@pytest.mark.interpreter
def test_down_shrink_without_gemm1_epilogue(monkeypatch):
    """Decode past MAX_DOWN_PARTIALS GEMM1 tiles: GEMM2's shrink gets its own launch (forced here with a
    limit of 1 on two GEMM1 tiles, and none for few-pair batches), beside the gate/up shrink in the
    alignment's launch."""
    path = "split"
    monkeypatch.setattr(fused_experts_module, "MAX_DOWN_PARTIALS", 1)
    monkeypatch.setattr(importlib.import_module("triton_ops.plan"), "MAX_DECODE_DOWN_PARTIALS", 0)
    launches = []
    shrink = fused_experts_module.moe_lora_a
    monkeypatch.setattr(fused_experts_module, "moe_lora_a",
                        lambda *args, **kwargs: launches.append(kwargs["gated"]) or shrink(*args, **kwargs))
    gen = torch.Generator().manual_seed(11)
    (x, w13, w2), weights, ids, lora, ref, base = make_case(
        m=7, hidden=64, inter=40, num_experts=4, top_k=2, ranks=(5, 16), max_rank=16, num_slots=3,
        dtype=torch.float32, gen=gen,
    )
    gemm = GemmConfig(16, 32, 32, 1, 4, 2)
    out = fused_experts(x, w13, w2, weights, ids, lora=lora, lora_path=path, config=MoEConfig(gemm, gemm))
    assert launches == [False], "the down shrink must be a launch of its own here"
    assert_matches_reference(out, ref, base)


@pytest.mark.interpreter
@pytest.mark.parametrize("one_wave,prefetch", [(True, True), (False, True), (True, False)])
def test_decode_down_shrink_with_and_without_prefetch(monkeypatch, one_wave, prefetch):
    """Decode on the split path: GEMM1's epilogue writes GEMM2's shrink; the first slot's down-A tile is
    prefetched before the K-loop only when the grid fits one wave (forced both ways here), and none of the
    epilogue operands are with lora_prefetch=0. Three slots (ranks 5, 16, 9) and rows without an
    adapter share 16-row blocks, so the prefetched slot is followed by slots loaded in the epilogue."""
    monkeypatch.setattr(importlib.import_module("triton_ops.plan"), "_fits_one_wave",
                        lambda programs, device: one_wave)
    if not prefetch:
        monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_prefetch", "0")
    gen = torch.Generator().manual_seed(12)
    (x, w13, w2), weights, ids, lora, ref, base = make_case(
        m=9, hidden=64, inter=48, num_experts=3, top_k=2, ranks=(5, 16, 9), max_rank=16, num_slots=4,
        dtype=torch.float32, gen=gen,
    )
    assert (lora.token_slots < 0).any()
    gemm = GemmConfig(16, 32, 32, 1, 4, 2)
    out = fused_experts(x, w13, w2, weights, ids, lora=lora, lora_path="split", config=MoEConfig(gemm, gemm))
    assert_matches_reference(out, ref, base)


@pytest.mark.interpreter
@pytest.mark.parametrize("path", ["fused", "split", "staged"])
@pytest.mark.parametrize(
    "ranks",
    [
        (16, 6),
        # Six adapters of rank <= 16 over 7 experts: blocks hold more slots than moe_lora_a's group of
        # 64 // 16 = 4, so its shrink walks K twice (two slot groups), one of them partly empty.
        (3, 16, 5, 9, 12, 7),
    ],
)
# None: the default config (32-row tiles: the split epilogue prefetches the first slot group); 64x32
# tiles: no prefetch, every row's partials in one load after the K-loop, then a dot per slot group;
# 128x64 ("big" tiles): GEMM1 expands a slot at a time, GEMM2 two slots per dot.
@pytest.mark.parametrize("tile", [None, (64, 32), (128, 64)], ids=str)
def test_prefill_sized_batch(path, ranks, tile):
    """67 tokens x top-2 = 134 pairs: past SINGLE_PROGRAM_MAX_PAIRS, so the three-launch alignment and
    (split) moe_lora_a's gate/up shrink run instead of the decode launch."""
    gen = torch.Generator().manual_seed(5)
    (x, w13, w2), weights, ids, lora, ref, base = make_case(
        m=67, hidden=48, inter=40, num_experts=7, top_k=2, ranks=ranks, max_rank=16, num_slots=len(ranks),
        dtype=torch.float32, gen=gen,
    )
    assert 67 * 2 > SINGLE_PROGRAM_MAX_PAIRS
    config = None
    if tile is not None:
        gemm = GemmConfig(*tile, 32, 1, 4, 2)
        config = MoEConfig(gemm, gemm)
    out = fused_experts(x, w13, w2, weights, ids, lora=lora, lora_path=path, config=config)
    assert_matches_reference(out, ref, base)


def test_big_tile_slot_group_rule():
    from triton_ops.fused_moe import lora_tile_slot_group

    big = GemmConfig(128, 256, 64, 8, 8, 3)  # GEMM2 at M=4096
    small = GemmConfig(16, 64, 64, 1, 4, 3)  # decode tile: the whole stacked group
    assert lora_tile_slot_group(small, 16, 4, 16, gated=False, K=14336) == 4
    assert lora_tile_slot_group(big, 16, 4, 128, gated=False, K=1536) == 2  # DeepSeek-V2's short K
    assert lora_tile_slot_group(big, 16, 4, 128, gated=False, K=14336) == 1  # Mixtral's long K
    assert lora_tile_slot_group(big, 16, 4, 128, gated=True, K=1536) == 1  # two accumulators
    assert lora_tile_slot_group(big, 16, 1, 128, gated=False, K=1536) == 1  # one adapter
    assert lora_tile_slot_group(big, 64, 4, 128, gated=False, K=1536) == 1  # 64 rank columns already


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_align_with_gate_up_shrink(dtype):
    """The decode launch: program 0's alignment equals ``moe_align_block_size`` bit for bit, and the
    shrink partials sum to A_gate/up x per pair (ranks 5 and 16 in a max-rank-24 pool read with a rank
    tile of 16; tokens without an adapter are left unwritten)."""
    gen = torch.Generator().manual_seed(3)
    m, hidden, num_experts, top_k, pool_rank, rank_block = 5, 300, 6, 3, 24, 16
    x = torch.randn(m, hidden, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(m)]).int()
    gate_up_a = torch.randn(3, num_experts, 2 * pool_rank, hidden, generator=gen).to(dtype)
    slots = torch.tensor([0, -1, 2, 0, 2], dtype=torch.int32)
    ranks = torch.tensor([5, 0, 16], dtype=torch.int32)
    splits = decode_shrink_splits(m * top_k, hidden, 64)
    assert splits > 1  # 300 = 4 K tiles of 64 + a ragged one
    out = torch.full((m * top_k, splits, 2 * rank_block), float("nan"))
    got = moe_align_with_gate_up_shrink(ids, 16, num_experts, x, gate_up_a, slots, ranks,
                                        rank_block=rank_block, out=out)
    for g, e in zip(got, moe_align_block_size(ids, 16, num_experts), strict=True):
        assert torch.equal(g, e)
    summed = out.sum(1)
    for p in range(m * top_k):
        slot = int(slots[p // top_k])
        if slot < 0:
            assert out[p].isnan().all()
            continue
        rank, a = int(ranks[slot]), gate_up_a[slot, ids.view(-1)[p]].float()
        expected = torch.zeros(2 * rank_block)
        expected[:rank] = a[:rank] @ x[p // top_k].float()
        expected[rank_block:rank_block + rank] = a[pool_rank:pool_rank + rank] @ x[p // top_k].float()
        torch.testing.assert_close(summed[p], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
# top-k 1, 2, 6, 8; slot 2 (rank 16) in a max-rank-24 pool read with a rank tile of 16 (the columns past a
# real rank must come out 0), slot 0 (rank 5), and no adapter (rows left unwritten). I=300: four K tiles
# of 64 plus a ragged one.
@pytest.mark.parametrize("top_k", [1, 2, 6, 8])
@pytest.mark.parametrize("slot", [0, 2, -1])
def test_one_token_down_shrink(dtype, top_k, slot):
    """One token's down shrink without an alignment: the partials sum to A_down h per routed pair."""
    gen = torch.Generator().manual_seed(top_k)
    inter, num_experts, pool_rank, rank_block = 300, 9, 24, 16
    ids = torch.randperm(num_experts, generator=gen)[:top_k].int().view(1, top_k)
    activated = torch.randn(top_k, inter, generator=gen).to(dtype)
    down_a = torch.randn(3, num_experts, pool_rank, inter, generator=gen).to(dtype)
    slots = torch.tensor([slot], dtype=torch.int32)
    ranks = torch.tensor([5, 0, 16], dtype=torch.int32)
    splits = decode_shrink_splits(top_k, inter, 64)
    assert splits > 1
    out = torch.full((top_k, splits, rank_block), float("nan"))
    one_token_down_shrink(activated, down_a, ids, slots, ranks, rank_block=rank_block, out=out)
    if slot < 0:
        assert out.isnan().all()
        return
    rank = int(ranks[slot])
    for p in range(top_k):
        expected = torch.zeros(rank_block)
        expected[:rank] = down_a[slot, ids[0, p], :rank].float() @ activated[p].float()
        torch.testing.assert_close(out[p].sum(0), expected, atol=1e-4, rtol=1e-4)


def test_one_token_down_splits_rule():
    from triton_ops.decode_shrink import one_token_down_splits

    assert one_token_down_splits(2, 14336, 16, 128) == 8  # Mixtral rank 16: the decode rule's 8
    assert one_token_down_splits(2, 14336, 64, 128) == 28  # rank 64: 32K elements of A a program
    assert one_token_down_splits(6, 1408, 64, 128) == 8  # DeepSeek-V2-Lite rank 64: the decode rule
    assert one_token_down_splits(2, 300, 64, 128) == 3  # never more splits than K tiles
    assert one_token_down_splits(1, 10**6, 64, 128) == 32  # at most DOWN_GEMV_MAX_SPLITS


def test_one_token_down_shrink_rejects_bad_operands():
    activated, down_a = torch.zeros(2, 40), torch.zeros(3, 9, 16, 40)
    ids, slots, ranks = torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), torch.ones(3)
    out = torch.zeros(2, 1, 16)
    with pytest.raises(ValueError, match=r"one token's topk_ids \(1, top_k\)"):
        one_token_down_shrink(activated, down_a, ids.view(2, 1), slots, ranks, rank_block=16, out=out)
    with pytest.raises(ValueError, match="a row per routed pair"):
        one_token_down_shrink(activated[:1], down_a, ids, slots, ranks, rank_block=16, out=out)
    with pytest.raises(ValueError, match=r"down_a must have 40 columns \(activated's\), got 20"):
        one_token_down_shrink(activated, down_a[..., :20], ids, slots, ranks, rank_block=16, out=out)
    with pytest.raises(ValueError, match=r"out must be fp32 \(2, splits, 16\)"):
        one_token_down_shrink(activated, down_a, ids, slots, ranks, rank_block=16, out=out[..., :8])
    with pytest.raises(ValueError, match="sm_90"):
        one_token_down_shrink(activated, down_a, ids, slots, ranks, rank_block=16, out=out, release_next=True)


@pytest.mark.interpreter
@pytest.mark.parametrize("block_m", [None, 64])
# 4: the shrinks run a program per slot (``slot_program_shrink``), four programs for blocks of up to six.
@pytest.mark.parametrize("hint", [1, 4])
def test_adapter_count_hint_is_only_a_hint(block_m, hint):
    """``num_adapters`` sizes the slot groups; a stale hint (1 or 4, with six adapters in the batch: a CUDA
    graph captured for one mapping and replayed with another) costs speed, never correctness."""
    gen = torch.Generator().manual_seed(9)
    (x, w13, w2), weights, ids, lora, ref, base = make_case(
        m=67, hidden=48, inter=40, num_experts=7, top_k=2, ranks=(3, 16, 5, 9, 12, 7), max_rank=16,
        num_slots=6, dtype=torch.float32, gen=gen,
    )
    config = None
    if block_m is not None:
        gemm = GemmConfig(block_m, 32, 32, 1, 4, 2)
        config = MoEConfig(gemm, gemm)
    out = fused_experts(x, w13, w2, weights, ids, lora=replace(lora, num_adapters=hint), lora_path="split",
                        config=config)
    scale = ref.abs().max()
    torch.testing.assert_close(out, ref, atol=2e-5 * scale, rtol=1e-4)


def test_slot_group_rule():
    assert lora_slot_group(16, 0, 64) == 4  # unknown adapter count: 64 stacked rank columns
    assert lora_slot_group(16, 1, 64) == 1  # one adapter: nothing to stack
    assert lora_slot_group(16, 3, 64) == 4  # three adapters: the next power of two
    assert lora_slot_group(16, 8, 1) == 1  # decode: one row per block holds one slot
    assert lora_slot_group(32, 8, 64) == 2 and lora_slot_group(64, 8, 64) == 1


def test_moe_lora_a_launch_overrides_are_checked():
    """A sub-block that does not divide the alignment's block would mix experts in one program."""
    ids = torch.tensor([[0, 1], [1, 2]], dtype=torch.int32)
    sorted_ids, expert_ids, num_post_padded = moe_align_block_size(ids, 32, 3)
    with pytest.raises(ValueError, match="sub_block_m 48 must divide the alignment's block_m 32"):
        moe_lora_a(torch.zeros(2, 8), torch.zeros(1, 3, 32, 8), torch.zeros(2, dtype=torch.int32),
                   torch.zeros(1, dtype=torch.int32), sorted_ids=sorted_ids, expert_ids=expert_ids,
                   num_post_padded=num_post_padded, block_m=32, top_k=2, x_row_div=2, rank_block=16,
                   gated=True, out=torch.zeros(4, 1, 32), sub_block_m=48)


@pytest.mark.interpreter
# 140 rows: a row per program; 1030 rows of width 16: 4 rows per program, the last one ragged (2 rows);
# widths 32 (rank-16 gate/up) and 16 (rank-16 down); 1 split: nothing to sum, the view alone.
@pytest.mark.parametrize("numel,splits,width", [(140, 3, 32), (1030, 5, 16), (8, 1, 32)])
def test_reduce_shrink_splits_in_place(numel, splits, width):
    from triton_ops.shrink_reduce import reduce_block_rows, reduce_shrink_splits

    gen = torch.Generator().manual_seed(3)
    top_k = 2
    slots = torch.randint(-1, 3, (numel // top_k,), generator=gen, dtype=torch.int32)
    partials = torch.randn(numel, splits, width, generator=gen)
    expected = partials.sum(1)
    before = partials.clone()
    if numel == 1030:
        assert reduce_block_rows(numel, width) == 4
    summed = reduce_shrink_splits(partials, slots, slot_row_div=top_k)
    assert summed.shape == (numel, 1, width) and summed.data_ptr() == partials.data_ptr()
    has_slot = slots.repeat_interleave(top_k) >= 0
    assert (~has_slot).any() and has_slot.any()
    torch.testing.assert_close(summed[has_slot, 0], expected[has_slot], atol=1e-5, rtol=1e-5)
    # Rows without an adapter, and every split past the first, are left as they were.
    assert torch.equal(partials[~has_slot], before[~has_slot])
    assert torch.equal(partials[:, 1:], before[:, 1:])


def test_reduce_shrink_splits_rejects_bad_buffers():
    from triton_ops.shrink_reduce import reduce_shrink_splits

    slots = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="fp32"):
        reduce_shrink_splits(torch.zeros(8, 2, 16, dtype=torch.float16), slots, slot_row_div=2)
    with pytest.raises(ValueError, match="power of two"):
        reduce_shrink_splits(torch.zeros(8, 2, 24), slots, slot_row_div=2)
    with pytest.raises(ValueError, match="one slot per 2 rows"):
        reduce_shrink_splits(torch.zeros(10, 2, 16), slots, slot_row_div=2)


@pytest.mark.interpreter
@pytest.mark.parametrize("reduce", ["0", "1"])
# (128, 64): GEMM1 expands a slot at a time from the partials; (32, 16): the prefetched first slot group.
@pytest.mark.parametrize("tile", [(128, 64), (32, 16)], ids=str)
def test_split_path_with_and_without_reduced_partials(monkeypatch, reduce, tile):
    """A prefill-sized batch (past the decode launch) whose shrinks split K=100 and I=40 into several
    fp32 partials: the GEMM epilogues read them summed once by ``reduce_shrink_splits`` or sum them
    themselves (``lora_reduce_splits`` forced both ways); ranks 29 and 3 in a rank-32 pool."""
    from triton_ops import shrink_reduce

    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_reduce_splits", reduce)
    calls = []
    original = shrink_reduce.reduce_shrink_splits

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(fused_experts_module, "reduce_shrink_splits", counting)
    gen = torch.Generator().manual_seed(23)
    (x, w13, w2), weights, ids, lora, ref, base = make_case(
        m=67, hidden=100, inter=40, num_experts=5, top_k=2, ranks=(29, 3), max_rank=32, num_slots=3,
        dtype=torch.float32, gen=gen,
    )
    gemm = GemmConfig(*tile, 32, 1, 4, 2)
    out = fused_experts(x, w13, w2, weights, ids, lora=lora, lora_path="split", config=MoEConfig(gemm, gemm))
    # Both shrinks split K (100 -> 4 fp32 tiles of 32, 40 -> 2): the gate/up and the down partials.
    assert len(calls) == (2 if reduce == "1" else 0)
    assert all(shape[1] > 1 for shape in calls)
    assert_matches_reference(out, ref, base)


def test_reduce_splits_rule(monkeypatch):
    from triton_ops.shrink_reduce import MIN_REREADS_TO_REDUCE, reduce_splits_pays

    monkeypatch.delitem(LAUNCH_OVERRIDES, "lora_reduce_splits", raising=False)
    assert reduce_splits_pays(8, 224)  # Mixtral M=256 GEMM1: 224 N tiles each re-summing 8 partials
    assert not reduce_splits_pays(1, 224)  # one partial: nothing to sum
    assert not reduce_splits_pays(2, MIN_REREADS_TO_REDUCE - 1)
    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_reduce_splits", "1")
    assert reduce_splits_pays(2, 1) and not reduce_splits_pays(1, 1)
    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_reduce_splits", "yes")
    with pytest.raises(ValueError, match="lora_reduce_splits"):
        reduce_splits_pays(2, 1)


@pytest.mark.interpreter
# 16: the old big-tile width, four chunks, two past rank 40 for one slot and three past rank 3 for the other;
# 32 (the default here): two chunks, the second partly past rank 40; 64: the whole rank in one.
@pytest.mark.parametrize("chunk", ["16", "32", "64"])
def test_forced_rank_chunk_width(monkeypatch, chunk):
    """``lora_chunk_r`` sets the split epilogue's rank chunks on 128x64 tiles (32 by default):
    ranks 40 and 3 in a max-rank-64 pool, a prefill-sized batch, against the reference."""
    from triton_ops.fused_moe import lora_rank_chunk

    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_chunk_r", chunk)
    gemm = GemmConfig(128, 64, 32, 1, 4, 2)
    assert lora_rank_chunk(gemm, 64) == int(chunk) and lora_rank_chunk(gemm, 16) == 16
    gen = torch.Generator().manual_seed(29)
    (x, w13, w2), weights, ids, lora, ref, base = make_case(
        m=67, hidden=48, inter=40, num_experts=5, top_k=2, ranks=(40, 3), max_rank=64, num_slots=3,
        dtype=torch.float32, gen=gen,
    )
    out = fused_experts(x, w13, w2, weights, ids, lora=lora, lora_path="split", config=MoEConfig(gemm, gemm))
    assert_matches_reference(out, ref, base)


def test_rank_chunk_rule(monkeypatch):
    from triton_ops.fused_moe import lora_rank_chunk

    monkeypatch.delitem(LAUNCH_OVERRIDES, "lora_chunk_r", raising=False)
    assert lora_rank_chunk(GemmConfig(128, 64, 64, 8, 8, 3), 64) == 32  # big tile: accumulators first
    assert lora_rank_chunk(GemmConfig(128, 64, 64, 8, 8, 3), 128) == 32
    assert lora_rank_chunk(GemmConfig(128, 64, 64, 8, 8, 3), 32) == 16
    assert lora_rank_chunk(GemmConfig(128, 64, 64, 8, 8, 3), 16) == 16
    assert lora_rank_chunk(GemmConfig(32, 128, 64, 8, 4, 3), 64) == 64  # 32x128: the whole rank tile
    assert lora_rank_chunk(GemmConfig(32, 128, 64, 8, 4, 3), 16) == 16
    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_chunk_r", "48")
    with pytest.raises(ValueError, match="lora_chunk_r"):
        lora_rank_chunk(GemmConfig(128, 64, 64, 8, 8, 3), 64)


@pytest.mark.interpreter
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m", [1, 9])  # one token: direct pairs (decode shrinks); 9: the alignment
def test_slots_and_ranks_outside_the_tables_mean_no_adapter(path, m):
    """A caller's ``MoELoRAInputs`` (not a pool's batch) with slot ids past the slot tables (negative or
    >= L) and a rank past the buffers': the kernels index nothing with them. Those tokens get the base
    output, the slot's rank is read as the buffers' rank, and every other token is exact."""
    gen = torch.Generator().manual_seed(23)
    (x, w13, w2), weights, ids, lora, ref, base = make_case(
        m=m, hidden=48, inter=40, num_experts=5, top_k=2, ranks=(8, 3), max_rank=8, num_slots=3,
        dtype=torch.float32, gen=gen,
    )
    good = torch.tensor([0, 1, -1, 0, 1, 0, 1, 0, 1], dtype=torch.int32)[:m]
    bad = torch.tensor([0, 1_000_000, -7, 3, 1, 0, -2**31, 0, 2**31 - 1], dtype=torch.int32)[:m]
    valid = (bad >= 0) & (bad < 3)
    out = fused_experts(x, w13, w2, weights, ids, lora=replace(lora, token_slots=bad), lora_path=path)
    want = fused_experts(x, w13, w2, weights, ids, lora_path=path,
                         lora=replace(lora, token_slots=torch.where(valid, bad, -1)))
    assert torch.equal(out, want)
    if m > 1:  # tokens with a real slot still get their adapter
        with_good = fused_experts(x, w13, w2, weights, ids, lora=replace(lora, token_slots=good),
                                  lora_path=path)
        assert torch.equal(out[valid], with_good[valid])
    # A slot rank past the buffers' rank (8) is read as 8: slot 0 holds rank 8.
    huge = replace(lora, token_slots=good, slot_ranks=torch.tensor([1 << 30, 3, 0], dtype=torch.int32))
    assert torch.equal(fused_experts(x, w13, w2, weights, ids, lora=huge, lora_path=path),
                       fused_experts(x, w13, w2, weights, ids, lora=replace(lora, token_slots=good),
                                     lora_path=path))
