"""Gated activations beyond act(g) * u: GELU-tanh and the clamped SwiGLUs of DeepSeek-V4, GLM-5-next,
Hunyuan-V4, MiniMax-M3 (gpt-oss' form, chunked halves) and Step-3.7, on every path.

The families' experts modules are built from transformers with minimal configs; their own forward is the
oracle of the activation (``_check_supported`` must find exactly the gate function each one computes).
The Triton paths (fused, split, staged) are checked against the PyTorch path in the interpreter (fp32)
and on the GPU (bf16), with LoRA deltas entering before the activation (docs/design.md §1).
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from moelora import FusedMoEWithLoRA, GatedActivation, MoELoRAMemoryPool
from moelora.integrations.transformers import UnsupportedModelError, _check_supported
from moelora.pool import DenseLoRA
from moelora.reference import LoRAProjection, ReferenceLoRA, reference_moe
from moelora.torch_path import moe_lora_forward_torch

F32, BF16 = torch.float32, torch.bfloat16
# E=5 (prime), H=24, I=20 (H != I, neither a power of two): a gate/up or H/I mix-up fails.
E, H, I = 5, 24, 20  # noqa: E741  (I = intermediate size, as in docs/design.md)

# Small limits so that gate and up values of randn-scale inputs pass them: every clamp is exercised.
KINDS = {
    "silu": GatedActivation("silu"),
    "gelu_tanh": GatedActivation("gelu_tanh"),
    "swiglu_oai": GatedActivation("clamped_swiglu", 1.25, 1.702, 1.0),  # gpt-oss / MiniMax-M3 form
    "swiglu_clamp": GatedActivation("clamped_swiglu", 1.25),  # DeepSeek-V4 / GLM-5-next / Hunyuan-V4
    "silu_clamp_after": GatedActivation("clamped_silu_after", 0.5),  # Step-3.7
    "relu": GatedActivation("relu"),  # ungated squared ReLU (Nemotron-H) with the up rows as the gate
    "softcap": GatedActivation("softcapped_swiglu", 1.5, up_limit=0.75),  # Inkling-2
}

# family -> (experts class, config fields, extra init kwargs, the activation it must be recognised as)
FAMILIES = {
    "deepseek_v4": ("DeepseekV4Experts", dict(num_local_experts=E, hidden_size=H, intermediate_size=I,
                                              hidden_act="silu", swiglu_limit=2.5), {},
                    GatedActivation("clamped_swiglu", 2.5)),
    "glm5_next": ("Glm5NextTextExperts", dict(num_local_experts=E, hidden_size=H, moe_intermediate_size=I,
                                              swiglu_limit=2.5), {}, GatedActivation("clamped_swiglu", 2.5)),
    "hy_v4": ("HYV4Experts", dict(num_local_experts=E, hidden_size=H, moe_intermediate_size=I,
                                  swiglu_limit=3.0), {}, GatedActivation("clamped_swiglu", 3.0)),
    "minimax_m3_vl": ("MiniMaxM3VLExperts", dict(num_local_experts=E, hidden_size=H, intermediate_size=I,
                                                 swiglu_limit=3.0, swiglu_alpha=1.702), {},
                      GatedActivation("clamped_swiglu", 3.0, 1.702, 1.0)),
    "step3p7": ("Step3p7Experts", dict(num_local_experts=E, hidden_size=H, moe_intermediate_size=I,
                                       hidden_act="silu"), {"swiglu_limit": 1.5},
                GatedActivation("clamped_silu_after", 1.5)),
    # Step-3.7 without a limit clamps at infinity: plain SiLU.
    "step3p7_unclamped": ("Step3p7Experts", dict(num_local_experts=E, hidden_size=H,
                                                 moe_intermediate_size=I, hidden_act="silu"), {},
                          GatedActivation("silu")),
    # Beam computes the plain SiLU in float32 inside _apply_gate: the same function.
    "beam": ("BeamExperts", dict(num_experts=E, hidden_size=H, moe_intermediate_size=I, hidden_act="silu"),
             {}, GatedActivation("silu")),
}


def _experts_module(family: str):
    cls_name, fields, kwargs, _ = FAMILIES[family]
    module_name = family.removesuffix("_unclamped")
    modeling = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    cls = getattr(modeling, cls_name)
    module = cls(SimpleNamespace(**fields, _experts_implementation="eager"), **kwargs)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # gate and up of order 1-5: past every limit above
        module.gate_up_proj.copy_(torch.randn(module.gate_up_proj.shape, generator=gen))
        module.down_proj.copy_(torch.randn(module.down_proj.shape, generator=gen) / I**0.5)
    return module


def _routing(m, top_k, seed):
    gen = torch.Generator().manual_seed(seed)
    weights, ids = torch.topk(torch.softmax(torch.randn(m, E, generator=gen), -1), top_k, -1)
    return torch.randn(m, H, generator=gen), weights, ids.to(torch.int32)


def test_gated_activation_refusals():
    with pytest.raises(ValueError, match="activation kind must be one of"):
        GatedActivation("swish")
    with pytest.raises(ValueError, match="needs its clamp limit > 0"):
        GatedActivation("clamped_swiglu")
    with pytest.raises(ValueError, match="alpha and up_offset belong to clamped_swiglu"):
        GatedActivation("clamped_silu_after", 1.0, alpha=2.0)
    with pytest.raises(ValueError, match="limit belongs to the clamped activations"):
        GatedActivation("silu", limit=3.0)
    with pytest.raises(ValueError, match="must be a finite number"):
        GatedActivation("clamped_swiglu", float("inf"))
    with pytest.raises(ValueError, match="or a GatedActivation"):
        moe_lora_forward_torch(torch.zeros(1, H), torch.zeros(E, 2 * I, H), torch.zeros(E, H, I),
                               torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32), None, None,
                               activation="clamped_swiglu")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_gate_is_recognised_and_exact(family):
    """attach's check finds the gate function each family's own ``_apply_gate`` computes, and the PyTorch
    path with it equals the family's experts forward."""
    module = _experts_module(family)
    activation = _check_supported("layers.0.mlp.experts", module, None)
    assert activation == FAMILIES[family][3]
    x, weights, ids = _routing(7, 2, seed=1)
    want = module(x, ids.long(), weights)
    got = moe_lora_forward_torch(x, module.gate_up_proj.data, module.down_proj.data, weights, ids, None, None,
                                 activation=activation)
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)


def test_unknown_gate_is_refused():
    """An _apply_gate of another form (a soft cap) is refused with the kinds tried, not served wrongly."""
    module = _experts_module("deepseek_v4")

    class SoftCapped(type(module)):
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return torch.tanh(gate / 3.0) * 3.0 * up

    module.__class__ = SoftCapped
    with pytest.raises(UnsupportedModelError, match="overrides _apply_gate with a gated activation moelora"):
        _check_supported("layers.0.mlp.experts", module, None)


def _lora_buffers(dtype, device, rank=8, slots=3, seed=4):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, fan_in):
        return (torch.randn(*shape, generator=gen) / fan_in**0.5).to(device, dtype)

    return DenseLoRA(gate_up_a=rnd(slots, E, 2 * rank, H, fan_in=H),
                     gate_up_b=rnd(slots, E, 2 * I, rank, fan_in=rank),
                     down_a=rnd(slots, E, rank, I, fan_in=I), down_b=rnd(slots, E, H, rank, fan_in=rank))


def _triton_against_torch(kind, path, dtype, device, m, top_k, tol):
    from triton_ops.fused_experts import MoELoRAInputs, fused_experts

    activation = KINDS[kind]
    gen = torch.Generator().manual_seed(11)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) / H**0.5 * 2.0).to(device, dtype)
    w2 = (torch.randn(E, H, I, generator=gen) / I**0.5).to(device, dtype)
    x, weights, ids = _routing(m, top_k, seed=m)
    x, weights, ids = x.to(device, dtype), weights.to(device), ids.to(device)
    buffers = _lora_buffers(dtype, device)
    # Slots 0 and 2 of ranks 8 and 5, and tokens without an adapter (-1).
    slots = torch.tensor([(0, -1, 2)[t % 3] for t in range(m)], dtype=torch.int32, device=device)
    ranks = torch.tensor([8, 0, 5], dtype=torch.int32, device=device)
    scalings = torch.tensor([0.75, 0.0, 1.5], device=device)
    lora = MoELoRAInputs(token_slots=slots, gate_up_a=buffers.gate_up_a, gate_up_b=buffers.gate_up_b,
                         down_a=buffers.down_a, down_b=buffers.down_b, slot_ranks=ranks,
                         slot_scalings=scalings, max_rank=8, num_adapters=2)
    got = fused_experts(x, w13, w2, weights, ids, activation=activation, lora=lora, lora_path=path).float()
    batch = SimpleNamespace(num_tokens=m, token_slots=slots, has_lora=True, slot_scalings=scalings)
    # The PyTorch path reads all R rank rows: zero the rows past each slot's rank, as a pool holds them.
    dense = DenseLoRA(*(t.clone() for t in buffers.tensors()))
    for slot, r in ((0, 8), (1, 0), (2, 5)):
        dense.gate_up_a[slot, :, r:8] = 0
        dense.gate_up_a[slot, :, 8 + r :] = 0
        dense.gate_up_b[slot, :, :, r:] = 0
        dense.down_a[slot, :, r:] = 0
        dense.down_b[slot, :, :, r:] = 0
    want = moe_lora_forward_torch(x.float(), w13.float(), w2.float(), weights, ids,
                                  DenseLoRA(*(t.float() for t in dense.tensors())), batch,
                                  activation=activation).float()
    rel = float((got - want).norm() / want.norm())
    assert rel <= tol, f"{kind} {path}: relative L2 error {rel:.3g} > {tol}"


@pytest.mark.interpreter
@pytest.mark.parametrize("path", ["fused", "split", "staged"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_triton_paths_compute_each_activation_interpreter(kind, path):
    """M=11 (odd), top-2: aligned blocks of mixed slots and tokens without an adapter."""
    _triton_against_torch(kind, path, F32, torch.device("cpu"), m=11, top_k=2, tol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 37])  # one decode token (its own launches) and an odd prefill
@pytest.mark.parametrize("path", ["fused", "split", "staged"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_triton_paths_compute_each_activation_gpu(kind, path, m):
    _triton_against_torch(kind, path, BF16, torch.device("cuda"), m=m, top_k=3, tol=1e-2)


def test_layer_with_a_clamped_swiglu_matches_reference():
    """The layer over a pool, mixed adapters and a token without one, against the reference fed the
    adapters' own tensors; on the PyTorch path and the Triton kernels (interpreter)."""
    activation = GatedActivation("clamped_swiglu", 1.25, 1.702, 1.0)
    pool = MoELoRAMemoryPool(num_experts=E, hidden_size=H, intermediate_size=I, layer_ids=[3], max_loras=3,
                             max_rank=8, dtype=F32, device="cpu")
    gen = torch.Generator().manual_seed(5)
    adapters = {}
    for name, rank in (("a", 8), ("b", 3)):
        lora = ReferenceLoRA()
        for e in range(E):
            for mod, (fan_in, out) in (("gate", (H, I)), ("up", (H, I)), ("down", (I, H))):
                getattr(lora, mod)[e] = LoRAProjection(torch.randn(rank, fan_in, generator=gen) / fan_in**0.5,
                                                       torch.randn(out, rank, generator=gen) / rank**0.5, 0.5)
        adapters[name] = lora
        pool.add_adapter_weights(name, {3: lora})
    w13 = torch.randn(E, 2 * I, H, generator=gen) / H**0.5 * 2.0
    w2 = torch.randn(E, H, I, generator=gen) / I**0.5
    names = ["a", None, "b", "a", "b"]
    x, weights, ids = _routing(len(names), 2, seed=9)
    want = reference_moe(x, w13, w2, weights, ids, adapters=[adapters.get(n) for n in names],
                         token_adapter=list(range(len(names))), activation=activation)
    for path in ("torch", "auto"):
        layer = FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=3, activation=activation, path=path)
        got = layer(x, weights, ids, pool.prepare_batch(names))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
