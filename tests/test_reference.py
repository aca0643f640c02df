"""Tests of the fp32 oracle in moelora.reference against independent computations.

The oracle loops over tokens; the checks here use vectorised merged-weight computations (gather the
per-(token, k) weights, torch.bmm), transformers' own DeepSeek-V3 router, and hand-made examples.
Shapes are small and odd on purpose (see the comment at each one): nothing may rely on powers of two.
"""

import pytest
import torch
import torch.nn.functional as F

from moelora.reference import (
    LoRAProjection,
    ReferenceLoRA,
    grouped_topk,
    reference_moe,
    reference_moe_from_pool,
    reference_moe_grouped,
    reference_moe_no_combine,
    softmax_topk,
)

F64 = torch.float64

# H=48, I=40: not powers of two and H != I, so a swapped gate/up/down shape or an H/I mix-up fails.
# E=6: not a power of two; with top-k 6 every token visits every expert.
H, I, E = 48, 40, 6  # noqa: E741  (I = intermediate size, as in docs/design.md)
# M=11: odd, prime token count; no accidental alignment to any block size.
M = 11


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def make_base(m=M, hidden=H, inter=I, experts=E, dtype=F64):
    x = torch.randn(m, hidden, dtype=dtype)
    w13 = torch.randn(experts, 2 * inter, hidden, dtype=dtype) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, dtype=dtype) / inter**0.5
    return x, w13, w2


def make_routing(m=M, experts=E, top_k=2, dtype=F64):
    """Distinct experts per token; weights not normalised (so a forgotten weight shows up)."""
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(m)]).to(torch.int32)
    weights = torch.rand(m, top_k, dtype=dtype) + 0.25
    return weights, ids


def make_proj(rank, in_features, out_features, scaling, dtype=F64, amp=1.0):
    """A LoRA whose delta is of the order of the base weight (amp=1), so nonlinear effects are visible."""
    a = torch.randn(rank, in_features, dtype=dtype) * amp / in_features**0.5
    b = torch.randn(out_features, rank, dtype=dtype) * amp / rank**0.5
    return LoRAProjection(a=a, b=b, scaling=scaling)


def make_adapter(ranks, experts=range(E), scaling=0.5, modules=("gate", "up", "down"), amp=1.0, dtype=F64):
    """ranks: dict module -> rank (per-module ranks, like PEFT's rank_pattern)."""
    lora = ReferenceLoRA()
    dims = {"gate": (H, I), "up": (H, I), "down": (I, H)}
    for mod in modules:
        for e in experts:
            getattr(lora, mod)[e] = make_proj(ranks[mod], *dims[mod], scaling, dtype=dtype, amp=amp)
    return lora


def merged_pair_weights(w13, w2, topk_ids, adapters=None, token_adapter=None):
    """Per-(token, k) merged weights W + s·B·A: (M, k, 2I, H) and (M, k, H, I)."""
    inter = w13.shape[1] // 2
    w13_tk = w13[topk_ids.long()].clone()
    w2_tk = w2[topk_ids.long()].clone()
    if adapters is None:
        return w13_tk, w2_tk
    for t, slot in enumerate(token_adapter):
        if slot < 0 or adapters[slot] is None:
            continue
        lora = adapters[slot]
        for k, e in enumerate(topk_ids[t].tolist()):
            if e in lora.gate:
                p = lora.gate[e]
                w13_tk[t, k, :inter] += p.scaling * p.b @ p.a
            if e in lora.up:
                p = lora.up[e]
                w13_tk[t, k, inter:] += p.scaling * p.b @ p.a
            if e in lora.down:
                p = lora.down[e]
                w2_tk[t, k] += p.scaling * p.b @ p.a
    return w13_tk, w2_tk


def vectorised_moe(x, w13_tk, w2_tk, topk_weights, rsf=1.0, activation="silu", on_input=False, combine=True):
    """Independent batched computation: one bmm per projection over all (token, k) pairs."""
    m, k = topk_weights.shape
    inter = w13_tk.shape[2] // 2
    xin = x[:, None, :].expand(m, k, -1)
    if on_input:
        xin = xin * topk_weights[..., None]
    gu = torch.bmm(w13_tk.reshape(m * k, 2 * inter, -1), xin.reshape(m * k, -1, 1)).reshape(m, k, 2 * inter)
    act = F.silu if activation == "silu" else (lambda v: F.gelu(v, approximate="none"))
    h = act(gu[..., :inter]) * gu[..., inter:]
    y = torch.bmm(w2_tk.reshape(m * k, -1, inter), h.reshape(m * k, inter, 1)).reshape(m, k, -1)
    if not on_input:
        y = y * topk_weights[..., None]
    y = rsf * y
    return y.sum(dim=1) if combine else y


def wrong_separate_ffn(x, w13, w2, topk_weights, topk_ids, adapters, token_adapter):
    """Seed 002's formula (NOT our contract): base + Σ_k w·s·(B_d A_d silu(B_g A_g x) ⊙ (B_u A_u x))."""
    out = reference_moe(x, w13, w2, topk_weights, topk_ids).clone()
    for t, slot in enumerate(token_adapter):
        if slot < 0:
            continue
        lora = adapters[slot]
        for k, e in enumerate(topk_ids[t].tolist()):
            g, u, d = lora.gate[e], lora.up[e], lora.down[e]
            hid = F.silu(g.b @ (g.a @ x[t])) * (u.b @ (u.a @ x[t]))
            out[t] += topk_weights[t, k] * d.scaling * (d.b @ (d.a @ hid))
    return out


# --------------------------------------------------------------------------------------------------
# Base MoE
# --------------------------------------------------------------------------------------------------


# top-k 1: no reduction at all; 2: the usual case; 6 = E: every expert visited by every token.
@pytest.mark.parametrize("top_k", [1, 2, 6])
@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_base_matches_vectorised(top_k, activation):
    x, w13, w2 = make_base()
    weights, ids = make_routing(top_k=top_k)
    got = reference_moe(x, w13, w2, weights, ids, activation=activation)
    want = vectorised_moe(x, *merged_pair_weights(w13, w2, ids), weights, activation=activation)
    assert got.dtype == F64
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_silu_and_gelu_differ():
    # Guards against the activation argument being silently ignored.
    x, w13, w2 = make_base()
    weights, ids = make_routing()
    silu = reference_moe(x, w13, w2, weights, ids, activation="silu")
    gelu = reference_moe(x, w13, w2, weights, ids, activation="gelu")
    assert (silu - gelu).abs().max() > 1e-2


def test_fp32_upcast_and_device():
    x, w13, w2 = make_base(dtype=torch.bfloat16)
    weights, ids = make_routing(dtype=torch.bfloat16)
    got = reference_moe(x, w13, w2, weights, ids)
    assert got.dtype == torch.float32 and got.device == x.device and got.shape == (M, H)
    want = vectorised_moe(x.double(), *merged_pair_weights(w13.double(), w2.double(), ids), weights.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_negative_expert_id_contributes_nothing():
    # -1 marks an expert filtered out (expert parallelism): that slot adds zero.
    x, w13, w2 = make_base()
    weights, ids = make_routing(top_k=2)
    masked = ids.clone()
    masked[::2, 1] = -1
    got = reference_moe_no_combine(x, w13, w2, weights, masked)
    assert torch.equal(got[::2, 1], torch.zeros_like(got[::2, 1]))
    full = reference_moe_no_combine(x, w13, w2, weights, ids)
    torch.testing.assert_close(got[::2, 0], full[::2, 0], rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------
# LoRA
# --------------------------------------------------------------------------------------------------


def test_lora_delta_enters_before_activation():
    x, w13, w2 = make_base()
    weights, ids = make_routing(top_k=2)
    adapters = [make_adapter({"gate": 8, "up": 8, "down": 8}), make_adapter({"gate": 4, "up": 4, "down": 4})]
    token_adapter = [0, 1, -1, 1, 0, 0, -1, 1, 0, 1, 0]
    got = reference_moe(x, w13, w2, weights, ids, adapters=adapters, token_adapter=token_adapter)

    merged = vectorised_moe(x, *merged_pair_weights(w13, w2, ids, adapters, token_adapter), weights)
    torch.testing.assert_close(got, merged, rtol=0, atol=1e-10)

    base = reference_moe(x, w13, w2, weights, ids)
    with_lora = torch.tensor(token_adapter) >= 0
    lora_delta = (got - base)[with_lora]
    assert lora_delta.abs().max() > 0.1  # the adapters really change the output

    wrong = wrong_separate_ffn(x, w13, w2, weights, ids, adapters, token_adapter)
    # The separate-FFN formula misses most of the true delta: the error is of the order of the delta.
    err = (wrong - got)[with_lora]
    assert err.norm() > 0.3 * lora_delta.norm()


def test_mixed_ranks_modules_and_no_adapter_tokens():
    x, w13, w2 = make_base()
    weights, ids = make_routing(top_k=2)
    # Token 5 is routed to experts 1 and 3 only, which adapter 1 does not cover.
    ids[5] = torch.tensor([1, 3], dtype=torch.int32)
    adapters = [
        # Per-module ranks, incl. rank 1 (the smallest) and 16, like a PEFT rank_pattern.
        make_adapter({"gate": 1, "up": 3, "down": 16}, scaling=2.0),
        # Only experts 0, 2, 4; rank 5 (odd).
        make_adapter({"gate": 5, "up": 5, "down": 5}, experts=(0, 2, 4), scaling=0.25),
        # Adapter that targets nothing on this layer.
        ReferenceLoRA(),
        # Only down_proj, rank 7.
        make_adapter({"down": 7}, modules=("down",), scaling=1.5),
        None,
    ]
    token_adapter = [0, -1, 1, 2, 3, 1, -1, 4, 0, 3, 1]
    got = reference_moe(x, w13, w2, weights, ids, adapters=adapters, token_adapter=token_adapter)
    base = reference_moe(x, w13, w2, weights, ids)

    # Exactly the base output (bit for bit): no adapter, an empty adapter, None, uncovered experts.
    for t in (1, 6, 3, 7, 5):
        assert torch.equal(got[t], base[t]), t
    # Everyone else: the merged-weight computation.
    merged = vectorised_moe(x, *merged_pair_weights(w13, w2, ids, adapters, token_adapter), weights)
    torch.testing.assert_close(got, merged, rtol=0, atol=1e-10)
    for t in (0, 2, 4, 8, 9, 10):
        assert (got[t] - base[t]).abs().max() > 1e-3, t

    # Tensor token_adapter behaves like the list.
    got_t = reference_moe(
        x, w13, w2, weights, ids, adapters=adapters, token_adapter=torch.tensor(token_adapter)
    )
    assert torch.equal(got_t, got)


def test_bad_arguments_raise():
    x, w13, w2 = make_base()
    weights, ids = make_routing()
    lora = make_adapter({"gate": 2, "up": 2, "down": 2})
    with pytest.raises(ValueError, match="out of range"):
        reference_moe(x, w13, w2, weights, ids, adapters=[lora], token_adapter=[1] * M)
    with pytest.raises(ValueError, match="entries"):
        reference_moe(x, w13, w2, weights, ids, adapters=[lora], token_adapter=[0] * (M - 1))
    with pytest.raises(ValueError, match="activation"):
        reference_moe(x, w13, w2, weights, ids, activation="tanh")
    bad = ReferenceLoRA(gate={0: make_proj(2, I, H, 1.0)})  # gate A/B with down's shapes
    with pytest.raises(ValueError, match="gate"):
        reference_moe(x, w13, w2, weights, ids, adapters=[bad], token_adapter=[0] * M)


# --------------------------------------------------------------------------------------------------
# Router weight on input, routed scaling factor, no-combine
# --------------------------------------------------------------------------------------------------


def test_apply_router_weight_on_input():
    x, w13, w2 = make_base()
    weights, ids = make_routing(top_k=3)
    adapters = [make_adapter({"gate": 4, "up": 6, "down": 2})]
    token_adapter = [0, -1] * (M // 2) + [0]
    kw = dict(adapters=adapters, token_adapter=token_adapter)
    got = reference_moe(x, w13, w2, weights, ids, apply_router_weight_on_input=True, **kw)
    pair_w = merged_pair_weights(w13, w2, ids, adapters, token_adapter)
    want = vectorised_moe(x, *pair_w, weights, on_input=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    # Also: out = Σ_k y_k(w_k x), i.e. k separate top-1 calls on the pre-scaled input with weight 1.
    per_k = sum(
        reference_moe(
            x * weights[:, j : j + 1], w13, w2, torch.ones_like(weights[:, :1]), ids[:, j : j + 1], **kw
        )
        for j in range(3)
    )
    torch.testing.assert_close(got, per_k, rtol=0, atol=1e-10)
    # The activation is nonlinear, so weighting the input is not the same as weighting the output.
    default = reference_moe(x, w13, w2, weights, ids, **kw)
    assert (got - default).abs().max() > 1e-2


@pytest.mark.parametrize("on_input", [False, True])
def test_routed_scaling_factor_and_no_combine(on_input):
    x, w13, w2 = make_base()
    weights, ids = make_routing(top_k=2)
    adapters = [make_adapter({"gate": 3, "up": 3, "down": 3})]
    token_adapter = [0, 0, -1, 0, -1, 0, 0, -1, 0, 0, 0]
    kw = dict(adapters=adapters, token_adapter=token_adapter, apply_router_weight_on_input=on_input)
    rsf = 2.5

    one = reference_moe(x, w13, w2, weights, ids, **kw)
    scaled = reference_moe(x, w13, w2, weights, ids, routed_scaling_factor=rsf, **kw)
    torch.testing.assert_close(scaled, rsf * one, rtol=1e-12, atol=1e-12)

    per_slot = reference_moe_no_combine(x, w13, w2, weights, ids, routed_scaling_factor=rsf, **kw)
    assert per_slot.shape == (M, 2, H)
    torch.testing.assert_close(per_slot.sum(dim=1), scaled, rtol=0, atol=1e-12)
    # Each slot is rsf·w_k·y_k(x) (or rsf·y_k(w_k x) with the weight on the input).
    pair_w = merged_pair_weights(w13, w2, ids, adapters, token_adapter)
    want = vectorised_moe(x, *pair_w, weights, rsf=rsf, on_input=on_input, combine=False)
    torch.testing.assert_close(per_slot, want, rtol=0, atol=1e-10)


# --------------------------------------------------------------------------------------------------
# Pool layout
# --------------------------------------------------------------------------------------------------


# "zeros": what the pool really holds; "nan": garbage beyond the rank, so any read of it poisons the output.
@pytest.mark.parametrize("padding", ["zeros", "nan"])
def test_from_pool_matches_reference(padding):
    x, w13, w2 = make_base()
    weights, ids = make_routing(top_k=2)
    # L=4 slots, R=16; ranks 4, 0 (empty slot), 16 (= max rank, no padding), 1 (extreme padding).
    n_slots, max_rank = 4, 16
    ranks = [4, 0, 16, 1]
    scalings = [0.5, 3.0, 0.125, 2.0]
    adapters = [
        make_adapter({"gate": r, "up": r, "down": r}, scaling=s) if r else ReferenceLoRA()
        for r, s in zip(ranks, scalings, strict=True)
    ]

    fill = 0.0 if padding == "zeros" else float("nan")
    gate_up_a = torch.full((n_slots, E, 2 * max_rank, H), fill, dtype=F64)
    gate_up_b = torch.full((n_slots, E, 2 * I, max_rank), fill, dtype=F64)
    down_a = torch.full((n_slots, E, max_rank, I), fill, dtype=F64)
    down_b = torch.full((n_slots, E, H, max_rank), fill, dtype=F64)
    for slot, (lora, r) in enumerate(zip(adapters, ranks, strict=True)):
        for e in range(E) if r else ():
            gate_up_a[slot, e, :r] = lora.gate[e].a
            gate_up_a[slot, e, max_rank : max_rank + r] = lora.up[e].a
            gate_up_b[slot, e, :I, :r] = lora.gate[e].b
            gate_up_b[slot, e, I:, :r] = lora.up[e].b
            down_a[slot, e, :r] = lora.down[e].a
            down_b[slot, e, :, :r] = lora.down[e].b

    token_slots = torch.tensor([0, 2, 3, -1, 1, 0, 2, 3, -1, 2, 0], dtype=torch.int32)
    rsf = 1.5
    got = reference_moe_from_pool(
        x, w13, w2, weights, ids, token_slots, gate_up_a, gate_up_b, down_a, down_b,
        torch.tensor(ranks, dtype=torch.int32), torch.tensor(scalings), routed_scaling_factor=rsf,
    )  # fmt: skip
    want = reference_moe(
        x,
        w13,
        w2,
        weights,
        ids,
        adapters=adapters,
        token_adapter=token_slots.tolist(),
        routed_scaling_factor=rsf,
    )
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    # Slot 1 (rank 0) and -1 tokens: the base output.
    base = reference_moe(x, w13, w2, weights, ids, routed_scaling_factor=rsf)
    for t in (3, 4, 8):
        assert torch.equal(got[t], base[t]), t


def test_from_pool_shared_gate_up_a():
    # A PEFT fused gate_up projection with one shared A stores that A in both halves of gate_up_a.
    x, w13, w2 = make_base()
    weights, ids = make_routing(top_k=2)
    r, max_rank, s = 3, 8, 0.75
    a_shared = torch.randn(E, r, H, dtype=F64) / H**0.5
    b_gate = torch.randn(E, I, r, dtype=F64)
    b_up = torch.randn(E, I, r, dtype=F64)
    gate_up_a = torch.zeros(1, E, 2 * max_rank, H, dtype=F64)
    gate_up_a[0, :, :r] = a_shared
    gate_up_a[0, :, max_rank : max_rank + r] = a_shared
    gate_up_b = torch.zeros(1, E, 2 * I, max_rank, dtype=F64)
    gate_up_b[0, :, :I, :r] = b_gate
    gate_up_b[0, :, I:, :r] = b_up
    down_a = torch.zeros(1, E, max_rank, I, dtype=F64)
    down_b = torch.zeros(1, E, H, max_rank, dtype=F64)
    got = reference_moe_from_pool(
        x, w13, w2, weights, ids, [0] * M, gate_up_a, gate_up_b, down_a, down_b, [r], [s]
    )
    # Merged: w13' = w13 + s · [B_gate; B_up] · A_shared.
    w13_merged = w13 + s * torch.cat([b_gate, b_up], dim=1) @ a_shared
    want = vectorised_moe(x, *merged_pair_weights(w13_merged, w2, ids), weights)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


# --------------------------------------------------------------------------------------------------
# Routing
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("renormalize", [False, True])
def test_softmax_topk(renormalize):
    # E=60 (Qwen1.5-MoE-style, not a power of two), top-k 4; bf16 logits to check the fp32 upcast.
    logits = torch.randn(M, 60).to(torch.bfloat16)
    w, ids = softmax_topk(logits, 4, renormalize=renormalize)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == ids.shape == (M, 4)
    probs = torch.softmax(logits.float(), dim=-1)
    ref_w, ref_ids = probs.topk(4, dim=-1)
    assert torch.equal(ids, ref_ids.to(torch.int32))
    if renormalize:
        torch.testing.assert_close(w.sum(-1), torch.ones(M), rtol=0, atol=1e-6)
        torch.testing.assert_close(w, ref_w / ref_w.sum(-1, keepdim=True))
    else:
        assert torch.equal(w, ref_w)


def _sort_by_id(weights, ids):
    order = ids.long().argsort(dim=-1)
    return weights.gather(1, order), ids.long().gather(1, order)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_grouped_topk_matches_transformers(norm_topk_prob):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    # E=16 in 4 groups of 4, keep 2 groups, top-4: the DeepSeek-V3 scheme at toy size.
    n_exp, n_group, topk_group, top_k, rsf = 16, 4, 2, 4, 2.5
    config = DeepseekV3Config(
        hidden_size=n_exp, n_routed_experts=n_exp, num_experts_per_tok=top_k, n_group=n_group,
        topk_group=topk_group, norm_topk_prob=norm_topk_prob, routed_scaling_factor=rsf,
    )  # fmt: skip
    router = DeepseekV3TopkRouter(config)
    bias = torch.randn(n_exp) * 0.3  # large enough to change many selections
    with torch.no_grad():
        router.weight.copy_(torch.eye(n_exp))  # router_logits = hidden_states @ I = the logits
        router.e_score_correction_bias.copy_(bias)
    logits = torch.randn(64, n_exp) * 2

    hf_logits, hf_w, hf_ids = router(logits)
    assert torch.equal(hf_logits, logits)
    w, ids = grouped_topk(
        logits, top_k, n_group=n_group, topk_group=topk_group, e_score_correction_bias=bias,
        norm_topk_prob=norm_topk_prob, routed_scaling_factor=rsf,
    )  # fmt: skip
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    w_s, ids_s = _sort_by_id(w, ids)
    hf_w_s, hf_ids_s = _sort_by_id(hf_w, hf_ids)
    assert torch.equal(ids_s, hf_ids_s)
    torch.testing.assert_close(w_s, hf_w_s, rtol=1e-6, atol=1e-7)

    # The bias really mattered for this data (otherwise the test would not check it).
    w0, ids0 = grouped_topk(logits, top_k, n_group=n_group, topk_group=topk_group)
    assert not torch.equal(_sort_by_id(w0, ids0)[1], ids_s)


def test_grouped_topk_bias_selects_but_does_not_weigh():
    # E=4 in 2 groups of 2, keep both groups, top-1: only the bias decides between experts 0 and 3.
    logits = torch.tensor([[2.0, 0.0, -1.0, 1.5]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.2])  # sigmoid(2)=0.881 < sigmoid(1.5)+0.2=1.018
    w, ids = grouped_topk(
        logits, 1, n_group=2, topk_group=2, e_score_correction_bias=bias, norm_topk_prob=False
    )
    assert ids.tolist() == [[3]]
    torch.testing.assert_close(w, torch.sigmoid(torch.tensor([[1.5]])))  # unbiased score
    w_nb, ids_nb = grouped_topk(logits, 1, n_group=2, topk_group=2, norm_topk_prob=False)
    assert ids_nb.tolist() == [[0]]
    # With norm_topk_prob the single weight becomes 1, then times the routed scaling factor.
    w_n, _ = grouped_topk(
        logits, 1, n_group=2, topk_group=2, e_score_correction_bias=bias, routed_scaling_factor=2.5
    )
    torch.testing.assert_close(w_n, torch.tensor([[2.5]]))


def test_grouped_topk_group_mask():
    # E=8 in 4 groups of 2, keep 1 group, top-2. Expert 0 has the single best score, but group 2
    # (experts 4, 5) has the best top-2 sum, so both picks come from group 2 and expert 0 is masked.
    logits = torch.tensor([[3.0, -3.0, 0.0, 0.0, 1.5, 1.5, -1.0, -1.0]])
    w, ids = grouped_topk(logits, 2, n_group=4, topk_group=1, norm_topk_prob=True)
    assert sorted(ids[0].tolist()) == [4, 5]
    torch.testing.assert_close(w, torch.full((1, 2), 0.5))


def test_grouped_topk_softmax_single_group_is_softmax_topk():
    # One group, no bias: grouped routing degenerates to plain softmax top-k (DeepSeek-V2-Lite's greedy).
    logits = torch.randn(M, 64)
    for norm in (False, True):
        w, ids = grouped_topk(logits, 6, n_group=1, topk_group=1, norm_topk_prob=norm, scoring_func="softmax")
        w_ref, ids_ref = softmax_topk(logits, 6, renormalize=norm)
        assert torch.equal(ids, ids_ref)
        torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------------------------------
# The grouped oracle (GPU tests' fast stand-in for the per-pair loop)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize(("rsf", "on_input", "activation"), [(1.0, False, "silu"), (2.5, True, "gelu")])
def test_grouped_oracle_matches_reference(dtype, rsf, on_input, activation):
    """``reference_moe_grouped`` (an (expert, adapter) group of pairs at a time) gives ``reference_moe``'s
    outputs: adapters of different ranks and modules, a token with no adapter, an adapter slot that is None,
    an adapter without some experts, a filtered expert (-1), experts no token picks."""
    torch.manual_seed(5)
    # M=13, top-3 of E=6 experts, expert 5 never picked: odd sizes, and a group with no pairs.
    m, top_k = 13, 3
    x, w13, w2 = make_base(m=m, dtype=dtype)
    weights, ids = make_routing(m=m, experts=E - 1, top_k=top_k, dtype=dtype)
    ids[2, 1] = -1  # an expert filtered out (expert parallelism): contributes zeros
    adapters = [
        make_adapter({"gate": 3, "up": 5, "down": 2}, dtype=dtype),  # per-module ranks
        None,  # a slot without weights: like no adapter
        make_adapter({"gate": 7, "up": 7, "down": 7}, experts=(0, 2, 3), modules=("gate", "down"),
                     dtype=dtype),
    ]
    token_adapter = [0, -1, 2, 1, 0, 2, 2, -1, 0, 1, 2, 0, 2]
    kw = dict(adapters=adapters, token_adapter=token_adapter, routed_scaling_factor=rsf,
              apply_router_weight_on_input=on_input, activation=activation)
    want = reference_moe(x, w13, w2, weights, ids, **kw)
    got = reference_moe_grouped(x, w13, w2, weights, ids, **kw)
    assert got.shape == (m, H) and got.dtype == dtype
    tol = 1e-12 if dtype == F64 else 2e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
    # Per pair, before the top-k sum: reference_moe_no_combine's (the filtered pair's row is zeros).
    per_pair = reference_moe_grouped(x, w13, w2, weights, ids, combine=False, **kw)
    want_per_pair = reference_moe_no_combine(x, w13, w2, weights, ids, **kw)
    assert per_pair.shape == (m, top_k, H) and torch.equal(per_pair[2, 1], torch.zeros(H, dtype=dtype))
    torch.testing.assert_close(per_pair, want_per_pair, rtol=tol, atol=tol * want_per_pair.abs().max().item())
    # The LoRA is visible (else the comparison would not test the adapters) and no-adapter rows are the base
    # (to rounding: their groups hold other rows than in the base call).
    base = reference_moe_grouped(x, w13, w2, weights, ids, routed_scaling_factor=rsf,
                                 apply_router_weight_on_input=on_input, activation=activation)
    assert (got[0] - base[0]).abs().max() > 1e-3 * base[0].abs().max()
    no_adapter = [1, 3, 7, 9]
    scale = want.abs().max().item()
    torch.testing.assert_close(got[no_adapter], base[no_adapter], rtol=tol, atol=tol * scale)
