"""MXFP4 decode (``triton_ops.mxfp4``): bit-exact against a decoder written here from the OCP MX format
(a value table for E2M1 and ``ldexp`` for E8M0), every code and scale, odd row counts and group counts."""

from __future__ import annotations

import os

import pytest
import torch

from triton_ops.mxfp4 import check_mxfp4, dequantize_mxfp4

gpu = pytest.mark.gpu
interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="runs Triton kernels on the CPU: set TRITON_INTERPRET=1")

# E2M1 values of codes 0..15 (sign bit 3): the OCP MX spec's table.
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Independent decoder: (..., N, K/2) uint8 and (..., N, K/32) uint8 -> (..., N, K) fp32."""
    low, high = (blocks & 15).long(), (blocks >> 4).long()
    codes = torch.stack([low, high], dim=-1).flatten(-2)  # low nibble = even column
    values = torch.tensor(E2M1, dtype=torch.float64)[codes]
    exponents = scales.long().repeat_interleave(32, dim=-1) - 127
    out = torch.ldexp(values, exponents.double())
    out[(scales == 255).repeat_interleave(32, dim=-1)] = float("nan")
    return out.float()


def random_mxfp4(rows: int, groups: int, gen: torch.Generator, scale_range=(0, 256)):
    blocks = torch.randint(0, 256, (rows, groups * 16), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(*scale_range, (rows, groups), generator=gen, dtype=torch.int32).to(torch.uint8)
    return blocks, scales


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other is NaN, and the sign of zero kept."""
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    a, b = a[~nan], b[~nan]
    return torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))


@interpreter
@pytest.mark.parametrize("rows, groups", [(1, 1), (7, 3), (17, 2)])
def test_every_code_and_scale_decodes_exactly_in_fp32(rows, groups):
    """Every byte value (both nibbles) beside every scale 0..255 (the subnormal 2^-127, 1, NaN included),
    prime row counts and a group count that leaves half of the kernel's last 64-column tile empty."""
    gen = torch.Generator().manual_seed(rows * 31 + groups)
    blocks, scales = random_mxfp4(rows, groups, gen)
    bytes_all = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    flat = blocks.flatten()
    flat[: min(256, flat.numel())] = bytes_all[: flat.numel()]
    blocks = flat.view_as(blocks)
    flat_scales = scales.flatten()
    flat_scales[: min(4, flat_scales.numel())] = torch.tensor([0, 127, 255, 1], dtype=torch.uint8)[
        : flat_scales.numel()]
    out = dequantize_mxfp4(blocks, scales, torch.float32)
    assert out.shape == (rows, groups * 32)
    assert same_bits(out, decode(blocks, scales))


def test_torch_decoder_matches_the_independent_one():
    """``dequantize_mxfp4_torch`` (the layer's torch path), a slice of experts at a time and on 2-D input:
    every byte and scale, NaN and the subnormal scale included, bit for bit in fp32."""
    from triton_ops.mxfp4 import dequantize_mxfp4_torch

    gen = torch.Generator().manual_seed(2)
    blocks, scales = random_mxfp4(3 * 7, 2, gen)
    blocks.view(-1)[:256] = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    scales.view(-1)[:3] = torch.tensor([0, 255, 127], dtype=torch.uint8)
    expected = decode(blocks, scales)
    assert same_bits(dequantize_mxfp4_torch(blocks, scales, torch.float32), expected)
    stacked = dequantize_mxfp4_torch(blocks.view(3, 7, 32), scales.view(3, 7, 2), torch.float32)
    assert same_bits(stacked, expected.view(3, 7, 64))


@interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_outputs_are_the_exact_values_rounded_once(dtype):
    """Scales inside the target type's range: every value is representable, so the output is exactly the
    independent decode cast to the dtype; gpt-oss' (E, N, G, 16) block layout is read as (E, N, K/2)."""
    gen = torch.Generator().manual_seed(5)
    low = 127 - 14 if dtype == torch.float16 else 1
    high = 127 + 13 if dtype == torch.float16 else 254
    blocks, scales = random_mxfp4(3 * 5, 3, gen, scale_range=(low, high))
    blocks_4d, scales_3d = blocks.view(3, 5, 3, 16), scales.view(3, 5, 3)
    out = dequantize_mxfp4(blocks_4d, scales_3d, dtype)
    assert out.shape == (3, 5, 96) and out.dtype == dtype
    expected = decode(blocks, scales).to(dtype).view(3, 5, 96)
    assert same_bits(out.float(), expected.float())


def test_mismatched_operands_are_refused_with_what_was_expected():
    blocks, scales = torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8)
    assert [t.shape for t in check_mxfp4(blocks, scales)] == [(4, 32), (4, 2)]
    with pytest.raises(TypeError, match="must be uint8"):
        check_mxfp4(blocks.int(), scales)
    with pytest.raises(ValueError, match="16 bytes per scale"):
        check_mxfp4(blocks[:, :30], scales)
    with pytest.raises(ValueError, match="share their leading dims"):
        check_mxfp4(blocks[:3], scales)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        dequantize_mxfp4(blocks, scales, torch.int8)


@gpu
def test_gpu_decode_matches_independent_decoder():
    """The compiled kernel on the GPU: gpt-oss-20b-like rows (2 experts x 2880 gate/up rows, 90 groups),
    fp32 bit-exact, bf16 the exact values rounded once."""
    gen = torch.Generator().manual_seed(11)
    blocks, scales = random_mxfp4(2 * 2880, 90, gen, scale_range=(100, 140))
    expected = decode(blocks, scales)
    blocks, scales = blocks.cuda(), scales.cuda()
    assert same_bits(dequantize_mxfp4(blocks, scales, torch.float32).cpu(), expected)
    assert same_bits(dequantize_mxfp4(blocks, scales, torch.bfloat16).cpu().float(),
                     expected.to(torch.bfloat16).float())


def _mxfp4_experts(experts: int, rows: int, cols: int, gen: torch.Generator, scale_range=(112, 122)):
    """Packed (E, rows, cols/2) blocks, (E, rows, cols/32) scales and their fp32 values."""
    blocks, scales = random_mxfp4(experts * rows, cols // 32, gen, scale_range=scale_range)
    values = decode(blocks, scales).view(experts, rows, cols)
    return blocks.view(experts, rows, cols // 2), scales.view(experts, rows, cols // 32), values


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("m, top_k, block_k", [(7, 2, 32), (13, 3, 64)])
def test_gemms_read_packed_weights_as_their_decoded_values(dtype, m, top_k, block_k):
    """Both GEMMs of a layer with MXFP4 weights (the gated GEMM1, K = 96 = three scale groups, so a 64-wide
    K step is half past K; GEMM2 with the routed weight) give what the same launches give on the decoded
    dense weights: fp32 activations bit for bit (the K-loop decodes each tile exactly before the same
    dot); fp16 ones through ``tl.dot_scaled``, whose products are the same exact values summed in another
    order, so to fp16's rounding (relative norm). Seven experts (some picked by no token), prime token
    counts."""
    from triton_ops.configs import GemmConfig
    from triton_ops.fused_moe import invoke_fused_moe_kernel
    from triton_ops.moe_align import moe_align_block_size

    gen = torch.Generator().manual_seed(m)
    experts, hidden, inter = 7, 96, 32
    w13_blocks, w13_scales, w13 = _mxfp4_experts(experts, 2 * inter, hidden, gen)
    w2_blocks, w2_scales, w2 = _mxfp4_experts(experts, hidden, inter, gen)
    x = torch.randn(m, hidden, generator=gen).to(dtype)
    ids = torch.randint(0, experts - 2, (m, top_k), generator=gen, dtype=torch.int32)
    weights = torch.rand(m * top_k, generator=gen)
    cfg = GemmConfig(block_m=16, block_n=16, block_k=block_k)
    sorted_ids, expert_ids, num_post_padded = moe_align_block_size(ids, cfg.block_m, experts)
    align = dict(sorted_ids=sorted_ids, expert_ids=expert_ids, num_post_padded=num_post_padded)

    def layer(gate_up, down, gate_up_scale=None, down_scale=None):
        h = torch.empty(m * top_k, inter, dtype=dtype)
        y = torch.empty(m * top_k, hidden, dtype=dtype)
        invoke_fused_moe_kernel(x, gate_up, h, topk_weights=None, a_row_div=top_k, config=cfg,
                                activation="silu", b_scale=gate_up_scale, **align)
        invoke_fused_moe_kernel(h, down, y, topk_weights=weights, a_row_div=1, config=cfg,
                                b_scale=down_scale, **align)
        return h, y

    packed = layer(w13_blocks, w2_blocks, w13_scales, w2_scales)
    dense = layer(w13.to(dtype), w2.to(dtype))
    for got, expected in zip(packed, dense, strict=True):
        assert torch.isfinite(got).all()
        if dtype == torch.float32:
            assert torch.equal(got, expected)
        else:
            diff = (got.float() - expected.float()).norm() / expected.float().norm()
            assert diff.item() < 2.0**-10, diff  # fp16 rounds at 2^-11: GEMM2 inherits GEMM1's roundings


def test_gemm_refuses_mxfp4_operands_that_do_not_fit():
    from triton_ops.configs import GemmConfig
    from triton_ops.fused_moe import invoke_fused_moe_kernel

    x, out = torch.zeros(2, 64), torch.zeros(2, 8)
    blocks, scales = torch.zeros(3, 8, 32, dtype=torch.uint8), torch.zeros(3, 8, 2, dtype=torch.uint8)
    ids = torch.zeros(2, dtype=torch.int32)
    kw = dict(topk_weights=None, a_row_div=1, direct_ids=ids)
    with pytest.raises(ValueError, match=r"need b_scale: uint8 E8M0 scales \(3, 8, 2\)"):
        invoke_fused_moe_kernel(x, blocks, out, config=GemmConfig(16, 16, 32), **kw)
    with pytest.raises(ValueError, match="BLOCK_K a multiple of 32"):
        invoke_fused_moe_kernel(x, blocks, out, config=GemmConfig(16, 16, 16), b_scale=scales, **kw)
    with pytest.raises(ValueError, match=r"expected \(E, 8, 48\) uint8 \(MXFP4"):
        invoke_fused_moe_kernel(torch.zeros(2, 96), blocks, out, config=GemmConfig(16, 16, 32),
                                b_scale=scales, **kw)


@interpreter
@pytest.mark.parametrize("m, path", [(1, None), (1, "split"), (9, None), (9, "split"), (9, "fused"),
                                     (9, "staged"), (40, "split")])
def test_fused_experts_with_mxfp4_experts_matches_the_decoded_layer(m, path):
    """``fused_experts(mxfp4=...)``: the layer on packed experts is bit for bit the layer on their decoded
    values (same launches, same tiles), with and without adapters (ranks 8 and 16, tokens without one) on
    every LoRA path, one decode token (direct pairs) to 40 tokens; and it matches the fp32 oracle."""
    from test_decode_launches import lora_inputs

    from moelora.reference import reference_moe
    from triton_ops.configs import GemmConfig, MoEConfig
    from triton_ops.fused_experts import fused_experts
    from triton_ops.mxfp4 import Mxfp4Weights

    gen = torch.Generator().manual_seed(m)
    experts, top_k, hidden, inter = 6, 2, 64, 32
    w13_blocks, w13_scales, w13 = _mxfp4_experts(experts, 2 * inter, hidden, gen)
    w2_blocks, w2_scales, w2 = _mxfp4_experts(experts, hidden, inter, gen)
    x = torch.randn(m, hidden, generator=gen)
    weights, ids = torch.softmax(torch.randn(m, experts, generator=gen), -1).topk(top_k, -1)
    ids = ids.to(torch.int32)
    kwargs = dict(config=MoEConfig(GemmConfig(16, 16, 32), GemmConfig(16, 16, 32)))
    adapters = per_token = None
    if path is not None:
        lora, adapters, per_token = lora_inputs(m, experts, hidden, inter, torch.float32, seed=m)
        kwargs |= dict(lora=lora, lora_path=path)
    packed = fused_experts(x, w13_blocks, w2_blocks, weights, ids,
                           mxfp4=Mxfp4Weights(w13_scales, w2_scales), **kwargs)
    dense = fused_experts(x, w13, w2, weights, ids, **kwargs)
    assert torch.isfinite(packed).all()
    assert torch.equal(packed, dense)
    ref = reference_moe(x, w13, w2, weights, ids, adapters=adapters, token_adapter=per_token)
    torch.testing.assert_close(packed, ref, rtol=1e-4, atol=1e-5)


def test_fused_experts_refuses_mxfp4_operands_that_do_not_fit():
    from triton_ops.fp8 import BlockFp8Weights
    from triton_ops.fused_experts import fused_experts
    from triton_ops.mxfp4 import Mxfp4Weights

    x, weights, ids = torch.zeros(2, 64), torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int32)
    w13, w2 = torch.zeros(3, 16, 32, dtype=torch.uint8), torch.zeros(3, 64, 4, dtype=torch.uint8)
    scales = Mxfp4Weights(torch.zeros(3, 16, 2, dtype=torch.uint8), torch.zeros(3, 64, 1, dtype=torch.uint8))
    with pytest.raises(TypeError, match="Mxfp4Weights"):
        fused_experts(x, w13, w2, weights, ids, mxfp4=(scales.w13_scale, scales.w2_scale))
    with pytest.raises(ValueError, match=r"w13_scale must be \(3, 16, 2\)"):
        fused_experts(x, w13, w2, weights, ids,
                      mxfp4=Mxfp4Weights(scales.w13_scale[:, :, :1], scales.w2_scale))
    with pytest.raises(ValueError, match=r"w2 must be \(E, H, I / 2\) = \(3, 64, 4\)"):
        fused_experts(x, w13, w2[:, :, :3], weights, ids, mxfp4=scales)
    with pytest.raises(TypeError, match="w13 and w2 must have dtype torch.uint8"):
        fused_experts(x, w13.float(), w2, weights, ids, mxfp4=scales)
    with pytest.raises(ValueError, match="fp8= or mxfp4="):
        fused_experts(x, w13, w2, weights, ids, mxfp4=scales,
                      fp8=BlockFp8Weights.__new__(BlockFp8Weights))


@pytest.mark.parametrize("path", ["auto", "fused", "staged", "torch"])
def test_layer_with_mxfp4_experts_matches_the_layer_on_their_values(path):
    """``FusedMoEWithLoRA(mxfp4=...)`` with gpt-oss' layout read in place: gate/up rows interleaved (row 2n
    gate n, row 2n + 1 up n) taken as an (E, 2, I, H / 2) halves view of the blocks and of the scales, two
    adapters of ranks 3 and 8 and tokens without one. Bit for bit the layer on the decoded weights (the
    Triton paths through the interpreter; the torch path decodes a dense copy) and the fp32 oracle."""
    if path != "torch" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs Triton kernels on the CPU: set TRITON_INTERPRET=1")
    from test_lora_layer import make_adapter, make_pool

    from moelora.layer import FusedMoEWithLoRA
    from moelora.reference import reference_moe
    from triton_ops.mxfp4 import Mxfp4Weights

    gen = torch.Generator().manual_seed(3)
    experts, hidden, inter, m, top_k = 5, 64, 32, 11, 2
    gu_blocks, gu_scales, gu_values = _mxfp4_experts(experts, 2 * inter, hidden, gen)
    w2_blocks, w2_scales, w2 = _mxfp4_experts(experts, hidden, inter, gen)

    def halves(t):  # interleaved rows -> (E, 2, I, ...) view: [:, 0] the even (gate) rows, [:, 1] the odd
        return t.view(experts, inter, 2, t.shape[-1]).transpose(1, 2)

    w13 = halves(gu_values).reshape(experts, 2 * inter, hidden)  # gate rows, then up rows
    pool = make_pool(torch.float32, num_experts=experts, hidden=hidden, inter=inter, layer_ids=[0])
    adapters = {name: make_adapter(rank, 0.5, torch.float32, layers=[0], num_experts=experts, hidden=hidden,
                                   inter=inter) for name, rank in (("a", 3), ("b", 8))}
    for name, adapter in adapters.items():
        pool.add_adapter_weights(name, adapter)
    packed = FusedMoEWithLoRA(halves(gu_blocks), w2_blocks, pool=pool, layer_id=0, path=path,
                              mxfp4=Mxfp4Weights(halves(gu_scales), w2_scales))
    dense = FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=0, path=path)
    x = torch.randn(m, hidden, generator=gen)
    weights, ids = torch.softmax(torch.randn(m, experts, generator=gen), -1).topk(top_k, -1)
    names = [("a", None, "b")[t % 3] for t in range(m)]
    batch = pool.prepare_batch(names)
    out = packed(x, weights, ids.int(), batch)
    assert torch.equal(out, dense(x, weights, ids.int(), batch))
    ref = reference_moe(x, w13, w2, weights, ids, adapters=[adapters["a"][0], adapters["b"][0]],
                        token_adapter=[{"a": 0, "b": 1, None: -1}[n] for n in names])
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_layer_refuses_mxfp4_experts_it_cannot_serve():
    from test_lora_layer import make_pool

    from moelora.layer import FusedMoEWithLoRA
    from triton_ops.mxfp4 import Mxfp4Weights

    pool = make_pool(torch.float32, num_experts=3, hidden=64, inter=32, layer_ids=[0])
    w13, w2 = torch.zeros(3, 64, 32, dtype=torch.uint8), torch.zeros(3, 64, 16, dtype=torch.uint8)
    scales = Mxfp4Weights(torch.zeros(3, 64, 2, dtype=torch.uint8), torch.zeros(3, 64, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"w13 must be \(E, 2I, H / 2\) uint8 MXFP4 blocks = \(3, 64, 32\)"):
        FusedMoEWithLoRA(w13[:, :, :16], w2, pool=pool, layer_id=0, mxfp4=scales)
    with pytest.raises(ValueError, match=r"w2 must be \(E, H, I / 2\)"):
        FusedMoEWithLoRA(w13, w2[:, :, :8], pool=pool, layer_id=0, mxfp4=scales)
    with pytest.raises(TypeError, match="MXFP4 w13 must be uint8"):
        FusedMoEWithLoRA(w13.float(), w2, pool=pool, layer_id=0, mxfp4=scales)
    layer = FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=0, mxfp4=scales)
    message = r"x's dtype \(float16\) differs from the layer's expert weights' dtype \(float32\)"
    with pytest.raises(TypeError, match=message):
        layer(torch.zeros(2, 64, dtype=torch.float16), torch.ones(2, 1),
              torch.zeros(2, 1, dtype=torch.int32))


def test_mxfp4_chunks_step_k_by_whole_scale_groups_within_the_registers():
    """Without a tuned MXFP4 file the GEMMs' K step is held to 32-128 columns: whole scale groups, and no
    decoded tile too big for the registers (sm_90 spills at 256)."""
    from triton_ops.configs import GemmConfig, MoEConfig
    from triton_ops.fused_experts import plan_chunk

    forced = MoEConfig(GemmConfig(16, 64, 256), GemmConfig(16, 64, 16))
    plan = plan_chunk(5, 2, 8, 64, 64, torch.bfloat16, torch.device("cpu"), lora=None, lora_path="fused",
                      config=forced, combine=True, mxfp4=True)
    assert (plan.config.gemm1.block_k, plan.config.gemm2.block_k) == (128, 32)
    dense = plan_chunk(5, 2, 8, 64, 64, torch.bfloat16, torch.device("cpu"), lora=None, lora_path="fused",
                       config=forced, combine=True)
    assert (dense.config.gemm1.block_k, dense.config.gemm2.block_k) == (256, 16)


@gpu
@pytest.mark.parametrize("m", [1, 64, 300])
@pytest.mark.parametrize("path", [None, "split", "fused", "staged"])
def test_gpu_mxfp4_layer_matches_the_bf16_layer_on_its_values(m, path):
    """Compiled kernels, bf16 activations, gpt-oss-20b's sizes (E=32, top-4, H=I=2880: 90 scale groups a
    row): the MXFP4 layer gives the bf16 layer's outputs on the decoded weights with the same tiles, with
    gpt-oss' clamped SwiGLU and biases, four adapters of ranks 4-16 and tokens without one. The decode is
    exact and ``tl.dot_scaled`` multiplies the same values; it sums them in another order (a warpgroup
    MMA with the tokens as its N), so the outputs agree to bf16 rounding, not bit for bit. And near the
    fp32 oracle."""
    from test_decode_launches import lora_inputs

    from moelora.activations import GatedActivation
    from moelora.reference import reference_moe
    from triton_ops.configs import GemmConfig, MoEConfig
    from triton_ops.fused_experts import fused_experts
    from triton_ops.mxfp4 import Mxfp4Weights, dequantize_mxfp4

    gen = torch.Generator().manual_seed(m)
    experts, top_k, hidden, inter = 32, 4, 2880, 2880
    gu_blocks, gu_scales = random_mxfp4(experts * 2 * inter, hidden // 32, gen, scale_range=(118, 124))
    w2_blocks, w2_scales = random_mxfp4(experts * hidden, inter // 32, gen, scale_range=(118, 124))
    gu_blocks, gu_scales = (t.view(experts, 2 * inter, -1).cuda() for t in (gu_blocks, gu_scales))
    w2_blocks, w2_scales = (t.view(experts, hidden, -1).cuda() for t in (w2_blocks, w2_scales))
    w13 = dequantize_mxfp4(gu_blocks, gu_scales, torch.bfloat16)
    w2 = dequantize_mxfp4(w2_blocks, w2_scales, torch.bfloat16)
    x = torch.randn(m, hidden, generator=gen).cuda().to(torch.bfloat16)
    weights, ids = torch.softmax(torch.randn(m, experts, generator=gen), -1).topk(top_k, -1)
    weights, ids = weights.cuda(), ids.to(torch.int32).cuda()
    activation = GatedActivation("clamped_swiglu", 7.0, 1.702, 1.0)
    b13 = (torch.randn(experts, 2 * inter, generator=gen) * 0.1).cuda().to(torch.bfloat16)
    b2 = (torch.randn(experts, hidden, generator=gen) * 0.1).cuda().to(torch.bfloat16)
    block_m = 16 if m * top_k <= 128 else 64
    tiles = GemmConfig(block_m, 64, 64, 1 if block_m == 16 else 8, 4, 3)
    kwargs = dict(activation=activation, w13_bias=b13, w2_bias=b2, config=MoEConfig(tiles, tiles))
    adapters = per_token = None
    if path is not None:
        lora, adapters, per_token = lora_inputs(m, experts, hidden, inter, torch.bfloat16, seed=m,
                                                ranks=(16, 8, 16, 4), device="cuda")
        kwargs |= dict(lora=lora, lora_path=path)
    packed = fused_experts(x, gu_blocks, w2_blocks, weights, ids, mxfp4=Mxfp4Weights(gu_scales, w2_scales),
                           **kwargs)
    dense = fused_experts(x, w13, w2, weights, ids, **kwargs)
    assert torch.isfinite(packed).all()
    assert ((packed.float() - dense.float()).norm() / dense.float().norm()).item() < 2.0**-8
    ref = reference_moe(x.float(), w13.float(), w2.float(), weights, ids, adapters=adapters,
                        token_adapter=per_token, activation=activation, w13_bias=b13.float(),
                        w2_bias=b2.float())
    assert ((packed.float() - ref).norm() / ref.norm()).item() < 2e-2


def test_tuner_searches_two_warpgroups_for_mxfp4_decode():
    """``tune_moe.py --dtype mxfp4``: at decode sizes the sweep holds 8-warp tiles of 128-256 columns (each
    warpgroup decodes its own 64 columns for the scaled dot on sm_90) besides the bf16 sweep's 4-warp ones,
    and it counts the packed weight tiles at half a byte a value against shared memory."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "tune_moe", Path(__file__).resolve().parents[1] / "benchmarks" / "tune_moe.py")
    tune_moe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune_moe)
    for gemm in (1, 2):
        dense = tune_moe.candidates(1, 4, 32, gemm)
        packed = tune_moe.candidates(1, 4, 32, gemm, mxfp4=True)
        assert {c.num_warps for c in dense} == {4} and {c.num_warps for c in packed} == {4, 8}
        assert {c.block_n for c in packed} == {64, 128, 256}
        assert any(c.num_warps == 8 and c.block_n == 128 for c in packed)
        assert len(packed) > len(dense)
    # Past decode the sweep is the bf16 one, its shared-memory filter at half-byte weight tiles.
    assert set(tune_moe.candidates(4096, 4, 32, 2)) <= set(tune_moe.candidates(4096, 4, 32, 2, mxfp4=True))
