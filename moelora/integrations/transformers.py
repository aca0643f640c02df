"""Serve many LoRA adapters on a transformers-5 Mixture-of-Experts model, one adapter per sequence.

:func:`attach` finds every routed-experts module of the model and swaps it for a
:class:`MoELoRAExperts`, which runs :class:`moelora.FusedMoEWithLoRA` on the model's own expert tensors
(the same ``nn.Parameter`` objects: nothing is copied, ``state_dict()`` keys are unchanged). Routers,
shared experts, attention and dense MLP layers are not touched. The returned :class:`MoELoRAHandle`
loads adapters into the pool and selects one adapter per batch row::

    handle = attach(model, max_loras=8, max_rank=64)     # pool sized from the expert tensors
    handle.load_adapter("sql", "path/to/sql")            # a PEFT directory
    handle.load_adapter("chat", "path/to/chat")
    with handle.adapters(["sql", None, "chat"]):          # one entry per batch row, None = base model
        logits = model(input_ids).logits
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=32, do_sample=False)
    handle.detach()                                       # original modules back, bit-identical outputs

What is swapped. In transformers 5 the routed experts of a MoE layer are one module with fused
parameters ``gate_up_proj (E, 2I, H)`` (rows ``[0, I)`` gate, ``[I, 2I)`` up) and ``down_proj
(E, H, I)`` and ``forward(hidden_states (M, H), top_k_index (M, k), top_k_weights (M, k))`` computing
``sum_k w_k * down_e(act(gate_e x, up_e x))``: ``Qwen3MoeExperts``, ``Qwen2MoeExperts``,
``OlmoeExperts``, ``MixtralExperts``, ``DeepseekV3Experts`` (the families in
:data:`KNOWN_EXPERTS_CLASSES`, tested against PEFT) and many others built with transformers'
``use_experts_implementation``. The router of each family runs before the experts module and hands it
the final routing weights: DeepSeek-V3's ``DeepseekV3TopkRouter`` already multiplies them by
``routed_scaling_factor`` (and renormalises with ``norm_topk_prob``), so the experts module, and
therefore the swapped layer, uses ``routed_scaling_factor = 1``: the same math as the original module.
Other classes with the same structure are accepted after a numerical check of their forward against
that formula at attach time. ``act`` is SiLU, exact or tanh GELU (probed from ``act_fn``), or, where the
class overrides ``_apply_gate``, the gated activation it computes (the clamped SwiGLUs of gpt-oss,
DeepSeek-V4, GLM-5-next, Hunyuan-V4, MiniMax-M3, Step-3.7; Inkling-2's soft-capped SwiGLU: found by running
it on probe values, :class:`moelora.activations.GatedActivation`). Other layouts are mapped onto the layer
(docs/architecture.md, "Expert layouts"): transposed storage (Aria, gpt-oss, and Llama-4's unflagged one)
read in place through strides; ungated squared-ReLU experts (Nemotron-H) as a ``(E, 2, I, H)`` halves view
of their up projection; interleaved gate/up columns (gpt-oss) through one de-interleaved copy of gate/up
(the in-place halves view reads 6-8x slower); MXFP4 experts (gpt-oss: the checkpoint's, as
:func:`moelora.integrations.gpt_oss.load_packed_gpt_oss` loads them, or packed for transformers' hub
kernels) served packed, the GEMMs decoding them, or with ``dequantize_mxfp4`` dequantized once at attach,
de-interleaved on the way; expert biases (gpt-oss) in the GEMM
epilogues; identity experts (LongCat-Flash) added by the wrapper; a norm after each expert (MuSE-Spark) run
on each routed pair's output; Llama-4's dense form (every expert's input-scaled rows) as top-1 pairs; and
JetMoE's self-routing block, swapped whole; several expert sets per layer chosen by a token-type mask
(ERNIE-4.5-VL's text and vision experts) from a pool per set (:attr:`MoELoRAHandle.pools`).
``benchmarks/family_coverage.py`` checks every family against PEFT. Refused, with an
:class:`UnsupportedModelError` (a ``ValueError``) that says why: expert sets chosen otherwise, stacked 2-D
expert matrices (DBRX), experts as one module each (transformers 4,
Switch Transformers, NLLB-MoE), an ``_apply_gate`` of another form, other activations, MXFP4 experts whose
packed tensors cannot be decoded (load them dequantized), expert parallelism across ranks that hold different
batches (transformers' all-to-all), quantised or meta-device expert weights, experts spread over several
devices or dtypes, MoE layers of different shapes in one model, and a model that PEFT already wraps (attach
to the plain base model). A model loaded with transformers' tensor-parallel plan, or its expert-parallel
plan over the tensor-parallel ranks, is served shard by shard (``_sharding_of``).

Adapter per token. Inside a ``handle.adapters(names)`` context the hidden states an experts module
receives are the model's ``(B, S, H)`` activations flattened batch-major: ``B*S`` rows at prefill,
``B`` rows per decode step with a KV cache. The tokens of row ``b`` are rows ``[b*S, (b+1)*S)``, so
row ``b`` gets ``names[b]`` for all its ``S`` tokens. When ``generate`` expands the batch
(``num_return_sequences``, beam search) it repeats each row in place (``repeat_interleave``), so a
batch of ``n * len(names)`` rows gives every name its ``n`` adjacent copies; the model's forward
pre-hook refuses a batch whose row count is not a multiple of ``len(names)``. For packed (padding-free)
inputs pass ``seq_lens`` (tokens per sequence in the flattened order) instead.

Padding. With left (or right) padding a padded position belongs to its row and takes the row's
adapter. That is harmless: the attention mask keeps padded positions out of every real token's
attention, and their own outputs are ignored, so real tokens get exactly what they get unpadded.

Batch info. A :class:`moelora.MoELoRABatchInfo` depends only on the names and the token count, so one
is built per (context, token count) on first use and shared by every MoE layer and every later step
of that shape: a ``generate`` call builds two (prefill and decode), not one per layer per step. They
hold their adapters' slots (no eviction) until the context exits. Outside any context (or when every
name is ``None``) the original module runs: exactly the base model's output.

Where the parts are. This module holds :func:`attach`, :class:`MoELoRAHandle` and
:func:`find_experts_modules`; the swapped module is in :mod:`moelora.integrations.experts_module`, the
adapter selection in :mod:`moelora.integrations.selection`, each family's case (storage layouts, special
modules, token-type expert sets) in :mod:`moelora.integrations.families`, the activation detection and the
checks in :mod:`moelora.integrations.checks`, and the reading of parallel plans in
:mod:`moelora.integrations.sharding`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moelora.activations import GatedActivation
from moelora.integrations.checks import _activation_dtype, _check_supported, _verify_math
from moelora.integrations.experts_module import MoELoRAExperts
from moelora.integrations.families import (
    _FP8_EXPERTS_CLASS,
    _POOL_DTYPES,  # noqa: F401  (read by benchmarks/supported_table.py through this module)
    KNOWN_EXPERTS_CLASSES,
    UnsupportedModelError,
    _DequantizedMxfp4Experts,
    _expert_layout,
    _expert_set_of,
    _expert_shape,
    _experts_view,
    _is_experts_module,
    _is_mxfp4_hub,
    _storage_of,
    _token_type_block,
    _TokenTypes,
)
from moelora.integrations.selection import _Selection, _Selector
from moelora.integrations.sharding import _shard_layout, _sharding_of
from moelora.layer import PATHS
from moelora.parallel import MoEShard
from moelora.peft_loader import OTHER_EXPERT_SET, in_expert_set, lora_module_names
from moelora.pool import MoELoRAMemoryPool

__all__ = [
    "UnsupportedModelError",
    "KNOWN_EXPERTS_CLASSES",
    "MoELoRAExperts",
    "MoELoRAHandle",
    "attach",
    "find_experts_modules",
]

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?=\.|$)")


# --------------------------------------------------------------------------------------------------
# Finding the experts modules
# --------------------------------------------------------------------------------------------------


def find_experts_modules(model: nn.Module) -> list[tuple[str, int, nn.Module]]:
    """The fused routed-experts modules of ``model``: ``(qualified name, layer id, module)`` per MoE layer,
    in model order.

    A module qualifies when it has 3-D ``gate_up_proj`` and ``down_proj`` tensors (transformers 5). The
    layer id is the model's own decoder-layer index, the last ``layers.{n}`` in the module's name (as in
    PEFT keys); a layer with several expert sets (ERNIE-4.5-VL's text and vision experts) lists each.
    Raises :class:`UnsupportedModelError` when a module has no layer index, modules of two decoder stacks
    share one, or the model is already wrapped by PEFT or attached.
    """
    found: list[tuple[str, int, nn.Module]] = []
    seen: dict[int, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, MoELoRAExperts):
            raise ValueError(f"{name} is already a MoELoRAExperts: this model is attached; detach() first")
        if not _is_experts_module(module):
            continue
        ids = _LAYER_RE.findall(name)
        if not ids:
            raise UnsupportedModelError(
                f"experts module {name!r} ({type(module).__name__}) has no 'layers.<n>' in its name, so its "
                "layer index (as in PEFT keys) is unknown"
            )
        lid = int(ids[-1])
        if lid in seen and seen[lid].partition(f"layers.{lid}.")[0] != name.partition(f"layers.{lid}.")[0]:
            raise UnsupportedModelError(
                f"experts modules {seen[lid]!r} and {name!r} share the layer index {lid}: the adapter keys "
                "('layers.<n>...experts') would be ambiguous; attach to the sub-model that holds one decoder "
                "stack"
            )
        seen.setdefault(lid, name)
        found.append((name, lid, module))
    return found


# --------------------------------------------------------------------------------------------------
# Handle
# --------------------------------------------------------------------------------------------------


def _rows_of(args: tuple, kwargs: dict) -> int | None:
    for key in ("input_ids", "inputs_embeds"):
        t = kwargs.get(key)
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            return int(t.shape[0])
    if args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 2:
        return int(args[0].shape[0])
    return None


class MoELoRAHandle:
    """What :func:`attach` returns: the pool, the swapped modules, adapter loading and selection.

    Attributes:
        model: the attached model.
        pool: the :class:`moelora.MoELoRAMemoryPool` (created by ``attach`` unless one was given); of the
            first expert set where a layer holds several.
        pools: expert set (the experts module's path in its layer, ``"mlp.experts"``) -> its pool: one
            entry, ``pool``, unless a layer holds several expert sets (ERNIE-4.5-VL: text and vision).
        modules: layer id -> :class:`MoELoRAExperts` now in the model (of the first expert set).
        module_names: layer id -> qualified module name (of the first expert set).
        expert_sets: expert set -> layer id -> its :class:`MoELoRAExperts`.
    """

    def __init__(
        self,
        model: nn.Module,
        pools: dict[str, MoELoRAMemoryPool],
        sites: list[tuple[str, int, nn.Module, nn.Module, str]],
        modules: dict[str, MoELoRAExperts],
        selector: _Selector,
        owns_pool: bool,
        hooks: Sequence[Any] = (),
    ) -> None:
        self.model = model
        self.pools = dict(pools)
        self.pool = next(iter(self.pools.values()))
        self.expert_sets: dict[str, dict[int, MoELoRAExperts]] = {name: {} for name in self.pools}
        for name, lid, *_ in sites:
            self.expert_sets[_expert_set_of(name, lid)][lid] = modules[name]
        primary = next(iter(self.pools))
        self.modules = dict(self.expert_sets[primary])
        self.module_names = {lid: name for name, lid, *_ in sites if _expert_set_of(name, lid) == primary}
        self._sites = sites  # (name, layer id, parent, original, attribute in parent)
        self._selector = selector
        self._step_selection: _Selection | None = None  # the one :meth:`step` keeps across steps
        self._owns_pool = owns_pool
        self._hooks = [model.register_forward_pre_hook(self._check_rows, with_kwargs=True), *hooks]
        self._loader: ThreadPoolExecutor | None = None  # loads into several pools, in the background
        self._attached = True

    # ---------------------------------------------------------------------------------------------- info

    @property
    def attached(self) -> bool:
        """False after :meth:`detach`."""
        return self._attached

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """The model's MoE layer indices, ascending."""
        return tuple(sorted(self.modules))

    @property
    def active_adapters(self) -> tuple[str | None, ...] | None:
        """The names per batch row in effect now (innermost context, else ``set_adapters``), or None."""
        sel = self._selector.active()
        return None if sel is None else sel.names

    def __repr__(self) -> str:
        state = "attached" if self._attached else "detached"
        return f"MoELoRAHandle({state}, layers={list(self.layer_ids)}, pool={self.pool!r})"

    # ---------------------------------------------------------------------------------------------- adapters

    def load_adapter(self, name: str, path: str | Path) -> object:
        """Loads a PEFT adapter directory into the pool (``MoELoRAMemoryPool.load_adapter``) and returns
        its report. Only the routed-expert LoRA is served: if the adapter also has LoRA weights elsewhere
        (attention, shared experts, dense MLPs, ``modules_to_save``) a warning names them, since outputs
        will then differ from PEFT's for that adapter.

        Where a layer holds several expert sets (:attr:`pools`), the adapter is loaded into the pool of
        each set it has LoRA in (a set it has none in runs its rows as the base model) and the reports
        come back as a dict by set; if one load fails, the others are undone (every pool as before)."""
        if len(self.pools) == 1:
            report = self.pool.load_adapter(name, path)
            self._warn_ignored(name, [report])
            return report
        with self._selector.lock:
            held = [set_name for set_name, pool in self.pools.items() if name in pool]
            if held:
                raise ValueError(f"adapter {name!r} is already loaded (expert sets {held}); unload it first")
            modules = lora_module_names(path)
            sets = [s for s in self.pools if any(in_expert_set(m, s) for m in modules)]
            sets = sets or [next(iter(self.pools))]  # none: the first pool's load says what is wrong
            reports: dict[str, object] = {}
            try:
                for set_name in sets:
                    reports[set_name] = self.pools[set_name].load_adapter(name, path)
            except BaseException:
                for set_name in reports:
                    self.pools[set_name].unload_adapter(name)
                raise
            self._selector.covers[name] = frozenset(sets)
        self._warn_ignored(name, list(reports.values()))
        return reports

    def _warn_ignored(self, name: str, reports: Sequence[object]) -> None:
        ignored: dict[str, str] = {}
        for report in reports:
            ignored.update(getattr(report, "ignored_keys", None) or {})
        keys = sorted(k for k, why in ignored.items() if not str(why).startswith(OTHER_EXPERT_SET))
        if keys:
            more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
            warnings.warn(
                f"adapter {name!r}: {len(keys)} tensor(s) outside the routed experts are not applied "
                f"({', '.join(keys[:3])}{more}); this adapter's outputs will differ from PEFT's",
                UserWarning,
                stacklevel=3,
            )

    def load_adapter_async(self, name: str, path: str | Path) -> Future:
        """``MoELoRAMemoryPool.load_adapter_async``: loads in a background thread, returns a Future. With
        several expert sets, :meth:`load_adapter` runs in a background thread of the handle."""
        if len(self.pools) == 1:
            return self.pool.load_adapter_async(name, path)
        if self._loader is None:
            self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moelora-sets-load")
        return self._loader.submit(self.load_adapter, name, path)

    def unload_adapter(self, name: str) -> None:
        """``MoELoRAMemoryPool.unload_adapter`` (refused for a pinned adapter), from every pool that holds
        it. A selection that names it is refused at its next forward, unless the adapter is still in the
        host tier."""
        if len(self.pools) == 1:
            self.pool.unload_adapter(name)
            return
        with self._selector.lock:
            holding = [pool for pool in self.pools.values() if name in pool]
            if not holding:
                self.pool.unload_adapter(name)  # refuses the unknown name, worded as the pool words it
            if any(pool.is_pinned(name) for pool in holding):  # before any pool lets it go
                raise ValueError(f"adapter {name!r} is pinned; unpin it before unloading")
            for pool in holding:
                pool.unload_adapter(name)
            self._selector.covers.pop(name, None)

    @contextlib.contextmanager
    def adapters(
        self, names: Sequence[str | None], seq_lens: Sequence[int] | None = None
    ) -> Iterator[MoELoRAHandle]:
        """Selects one adapter per batch row (``None`` = base model) for forwards and ``generate`` inside
        the ``with`` block.

        Args:
            names: one entry per batch row, in batch order. A ``generate`` that expands rows in place
                (``num_return_sequences``, beams) applies each name to its row's copies.
            seq_lens: only for packed (padding-free) inputs: tokens per sequence in the flattened order;
                every forward in the block must then have ``sum(seq_lens)`` tokens.

        Contexts nest (the innermost wins). The batch infos built inside are released on exit.
        """
        self._require_attached()
        with self._active(self._selector.make(names, seq_lens), keep=False):
            yield self

    @contextlib.contextmanager
    def step(self, names: Sequence[str | None], seq_lens: Sequence[int] | None = None, *,
             padding: torch.Tensor | None = None) -> Iterator[MoELoRAHandle]:
        """Like :meth:`adapters`, for a serving loop's steps: one selection lives across steps, and its
        batch infos (one per token count) are rebuilt in place each step (``prepare_batch(..., out=)``)
        instead of allocated. On exit they release their slots, so between steps nothing keeps an
        adapter from LRU eviction. One serving loop per handle: its steps do not nest or overlap.

        ``padding``: a bool tensor with one entry per token of the step's forward (rows flattened), True
        for filler tokens whose outputs nobody reads (the left padding of prompts of different lengths
        run as one batch): the MoE layers route them to no expert, so they cost no expert work. Their own
        hidden states then differ from an unpadded run's; every other token's are unchanged as long as
        the attention mask hides the filler from them."""
        self._require_attached()
        if padding is not None and (not isinstance(padding, torch.Tensor) or padding.dtype != torch.bool
                                    or padding.dim() != 1):
            got = f"{padding.dtype} {tuple(padding.shape)}" if isinstance(padding, torch.Tensor) else padding
            raise TypeError(f"padding must be a 1-D bool tensor (one entry per token), got {got!r}")
        fresh = self._selector.make(names, seq_lens)
        fresh.padding = padding
        with self._selector.lock:
            if self._step_selection is None:
                self._step_selection = fresh
            else:
                self._step_selection.retarget(fresh)
        with self._active(self._step_selection, keep=True):
            yield self

    @contextlib.contextmanager
    def _active(self, sel: _Selection, *, keep: bool) -> Iterator[None]:
        """``sel`` is the innermost choice inside the block; its batch infos release their slots on exit
        (and are forgotten unless ``keep``)."""
        with self._selector.lock:
            self._selector.stack.append(sel)
        try:
            yield
        finally:
            with self._selector.lock:
                if sel in self._selector.stack:
                    self._selector.stack.remove(sel)
                sel.release(keep=keep)

    def set_adapters(self, names: Sequence[str | None] | None, seq_lens: Sequence[int] | None = None) -> None:
        """Like :meth:`adapters`, but in effect until changed (``None`` = base model again) outside any
        ``with handle.adapters(...)`` block."""
        self._require_attached()
        sel = None if names is None else self._selector.make(names, seq_lens)
        with self._selector.lock:
            if self._selector.default is not None:
                self._selector.default.release()
            self._selector.default = sel

    def batch_infos_built(self) -> int:
        """How many batch infos the active selection has built (one per distinct token count)."""
        sel = self._selector.active()
        return 0 if sel is None else sel.builds

    # ---------------------------------------------------------------------------------------------- detach

    def detach(self) -> None:
        """Puts the original experts modules back (the model computes exactly what it did before attach),
        removes the forward pre-hook and releases the active selections. The pool stays usable through
        :attr:`pool`; a pool created by :func:`attach` has its loader thread stopped. Idempotent."""
        if not self._attached:
            return
        self._selector.clear()
        if self._step_selection is not None:
            self._step_selection.release()
            self._step_selection = None
        for _, _, parent, original, attr in self._sites:
            setattr(parent, attr, original)
        for hook in self._hooks:
            hook.remove()
        self._attached = False
        if self._loader is not None:
            self._loader.shutdown(wait=True)
        if self._owns_pool:
            for pool in self.pools.values():
                pool.close()

    def __enter__(self) -> MoELoRAHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # ---------------------------------------------------------------------------------------------- internals

    def _require_attached(self) -> None:
        if not self._attached:
            raise RuntimeError("this MoELoRAHandle is detached")

    def _check_rows(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        sel = self._selector.active()
        if sel is None or not sel.any_adapter or sel.seq_lens is not None:
            return
        rows = _rows_of(args, kwargs)
        if rows is not None and rows % len(sel.names):
            raise ValueError(
                f"the model got a batch of {rows} rows but handle.adapters names {len(sel.names)} "
                f"({list(sel.names)}): give one name per batch row"
            )


# --------------------------------------------------------------------------------------------------
# attach
# --------------------------------------------------------------------------------------------------


def attach(
    model: nn.Module,
    pool: MoELoRAMemoryPool | None = None,
    *,
    max_loras: int = 8,
    max_rank: int = 64,
    max_cpu_loras: int = 0,
    path: str = "auto",
    verify: bool | None = None,
    cuda_graphs: bool = True,
    graph_max_tokens: int = 64,
    base_experts: str = "auto",
    dequantize_mxfp4: bool = False,
) -> MoELoRAHandle:
    """Swaps every routed-experts module of a transformers-5 MoE ``model`` for a :class:`MoELoRAExperts`
    and returns the :class:`MoELoRAHandle`.

    Args:
        model: a transformers-5 MoE model (``...ForCausalLM`` or its decoder), on its final device and
            dtype (the pool is created there; move the model before attaching).
        pool: an existing pool to use; it must match the experts' E, H, I, dtype and hold every MoE layer
            id. ``None``: a :class:`moelora.MoELoRAMemoryPool` is created from the expert tensors
            (E, H, I, the model's MoE layer ids, their dtype and device).
        max_loras, max_rank, max_cpu_loras: sizes of the created pool (ignored with ``pool``).
        path: ``FusedMoEWithLoRA`` path ("auto", "fused", "split", "staged", "torch").
        verify: run each experts module against the §1 formula on random tokens before swapping it;
            ``None`` (default): only for classes not in :data:`KNOWN_EXPERTS_CLASSES` and not
            transformers' ``FP8Experts`` (whose forward needs transformers' hub kernels to run).
        cuda_graphs: each MoE layer replays its forward from a CUDA graph per token count of at most
            ``graph_max_tokens`` (default 64: decode steps, every one after the first two of a batch size;
            prompts run eagerly, so each prompt length does not keep buffers of its own in every layer),
            instead of planning and launching its kernels on every call
            (``FusedMoEWithLoRA(cuda_graphs=True)``); ``False``: eager.
        base_experts: what runs a step inside an adapter context in which no row has an adapter (a
            server's step of base-model requests): ``"kernels"`` (the layer's fused MoE, as rows with
            adapters do), ``"model"`` (the model's own experts module: exactly the model's numbers), or
            ``"auto"`` (default): the kernels on CUDA, where they are faster than transformers' own experts
            loop, the model's module elsewhere. Outside any adapter context the model's own module runs.
        dequantize_mxfp4: MXFP4 experts (gpt-oss) are served packed by default, the GEMMs decoding them in
            their K-loops (in place for ``load_packed_gpt_oss``'s experts; for transformers' hub module, its
            bytes once more beside the hub's swizzled tensors); ``True`` serves a bf16 copy decoded at
            attach instead (about four times the MXFP4 bytes).

    Raises:
        UnsupportedModelError: a MoE layer that cannot be served exactly (the message says why), or no fused
            experts module at all. Nothing is swapped then.
        ValueError: a pool that does not fit, an unknown path, or a model already attached.
    """
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if base_experts not in ("auto", "kernels", "model"):
        raise ValueError(f"base_experts must be 'auto', 'kernels' or 'model', got {base_experts!r}")
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and hasattr(module, "base_layer"):
            raise UnsupportedModelError(
                f"{type(model).__name__} is wrapped by PEFT ({name or 'the model'} is a "
                f"{type(module).__name__}); attach to the plain base model and load the adapters with "
                "handle.load_adapter"
            )
    found = find_experts_modules(model)
    if not found:
        stacked = next((n for n, m in model.named_modules()
                        if all(isinstance(getattr(m, w, None), torch.Tensor) and getattr(m, w).dim() == 2
                               for w in ("w1", "v1", "w2"))), None)
        if stacked is not None:
            raise UnsupportedModelError(
                f"{type(model).__name__} stores its experts as stacked 2-D matrices ({stacked!r}: w1, v1, w2 "
                "(E*I, H), DBRX) that no fused routed-experts module holds; not supported")
        raise UnsupportedModelError(
            f"{type(model).__name__} has no fused routed-experts module (gate_up_proj (E, 2I, H) and "
            "down_proj (E, H, I) parameters, transformers 5); experts as one module each (nn.Linear pairs, "
            "transformers 4 and the encoder-decoder Switch Transformers / NLLB-MoE) and dense models are not "
            "supported"
        )
    sites: list[tuple[str, int, nn.Module, nn.Module, str]] = []
    activations: dict[str, str | GatedActivation] = {}
    parallel: dict[str, tuple[int, int, object] | None] = {}
    views: dict[str, nn.Module] = {}
    for name, lid, block in found:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if _is_mxfp4_hub(block) and type(parent).__name__ != "Mxfp4GptOssMLP":  # before dequantizing
            raise UnsupportedModelError(
                f"experts module {name!r}: MXFP4 experts under a {type(parent).__name__}, not transformers' "
                "Mxfp4GptOssMLP (which sends its routes through the experts' forward once they are swapped): "
                "this transformers runs them through its hub kernels' routing; load the model with "
                "quantization_config=Mxfp4Config(dequantize=True) and attach that"
            )
        module = views[name] = _experts_view(name, block, _activation_dtype(model),
                                             dequantize_mxfp4=dequantize_mxfp4)
        activations[name] = _check_supported(name, module, parent)
        parallel[name] = _sharding_of(name, module, model)
        if parallel[name] is None and getattr(module, "_is_expert_parallel", False):
            raise UnsupportedModelError(f"experts module {name!r} ({type(module).__name__}) is marked "
                                      "expert-parallel but its tensors are not DTensors moelora can read the "
                                      "shard of")
        known = (type(module).__name__ in KNOWN_EXPERTS_CLASSES or type(module).__name__ == _FP8_EXPERTS_CLASS
                 or isinstance(module, _DequantizedMxfp4Experts))  # its forward is the layer's torch path
        if parallel[name] is None and (verify or (verify is None and not known)):
            _verify_math(name, module, activations[name])
        sites.append((name, lid, parent, block, attr))
    layouts = {p[0] if p else None for p in parallel.values()}
    if len(layouts) > 1:
        raise UnsupportedModelError(f"MoE layers sharded differently ({sorted(map(str, layouts))}); one pool "
                                  "holds one layout")
    sharding = next(iter(parallel.values()))
    group = sharding[1] if sharding is not None else None

    # The expert sets: one for most models; a layer may hold several, chosen per token by a token-type mask
    # (ERNIE-4.5-VL's text and vision experts), each served from a pool of its own (its own I).
    expert_sets: dict[str, list[str]] = {}
    for name, lid, _ in found:
        expert_sets.setdefault(_expert_set_of(name, lid), []).append(name)
    several = len(expert_sets) > 1
    token_types: dict[int, tuple[nn.Module, _TokenTypes]] = {}
    marked: dict[str, bool] = {}
    if several:
        if pool is not None:
            raise ValueError(f"the model's layers hold {len(expert_sets)} expert sets "
                             f"({', '.join(expert_sets)}) served from a pool each: attach creates them, give "
                             "no pool")
        if sharding is not None:
            raise UnsupportedModelError("several expert sets per layer are served unsharded")
        for name, lid, _ in found:
            block, marked[name] = _token_type_block(model, name)
            if lid not in token_types:
                token_types[lid] = (block, _TokenTypes())

    pools: dict[str, MoELoRAMemoryPool] = {}
    owns_pool = pool is None
    try:
        _make_pools(pools, pool, expert_sets, views, found, several, sharding, model, max_loras, max_rank,
                    max_cpu_loras)
        selector = _Selector(pools)
        modules: dict[str, MoELoRAExperts] = {}
        for name, lid, _parent, _module, _attr in sites:  # build all before swapping any
            set_name = _expert_set_of(name, lid)
            modules[name] = MoELoRAExperts(
                views[name], pool=pools[set_name], layer_id=lid, activation=activations[name], path=path,
                selector=selector, cuda_graphs=cuda_graphs, graph_max_tokens=graph_max_tokens,
                process_group=group, expert_set=set_name if several else None,
                token_types=token_types[lid][1] if several else None, marked_tokens=marked.get(name, False),
                base_on_kernels=base_experts == "kernels" or (
                    base_experts == "auto" and pools[set_name].device.type == "cuda"),
            )
    except BaseException:
        if owns_pool:
            for created in pools.values():
                created.close()
        raise
    for name, _lid, parent, _module, attr in sites:
        setattr(parent, attr, modules[name])
    hooks = [block.register_forward_pre_hook(types.record, with_kwargs=True)
             for block, types in token_types.values()]
    return MoELoRAHandle(model, pools, sites, modules, selector, owns_pool, hooks)


def _make_pools(pools: dict[str, MoELoRAMemoryPool], pool: MoELoRAMemoryPool | None,
                expert_sets: dict[str, list[str]], views: dict[str, nn.Module],
                found: list[tuple[str, int, nn.Module]], several: bool,
                sharding: tuple[MoEShard, object] | None, model: nn.Module, max_loras: int, max_rank: int,
                max_cpu_loras: int) -> None:
    """Fills ``pools`` (expert set -> pool): each set's experts checked for one shape, dtype, device and
    layout; a pool created per set, or the given ``pool`` checked against the one set."""
    shard = sharding[0] if sharding is not None else None
    for set_name, names in expert_sets.items():
        first = views[names[0]]
        shape, dtype, device = _expert_shape(first), first.down_proj.dtype, first.down_proj.device
        layout = _expert_layout(first)
        if several:
            layout = dataclasses.replace(layout, expert_set=set_name)
        fp8 = dtype == torch.float8_e4m3fn
        if fp8 and sharding is not None:
            raise UnsupportedModelError("FP8 experts sharded by a tensor- or expert-parallel plan are not "
                                        "served yet (their block scales would need sharding too)")
        for name in names[1:]:
            module = views[name]
            w2 = module.down_proj
            if _expert_shape(module) != shape:
                raise UnsupportedModelError(
                    f"MoE layers of different shapes ({names[0]}: {shape}, {name}: {_expert_shape(module)}); "
                    "one pool holds one (E, H, I)"
                )
            if w2.dtype != dtype or w2.device != device:
                raise UnsupportedModelError(
                    f"experts on different dtypes/devices ({names[0]}: {dtype} {device}, {name}: {w2.dtype} "
                    f"{w2.device}); the pool lives on one device with one dtype"
                )
            if _expert_layout(module) != _expert_layout(first):
                raise UnsupportedModelError(
                    f"MoE layers stored differently ({names[0]}: {_storage_of(first)}, {name}: "
                    f"{_storage_of(module)}); one pool reads one adapter layout"
                )
        num_experts, two_i, hidden = shape
        layer_ids = [lid for name, lid, _ in found if name in names]
        if pool is None:
            pools[set_name] = MoELoRAMemoryPool(
                num_experts=num_experts, hidden_size=hidden, intermediate_size=two_i // 2,
                layer_ids=layer_ids, max_loras=max_loras, max_rank=max_rank,
                dtype=_activation_dtype(model) if fp8 else dtype, device=device, max_cpu_loras=max_cpu_loras,
                shard=shard, expert_layout=layout,
            )
            continue
        got = (pool.num_experts, pool.hidden_size, pool.intermediate_size)
        want = (num_experts, hidden, two_i // 2) if shard is None else (
            shard.local_num_experts, hidden, shard.local_intermediate_size)
        if got != want or _shard_layout(pool.shard) != _shard_layout(shard):
            raise ValueError(f"the pool has (E, H, I) = {got} (shard {pool.shard}), the model's experts on "
                             f"this rank {want} (shard {shard})")
        if pool.expert_layout != layout:
            raise ValueError(f"the pool reads adapters as {pool.expert_layout}, the model's experts need "
                             f"{layout} ({_storage_of(first)})")
        missing = [lid for lid in layer_ids if lid not in pool.layer_ids]
        if missing:
            raise ValueError(
                f"the pool has no buffers for MoE layers {missing} (pool layer_ids {list(pool.layer_ids)})"
            )
        pools[set_name] = pool
