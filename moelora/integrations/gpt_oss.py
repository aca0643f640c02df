"""gpt-oss checkpoints with MXFP4 experts, loaded packed: no hub kernels, no bf16 copy of the experts.

transformers serves gpt-oss' MXFP4 experts packed only through its hub kernels (the ``kernels`` package,
a GPU, Triton 3.4+), in a swizzled layout of their own: attach then reads the blocks back out of it, so the
packed bytes are held twice. Anywhere else it dequantizes them to bf16 at load (gpt-oss-120b: about
229 GB of experts instead of 61 GB). :func:`load_packed_gpt_oss` reads the checkpoint itself: the experts'
``*_blocks`` (E2M1 values, two a byte) and ``*_scales`` (E8M0) go into :class:`PackedGptOssExperts` as
they are stored, everything else into transformers' own gpt-oss model, so the experts take their packed
size once. ``attach`` serves those experts packed (the GEMMs decode the blocks in their K-loops) or, with
``dequantize_mxfp4=True``, from one bf16 copy.

The checkpoint layout (``openai/gpt-oss-20b`` / ``-120b``): per layer ``mlp.experts.gate_up_proj_blocks``
``(E, 2I, H / 32, 16)`` uint8 with gate and up rows interleaved (row 2n is gate n, 2n + 1 up n),
``gate_up_proj_scales`` ``(E, 2I, H / 32)`` uint8, ``down_proj_blocks`` ``(E, H, I / 32, 16)``,
``down_proj_scales`` ``(E, H, I / 32)`` and the two biases; ``config.json`` names the
``quantization_config`` ``{"quant_method": "mxfp4"}``.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import torch
from torch import nn

__all__ = ["PackedGptOssExperts", "is_packed_gpt_oss_checkpoint", "load_packed_gpt_oss"]

log = logging.getLogger(__name__)

_PACKED = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")


class PackedGptOssExperts(nn.Module):
    """gpt-oss' routed experts with MXFP4 weights, stored as the checkpoint stores them (parameters under
    the checkpoint's names, uint8, ``requires_grad=False``; the biases in the model's dtype). Its forward
    is ``GptOssExperts``' math on the weights of each picked expert decoded for the call (PyTorch): the
    reference path; ``attach`` swaps it for the layer, which reads the blocks in place."""

    def __init__(self, config, dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__()
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        if h % 32 or i % 32:
            raise ValueError(f"MXFP4 experts need hidden_size and intermediate_size multiples of 32, got "
                             f"{h} and {i}")
        self.num_experts, self.hidden_size, self.intermediate_size = e, h, i
        # As the installed transformers' GptOssExperts takes them: some versions read both from the config,
        # older ones fix alpha at 1.702 (and their configs have no swiglu_alpha).
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        with torch.device("meta"):
            dense = GptOssExperts(config)
        self.alpha, self.limit = float(dense.alpha), float(dense.limit)
        shapes = {"gate_up_proj_blocks": (e, 2 * i, h // 32, 16), "gate_up_proj_scales": (e, 2 * i, h // 32),
                  "down_proj_blocks": (e, h, i // 32, 16), "down_proj_scales": (e, h, i // 32)}
        for name, shape in shapes.items():
            setattr(self, name, nn.Parameter(torch.empty(shape, dtype=torch.uint8, device=device),
                                             requires_grad=False))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i, dtype=dtype, device=device))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h, dtype=dtype, device=device))

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gpt-oss' own clamped SwiGLU (``GptOssExperts._apply_gate``, on ``self.limit`` and ``self.alpha``)
        on interleaved ``[g0, u0, g1, u1, ...]`` columns."""
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        return GptOssExperts._apply_gate(self, gate_up)

    def forward(self, hidden_states: torch.Tensor, router_indices: torch.Tensor,
                routing_weights: torch.Tensor) -> torch.Tensor:
        """``sum_k w_k * (W_down swiglu(W_gate_up x + b_gate_up) + b_down)`` over each token's experts."""
        from triton_ops.mxfp4 import dequantize_mxfp4_torch

        out = torch.zeros_like(hidden_states)
        dtype = self.gate_up_proj_bias.dtype
        x = hidden_states.to(dtype)
        for expert in torch.unique(router_indices).tolist():
            if not 0 <= expert < self.num_experts:
                continue
            token, pick = torch.where(router_indices == expert)
            gate_up_w = dequantize_mxfp4_torch(self.gate_up_proj_blocks[expert].flatten(-2),
                                               self.gate_up_proj_scales[expert], dtype)
            down_w = dequantize_mxfp4_torch(self.down_proj_blocks[expert].flatten(-2),
                                            self.down_proj_scales[expert], dtype)
            h = self._apply_gate(x[token] @ gate_up_w.T + self.gate_up_proj_bias[expert])
            y = (h @ down_w.T + self.down_proj_bias[expert]) * routing_weights[token, pick, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


def _config_json(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def is_packed_gpt_oss_checkpoint(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` holds a gpt-oss checkpoint with MXFP4 experts (``config.json``'s model type and
    quantization method), which :func:`load_packed_gpt_oss` loads."""
    config = _config_json(Path(model_dir))
    quant = config.get("quantization_config") or {}
    return config.get("model_type") == "gpt_oss" and isinstance(quant, dict) and quant.get(
        "quant_method") == "mxfp4"


def _checkpoint_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files: those the index names, or ``model.safetensors``."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [model_dir / name for name in sorted(set(weight_map.values()))]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{index}: not a safetensors index with a weight_map of file names "
                             f"({type(err).__name__}: {err})") from None
    else:
        files = [model_dir / "model.safetensors"]
    for file in files:
        if not file.is_file():
            raise ValueError(f"{file}: checkpoint file missing; expected the safetensors files of the model")
    return files


def _rebuild_meta_buffers(model: nn.Module, config, device: torch.device) -> None:
    """Buffers a model computes at construction and does not save (the rotary embedding's frequencies),
    left on the meta device by the construction there: that module built again on ``device``."""
    for name, module in list(model.named_modules()):
        if not any(b.is_meta for b in module.buffers(recurse=False)):
            continue
        if "RotaryEmbedding" not in type(module).__name__:
            meta = [n for n, b in module.named_buffers(recurse=False) if b.is_meta]
            raise ValueError(f"{name}.{meta[0]}: a buffer the checkpoint does not hold and the loader cannot "
                             "compute")
        with torch.device(device):
            rebuilt = type(module)(config=config)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, rebuilt)


def load_packed_gpt_oss(model_dir: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype | None = None) -> nn.Module:
    """transformers' ``GptOssForCausalLM`` from ``model_dir`` with each layer's experts a
    :class:`PackedGptOssExperts` holding the checkpoint's MXFP4 blocks and scales as stored (module
    docstring). ``dtype``: every floating-point tensor's (default: the config's, else bfloat16), but in
    half precision the modules transformers keeps in float32 (the norms) stay so, as its own loading
    leaves them; the weights are read straight onto ``device``, a file at a time (logged at INFO).
    ValueError naming the file and key for a checkpoint that is not one (missing or unexpected keys, a
    shape that does not match the config, a file safetensors cannot read)."""
    from safetensors import SafetensorError, safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    model_dir, device = Path(model_dir), torch.device(device)
    if not is_packed_gpt_oss_checkpoint(model_dir):
        raise ValueError(f"{model_dir}: not a gpt-oss checkpoint with MXFP4 experts (config.json's "
                         "model_type 'gpt_oss' and quantization_config.quant_method 'mxfp4' expected)")
    config = AutoConfig.from_pretrained(model_dir)
    if dtype is None:
        dtype = getattr(config, "dtype", None)
        dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
        dtype = dtype if isinstance(dtype, torch.dtype) else torch.bfloat16
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    for layer in model.model.layers:
        layer.mlp.experts = PackedGptOssExperts(config, dtype, device="meta")
    expected = dict(model.state_dict(keep_vars=True))
    # As transformers loads a model in half precision: the modules it names stay in float32 (the norms).
    keep_fp32 = getattr(model, "_keep_in_fp32_modules", None) or []
    fp32_keys = None
    if keep_fp32 and dtype in (torch.float16, torch.bfloat16):
        fp32_keys = re.compile("|".join(re.escape(module) for module in keep_fp32))
    tied = {"lm_head.weight"} & expected.keys() if config.tie_word_embeddings else set()
    state: dict[str, torch.Tensor] = {}
    files, started, read_bytes = _checkpoint_files(model_dir), time.monotonic(), 0
    for number, file in enumerate(files, 1):
        try:
            f = safe_open(str(file), framework="pt", device=str(device))
        except (OSError, SafetensorError) as err:
            raise ValueError(f"{file}: not a readable safetensors file ({err})") from None
        with f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if key not in expected:
                    raise ValueError(f"{file}: key {key!r} is not a parameter of the gpt-oss model built "
                                     "from config.json")
                try:
                    tensor = f.get_tensor(key)
                except (OSError, SafetensorError) as err:
                    raise ValueError(f"{file}: key {key!r} cannot be read ({err})") from None
                want = expected[key]
                if tuple(tensor.shape) != tuple(want.shape):
                    raise ValueError(f"{file}: key {key!r} has shape {tuple(tensor.shape)}, expected "
                                     f"{tuple(want.shape)} from config.json")
                if key.endswith(_PACKED):
                    if tensor.dtype != torch.uint8:
                        raise ValueError(f"{file}: key {key!r} is {tensor.dtype}, expected uint8 MXFP4 "
                                         "blocks or scales")
                elif tensor.is_floating_point():
                    tensor = tensor.to(torch.float32 if fp32_keys and fp32_keys.search(key) else dtype)
                state[key] = tensor
                read_bytes += tensor.numel() * tensor.element_size()
        log.info("%s: file %d/%d read onto %s (%.2f GB, %.0f s)", model_dir.name, number, len(files), device,
                 read_bytes / 1e9, time.monotonic() - started)
    missing = sorted(set(expected) - set(state) - tied)
    if missing:
        raise ValueError(f"{model_dir}: the checkpoint has no {missing[0]!r} ({len(missing)} keys missing); "
                         "expected every parameter of the gpt-oss model built from config.json")
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.tie_weights()
    _rebuild_meta_buffers(model, config, device)
    try:
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    except OSError:  # no generation_config.json: the one from_config made
        pass
    return model.eval()
