"""Many adapters in one batch: dozens of resident adapters of ranks 1-64, each training its own subset of
experts, tokens without an adapter, from one decode token to prefill batches of thousands of tokens.

Every forward runs through the layer the way a server runs it (a pool with its arena, ``prepare_batch``,
``FusedMoEWithLoRA``) and is checked against :func:`moelora.reference.reference_moe` fed each adapter's own
tensors (fp32). A block of routed pairs then holds many adapters; the launch rules' choice (path "auto"),
the split path on the expert blocks, the slot-range expand forced on both GEMMs (one pipeline stage and
two), the shrinks on pairs grouped by (expert, adapter) and the staged path with every LoRA launch on them
(the variants the many-adapter A/B times) must all give the reference's values, with the experts an
adapter does not train contributing nothing and the rank rows past each adapter's rank never counted.
"""

from __future__ import annotations

import random

import pytest
import torch

from moelora import FusedMoEWithLoRA
from moelora.pool import MoELoRAMemoryPool
from moelora.reference import LoRAProjection, ReferenceLoRA, reference_moe
from triton_ops.overrides import LAUNCH_OVERRIDES

LAYER = 0
# (path, overrides): the launch rules' choice (path "auto": split, or staged for a prefill step of dozens of
# adapters; the LoRA launches on pairs grouped by (expert, adapter) from nine adapters on), the split path on
# the GEMMs' expert blocks, the slot-range expand forced on both GEMMs in one and two stages, the split
# path's shrinks on pairs grouped by (expert, adapter), and the staged path with all its LoRA launches on
# them (and its expands walking whole rows).
VARIANTS = {"rule": ("auto", {}), "expert_blocks": ("split", {"lora_by_adapter": "0"}),
            "ext": ("split", {"lora_ext": "1", "lora_by_adapter": "0"}),
            "ext2": ("split", {"lora_ext": "1", "lora_ext_stages": "2", "lora_by_adapter": "0"}),
            "split_by_adapter": ("split", {"lora_by_adapter": "1"}),
            "by_adapter": ("staged", {"lora_by_adapter": "1"}),
            "whole_rows": ("staged", {"lora_by_adapter": "1", "expand_whole_rows": "1"})}

def _adapters(count: int, ranks: tuple[int, ...], experts: int, hidden: int, inter: int,
              seed: int) -> dict[str, dict[int, ReferenceLoRA]]:
    """``count`` adapters, ranks cycling through ``ranks``; every third trains all experts, the others a
    random half (the rest point at the arena's zero block)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    dims = {"gate": (hidden, inter), "up": (hidden, inter), "down": (inter, hidden)}
    out = {}
    for n in range(count):
        rank = ranks[n % len(ranks)]
        trained = range(experts) if n % 3 == 0 else sorted(rng.sample(range(experts), experts // 2))
        lora = ReferenceLoRA()
        for e in trained:
            for mod, (in_f, out_f) in dims.items():
                getattr(lora, mod)[e] = LoRAProjection(
                    a=torch.randn(rank, in_f, generator=gen) / in_f**0.5,
                    b=torch.randn(out_f, rank, generator=gen) / rank**0.5, scaling=0.5 + 0.01 * n)
        out[f"a{n}"] = {LAYER: lora}
    return out


def _check(m: int, *, experts: int, top_k: int, hidden: int, inter: int, count: int, ranks: tuple[int, ...],
           dtype: torch.dtype, device: str, variant: str, tol: float, monkeypatch) -> None:
    path, forced = VARIANTS[variant]
    for name, value in forced.items():
        monkeypatch.setitem(LAUNCH_OVERRIDES, name, value)
    weights_of = _adapters(count, ranks, experts, hidden, inter, seed=count)
    pool = MoELoRAMemoryPool(num_experts=experts, hidden_size=hidden, intermediate_size=inter,
                             layer_ids=[LAYER], max_loras=count, max_rank=max(ranks), dtype=dtype,
                             device=device)
    for name, weights in weights_of.items():
        pool.add_adapter_weights(name, weights)
    gen = torch.Generator().manual_seed(m)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    x = torch.randn(m, hidden, generator=gen)
    topk_weights, ids = torch.softmax(torch.randn(m, experts, generator=gen), -1).topk(top_k, -1)
    ids = ids.to(torch.int32)
    # Each token its own sequence; one in five without an adapter, the others drawn from all of them.
    rng = random.Random(m)
    names = [None if rng.random() < 0.2 else f"a{rng.randrange(count)}" for _ in range(m)]
    batch = pool.prepare_batch(names)
    layer = FusedMoEWithLoRA(w13.to(device, dtype), w2.to(device, dtype), pool=pool, layer_id=LAYER,
                             path=path)
    got = layer(x.to(device, dtype), topk_weights.to(device), ids.to(device), batch).float().cpu()
    order = sorted({n for n in names if n is not None})
    want = reference_moe(x.to(dtype).float(), w13.to(dtype).float(), w2.to(dtype).float(), topk_weights, ids,
                         adapters=[weights_of[n][LAYER] for n in order],
                         token_adapter=[-1 if n is None else order.index(n) for n in names])
    assert torch.isfinite(got).all()
    rel = float((got - want).norm() / want.norm())
    assert rel <= tol, f"M={m}, {variant}: relative L2 error {rel:.3g} > {tol}"
    batch.release()
    pool.close()


@pytest.mark.interpreter
@pytest.mark.parametrize("variant", ["rule", "expert_blocks", "ext2", "split_by_adapter", "by_adapter"])
@pytest.mark.parametrize("m", [1, 97])
def test_many_adapters_match_the_reference_interpreter(m, variant, monkeypatch):
    """12 adapters of ranks 1, 3, 8 and 16 in a rank-16 pool, 9 experts, top-4, fp32 (the interpreter)."""
    _check(m, experts=9, top_k=4, hidden=48, inter=40, count=12, ranks=(1, 3, 8, 16), dtype=torch.float32,
           device="cpu", variant=variant, tol=1e-4, monkeypatch=monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("m", [1, 7, 300, 1024, 4096])
def test_many_adapters_match_the_reference_gpu(m, variant, monkeypatch):
    """40 adapters of ranks 1, 3, 8, 16, 33 and 64 in a rank-64 pool, 64 experts, top-6, bf16; M from one
    decode token to 4096 (a 64-row block of M=4096 holds dozens of adapters)."""
    _check(m, experts=64, top_k=6, hidden=512, inter=384, count=40, ranks=(1, 3, 8, 16, 33, 64),
           dtype=torch.bfloat16, device="cuda", variant=variant, tol=2e-2, monkeypatch=monkeypatch)


@pytest.mark.interpreter
def test_auto_path_counts_the_experts_the_batch_trains(monkeypatch):
    """``pool.trained_experts`` sums the experts each adapter of a batch trains in a layer (host facts), and
    the layer's "auto" takes the staged path for a batch whose adapters train at most
    ``AUTO_STAGED_FEW_EXPERTS_SHARE`` of the experts (the rule's bounds lowered to this small batch), with
    the staged path's values bit for bit; above that share it stays split."""
    from triton_ops import plan

    experts, hidden, inter, count, m = 9, 32, 24, 6, 20
    weights_of = _adapters(count, (2, 4), experts, hidden, inter, seed=5)
    pool = MoELoRAMemoryPool(num_experts=experts, hidden_size=hidden, intermediate_size=inter,
                             layer_ids=[LAYER], max_loras=count, max_rank=4, dtype=torch.float32,
                             device="cpu")
    for name, weights in weights_of.items():
        pool.add_adapter_weights(name, weights)
    names = [f"a{i % count}" for i in range(m)]
    batch = pool.prepare_batch(names)
    trained = sum(len(weights_of[n][LAYER].gate) for n in sorted(set(names)))
    assert pool.trained_experts(batch, LAYER) == trained
    with pytest.raises(ValueError, match="valid layer ids"):
        pool.trained_experts(batch, LAYER + 1)
    share = trained / (count * experts)
    assert 0 < share < 1  # every third adapter trains all experts, the others half

    monkeypatch.setattr(plan, "AUTO_STAGED_MIN_ADAPTERS", 10**6)
    monkeypatch.setattr(plan, "AUTO_STAGED_FEW_EXPERTS_MIN_ROWS", 8)
    monkeypatch.setattr(plan, "AUTO_STAGED_FEW_EXPERTS_MIN_ADAPTERS", 2)
    gen = torch.Generator().manual_seed(3)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    x = torch.randn(m, hidden, generator=gen)
    weights, ids = torch.softmax(torch.randn(m, experts, generator=gen), -1).topk(2, -1)
    ids = ids.to(torch.int32)
    outs = {}
    for bound, path in ((share + 0.01, "staged"), (share - 0.01, "split")):
        monkeypatch.setattr(plan, "AUTO_STAGED_FEW_EXPERTS_SHARE", bound)
        auto = FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=LAYER, path="auto")
        assert auto.resolve_path(x, batch) == path
        assert auto.resolve_path(x[:7], pool.prepare_batch(names[:7])) == "split"  # fewer rows than the bound
        forced = FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=LAYER, path=path)
        outs[path] = auto(x, weights, ids, batch)
        assert torch.equal(outs[path], forced(x, weights, ids, batch))
    assert not torch.equal(outs["staged"], outs["split"])
    batch.release()
    pool.close()
