"""Tests for ``triton_ops.moe_align_block_size``.

Contract under test: for experts e = 0..E-1 in order, ``sorted_ids`` lists the flat pair indices
p = t*k + j with ``topk_ids[t, j] == e`` in ascending order, padded with the sentinel ``numel`` up to the
next multiple of ``block_size``; experts with no pairs take no blocks. ``num_post_padded[0]`` is the sum
of the padded counts, ``expert_ids[b]`` is the expert of block b (-1 beyond the last used block), and
every entry of ``sorted_ids`` at or after ``num_post_padded`` is the sentinel. Pairs whose id is outside
[0, E) form a last run of their own (the null run, blocks of expert id -1). All outputs are int32, on the
device of ``topk_ids``, sized to the upper bound ``numel + min(E + 1, numel)*(block_size-1)`` (no host sync).

The CPU tests carry ``pytest.mark.interpreter`` one by one rather than through a module-level
``pytestmark``: conftest skips ``interpreter`` tests on a CUDA machine without TRITON_INTERPRET=1 and
``gpu`` tests under the interpreter, so a ``gpu`` test inside an all-``interpreter`` module would never run.
"""

import pytest
import torch

from triton_ops import moe_align_block_size

interpreter = pytest.mark.interpreter


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_padded_of(numel: int, num_experts: int, block_size: int) -> int:
    """Every run with a pair (E experts' and the null run) pads at most block_size - 1 slots."""
    return numel + min(num_experts + 1, numel) * (block_size - 1)


def reference_align(topk_ids: torch.Tensor, block_size: int, num_experts: int):
    """Plain torch version of the contract: stable argsort of the flat expert ids, padded per expert, then
    the null run (pairs whose id is outside [0, E), ascending) with expert id -1."""
    flat = topk_ids.reshape(-1).to("cpu", torch.int64)
    numel = flat.numel()
    max_padded = max_padded_of(numel, num_experts, block_size)
    sorted_ids = torch.full((max_padded,), numel, dtype=torch.int32)
    expert_ids = torch.full((_cdiv(max_padded, block_size),), -1, dtype=torch.int32)
    in_range = (flat >= 0) & (flat < num_experts)
    key = torch.where(in_range, flat, num_experts)  # the null run sorts last
    order = torch.argsort(key, stable=True).to(torch.int32)
    counts = torch.bincount(key, minlength=num_experts + 1).tolist()
    pos = src = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        padded = _cdiv(c, block_size) * block_size
        sorted_ids[pos : pos + c] = order[src : src + c]
        expert_ids[pos // block_size : (pos + padded) // block_size] = e if e < num_experts else -1
        pos += padded
        src += c
    return sorted_ids, expert_ids, pos


def check_align(topk_ids: torch.Tensor, block_size: int, num_experts: int) -> None:
    sorted_ids, expert_ids, num_post_padded = moe_align_block_size(topk_ids, block_size, num_experts)
    numel = topk_ids.numel()
    max_padded = max_padded_of(numel, num_experts, block_size)
    num_blocks_max = _cdiv(max_padded, block_size)

    for name, t in (
        ("sorted_ids", sorted_ids),
        ("expert_ids", expert_ids),
        ("num_post_padded", num_post_padded),
    ):
        assert t.dtype == torch.int32, f"{name} dtype {t.dtype}, expected int32"
        assert t.device == topk_ids.device, f"{name} on {t.device}, expected {topk_ids.device}"
    assert tuple(sorted_ids.shape) == (max_padded,)
    assert tuple(expert_ids.shape) == (num_blocks_max,)
    assert tuple(num_post_padded.shape) == (1,)

    ref_sorted, ref_experts, ref_npp = reference_align(topk_ids, block_size, num_experts)
    s = sorted_ids.cpu()
    ex = expert_ids.cpu()
    npp = int(num_post_padded.cpu()[0])
    flat = topk_ids.reshape(-1).to("cpu", torch.int64)
    in_range = (flat >= 0) & (flat < num_experts)

    # Invariants first: their messages say more than a bare mismatch would.
    counts = torch.bincount(torch.where(in_range, flat, num_experts), minlength=num_experts + 1)
    expected_npp = int(((counts + block_size - 1) // block_size * block_size).sum())
    assert npp == expected_npp == ref_npp, f"num_post_padded {npp}, expected {expected_npp}"
    assert npp % block_size == 0
    assert (s[npp:] == numel).all(), "entries past num_post_padded must be the sentinel"
    valid = s[:npp]
    real = valid[valid != numel]
    assert real.numel() == numel, f"{real.numel()} real entries, expected {numel} (one per pair)"
    assert torch.equal(torch.sort(real.long()).values, torch.arange(numel)), "every pair exactly once"

    num_blocks = npp // block_size
    blocks = valid.view(num_blocks, block_size).long()
    is_real = blocks != numel
    assert is_real.any(dim=1).all(), "a block with no real entry: experts with no pairs take no blocks"
    block_expert = ex[:num_blocks].long().unsqueeze(1).expand(num_blocks, block_size)
    pair_expert = torch.where(in_range, flat, -1)
    assert (pair_expert[blocks[is_real]] == block_expert[is_real]).all(), "one expert (or null) per block"
    assert (ex[num_blocks:] == -1).all(), "expert_ids past the last used block must be -1"

    # Then the exact layout (ascending pair order inside each expert, experts in order, null run last).
    assert torch.equal(s, ref_sorted), "sorted_ids differs from the stable-argsort reference"
    assert torch.equal(ex, ref_experts), "expert_ids differs from the reference"


def random_topk_ids(M, E, k, dtype=torch.int32, device="cpu", experts=None):
    """k distinct experts per token, like a real top-k router; ``experts`` restricts the choice."""
    pool = torch.arange(E) if experts is None else torch.as_tensor(experts)
    idx = torch.rand(M, pool.numel()).topk(k, dim=1).indices
    return pool[idx].to(device=device, dtype=dtype)


# Full sweep: block sizes of the GEMM configs; E=1 (degenerate), 6 (E not a power of two, k=E possible),
# 64 (DeepSeek-V2-Lite), 256 (more experts than pairs for small M, so most experts are empty);
# M=1 (decode), 7 and 33 (not multiples of anything), 300 (several blocks per expert).
SWEEP = [
    (bs, E, M, k)
    for bs in (16, 32, 64)
    for E in (1, 6, 64, 256)
    for M in (1, 7, 33, 300)
    for k in (1, 2, 6, 8)
    if k <= E
]


@interpreter
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("bs,E,M,k", SWEEP, ids=[f"bs{bs}-E{E}-M{M}-k{k}" for bs, E, M, k in SWEEP])
def test_align_sweep(bs, E, M, k, dtype):
    check_align(random_topk_ids(M, E, k, dtype), bs, E)


@interpreter
@pytest.mark.parametrize("bs", [16, 32, 64])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_align_unpicked_experts(bs, dtype):
    # Only four experts of 64 are ever chosen, including the first and the last: the other 60 must
    # take no blocks and the used ones must still come in expert order.
    ids = random_topk_ids(300, 64, 2, dtype, experts=[0, 17, 40, 63])
    check_align(ids, bs, 64)


@interpreter
@pytest.mark.parametrize("bs", [16, 32, 64])
@pytest.mark.parametrize("E,e", [(1, 0), (6, 0), (6, 5), (256, 0), (256, 131), (256, 255)])
@pytest.mark.parametrize("M", [1, 33, 300])
def test_align_all_tokens_one_expert(bs, E, e, M):
    # Every token on one expert (first, middle, last): one expert owns all blocks, the rest none.
    ids = torch.full((M, 1), e, dtype=torch.int32)
    check_align(ids, bs, E)


@interpreter
@pytest.mark.parametrize("bs", [16, 64])
def test_align_all_tokens_same_k_experts(bs):
    # Every token picks the same 6 experts of 64, in a different order per token: ascending pair order
    # within an expert must not depend on the slot j.
    chosen = torch.tensor([5, 9, 11, 40, 41, 63])
    perm = torch.stack([chosen[torch.randperm(6)] for _ in range(33)])
    check_align(perm.to(torch.int32), bs, 64)


@interpreter
@pytest.mark.parametrize("bs", [16, 32, 64])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_align_counts_exact_multiples(bs, dtype):
    # Each used expert gets exactly 64 pairs (a multiple of every block size): no sentinel padding at
    # all inside the used region, so num_post_padded == numel.
    ids = torch.tensor([1, 4, 6]).repeat_interleave(64).reshape(-1, 1)[torch.randperm(192)]
    check_align(ids.to(dtype), bs, 8)


@interpreter
@pytest.mark.parametrize("bs", [16, 64])
def test_align_repeated_expert_in_row(bs):
    # Not produced by a top-k router, but the contract covers it: the same expert twice in one row.
    ids = torch.randint(0, 6, (33, 8), dtype=torch.int32)
    ids[0] = 3
    check_align(ids, bs, 6)


@interpreter
def test_align_outputs_fresh_per_call():
    # A second call with different ids must not see leftovers of the first (e.g. a cached buffer).
    check_align(random_topk_ids(300, 64, 8), 16, 64)
    check_align(random_topk_ids(7, 64, 2), 16, 64)


GPU_CASES = [
    # (M, E, k, block_size, ids dtype, routing)
    (4096, 256, 8, 16, torch.int32, "random"),
    (4096, 256, 8, 64, torch.int64, "random"),
    (4096, 256, 8, 32, torch.int32, "skewed"),
    (4096 * 8, 256, 1, 64, torch.int32, "one"),
    (4096, 64, 6, 16, torch.int32, "random"),
    (1, 256, 8, 16, torch.int32, "random"),
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "M,E,k,bs,dtype,routing",
    GPU_CASES,
    ids=[f"M{c[0]}-E{c[1]}-k{c[2]}-bs{c[3]}-{str(c[4])[6:]}-{c[5]}" for c in GPU_CASES],
)
def test_align_gpu(M, E, k, bs, dtype, routing):
    if routing == "random":
        ids = random_topk_ids(M, E, k, dtype)
    elif routing == "skewed":
        # Half the experts get a big logit boost: very uneven counts, 128 experts nearly empty.
        scores = torch.rand(M, E) + (torch.arange(E) % 2 == 0) * 4.0
        ids = scores.topk(k, dim=1).indices.to(dtype)
    else:
        ids = torch.full((M, k), E - 1, dtype=dtype)
    check_align(ids.cuda(), bs, E)


@pytest.mark.gpu
def test_align_gpu_no_host_sync():
    # Outputs are sized to the upper bound, so the call must not synchronise with the host.
    ids = random_topk_ids(4096, 256, 8, device="cuda")
    moe_align_block_size(ids, 64, 256)  # warm-up: compilation may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe_align_block_size(ids, 64, 256)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# Ids outside [0, E) at random positions: -1 (expert-parallel "not mine"), E, 10**6 and, in int64, past
# int32; M=1/7 take the one-program alignment, M=50 with k=6 (300 pairs) the three-launch one.
@interpreter
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("bs,E,M,k", [(16, 6, 1, 2), (16, 64, 7, 6), (32, 64, 50, 6), (16, 8, 50, 2),
                                      (64, 1, 33, 1)])
def test_align_puts_out_of_range_ids_in_the_null_run(bs, E, M, k, dtype):
    ids = random_topk_ids(M, E, k, dtype)
    gen = torch.Generator().manual_seed(M * 31 + E)
    bad = torch.rand(ids.shape, generator=gen) < 0.3
    choices = [-1, E, 10**6, -(10**6)] + ([2**40] if dtype == torch.int64 else [])
    values = torch.tensor(choices, dtype=dtype)[torch.randint(len(choices), ids.shape, generator=gen)]
    ids = torch.where(bad, values, ids)
    ids.view(-1)[0] = -1  # at least one null pair
    check_align(ids, bs, E)
    check_align(torch.full((M, k), E, dtype=dtype), bs, E)  # every pair null


# Grouping by (expert, adapter slot): the same contract on virtual experts e * (L + 1) + s, a token without
# an adapter (or with a slot outside [0, L), or, with the block table, an expert its adapter does not train)
# in group L of its expert, ids outside [0, E) in the null run; expert_ids holds the real expert, pair_slots
# each pair's group slot. Built on an expert alignment of any block size (the GEMMs'): its own (16), one of
# 64 rows, and past the one-program alignment (300 x 8 pairs; 97 x 2 with a hot expert whose run spans
# several chunks); int64 ids; an alignment with no pair in any expert but the null run.
@pytest.mark.parametrize("bs, E, L, M, k, expert_bs", [
    (16, 5, 3, 1, 2, None), (16, 9, 12, 45, 4, 64), (16, 128, 33, 300, 8, None), (32, 7, 0, 40, 3, 16),
    (16, 3, 70, 97, 2, 128), (64, 4, 5, 200, 1, 64)])
@pytest.mark.parametrize("untrained", [False, True], ids=["all-trained", "untrained-experts"])
@pytest.mark.parametrize("device", [pytest.param("cpu", marks=interpreter),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
def test_align_by_adapter_groups_each_block_by_one_adapter(bs, E, L, M, k, expert_bs, untrained, device):
    from triton_ops.moe_align import align_by_adapter

    gen = torch.Generator().manual_seed(M + L)
    ids = torch.randint(0, E, (M, k), generator=gen, dtype=torch.int32 if M % 2 else torch.int64)
    ids.view(-1)[::7] = E + 3  # the null run
    ids.view(-1)[1::5] = 0  # a hot expert
    slots = torch.randint(-1, L + 2, (M,), generator=gen, dtype=torch.int32)  # L, L + 1: out of range
    # A pool's block table: unit 0 (the zero block) where the slot's adapter does not train the expert.
    table = torch.randint(1, 1000, (L, E), generator=gen, dtype=torch.int32)
    table[torch.rand(L, E, generator=gen) < 0.3] = 0
    ids, slots = ids.to(device), slots.to(device)
    expert_alignment = None
    if expert_bs is not None:
        expert_alignment = moe_align_block_size(ids, expert_bs, E, with_starts=True)
    sorted_ids, expert_ids, num_post_padded, pair_slots = align_by_adapter(
        ids, slots, bs, E, L, expert_alignment=expert_alignment,
        untrained_table=table.to(device) if untrained else None)
    ids, slots = ids.cpu(), slots.cpu()
    groups = L + 1
    flat = ids.reshape(-1).long()
    in_range = (flat >= 0) & (flat < E)
    pair_slot = slots.repeat_interleave(k).long()
    has_slot = (pair_slot >= 0) & (pair_slot < L) & in_range
    if untrained:
        has_slot &= table[pair_slot.clamp(0, max(L - 1, 0)), flat.clamp(0, E - 1)] != 0 if L else has_slot
    slot_col = torch.where(has_slot, pair_slot, L)
    virtual = torch.where(in_range, flat * groups + slot_col, E * groups)
    want_sorted, want_experts, want_padded = reference_align(virtual.view(M, k), bs, E * groups)
    # The reference's null run (virtual id E * groups) is the function's null run; its virtual experts
    # map to their real expert.
    want_experts = torch.where(want_experts >= 0, want_experts // groups, -1).to(torch.int32)
    assert sorted_ids.shape == want_sorted.shape and expert_ids.shape == want_experts.shape
    assert torch.equal(sorted_ids.cpu(), want_sorted) and torch.equal(expert_ids.cpu(), want_experts)
    assert int(num_post_padded) == int(want_padded)
    assert torch.equal(pair_slots.cpu(), torch.where(has_slot, pair_slot, -1).to(torch.int32))
    for block in range(int(num_post_padded) // bs):  # one (expert, adapter) a block
        pairs = sorted_ids[block * bs:(block + 1) * bs].cpu()
        pairs = pairs[pairs < M * k].long()
        assert len(set(virtual[pairs].tolist())) == 1
    every_null = torch.full_like(ids, E)
    sorted_ids, expert_ids, num_post_padded, pair_slots = align_by_adapter(every_null.to(device),
                                                                           slots.to(device), bs, E, L)
    want_sorted, want_experts, want_padded = reference_align(torch.full_like(ids, E * groups), bs, E * groups)
    assert torch.equal(sorted_ids.cpu(), want_sorted) and int(num_post_padded) == int(want_padded)
    assert (expert_ids == -1).all() and (pair_slots == -1).all()


def test_align_by_adapter_refuses_operands_that_do_not_fit():
    """token_slots must hold one slot per token of topk_ids; num_slots is a count: clear ValueErrors."""
    from triton_ops.moe_align import align_by_adapter

    ids = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"token_slots must be \(num_tokens,\) for topk_ids \(4, 2\)"):
        align_by_adapter(ids, torch.zeros(3, dtype=torch.int32), 16, 5, 2)
    # Two slots divide the 8 pairs but are not one a token.
    with pytest.raises(ValueError, match=r"for topk_ids \(4, 2\), got \(2,\)"):
        align_by_adapter(ids, torch.zeros(2, dtype=torch.int32), 16, 5, 2)
    with pytest.raises(ValueError, match=r"token_slots must be \(num_tokens,\)"):
        align_by_adapter(ids, torch.zeros(4, 1, dtype=torch.int32), 16, 5, 2)
    with pytest.raises(ValueError, match="num_slots must be >= 0, got -1"):
        align_by_adapter(ids, torch.zeros(4, dtype=torch.int32), 16, 5, -1)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        align_by_adapter(ids, torch.zeros(4, dtype=torch.int32), 12, 5, 2)
    with pytest.raises(ValueError, match=r"untrained_table must be the \(2, 5\) int32 block table"):
        align_by_adapter(ids, torch.zeros(4, dtype=torch.int32), 16, 5, 2,
                         untrained_table=torch.zeros(5, 2, dtype=torch.int32))
