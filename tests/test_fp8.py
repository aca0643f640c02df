"""Block-scaled FP8 base experts (``triton_ops.fp8``) with LoRA in the activations' dtype.

The reference is the PyTorch path with ``fp8=``: fp32 products of the dequantized weights with x and h
quantized the same way (per token and ``block_k`` group), the LoRA terms on the unquantized x and h. The
Triton path differs from it in accumulation order and in h's value before quantization (fp32 sums in
another order, then rounded to x's dtype): where that flips h's FP8 rounding, one term of a GEMM2 row moves
by one FP8 step (2^-3 of it). Tolerance: 1 % of the output's largest magnitude; a wrong scale block or a
LoRA term lost is tens of percent."""

from __future__ import annotations

import json
import os

import pytest
import torch

from moelora.integrations import attach
from moelora.pool import MoELoRAMemoryPool
from moelora.torch_path import (
    dequantize_fp8_blocks,
    fp8_group_roundtrip,
    moe_lora_forward_torch,
    quantize_fp8_blocks,
)
from triton_ops.fp8 import FP8_DTYPE, FP8_MAX, MIN_AMAX, BlockFp8Weights, quantize_fp8_groups
from triton_ops.fused_experts import MoELoRAInputs, fused_experts
from triton_ops.overrides import LAUNCH_OVERRIDES

F16 = torch.float16


@pytest.mark.interpreter
# 1 and 33 rows (past one 16-row block); K 128 (one group), 200 (a partial second group); groups 64, 128.
@pytest.mark.parametrize("rows,k,group", [(1, 128, 128), (33, 200, 128), (5, 200, 64)])
@pytest.mark.parametrize("dtype", [F16, torch.float32])
def test_quantize_groups_matches_torch_interpreter(rows, k, group, dtype):
    x = (torch.randn(rows, k) * 3).to(dtype)
    x[0, :group] = 0  # an all-zero group: a tiny scale, zeros out
    q, scales = quantize_fp8_groups(x, group)
    groups = -(-k // group)
    assert q.dtype == FP8_DTYPE and scales.shape == (rows, groups)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(rows, groups, group)
    want_scales = padded.abs().amax(dim=2).clamp_min(MIN_AMAX) / FP8_MAX
    want_q = (padded / want_scales[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(rows, -1)[:, :k]
    assert torch.equal(scales, want_scales)
    assert torch.equal(q.float(), want_q.float())
    assert torch.equal(q[0, :group].float(), torch.zeros(group))


def test_weight_blocks_roundtrip():
    w = torch.randn(3, 200, 136)
    q, scale = quantize_fp8_blocks(w, (128, 128))
    assert q.dtype == FP8_DTYPE and scale.shape == (3, 2, 2)
    back = dequantize_fp8_blocks(q, scale, (128, 128))
    # e4m3 keeps 3 mantissa bits: every element within 2^-4 of its block's largest magnitude.
    blocks_max = w.abs().amax()
    assert (back - w).abs().max() <= blocks_max / 16


E, H, INTER = 4, 200, 136  # H: a partial K group; INTER: the up rows start inside a scale block
ADAPTERS = {"a": 8, "b": 3}  # ranks that differ per adapter


def _case(m, top_k, seed=0):
    torch.manual_seed(seed)
    w13 = torch.randn(E, 2 * INTER, H) / H**0.5
    w2 = torch.randn(E, H, INTER) / INTER**0.5
    w13_q, w13_s = quantize_fp8_blocks(w13)
    w2_q, w2_s = quantize_fp8_blocks(w2)
    fp8 = BlockFp8Weights(w13_s, w2_s, (128, 128))
    x = torch.randn(m, H).to(F16)
    logits = torch.randn(m, E)
    logits[:, E - 1] = float("-inf")  # an expert no token picks
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return x, w13_q, w2_q, fp8, weights.float().contiguous(), ids.to(torch.int32).contiguous()


def _pool_and_batch(m):
    from test_lora_layer import make_adapter

    pool = MoELoRAMemoryPool(E, H, INTER, [0], max_loras=4, max_rank=8, dtype=F16, device="cpu")
    for name, rank in ADAPTERS.items():
        pool.add_adapter_weights(name, make_adapter(rank, 2.0, F16, layers=(0,), num_experts=E, hidden=H,
                                                    inter=INTER))
    names = [("a", None, "b")[t % 3] for t in range(m)]  # tokens with no adapter
    return pool, pool.prepare_batch(names)


def _lora_inputs(pool, batch):
    buffers = pool.layer(0)
    return MoELoRAInputs(token_slots=batch.token_slots, gate_up_a=buffers.gate_up_a,
                         gate_up_b=buffers.gate_up_b, down_a=buffers.down_a, down_b=buffers.down_b,
                         slot_ranks=batch.slot_ranks,
                         slot_scalings=batch.slot_scalings, max_rank=batch.max_rank,
                         num_adapters=len(batch.slots_used))


def _triton_and_torch(x, w13, w2, fp8, weights, ids, path):
    """``fused_experts`` on FP8 experts and the PyTorch path's reference, with the fixture adapters on
    ``path`` (None: the base alone) and tokens without one."""
    pool, batch = _pool_and_batch(x.shape[0])
    lora = None if path is None else _lora_inputs(pool, batch)
    got = fused_experts(x, w13, w2, weights, ids, fp8=fp8, lora=lora, lora_path=path or "split")
    want = moe_lora_forward_torch(x, w13, w2, weights, ids, pool.layer(0) if path else None,
                                  batch if path else None, fp8=fp8)
    return got, want


def _close(got, want, tolerance=0.01):
    scale = want.float().abs().max()
    err = (got.float() - want.float()).abs().max()
    assert err <= tolerance * scale, f"max error {err:.4g} against output scale {scale:.4g}"


@pytest.mark.interpreter
# 1 token: direct pairs, fused top-k sum; 5: the one-program alignment and the decode shrinks; 67: the
# three-launch alignment and the prefill shrinks. Top-k 1 and 2.
@pytest.mark.parametrize("m,top_k", [(1, 2), (5, 2), (67, 2), (5, 1)])
@pytest.mark.parametrize("path", [None, "split", "staged"])
def test_fp8_experts_match_torch_path_interpreter(m, top_k, path):
    x, w13, w2, fp8, weights, ids = _case(m, top_k)
    got, want = _triton_and_torch(x, w13, w2, fp8, weights, ids, path)
    _close(got, want)
    if path is not None:  # the adapters show: not the base output
        base = moe_lora_forward_torch(x, w13, w2, weights, ids, None, None, fp8=fp8)
        assert (want.float() - base.float()).abs().max() > 0.1 * base.float().abs().max()


def _dequantized_loop_reference(x, w13, w2, fp8, weights, ids):
    """The FP8 layer's math written out per token and pair (fp32, SiLU, no LoRA): dequantized weights, x
    rounded through FP8 per group, h rounded to x's dtype and then through FP8."""
    group = fp8.block_shape[1]
    w13_d = dequantize_fp8_blocks(w13, fp8.w13_scale, fp8.block_shape)
    w2_d = dequantize_fp8_blocks(w2, fp8.w2_scale, fp8.block_shape)
    inter = w2.shape[2]
    xq = fp8_group_roundtrip(x, group).float()
    want = torch.zeros(x.shape[0], w2.shape[1])
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w13_d[e] @ xq[t]
            h = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            hq = fp8_group_roundtrip(h.to(x.dtype)[None], group).float()[0]
            want[t] += weights[t, j] * (w2_d[e] @ hq)
    return want


@pytest.mark.interpreter
# I = 128: GEMM1's gate and up tiles each in one scale block (one weight scale per step); I = 136: the up
# rows start inside a block (a scale per column). GEMM2 (N = H = 200) takes one per tile in both.
@pytest.mark.parametrize("inter", [128, 136])
def test_fp8_tile_scales_are_exact_interpreter(inter, monkeypatch):
    """One weight scale per tile and step gives the same bits as a scale per column."""
    torch.manual_seed(1)
    w13, w13_s = quantize_fp8_blocks(torch.randn(E, 2 * inter, H) / H**0.5)
    w2, w2_s = quantize_fp8_blocks(torch.randn(E, H, inter) / inter**0.5)
    fp8 = BlockFp8Weights(w13_s, w2_s, (128, 128))
    x = torch.randn(5, H).to(F16)
    weights, ids = torch.softmax(torch.randn(5, E), -1).topk(2, dim=-1)
    weights, ids = weights.contiguous(), ids.to(torch.int32).contiguous()
    tile = fused_experts(x, w13, w2, weights, ids, fp8=fp8)
    monkeypatch.setitem(LAUNCH_OVERRIDES, "fp8_tile_scale", "0")
    column = fused_experts(x, w13, w2, weights, ids, fp8=fp8)
    assert torch.equal(tile, column)
    want = moe_lora_forward_torch(x, w13, w2, weights, ids, None, None, fp8=fp8)
    _close(tile, want)


def _tensor_scaled(weight, per_channel):
    """``weight`` (E, N, K) as float8_e4m3fn with one scale per expert (or per expert and row)."""
    dims = (2,) if per_channel else (1, 2)
    scale = weight.abs().amax(dim=dims).clamp_min(MIN_AMAX) / FP8_MAX
    view = scale[:, :, None] if per_channel else scale[:, None, None]
    return (weight / view).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


@pytest.mark.interpreter
# Per-tensor (one scale per expert and projection) and per-channel (one per output row); 1 token (direct
# pairs) and 5 with the split LoRA; I = 136 puts the up rows inside a 128-row block.
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("m,path", [(1, None), (5, "split")])
def test_per_tensor_and_per_channel_fp8_interpreter(per_channel, m, path):
    _, _, _, _, weights, ids = _case(m, 2)
    torch.manual_seed(3)
    w13, w13_s = _tensor_scaled(torch.randn(E, 2 * INTER, H) / H**0.5, per_channel)
    w2, w2_s = _tensor_scaled(torch.randn(E, H, INTER) / INTER**0.5, per_channel)
    fp8 = BlockFp8Weights.from_scales(w13, w2, w13_s, w2_s)
    assert fp8.block_shape == ((1, 128) if per_channel else (8, 128))  # per-tensor: gcd(2I, H) rows
    rows = (slice(None), slice(None), None) if per_channel else (slice(None), None, None)
    # The block layout dequantizes to exactly the weights times their tensor or channel scales.
    assert torch.equal(dequantize_fp8_blocks(w13, fp8.w13_scale, fp8.block_shape), w13.float() * w13_s[rows])
    assert torch.equal(dequantize_fp8_blocks(w2, fp8.w2_scale, fp8.block_shape), w2.float() * w2_s[rows])
    _close(*_triton_and_torch(torch.randn(m, H).to(F16), w13, w2, fp8, weights, ids, path))


def test_scale_layouts_refusals():
    x, w13, w2, fp8, weights, ids = _case(3, 2)
    with pytest.raises(ValueError, match=r"w13_scale must be \(E,\), \(E, rows\) or \(E, rows, cols\) "
                                         r"with E = 4, got \(3,\)"):
        BlockFp8Weights.from_scales(w13, w2, torch.ones(3), torch.ones(E))
    with pytest.raises(ValueError, match=r"w2_scale of shape \(4, 3, 1\) fits no FP8 scale layout"):
        BlockFp8Weights.from_scales(w13, w2, torch.ones(E), torch.ones(E, 3, 1))
    with pytest.raises(ValueError, match=r"per half \(E, 2, 1\), block-scaled \(3, 2\)"):
        BlockFp8Weights.from_scales(w13, w2, torch.ones(E, 2, 5), torch.ones(E), block_size=(128, 128))
    with pytest.raises(TypeError, match="must be torch.Tensors"):
        BlockFp8Weights.from_scales(w13, w2, 1.0, torch.ones(E))


@pytest.mark.interpreter
# transformers' FP8Experts layouts beside the block one: two scale rows for gate_up_proj, one per half,
# where 2I fits one block (I = 32 here, 128 x 128 blocks) or without block_size (per tensor per half).
@pytest.mark.parametrize("block_size", [(128, 128), None])
def test_fp8_scales_per_gate_up_half_interpreter(block_size):
    inter = 32
    torch.manual_seed(4)
    w13_full = torch.randn(E, 2 * inter, H) / H**0.5
    w2_full = torch.randn(E, H, inter) / inter**0.5
    halves = w13_full.view(E, 2, inter, H)
    if block_size is None:
        w13_scale = halves.abs().amax(dim=(2, 3)).clamp_min(MIN_AMAX)[:, :, None] / FP8_MAX  # (E, 2, 1)
        w2_scale = w2_full.abs().amax(dim=(1, 2)).clamp_min(MIN_AMAX)[:, None, None] / FP8_MAX  # (E, 1, 1)
        w2 = (w2_full / w2_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    else:
        padded = torch.nn.functional.pad(halves, (0, 256 - H)).view(E, 2, inter, 2, 128)
        w13_scale = padded.abs().amax(dim=(2, 4)).clamp_min(MIN_AMAX) / FP8_MAX  # (E, 2, cdiv(H, 128))
        w2, w2_scale = quantize_fp8_blocks(w2_full, block_size)
    full_rows = w13_scale.repeat_interleave(inter, dim=1)
    full = full_rows.repeat_interleave(128, dim=2)[:, :, :H] if block_size else full_rows
    w13 = (w13_full / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    fp8 = BlockFp8Weights.from_scales(w13, w2, w13_scale, w2_scale, block_size=block_size)
    assert fp8.block_shape == ((32, 128) if block_size else (8, 128))  # gcd(I, 128) and gcd(I, H)
    assert torch.equal(dequantize_fp8_blocks(w13, fp8.w13_scale, fp8.block_shape), w13.float() * full)
    x, _, _, _, weights, ids = _case(5, 2)
    got = fused_experts(x, w13, w2, weights, ids, fp8=fp8)
    _close(got, moe_lora_forward_torch(x, w13, w2, weights, ids, None, None, fp8=fp8))


@pytest.mark.interpreter
# 67 tokens, top-2, two adapters and tokens without one: aligned prefill GEMMs with packed shrinks.
@pytest.mark.parametrize("forced", ["1", "gemm2"])
def test_fp8_packed_shrinks_interpreter(forced, monkeypatch):
    """FP8 GEMMs take the slot-range expand (``lora_ext_expand``) only where forced; forced, the packed
    shrink stays in the LoRA's dtype (the GEMM's a is FP8) and the layer matches the torch path."""
    from triton_ops.fused_experts import plan_chunk

    x, w13, w2, fp8, weights, ids = _case(67, 2)
    pool, batch = _pool_and_batch(67)
    lora = _lora_inputs(pool, batch)
    args = (67, 2, E, H, INTER, F16, torch.device("cpu"))
    plan = dict(lora=lora, lora_path="split", config=None, combine=True, scale_block_k=128)
    monkeypatch.setitem(LAUNCH_OVERRIDES, "lora_ext", forced)
    forced_plan = plan_chunk(*args, **plan)
    assert forced_plan.pack_down and forced_plan.pack_gate_up == (forced == "1")
    got = fused_experts(x, w13, w2, weights, ids, fp8=fp8, lora=lora, lora_path="split")
    _close(got, moe_lora_forward_torch(x, w13, w2, weights, ids, pool.layer(0), batch, fp8=fp8))
    monkeypatch.delitem(LAUNCH_OVERRIDES, "lora_ext", raising=False)
    rule_plan = plan_chunk(*args, **plan)
    assert not (rule_plan.pack_down or rule_plan.pack_gate_up)


def test_deepseek_per_expert_checkpoint_stacks_into_the_block_layout():
    """DeepSeek-V3's checkpoints hold each expert's gate, up and down weights with their own
    ``weight_scale_inv``; stacked as docs/architecture.md says (gate rows, then up rows) they are the block
    layout: the stacked weights dequantize to the per-expert ones. I = 256: whole 128-row blocks per half."""
    experts, hidden, inter = 3, 200, 256
    torch.manual_seed(6)
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    parts = {name: [quantize_fp8_blocks(torch.randn(n, k)) for _ in range(experts)]
             for name, (n, k) in shapes.items()}
    w13 = torch.stack([torch.cat([g[0], u[0]]) for g, u in zip(parts["gate"], parts["up"], strict=True)])
    s13 = torch.stack([torch.cat([g[1], u[1]]) for g, u in zip(parts["gate"], parts["up"], strict=True)])
    w2 = torch.stack([d[0] for d in parts["down"]])
    s2 = torch.stack([d[1] for d in parts["down"]])
    fp8 = BlockFp8Weights(s13, s2)
    fp8.check(w13, w2)
    for e in range(experts):
        want = torch.cat([dequantize_fp8_blocks(*parts[name][e], (128, 128)) for name in ("gate", "up")])
        assert torch.equal(dequantize_fp8_blocks(w13[e], s13[e], fp8.block_shape), want)


def test_fp8_torch_path_is_the_dequantized_layer():
    """The FP8 torch path equals the bf16-free math it states: dequantized weights, x and h rounded
    through FP8 per group."""
    x, w13, w2, fp8, weights, ids = _case(3, 2)
    got = moe_lora_forward_torch(x, w13, w2, weights, ids, None, None, fp8=fp8).float()
    want = _dequantized_loop_reference(x, w13, w2, fp8, weights, ids)
    torch.testing.assert_close(got, want.to(F16).float(), rtol=2e-3, atol=2e-3)


def test_fp8_refusals():
    x, w13, w2, fp8, weights, ids = _case(3, 2)
    with pytest.raises(ValueError, match="need their block scales"):
        fused_experts(x, w13, w2, weights, ids)
    with pytest.raises(ValueError, match="need their block scales"):
        moe_lora_forward_torch(x, w13, w2, weights, ids, None, None)
    bad = BlockFp8Weights(fp8.w13_scale[:, :1], fp8.w2_scale, (128, 128))
    with pytest.raises(ValueError, match=r"w13_scale must be \(E, cdiv\(N, 128\), cdiv\(K, 128\)\)"):
        fused_experts(x, w13, w2, weights, ids, fp8=bad)
    with pytest.raises(TypeError, match="must have dtype torch.float8_e4m3fn"):
        fused_experts(x, w13.float().to(F16), w2.float().to(F16), weights, ids, fp8=fp8)
    with pytest.raises(ValueError, match="block_k must be 32, 64, 128"):
        fused_experts(x, w13, w2, weights, ids, fp8=BlockFp8Weights(fp8.w13_scale, fp8.w2_scale, (128, 100)))
    with pytest.raises(TypeError, match="BlockFp8Weights"):
        fused_experts(x, w13, w2, weights, ids, fp8=(fp8.w13_scale, fp8.w2_scale))
    from triton_ops.configs import GemmConfig
    from triton_ops.fused_moe import invoke_fused_moe_kernel

    with pytest.raises(TypeError, match="a_scale and b_scale belong to float8_e4m3fn a and b"):
        x_q, x_scale = quantize_fp8_groups(x, 128)
        invoke_fused_moe_kernel(x, w13.float().to(F16), torch.empty(ids.numel(), INTER, dtype=F16),
                                topk_weights=None, a_row_div=2, config=GemmConfig(16, 32, 128, 1, 4, 2),
                                activation="silu", direct_ids=ids.reshape(-1), a_scale=x_scale,
                                b_scale=fp8.w13_scale, scale_block_n=128)
    with pytest.raises(TypeError, match="BlockFp8Weights"):
        moe_lora_forward_torch(x, w13, w2, weights, ids, None, None, fp8=(fp8.w13_scale, fp8.w2_scale))
    pool, batch = _pool_and_batch(3)
    with pytest.MonkeyPatch.context() as env:
        env.setitem(LAUNCH_OVERRIDES, "fp8_lora_tiles", "fp16")
        with pytest.raises(ValueError, match="fp8_lora_tiles must be auto, bf16 or fp8, got 'fp16'"):
            fused_experts(x, w13, w2, weights, ids, fp8=fp8, lora=_lora_inputs(pool, batch),
                          lora_path="split")
    with pytest.raises(ValueError, match="lora_path 'split' or 'staged'"):
        fused_experts(x, w13, w2, weights, ids, fp8=fp8, lora=_lora_inputs(pool, batch), lora_path="fused")


def _fp8_layer(path, device="cpu", dtype=F16):
    from test_lora_layer import make_adapter

    from moelora.layer import FusedMoEWithLoRA

    x, w13, w2, fp8, weights, ids = _case(7, 2)
    pool = MoELoRAMemoryPool(E, H, INTER, [0], max_loras=4, max_rank=8, dtype=dtype, device=device)
    for name, rank in ADAPTERS.items():
        pool.add_adapter_weights(name, make_adapter(rank, 2.0, dtype, layers=(0,), num_experts=E, hidden=H,
                                                    inter=INTER))
    move = dict(device=device)
    fp8 = BlockFp8Weights(fp8.w13_scale.to(**move), fp8.w2_scale.to(**move), fp8.block_shape)
    layer = FusedMoEWithLoRA(w13.to(**move), w2.to(**move), pool=pool, layer_id=0, path=path, fp8=fp8)
    batch = pool.prepare_batch([("a", None, "b")[t % 3] for t in range(7)])
    return layer, x.to(device=device, dtype=dtype), weights.to(**move), ids.to(**move), batch


@pytest.mark.interpreter
# Block scales, and per-tensor ones (stride-0 scale tensors through the recorded trace).
@pytest.mark.parametrize("per_tensor", [False, True])
def test_fp8_layer_matches_torch_path_interpreter(per_tensor):
    """The layer with FP8 experts: the Triton split path (a trace recorded, then replayed) against the
    layer's own PyTorch path."""
    from moelora.layer import FusedMoEWithLoRA

    layer, x, weights, ids, batch = _fp8_layer("split")
    if per_tensor:
        w13, w13_s = _tensor_scaled(dequantize_fp8_blocks(layer.w13, layer.fp8.w13_scale, (128, 128)), False)
        w2, w2_s = _tensor_scaled(dequantize_fp8_blocks(layer.w2, layer.fp8.w2_scale, (128, 128)), False)
        fp8 = BlockFp8Weights.from_scales(w13, w2, w13_s, w2_s)
        assert fp8.w13_scale.stride(2) == 0
        layer = FusedMoEWithLoRA(w13, w2, pool=layer.pool, layer_id=0, path="split", fp8=fp8)
    torch_layer = FusedMoEWithLoRA(layer.w13, layer.w2, pool=layer.pool, layer_id=0, path="torch",
                                   fp8=layer.fp8)
    want = torch_layer(x, weights, ids, batch)
    for _ in range(2):  # records, then replays
        _close(layer(x, weights, ids, batch), want)
    assert len(layer.launch_cache.traces) == 1


def test_fp8_layer_refusals():
    x, w13, w2, fp8, weights, ids = _case(3, 2)
    pool = MoELoRAMemoryPool(E, H, INTER, [0], max_loras=2, max_rank=8, dtype=F16, device="cpu")
    from moelora.layer import FusedMoEWithLoRA

    with pytest.raises(ValueError, match="need their block scales"):
        FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=0)
    with pytest.raises(ValueError, match="path 'auto', 'split', 'staged' or 'torch'"):
        FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=0, fp8=fp8, path="fused")


def _gpu_case(m, num_experts, hidden, inter, top_k, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, device="cuda", generator=gen) / inter**0.5
    w13_q, w13_s = quantize_fp8_blocks(w13)
    w2_q, w2_s = quantize_fp8_blocks(w2)
    x = torch.randn(m, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    logits = torch.randn(m, num_experts, device="cuda", generator=gen)
    logits[:, 0] = float("-inf")  # an expert no token picks
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return x, w13_q, w2_q, BlockFp8Weights(w13_s, w2_s), weights.float().contiguous(), ids.to(torch.int32)


def _gpu_lora(m, num_experts, hidden, inter, seed=1):
    """Slots 0-2 hold ranks 16, 5 and 9; tokens use them and none (-1) in turn."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    slots, rank = 4, 16

    def rnd(*dims, fan_in):
        return (torch.randn(*dims, device="cuda", generator=gen) / fan_in**0.5).to(torch.bfloat16)

    ranks = (16, 5, 9, 0)
    token_slots = torch.tensor([(0, -1, 1, 2)[t % 4] for t in range(m)], device="cuda", dtype=torch.int32)
    gate_up_a, gate_up_b = rnd(slots, num_experts, 2 * rank, hidden, fan_in=hidden), rnd(
        slots, num_experts, 2 * inter, rank, fan_in=rank)
    down_a, down_b = rnd(slots, num_experts, rank, inter, fan_in=inter), rnd(
        slots, num_experts, hidden, rank, fan_in=rank)
    for slot, r in enumerate(ranks):  # the pool's layout: rank columns past a slot's rank are zeros
        gate_up_a[slot, :, r:rank] = 0
        gate_up_a[slot, :, rank + r:] = 0
        gate_up_b[slot, :, :, r:] = 0
        down_a[slot, :, r:] = 0
        down_b[slot, :, :, r:] = 0
    return MoELoRAInputs(
        token_slots=token_slots, gate_up_a=gate_up_a, gate_up_b=gate_up_b, down_a=down_a, down_b=down_b,
        slot_ranks=torch.tensor(ranks, device="cuda", dtype=torch.int32),
        slot_scalings=torch.full((slots,), 2.0, device="cuda"), max_rank=rank, num_adapters=3)


def _torch_reference(x, w13, w2, fp8, weights, ids, lora):
    """The PyTorch path's FP8 math with the same LoRA buffers (a pool layer's layout)."""
    from types import SimpleNamespace

    from moelora.pool import DenseLoRA

    if lora is None:
        return moe_lora_forward_torch(x, w13, w2, weights, ids, None, None, fp8=fp8)
    buffers = DenseLoRA(gate_up_a=lora.gate_up_a, gate_up_b=lora.gate_up_b, down_a=lora.down_a,
                        down_b=lora.down_b)
    batch = SimpleNamespace(num_tokens=x.shape[0], token_slots=lora.token_slots, has_lora=True,
                            slot_scalings=lora.slot_scalings)
    return moe_lora_forward_torch(x, w13, w2, weights, ids, buffers, batch, fp8=fp8)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [
    (16, 2048, 768, 8),  # Qwen3-30B-A3B's expert sizes and top-8
    (8, 7168, 2048, 8),  # DeepSeek-V3's
])
# 1: direct pairs, fused top-k sum; 7: one-program alignment, decode shrinks; 300: prefill (odd).
@pytest.mark.parametrize("m", [1, 7, 300])
@pytest.mark.parametrize("path", [None, "split", "staged"])
def test_fp8_experts_match_torch_path_gpu(shape, m, path):
    num_experts, hidden, inter, top_k = shape
    x, w13, w2, fp8, weights, ids = _gpu_case(m, num_experts, hidden, inter, top_k)
    lora = None if path is None else _gpu_lora(m, num_experts, hidden, inter)
    got = fused_experts(x, w13, w2, weights, ids, fp8=fp8, lora=lora, lora_path=path or "split")
    # bf16 outputs: each side rounds to bf16 (2^-8 relative, so up to 0.8 % of the output scale apart near
    # its largest values), on top of the FP8 flips of the module docstring: 2 %.
    _close(got, _torch_reference(x, w13, w2, fp8, weights, ids, lora), tolerance=0.02)


@pytest.mark.gpu
# Qwen3-30B-A3B's sizes (I = 768: gate and up tiles in one scale block each); 300 tokens: prefill tiles.
@pytest.mark.parametrize("m", [1, 300])
def test_fp8_tile_scales_are_exact_gpu(m, monkeypatch):
    x, w13, w2, fp8, weights, ids = _gpu_case(m, 16, 2048, 768, 8)
    tile = fused_experts(x, w13, w2, weights, ids, fp8=fp8)
    monkeypatch.setitem(LAUNCH_OVERRIDES, "fp8_tile_scale", "0")
    assert torch.equal(fused_experts(x, w13, w2, weights, ids, fp8=fp8), tile)


@pytest.mark.gpu
# Qwen3-30B-A3B's sizes; 1 token (direct pairs, one-row LoRA) and 300 (prefill tiles); per-channel
# scales read one scale per column, per-tensor ones one per tile.
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("m", [1, 300])
def test_per_tensor_and_per_channel_fp8_gpu(per_channel, m):
    x, w13, w2, fp8, weights, ids = _gpu_case(m, 16, 2048, 768, 8)
    w13, w13_s = _tensor_scaled(dequantize_fp8_blocks(w13, fp8.w13_scale, fp8.block_shape), per_channel)
    w2, w2_s = _tensor_scaled(dequantize_fp8_blocks(w2, fp8.w2_scale, fp8.block_shape), per_channel)
    tensor_fp8 = BlockFp8Weights.from_scales(w13, w2, w13_s, w2_s)
    lora = _gpu_lora(m, 16, 2048, 768)
    got = fused_experts(x, w13, w2, weights, ids, fp8=tensor_fp8, lora=lora, lora_path="split")
    # As test_fp8_experts_match_torch_path_gpu: bf16 rounding on both sides plus FP8 flips of h.
    _close(got, _torch_reference(x, w13, w2, tensor_fp8, weights, ids, lora), tolerance=0.02)


@pytest.mark.gpu
def test_fp8_experts_in_cuda_graph_gpu():
    x, w13, w2, fp8, weights, ids = _gpu_case(4, 16, 2048, 768, 8)
    lora = _gpu_lora(4, 16, 2048, 768)

    def call():
        return fused_experts(x, w13, w2, weights, ids, fp8=fp8, lora=lora, lora_path="split")

    from moelora.bench import warm_up_on_side_stream

    eager = call()
    warm_up_on_side_stream(call)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_dependent_fp8_decode_switch(monkeypatch):
    """``fp8_dependent_decode`` is on by default where dependent launch exists (never on the CPU or
    in the interpreter); a value other than 0/1 is refused by name."""
    from triton_ops.pdl import dependent_fp8_decode

    monkeypatch.delitem(LAUNCH_OVERRIDES, "fp8_dependent_decode", raising=False)
    assert not dependent_fp8_decode(torch.device("cpu"))
    monkeypatch.setitem(LAUNCH_OVERRIDES, "fp8_dependent_decode", "yes")
    with pytest.raises(ValueError, match="fp8_dependent_decode"):
        dependent_fp8_decode(torch.device("cpu"))


@pytest.mark.gpu
# Qwen3-30B-A3B's expert shape (the chain's measured win); with adapters the chain is GEMM1 -> h
# quantization -> GEMM2, without them it starts at x's quantization.
@pytest.mark.parametrize("adapters", [False, True])
def test_fp8_dependent_decode_chain_bit_equal_over_replays_gpu(adapters, monkeypatch):
    """One token's FP8 launches chained by dependent launch give, in graph replays with new x, routing
    (and slot) each time, bit for bit what plain launches give: a link that read its input before the
    launch before it finished would show as a stale replay."""
    from triton_ops.pdl import dependent_fp8_decode

    if not dependent_fp8_decode(torch.device("cuda")):
        pytest.skip("dependent launch needs sm_90 or later")
    x, w13, w2, fp8, weights, ids = _gpu_case(1, 128, 2048, 768, 8)
    lora = _gpu_lora(1, 128, 2048, 768) if adapters else None

    def call():
        return fused_experts(x, w13, w2, weights, ids, fp8=fp8, lora=lora, lora_path="split")

    from moelora.bench import warm_up_on_side_stream

    warm_up_on_side_stream(call)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    gen = torch.Generator("cuda").manual_seed(4)
    for step in range(8):
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda").to(x.dtype))
        ids.copy_(torch.randperm(128, generator=gen, device="cuda")[:8].to(torch.int32).view(1, 8))
        if lora is not None:
            lora.token_slots.fill_((0, -1, 2)[step % 3])
        graph.replay()
        torch.cuda.synchronize()
        monkeypatch.setitem(LAUNCH_OVERRIDES, "fp8_dependent_decode", "0")
        plain = call()
        monkeypatch.delitem(LAUNCH_OVERRIDES, "fp8_dependent_decode", raising=False)
        assert torch.equal(out, plain), f"replay {step} differs from the plain launches"


def test_from_base_reads_transformers_fp8_experts():
    """transformers' fine-grained ``FP8Experts`` (weights, ``*_scale_inv`` block scales, ``block_size``):
    ``from_base`` serves them with their scales; the layer's output is the dequantized experts' math."""
    from transformers import Qwen3MoeConfig
    from transformers.integrations.finegrained_fp8 import FP8Experts

    from moelora.layer import FusedMoEWithLoRA

    hidden, inter, experts = 256, 128, 4
    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                            hidden_act="silu")
    module = FP8Experts(config, block_size=(128, 128))
    torch.manual_seed(0)
    for name, (n, k) in (("gate_up_proj", (2 * inter, hidden)), ("down_proj", (hidden, inter))):
        q, scale = quantize_fp8_blocks(torch.randn(experts, n, k) / k**0.5)
        getattr(module, name).data.copy_(q)
        getattr(module, f"{name}_scale_inv").data.copy_(scale)
    pool = MoELoRAMemoryPool(experts, hidden, inter, [0], max_loras=2, max_rank=8, dtype=torch.bfloat16,
                             device="cpu")
    layer = FusedMoEWithLoRA.from_base(module, pool=pool, layer_id=0, path="torch")
    assert layer.fp8 is not None and layer.fp8.block_shape == (128, 128)
    assert layer.w13.data_ptr() == module.gate_up_proj.data_ptr()  # shared, not copied
    x = torch.randn(3, hidden).to(torch.bfloat16)
    weights, ids = torch.softmax(torch.randn(3, experts), -1).topk(2, dim=-1)
    got = layer(x, weights, ids.to(torch.int32))
    scales = BlockFp8Weights(module.gate_up_proj_scale_inv.data, module.down_proj_scale_inv.data)
    want = moe_lora_forward_torch(x, module.gate_up_proj.data, module.down_proj.data, weights, ids, None,
                                  None, fp8=scales)
    assert torch.equal(got, want)  # the module's own scales reached the layer
    # The dequantized experts, x and h rounded through FP8 per group: the same within bf16 rounding.
    ref = _dequantized_loop_reference(x, module.gate_up_proj.data, module.down_proj.data, scales, weights,
                                      ids)
    _close(got, ref, tolerance=0.02)  # bf16 output against fp32 (and h's FP8 flips)
    module.block_size = None  # block-shaped scales without their block size: no layout fits them
    with pytest.raises(ValueError, match=r"FP8Experts: w13_scale of shape \(4, 2, 2\) fits no FP8 scale"):
        FusedMoEWithLoRA.from_base(module, pool=pool, layer_id=0)


def test_from_base_reads_vllm_style_fp8_moe():
    """A vLLM/SGLang-style fused MoE module: ``w13_weight`` / ``w2_weight`` float8_e4m3fn with
    ``w13_weight_scale_inv`` / ``w2_weight_scale_inv`` and the block in ``quant_method.quant_config``
    (DeepSeek-V3's ``weight_scale_inv`` layout, stacked per expert)."""
    from types import SimpleNamespace

    from torch import nn

    from moelora.layer import FusedMoEWithLoRA

    x, w13, w2, fp8, weights, ids = _case(5, 2)
    module = nn.Module()
    for name, tensor in (("w13_weight", w13), ("w2_weight", w2), ("w13_weight_scale_inv", fp8.w13_scale),
                         ("w2_weight_scale_inv", fp8.w2_scale)):
        setattr(module, name, nn.Parameter(tensor, requires_grad=False))
    module.quant_method = SimpleNamespace(quant_config=SimpleNamespace(weight_block_size=[128, 128]))
    pool = MoELoRAMemoryPool(E, H, INTER, [0], max_loras=2, max_rank=8, dtype=F16, device="cpu")
    layer = FusedMoEWithLoRA.from_base(module, pool=pool, layer_id=0, path="torch")
    assert layer.fp8.block_shape == (128, 128)
    assert layer.w13.data_ptr() == w13.data_ptr()  # shared, not copied
    want = moe_lora_forward_torch(x, w13, w2, weights, ids, None, None, fp8=fp8)
    assert torch.equal(layer(x, weights, ids.to(torch.int32)), want)
    del module.quant_method  # no block anywhere: these block-shaped scales fit no other layout
    with pytest.raises(ValueError, match="w13_scale of shape .* fits no FP8 scale layout"):
        FusedMoEWithLoRA.from_base(module, pool=pool, layer_id=0)


# transformers' FP8Experts allocates (E, 2, ...) gate_up scales where 2I fits one block (I = 32, 128-row
# blocks), and (E, 2, 1) / (E, 1, 1) per-tensor scales without block_size.
@pytest.mark.parametrize("block_size", [(128, 128), None])
def test_from_base_reads_fp8_experts_scale_layouts(block_size):
    from transformers import Qwen3MoeConfig
    from transformers.integrations.finegrained_fp8 import FP8Experts

    from moelora.layer import FusedMoEWithLoRA

    hidden, inter, experts = 192, 32, 4
    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                            hidden_act="silu")
    module = FP8Experts(config, block_size=block_size)
    torch.manual_seed(5)
    dequantized = {}
    for name, (n, k) in (("gate_up_proj", (2 * inter, hidden)), ("down_proj", (hidden, inter))):
        scale = getattr(module, f"{name}_scale_inv")
        rows, cols = scale.shape[1:]
        scale.data.copy_(torch.rand(experts, rows, cols) / 100 + 1e-3)
        # Rows per scale: a half of gate_up, a 128-row block of down_proj, or all; columns: 128 or all.
        row_block = inter if name == "gate_up_proj" else (128 if block_size else n)
        col_block = 128 if block_size else k
        full = scale.data.repeat_interleave(row_block, 1)[:, :n].repeat_interleave(col_block, 2)[:, :, :k]
        q = (torch.randn(experts, n, k) * 100).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        getattr(module, name).data.copy_(q)
        dequantized[name] = q.float() * full
    pool = MoELoRAMemoryPool(experts, hidden, inter, [0], max_loras=2, max_rank=8, dtype=torch.float32,
                             device="cpu")
    layer = FusedMoEWithLoRA.from_base(module, pool=pool, layer_id=0, path="torch")
    for name, scale_name in (("gate_up_proj", "w13_scale"), ("down_proj", "w2_scale")):
        got = dequantize_fp8_blocks(getattr(module, name).data, getattr(layer.fp8, scale_name),
                                    layer.fp8.block_shape)
        assert torch.equal(got, dequantized[name])


FP8_TWIN_BLOCK = (32, 32)  # the tiny model's H = 64 and I = 32: two K groups in GEMM1, gate/up blocks apart


def _fp8_tiny_qwen3_and_twin():
    """The tiny Qwen3-MoE of ``adapters/`` with its experts as transformers' ``FP8Experts`` (weights
    quantized per 32 x 32 block), and its dequantized twin: the same model with the plain experts holding
    the dequantized weights."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from transformers.integrations.finegrained_fp8 import FP8Experts

    import adapters.make_adapters as mk
    from moelora.integrations.transformers import find_experts_modules

    model, twin = mk.load_tiny_qwen3_moe(), mk.load_tiny_qwen3_moe()
    for (name, _, module), (_, _, twin_module) in zip(find_experts_modules(model), find_experts_modules(twin),
                                                        strict=True):
        fp8_module = FP8Experts(model.config, block_size=FP8_TWIN_BLOCK).eval()
        for pname in ("gate_up_proj", "down_proj"):
            q, scale = quantize_fp8_blocks(getattr(module, pname).data, FP8_TWIN_BLOCK)
            getattr(fp8_module, pname).data.copy_(q)
            getattr(fp8_module, f"{pname}_scale_inv").data.copy_(scale)
            getattr(twin_module, pname).data.copy_(dequantize_fp8_blocks(q, scale, FP8_TWIN_BLOCK))
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, fp8_module)
    return model, twin, mk


def test_attach_fp8_model_matches_peft_on_dequantized_twin():
    """``attach()`` on a model whose experts are transformers' FP8Experts: a mixed batch (two fixture
    adapters, a base row) against PEFT on the dequantized twin, per row. They differ by the activation
    quantization alone: x and h of 3 layers' 6 GEMMs rounded to e4m3 per 32-column group, each element
    within 2^-4 of itself (3 mantissa bits). Through the model that gave 0.5-3.0 % of a row's logit
    scale; tolerance 5 %. The adapters move their rows by 28 % and 99 % of it."""
    model, twin, mk = _fp8_tiny_qwen3_and_twin()
    handle = attach(model, max_loras=4, max_rank=16, path="torch")
    try:
        assert all(module.layer.fp8 is not None for module in handle.modules.values())
        assert handle.pool.dtype == torch.float32  # the model's own dtype, not the experts' FP8
        for name in ("chat", "math"):
            handle.load_adapter(name, mk.ADAPTERS_DIR / name)
        rows = ["chat", None, "math"]
        ids = torch.randint(1, 128, (len(rows), 6), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            with handle.adapters(rows):
                logits = model(input_ids=ids).logits
            base_logits = model(input_ids=ids).logits  # outside the context: FP8 base through the layer
            for row, name in enumerate(rows):
                ref = twin if name is None else mk.load_tiny_qwen3_moe_peft(name, base=_fresh_twin())
                want = ref(input_ids=ids[row : row + 1]).logits[0]
                _close(logits[row], want, tolerance=0.05)
                if name is not None:  # the adapter shows through the FP8 rounding
                    assert (want - twin(input_ids=ids[row : row + 1]).logits[0]).abs().max() > \
                        0.1 * want.abs().max()
            _close(base_logits[1], twin(input_ids=ids[1:2]).logits[0], tolerance=0.05)
    finally:
        handle.detach()


# Everything but the routed experts stays bf16: transformers runs its FP8 linears through kernels fetched
# from the Hub, which a test cannot reach. Each pattern in two forms: a regex from the name's start (newer
# transformers) and a plain substring (older ones).
_NOT_FP8 = ["lm_head", ".*self_attn", "self_attn", r".*mlp\.gate", "mlp.gate", r".*layers\.0\.mlp",
            "layers.0."]


@pytest.mark.gpu
def test_attach_transformers_quantized_fp8_model_gpu():
    """The tiny Qwen3-MoE quantized by transformers itself on load (``FineGrainedFP8Config``, 32 x 32
    blocks: its own FP8Experts, weights and ``*_scale_inv``), served by ``attach()`` on the Triton path: a
    mixed batch (two fixture adapters, a base row) against PEFT on its dequantized bf16 twin, per row.
    Tolerance 5 % of a row's logit scale, as the CPU test: activation rounding to e4m3 per group is the
    difference, bf16 rounding adds well under a percent."""
    from transformers import FineGrainedFP8Config, Qwen3MoeForCausalLM

    import adapters.make_adapters as mk
    from moelora.integrations.transformers import find_experts_modules

    path = str(mk.ADAPTERS_DIR / mk.BASE_NAME)
    config = FineGrainedFP8Config(weight_block_size=list(FP8_TWIN_BLOCK), modules_to_not_convert=_NOT_FP8)
    model = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda",
                                                quantization_config=config).eval()

    fp8_experts = [module for _, _, module in find_experts_modules(model)]
    # The twin's expert weights, read before attach() swaps the FP8Experts modules out.
    dequantized = [{pname: dequantize_fp8_blocks(getattr(m, pname).data,
                                                 getattr(m, f"{pname}_scale_inv").data,
                                                 FP8_TWIN_BLOCK) for pname in ("gate_up_proj", "down_proj")}
                   for m in fp8_experts]

    def twin():
        plain = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda").eval()
        for (_, _, module), weights in zip(find_experts_modules(plain), dequantized, strict=True):
            for pname, weight in weights.items():
                getattr(module, pname).data.copy_(weight)
        return plain

    assert fp8_experts and all(m.gate_up_proj.dtype == FP8_DTYPE for m in fp8_experts)
    assert not any(type(m).__name__ == "FP8Linear" for m in model.modules())
    handle = attach(model, max_loras=4, max_rank=16)
    try:
        assert all(module.layer.fp8 is not None for module in handle.modules.values())
        assert handle.pool.dtype == torch.bfloat16
        for name in ("chat", "math"):
            handle.load_adapter(name, mk.ADAPTERS_DIR / name)
        rows = ["chat", None, "math"]
        ids = torch.randint(1, 128, (len(rows), 6), generator=torch.Generator().manual_seed(3)).cuda()
        with torch.no_grad():
            with handle.adapters(rows):
                logits = model(input_ids=ids).logits.float()
            base_twin = twin()
            for row, name in enumerate(rows):
                ref = base_twin if name is None else mk.load_tiny_qwen3_moe_peft(name, base=twin())
                _close(logits[row], ref(input_ids=ids[row : row + 1]).logits[0].float(), tolerance=0.05)
    finally:
        handle.detach()


def _fresh_twin():
    return _fp8_tiny_qwen3_and_twin()[1]


def test_attach_refuses_fp8_scales_of_no_layout():
    model, _, _ = _fp8_tiny_qwen3_and_twin()
    for module in model.modules():
        if type(module).__name__ == "FP8Experts":
            module.block_size = None
    from moelora.integrations import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="fits no FP8 scale layout") as refused:
        attach(model, path="torch")
    # A ValueError like every refusal, and still a NotImplementedError for callers that caught that.
    assert isinstance(refused.value, ValueError) and isinstance(refused.value, NotImplementedError)


def test_fp8_tuned_files_are_their_own(tmp_path, monkeypatch):
    """FP8 GEMMs read tuned files of their own (dtype=fp8_w8a8), never the bf16 ones; the tuner's FP8
    candidates keep BLOCK_SIZE_K at the scale group."""
    import importlib.util
    from pathlib import Path

    from triton_ops.configs import config_file_name, tuned_moe_config

    name = config_file_name(128, 768, "cpu", FP8_DTYPE)
    assert name == "E=128,N=768,device_name=cpu,dtype=fp8_w8a8.json"
    entry = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 8, "num_warps": 4,
             "num_stages": 3}
    (tmp_path / name).write_text(json.dumps({"64": entry}))
    monkeypatch.setenv("MOELORA_MOE_CONFIG_DIR", str(tmp_path))
    assert tuned_moe_config(64, 128, 768, FP8_DTYPE, "cpu").gemm1.block_n == 128
    assert tuned_moe_config(64, 128, 768, torch.bfloat16, "cpu") is None
    spec = importlib.util.spec_from_file_location(
        "tune_moe", Path(__file__).resolve().parents[1] / "benchmarks" / "tune_moe.py")
    tune_moe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune_moe)
    for m in (1, 64, 4096):
        for gemm in (1, 2):
            found = tune_moe.candidates(m, 8, 128, gemm, block_k=128)
            assert found and {c.block_k for c in found} == {128}


def test_tuner_compile_jobs_share_the_sweep():
    """``tune_moe.py --jobs N``: job j of N runs the sweep's calls j, j + N, ... once each (compiling them),
    times none, and a call that fails (out of resources) is skipped, not fatal."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "tune_moe", Path(__file__).resolve().parents[1] / "benchmarks" / "tune_moe.py")
    tune_moe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune_moe)
    ran = {job: [] for job in range(3)}
    for job in range(3):
        timer = tune_moe.compile_share(job, 3)
        for call in range(8):
            def fn(call=call, job=job):
                ran[job].append(call)
                if call == 4:
                    raise RuntimeError("out of resources")
            assert timer(fn) == float("inf")
    assert ran == {0: [0, 3, 6], 1: [1, 4, 7], 2: [2, 5]}


def test_bench_fp8_table_and_refusal(capsys):
    """``benchmarks/bench_fp8.py``: its table puts each LoRA column's bf16 and FP8 overheads side by side;
    without a GPU it refuses with a usage error instead of failing inside."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "bench_fp8", Path(__file__).resolve().parents[1] / "benchmarks" / "bench_fp8.py")
    bench_fp8 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_fp8)
    record = dict(model="qwen3-30b-a3b", M=64, times_us={"bf16": 400.0, "fp8": 250.0}, fp8_speedup=1.6,
                  fp8_weight_tbps=2.5, fp8_roofline=0.75,
                  overheads={"bf16 r16 x4": 0.1, "fp8 r16 x4": 0.2, "bf16 r64 x1": 0.05, "fp8 r64 x1": 0.08})
    table = bench_fp8.markdown([record], "title")
    assert "| LoRA r16 x4: bf16 / FP8 overhead | LoRA r64 x1: bf16 / FP8 overhead |" in table
    row = "| qwen3-30b-a3b | 64 | 400.0 | 250.0 | 1.60 | 2.50 (0.75) | +10.0 / +20.0 % | +5.0 / +8.0 % |"
    assert row in table
    with pytest.raises(SystemExit):
        bench_fp8.main(["--ab-env", "fp8_tile_scale"])
    assert "--ab-env must be NAME=VALUE" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            bench_fp8.main(["--M", "1", "--ab-env", "fp8_tile_scale=0"])
        assert "needs a CUDA GPU" in capsys.readouterr().err
    calls = []
    switched = bench_fp8.with_env("BENCH_FP8_TEST_SWITCH=on", lambda: calls.append(os.environ.get(
        "BENCH_FP8_TEST_SWITCH")))
    switched()
    assert calls == ["on"] and "BENCH_FP8_TEST_SWITCH" not in os.environ



@pytest.mark.interpreter
# 5 tokens: the decode alignment's 16-row blocks; 67: prefill (16-row blocks where the tiles take them).
@pytest.mark.parametrize("m,top_k", [(5, 2), (67, 2)])
@pytest.mark.parametrize("path", [None, "split"])
def test_fp8_swapped_k_loop_matches_torch_path_interpreter(m, top_k, path, monkeypatch):
    """16-row blocks of FP8 GEMMs accumulate the transposed block-scaled products (``plan.swap_ab``, the
    rule); the layer still matches the PyTorch path, and the GEMMs took the swap (64-column tiles forced)."""
    from triton_ops import fused_moe
    from triton_ops.configs import GemmConfig, MoEConfig

    swapped = []
    real = fused_moe.swap_ab
    monkeypatch.setattr(fused_moe, "swap_ab",
                        lambda config, **kw: swapped.append(real(config, **kw)) or swapped[-1])
    x, w13, w2, fp8, weights, ids = _case(m, top_k)
    pool, batch = _pool_and_batch(x.shape[0])
    lora = None if path is None else _lora_inputs(pool, batch)
    tiles = GemmConfig(16, 64, 128, 1, 4, 2)
    got = fused_experts(x, w13, w2, weights, ids, fp8=fp8, lora=lora, lora_path=path or "split",
                        config=MoEConfig(tiles, tiles))
    want = moe_lora_forward_torch(x, w13, w2, weights, ids, pool.layer(0) if path else None,
                                  batch if path else None, fp8=fp8)
    assert swapped and all(swapped)
    _close(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [16, 64])
def test_swapped_k_loop_on_the_gpu(m, monkeypatch):
    """Compiled kernels at Qwen3-30B-A3B's sizes, block-FP8 experts, 16-row tiles of 64 columns: the layer
    with the swap (FP8 warpgroup MMAs over ``b^T a^T``, the rule) against ``swap_ab=0``. The intermediate is
    quantized to FP8 between the GEMMs: a last-bit difference in the first GEMM's sum (warpgroup FP8 MMAs
    round their sums differently from converted 16x8 ones) moves a few percent of the intermediate's
    values by one FP8 step (2^-4 to 2^-3 of them), so the two layers agree to 2^-6, half the quantization's
    own error (about 2^-5 rms); a wrong scale or transposition misses that by orders of magnitude."""
    from triton_ops.configs import GemmConfig, MoEConfig

    gen = torch.Generator().manual_seed(m)
    experts, top_k, hidden, inter = 128, 8, 2048, 768
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    x = torch.randn(m, hidden, generator=gen).cuda().to(torch.bfloat16)
    weights, ids = torch.softmax(torch.randn(m, experts, generator=gen), -1).topk(top_k, -1)
    weights, ids = weights.cuda(), ids.to(torch.int32).cuda()
    (w13, s13), (w2, s2) = quantize_fp8_blocks(w13.cuda()), quantize_fp8_blocks(w2.cuda())
    kwargs = dict(config=MoEConfig(GemmConfig(16, 64, 128, 1, 4, 4), GemmConfig(16, 64, 128, 1, 4, 4)),
                  fp8=BlockFp8Weights(s13, s2, (128, 128)))
    outs = {}
    for swap in ("0", "1"):
        monkeypatch.setitem(LAUNCH_OVERRIDES, "swap_ab", swap)
        outs[swap] = fused_experts(x, w13, w2, weights, ids, **kwargs).float()
    assert torch.isfinite(outs["1"]).all()
    assert ((outs["1"] - outs["0"]).norm() / outs["0"].norm()).item() < 2.0**-6
