"""Tests of :mod:`moelora.peft_loader` (CPU, fp32; tiny models built with PEFT inside the tests).

PEFT is the oracle: adapters are made with ``get_peft_model`` + ``save_pretrained`` (LoRA weights set to
seeded random values, since PEFT initialises B to zero), read back with :func:`read_peft_adapter`, and the
output of PEFT's own wrapped modules is compared with :func:`moelora.reference.reference_moe` on the base
weights and the loaded :class:`ReferenceLoRA` (and, for ``pool.load_adapter``, with the pool's torch path).

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
    read_peft_adapter,
)
from moelora.pool import AdapterLoadError, MoELoRAMemoryPool
from moelora.reference import LoRAProjection, ReferenceLoRA, reference_moe
from moelora.torch_path import moe_lora_forward_torch

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

# H=16, I=12, E=4: H != I and H != 2I, so every F2 tensor's orientation is decided by its shape and an
# H/I mix-up fails. Layer 0 is dense (mlp_only_layers=[0]); layers 1 and 2 are MoE.
H, I, E, TOP_K = 16, 12, 4, 2  # noqa: E741  (I = intermediate size, as in docs/design.md)
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


def arena_rows(layers):
    """Arena rows an adapter read as ``layers`` takes: per layer, its experts with a module times its
    largest module rank there (counted from the modules, independently of the pool)."""
    rows = 0
    for lora in layers.values():
        mods = [(e, proj) for p in ("gate", "up", "down") for e, proj in getattr(lora, p).items()]
        rows += len({e for e, _ in mods}) * max(proj.a.shape[0] for _, proj in mods)
    return rows


def test_f2_dtype_and_pool_bytes(f2_adapters, tmp_path):
    path, _ = f2_adapters["both"]
    layers32, rep32 = read(path, max_rank=8)
    layers16, rep16 = read(path, max_rank=8, dtype=torch.bfloat16)
    p = layers16[1].gate[0]
    assert p.a.dtype == p.b.dtype == torch.bfloat16 and p.a.device.type == "cpu"
    assert torch.equal(p.a, layers32[1].gate[0].a.to(torch.bfloat16))
    for dtype, rep in ((torch.float32, rep32), (torch.bfloat16, rep16)):
        pool = MoELoRAMemoryPool(E, H, I, MOE_LAYERS, max_loras=3, max_rank=8, dtype=dtype, device="cpu")
        # Each layer's own rank (at most 3, not the pool's 8) for each (layer, expert) it trains.
        assert rep.pool_bytes == arena_rows(layers32) * pool.unit_bytes
        assert rep.pool_bytes < sum(len(es) for es in rep.experts_per_layer.values()) * 8 * pool.unit_bytes
        assert pool.load_adapter("x", path).pool_bytes == rep.pool_bytes
        assert pool.memory_report().adapters[0].bytes == rep.pool_bytes
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
# pool.load_adapter
# --------------------------------------------------------------------------------------------------


def pool_state(pool: MoELoRAMemoryPool):
    # Every layer's dense gather, the raw arena behind it and the block table, byte for byte.
    bufs = [t.clone() for lid in pool.layer_ids for t in pool.layer(lid).dense().tensors()]
    bufs += [w.data.clone() for w in pool.layer(pool.layer_ids[0]).tensors()]
    tables = (pool.blocks.clone(), pool.slot_ranks.clone(), pool.slot_scalings.clone())
    host = (
        list(pool.slot_rank_host),
        list(pool.slot_scaling_host),
        dict(pool.adapter_slots),
        list(pool.slot_adapters),
    )
    return bufs, tables, host


def assert_same_state(a, b):
    assert len(a[0]) == len(b[0]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True))
    assert len(a[1]) == len(b[1]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))
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
def test_pool_load_adapter_matches_peft_and_failures_leave_pool_unchanged(
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
    report = pool.load_adapter("a", path)
    assert isinstance(report, AdapterLoadReport) and "a" in pool
    assert report.pool_bytes == arena_rows(read(path)[0]) * pool.unit_bytes
    assert pool.memory_report().adapters[0].bytes == report.pool_bytes
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
            pool.load_adapter("b", p)
        assert "b" not in pool, name
        assert_same_state(pool_state(pool), snapshot)
    with pytest.raises(AdapterLoadError, match="already loaded"):  # the pool's own refusal
        pool.load_adapter("a", tmp_path / "good-copy")
    assert_same_state(pool_state(pool), snapshot)
    after = pool_outputs(pool, data)
    for lid in before:
        assert torch.equal(after[lid], before[lid])

    # and a good second adapter still loads afterwards, into the next slot, without disturbing "a"
    pool.load_adapter("b", tmp_path / "good-copy")
    assert pool.slot_of("b") == 1
    for lid, y in pool_outputs(pool, data).items():
        assert torch.equal(y, before[lid])


def test_pool_load_adapter_bf16_rounds_once(f1_adapters):
    """Float32 goes to the pool, which rescales per-module B's and rounds to bf16 exactly once."""
    path, _ = f1_adapters["qwen-patterns"]
    pool = MoELoRAMemoryPool(E, H, I, MOE_LAYERS, max_loras=2, max_rank=4, dtype=torch.bfloat16, device="cpu")
    report = pool.load_adapter("a", path)
    assert report.dtype == "bfloat16"
    layers, _ = read(path)
    slot, s = pool.slot_of("a"), pool.slot_scaling_host[0]
    p = layers[1].down[2]  # alpha 1 via alpha_pattern: differs from the slot scaling
    assert p.scaling != s
    want = (p.b.float() * (p.scaling / s)).to(torch.bfloat16)
    assert torch.equal(pool.layer(1).dense().down_b[slot, 2, :, : p.rank], want)
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


def test_empty_tensors_sharing_an_offset_tile_the_data(tmp_path):
    """Ordered by offset alone, an empty tensor may seem to overlap the one it shares a begin with; the
    exact (begin, end, key) order, which safetensors uses too, accepts the file."""
    from moelora.peft_loader import _read_safetensors_once

    hdr = {
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},
        "c": {"dtype": "F32", "shape": [0, 3], "data_offsets": [8, 8]},
    }
    h = json.dumps(hdr).encode()
    h += b" " * (-len(h) % 8)  # data aligned, as safetensors writes it
    f = tmp_path / "x.safetensors"
    f.write_bytes(len(h).to_bytes(8, "little") + h + bytes(8))
    got = _read_safetensors_once(f).tensors
    assert got["b"].tolist() == [0.0, 0.0] and got["a"].shape == (0,) and got["c"].shape == (0, 3)


def test_batched_views_are_the_per_tensor_views(tmp_path):
    """Tensors of a group read as one strided view are exactly the views read one at a time (storage,
    offset, strides, values), also across a missing expert, a second dtype and an ignored tensor between
    them; every tensor lies in exactly one batch and one region."""
    from moelora.peft_loader import _read_safetensors_header, _read_safetensors_once

    cfg, sd = good_f1()
    del sd[KA.replace("experts.0", "experts.2")], sd[KB.replace("experts.0", "experts.2")]
    sd = {k: (v.bfloat16() if "layers.2" in k and "down_proj" in k else v) for k, v in sd.items()}
    sd["base_model.model.model.layers.1.mlp.experts.1.gate_proj.lora_C.weight"] = torch.randn(3)
    path = write_adapter(tmp_path / "a", cfg, sd)
    header = _read_safetensors_header(path / WEIGHTS)
    keys = [k for k in sd if "lora_C" not in k]
    groups = [[k for k in keys if f"layers.{lid}." in k and f"{p}.lora_{ab}" in k]
              for lid in MOE_LAYERS for p in ("gate_proj", "up_proj", "down_proj") for ab in "AB"]
    one_by_one = _read_safetensors_once(path / WEIGHTS, header, keys).tensors
    read = _read_safetensors_once(path / WEIGHTS, header, keys, groups)
    assert any(len(batch_keys) > 1 for batch_keys, _ in read.batches)
    assert read.tensors.keys() == one_by_one.keys()
    assert len({t.untyped_storage().data_ptr() for t in read.tensors.values()}) == 1  # views of the buffer
    for k, t in read.tensors.items():
        u = one_by_one[k]
        layout = (t.dtype, t.shape, t.stride(), t.storage_offset())
        assert layout == (u.dtype, u.shape, u.stride(), u.storage_offset())
        assert torch.equal(t, sd[k])
    for parts in (read.batches, read.regions):
        assert sorted(k for part_keys, _ in parts for k in part_keys) == sorted(keys)
    for batch_keys, view in read.batches:
        for j, k in enumerate(batch_keys):
            assert view[j].data_ptr() == read.tensors[k].data_ptr() and torch.equal(view[j], sd[k])
    for region_keys, flat in read.regions:
        assert torch.equal(flat, torch.cat([sd[k].reshape(-1) for k in region_keys]))


def test_zero_first_elements_do_not_drop_live_components(tmp_path):
    """Zero-component checks read the first element of each A row and B column and sum only where it is
    zero: a zero there is no zero component, a zero row or column is one."""
    cfg, sd = good_f1(r=3)
    ka2, kb2 = KA.replace("experts.0", "experts.2"), KB.replace("experts.0", "experts.2")
    sd[KA][:, 0] = 0  # every row starts with a zero, none is zero
    sd[KB][0, :] = 0
    sd[ka2][:, 0] = 0
    sd[kb2][:, 1] = 0  # a zero column: component 1 adds nothing
    layers, report = read(write_adapter(tmp_path / "a", cfg, sd))
    assert layers[1].gate[0].rank == 3 and torch.equal(layers[1].gate[0].a, sd[KA])
    assert layers[1].gate[2].rank == 2 and torch.equal(layers[1].gate[2].a, sd[ka2][[0, 2]])
    assert any("1 exactly-zero rank components dropped (0 modules all zero)" in n for n in report.notes)


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
        assert fast.experts == slow.experts
        assert fast.layers.keys() == slow.layers.keys()
        for lid, st in slow.layers.items():
            assert st.keys() == fast.layers[lid].keys()
            for k, t in st.items():
                assert t.dtype == fast.layers[lid][k].dtype and torch.equal(
                    t.view(torch.int16 if t.element_size() == 2 else torch.int32),
                    fast.layers[lid][k].view(torch.int16 if t.element_size() == 2 else torch.int32),
                ), (which, dtype, lid, k)


# --------------------------------------------------------------------------------------------------
# Hardening: malformed adapters through pool.load_adapter (an AdapterLoadError, never a raw Python
# error, and the pool unchanged)
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def loaded_pool(tmp_path):
    """A small CPU pool already holding one good adapter, so "unchanged" covers written slots too."""
    pool = MoELoRAMemoryPool(E, H, I, MOE_LAYERS, max_loras=3, max_rank=8, dtype=torch.float32, device="cpu")
    pool.load_adapter("good", write_adapter(tmp_path / "good", *good_f1()))
    return pool


def assert_refused(pool, path, *patterns, error=AdapterLoadError) -> str:
    """``pool.load_adapter("bad", path)`` raises ``error`` whose message matches every pattern, and the
    pool (adapter names, slot buffers, rank/scaling tables) is exactly as before. Returns the message."""
    names, before = pool.adapters(), pool_state(pool)
    with pytest.raises(error) as info:
        pool.load_adapter("bad", path)
    msg = str(info.value)
    for pattern in patterns:
        assert re.search(pattern, msg), (pattern, msg)
    assert pool.adapters() == names and "bad" not in pool
    assert_same_state(pool_state(pool), before)
    return msg


def read_raw(file: Path) -> tuple[dict, bytes]:
    """(JSON header, data bytes) of a safetensors file."""
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_raw(file: Path, header: dict | bytes, data: bytes, *, hlen: int | None = None) -> None:
    """A safetensors file exactly as given: nothing checked, and ``hlen`` may lie about the header length."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    file.write_bytes((len(text) if hlen is None else hlen).to_bytes(8, "little") + text + data)


def retype_tensor(file: Path, key: str, dtype: str, nbytes: int) -> None:
    """Rewrites ``file`` with tensor ``key`` stored as ``dtype`` in ``nbytes`` zero bytes (same shape),
    every other tensor's bytes kept and all data_offsets recomputed: a valid file safetensors accepts."""
    header, data = read_raw(file)
    entries = sorted(
        ((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"]
    )
    out, blob = {}, b""
    for k, v in entries:
        begin, end = v["data_offsets"]
        chunk = bytes(nbytes) if k == key else data[begin:end]
        out[k] = {
            **v,
            "dtype": dtype if k == key else v["dtype"],
            "data_offsets": [len(blob), len(blob) + len(chunk)],
        }
        blob += chunk
    write_raw(file, out, blob)


@pytest.mark.parametrize(
    "dtype, nbytes",
    # KA is (2, H=16): 32 elements. F4 / F6 are packed sub-byte formats, F8_E8M0 a scale-only format
    # (torch has a dtype for it, safetensors reads it), C64 complex, XYZ no safetensors dtype at all.
    [("F4", 16), ("F6_E2M3", 24), ("F8_E8M0", 32), ("C64", 256), ("XYZ", 32)],
)
def test_unconvertible_lora_dtype_is_refused(loaded_pool, tmp_path, dtype, nbytes):
    """A LoRA factor in a dtype the loader cannot turn into float32 used to escape as NotImplementedError
    (F4: torch has no copy kernel for it) or load as garbage (F8_E8M0); it is refused naming the key, the
    dtype and the accepted dtypes."""
    path = write_adapter(tmp_path / dtype, *good_f1())
    retype_tensor(path / WEIGHTS, KA, dtype, nbytes)
    msg = assert_refused(
        loaded_pool, path, re.escape(f"key {KA!r}"), rf"\b{dtype}\b", r"F64, F32, F16, BF16, F8_E4M3, F8_E5M2"
    )
    assert msg.startswith(f"{path / WEIGHTS}: "), msg


def test_unconvertible_dtype_of_an_ignored_tensor_is_not_refused(loaded_pool, tmp_path):
    """Only LoRA factors need a convertible dtype: the dtype check must not refuse an adapter over an
    attention LoRA stored as F4, which is only listed as ignored (and never converted)."""
    cfg, sd = good_f1()
    attn = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
    path = write_adapter(tmp_path / "a", cfg, {**sd, attn: torch.zeros(2, H)})
    retype_tensor(path / WEIGHTS, attn, "F4", 16)
    report = loaded_pool.load_adapter("f4-attn", path)
    assert "attention" in report.ignored_keys[attn]
    assert loaded_pool.adapters() == ["good", "f4-attn"]


BAD_ALPHAS = [
    # (id, config fields to set ("@...@": a raw JSON literal), config field named, message pattern)
    ("alpha-1e40", {"lora_alpha": 1e40}, "lora_alpha", r"lora_alpha = 1e\+40 gives a LoRA scaling of 5e\+39"),
    ("alpha-minus-1e40", {"lora_alpha": -1e40}, "lora_alpha", r"lora_alpha = -1e\+40 .*does not fit float32"),
    (
        "alpha-pattern-1e40",
        {"alpha_pattern": {"gate_proj": 1e40}},
        "alpha_pattern",
        r"alpha_pattern\['gate_proj'\] = 1e\+40 .*does not fit float32",
    ),
    # rsLoRA divides by sqrt(r) only: 1e39 / sqrt(2) is still beyond float32
    ("rslora", {"lora_alpha": 1e39, "use_rslora": True}, "lora_alpha", r"alpha / sqrt\(r\) with r = 2"),
    # the smallest rank the config can give decides (here one from rank_pattern)
    (
        "rank-pattern",
        {"lora_alpha": 5e38, "rank_pattern": {"down_proj": 1}},
        "lora_alpha",
        r"rank_pattern\['down_proj'\] = 1, the smallest rank",
    ),
    # Python's json reads (and PEFT's json.dump writes) these non-standard literals
    ("alpha-nan", {"lora_alpha": "@NaN@"}, "lora_alpha", r"lora_alpha must be a finite number, got nan"),
    (
        "alpha-infinity",
        {"lora_alpha": "@Infinity@"},
        "lora_alpha",
        r"lora_alpha must be a finite number, got inf",
    ),
    (
        "alpha-pattern-minus-infinity",
        {"alpha_pattern": {"gate_proj": "@-Infinity@"}},
        "alpha_pattern",
        r"alpha_pattern\['gate_proj'\] must be a finite number, got -inf",
    ),
    # a JSON integer beyond the float range (math.isfinite used to raise OverflowError on it)
    (
        "alpha-huge-int",
        {"lora_alpha": "@1" + "0" * 400 + "@"},
        "lora_alpha",
        r"lora_alpha must be a finite number, got 10{400}$",
    ),
]


@pytest.mark.parametrize("case", BAD_ALPHAS, ids=[c[0] for c in BAD_ALPHAS])
def test_alpha_whose_scaling_does_not_fit_float32_is_refused_at_config_parse(
    loaded_pool, tmp_path, monkeypatch, case
):
    """The pool stores each scaling in float32: an alpha giving an infinite (or unstorable) scaling used to
    fail late, when the scaling was written. It is refused while the config is parsed, naming the field
    (lora_alpha / alpha_pattern[...]), before the weights file is even opened."""
    import moelora.peft_loader as loader

    _, fields, field_name, reason = case
    cfg, sd = good_f1()
    path = write_adapter(tmp_path / "a", cfg, sd)
    (path / CONFIG).write_text(re.sub(r'"@(.*?)@"', r"\1", json.dumps({**cfg, **fields})))

    def no_weights(*_args, **_kw):
        raise AssertionError("the weights file was opened although the config is invalid")

    monkeypatch.setattr(loader, "_read_safetensors_header", no_weights)
    msg = assert_refused(loaded_pool, path, re.escape(f"key {field_name!r}"), reason)
    assert msg.startswith(f"{path / CONFIG}: "), msg


def test_large_alpha_whose_scaling_fits_float32_still_loads(loaded_pool, tmp_path):
    """The limit is on the scaling, not on alpha: alpha 1e39 at rank 8 gives 1.25e38, which float32 holds."""
    cfg, sd = good_f1(r=8)
    report = loaded_pool.load_adapter(
        "big-alpha", write_adapter(tmp_path / "a", {**cfg, "lora_alpha": 1e39}, sd)
    )
    assert all(s == pytest.approx(1.25e38) for s in report.scalings.values())
    assert loaded_pool.slot_scaling_host[loaded_pool.slot_of("big-alpha")] == pytest.approx(1.25e38)


def _nested_value(depth: int) -> list:
    v: list = []
    for _ in range(depth - 1):
        v = [v]
    return v


@pytest.mark.parametrize(
    "text, reason",
    [
        # beyond Python's recursion limit: json used to raise RecursionError
        ("[" * 100_000 + "]" * 100_000, r"nested too deeply to parse"),
        ('{"a":' * 100_000 + "1" + "}" * 100_000, r"nested too deeply to parse"),
        # parseable, but deeper than any LoraConfig (later reprs of such a value could recurse too deep)
        (json.dumps({**good_f1()[0], "r": _nested_value(200)}), r"nested too deeply \(more than 64 levels"),
    ],
    ids=["array-100000", "object-100000", "field-200"],
)
def test_config_nested_too_deeply_is_refused(loaded_pool, tmp_path, text, reason):
    """A hostile adapter_config.json must give an AdapterLoadError naming the file, not a RecursionError."""
    path = write_adapter(tmp_path / "a", *good_f1())
    (path / CONFIG).write_text(text)
    msg = assert_refused(loaded_pool, path, reason)
    assert msg.startswith(f"{path / CONFIG}: "), msg


@pytest.mark.parametrize(
    "text, got",
    [('"x"', "string"), ("null", "null"), ("42", r"number \(42\)"), ("[]", "array"), ("true", "boolean")],
)
def test_config_that_is_valid_json_but_not_an_object_is_refused(loaded_pool, tmp_path, text, got):
    """Valid JSON of the wrong type: the message says an object of LoraConfig fields was expected and what
    the file holds instead."""
    path = write_adapter(tmp_path / "a", *good_f1())
    (path / CONFIG).write_text(text)
    msg = assert_refused(loaded_pool, path, rf"must be a JSON object .*got a JSON {got}")
    assert msg.startswith(f"{path / CONFIG}: "), msg


@pytest.mark.parametrize("empty", ["", " ", "\t\n"], ids=["empty", "space", "whitespace"])
def test_empty_adapter_path_is_refused(loaded_pool, tmp_path, monkeypatch, empty):
    """Path("") is the current directory: with a valid adapter there, load_adapter(name, "") used to load
    it. An empty or whitespace-only path is refused instead."""
    monkeypatch.chdir(write_adapter(tmp_path / "cwd-adapter", *good_f1()))
    assert_refused(loaded_pool, empty, r"adapter path is empty .*current directory")
    with pytest.raises(AdapterLoadError, match=r"adapter path is empty"):
        read(empty)


def test_empty_path_is_refused_before_the_host_tier_lookup(tmp_path, monkeypatch):
    """The pool looks a re-load up in its host tier by resolved path: "" resolved to the current
    directory and served the copy read from there. The path is checked before that lookup."""
    pool = MoELoRAMemoryPool(E, H, I, MOE_LAYERS, max_loras=2, max_rank=8, dtype=torch.float32, device="cpu",
                             max_cpu_loras=2)
    pool.load_adapter("x", write_adapter(tmp_path / "x", *good_f1()))
    pool.unload_adapter("x")  # its host copy stays, keyed by the resolved path
    monkeypatch.chdir(tmp_path / "x")
    with pytest.raises(AdapterLoadError, match="adapter path is empty"):
        pool.load_adapter("x", "")
    assert pool.adapters() == [] and pool.host_adapters() == ["x"]


@pytest.mark.parametrize("bad", [None, 42, b"/tmp/adapter", ["a"]], ids=["None", "int", "bytes", "list"])
def test_non_path_adapter_path_is_a_type_error(loaded_pool, bad):
    """A path of the wrong type is a programming error: a TypeError saying what a path must be, and the
    pool unchanged."""
    assert_refused(loaded_pool, bad, r"adapter path must be a str or os\.PathLike", error=TypeError)
    with pytest.raises(TypeError, match=r"adapter path must be a str or os\.PathLike"):
        read(bad)


def f2_factors(param: str, r: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(lora_A, lora_B) of one fused parameter in the current PEFT layout: A (E*r, in), B (out, E*r)."""
    gen = torch.Generator().manual_seed(seed)
    in_f, out_f = (H, 2 * I) if param == "gate_up_proj" else (I, H)
    return torch.randn(E * r, in_f, generator=gen), torch.randn(out_f, E * r, generator=gen)


F2_OUTER = "base_model.model.model.layers.{lid}.mlp.experts"


def f2_file(wrappers: dict[int, str]) -> dict[str, torch.Tensor]:
    """F2 tensors on both MoE layers: nesting depth (0 = outer ``experts.lora_*``) -> parameter shaped for."""
    sd = {}
    for lid in MOE_LAYERS:
        for depth, param in wrappers.items():
            pre = F2_OUTER.format(lid=lid) + ".base_layer" * depth
            sd[f"{pre}.lora_A.weight"], sd[f"{pre}.lora_B.weight"] = f2_factors(param, seed=lid + depth)
    return sd


TARGET_MISMATCHES = [
    # (id, target_parameters, depth -> tensors' real parameter, message pattern)
    # both listed, but the file holds only a gate_up LoRA: PEFT would nest down_proj outermost, so the lone
    # outer wrapper is read as down_proj (this used to say "hidden/intermediate size mismatch")
    (
        "both-listed-gate-up-only-in-file",
        ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        {0: "gate_up_proj"},
        r"outer wrapper.*shaped for gate_up_proj.*holds a LoRA for gate_up_proj only .* none for down_proj",
    ),
    (
        "down-listed-gate-up-in-file",
        ["mlp.experts.down_proj"],
        {0: "gate_up_proj"},
        r"targets only down_proj",
    ),
    (
        "gate-up-listed-down-in-file",
        ["gate_up_proj"],
        {0: "down_proj"},
        r"targets only gate_up_proj.*shaped for down_proj",
    ),
    (
        "nesting-inverted",
        ["gate_up_proj", "down_proj"],
        {0: "gate_up_proj", 1: "down_proj"},
        r"should be the down_proj LoRA.*shaped for gate_up_proj",
    ),
]


@pytest.mark.parametrize("case", TARGET_MISMATCHES, ids=[c[0] for c in TARGET_MISMATCHES])
def test_target_parameters_disagreeing_with_the_tensors_names_target_parameters(loaded_pool, tmp_path, case):
    """When the tensors fit the *other* fused parameter, the model sizes are fine and the config's
    target_parameters is what is wrong: the message says so (what it lists, which parameter that makes this
    wrapper, and which one the shapes fit) instead of blaming a hidden/intermediate size mismatch."""
    _, targets, wrappers, reason = case
    cfg = {
        "peft_type": "LORA",
        "peft_version": "0.21.2",
        "r": 2,
        "lora_alpha": 4,
        "target_parameters": targets,
    }
    path = write_adapter(tmp_path / "a", cfg, f2_file(wrappers))
    msg = assert_refused(
        loaded_pool,
        path,
        r"target_parameters in adapter_config\.json \(" + re.escape(str(targets)) + r"\) disagrees",
        reason,
    )
    assert "hidden/intermediate" not in msg, msg
    assert msg.startswith(f"{path / WEIGHTS}: key '{F2_OUTER.format(lid=1)}"), msg


def test_target_parameters_agreeing_with_the_tensors_loads(loaded_pool, tmp_path):
    """Control for the mismatch cases: the same files with a matching target_parameters load."""
    cfg = {"peft_type": "LORA", "peft_version": "0.21.2", "r": 2, "lora_alpha": 4}
    for i, (targets, wrappers) in enumerate(
        [
            (["down_proj"], {0: "down_proj"}),
            (["gate_up_proj"], {0: "gate_up_proj"}),
            (["down_proj", "gate_up_proj"], {0: "down_proj", 1: "gate_up_proj"}),
        ]
    ):
        path = write_adapter(tmp_path / str(i), {**cfg, "target_parameters": targets}, f2_file(wrappers))
        loaded_pool.load_adapter(f"ok{i}", path)
        loaded_pool.unload_adapter(f"ok{i}")


@pytest.fixture
def data_reads(monkeypatch):
    """Counts calls of the loader's tensor-data reader (everything before it works on the header only)."""
    import moelora.peft_loader as loader

    calls: list[Path] = []
    real = loader._read_safetensors

    def counting(file, *args, **kw):
        calls.append(file)
        return real(file, *args, **kw)

    monkeypatch.setattr(loader, "_read_safetensors", counting)
    return calls


HEADER_PHASE_REFUSALS = [
    # (id, mutation of good_f1, key, message pattern): all decided from the safetensors header
    ("shape", sd_set(KA, torch.randn(2, H + 1)), KA, r"expected \(r, H=16\).*hidden"),
    ("rank-vs-config", cfg_set(r=4), KA, r"config gives module .* rank 4"),
    ("int-dtype", sd_set(KA, torch.ones(2, H, dtype=torch.int32)), KA, r"floating-point.*int32"),
    ("3-d", sd_set(KA, torch.ones(1, 2, H)), KA, r"must be 2-D"),
    ("rank-mismatch-ab", sd_set(KB, torch.randn(I, 3)), KB, r"rank mismatch"),
]


@pytest.mark.parametrize("case", HEADER_PHASE_REFUSALS, ids=[c[0] for c in HEADER_PHASE_REFUSALS])
def test_misshaped_tensor_is_refused_before_any_tensor_data_is_read(loaded_pool, tmp_path, data_reads, case):
    """A large file with one mis-shaped tensor used to be read whole before its shapes were checked; the
    shapes and dtypes now come from the JSON header and the data reader is never called."""
    _, mutate, key, reason = case
    cfg, sd = mutate(*good_f1())
    big = "base_model.model.lm_head.lora_A.weight"  # ignored, 4 MiB: what a real file's bulk would be
    path = write_adapter(tmp_path / "a", cfg, {**sd, big: torch.zeros(1024, 1024)})
    assert_refused(loaded_pool, path, re.escape(f"key {key!r}"), reason)
    assert data_reads == []
    # control: the same file with the mutation undone is read (once) and loads
    loaded_pool.load_adapter(
        "ok", write_adapter(tmp_path / "ok", good_f1()[0], {**good_f1()[1], big: torch.zeros(4, 4)})
    )
    assert len(data_reads) == 1


def _lying_headers(file: Path) -> dict[str, tuple[bytes, tuple[str, ...]]]:
    """name -> (file bytes, message patterns) for broken variants of the good safetensors ``file``."""
    raw = file.read_bytes()
    header, data = read_raw(file)
    text = raw[8 : 8 + int.from_bytes(raw[:8], "little")]
    first = next(k for k in header if k != "__metadata__")
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])

    def with_entry(key, **kv):
        h = {**header, key: {**header[key], **kv}}
        t = json.dumps(h).encode()
        return len(t).to_bytes(8, "little") + t + data

    def with_text(t: bytes, hlen: int | None = None):
        return (len(t) if hlen is None else hlen).to_bytes(8, "little") + t + data

    b0, e0 = header[first]["data_offsets"]
    return {
        "truncated-data": (
            raw[:-100],
            (
                r"truncated, corrupt or unreadable",
                rf"data_offsets .* do not hold .* the {len(data) - 100} data bytes",
            ),
        ),
        "truncated-header": (raw[: 8 + len(text) // 2], (r"header length \d+ does not fit the file",)),
        "shorter-than-8-bytes": (raw[:5], (r"5 bytes: shorter than the 8-byte header length",)),
        "header-length-huge": (with_text(text, hlen=2**63), (r"header length \d+ exceeds",)),
        "header-length-past-end": (with_text(text, hlen=len(raw)), (r"does not fit the file",)),
        "offsets-past-end": (
            with_entry(last, data_offsets=[len(data) + 8, len(data) + 8 + e0 - b0]),
            (re.escape(f"key {last!r}"), rf"within the {len(data)} data bytes"),
        ),
        "shape-vs-offsets": (
            with_entry(first, shape=[2, 17]),
            (re.escape(f"key {first!r}"), r"do not hold the 136 bytes of a F32 tensor of shape \[2, 17\]"),
        ),
        # two tensors claiming the same bytes: every span is in bounds and the right size, but they overlap
        "overlap": (
            with_entry(last, data_offsets=header[first]["data_offsets"]),
            (r"data_offsets overlap or leave a gap",),
        ),
        "not-json": (with_text(b"not json at all"), (r"not valid UTF-8 JSON",)),
        "not-utf8": (with_text(b'{"\xff\xfe": 1}'), (r"not valid UTF-8 JSON",)),
        "nested": (with_text(b"[" * 100_000 + b"]" * 100_000), (r"nested too deeply",)),
        # parseable, but a plain repr() of the shape in the message could recurse too deep
        "deeply-nested-shape": (
            with_text(
                b'{"k": {"dtype": "F32", "shape": ' + b"[" * 500 + b"]" * 500 + b', "data_offsets": [0, 0]}}'
            ),
            (r"key 'k'", r"invalid shape \[+\.\.\.\]+: expected a list"),
        ),
        "not-object": (with_text(b"[1, 2]"), (r"not a JSON object \(got a JSON array\)",)),
        "entry-not-object": (
            with_text(b'{"k": 5}'),
            (r"key 'k'", r"not an object"),
        ),
        "negative-dim": (with_entry(first, shape=[-2, 16]), (r"invalid shape \[-2, 16\]",)),
        "float-offsets": (with_entry(first, data_offsets=[float(b0), float(e0)]), (r"invalid data_offsets",)),
        "huge-int": (
            with_text(b'{"k": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 0]}}'),
            (r"not valid UTF-8 JSON",),
        ),
        "metadata": (
            with_text(b'{"__metadata__": {"format": 1}}'),
            (r"__metadata__ must be an object of strings",),
        ),
    }


@pytest.mark.parametrize(
    "name",
    [
        "truncated-data",
        "truncated-header",
        "shorter-than-8-bytes",
        "header-length-huge",
        "header-length-past-end",
        "offsets-past-end",
        "shape-vs-offsets",
        "overlap",
        "not-json",
        "not-utf8",
        "nested",
        "deeply-nested-shape",
        "not-object",
        "entry-not-object",
        "negative-dim",
        "float-offsets",
        "huge-int",
        "metadata",
    ],
)
def test_lying_or_truncated_safetensors_header_is_refused(loaded_pool, tmp_path, data_reads, name):
    """The header is checked on its own (length sane and within the file, valid JSON object, each entry's
    dtype/shape/data_offsets consistent and inside the file, tiling the data) before any data is read: a
    truncated or lying file gives an AdapterLoadError naming the file, never a crash or an out-of-bounds
    read."""
    path = write_adapter(tmp_path / "a", *good_f1())
    content, patterns = _lying_headers(path / WEIGHTS)[name]
    (path / WEIGHTS).write_bytes(content)
    msg = assert_refused(loaded_pool, path, *patterns)
    assert msg.startswith(f"{path / WEIGHTS}: "), msg
    assert data_reads == []


def test_file_changed_between_header_and_data_is_refused(loaded_pool, tmp_path, monkeypatch):
    """The data must belong to the header that was checked: a file replaced after its header was read
    (another size, or the same size with another header) is refused, not read with stale offsets."""
    import moelora.peft_loader as loader

    cfg, sd = good_f1()
    path = write_adapter(tmp_path / "a", cfg, sd)
    size = (path / WEIGHTS).stat().st_size
    real = loader._read_safetensors_header
    other_size = good_f1(r=3)[1]
    # KA (2, 16) stored as (4, 8): the same bytes and (padded) header length, another header
    same_size = {**sd, KA: sd[KA].reshape(4, 8)}
    save_file(same_size, str(tmp_path / "probe.safetensors"))
    assert (tmp_path / "probe.safetensors").stat().st_size == size
    for replacement, why in (
        (other_size, r"bytes, \d+ when its header was read"),
        (same_size, r"header is not"),
    ):

        def swap_after_header(file, replacement=replacement):
            header = real(file)
            save_file(replacement, str(file))
            return header

        monkeypatch.setattr(loader, "_read_safetensors_header", swap_after_header)
        assert_refused(loaded_pool, path, r"the file changed while it was read", why)
        write_adapter(path, cfg, sd)


@pytest.mark.parametrize("parts", [1, 3])
def test_file_read_in_parallel_parts_is_the_same(tmp_path, monkeypatch, parts):
    """A file past the parallel-read size is read by threads, a part each: the bytes are the file's, and
    a file that shrank mid-read still reports how much it gave."""
    import moelora.peft_loader as loader

    data = bytes(range(256)) * 1001 + b"tail"  # not a multiple of the part count
    file = tmp_path / "blob"
    file.write_bytes(data)
    monkeypatch.setattr(loader, "_PARALLEL_READ_BYTES", 0 if parts > 1 else len(data))
    monkeypatch.setattr(loader, "_READ_THREADS", parts)
    monkeypatch.setattr(loader.os, "cpu_count", lambda: 8)
    view = memoryview(bytearray(len(data) + 10))
    with open(file, "rb", buffering=0) as fh:
        assert loader._read_into(fh.fileno(), view, len(data)) == len(data)
        assert bytes(view[: len(data)]) == data
        assert loader._read_into(fh.fileno(), view, len(data) + 10) == len(data)  # 10 bytes past the end
