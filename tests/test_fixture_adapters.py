"""PEFT as the oracle for every committed fixture adapter in ``adapters/``.

For each adapter, the experts output of PEFT's own forward (the tiny transformers-5 Qwen3-MoE for the
F2 adapters, the per-expert module trees for F1) equals ``pool.load_adapter`` + ``FusedMoEWithLoRA``
(CPU fp32), alone and all mixed in one batch with tokens of no adapter; on every path: the vectorised
torch path and the three Triton paths in the interpreter.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import adapters.make_adapters as mk  # noqa: E402
from moelora import FusedMoEWithLoRA, MoELoRAMemoryPool  # noqa: E402
from moelora.reference import softmax_topk  # noqa: E402

# PEFT 0.21 warns that pattern keys on target_parameters match nothing; they do apply (verified against
# get_delta_weight when the fixtures were made, see adapters/README.md).
pytestmark = pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys did not match")

F2_NAMES = ["sql", "chat", "math", "gate-up-only", "down-only", "v4-style"]
PATHS = ["torch", *(pytest.param(p, marks=pytest.mark.interpreter)
                    for p in ("fused", "split", "staged"))]
TOL = 1e-4


@pytest.fixture(scope="module")
def qwen3():
    """The tiny base, its experts per MoE layer, and PEFT's experts output for every F2 adapter."""
    base = mk.load_tiny_qwen3_moe()
    experts = mk.tiny_qwen3_moe_experts(base)
    cfg = mk.TINY_QWEN3_MOE
    gen = torch.Generator().manual_seed(0)
    # 11 tokens: odd, more than one 8-row block per expert group at top-2 of 8 experts.
    x = torch.randn(11, cfg["hidden_size"], generator=gen)
    routing = {lid: softmax_topk(torch.randn(11, cfg["num_experts"], generator=gen), 2) for lid in experts}
    expected = {}
    for name in F2_NAMES:
        peft_model = mk.load_tiny_qwen3_moe_peft(name, base=mk.load_tiny_qwen3_moe())
        for lid in experts:
            weights, ids = routing[lid]
            module = peft_model.base_model.model.model.layers[lid].mlp.experts
            with torch.no_grad():
                expected[name, lid] = module(x, ids.long(), weights)
    return experts, x, routing, expected


def qwen3_pool(max_loras):
    cfg = mk.TINY_QWEN3_MOE
    return MoELoRAMemoryPool(
        num_experts=cfg["num_experts"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["moe_intermediate_size"],
        layer_ids=mk.MOE_LAYER_IDS,
        max_loras=max_loras,
        max_rank=16,
        dtype=torch.float32,
        device="cpu",
    )


def assert_close(got, want, what):
    scale = want.abs().max().clamp_min(1e-6)
    err = (got - want).abs().max() / scale
    assert err <= TOL, f"{what}: max error {err:.3g} of the output scale"


@pytest.mark.parametrize("path", PATHS)
def test_f2_adapters_match_peft(qwen3, path):
    experts, x, routing, expected = qwen3
    pool = qwen3_pool(max_loras=len(F2_NAMES))
    for name in F2_NAMES:
        pool.load_adapter(name, ROOT / "adapters" / name)
    base_out = {}
    for lid, w in experts.items():
        layer = FusedMoEWithLoRA(w["w13"], w["w2"], pool=pool, layer_id=lid, path=path)
        weights, ids = routing[lid]
        base_out[lid] = layer(x, weights, ids, pool.prepare_batch([None] * x.shape[0]))
        for name in F2_NAMES:
            alone = layer(x, weights, ids, pool.prepare_batch([name] * x.shape[0]))
            assert_close(alone, expected[name, lid], f"{name} layer {lid} alone")
            assert (expected[name, lid] - base_out[lid]).abs().max() > 1e-3  # the adapter matters here
        # All mixed, one token per adapter in turn, every seventh token without an adapter.
        names = [None if t % 7 == 6 else F2_NAMES[t % len(F2_NAMES)] for t in range(x.shape[0])]
        mixed = layer(x, weights, ids, pool.prepare_batch(names))
        want = torch.stack(
            [base_out[lid][t] if n is None else expected[n, lid][t] for t, n in enumerate(names)]
        )
        assert_close(mixed, want, f"mixed batch layer {lid}")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fixture", ["f1-qwen", "f1-mixtral"])
def test_f1_adapters_match_peft(fixture, path):
    spec = mk.F1_SPECS[fixture]
    gate, up, down = mk.F1_NAMINGS[spec["naming"]][1:]
    peft_model = mk.load_f1_peft(fixture)
    tree = mk.load_f1_base(fixture)
    pool = MoELoRAMemoryPool(
        num_experts=spec["E"],
        hidden_size=spec["H"],
        intermediate_size=spec["I"],
        layer_ids=spec["layer_ids"],
        max_loras=2,
        max_rank=8,
        dtype=torch.float32,
        device="cpu",
    )
    report = pool.load_adapter("a", ROOT / "adapters" / fixture / "adapter")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, spec["H"], generator=gen)
    for lid in spec["layer_ids"]:
        block = tree.moe(lid)
        w13 = torch.stack(
            [torch.cat([getattr(ex, gate).weight, getattr(ex, up).weight]) for ex in block.experts]
        )
        w2 = torch.stack([getattr(ex, down).weight for ex in block.experts])
        weights, ids = softmax_topk(torch.randn(9, spec["E"], generator=gen), spec["top_k"])
        with torch.no_grad():
            want = peft_model.base_model.model.moe(lid)(x, weights, ids.long())
            base = block(x, weights, ids.long())
        layer = FusedMoEWithLoRA(w13.detach(), w2.detach(), pool=pool, layer_id=lid, path=path)
        names = ["a"] * 8 + [None]
        out = layer(x, weights, ids, pool.prepare_batch(names))
        assert_close(out[:8], want[:8], f"{fixture} layer {lid}")
        assert torch.allclose(out[8], base[8], atol=1e-5)
        assert (want - base).abs().max() > 1e-3
    if fixture == "f1-qwen":
        assert any("shared_expert" in key for key in report.ignored_keys)


def _snapshot(pool):
    tensors = [t.clone() for buf in pool.layers.values() for t in buf.dense().tensors()]
    return (tensors, pool.blocks.clone(), pool.slot_ranks.clone(), pool.slot_scalings.clone(),
            pool.adapters(), pool.host_adapters())


def _corruptions(tmp_path):
    """Broken copies of the ``chat`` fixture, one per way a file can be wrong."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src = ROOT / "adapters" / "chat"

    def copy(name):
        dst = tmp_path / name
        shutil.copytree(src, dst)
        return dst

    cases = {}
    d = copy("truncated")
    blob = (d / "adapter_model.safetensors").read_bytes()
    (d / "adapter_model.safetensors").write_bytes(blob[: len(blob) // 2])
    cases["truncated"] = (d, "adapter_model.safetensors")
    d = copy("nan")
    tensors = load_file(str(d / "adapter_model.safetensors"))
    key = sorted(tensors)[0]
    tensors[key][0, 0] = float("nan")
    save_file(tensors, str(d / "adapter_model.safetensors"))
    cases["nan"] = (d, "NaN")
    d = copy("bad-json")
    (d / "adapter_config.json").write_text("{not json")
    cases["bad-json"] = (d, "adapter_config.json")
    d = copy("dora")
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    cases["dora"] = (d, "DoRA")
    cases["missing"] = (tmp_path / "does-not-exist", "does-not-exist")
    return cases


def test_bad_adapter_files_leave_the_pool_and_its_outputs_unchanged(qwen3, tmp_path):
    from moelora import AdapterLoadError

    experts, x, routing, expected = qwen3
    pool = qwen3_pool(max_loras=2)
    pool.load_adapter("sql", ROOT / "adapters" / "sql")
    lid = mk.MOE_LAYER_IDS[0]
    weights, ids = routing[lid]
    layer = FusedMoEWithLoRA(experts[lid]["w13"], experts[lid]["w2"], pool=pool, layer_id=lid, path="torch")
    before_out = layer(x, weights, ids, pool.prepare_batch(["sql"] * x.shape[0]))
    before = _snapshot(pool)
    for label, (path, fragment) in _corruptions(tmp_path).items():
        with pytest.raises(AdapterLoadError) as err:
            pool.load_adapter("chat", path)
        assert fragment in str(err.value), f"{label}: {err.value}"
        after = _snapshot(pool)
        assert all(torch.equal(a, b) for a, b in zip(before[0], after[0], strict=True)), label
        assert all(torch.equal(before[k], after[k]) for k in (1, 2, 3)), label  # blocks, ranks, scalings
        assert before[4:] == after[4:] and "chat" not in pool, label
    out = layer(x, weights, ids, pool.prepare_batch(["sql"] * x.shape[0]))
    assert torch.equal(out, before_out)
