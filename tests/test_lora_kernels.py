"""The LoRA kernels through ``fused_experts(lora=...)`` with forced launch configs, against the pool-layout
reference: covers tile shapes the layer's default configs never pick at test sizes (large BLOCK_N, which
makes the split path expand in 16-column rank chunks) and split-K shrinks with several partials."""

import pytest
import torch

from moelora.reference import reference_moe_from_pool
from triton_ops import MoEConfig
from triton_ops.configs import GemmConfig
from triton_ops.fused_experts import MoELoRAInputs, fused_experts
from triton_ops.moe_lora import shrink_k_splits

PATHS = ("fused", "split", "wide", "staged")


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


@pytest.mark.interpreter
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "block_m,block_n",
    [(16, 32), (32, 256)],  # 32x256 > 32x128: the split path expands 16 rank columns at a time
)
def test_forced_tiles_and_rank_chunks(path, block_m, block_n):
    gen = torch.Generator().manual_seed(7)
    # H=100: four fp32 K tiles of 32 with a ragged tail, so shrinks split K into several partials;
    # ranks 3 and 29 in a max-rank-32 pool: two rank chunks, the second one partly past a rank.
    (x, w13, w2), weights, ids, lora, ref, base = make_case(
        m=9, hidden=100, inter=40, num_experts=5, top_k=2, ranks=(29, 3), max_rank=32, num_slots=3,
        dtype=torch.float32, gen=gen,
    )
    assert shrink_k_splits(9 * 2 + 5 * (block_m - 1), block_m, 100, block_k=32) > 1
    gemm = GemmConfig(block_m, block_n, 32, 1, 4, 2)
    out = fused_experts(x, w13, w2, weights, ids, lora=lora, lora_path=path, config=MoEConfig(gemm, gemm))
    scale = ref.abs().max()
    assert (ref - base).abs().max() > 0.1 * scale  # the adapters matter in this case
    torch.testing.assert_close(out, ref, atol=2e-5 * scale, rtol=1e-4)
