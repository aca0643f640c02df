"""Tests for ``triton_ops.fused_experts`` (and its helpers ``silu_and_mul``, ``moe_sum_reduce``).

``fused_experts`` computes rsf * sum_k w_k * W2_e (act(W_gate x) * W_up x), w13 rows [0, I) being the
gate and [I, 2I) the up projection. The oracle is the fp32 ``moelora.reference.reference_moe``; the
per-pair outputs of ``no_combine=True`` are checked against ``pairwise_oracle`` (``reference_moe_grouped``
per pair: an expert at a time), which is itself checked against ``reference_moe``.

CPU tests (``interpreter``) run the kernels in the Triton interpreter, so the sizes are small and odd.
They are fp32 and fp16 only: the Triton 3.9 interpreter's ``tl.dot`` on bf16 returns garbage. bf16 is
covered by the ``gpu`` tests at real model shapes, which print their errors (``pytest -s``).

The ``interpreter`` mark is put on each CPU test rather than module-wide: conftest skips ``interpreter``
tests on a CUDA machine without TRITON_INTERPRET=1 and ``gpu`` tests under the interpreter, so a ``gpu``
test in an all-``interpreter`` module would never run.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from moelora.reference import reference_moe, reference_moe_grouped
from triton_ops import fused_experts, moe_sum_reduce, silu_and_mul
from triton_ops.overrides import LAUNCH_OVERRIDES

interpreter = pytest.mark.interpreter
gpu = pytest.mark.gpu

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPE_IDS = {F32: "fp32", F16: "fp16", BF16: "bf16", torch.int32: "i32", torch.int64: "i64"}

# (max relative L2 error ||out-ref||/||ref||, max abs error as a fraction of max|ref|), vs the fp32 oracle.
TOL = {F32: (1e-5, 1e-4), F16: (1e-2, 1e-2), BF16: (1e-2, 2e-2)}


# --------------------------------------------------------------------------------------------- helpers


def make_weights(E, H, inter, dtype, device="cpu"):
    """Weights scaled by 1/sqrt(fan_in) so that activations and outputs stay O(1)."""
    w13 = (torch.randn(E, 2 * inter, H, device=device) / math.sqrt(H)).to(dtype)
    w2 = (torch.randn(E, H, inter, device=device) / math.sqrt(inter)).to(dtype)
    return w13, w2


def make_routing(M, E, k, device="cpu", ids_dtype=torch.int32, mode="random"):
    """topk_weights (M, k) float32 and topk_ids (M, k).

    mode "random": softmax top-k over all experts, renormalised; "unused": only odd experts can be
    chosen (at least half the experts get no token); "one": every token picks the same k experts
    (the last k, in a per-token order), so those experts get every token and the rest none.
    """
    logits = torch.randn(M, E, device=device)
    if mode == "unused":
        logits[:, 0::2] = float("-inf")
    if mode == "one":
        chosen = torch.arange(E - k, E, device=device)
        ids = torch.stack([chosen[torch.randperm(k, device=device)] for _ in range(M)])
        weights = torch.rand(M, k, device=device) * 0.8 + 0.2
    else:
        weights, ids = torch.softmax(logits, dim=-1).topk(k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.float().contiguous(), ids.to(ids_dtype).contiguous()


def make_inputs(M, E, k, H, inter, dtype, device="cpu", ids_dtype=torch.int32, mode="random"):
    x = torch.randn(M, H, device=device).to(dtype)
    w13, w2 = make_weights(E, H, inter, dtype, device)
    topk_weights, topk_ids = make_routing(M, E, k, device, ids_dtype, mode)
    return x, w13, w2, topk_weights, topk_ids


def pairwise_oracle(x, w13, w2, topk_weights, topk_ids, *, rsf=1.0, on_input=False, activation="silu"):
    """fp32 per-pair outputs (M, k, H): rsf * w_k * y_k (w_k multiplies x instead when ``on_input``), an
    expert at a time on x's device (``reference_moe_grouped``)."""
    return reference_moe_grouped(x, w13, w2, topk_weights, topk_ids, routed_scaling_factor=rsf,
                                 apply_router_weight_on_input=on_input, activation=activation, combine=False)


def oracle(x, w13, w2, topk_weights, topk_ids):
    """fp32 combined output: ``reference_moe`` on the CPU, ``pairwise_oracle`` on the GPU.

    ``reference_moe`` runs one CPU matvec per (token, k) pair, each reading its expert's weights again:
    seconds for 300 x 6 pairs at DeepSeek-V2-Lite shapes, minutes for 4096 x 6, and far more where GPU
    tests run in parallel processes. On the GPU the vectorised ``pairwise_oracle`` (checked against
    ``reference_moe`` by ``test_pairwise_oracle_agrees_with_reference``) runs in fp32 instead.
    """
    if x.is_cuda:
        return pairwise_oracle(x, w13, w2, topk_weights, topk_ids).sum(1)
    return reference_moe(x, w13, w2, topk_weights, topk_ids)


def assert_close(out, ref, dtype, what=""):
    """Compare the whole tensor (so every element must have been written) with the fp32 oracle."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{what}: non-finite values in the output"
    out32, ref = out.float(), ref.float()
    err = (out32 - ref).abs()
    max_abs, scale = err.max().item(), ref.abs().max().item()
    rel = (err.norm() / ref.norm().clamp_min(1e-30)).item()
    print(f"\n[{what}] max_abs_err={max_abs:.3e} max|ref|={scale:.3e} rel_l2_err={rel:.3e}")
    rel_tol, abs_frac = TOL[dtype]
    if dtype == F32:
        torch.testing.assert_close(
            out32, ref, atol=abs_frac * scale, rtol=abs_frac, msg=lambda m: f"{what}: {m}"
        )
    else:
        assert rel <= rel_tol, f"{what}: relative L2 error {rel:.3e} > {rel_tol:.0e}"
        assert max_abs <= abs_frac * scale, (
            f"{what}: max abs error {max_abs:.3e} > {abs_frac:.0e} * {scale:.3e}"
        )


def run_and_check(M, E, k, H, inter, dtype, *, device="cpu", ids_dtype=torch.int32, mode="random", what=""):
    x, w13, w2, tw, ti = make_inputs(M, E, k, H, inter, dtype, device, ids_dtype, mode)
    x_before = x.clone()
    out = fused_experts(x, w13, w2, tw, ti)
    assert out.dtype == dtype and out.device == x.device
    assert out.data_ptr() != x.data_ptr()
    assert torch.equal(x, x_before), "inplace=False must not modify x"
    assert_close(out, oracle(x, w13, w2, tw, ti), dtype, what)


# ------------------------------------------------------------------------------------- CPU: main path

CASES = [
    # (M, E, k, H, I, dtype, ids dtype)
    # 48, 40: not multiples of the block sizes, exercise the tail masks on H, I and 2I.
    (1, 6, 2, 48, 40, F32, torch.int32),  # single token (decode): one pair per used block
    (3, 6, 1, 48, 40, F16, torch.int32),  # top-1
    (17, 6, 6, 48, 40, F32, torch.int64),  # k == E: every token uses every expert; int64 ids
    (17, 6, 6, 48, 40, F16, torch.int32),
    (17, 64, 8, 48, 40, F32, torch.int32),  # many experts, each with 0-5 pairs: mostly padded blocks
    # 72, 56: another odd pair, with H > 64 so GEMM2's N and GEMM1's K take more than one block.
    (3, 8, 2, 72, 56, F16, torch.int64),
    (17, 64, 6, 72, 56, F16, torch.int32),
    (300, 64, 6, 48, 40, F16, torch.int32),  # several M blocks per expert, tokens gathered far apart
    (300, 6, 2, 72, 56, F32, torch.int32),  # ~100 pairs per expert
    # 64, 32: multiples of the block sizes, a control for the odd shapes above (no masking needed).
    (17, 16, 2, 64, 32, F16, torch.int32),
]


@interpreter
@pytest.mark.parametrize(
    "M,E,k,H,inter,dtype,ids_dtype",
    CASES,
    ids=[f"M{c[0]}-E{c[1]}-k{c[2]}-H{c[3]}-I{c[4]}-{DTYPE_IDS[c[5]]}-{DTYPE_IDS[c[6]]}" for c in CASES],
)
def test_fused_experts_matches_reference(M, E, k, H, inter, dtype, ids_dtype):
    run_and_check(M, E, k, H, inter, dtype, ids_dtype=ids_dtype, what=f"M{M} E{E} k{k} H{H} I{inter} {dtype}")


@interpreter
@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
def test_fused_experts_unused_experts(dtype):
    # Half of the 64 experts (all even ones, expert 0 included) get no token: they must take no blocks
    # and contribute nothing.
    run_and_check(17, 64, 2, 48, 40, dtype, mode="unused", what="unused experts")


@interpreter
@pytest.mark.parametrize(
    "M,E,k,dtype",
    [(300, 6, 1, F16), (17, 64, 6, F32), (1, 64, 8, F16)],
    ids=["M300-E6-k1-fp16", "M17-E64-k6-fp32", "M1-E64-k8-fp16"],
)
def test_fused_experts_all_tokens_same_experts(M, E, k, dtype):
    # Every token on the same k experts (the last ones): all blocks belong to those, the rest are idle.
    run_and_check(M, E, k, 48, 40, dtype, mode="one", what="all tokens on the same experts")


@interpreter
@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
def test_fused_experts_inplace(dtype):
    x, w13, w2, tw, ti = make_inputs(17, 6, 2, 48, 40, dtype)
    ref = reference_moe(x, w13, w2, tw, ti)
    out = fused_experts(x, w13, w2, tw, ti, inplace=True)
    assert out is x or out.data_ptr() == x.data_ptr(), "inplace=True must return x itself"
    assert_close(x, ref, dtype, "inplace")


@interpreter
@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
def test_fused_experts_no_combine(dtype):
    x, w13, w2, tw, ti = make_inputs(17, 8, 6, 48, 40, dtype)
    out = fused_experts(x, w13, w2, tw, ti, no_combine=True, routed_scaling_factor=2.5)
    assert out.shape == (17, 6, 48) and out.dtype == dtype
    assert_close(out, pairwise_oracle(x, w13, w2, tw, ti, rsf=2.5), dtype, "no_combine per pair")
    ref = reference_moe(x, w13, w2, tw, ti, routed_scaling_factor=2.5)
    assert_close(out.float().sum(1), ref, dtype, "no_combine summed")


@interpreter
@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
def test_fused_experts_router_weight_on_input(dtype):
    # top_k = 1: w multiplies x before GEMM1 and not the output. Weights in [0.2, 1), so with the
    # non-linear activation the result differs from the default path.
    x, w13, w2, _, ti = make_inputs(17, 6, 1, 48, 40, dtype)
    tw = torch.rand(17, 1) * 0.8 + 0.2
    out = fused_experts(x, w13, w2, tw, ti, apply_router_weight_on_input=True)
    ref = reference_moe(x, w13, w2, tw, ti, apply_router_weight_on_input=True)
    assert_close(out, ref, dtype, "router weight on input")
    default = reference_moe(x, w13, w2, tw, ti)
    assert (ref - default).norm() > 0.05 * ref.norm(), "test inputs do not tell the two paths apart"


@interpreter
@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
def test_fused_experts_routed_scaling_factor(dtype):
    x, w13, w2, tw, ti = make_inputs(17, 6, 2, 48, 40, dtype)
    out = fused_experts(x, w13, w2, tw, ti, routed_scaling_factor=2.5)
    assert_close(out, reference_moe(x, w13, w2, tw, ti, routed_scaling_factor=2.5), dtype, "rsf=2.5")


@interpreter
@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
def test_fused_experts_gelu(dtype):
    x, w13, w2, tw, ti = make_inputs(17, 6, 2, 72, 56, dtype)
    out = fused_experts(x, w13, w2, tw, ti, activation="gelu")
    ref = reference_moe(x, w13, w2, tw, ti, activation="gelu")
    assert_close(out, ref, dtype, "gelu")
    # Exact (erf) gelu, not the tanh approximation: the oracle below is independent of reference_moe.
    exact = pairwise_oracle(x, w13, w2, tw, ti, activation="gelu").sum(1)
    assert_close(out, exact, dtype, "gelu vs local erf oracle")


@interpreter
def test_fused_experts_all_options_together():
    # gelu + int64 ids + rsf + inplace + an E with unused experts, on the 72/56 odd shape.
    x, w13, w2, tw, ti = make_inputs(17, 64, 2, 72, 56, F16, ids_dtype=torch.int64, mode="unused")
    ref = reference_moe(x, w13, w2, tw, ti, routed_scaling_factor=2.5, activation="gelu")
    out = fused_experts(x, w13, w2, tw, ti, inplace=True, activation="gelu", routed_scaling_factor=2.5)
    assert out.data_ptr() == x.data_ptr()
    assert_close(x, ref, F16, "all options")


@interpreter
@pytest.mark.parametrize("mode", ["plain", "inplace", "no_combine"])
def test_fused_experts_token_chunks(monkeypatch, mode):
    # moe_chunk_tokens=5 splits 17 tokens into chunks of 5, 5, 5, 2: every chunk must land in its
    # own rows of the output (the last, short one included).
    monkeypatch.setitem(LAUNCH_OVERRIDES, "moe_chunk_tokens", "5")
    x, w13, w2, tw, ti = make_inputs(17, 6, 2, 48, 40, F32)
    if mode == "no_combine":
        out = fused_experts(x, w13, w2, tw, ti, no_combine=True)
        assert_close(out, pairwise_oracle(x, w13, w2, tw, ti), F32, "chunks no_combine")
        return
    ref = reference_moe(x, w13, w2, tw, ti)
    out = fused_experts(x, w13, w2, tw, ti, inplace=mode == "inplace")
    assert_close(out, ref, F32, f"chunks {mode}")


@interpreter
def test_fused_experts_deterministic():
    x, w13, w2, tw, ti = make_inputs(17, 6, 2, 48, 40, F16)
    a = fused_experts(x, w13, w2, tw, ti)
    b = fused_experts(x, w13, w2, tw, ti)
    assert torch.equal(a, b)


def test_pairwise_oracle_agrees_with_reference():
    # Keeps the local no_combine oracle honest (and cross-checks reference_moe); no kernel involved.
    x, w13, w2, tw, ti = make_inputs(17, 8, 6, 48, 40, F32)
    for kwargs, local in [
        ({}, {}),
        ({"routed_scaling_factor": 2.5}, {"rsf": 2.5}),
        ({"activation": "gelu"}, {"activation": "gelu"}),
    ]:
        ref = reference_moe(x, w13, w2, tw, ti, **kwargs)
        assert ref.dtype == F32 and ref.shape == (17, 48)
        torch.testing.assert_close(
            pairwise_oracle(x, w13, w2, tw, ti, **local).sum(1), ref, atol=1e-5, rtol=1e-5
        )
    tw1 = torch.rand(17, 1) + 0.2
    ref = reference_moe(x, w13, w2, tw1, ti[:, :1], apply_router_weight_on_input=True)
    local = pairwise_oracle(x, w13, w2, tw1, ti[:, :1], on_input=True).sum(1)
    torch.testing.assert_close(local, ref, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------ CPU: bad input


def _bad(name):
    """Valid inputs (M=3, E=6, k=2, H=48, I=40, fp16) with one thing broken; returns (args, kwargs)."""
    x, w13, w2, tw, ti = make_inputs(3, 6, 2, 48, 40, F16)
    kwargs = {}
    if name == "w13_wrong_H":
        w13 = torch.randn(6, 80, 56).half()
    elif name == "w2_wrong_I":
        w2 = torch.randn(6, 48, 48).half()
    elif name == "w2_wrong_H":
        w2 = torch.randn(6, 56, 40).half()
    elif name == "w13_w2_num_experts":
        w2 = torch.randn(5, 48, 40).half()
    elif name == "topk_ids_vs_weights":
        ti = torch.zeros(3, 3, dtype=torch.int32)
    elif name == "topk_rows_vs_x":
        tw, ti = tw[:2], ti[:2]
    elif name == "x_w13_dtype":
        w13 = w13.float()
    elif name == "topk_ids_float":
        ti = ti.float()
    elif name == "activation":
        kwargs["activation"] = "tanh"
    return (x, w13, w2, tw, ti), kwargs


BAD = [
    # (case, regex the message must match: it names the offending argument or the expected property)
    ("w13_wrong_H", r"(?i)w13"),
    ("w2_wrong_I", r"(?i)w2"),
    ("w2_wrong_H", r"(?i)w2"),
    ("w13_w2_num_experts", r"(?i)w2|w13|expert"),
    ("topk_ids_vs_weights", r"(?i)topk"),
    ("topk_rows_vs_x", r"(?i)topk"),
    ("x_w13_dtype", r"(?i)dtype"),
    ("topk_ids_float", r"(?i)topk_ids|int"),
    ("activation", r"(?i)activation|relu"),
]


@interpreter
@pytest.mark.parametrize("case,pattern", BAD, ids=[b[0] for b in BAD])
def test_fused_experts_rejects_bad_input(case, pattern):
    args, kwargs = _bad(case)
    with pytest.raises((ValueError, TypeError), match=pattern):
        fused_experts(*args, **kwargs)


# ------------------------------------------------------------------------------ CPU: small helpers


@interpreter
@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("T,N", [(1, 40), (17, 56), (300, 40)])
def test_silu_and_mul(T, N, dtype):
    # N = 40, 56: not powers of two (tail masks); T = 300: many rows.
    x = (torch.randn(T, 2 * N) * 3).to(dtype)
    out = silu_and_mul(x)
    ref = F.silu(x[:, :N].float()) * x[:, N:].float()
    assert out.shape == (T, N) and out.dtype == dtype
    tol = 1e-5 if dtype == F32 else 2e-3
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@interpreter
@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("rsf", [1.0, 2.5])
@pytest.mark.parametrize("M,k,H", [(1, 8, 72), (17, 6, 48), (300, 2, 40), (5, 1, 48)])
def test_moe_sum_reduce(M, k, H, rsf, dtype):
    # H = 72, 48, 40: not powers of two (tail masks); k = 1: nothing to sum, only the scale.
    x = torch.randn(M, k, H).to(dtype)
    out = moe_sum_reduce(x, rsf)
    ref = x.float().sum(1) * rsf
    assert out.shape == (M, H)
    tol = 1e-5 if dtype == F32 else 5e-3
    torch.testing.assert_close(out.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


# -------------------------------------------------------------------------- GPU: real model shapes

DEEPSEEK_V2_LITE = dict(E=64, k=6, H=2048, inter=1408)
QWEN3 = dict(E=128, k=8, H=2048, inter=768)  # Qwen3-30B-A3B
GPU_SHAPES = [("dsv2lite", DEEPSEEK_V2_LITE, M) for M in (1, 64, 1024, 4096)] + [
    ("qwen3", QWEN3, M) for M in (1, 300)
]


@gpu
@pytest.mark.parametrize("name,shape,M", GPU_SHAPES, ids=[f"{n}-M{M}" for n, _, M in GPU_SHAPES])
def test_gpu_model_shapes_bf16(name, shape, M):
    run_and_check(M, **shape, dtype=BF16, device="cuda", what=f"{name} M={M} bf16")


GPU_VARIANTS = ["fp16", "int64_ids", "unused", "all_one", "inplace", "no_combine", "on_input", "rsf", "gelu"]


@gpu
@pytest.mark.parametrize("variant", GPU_VARIANTS)
def test_gpu_variants(variant):
    E, k, H, inter = (DEEPSEEK_V2_LITE[n] for n in ("E", "k", "H", "inter"))
    M, dtype, dev, what = 300, BF16, "cuda", f"dsv2lite M=300 {variant}"
    if variant in ("fp16", "int64_ids", "unused", "all_one"):
        mode = {"unused": "unused", "all_one": "one"}.get(variant, "random")
        ids_dtype = torch.int64 if variant == "int64_ids" else torch.int32
        dtype = F16 if variant == "fp16" else BF16
        M = 1024 if variant == "all_one" else M  # one expert group with ~1000 tokens: many M blocks
        what = f"dsv2lite M={M} {variant}"
        run_and_check(M, E, k, H, inter, dtype, device=dev, ids_dtype=ids_dtype, mode=mode, what=what)
        return
    if variant == "on_input":
        k = 1
    x, w13, w2, tw, ti = make_inputs(M, E, k, H, inter, dtype, dev)
    if variant == "inplace":
        ref = oracle(x, w13, w2, tw, ti)
        out = fused_experts(x, w13, w2, tw, ti, inplace=True)
        assert out.data_ptr() == x.data_ptr()
        assert_close(x, ref, dtype, what)
    elif variant == "no_combine":
        out = fused_experts(x, w13, w2, tw, ti, no_combine=True, routed_scaling_factor=2.5)
        assert_close(out, pairwise_oracle(x, w13, w2, tw, ti, rsf=2.5), dtype, what)
    elif variant == "on_input":
        tw = torch.rand(M, 1, device=dev) * 0.8 + 0.2
        out = fused_experts(x, w13, w2, tw, ti, apply_router_weight_on_input=True)
        assert_close(out, pairwise_oracle(x, w13, w2, tw, ti, on_input=True).sum(1), dtype, what)
    elif variant == "rsf":
        out = fused_experts(x, w13, w2, tw, ti, routed_scaling_factor=2.5)
        assert_close(out, pairwise_oracle(x, w13, w2, tw, ti, rsf=2.5).sum(1), dtype, what)
    elif variant == "gelu":
        out = fused_experts(x, w13, w2, tw, ti, activation="gelu")
        assert_close(out, pairwise_oracle(x, w13, w2, tw, ti, activation="gelu").sum(1), dtype, what)


@gpu
@pytest.mark.parametrize("T,N", [(1, 1408), (4096, 768), (300, 1400)])
def test_gpu_silu_and_mul_bf16(T, N):
    x = torch.randn(T, 2 * N, device="cuda").to(BF16)
    ref = F.silu(x[:, :N].float()) * x[:, N:].float()
    torch.testing.assert_close(silu_and_mul(x).float(), ref, atol=2e-2, rtol=1e-2)


@gpu
@pytest.mark.parametrize("M,k", [(1, 8), (4096, 6), (300, 8)])
def test_gpu_moe_sum_reduce_bf16(M, k):
    x = torch.randn(M, k, 2048, device="cuda").to(BF16)
    ref = x.float().sum(1) * 2.5
    out = moe_sum_reduce(x, 2.5)
    assert out.shape == (M, 2048)
    torch.testing.assert_close(out.float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=2e-2)


def test_programmatic_launch_only_for_dependent_launches():
    """A launch is made dependent only where its own rule asks (``dependent``) and the device has dependent
    launch: never on the CPU, never for a plain launch."""
    from triton_ops.pdl import programmatic_launch

    assert programmatic_launch(torch.device("cpu"), False) == {}
    assert programmatic_launch(torch.device("cpu"), True) == {}


@pytest.mark.interpreter
def test_unscaled_gemms_do_not_swap(monkeypatch):
    """bf16/fp16/fp32 GEMMs never take the swapped K-loop, forced or not (it is for block-FP8 tiles:
    ``plan.swap_ab``)."""
    from triton_ops.configs import GemmConfig
    from triton_ops.overrides import LAUNCH_OVERRIDES
    from triton_ops.plan import swap_ab

    tiles = GemmConfig(16, 64, 32, 1, 4, 2)
    for forced in ("0", "1"):
        monkeypatch.setitem(LAUNCH_OVERRIDES, "swap_ab", forced)
        assert not swap_ab(tiles, block_scaled=False)
        assert swap_ab(tiles, block_scaled=True) == (forced == "1")
    monkeypatch.delitem(LAUNCH_OVERRIDES, "swap_ab")
    assert swap_ab(tiles, block_scaled=True)
    assert not swap_ab(GemmConfig(32, 64, 32, 1, 4, 2), block_scaled=True)
    assert not swap_ab(GemmConfig(16, 32, 32, 1, 4, 2), block_scaled=True)
