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
