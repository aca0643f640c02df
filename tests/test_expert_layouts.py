"""Expert layouts beyond bias-free ``[gate; up]`` experts: expert biases (gpt-oss), on every path.

The Triton paths (fused, split, staged) and the PyTorch path are checked against the fp32 reference
(``moelora.reference.reference_moe``) fed the adapters' own tensors: in the interpreter (fp32) and on the
GPU (bf16), with LoRA deltas entering before the activation and the down bias inside the routed weight.
"""

from __future__ import annotations

import pytest
import torch

from moelora import FusedMoEWithLoRA, GatedActivation, LoRAProjection, MoELoRAMemoryPool, ReferenceLoRA
from moelora.reference import reference_moe

F32, BF16 = torch.float32, torch.bfloat16
# E=7 (prime: an expert no token of a small batch picks), H=24 and I=20 (not powers of two: masked tiles).
E, H, I = 7, 24, 20  # noqa: E741
GPT_OSS_GATE = GatedActivation("clamped_swiglu", 7.0, 1.702, 1.0)


def _adapters(gen: torch.Generator, ranks: dict[str, int]) -> dict[str, ReferenceLoRA]:
    """Adapters of different ranks; expert 5 untrained in the first one (it keeps the base weights)."""
    adapters = {}
    for index, (name, rank) in enumerate(ranks.items()):
        lora = ReferenceLoRA()
        for e in range(E):
            if index == 0 and e == 5:
                continue
            for mod, (fan_in, out) in (("gate", (H, I)), ("up", (H, I)), ("down", (I, H))):
                a = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
                b = torch.randn(out, rank, generator=gen) / rank**0.5
                getattr(lora, mod)[e] = LoRAProjection(a, b, 0.75)
        adapters[name] = lora
    return adapters


def _case(m: int, top_k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=gen) / H**0.5 * 2.0
    w2 = torch.randn(E, H, I, generator=gen) / I**0.5
    b13 = torch.randn(E, 2 * I, generator=gen) * 0.5
    b2 = torch.randn(E, H, generator=gen) * 0.5
    x = torch.randn(m, H, generator=gen)
    logits = torch.randn(m, E, generator=gen)
    logits[:, 6] = -1e9  # expert 6: picked by no token
    weights, ids = torch.softmax(logits, dim=1).topk(top_k, dim=1)
    return gen, w13, w2, b13, b2, x, weights, ids


def _layer_against_reference(path: str, dtype: torch.dtype, device: str, m: int, top_k: int,
                             on_input: bool, tol: float) -> None:
    gen, w13, w2, b13, b2, x, weights, ids = _case(m, top_k, seed=m + top_k)
    adapters = _adapters(gen, {"a": 8, "b": 3})  # ranks that differ per adapter
    names = [("a", None, "b")[t % 3] for t in range(m)]  # tokens without an adapter too
    activation = "silu" if on_input else GPT_OSS_GATE
    want = reference_moe(x, w13, w2, weights, ids, adapters=[adapters.get(n) for n in names],
                         token_adapter=list(range(m)), activation=activation,
                         apply_router_weight_on_input=on_input, w13_bias=b13, w2_bias=b2)
    pool = MoELoRAMemoryPool(num_experts=E, hidden_size=H, intermediate_size=I, layer_ids=[2], max_loras=3,
                             max_rank=8, dtype=dtype, device=device)
    for name, lora in adapters.items():
        pool.add_adapter_weights(name, {2: lora})
    layer = FusedMoEWithLoRA(w13.to(device, dtype), w2.to(device, dtype), pool=pool, layer_id=2,
                             activation=activation, apply_router_weight_on_input=on_input, path=path,
                             w13_bias=b13.to(device, dtype), w2_bias=b2.to(device, dtype))
    batch = pool.prepare_batch(names)
    got = layer(x.to(device, dtype), weights.to(device), ids.to(device), batch).float().cpu()
    rel = float((got - want.float()).norm() / want.float().norm())
    assert rel <= tol, f"{path} M={m} top-{top_k}: relative L2 error {rel:.3g} > {tol}"
    # The base rows (no adapter) are the biased base MoE: without any adapter the layer runs its base path.
    base = layer(x.to(device, dtype), weights.to(device), ids.to(device), None).float().cpu()
    want_base = reference_moe(x, w13, w2, weights, ids, activation=activation,
                              apply_router_weight_on_input=on_input, w13_bias=b13, w2_bias=b2)
    rel = float((base - want_base.float()).norm() / want_base.float().norm())
    assert rel <= tol, f"{path} base M={m}: relative L2 error {rel:.3g} > {tol}"


def test_torch_path_with_biases_matches_reference():
    """M=13 (odd), top-4 as gpt-oss routes; and top-1 with the weight on the input (bias not scaled)."""
    _layer_against_reference("torch", F32, "cpu", m=13, top_k=4, on_input=False, tol=1e-5)
    _layer_against_reference("torch", F32, "cpu", m=13, top_k=1, on_input=True, tol=1e-5)


@pytest.mark.interpreter
@pytest.mark.parametrize("path", ["fused", "split", "staged"])
@pytest.mark.parametrize("top_k", [1, 2])  # top-1: one pair per token; top-2: blocks of mixed slots
def test_triton_paths_with_biases_interpreter(path, top_k):
    _layer_against_reference(path, F32, "cpu", m=11, top_k=top_k, on_input=False, tol=1e-5)


@pytest.mark.interpreter
def test_triton_bias_with_weight_on_input_interpreter():
    _layer_against_reference("split", F32, "cpu", m=5, top_k=1, on_input=True, tol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 37, 300])  # one decode token (direct pairs), an odd prefill, many blocks
@pytest.mark.parametrize("path", ["fused", "split", "staged"])
@pytest.mark.parametrize("top_k", [1, 4, 8])
def test_triton_paths_with_biases_gpu(path, m, top_k):
    _layer_against_reference(path, BF16, "cuda", m=m, top_k=min(top_k, E - 1), on_input=False, tol=1e-2)


@pytest.mark.gpu
def test_triton_bias_with_weight_on_input_gpu():
    _layer_against_reference("split", BF16, "cuda", m=9, top_k=1, on_input=True, tol=1e-2)


def test_bias_refusals():
    pool = MoELoRAMemoryPool(num_experts=E, hidden_size=H, intermediate_size=I, layer_ids=[0], max_loras=1,
                             max_rank=4, dtype=F32, device="cpu")
    w13, w2 = torch.zeros(E, 2 * I, H), torch.zeros(E, H, I)
    with pytest.raises(ValueError, match=r"w13_bias must be a tensor of shape \(7, 40\)"):
        FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=0, w13_bias=torch.zeros(E, I))
    with pytest.raises(ValueError, match=r"w2_bias must be a tensor of shape \(7, 24\)"):
        FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=0, w2_bias=torch.zeros(E, H, 1))
    with pytest.raises(TypeError, match="w2_bias must be a float tensor"):
        FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=0, w2_bias=torch.zeros(E, H, dtype=torch.int32))


# --------------------------------------------------------------------------------------------------
# Weights read in the family's own storage (no copy): strided and halves views of w13 / w2
# --------------------------------------------------------------------------------------------------


def _stored(layout: str, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w13``/``w2`` as a family stores them, and returned as the views the layer reads (same values)."""
    e = w13.shape[0]
    if layout == "transposed":  # Aria, Llama-4: (E, H, 2I) / (E, I, H)
        stored13, stored2 = w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
        return stored13.transpose(1, 2), stored2.transpose(1, 2)
    if layout == "interleaved_transposed":  # gpt-oss: (E, H, 2I), columns gate0, up0, gate1, ...
        raw = w13.view(e, 2, I, H).permute(0, 3, 2, 1).reshape(e, H, 2 * I).contiguous()
        view = raw.transpose(1, 2).unflatten(1, (I, 2)).transpose(1, 2)
        return view, w2.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "ungated":  # Nemotron-H: one up (E, I, H) read as both halves
        up = w13[:, I:].contiguous()
        return up.unsqueeze(1).expand(-1, 2, -1, -1), w2
    raise ValueError(layout)


def _views_against_copies(path: str, layout: str, dtype: torch.dtype, device: str, m: int, top_k: int,
                          tol: float) -> None:
    gen, w13, w2, b13, b2, x, weights, ids = _case(m, top_k, seed=3 * m + top_k)
    if layout == "ungated":
        w13[:, :I] = w13[:, I:]  # the gate rows are the up rows
    activation = GatedActivation("relu") if layout == "ungated" else GPT_OSS_GATE
    adapters = _adapters(gen, {"a": 8, "b": 3})
    pool = MoELoRAMemoryPool(num_experts=E, hidden_size=H, intermediate_size=I, layer_ids=[2], max_loras=3,
                             max_rank=8, dtype=dtype, device=device)
    for name, lora in adapters.items():
        pool.add_adapter_weights(name, {2: lora})
    names = [("a", None, "b")[t % 3] for t in range(m)]
    batch = pool.prepare_batch(names)
    w13, w2 = w13.to(device, dtype), w2.to(device, dtype)
    view13, view2 = _stored(layout, w13, w2)
    assert view13.data_ptr() != w13.data_ptr()
    outs = []
    for a, b in ((w13, w2), (view13, view2)):
        layer = FusedMoEWithLoRA(a, b, pool=pool, layer_id=2, activation=activation, path=path,
                                 w13_bias=b13.to(device, dtype), w2_bias=b2.to(device, dtype))
        outs.append(layer(x.to(device, dtype), weights.to(device), ids.to(device), batch).float().cpu())
    rel = float((outs[1] - outs[0]).norm() / outs[0].norm())
    assert rel <= tol, f"{layout} {path} M={m}: relative L2 {rel:.3g} between the views and the copies"


@pytest.mark.parametrize("layout", ["transposed", "interleaved_transposed", "ungated"])
def test_torch_path_reads_stored_layouts(layout):
    _views_against_copies("torch", layout, F32, "cpu", m=9, top_k=2, tol=1e-6)


@pytest.mark.interpreter
@pytest.mark.parametrize("path", ["fused", "split", "staged"])
@pytest.mark.parametrize("layout", ["transposed", "interleaved_transposed", "ungated"])
def test_triton_paths_read_stored_layouts_interpreter(layout, path):
    _views_against_copies(path, layout, F32, "cpu", m=7, top_k=2, tol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 37, 300])  # one decode token (direct pairs), an odd prefill, many blocks
@pytest.mark.parametrize("path", ["fused", "split", "staged"])
@pytest.mark.parametrize("layout", ["transposed", "interleaved_transposed", "ungated"])
def test_triton_paths_read_stored_layouts_gpu(layout, path, m):
    _views_against_copies(path, layout, BF16, "cuda", m=m, top_k=4, tol=1e-2)


def test_halves_view_refusals():
    pool = MoELoRAMemoryPool(num_experts=E, hidden_size=H, intermediate_size=I, layer_ids=[0], max_loras=1,
                             max_rank=4, dtype=F32, device="cpu")
    with pytest.raises(ValueError, match=r"w13 must be \(E, 2I, H\) = \(7, 40, 24\), or its \(E, 2, I, H\)"):
        FusedMoEWithLoRA(torch.zeros(E, 3, I, H), torch.zeros(E, H, I), pool=pool, layer_id=0)
