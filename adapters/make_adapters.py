#!/usr/bin/env python
"""Build the small, real PEFT adapter fixtures in ``adapters/`` (CPU, deterministic).

    python adapters/make_adapters.py            # (re)writes everything under adapters/

What it writes (see adapters/README.md, which this script also regenerates):

* ``tiny-qwen3-moe/``  a tiny transformers-5 Qwen3-MoE base (layer 0 dense MLP, layers 1-2 MoE,
  fused experts ``mlp.experts.gate_up_proj`` (E, 2I, H) and ``mlp.experts.down_proj`` (E, H, I)).
* ``sql/ chat/ math/ gate-up-only/ down-only/ v4-style/``  PEFT adapters for it that use
  ``target_parameters`` on the fused expert tensors ("F2"); weights are seeded random, non-zero.
* ``f1-qwen/`` and ``f1-mixtral/``  per-expert-module ("F1", transformers-4 layout) adapters made by
  PEFT on a hand-written module tree (``build_f1_tree``), with that tree's base weights in
  ``base.safetensors`` so tests can run PEFT's forward as the oracle.

Importable helpers for tests (``import adapters.make_adapters as mk`` or load the file by path):

* ``build_f1_tree(naming, layer_ids, E, H, I, ...)``  the F1 module tree (random init).
* ``load_f1_base(name)``  rebuild the tree of ``adapters/<name>/`` and load ``base.safetensors``.
* ``load_f1_peft(name)``  the same tree wrapped by PEFT with ``adapters/<name>/adapter`` loaded.
* ``tiny_qwen3_moe_config()`` / ``load_tiny_qwen3_moe()`` / ``load_tiny_qwen3_moe_peft(adapter)`` /
  ``tiny_qwen3_moe_experts()`` (fused w13 / w2 / router per MoE layer).
* ``f2_expert_deltas(adapter_dir)``  the verified F2 formula: per-layer per-expert dense deltas.
* ``moe_reference(x, w13, w2, topk_w, topk_ids)``  plain fp32 loop reference of docs/design.md §1.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

ADAPTERS_DIR = Path(__file__).resolve().parent
BASE_NAME = "tiny-qwen3-moe"

# ----------------------------------------------------------------------------------------------
# tiny Qwen3-MoE base (transformers 5)
# ----------------------------------------------------------------------------------------------

TINY_QWEN3_MOE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=64,  # dense MLP of layer 0
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=[0],  # layer 0 is a dense Qwen3MoeMLP, layers 1, 2 are Qwen3MoeSparseMoeBlock
    decoder_sparse_step=1,
    tie_word_embeddings=False,
    initializer_range=0.05,
    rms_norm_eps=1e-6,
    output_router_logits=False,
)
MOE_LAYER_IDS = [1, 2]


def tiny_qwen3_moe_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**TINY_QWEN3_MOE)


def build_tiny_qwen3_moe(seed: int = 0):
    """A freshly initialised tiny Qwen3MoeForCausalLM (fp32, eval mode), deterministic for a seed."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(tiny_qwen3_moe_config())
    model.to(torch.float32).eval()
    return model


def load_tiny_qwen3_moe(path: str | os.PathLike | None = None):
    """Load the saved tiny base from ``adapters/tiny-qwen3-moe`` (fp32, eval mode)."""
    from transformers import Qwen3MoeForCausalLM

    path = Path(path) if path is not None else ADAPTERS_DIR / BASE_NAME
    model = Qwen3MoeForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.eval()


def tiny_qwen3_moe_experts(model=None) -> dict[int, dict[str, torch.Tensor]]:
    """Fused in-memory expert weights of each MoE layer of the tiny base:
    {L: {"w13": (E, 2I, H) rows gate then up, "w2": (E, H, I), "router": (E, H)}} (clones, fp32).
    Note: the checkpoint on disk stores per-expert ``experts.{e}.{gate,up,down}_proj.weight`` instead (see README)."""
    model = model if model is not None else load_tiny_qwen3_moe()
    out = {}
    for L in MOE_LAYER_IDS:
        mlp = model.model.layers[L].mlp
        out[L] = {"w13": mlp.experts.gate_up_proj.detach().clone(), "w2": mlp.experts.down_proj.detach().clone(),
                  "router": mlp.gate.weight.detach().clone()}
    return out


def load_tiny_qwen3_moe_peft(adapter: str | os.PathLike, base=None):
    """The tiny base wrapped by PEFT with one adapter (name or dir) loaded; PEFT's forward is the oracle."""
    from peft import PeftModel

    adapter = Path(adapter)
    if not adapter.is_absolute() and not adapter.exists():
        adapter = ADAPTERS_DIR / adapter
    base = base if base is not None else load_tiny_qwen3_moe()
    return PeftModel.from_pretrained(base, str(adapter)).eval()


# ----------------------------------------------------------------------------------------------
# F1: per-expert module tree (transformers-4 layout)
# ----------------------------------------------------------------------------------------------

F1_NAMINGS = {
    # naming: (moe block attr, gate proj, up proj, down proj)
    "qwen": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
}


class F1Expert(nn.Module):
    """One SwiGLU expert with per-projection nn.Linear (no bias): down(silu(gate x) * up x)."""

    def __init__(self, naming: str, H: int, I: int):
        super().__init__()
        _, g, u, d = F1_NAMINGS[naming]
        self._names = (g, u, d)
        setattr(self, g, nn.Linear(H, I, bias=False))
        setattr(self, u, nn.Linear(H, I, bias=False))
        setattr(self, d, nn.Linear(I, H, bias=False))

    def forward(self, x):
        g, u, d = (getattr(self, n) for n in self._names)
        return d(F.silu(g(x)) * u(x))


class F1SharedExpert(nn.Module):
    """A stub shared expert holding only ``gate_proj`` (exists so PEFT's target_modules match a non-routed module
    whose keys a loader must report, not merge). Not used in the forward."""

    def __init__(self, H: int, I: int):
        super().__init__()
        self.gate_proj = nn.Linear(H, I, bias=False)


class F1MoEBlock(nn.Module):
    """``gate`` (router nn.Linear H->E) + ``experts`` (nn.ModuleList of F1Expert)."""

    def __init__(self, naming: str, E: int, H: int, I: int, top_k: int = 2, with_shared_expert: bool = False):
        super().__init__()
        self.num_experts, self.top_k = E, top_k
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([F1Expert(naming, H, I) for _ in range(E)])
        if with_shared_expert:
            self.shared_expert = F1SharedExpert(H, I)

    def route(self, x):
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        w, ids = torch.topk(probs, self.top_k, dim=-1)
        return (w / w.sum(-1, keepdim=True)).to(x.dtype), ids

    def forward(self, x, topk_weights=None, topk_ids=None):
        """x: [M, H]; routing from ``gate`` unless topk_weights/topk_ids ([M, k]) are given. Returns [M, H]."""
        if topk_ids is None:
            topk_weights, topk_ids = self.route(x)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tok, kk = torch.where(topk_ids == e)
            if tok.numel() == 0:
                continue
            y = self.experts[e](x[tok])
            out.index_add_(0, tok, y * topk_weights[tok, kk, None].to(y.dtype))
        return out


class F1Layer(nn.Module):
    def __init__(self, naming, E, H, I, top_k, with_shared_expert):
        super().__init__()
        setattr(self, F1_NAMINGS[naming][0], F1MoEBlock(naming, E, H, I, top_k, with_shared_expert))
        self._moe_attr = F1_NAMINGS[naming][0]

    def forward(self, x, topk_weights=None, topk_ids=None):
        return getattr(self, self._moe_attr)(x, topk_weights, topk_ids)


class F1Inner(nn.Module):
    def __init__(self, layers: dict):
        super().__init__()
        # ModuleDict keyed by the model's own layer index, so names are `model.layers.{L}....`
        self.layers = nn.ModuleDict(layers)


class F1Tree(nn.Module):
    """Root whose module names mimic a real model: ``model.layers.{L}.<mlp|block_sparse_moe>.experts.{e}.<proj>``.

    ``tree.moe(L)`` returns the MoE block of layer L; ``tree(x, L, topk_weights, topk_ids)`` runs it.
    """

    def __init__(self, naming, layer_ids, E, H, I, top_k=2, shared_expert_layers=()):
        super().__init__()
        self.naming, self.layer_ids = naming, list(layer_ids)
        self.E, self.H, self.I, self.top_k = E, H, I, top_k
        self.model = F1Inner(
            {str(L): F1Layer(naming, E, H, I, top_k, L in shared_expert_layers) for L in layer_ids}
        )

    def moe(self, L: int) -> F1MoEBlock:
        return getattr(self.model.layers[str(L)], F1_NAMINGS[self.naming][0])

    def forward(self, x, layer_id, topk_weights=None, topk_ids=None):
        return self.model.layers[str(layer_id)](x, topk_weights, topk_ids)


def build_f1_tree(naming: str, layer_ids, E: int, H: int, I: int, top_k: int = 2, shared_expert_layers=(),
                  seed: int | None = None) -> F1Tree:
    """Build the F1 module tree (fp32). With ``seed`` the base weights are randomly initialised
    deterministically (nn.Linear default init); load ``base.safetensors`` to get the saved ones."""
    if seed is not None:
        torch.manual_seed(seed)
    return F1Tree(naming, layer_ids, E, H, I, top_k, shared_expert_layers).eval()


F1_SPECS = {
    "f1-qwen": dict(naming="qwen", layer_ids=[1, 2], E=4, H=32, I=16, top_k=2, shared_expert_layers=[1]),
    "f1-mixtral": dict(naming="mixtral", layer_ids=[0, 1], E=4, H=32, I=16, top_k=2, shared_expert_layers=[]),
}


def load_f1_base(name: str, root: str | os.PathLike | None = None) -> F1Tree:
    """Rebuild the F1 tree of ``adapters/<name>`` and load its ``base.safetensors``."""
    root = Path(root) if root is not None else ADAPTERS_DIR
    tree = build_f1_tree(**F1_SPECS[name])
    tree.load_state_dict(load_file(str(root / name / "base.safetensors")), strict=True)
    return tree.eval()


def load_f1_peft(name: str, root: str | os.PathLike | None = None):
    """The F1 tree of ``adapters/<name>`` with PEFT's ``adapter/`` loaded (a PeftModel; oracle forward:
    ``peft_model.base_model.model.moe(L)(x, topk_weights, topk_ids)``)."""
    from peft import PeftModel

    root = Path(root) if root is not None else ADAPTERS_DIR
    return PeftModel.from_pretrained(load_f1_base(name, root), str(root / name / "adapter")).eval()


# ----------------------------------------------------------------------------------------------
# reference math (docs/design.md §1) and the F2 formula
# ----------------------------------------------------------------------------------------------


def moe_reference(x, w13, w2, topk_weights, topk_ids, d13=None, d2=None):
    """fp32 loop reference: x [M,H], w13 [E,2I,H] (rows gate then up), w2 [E,H,I]; optional dense deltas of the
    same shapes are added to the weights. Returns [M,H]."""
    if d13 is not None:
        w13 = w13 + d13
    if d2 is not None:
        w2 = w2 + d2
    I = w2.shape[-1]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            gu = w13[e] @ x[t]
            h = F.silu(gu[:I]) * gu[I:]
            out[t] += topk_weights[t, k] * (w2[e] @ h)
    return out


def f2_delta(A: torch.Tensor, B: torch.Tensor, E: int, scaling: float) -> torch.Tensor:
    """Verified F2 formula. A: (E*r, in) expert-major, B: (out, E*r) rank-major.
    delta[e] = scaling * B[:, e::E] @ A[e*r:(e+1)*r]  ->  (E, out, in)."""
    r = A.shape[0] // E
    return torch.stack([scaling * B[:, e::E] @ A[e * r:(e + 1) * r] for e in range(E)])


def _pattern_value(patterns: dict, key: str, default):
    # PEFT's get_pattern_key: first pattern p (dict order) with re.match(rf"(.*\.)?({p})$", key)
    for p, v in (patterns or {}).items():
        if re.match(rf"(.*\.)?({p})$", key):
            return v
    return default


_F2_KEY = re.compile(r"^base_model\.model\.(?P<mod>.*\.experts)\.(?P<nest>(base_layer\.)*)lora_(?P<ab>[AB])\.weight$")


QWEN3_EXPERT_PARAM_ORDER = ["gate_up_proj", "down_proj"]  # registration order in Qwen3MoeExperts.__init__


def f2_wrap_order(cfg: dict) -> list[str]:
    """Targeted expert parameter names, innermost ParamWrapper first (= key with the most ``base_layer.``)."""
    tps = cfg.get("target_parameters") or []
    return [p for p in QWEN3_EXPERT_PARAM_ORDER if any(t == p or t.endswith("." + p) for t in tps)]


def f2_expert_deltas(adapter_dir, num_experts: int | None = None):
    """Dense per-expert deltas of an F2 adapter of the tiny Qwen3-MoE (what PEFT adds to the parameters):
    returns {layer_id: {"gate_up_proj": (E, 2I, H), "down_proj": (E, H, I)}} (only the targeted ones).

    Which key is which parameter is resolved from the nesting: PEFT wraps the targeted parameters of a module in
    the module's parameter registration order (``Qwen3MoeExperts``: gate_up_proj, then down_proj), the first one
    innermost; with both targeted ``gate_up_proj`` is the inner wrapper (``experts.base_layer.lora_*``) and
    ``down_proj`` the outer (``experts.lora_*``). A's in-dim (H for gate_up, I for down) is asserted too."""
    adapter_dir = Path(adapter_dir)
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    sd = load_file(str(adapter_dir / "adapter_model.safetensors"))
    E = num_experts or TINY_QWEN3_MOE["num_experts"]
    leaf_names = f2_wrap_order(cfg)
    in_dim = {"gate_up_proj": TINY_QWEN3_MOE["hidden_size"], "down_proj": TINY_QWEN3_MOE["moe_intermediate_size"]}
    out: dict[int, dict[str, torch.Tensor]] = {}
    for key, A in sd.items():
        m = _F2_KEY.match(key)
        if not m or m["ab"] != "A":
            continue
        B = sd[key[: -len("lora_A.weight")] + "lora_B.weight"]
        depth = m["nest"].count("base_layer.")
        pname = leaf_names[len(leaf_names) - 1 - depth]  # outermost = last in sorted order
        layer = int(re.search(r"layers\.(\d+)\.", m["mod"])[1])
        full = f"{m['mod']}.{pname}"
        r = _pattern_value(cfg.get("rank_pattern"), full, cfg["r"])
        alpha = _pattern_value(cfg.get("alpha_pattern"), full, cfg["lora_alpha"])
        assert A.shape[0] == E * r and A.shape[1] == in_dim[pname], (key, pname, A.shape, E, r)
        s = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        out.setdefault(layer, {})[pname] = f2_delta(A.float(), B.float(), E, s)
    return out


# ----------------------------------------------------------------------------------------------
# building
# ----------------------------------------------------------------------------------------------

LORA_STD = 0.1


def _fill_lora_(model: nn.Module, seed: int, std: float = LORA_STD) -> None:
    """Replace every lora_A / lora_B weight with seeded N(0, std^2) values (sorted by name)."""
    g = torch.Generator().manual_seed(seed)
    params = sorted((n, p) for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n)
    assert params, "no LoRA parameters found"
    with torch.no_grad():
        for _, p in params:
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * std)


def _clean_dir(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)


def _save_peft(peft_model, out_dir: Path) -> None:
    _clean_dir(out_dir)
    peft_model.save_pretrained(str(out_dir))
    card = out_dir / "README.md"  # PEFT's auto model card: not needed
    if card.exists():
        card.unlink()
    _normalise_config_json(out_dir / "adapter_config.json")


def _normalise_config_json(path: Path) -> None:
    """PEFT serialises python sets (target_modules / target_parameters) in set-iteration order, which depends on
    PYTHONHASHSEED. Sort those lists (same content) so the file is byte-identical across runs."""
    cfg = json.loads(path.read_text())
    for k in ("target_modules", "target_parameters", "modules_to_save", "layers_to_transform"):
        if isinstance(cfg.get(k), list):
            cfg[k] = sorted(cfg[k])
    for k in ("rank_pattern", "alpha_pattern"):
        if isinstance(cfg.get(k), dict):
            cfg[k] = dict(sorted(cfg[k].items()))
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


# F2 adapters of the tiny Qwen3-MoE. Seeds are fixed per adapter.
F2_SPECS = {
    "sql": dict(
        seed=101,
        config=dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
        note="F2 gate_up_proj + down_proj, r=8, alpha=16, PLUS attention q_proj/v_proj (non-expert keys a loader "
             "must report, not merge)",
    ),
    "chat": dict(
        seed=102,
        config=dict(r=4, lora_alpha=8, use_rslora=True, target_modules=[],
                    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
        note="F2 gate_up_proj + down_proj, r=4, alpha=8, use_rslora (scaling = 8/sqrt(4) = 4)",
    ),
    "math": dict(
        seed=103,
        config=dict(r=8, lora_alpha=16, target_modules=[],
                    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                    rank_pattern={"down_proj": 4}, alpha_pattern={"down_proj": 4}),
        note="F2 gate_up_proj r=8 alpha=16 (s=2); down_proj via rank_pattern/alpha_pattern r=4 alpha=4 (s=1)",
    ),
    "gate-up-only": dict(
        seed=104,
        config=dict(r=8, lora_alpha=16, target_modules=[], target_parameters=["mlp.experts.gate_up_proj"]),
        note="F2 gate_up_proj only, r=8, alpha=16",
    ),
    "down-only": dict(
        seed=105,
        config=dict(r=8, lora_alpha=16, target_modules=[], target_parameters=["mlp.experts.down_proj"]),
        note="F2 down_proj only, r=8, alpha=16",
    ),
    "v4-style": dict(
        seed=106,
        config=dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
        note="given the transformers-4 style config target_modules=[gate_proj, up_proj, down_proj], r=4, alpha=8. "
             "PEFT (peft.utils.transformers_weight_conversion._convert_peft_config_moe, qwen3_moe -> qwen2_moe rules) "
             "rewrites it in place before injection and the REWRITTEN config is what is saved: target_modules=[], "
             "target_parameters=[down_proj, gate_up_proj] (bare names), rank_pattern {'.*\\.gate_up_proj': 2r=8}, "
             "alpha_pattern {'.*\\.gate_up_proj': 2*alpha=16}, so gate_up is a plain rank-8 F2 LoRA with s=16/8=2 "
             "(a dense B, not block-diagonal, since it was created fresh) and down_proj r=4, s=8/4=2. Side effect: "
             "the dense layer-0 MLP (nn.Linear gate_proj/up_proj/down_proj), which a v4 config would also have hit, "
             "is NOT targeted (no layer-0 keys)",
    ),
}


def build_f2(name: str, base_state: dict, report: dict) -> None:
    from peft import LoraConfig, get_peft_model

    spec = F2_SPECS[name]
    model = build_tiny_qwen3_moe()
    model.load_state_dict(base_state)
    model.name_or_path = f"adapters/{BASE_NAME}"  # -> base_model_name_or_path in adapter_config.json
    given = dict(spec["config"])
    cfg = LoraConfig(lora_dropout=0.0, bias="none", **given)
    pm = get_peft_model(model, cfg)
    _fill_lora_(pm, spec["seed"])
    pm.eval()
    _save_peft(pm, ADAPTERS_DIR / name)
    report[name] = {"given_config": given, "note": spec["note"]}


def build_f1(name: str, report: dict) -> None:
    from peft import LoraConfig, get_peft_model

    spec = F1_SPECS[name]
    tree = build_f1_tree(**spec, seed={"f1-qwen": 201, "f1-mixtral": 202}[name])
    out = ADAPTERS_DIR / name
    _clean_dir(out)
    save_file({k: v.contiguous() for k, v in tree.state_dict().items()}, str(out / "base.safetensors"))
    if spec["naming"] == "qwen":
        given = dict(target_modules=["gate_proj", "up_proj", "down_proj"], r=4, lora_alpha=8,
                     rank_pattern={r"model\.layers\.1\.mlp\.experts\.2\.down_proj": 2},
                     alpha_pattern={r"model\.layers\.1\.mlp\.experts\.2\.down_proj": 6})
        seed = 301
    else:
        given = dict(target_modules=["w1", "w3", "w2"], r=4, lora_alpha=4)
        seed = 302
    pm = get_peft_model(tree, LoraConfig(lora_dropout=0.0, bias="none", **given))
    _fill_lora_(pm, seed)
    pm.eval()
    _save_peft(pm, out / "adapter")
    report[name] = {"given_config": given, "spec": spec}


# ----------------------------------------------------------------------------------------------
# verification
# ----------------------------------------------------------------------------------------------


def _wrappers(pm):
    from peft.tuners.lora.layer import ParamWrapper

    return [(n, m) for n, m in pm.named_modules() if isinstance(m, ParamWrapper)]


def verify_f2(name: str, base_state: dict) -> list[str]:
    """Check the F2 formula against PEFT: (1) each ParamWrapper's get_delta_weight, (2) the wrapped experts' forward
    against the §1 reference with the hypothesised deltas, (3) the whole model's logits against the base model with
    the hypothesised deltas merged into the expert parameters (adapters without non-expert modules)."""
    lines = []
    base = build_tiny_qwen3_moe()
    base.load_state_dict(base_state)
    pm = load_tiny_qwen3_moe_peft(ADAPTERS_DIR / name, base=base)
    deltas = f2_expert_deltas(ADAPTERS_DIR / name)
    E = TINY_QWEN3_MOE["num_experts"]
    # (1) get_delta_weight
    max_err, min_alt = 0.0, float("inf")
    nwrap = 0
    for wname, w in _wrappers(pm):
        L = int(re.search(r"layers\.(\d+)\.", wname)[1])
        d_peft = w.get_delta_weight("default")
        d_hyp = deltas[L][w.parameter_name]
        assert d_peft.shape == d_hyp.shape, (wname, d_peft.shape, d_hyp.shape)
        max_err = max(max_err, (d_peft - d_hyp).abs().max().item())
        # also the factorised path used by the forward
        lhs, rhs, s = w.get_delta_factors("default")
        max_err = max(max_err, (s * lhs @ rhs - d_hyp).abs().max().item())
        # the other readings of the layouts must NOT match (so the check discriminates)
        A = w.lora_A["default"].weight.detach()
        B = w.lora_B["default"].weight.detach()
        r = A.shape[0] // E
        s = w.scaling["default"]
        alt_b = torch.stack([s * B[:, e * r:(e + 1) * r] @ A[e * r:(e + 1) * r] for e in range(E)])  # B expert-major
        alt_a = torch.stack([s * B[:, e::E] @ A[e::E] for e in range(E)])  # A rank-major
        min_alt = min(min_alt, (d_peft - alt_b).abs().max().item(), (d_peft - alt_a).abs().max().item())
        nwrap += 1
    assert max_err < 1e-5 and min_alt > 1e-3, (name, max_err, min_alt)
    lines.append(f"get_delta_weight / get_delta_factors of {nwrap} ParamWrappers == formula (max abs err {max_err:.1e}); "
                 f"B expert-major or A rank-major readings differ by >= {min_alt:.2f}")
    # (2) experts forward vs §1 reference
    g = torch.Generator().manual_seed(7)
    M = 12
    x = torch.randn(M, TINY_QWEN3_MOE["hidden_size"], generator=g)
    topk_ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(M)])
    topk_w = torch.softmax(torch.randn(M, 2, generator=g), -1)
    err2 = 0.0
    changed = 0.0
    inner = pm.base_model.model.model
    for L in MOE_LAYER_IDS:
        experts_peft = inner.layers[L].mlp.experts  # outermost ParamWrapper (or the plain experts)
        with torch.no_grad():
            y_peft = experts_peft(x, topk_ids, topk_w)
            w13 = base_state[f"model.layers.{L}.mlp.experts.gate_up_proj"]
            w2 = base_state[f"model.layers.{L}.mlp.experts.down_proj"]
            y_ref = moe_reference(x, w13, w2, topk_w, topk_ids, deltas[L].get("gate_up_proj"), deltas[L].get("down_proj"))
            y_base = moe_reference(x, w13, w2, topk_w, topk_ids)
        err2 = max(err2, (y_peft - y_ref).abs().max().item())
        changed = max(changed, (y_peft - y_base).abs().max().item())
    assert err2 < 1e-4 and changed > 1e-2, (name, err2, changed)
    lines.append(f"PEFT experts forward == §1 reference with formula deltas (max abs err {err2:.1e}; "
                 f"adapter changes the experts output by up to {changed:.2f})")
    # (3) whole-model logits, merging hypothesised deltas into a plain base (only if all keys are expert keys)
    sd = load_file(str(ADAPTERS_DIR / name / "adapter_model.safetensors"))
    if all(".experts." in k for k in sd):
        merged = build_tiny_qwen3_moe()
        st = {k: v.clone() for k, v in base_state.items()}
        for L, dd in deltas.items():
            for pname, d in dd.items():
                st[f"model.layers.{L}.mlp.experts.{pname}"] += d
        merged.load_state_dict(st)
        ids = torch.arange(16).reshape(2, 8) * 7 % TINY_QWEN3_MOE["vocab_size"]
        with torch.no_grad():
            lp = pm(input_ids=ids).logits
            lm = merged(input_ids=ids).logits
        with torch.no_grad(), pm.disable_adapter():
            lb = pm(input_ids=ids).logits
        err3 = (lp - lm).abs().max().item()
        moved = (lp - lb).abs().max().item()
        assert err3 < 1e-4 and moved > 1e-3, (name, err3, moved)
        lines.append(f"PEFT model logits == base with formula deltas merged into the expert parameters "
                     f"(max abs err {err3:.1e}; the adapter moves the logits by up to {moved:.2f})")
    return lines


def verify_f1(name: str) -> list[str]:
    """PEFT's F1 forward == §1 reference with per-expert deltas s * B @ A (rank/alpha patterns applied)."""
    spec = F1_SPECS[name]
    _, gn, un, dn = F1_NAMINGS[spec["naming"]]
    block = F1_NAMINGS[spec["naming"]][0]
    pm = load_f1_peft(name)
    base = load_f1_base(name)
    cfg = json.loads((ADAPTERS_DIR / name / "adapter" / "adapter_config.json").read_text())
    sd = load_file(str(ADAPTERS_DIR / name / "adapter" / "adapter_model.safetensors"))
    E, I = spec["E"], spec["I"]
    g = torch.Generator().manual_seed(8)
    M = 10
    x = torch.randn(M, spec["H"], generator=g)
    topk_ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(M)])
    topk_w = torch.softmax(torch.randn(M, 2, generator=g), -1)
    err = 0.0
    for L in spec["layer_ids"]:
        bb = base.moe(L)
        w13 = torch.stack([torch.cat([getattr(bb.experts[e], gn).weight, getattr(bb.experts[e], un).weight]) for e in range(E)])
        w2 = torch.stack([getattr(bb.experts[e], dn).weight for e in range(E)])
        d13 = torch.zeros_like(w13)
        d2 = torch.zeros_like(w2)
        for e in range(E):
            for proj, tgt, rows in ((gn, d13, slice(0, I)), (un, d13, slice(I, 2 * I)), (dn, d2, slice(None))):
                mod = f"model.layers.{L}.{block}.experts.{e}.{proj}"
                A = sd[f"base_model.model.{mod}.lora_A.weight"]
                B = sd[f"base_model.model.{mod}.lora_B.weight"]
                r = _pattern_value(cfg.get("rank_pattern"), mod, cfg["r"])
                alpha = _pattern_value(cfg.get("alpha_pattern"), mod, cfg["lora_alpha"])
                assert A.shape[0] == r
                s = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
                tgt[e][rows] += s * B @ A
        with torch.no_grad():
            y = pm.base_model.model.moe(L)(x, topk_w, topk_ids)
        y_ref = moe_reference(x, w13, w2, topk_w, topk_ids, d13, d2)
        err = max(err, (y - y_ref).abs().max().item())
    assert err < 1e-4, (name, err)
    return [f"PEFT forward == §1 reference with per-expert s*B@A deltas (max abs err {err:.1e})"]


def verify_layout() -> list[str]:
    """Confirm the transformers-5 fused expert layout: gate_up_proj (E, 2I, H) rows [0,I) gate, [I,2I) up."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe as mq

    model = load_tiny_qwen3_moe()
    lines = []
    for i, layer in enumerate(model.model.layers):
        lines.append(f"layer {i}: mlp = {type(layer.mlp).__name__}")
    ex = model.model.layers[1].mlp.experts
    E, I, H = TINY_QWEN3_MOE["num_experts"], TINY_QWEN3_MOE["moe_intermediate_size"], TINY_QWEN3_MOE["hidden_size"]
    assert tuple(ex.gate_up_proj.shape) == (E, 2 * I, H) and tuple(ex.down_proj.shape) == (E, H, I)
    assert isinstance(model.model.layers[0].mlp, mq.Qwen3MoeMLP)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(5, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(5)])
    w = torch.softmax(torch.randn(5, 2, generator=g), -1)
    with torch.no_grad():
        y = ex(x, ids, w)
        y_ref = moe_reference(x, ex.gate_up_proj, ex.down_proj, w, ids)
        # swapping the halves must NOT match: proves rows [0,I) are gate (go through silu)
        sw = torch.cat([ex.gate_up_proj[:, I:], ex.gate_up_proj[:, :I]], 1)
        y_sw = moe_reference(x, sw, ex.down_proj, w, ids)
    err = (y - y_ref).abs().max().item()
    assert err < 1e-5 and (y - y_sw).abs().max().item() > 1e-3
    # the checkpoint on disk is per-expert (transformers-4 keys); check it re-fuses to cat(gate, up) exactly
    disk = load_file(str(ADAPTERS_DIR / BASE_NAME / "model.safetensors"))
    for Lid in MOE_LAYER_IDS:
        exL = model.model.layers[Lid].mlp.experts
        pre = f"model.layers.{Lid}.mlp.experts"
        for e in range(E):
            assert torch.equal(exL.gate_up_proj[e], torch.cat([disk[f"{pre}.{e}.gate_proj.weight"],
                                                                disk[f"{pre}.{e}.up_proj.weight"]]))
            assert torch.equal(exL.down_proj[e], disk[f"{pre}.{e}.down_proj.weight"])
        assert torch.equal(model.model.layers[Lid].mlp.gate.weight, disk[f"model.layers.{Lid}.mlp.gate.weight"])
    lines.append("on-disk per-expert tensors: gate_up_proj[e] == cat(experts.{e}.gate_proj.weight, "
                 "experts.{e}.up_proj.weight), down_proj[e] == experts.{e}.down_proj.weight (bit-exact)")
    lines.append(f"Qwen3MoeExperts forward == silu(W13[e][:I] x) * (W13[e][I:] x) -> W2[e] (max abs err {err:.1e}); "
                 f"experts implementation: {getattr(model.config, '_experts_implementation', None)!r}")
    return lines


# ----------------------------------------------------------------------------------------------
# README
# ----------------------------------------------------------------------------------------------


def _dir_size(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def _keys_table(st_path: Path, collapse: bool) -> list[str]:
    """Markdown list of keys -> shape. With ``collapse`` the layer/expert indices are folded to {L}/{e}."""
    sd = load_file(str(st_path))
    rows: dict[str, tuple[str, set]] = {}
    for k in sorted(sd):
        shape = tuple(sd[k].shape)
        if collapse:
            pat = re.sub(r"layers\.(\d+)\.", "layers.{L}.", k)
            pat = re.sub(r"experts\.(\d+)\.", "experts.{e}.", pat)
        else:
            pat = k
        rows.setdefault((pat, shape), set()).add(k)
    out = []
    for (pat, shape), ks in rows.items():
        out.append(f"| `{pat}` | {list(shape)} | {len(ks)} | {sd[next(iter(ks))].dtype} |".replace("torch.", ""))
    return ["| key | shape | count | dtype |", "| --- | --- | --- | --- |"] + out


def _cfg_fields(path: Path) -> str:
    cfg = json.loads(path.read_text())
    keep = ["peft_type", "peft_version", "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern",
            "target_modules", "target_parameters", "use_dora", "lora_bias", "bias", "fan_in_fan_out",
            "init_lora_weights", "base_model_name_or_path", "modules_to_save", "layers_to_transform"]
    return "\n".join(f"    {k}: {json.dumps(cfg.get(k))}" for k in keep if k in cfg)


def write_readme(report: dict, verification: dict) -> None:
    import peft
    import transformers

    E, I, H = TINY_QWEN3_MOE["num_experts"], TINY_QWEN3_MOE["moe_intermediate_size"], TINY_QWEN3_MOE["hidden_size"]
    L = []
    a = L.append
    a("# adapters/: small real PEFT adapters for a tiny MoE base")
    a("")
    a("Made by `python adapters/make_adapters.py` (CPU, fixed seeds, byte-identical on re-run; this README is "
      "generated by the same script, do not edit by hand). Built with "
      f"torch {torch.__version__.split('+')[0]}, transformers {transformers.__version__}, peft {peft.__version__}. "
      "All tensors are float32. LoRA A/B weights are seeded N(0, 0.1²) random values (not PEFT's zero-B init), "
      "so every adapter changes outputs.")
    a("")
    a("Helpers for tests live in `make_adapters.py`: `load_tiny_qwen3_moe()`, `load_tiny_qwen3_moe_peft(name)`, "
      "`tiny_qwen3_moe_experts()`, "
      "`build_f1_tree(...)`, `load_f1_base(name)`, `load_f1_peft(name)`, `f2_expert_deltas(dir)`, "
      "`moe_reference(...)`, `F1_SPECS`, `TINY_QWEN3_MOE`, `MOE_LAYER_IDS`.")
    a("")
    a("## Folders")
    a("")
    a("| folder | what | size (bytes) |")
    a("| --- | --- | --- |")
    rows = [(BASE_NAME, "tiny transformers-5 Qwen3-MoE base (`save_pretrained`, safetensors)")]
    rows += [(n, F2_SPECS[n]["note"]) for n in F2_SPECS]
    rows += [("f1-qwen", "F1 per-expert modules, Qwen naming; `base.safetensors` + PEFT `adapter/`"),
             ("f1-mixtral", "F1 per-expert modules, Mixtral naming (w1 gate, w3 up, w2 down); `base.safetensors` + `adapter/`")]
    total = 0
    for n, what in rows:
        sz = _dir_size(ADAPTERS_DIR / n)
        total += sz
        a(f"| `{n}/` | {what} | {sz} |")
    a(f"| total | | {total} |")
    a("")
    a("## Tiny Qwen3-MoE base (`tiny-qwen3-moe/`)")
    a("")
    a("`Qwen3MoeConfig(" + ", ".join(f"{k}={v!r}" for k, v in TINY_QWEN3_MOE.items()) + ")`, "
      "`Qwen3MoeForCausalLM`, `torch.manual_seed(0)` then default init.")
    a("")
    a("Verified on the installed transformers:")
    a("")
    a("- Dense layers: `Qwen3MoeConfig.mlp_only_layers` (list of layer ids) is honoured by "
      "`Qwen3MoeDecoderLayer`: a layer is MoE iff `layer_idx not in mlp_only_layers and num_experts > 0 and "
      "(layer_idx + 1) % decoder_sparse_step == 0`. With `mlp_only_layers=[0]`:")
    for ln in verification["layout"][:-2]:
        a(f"  - {ln}")
    a(f"- Fused experts (`Qwen3MoeExperts`, module `model.layers.{{L}}.mlp.experts`): parameters "
      f"`gate_up_proj` (E, 2I, H) = {[E, 2 * I, H]} with rows `[0, I)` = gate and `[I, 2I)` = up "
      f"(`linear(x, gate_up_proj[e]).chunk(2, -1)` -> gate, up), and `down_proj` (E, H, I) = {[E, H, I]}; "
      "i.e. exactly the docs/design.md §2 `w13` / `w2` layout, no transpose. Router: `mlp.gate` is a "
      "`Qwen3MoeTopKRouter` with a parameter `mlp.gate.weight` (E, H) (softmax -> top-k -> renormalise since "
      "`norm_topk_prob=True`).")
    a(f"- {verification['layout'][-1]}")
    a(f"- Checked: {verification['layout'][-2]}.")
    a("- ON DISK the layout is different: transformers 5 `save_pretrained` reverses its weight conversion and "
      "writes the transformers-4 per-expert keys `model.layers.{L}.mlp.experts.{e}.{gate_proj,up_proj}.weight` "
      "(I, H) and `...experts.{e}.down_proj.weight` (H, I) (table below); `from_pretrained` re-fuses them into "
      "`gate_up_proj = cat(gate, up)` per expert. Read the base through transformers (or "
      "`tiny_qwen3_moe_experts()`), or stack the per-expert tensors yourself.")
    a("- `config.json` stores the expert count as `num_local_experts` (`Qwen3MoeConfig.attribute_map` maps "
      "`num_experts` -> `num_local_experts`), plus `num_experts_per_tok`, `moe_intermediate_size`, `mlp_only_layers`, "
      "`decoder_sparse_step`, `norm_topk_prob`.")
    a("")
    a("Base keys (`model.safetensors`, layer/expert indices folded):")
    a("")
    L.extend(_keys_table(ADAPTERS_DIR / BASE_NAME / "model.safetensors", collapse=True))
    a("")
    a("## F2 adapters (fused expert parameters, `target_parameters`)")
    a("")
    a("### How PEFT applies them (verified numerically)")
    a("")
    a("PEFT wraps each targeted 3-D parameter in a `lora.ParamWrapper`. For a parameter of shape "
      "(E, out, in) (transformers-5 experts are (experts, out, in), so PEFT swaps its in/out reading: "
      "`in_features = shape[2]`, `out_features = shape[1]`):")
    a("")
    a("```")
    a("lora_A.weight : (E*r, in)     expert-major:  A_e = A[e*r:(e+1)*r]        (r, in)")
    a("lora_B.weight : (out, E*r)    rank-major:    B_e = B[:, e::E]            (out, r)   (column j*E+e = rank j of expert e)")
    a("delta_e       = s * B_e @ A_e                                            (out, in), added to param[e]")
    a("s             = lora_alpha / r   (lora_alpha / sqrt(r) with use_rslora), r/alpha from rank_pattern/alpha_pattern")
    a("               matched against the parameter's full name, e.g. 'model.layers.1.mlp.experts.down_proj'")
    a("```")
    a("")
    a(f"- gate_up_proj: in = H = {H}, out = 2I = {2 * I}. ONE A_e (r, H) is shared by gate and up; "
      f"B_e rows `[0, I)` give the gate delta and rows `[I, 2I)` the up delta: "
      "`dW_gate[e] = s * B[:I, e::E] @ A_e`, `dW_up[e] = s * B[I:, e::E] @ A_e`. "
      "In the docs/design.md §2 pool this A is stored in both halves of `gate_up_a` (gate rows and up rows), "
      "B rows `[0,I)` -> gate B, `[I,2I)` -> up B.")
    a(f"- down_proj: in = I = {I}, out = H = {H}; A (E*r, I), B (H, E*r).")
    a("- PEFT's own code (`ParamWrapper.get_delta_weight`): `A.reshape(E, r, in)`, `B.reshape(out, r, E)`, "
      "`einsum('o r e, e r i -> e o i') * scaling`; the forward uses `get_delta_factors` "
      "(same factors) and a parametrization W + delta of the parameter, so gate/up deltas enter before SiLU "
      "and the down delta after, as in docs/design.md §1.")
    a("- Key naming / nesting: one `ParamWrapper` per parameter; two targeted parameters on the same module nest. "
      "PEFT (`BaseTuner._inject_parameters`) walks `named_modules()` and, per module, its "
      "`named_parameters(recurse=False)` in registration order (`Qwen3MoeExperts`: `gate_up_proj`, then `down_proj`); "
      "each match wraps the current (possibly already wrapped) module, so the first is innermost. "
      "With both targeted, `gate_up_proj` is INNER (`...mlp.experts.base_layer.lora_A.weight`) and "
      "`down_proj` is OUTER (`...mlp.experts.lora_A.weight`). With only one targeted parameter, its key is "
      "`...mlp.experts.lora_A.weight` whichever it is (see gate-up-only / down-only) -- the loader must use "
      f"`adapter_config.json` (`target_parameters`) and/or the A shape to tell which is which: A is (E*r, H) for "
      f"gate_up and (E*r, I) for down, while B shapes are ambiguous here on purpose (2I == H == {H}).")
    a("- Checks run by the script for every F2 adapter:")
    for n in F2_SPECS:
        for ln in verification[n]:
            a(f"  - `{n}`: {ln}")
    a("")
    for n in F2_SPECS:
        a(f"### `{n}/`")
        a("")
        a(F2_SPECS[n]["note"] + ".")
        a("")
        a("LoraConfig given (plus `lora_dropout=0.0, bias='none'`): `" + json.dumps(report[n]["given_config"]) + "`")
        a("")
        a("Saved `adapter_config.json` (fields that matter):")
        a("")
        a("```")
        a(_cfg_fields(ADAPTERS_DIR / n / "adapter_config.json"))
        a("```")
        a("")
        L.extend(_keys_table(ADAPTERS_DIR / n / "adapter_model.safetensors", collapse=False))
        a("")
        a(_f2_key_roles(n))
        a("")
    a("## F1 adapters (per-expert modules, transformers-4 layout)")
    a("")
    a("Made by PEFT (`get_peft_model` + `save_pretrained`) on `build_f1_tree(...)`, a hand-written module tree "
      "whose names mimic the real models: `model.layers` is an `nn.ModuleDict` keyed by the model's own layer id, "
      "each expert is a module with three `nn.Linear` (no bias). `base.safetensors` is the tree's `state_dict()`. "
      "`load_f1_peft(name)` gives the PEFT oracle; `peft_model.base_model.model.moe(L)(x, topk_weights, topk_ids)` "
      "runs one MoE block (x [M, H], routing given or from the `gate` router: softmax -> top-2 -> renormalise). "
      "Per expert and projection: nn.Linear LoRA, `A (r, in)`, `B (out, r)`, `delta = s * B @ A` (s = alpha/r, "
      "rank_pattern/alpha_pattern matched against the module's full name).")
    a("")
    for n in F1_SPECS:
        spec = F1_SPECS[n]
        a(f"### `{n}/`")
        a("")
        a(f"`build_f1_tree(**{spec!r})`; naming: "
          + {"qwen": "`model.layers.{L}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}`, router `model.layers.{L}.mlp.gate` (Linear H->E, not targeted), "
                     "and a stub `model.layers.1.mlp.shared_expert.gate_proj` (Linear H->I) that the v4-style target "
                     "list also matches: its LoRA keys are NOT expert keys and must be reported as ignored.",
             "mixtral": "`model.layers.{L}.block_sparse_moe.experts.{e}.{w1,w3,w2}` (w1 = gate, w3 = up, w2 = down), "
                        "router `model.layers.{L}.block_sparse_moe.gate` (not targeted)."}[spec["naming"]])
        a("")
        a("LoraConfig given (plus `lora_dropout=0.0, bias='none'`): `" + json.dumps(report[n]["given_config"]) + "`")
        a("")
        a("Saved `adapter/adapter_config.json` (fields that matter):")
        a("")
        a("```")
        a(_cfg_fields(ADAPTERS_DIR / n / "adapter" / "adapter_config.json"))
        a("```")
        a("")
        a("Adapter keys (`adapter/adapter_model.safetensors`, layer/expert indices folded):")
        a("")
        L.extend(_keys_table(ADAPTERS_DIR / n / "adapter" / "adapter_model.safetensors", collapse=True))
        a("")
        if spec["naming"] == "qwen":
            a("The rank-2 `down_proj` row is `model.layers.1.mlp.experts.2.down_proj` only (rank_pattern r=2, "
              "alpha_pattern 6, so s = 3 there; s = 8/4 = 2 everywhere else). The `shared_expert.gate_proj` keys "
              "exist for layer 1 only.")
            a("")
        a("Base keys (`base.safetensors`):")
        a("")
        L.extend(_keys_table(ADAPTERS_DIR / n / "base.safetensors", collapse=True))
        a("")
        for ln in verification[n]:
            a(f"Check: {ln}.")
        a("")
    (ADAPTERS_DIR / "README.md").write_text("\n".join(L).rstrip() + "\n")


def _f2_key_roles(name: str) -> str:
    cfg = json.loads((ADAPTERS_DIR / name / "adapter_config.json").read_text())
    sd = load_file(str(ADAPTERS_DIR / name / "adapter_model.safetensors"))
    leaf = f2_wrap_order(cfg)
    roles = []
    seen = set()
    for k in sorted(sd):
        m = _F2_KEY.match(k)
        if not m:
            kind = re.sub(r"layers\.\d+\.", "layers.{L}.", k)
            if kind not in seen:
                seen.add(kind)
                roles.append(f"`{kind}`: NOT an expert key (must be reported, not merged)")
            continue
        depth = m["nest"].count("base_layer.")
        kind = f"experts.{m['nest']}lora_{m['ab']}"
        if kind in seen:
            continue
        seen.add(kind)
        pname = leaf[len(leaf) - 1 - depth]
        roles.append(f"`{kind}.weight` = {pname} {m['ab']}")
    return "Key roles: " + "; ".join(roles) + "."


# ----------------------------------------------------------------------------------------------


def main() -> int:
    import transformers

    torch.set_num_threads(1)  # deterministic CPU reductions
    transformers.logging.set_verbosity_error()
    import warnings

    warnings.filterwarnings("ignore")

    report: dict = {}
    verification: dict = {}

    # 1. base
    base_dir = ADAPTERS_DIR / BASE_NAME
    _clean_dir(base_dir)
    model = build_tiny_qwen3_moe(seed=0)
    model.config._name_or_path = f"adapters/{BASE_NAME}"
    model.save_pretrained(str(base_dir))
    del model
    base_state = {k: v.clone() for k, v in load_tiny_qwen3_moe(base_dir).state_dict().items()}
    verification["layout"] = verify_layout()

    # 2. F2 adapters
    for n in F2_SPECS:
        build_f2(n, base_state, report)
    for n in F2_SPECS:
        verification[n] = verify_f2(n, base_state)

    # 3. F1 fixtures
    for n in F1_SPECS:
        build_f1(n, report)
        verification[n] = verify_f1(n)

    # 4. README
    write_readme(report, verification)

    for n in [BASE_NAME, *F2_SPECS, *F1_SPECS]:
        print(f"{n:16s} {_dir_size(ADAPTERS_DIR / n):8d} bytes")
    for k, v in verification.items():
        for ln in v:
            print(f"[{k}] {ln}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
