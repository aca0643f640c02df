"""Tests of :mod:`moelora.peft_loader` (CPU, fp32; tiny models built with PEFT inside the tests).

PEFT is the oracle: adapters are made with ``get_peft_model`` + ``save_pretrained`` (LoRA weights set to
seeded random values, since PEFT initialises B to zero), read back with :func:`read_peft_adapter`, and the
output of PEFT's own wrapped modules is compared with :func:`moelora.reference.reference_moe` on the base
weights and the loaded :class:`ReferenceLoRA` (and, for :func:`load_into_pool`, with the pool's torch path).

F2 (fused expert parameters) runs on a tiny transformers-5 ``Qwen3MoeForCausalLM``: the PEFT-wrapped
``mlp.experts`` module is called directly with hidden states, top-k indices and weights, as
``Qwen3MoeExperts.forward(hidden_states, top_k_index, top_k_weights)`` expects. F1 (per-expert modules)
runs on a hand-built module tree (Qwen names and Mixtral ``block_sparse_moe.experts.{e}.w1/w3/w2``).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from torch import nn

from moelora.layer import FusedMoEWithLoRA
from moelora.peft_loader import (
    FORMAT_F1,
    FORMAT_F2,
    FORMAT_F2_SWAPPED,
    AdapterLoadReport,
    load_into_pool,
    read_peft_adapter,
)
from moelora.pool import AdapterLoadError, MoELoRAMemoryPool
from moelora.reference import LoRAProjection, ReferenceLoRA, reference_moe
from moelora.torch_path import moe_lora_forward_torch

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

# H=16, I=12, E=4: H != I and H != 2I, so every F2 tensor's orientation is decided by its shape and an
# H/I mix-up fails. Layer 0 is dense (mlp_only_layers=[0]); layers 1 and 2 are MoE.
H, I, E, TOP_K = 16, 12, 4, 2  # noqa: E741  (I = intermediate size, as in DESIGN.md)
MOE_LAYERS = (1, 2)
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def routing(m: int, gen: torch.Generator, experts: int = E, top_k: int = TOP_K):
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(m)])
    weights = torch.rand(m, top_k, generator=gen) + 0.25
    return weights, ids


def fill_lora(model: nn.Module, seed: int, std: float = 0.3) -> None:
    """Seeded random LoRA weights (PEFT inits B to zero, which would make every check vacuous)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    scale = max(1.0, want.abs().max().item())
    err = (got.double() - want.double()).abs().max().item()
    assert err <= 1e-4 * scale, f"{what}: max abs err {err:.3g} (scale {scale:.3g})"


def read(path, **kw) -> tuple[dict[int, ReferenceLoRA], AdapterLoadReport]:
    args = dict(num_experts=E, hidden_size=H, intermediate_size=I, layer_ids=MOE_LAYERS, max_rank=8)
    args.update(kw)
    return read_peft_adapter(path, **args)


def write_adapter(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG).write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / WEIGHTS))
    return path


def copy_adapter(src: Path, dst: Path, *, config=None, tensors=None) -> Path:
    """Copy of ``src`` with ``config(cfg) -> cfg`` / ``tensors(dict) -> dict`` applied."""
    cfg = json.loads((src / CONFIG).read_text())
    sd = load_file(str(src / WEIGHTS))
    return write_adapter(dst, config(cfg) if config else cfg, tensors(sd) if tensors else sd)


# --------------------------------------------------------------------------------------------------
# F2: tiny transformers-5 Qwen3-MoE + PEFT target_parameters
# --------------------------------------------------------------------------------------------------


def tiny_qwen3_moe(seed: int = 0, hidden: int = H, inter: int = I) -> nn.Module:
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=32,
        hidden_size=hidden,
        intermediate_size=24,
        moe_intermediate_size=inter,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=E,
        num_experts_per_tok=TOP_K,
        mlp_only_layers=[0],
        decoder_sparse_step=1,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(cfg).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


F2_SPECS = {
    # both fused parameters (listed gate_up first), attention LoRA and a router LoRA (to be ignored),
    # layer 2's down_proj at its own rank and alpha via patterns in PEFT's "module path" spelling
    "both": dict(
        r=2,
        lora_alpha=5,
        target_modules=["q_proj", "v_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"],
        rank_pattern={"model.layers.2.mlp.experts.down_proj": 3},
        alpha_pattern={"layers.2.mlp.experts.down_proj": 2},
    ),
    # the other order in target_parameters must nest the same way (PEFT nests by registration order)
    "both-reversed-rslora": dict(
        r=4,
        lora_alpha=3,
        use_rslora=True,
        target_parameters=["down_proj", "gate_up_proj"],
        rank_pattern={r".*\.gate_up_proj": 3},
        alpha_pattern={"down_proj": 7},
    ),
    "gate-up-only": dict(r=3, lora_alpha=6, target_parameters=["gate_up_proj"]),
    "down-only": dict(r=2, lora_alpha=4, target_parameters=["mlp.experts.down_proj"]),
    # a transformers-4 style config: PEFT rewrites it to target_parameters + rank_pattern {".*\.gate_up_proj":
    # 2r} + alpha_pattern {".*\.gate_up_proj": 2*alpha} before injecting, and saves the rewritten config
    "v4-style": dict(r=2, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"]),
}


@pytest.fixture(scope="module")
def f2_adapters(tmp_path_factory):
    """name -> (adapter dir, PEFT model) for every F2_SPECS entry."""
    root = tmp_path_factory.mktemp("f2")
    out = {}
    for i, (name, spec) in enumerate(F2_SPECS.items()):
        with warnings.catch_warnings():
            # PEFT 0.21 checks rank/alpha_pattern keys against targeted *modules* only and warns that keys for
            # targeted parameters "matched nothing"; they are applied (the ranks below prove it).
            warnings.filterwarnings("ignore", ".*_pattern keys did not match", RuntimeWarning)
            pm = get_peft_model(tiny_qwen3_moe(seed=i), LoraConfig(**spec))
        fill_lora(pm, seed=100 + i)
        if name == "v4-style":
            # What PEFT's conversion of a real transformers-4 checkpoint gives: per expert a block-diagonal
            # gate_up B ([B_gate, 0; 0, B_up]) over a rank-2r A (rows: gate A then up A).
            for lid in MOE_LAYERS:
                wrapper = pm.base_model.model.model.layers[lid].mlp.experts.base_layer
                assert wrapper.parameter_name == "gate_up_proj"
                b = wrapper.lora_B["default"].weight.data  # (2I, 2r * E), rank-major
                b3 = b.view(2 * I, -1, E)
                r = b3.shape[1] // 2
                b3[:I, r:] = 0
                b3[I:, :r] = 0
        pm.save_pretrained(root / name)
        out[name] = (root / name, pm)
    return out


def peft_experts_vs_reference(pm, layers: dict[int, ReferenceLoRA], seed: int = 7, m: int = 9):
    """Per MoE layer: (PEFT experts output, reference_moe with the loaded LoRA, base output, inputs)."""
    gen = torch.Generator().manual_seed(seed)
    res = {}
    for lid in MOE_LAYERS:
        experts = pm.base_model.model.model.layers[lid].mlp.experts
        base = experts.get_base_layer()
        x = torch.randn(m, H, generator=gen)
        w, ids = routing(m, gen)
        with torch.no_grad():
            got = experts(x, ids, w)  # Qwen3MoeExperts.forward(hidden_states, top_k_index, top_k_weights)
        w13, w2 = base.gate_up_proj.detach(), base.down_proj.detach()
        want = reference_moe(x, w13, w2, w, ids, adapters=[layers.get(lid)], token_adapter=[0] * m)
        plain = reference_moe(x, w13, w2, w, ids)
        res[lid] = (got, want, plain, (x, w, ids, w13, w2))
    return res


def test_f2_nesting_and_layout_facts(f2_adapters):
    """What PEFT 0.21 writes: gate_up is the inner wrapper whatever the target_parameters order, A (E*r, in)
    expert-major, B (out, E*r) rank-major, one A shared by gate and up."""
    for name in ("both", "both-reversed-rslora"):
        path, pm = f2_adapters[name]
        cfg = json.loads((path / CONFIG).read_text())
        # PEFT's transformers-5 config conversion turns the list into a set: it is saved in arbitrary order
        assert sorted(cfg["target_parameters"]) == sorted(F2_SPECS[name]["target_parameters"])
        experts = pm.base_model.model.model.layers[1].mlp.experts
        assert experts.parameter_name == "down_proj"
        assert experts.base_layer.parameter_name == "gate_up_proj"
        sd = load_file(str(path / WEIGHTS))
        pre = "base_model.model.model.layers.1.mlp.experts"
        r_gu = sd[f"{pre}.base_layer.lora_A.weight"].shape[0] // E
        assert sd[f"{pre}.base_layer.lora_A.weight"].shape == (E * r_gu, H)
        assert sd[f"{pre}.base_layer.lora_B.weight"].shape == (2 * I, E * r_gu)
        r_d = sd[f"{pre}.lora_A.weight"].shape[0] // E
        assert sd[f"{pre}.lora_A.weight"].shape == (E * r_d, I)
        assert sd[f"{pre}.lora_B.weight"].shape == (H, E * r_d)

    # the per-expert slices, checked against PEFT's own delta of the fused parameter
    path, pm = f2_adapters["both"]
    layers, _ = read(path)
    wrapper = pm.base_model.model.model.layers[1].mlp.experts.base_layer
    with torch.no_grad():
        delta = wrapper.get_delta_weight("default")  # (E, 2I, H)
    for e in range(E):
        gate, up = layers[1].gate[e], layers[1].up[e]
        assert torch.equal(gate.a, up.a)  # shared A
        assert_close(gate.scaling * gate.b @ gate.a, delta[e, :I], f"gate delta expert {e}")
        assert_close(up.scaling * up.b @ up.a, delta[e, I:], f"up delta expert {e}")


@pytest.mark.parametrize("name", list(F2_SPECS))
def test_f2_matches_peft(f2_adapters, name):
    path, pm = f2_adapters[name]
    layers, report = read(path)
    assert report.format == FORMAT_F2
    assert report.layers == list(MOE_LAYERS)
    assert report.experts_per_layer == {lid: list(range(E)) for lid in MOE_LAYERS}
    for lid, (got, want, plain, _) in peft_experts_vs_reference(pm, layers).items():
        assert_close(want, got, f"{name} layer {lid}")
        assert (got - plain).abs().max() > 1e-2 * got.abs().max(), "the adapter must change the output"
    spec = F2_SPECS[name]
    has = {p: any(p in t for t in pm.peft_config["default"].target_parameters) for p in ("gate_up", "down")}
    for lid in MOE_LAYERS:
        assert bool(layers[lid].gate) == bool(layers[lid].up) == has["gate_up"]
        assert bool(layers[lid].down) == has["down"]
    for pname, r in report.ranks.items():
        assert re.fullmatch(r"model\.layers\.[12]\.mlp\.experts\.(gate_up_proj|down_proj)", pname)
        assert report.scalings[pname] > 0 and r > 0
    if name == "both":
        # rank_pattern/alpha_pattern keys are PEFT module paths without "base_model.model."
        assert report.ranks["model.layers.2.mlp.experts.down_proj"] == 3
        assert report.scalings["model.layers.2.mlp.experts.down_proj"] == pytest.approx(2 / 3)
        assert report.scalings["model.layers.1.mlp.experts.down_proj"] == pytest.approx(5 / 2)
        reasons = report.ignored_keys
        assert any("q_proj" in k and "attention" in v for k, v in reasons.items())
        assert any(k.endswith("mlp.gate.lora_A.weight") and "router" in v for k, v in reasons.items())
        assert not any("experts" in k for k in reasons)
    if name == "both-reversed-rslora":
        assert report.scalings["model.layers.1.mlp.experts.gate_up_proj"] == pytest.approx(3 / math.sqrt(3))
        assert report.scalings["model.layers.1.mlp.experts.down_proj"] == pytest.approx(7 / math.sqrt(4))
    if name == "v4-style":
        cfg = json.loads((path / CONFIG).read_text())
        assert cfg["rank_pattern"] == {r".*\.gate_up_proj": 2 * spec["r"]}  # PEFT's rewrite, honoured
        assert cfg["alpha_pattern"] == {r".*\.gate_up_proj": 2 * spec["lora_alpha"]}
        assert report.ranks["model.layers.1.mlp.experts.gate_up_proj"] == 4
        assert report.scalings["model.layers.1.mlp.experts.gate_up_proj"] == pytest.approx(8 / 4)
        # the block-diagonal gate_up costs rank r per projection, not 2r: it fits a max_rank-2 pool
        assert report.max_rank == 2
        assert all(
            p.rank == 2 for lid in MOE_LAYERS for p in (*layers[lid].gate.values(), *layers[lid].up.values())
        )
        layers2, report2 = read(path, max_rank=2)
        assert report2.max_rank == 2 and report2.notes
        for lid, (got, want, _, _) in peft_experts_vs_reference(pm, layers2).items():
            assert_close(want, got, f"v4-style max_rank 2 layer {lid}")


def test_f2_dtype_and_pool_bytes(f2_adapters, tmp_path):
    path, _ = f2_adapters["both"]
    layers32, rep32 = read(path, max_rank=8)
    layers16, rep16 = read(path, max_rank=8, dtype=torch.bfloat16)
    p = layers16[1].gate[0]
    assert p.a.dtype == p.b.dtype == torch.bfloat16 and p.a.device.type == "cpu"
    assert torch.equal(p.a, layers32[1].gate[0].a.to(torch.bfloat16))
    for dtype, rep in ((torch.float32, rep32), (torch.bfloat16, rep16)):
        pool = MoELoRAMemoryPool(E, H, I, MOE_LAYERS, max_loras=3, max_rank=8, dtype=dtype, device="cpu")
        assert rep.pool_bytes == pool.nbytes // pool.max_loras
    assert rep32.max_rank == 3 and rep32.pool_max_rank == 8
    # fp32 tensors for a bf16 pool: pool_bytes (and the overflow check) follow pool_dtype
    layers_mixed, rep_mixed = read(path, dtype=torch.float32, pool_dtype=torch.bfloat16)
    assert layers_mixed[1].gate[0].a.dtype == torch.float32 and rep_mixed.pool_bytes == rep16.pool_bytes
    cfg, sd = good_f1()
    big = write_adapter(tmp_path / "big", cfg, {**sd, KB: torch.full((I, 2), 1e6)})
    read(big, dtype=torch.float32)
    with pytest.raises(AdapterLoadError, match="LoRA B overflows float16"):
        read(big, dtype=torch.float32, pool_dtype=torch.float16)


# --------------------------------------------------------------------------------------------------
# PEFT 0.17-0.19.0 swapped F2 layout
# --------------------------------------------------------------------------------------------------


def to_swapped(sd: dict[str, torch.Tensor], experts: int = E) -> dict[str, torch.Tensor]:
    """Rewrites every F2 pair the way PEFT 0.18/0.19.0 stored it: A_old (E*r, out) with A_old[e*r+j] =
    B[:, j*E+e], B_old (in, E*r) with B_old[:, j*E+e] = A[e*r+j] (the same delta, transposed)."""
    out = dict(sd)
    for ka in [k for k in sd if re.search(r"experts(\.base_layer)*\.lora_A\.weight$", k)]:
        kb = ka.replace("lora_A", "lora_B")
        a, b = sd[ka], sd[kb]  # (E*r, in), (out, E*r)
        r = a.shape[0] // experts
        out[ka] = b.reshape(b.shape[0], r, experts).permute(2, 1, 0).reshape(experts * r, b.shape[0])
        out[kb] = a.reshape(experts, r, a.shape[1]).permute(2, 1, 0).reshape(a.shape[1], r * experts)
    return out


def assert_same_lora(got: dict[int, ReferenceLoRA], want: dict[int, ReferenceLoRA]) -> None:
    assert got.keys() == want.keys()
    for lid in want:
        for proj in ("gate", "up", "down"):
            g, w = getattr(got[lid], proj), getattr(want[lid], proj)
            assert g.keys() == w.keys()
            for e in w:
                assert g[e].scaling == w[e].scaling
                assert torch.equal(g[e].a, w[e].a) and torch.equal(g[e].b, w[e].b), (lid, proj, e)


@pytest.mark.parametrize("name", ["both", "gate-up-only", "down-only"])
def test_swapped_f2_loads_to_the_same_numbers(f2_adapters, tmp_path, name):
    path, pm = f2_adapters[name]
    want, _ = read(path)

    def cfg(c):
        return {**c, "peft_version": "0.18.1"}

    swapped = copy_adapter(path, tmp_path / "swapped", config=cfg, tensors=to_swapped)
    sd_new, sd_old = load_file(str(path / WEIGHTS)), load_file(str(swapped / WEIGHTS))
    k = next(k for k in sd_new if k.endswith("experts.lora_A.weight"))
    assert sd_old[k].shape != sd_new[k].shape  # H != 2I, H != I: the shapes decide
    got, report = read(swapped)
    assert report.format == FORMAT_F2_SWAPPED
    assert_same_lora(got, want)
    for lid, (out, ref, _, _) in peft_experts_vs_reference(pm, got).items():
        assert_close(ref, out, f"swapped {name} layer {lid}")


def test_swapped_f2_ambiguous_shapes_use_peft_version(tmp_path):
    """H == 2I: a gate_up-only F2 file fits both orientations; peft_version decides (0.17.0-0.19.0 swapped,
    0.19.1 on not), and without one the adapter is refused rather than guessed."""
    hid, inter, r = 16, 8, 2
    gen = torch.Generator().manual_seed(3)
    pre = "base_model.model.model.layers.1.mlp.experts"
    a, b = torch.randn(E * r, hid, generator=gen), torch.randn(2 * inter, E * r, generator=gen)
    sd = {f"{pre}.lora_A.weight": a, f"{pre}.lora_B.weight": b}
    base_cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 4, "target_parameters": ["gate_up_proj"]}
    kw = dict(hidden_size=hid, intermediate_size=inter, layer_ids=[1])
    want, rep = read(write_adapter(tmp_path / "new", {**base_cfg, "peft_version": "0.19.1"}, sd), **kw)
    assert rep.format == FORMAT_F2
    for e in range(E):
        assert torch.equal(want[1].gate[e].a, a[e * r : (e + 1) * r])
        assert torch.equal(want[1].gate[e].b, b[:inter, e::E])
        assert torch.equal(want[1].up[e].b, b[inter:, e::E])
    old = to_swapped(sd)
    for version in ("0.17.1", "0.18.0", "0.18.1", "0.19.0"):
        got, rep = read(write_adapter(tmp_path / version, {**base_cfg, "peft_version": version}, old), **kw)
        assert rep.format == FORMAT_F2_SWAPPED and "peft_version" in rep.notes[0]
        assert_same_lora(got, want)
    with pytest.raises(AdapterLoadError, match=r"adapter_config\.json: key 'peft_version': cannot tell"):
        read(write_adapter(tmp_path / "noversion", base_cfg, old), **kw)


# --------------------------------------------------------------------------------------------------
# F1: hand-built per-expert module tree + PEFT target_modules
# --------------------------------------------------------------------------------------------------

NAMES = {
    "qwen": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}


class Expert(nn.Module):
    def __init__(self, names):
        super().__init__()
        self.names = names
        g, u, d = names
        setattr(self, g, nn.Linear(H, I, bias=False))
        setattr(self, u, nn.Linear(H, I, bias=False))
        setattr(self, d, nn.Linear(I, H, bias=False))

    def projs(self):
        return [getattr(self, n) for n in self.names]


class SparseMoe(nn.Module):
    def __init__(self, names, shared: bool):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)  # router
        self.experts = nn.ModuleList(Expert(names) for _ in range(E))
        if shared:
            self.shared_expert = Expert(names)


class DecoderLayer(nn.Module):
    def __init__(self, style: str, dense: bool):
        super().__init__()
        block, names = NAMES[style]
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(H, H, bias=False)
        setattr(self, block, Expert(names) if dense else SparseMoe(names, shared=style == "qwen"))


class TinyTree(nn.Module):
    def __init__(self, style: str):
        super().__init__()
        self.style = style
        self.model = nn.Module()
        # layer 0 is dense
        self.model.layers = nn.ModuleList(DecoderLayer(style, dense=i == 0) for i in range(3))
        self.lm_head = nn.Linear(H, 7, bias=False)
        for p in self.parameters():
            nn.init.normal_(p, 0, 0.2)


def moe_block(pm, lid):
    tree = pm.base_model.model
    return getattr(tree.model.layers[lid], NAMES[tree.style][0])


def peft_f1_moe(block, x, w, ids) -> torch.Tensor:
    """The MoE computed with PEFT's wrapped per-expert Linear modules."""
    out = torch.zeros(x.shape[0], H)
    with torch.no_grad():
        for t in range(x.shape[0]):
            for k in range(ids.shape[1]):
                gate, up, down = block.experts[int(ids[t, k])].projs()
                out[t] += w[t, k] * down(F.silu(gate(x[t : t + 1])) * up(x[t : t + 1]))[0]
    return out


def f1_base(block) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = torch.stack(
        [torch.cat([p.get_base_layer().weight for p in ex.projs()[:2]]) for ex in block.experts]
    )
    w2 = torch.stack([ex.projs()[2].get_base_layer().weight for ex in block.experts])
    return w13.detach(), w2.detach()


F1_SPECS = {
    "qwen-patterns": (
        "qwen",
        dict(
            r=2,
            lora_alpha=4,
            target_modules=["gate_proj", "up_proj", "down_proj", "q_proj", "gate"],
            modules_to_save=["lm_head"],
            rank_pattern={"model.layers.2.mlp.experts.3.down_proj": 4, "experts.0.up_proj": 1},
            alpha_pattern={r"experts\.1\.gate_proj": 5, "model.layers.1.mlp.experts.2.down_proj": 1},
        ),
    ),
    "qwen-rslora": (
        "qwen",
        dict(
            r=3,
            lora_alpha=6,
            use_rslora=True,
            target_modules=["gate_proj", "up_proj", "down_proj"],
            rank_pattern={"experts.1.up_proj": 2},
            alpha_pattern={"down_proj": 9},
        ),
    ),
    "mixtral": (
        "mixtral",
        dict(
            r=2, lora_alpha=3, target_modules=["w1", "w2", "w3", "q_proj"], rank_pattern={"experts.2.w2": 3}
        ),
    ),
}


@pytest.fixture(scope="module")
def f1_adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("f1")
    out = {}
    for i, (name, (style, spec)) in enumerate(F1_SPECS.items()):
        torch.manual_seed(10 + i)
        pm = get_peft_model(TinyTree(style), LoraConfig(**spec))
        fill_lora(pm, seed=200 + i)
        pm.save_pretrained(root / name)
        out[name] = (root / name, pm)
    return out


def f1_check(pm, layers: dict[int, ReferenceLoRA], seed: int = 11, m: int = 7):
    gen = torch.Generator().manual_seed(seed)
    res = {}
    for lid in MOE_LAYERS:
        block = moe_block(pm, lid)
        x = torch.randn(m, H, generator=gen)
        w, ids = routing(m, gen)
        w13, w2 = f1_base(block)
        got = peft_f1_moe(block, x, w, ids)
        want = reference_moe(x, w13, w2, w, ids, adapters=[layers[lid]], token_adapter=[0] * m)
        res[lid] = (got, want, reference_moe(x, w13, w2, w, ids), (x, w, ids, w13, w2))
    return res


@pytest.mark.parametrize("name", list(F1_SPECS))
def test_f1_matches_peft(f1_adapters, name):
    path, pm = f1_adapters[name]
    layers, report = read(path)
    assert report.format == FORMAT_F1
    assert report.layers == list(MOE_LAYERS)
    assert report.experts_per_layer == {lid: list(range(E)) for lid in MOE_LAYERS}
    for lid, (got, want, plain, _) in f1_check(pm, layers).items():
        assert_close(want, got, f"{name} layer {lid}")
        assert (got - plain).abs().max() > 1e-2 * got.abs().max()
    # every expert module of PEFT, with PEFT's own rank and scaling
    peft_mods = {
        n: mod
        for n, mod in pm.base_model.model.named_modules()
        if hasattr(mod, "scaling") and ".experts." in n
    }
    assert set(report.ranks) == set(peft_mods)
    for n, mod in peft_mods.items():
        assert report.ranks[n] == mod.r["default"]
        assert report.scalings[n] == pytest.approx(mod.scaling["default"])
    reasons = report.ignored_keys
    if "q_proj" in F1_SPECS[name][1]["target_modules"]:
        assert any("self_attn.q_proj" in k and "attention" in v for k, v in reasons.items())
    assert not any(".experts." in k for k in reasons)
    if name == "qwen-patterns":
        assert report.ranks["model.layers.2.mlp.experts.3.down_proj"] == 4
        assert report.ranks["model.layers.1.mlp.experts.0.up_proj"] == 1
        assert report.scalings["model.layers.1.mlp.experts.1.gate_proj"] == pytest.approx(5 / 2)
        assert report.scalings["model.layers.1.mlp.experts.2.down_proj"] == pytest.approx(1 / 2)
        assert reasons["base_model.model.lm_head.weight"].startswith("modules_to_save")
        assert any("shared_expert" in k and "shared expert" in v for k, v in reasons.items())
        assert any(".layers.0.mlp.gate_proj." in k and "dense MLP" in v for k, v in reasons.items())
        assert any(k.endswith("mlp.gate.lora_A.weight") and "router" in v for k, v in reasons.items())
    if name == "mixtral":
        assert report.ranks["model.layers.1.block_sparse_moe.experts.2.w2"] == 3
        assert set(layers[1].gate[0].a.shape) == {2, H}  # w1 -> gate, (r, H)
        w1 = moe_block(pm, 1).experts[0].w1
        assert torch.equal(layers[1].gate[0].a, w1.lora_A["default"].weight.detach())
        assert torch.equal(
            layers[1].up[0].b, moe_block(pm, 1).experts[0].w3.lora_B["default"].weight.detach()
        )
        assert torch.equal(
            layers[1].down[0].b, moe_block(pm, 1).experts[0].w2.lora_B["default"].weight.detach()
        )


def test_zero_rank_components_are_dropped(f1_adapters, tmp_path):
    """An expert never routed to in training keeps B == 0: it costs nothing and adds nothing."""
    path, pm = f1_adapters["qwen-rslora"]

    def zero(sd):
        for k in sd:
            if ".layers.1.mlp.experts.3." in k and "lora_B" in k:
                sd[k] = torch.zeros_like(sd[k])
        return sd

    layers, report = read(copy_adapter(path, tmp_path / "z", tensors=zero))
    assert 3 not in layers[1].gate and 3 not in layers[1].up and 3 not in layers[1].down
    assert 3 in layers[2].gate and report.notes
    assert report.experts_per_layer[1] == list(range(E))  # present in the file


# --------------------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------------------

KA = "base_model.model.model.layers.1.mlp.experts.0.gate_proj.lora_A.weight"
KB = "base_model.model.model.layers.1.mlp.experts.0.gate_proj.lora_B.weight"


def good_f1(r: int = 2) -> tuple[dict, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    sd = {}
    for lid in MOE_LAYERS:
        for e in range(E):
            for proj, (i_f, o_f) in (("gate_proj", (H, I)), ("up_proj", (H, I)), ("down_proj", (I, H))):
                pre = f"base_model.model.model.layers.{lid}.mlp.experts.{e}.{proj}"
                sd[f"{pre}.lora_A.weight"] = torch.randn(r, i_f, generator=gen)
                sd[f"{pre}.lora_B.weight"] = torch.randn(o_f, r, generator=gen)
    cfg = {
        "peft_type": "LORA",
        "peft_version": "0.21.2",
        "r": r,
        "lora_alpha": 2 * r,
        "bias": "none",
        "target_modules": ["gate_proj", "up_proj", "down_proj"],
    }
    return cfg, sd


def good_f2(r: int = 2) -> tuple[dict, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(6)
    sd = {}
    for lid in MOE_LAYERS:
        pre = f"base_model.model.model.layers.{lid}.mlp.experts"
        sd[f"{pre}.base_layer.lora_A.weight"] = torch.randn(E * r, H, generator=gen)
        sd[f"{pre}.base_layer.lora_B.weight"] = torch.randn(2 * I, E * r, generator=gen)
        sd[f"{pre}.lora_A.weight"] = torch.randn(E * r, I, generator=gen)
        sd[f"{pre}.lora_B.weight"] = torch.randn(H, E * r, generator=gen)
    cfg = {
        "peft_type": "LORA",
        "peft_version": "0.21.2",
        "r": r,
        "lora_alpha": 4,
        "target_parameters": ["down_proj", "gate_up_proj"],
    }
    return cfg, sd


F2A = "base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight"
F2B = "base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight"


def cfg_set(**kv):
    return lambda cfg, sd: ({**cfg, **kv}, sd)


def sd_set(key, value):
    return lambda cfg, sd: (cfg, {**sd, key: value})


def sd_del(key):
    return lambda cfg, sd: (cfg, {k: v for k, v in sd.items() if k != key})


def sd_rename(old, new):
    return lambda cfg, sd: (cfg, {(k.replace(old, new)): v for k, v in sd.items()})


def only_attention(cfg, sd):
    gen = torch.Generator().manual_seed(0)
    pre = "base_model.model.model.layers.1.self_attn.q_proj"
    return cfg, {
        f"{pre}.lora_A.weight": torch.randn(2, H, generator=gen),
        f"{pre}.lora_B.weight": torch.randn(H, 2),
    }


def mixed(cfg, sd):
    cfg2, sd2 = good_f2()
    return {**cfg, "target_parameters": cfg2["target_parameters"]}, {**sd, **sd2}


# (id, base ("f1"/"f2"), mutation, expected file, expected key or None, reason regex)
REFUSALS = [
    ("wrong-hidden", "f1", sd_set(KA, torch.randn(2, H + 1)), WEIGHTS, KA, r"expected \(r, H=16\).*hidden"),
    (
        "wrong-inter",
        "f1",
        sd_set(KB, torch.randn(I + 2, 2)),
        WEIGHTS,
        KB,
        r"expected \(I=12, r\).*intermediate",
    ),
    ("rank-mismatch-ab", "f1", sd_set(KB, torch.randn(I, 3)), WEIGHTS, KB, r"rank mismatch"),
    ("rank-vs-config", "f1", cfg_set(r=4), WEIGHTS, KA, r"config gives module .* rank 4"),
    ("lone-A", "f1", sd_del(KB), WEIGHTS, KA, r"lone LoRA factor.*lora_B"),
    ("lone-B", "f1", sd_del(KA), WEIGHTS, KB, r"lone LoRA factor.*lora_A"),
    (
        "expert-out-of-range",
        "f1",
        sd_rename("experts.3.", "experts.4."),
        WEIGHTS,
        "base_model.model.model.layers.1.mlp.experts.4.gate_proj.lora_A.weight",
        r"expert index 4.*num_experts=4",
    ),
    (
        "layer-not-moe",
        "f1",
        sd_rename("layers.2.", "layers.5."),
        WEIGHTS,
        "base_model.model.model.layers.5.mlp.experts.0.gate_proj.lora_A.weight",
        r"layer 5 is not an MoE layer",
    ),
    (
        "int-tensor",
        "f1",
        sd_set(KA, torch.ones(2, H, dtype=torch.int32)),
        WEIGHTS,
        KA,
        r"floating-point.*int32",
    ),
    ("3d-tensor", "f1", sd_set(KA, torch.ones(1, 2, H)), WEIGHTS, KA, r"must be 2-D"),
    ("nan", "f1", sd_set(KA, torch.full((2, H), float("nan"))), WEIGHTS, KA, r"non-finite.*NaN"),
    ("inf", "f1", sd_set(KB, torch.full((I, 2), float("inf"))), WEIGHTS, KB, r"non-finite.*Inf"),
    ("dora-flag", "f1", cfg_set(use_dora=True), CONFIG, "use_dora", r"DoRA"),
    (
        "dora-key",
        "f1",
        sd_set(KA.replace("lora_A.weight", "lora_magnitude_vector"), torch.ones(I)),
        WEIGHTS,
        KA.replace("lora_A.weight", "lora_magnitude_vector"),
        r"DoRA",
    ),
    ("bias-all", "f1", cfg_set(bias="all"), CONFIG, "bias", r"bias='all'"),
    ("bias-lora-only", "f1", cfg_set(bias="lora_only"), CONFIG, "bias", r"bias='lora_only'"),
    ("lora-bias-flag", "f1", cfg_set(lora_bias=True), CONFIG, "lora_bias", r"LoRA bias"),
    (
        "lora-bias-key",
        "f1",
        sd_set(KB.replace(".weight", ".bias"), torch.zeros(I)),
        WEIGHTS,
        KB.replace(".weight", ".bias"),
        r"LoRA bias",
    ),
    ("peft-type", "f1", cfg_set(peft_type="LOHA"), CONFIG, "peft_type", r"unsupported PEFT type 'LOHA'"),
    ("qalora", "f1", cfg_set(use_qalora=True), CONFIG, "use_qalora", r"QALoRA"),
    (
        "layer-replication",
        "f1",
        cfg_set(layer_replication=[[0, 2]]),
        CONFIG,
        "layer_replication",
        r"replicated",
    ),
    (
        "alora",
        "f1",
        cfg_set(alora_invocation_tokens=[1, 2]),
        CONFIG,
        "alora_invocation_tokens",
        r"activated LoRA",
    ),
    (
        "trainable-tokens",
        "f1",
        cfg_set(trainable_token_indices=[3]),
        CONFIG,
        "trainable_token_indices",
        r"embed",
    ),
    ("bdlora", "f1", cfg_set(use_bdlora={"nblocks": 2}), CONFIG, "use_bdlora", r"BD-LoRA"),
    ("arrow", "f1", cfg_set(arrow_config={"top_k": 2}), CONFIG, "arrow_config", r"Arrow"),
    ("kasa", "f1", cfg_set(kasa_config={"x": 1}), CONFIG, "kasa_config", r"KaSA"),
    ("monteclora", "f1", cfg_set(monteclora_config={"x": 1}), CONFIG, "monteclora_config", r"MonteCLoRA"),
    ("pissa", "f1", cfg_set(init_lora_weights="pissa_niter_4"), CONFIG, "init_lora_weights", r"residual"),
    ("olora", "f1", cfg_set(init_lora_weights="olora"), CONFIG, "init_lora_weights", r"residual"),
    ("loftq", "f1", cfg_set(init_lora_weights="loftq"), CONFIG, "init_lora_weights", r"residual"),
    ("lora-ga", "f1", cfg_set(init_lora_weights="lora_ga"), CONFIG, "init_lora_weights", r"residual"),
    ("bad-r", "f1", cfg_set(r="8"), CONFIG, "r", r"positive int"),
    (
        "bad-regex",
        "f1",
        cfg_set(rank_pattern={"experts.(0": 3}),
        CONFIG,
        "rank_pattern",
        r"regular expression",
    ),
    (
        "unknown-expert-proj",
        "f1",
        sd_rename("experts.0.gate_proj", "experts.0.fc1"),
        WEIGHTS,
        "base_model.model.model.layers.1.mlp.experts.0.fc1.lora_A.weight",
        r"unknown expert layout",
    ),
    (
        "unknown-expert-module",
        "f1",
        sd_rename("experts.0.gate_proj", "experts.gate_up_proj"),
        WEIGHTS,
        "base_model.model.model.layers.1.mlp.experts.gate_up_proj.lora_A.weight",
        r"unknown expert layout",
    ),
    (
        "modules-to-save-experts",
        "f1",
        lambda c, s: (
            {**c, "modules_to_save": ["experts"]},
            {**s, "base_model.model.model.layers.1.mlp.experts.0.gate_proj.weight": torch.ones(I, H)},
        ),
        WEIGHTS,
        "base_model.model.model.layers.1.mlp.experts.0.gate_proj.weight",
        r"modules_to_save replaces",
    ),
    ("no-expert-weights", "f1", only_attention, WEIGHTS, None, r"no expert LoRA weights at all"),
    ("mixed-f1-f2", "f1", mixed, WEIGHTS, KA, r"mixes per-expert \(F1\) and fused-parameter \(F2\)"),
    (
        "rank-above-max-f1",
        "f1",
        lambda c, s: good_f1(r=9),
        WEIGHTS,
        KA,
        r"module model\.layers\.1\.mlp\.experts\.0\.gate_proj: rank 9 exceeds max_rank 8",
    ),
    ("fp16-overflow", "f1", sd_set(KB, torch.full((I, 2), 1e6)), WEIGHTS, KB, r"overflows float16"),
    (
        "f2-wrong-hidden",
        "f2",
        sd_set(F2A, torch.randn(E * 2, H + 1)),
        WEIGHTS,
        F2A,
        r"wrong shapes for gate_up_proj",
    ),
    ("f2-wrong-inter", "f2", sd_set(F2B, torch.randn(2 * I + 2, E * 2)), WEIGHTS, F2A, r"wrong shapes"),
    ("f2-num-experts", "f2", sd_set(F2A, torch.randn(9, H)), WEIGHTS, F2B, r"rank mismatch"),
    (
        "f2-num-experts-rank",
        "f2",
        lambda c, s: (c, {**s, F2A: torch.randn(E * 4, H), F2B: torch.randn(2 * I, E * 4)}),
        WEIGHTS,
        F2A,
        r"num_experts \(4\) x rank 4.*rank 2",
    ),
    ("f2-lone-A", "f2", sd_del(F2B), WEIGHTS, F2A, r"lone LoRA factor"),
    (
        "f2-layer-not-moe",
        "f2",
        sd_rename("layers.2.", "layers.0."),
        WEIGHTS,
        "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight",
        r"layer 0 is not an MoE layer",
    ),
    ("f2-no-target-parameters", "f2", cfg_set(target_parameters=None), WEIGHTS, F2A, r"no target_parameters"),
    (
        "f2-unknown-target-parameter",
        "f2",
        cfg_set(target_parameters=["experts.gate_up_proj_bias"]),
        CONFIG,
        "target_parameters",
        r"unsupported target_parameters entry 'experts.gate_up_proj_bias'",
    ),
    (
        "f2-gpt-oss",
        "f2",
        cfg_set(base_model_name_or_path="openai/gpt-oss-20b"),
        CONFIG,
        "base_model_name_or_path",
        r"gpt-oss interleaves gate and up",
    ),
    (
        "f2-too-deep",
        "f2",
        sd_rename("experts.base_layer.", "experts.base_layer.base_layer."),
        WEIGHTS,
        "base_model.model.model.layers.1.mlp.experts.base_layer.base_layer.lora_A.weight",
        r"unknown expert layout",
    ),
    (
        "f2-rank-above-max",
        "f2",
        lambda c, s: good_f2(r=9),
        WEIGHTS,
        F2A,
        r"module model\.layers\.1\.mlp\.experts\.gate_up_proj\[expert 0 gate\]: rank 9 exceeds max_rank 8",
    ),
    (
        "f2-inconsistent",
        "f2",
        lambda c, s: (c, {**s, **{k: v for k, v in to_swapped(s).items() if "layers.2" in k}}),
        WEIGHTS,
        None,
        r"inconsistent fused-parameter layouts",
    ),
]


@pytest.mark.parametrize("case", REFUSALS, ids=[c[0] for c in REFUSALS])
def test_refusals(tmp_path, case):
    name, base, mutate, file, key, reason = case
    cfg, sd = mutate(*(good_f1() if base == "f1" else good_f2()))
    path = write_adapter(tmp_path / name, cfg, sd)
    dtype = torch.float16 if name == "fp16-overflow" else torch.float32
    with pytest.raises(AdapterLoadError) as info:
        read(path, dtype=dtype)
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    assert str(path / file) in msg or (file == WEIGHTS and str(path) in msg), msg
    assert file in msg, msg
    if key is not None:
        assert f"key {key!r}" in msg, msg
    assert re.search(reason, msg), msg


def test_the_good_synthetic_adapters_load(tmp_path):
    """The bases of the refusal cases are valid (each refusal comes from its one mutation)."""
    for name, (cfg, sd) in (("f1", good_f1()), ("f2", good_f2())):
        layers, report = read(write_adapter(tmp_path / name, cfg, sd))
        assert report.layers == list(MOE_LAYERS) and len(layers[1].down) == E
    cfg, sd = good_f1()
    cfg = {**cfg, "init_lora_weights": "mica", "velora_config": {"rank": 1}, "lora_dropout": 0.1}
    sd["base_model.model.model.layers.1.mlp.experts.0.gate_proj.lora_velora_embed"] = torch.ones(3)
    _, report = read(write_adapter(tmp_path / "forward-identical-variants", cfg, sd))
    assert "VeLoRA" in next(iter(report.ignored_keys.values()))


FILE_REFUSALS = [
    "missing-dir",
    "not-a-dir",
    "no-config",
    "no-weights",
    "bin-only",
    "config-is-dir",
    "weights-is-dir",
    "invalid-json",
    "json-not-object",
    "truncated",
    "empty-file",
    "no-tensors",
]


@pytest.mark.parametrize("name", FILE_REFUSALS)
def test_file_refusals(tmp_path, name):
    cfg, sd = good_f1()
    path = write_adapter(tmp_path / "a", cfg, sd)
    wfile, cfile = path / WEIGHTS, path / CONFIG
    expect = {"missing-dir": (tmp_path / "nope", r"does not exist")}
    if name == "missing-dir":
        path = tmp_path / "nope"
    elif name == "not-a-dir":
        path = wfile
        expect[name] = (wfile, r"not a directory")
    elif name == "no-config":
        cfile.unlink()
        expect[name] = (cfile, r"missing")
    elif name == "no-weights":
        wfile.unlink()
        expect[name] = (wfile, r"missing")
    elif name == "bin-only":
        torch.save(sd, path / "adapter_model.bin")
        wfile.unlink()
        expect[name] = (path / "adapter_model.bin", r"pickled.*[Cc]onvert.*save_file.*safe_serialization")
    elif name == "config-is-dir":
        cfile.unlink()
        cfile.mkdir()
        expect[name] = (cfile, r"not a regular file")
    elif name == "weights-is-dir":
        wfile.unlink()
        wfile.mkdir()
        expect[name] = (wfile, r"not a regular file")
    elif name == "invalid-json":
        cfile.write_text('{"r": 2,')
        expect[name] = (cfile, r"invalid JSON")
    elif name == "json-not-object":
        cfile.write_text("[1, 2]")
        expect[name] = (cfile, r"must be a JSON object")
    elif name == "truncated":
        data = wfile.read_bytes()
        wfile.write_bytes(data[: len(data) - 100])
        expect[name] = (wfile, r"truncated, corrupt or unreadable")
    elif name == "empty-file":
        wfile.write_bytes(b"")
        expect[name] = (wfile, r"empty")
    elif name == "no-tensors":
        save_file({}, str(wfile))
        expect[name] = (wfile, r"no tensors.*no expert LoRA weights")
    file, reason = expect[name]
    with pytest.raises(AdapterLoadError) as info:
        read(path)
    msg = str(info.value)
    assert msg.startswith(f"{file}: "), msg
    assert re.search(reason, msg), msg


def test_bad_arguments_are_value_errors(tmp_path):
    cfg, sd = good_f1()
    path = write_adapter(tmp_path / "a", cfg, sd)
    for kw in ({"num_experts": 0}, {"layer_ids": []}, {"max_rank": -1}, {"dtype": torch.int8}):
        with pytest.raises(ValueError):
            read(path, **kw)


# --------------------------------------------------------------------------------------------------
# load_into_pool
# --------------------------------------------------------------------------------------------------


def pool_state(pool: MoELoRAMemoryPool):
    bufs = [t.clone() for lid in pool.layer_ids for t in pool.layer(lid).tensors()]
    tables = (pool.slot_ranks.clone(), pool.slot_scalings.clone())
    host = (
        list(pool.slot_rank_host),
        list(pool.slot_scaling_host),
        dict(pool.adapter_slots),
        list(pool.slot_adapters),
    )
    return bufs, tables, host


def assert_same_state(a, b):
    assert len(a[0]) == len(b[0]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True))
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))
    assert a[2] == b[2]


def pool_outputs(pool, data):
    """Per MoE layer: (FusedMoEWithLoRA torch path, moe_lora_forward_torch) for all tokens on adapter "a"."""
    out = {}
    for lid, (x, w, ids, w13, w2) in data.items():
        batch = pool.prepare_batch(["a", None], seq_lens=[x.shape[0] - 2, 2])
        layer = FusedMoEWithLoRA(w13.contiguous(), w2.contiguous(), pool=pool, layer_id=lid, path="torch")
        y = layer(x, w, ids, batch)
        y2 = moe_lora_forward_torch(x, w13, w2, w, ids, pool.layer(lid), batch)
        assert torch.equal(y, y2)
        out[lid] = y
    return out


@pytest.mark.parametrize("which", ["f2", "f1"])
def test_load_into_pool_matches_peft_and_failures_leave_pool_unchanged(
    f2_adapters, f1_adapters, tmp_path, which
):
    if which == "f2":
        path, pm = f2_adapters["both"]
        checks = peft_experts_vs_reference(pm, read(path)[0])
        peft_out = {lid: got for lid, (got, _, _, _) in checks.items()}
    else:
        path, pm = f1_adapters["qwen-patterns"]  # per-module rank/alpha: the pool folds the scalings
        checks = f1_check(pm, read(path)[0])
        peft_out = {lid: got for lid, (got, _, _, _) in checks.items()}
    data = {lid: c[3] for lid, c in checks.items()}
    base = {lid: reference_moe(x, w13, w2, w, ids) for lid, (x, w, ids, w13, w2) in data.items()}

    pool = MoELoRAMemoryPool(E, H, I, MOE_LAYERS, max_loras=3, max_rank=4, dtype=torch.float32, device="cpu")
    report = load_into_pool(pool, "a", path)
    assert isinstance(report, AdapterLoadReport) and "a" in pool
    assert report.pool_bytes == pool.nbytes // pool.max_loras
    assert pool.slot_rank_host[pool.slot_of("a")] == report.max_rank
    before = pool_outputs(pool, data)
    for lid, y in before.items():
        m = y.shape[0]
        assert_close(y[: m - 2], peft_out[lid][: m - 2], f"{which} pool layer {lid}")
        assert torch.equal(y[m - 2 :], base[lid][m - 2 :].to(y.dtype)) or torch.allclose(
            y[m - 2 :], base[lid][m - 2 :]
        )
    snapshot = pool_state(pool)

    cfg, sd = good_f1()
    bad = {
        "rank": write_adapter(tmp_path / "rank", *good_f1(r=5)),  # above the pool's max_rank 4
        "shape": write_adapter(tmp_path / "shape", cfg, {**sd, KA: torch.randn(2, H + 3)}),
        "nan": write_adapter(tmp_path / "nan", cfg, {**sd, KB: torch.full((I, 2), float("nan"))}),
        "layer": write_adapter(tmp_path / "layer", *sd_rename("layers.2.", "layers.3.")(cfg, sd)),
        "dora": write_adapter(tmp_path / "dora", {**cfg, "use_dora": True}, sd),
        "truncated": copy_adapter(path, tmp_path / "truncated"),
    }
    w = bad["truncated"] / WEIGHTS
    w.write_bytes(w.read_bytes()[:-64])
    shutil.copytree(path, tmp_path / "good-copy")
    for name, p in bad.items():
        with pytest.raises(AdapterLoadError):
            load_into_pool(pool, "b", p)
        assert "b" not in pool, name
        assert_same_state(pool_state(pool), snapshot)
    with pytest.raises(AdapterLoadError, match="already loaded"):  # the pool's own refusal
        load_into_pool(pool, "a", tmp_path / "good-copy")
    assert_same_state(pool_state(pool), snapshot)
    after = pool_outputs(pool, data)
    for lid in before:
        assert torch.equal(after[lid], before[lid])

    # and a good second adapter still loads afterwards, into the next slot, without disturbing "a"
    load_into_pool(pool, "b", tmp_path / "good-copy")
    assert pool.slot_of("b") == 1
    for lid, y in pool_outputs(pool, data).items():
        assert torch.equal(y, before[lid])


def test_load_into_pool_bf16_rounds_once(f1_adapters):
    """Float32 goes to the pool, which rescales per-module B's and rounds to bf16 exactly once."""
    path, _ = f1_adapters["qwen-patterns"]
    pool = MoELoRAMemoryPool(E, H, I, MOE_LAYERS, max_loras=2, max_rank=4, dtype=torch.bfloat16, device="cpu")
    report = load_into_pool(pool, "a", path)
    assert report.dtype == "bfloat16"
    layers, _ = read(path)
    slot, s = pool.slot_of("a"), pool.slot_scaling_host[0]
    p = layers[1].down[2]  # alpha 1 via alpha_pattern: differs from the slot scaling
    assert p.scaling != s
    want = (p.b.float() * (p.scaling / s)).to(torch.bfloat16)
    assert torch.equal(pool.layer(1).down_b[slot, 2, :, : p.rank], want)
    assert isinstance(p, LoRAProjection)


# --------------------------------------------------------------------------------------------------
# Fast reading: one read into owned memory, batched checks, stacked staging (same results, same refusals)
# --------------------------------------------------------------------------------------------------


def test_read_tensors_own_their_memory(tmp_path):
    """The file is read, not mapped: rewriting or truncating it afterwards changes nothing read."""
    cfg, sd = good_f1()
    path = write_adapter(tmp_path / "a", cfg, sd)
    layers, _ = read(path)
    (path / WEIGHTS).write_bytes(b"")  # a map of the file would now fault (SIGBUS) on access
    save_file({k: torch.zeros_like(v) for k, v in sd.items()}, str(path / WEIGHTS))
    for lid in MOE_LAYERS:
        for e in range(E):
            p = layers[lid].gate[e]
            pre = f"base_model.model.model.layers.{lid}.mlp.experts.{e}.gate_proj"
            assert torch.equal(p.a, sd[f"{pre}.lora_A.weight"]) and torch.equal(
                p.b, sd[f"{pre}.lora_B.weight"]
            )


def _same_read(a, b):
    (la, ra), (lb, rb) = a, b
    assert {**vars(ra), "path": ""} == {**vars(rb), "path": ""} and la.keys() == lb.keys()
    for lid in la:
        for proj in ("gate", "up", "down"):
            pa, pb = getattr(la[lid], proj), getattr(lb[lid], proj)
            assert pa.keys() == pb.keys()
            for e in pa:
                assert torch.equal(pa[e].a, pb[e].a) and torch.equal(pa[e].b, pb[e].b)
                assert pa[e].scaling == pb[e].scaling


def test_reader_fallbacks_read_the_same(tmp_path, monkeypatch):
    import moelora.peft_loader as loader

    cfg, sd = good_f1()
    sd = {k: (v.half() if "up_proj" in k else v) for k, v in sd.items()}  # two dtypes in the file
    path = write_adapter(tmp_path / "a", cfg, sd)
    want = read(path)
    # a header whose length leaves the data unaligned (safetensors accepts it): aligned copies
    raw = (path / WEIGHTS).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = raw[8 : 8 + n].rstrip() + b" " * (1 - (8 + len(raw[8 : 8 + n].rstrip())) % 2)  # odd start
    assert (8 + len(header)) % 2 == 1
    odd = copy_adapter(path, tmp_path / "odd")
    (odd / WEIGHTS).write_bytes(len(header).to_bytes(8, "little") + header + raw[8 + n :])
    _same_read(read(odd), want)
    # a dtype the one-read path does not map: safetensors' own reader, copied into owned memory
    monkeypatch.delitem(loader._ST_DTYPES, "F16")
    _same_read(read(path), want)


@pytest.mark.parametrize(
    "spans, why",
    [
        ([(0, 8), (16, 24)], "gap"),
        ([(0, 8), (4, 12)], "overlap"),
        ([(0, 8), (8, 20)], "do not hold"),
        ([(0, 8)], "cover"),
    ],
)
def test_one_read_path_checks_offsets(tmp_path, spans, why):
    """Checks of the one-read path itself (safetensors refuses such files before it is reached)."""
    from moelora.peft_loader import _read_safetensors_once

    hdr = {f"t{i}": {"dtype": "F32", "shape": [2], "data_offsets": list(s)} for i, s in enumerate(spans)}
    h = json.dumps(hdr).encode()
    f = tmp_path / "x.safetensors"
    f.write_bytes(len(h).to_bytes(8, "little") + h + bytes(24))
    with pytest.raises(ValueError, match=why):
        _read_safetensors_once(f)


def test_batched_value_checks_name_the_right_tensor(tmp_path):
    """Finiteness, overflow and zero-component checks run on whole regions/batches of tensors; the
    refusal still names the one bad tensor, and overflow hidden in a dropped component is no overflow."""
    cfg, sd = good_f1(r=3)
    ka = "base_model.model.model.layers.2.mlp.experts.{e}.{p}.lora_A.weight"
    kb = "base_model.model.model.layers.2.mlp.experts.{e}.{p}.lora_B.weight"
    for e, bad in ((1, float("nan")), (3, float("inf"))):
        t = sd[kb.format(e=e, p="up_proj")].clone()
        t[5, 1] = bad
        with pytest.raises(AdapterLoadError, match="non-finite") as info:
            read(write_adapter(tmp_path / f"bad{e}", cfg, {**sd, kb.format(e=e, p="up_proj"): t}))
        assert repr(kb.format(e=e, p="up_proj")) in str(info.value)
    big = sd[ka.format(e=2, p="down_proj")].clone()
    big[1, 3] = 7e4  # beyond float16
    over = {**sd, ka.format(e=2, p="down_proj"): big}
    with pytest.raises(AdapterLoadError, match="LoRA A overflows float16") as info:
        read(write_adapter(tmp_path / "over", cfg, over), pool_dtype=torch.float16)
    assert repr(ka.format(e=2, p="down_proj")) in str(info.value)
    # the same value in a component whose B column is zero: dropped, so nothing overflows
    b = sd[kb.format(e=2, p="down_proj")].clone()
    b[:, 1] = 0
    a0 = sd[ka.format(e=0, p="gate_proj")].clone()
    a0[2] = 0
    path = write_adapter(
        tmp_path / "dropped",
        cfg,
        {**over, kb.format(e=2, p="down_proj"): b, ka.format(e=0, p="gate_proj"): a0},
    )
    layers, report = read(path, pool_dtype=torch.float16)
    assert layers[2].down[2].rank == 2 and layers[2].gate[0].rank == 2 and layers[1].gate[0].rank == 3
    assert layers[2].down[2].a.abs().max() < 7e4
    assert any("2 exactly-zero rank components dropped" in n for n in report.notes)


@pytest.mark.parametrize("which", ["good-f1", "qwen-patterns", "bf16-file"])
def test_stacked_staging_matches_the_module_path(f1_adapters, tmp_path, monkeypatch, which):
    """The pool stages whole (E, r, in) stacks when it can; the stacks are byte for byte those of the
    module-by-module path (which names problems and handles any other case)."""
    if which == "qwen-patterns":  # per-module ranks and alphas: rescaled B's, partial stacks
        path = f1_adapters[which][0]
    else:
        cfg, sd = good_f1()
        if which == "bf16-file":
            sd = {k: v.bfloat16() for k, v in sd.items()}
        path = write_adapter(tmp_path / which, cfg, sd)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        pool = MoELoRAMemoryPool(E, H, I, MOE_LAYERS, max_loras=1, max_rank=4, dtype=dtype, device="cpu")
        layers, _ = read(path, dtype=torch.float32, pool_dtype=dtype)
        raw = [
            (lid, e, p, getattr(layers[lid], p)[e])
            for lid in sorted(layers)
            for e in range(E)
            for p in ("gate", "up", "down")
            if e in getattr(layers[lid], p)
        ]
        dims = {"gate": (H, I), "up": (H, I), "down": (I, H)}
        fast = pool._stage_stacked("a", raw, dims)
        assert fast is not None
        with monkeypatch.context() as m:
            m.setattr(MoELoRAMemoryPool, "_stage_stacked", lambda *args: None)
            slow = pool._stage("a", layers)
        assert (fast.rank, fast.scaling, fast.nbytes) == (slow.rank, slow.scaling, slow.nbytes)
        assert fast.layers.keys() == slow.layers.keys()
        for lid, st in slow.layers.items():
            assert st.keys() == fast.layers[lid].keys()
            for k, t in st.items():
                assert t.dtype == fast.layers[lid][k].dtype and torch.equal(
                    t.view(torch.int16 if t.element_size() == 2 else torch.int32),
                    fast.layers[lid][k].view(torch.int16 if t.element_size() == 2 else torch.int32),
                ), (which, dtype, lid, k)
