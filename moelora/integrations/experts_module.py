"""The swapped experts module: :class:`MoELoRAExperts` runs :class:`moelora.FusedMoEWithLoRA` on a
transformers experts module's own tensors, each token with its adapter."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moelora.activations import GatedActivation
from moelora.integrations.families import (
    _dense_form,
    _dense_routing,
    _DequantizedMxfp4Experts,
    _expert_biases,
    _expert_shape,
    _expert_weights,
    _identity_experts,
    _identity_term,
    _model_module,
    _PackedMxfp4Experts,
    _per_pair,
    _post_expert_norm,
    _RoutedBlockExperts,
    _TokenTypes,
)
from moelora.integrations.selection import _Selector
from moelora.layer import FusedMoEWithLoRA, fp8_scales_of
from moelora.pool import MoELoRAMemoryPool

__all__ = ["MoELoRAExperts"]


class MoELoRAExperts(nn.Module):
    """Drop-in replacement of a transformers-5 routed-experts module that adds each token's adapter.

    Holds the original module's ``gate_up_proj`` and ``down_proj`` (the same ``nn.Parameter`` objects,
    registered under the same names, so ``state_dict()`` is unchanged) and runs
    :class:`moelora.FusedMoEWithLoRA` on them with the pool's layer ``layer_id``. ``forward`` has the
    original signature ``(hidden_states (M, H), top_k_index (M, k), top_k_weights (M, k)) -> (M, H)``.
    When no adapter is selected for any token it calls the original module (exactly the base output).

    Attributes:
        layer_id: the model's own index of this MoE layer (as in PEFT keys).
        original: the module this one replaced (restored by :meth:`MoELoRAHandle.detach`).
        layer: the :class:`moelora.FusedMoEWithLoRA` (routed_scaling_factor 1: the router already
            applied it where the family has one, e.g. DeepSeek-V3).
    """

    def __init__(
        self,
        original: nn.Module,
        *,
        pool: MoELoRAMemoryPool,
        layer_id: int,
        activation: str | GatedActivation,
        path: str,
        selector: _Selector,
        cuda_graphs: bool = False,
        graph_max_tokens: int = 64,
        process_group: object | None = None,
        expert_set: str | None = None,
        token_types: _TokenTypes | None = None,
        marked_tokens: bool = False,
        base_on_kernels: bool = False,
    ) -> None:
        super().__init__()
        # Rows without adapter run the layer's kernels (True) or the model's own experts module (False).
        self.base_on_kernels = base_on_kernels
        # One of several expert sets of its layer (ERNIE-4.5-VL): its pool, and the tokens it gets.
        self.expert_set = expert_set
        object.__setattr__(self, "_token_types", token_types)
        self.marked_tokens = marked_tokens
        # The original's parameters under their own names (gate_up_proj or up_proj, down_proj, biases): the
        # same objects, so state_dict() keys and tensors are unchanged.
        source = _model_module(original)
        for pname, param in source.named_parameters(recurse=False):
            self.register_parameter(pname, param)
        for cname, child in source.named_children():  # e.g. a post-expert norm with its weight
            self.add_module(cname, child)
        self.routed_block = isinstance(original, _RoutedBlockExperts)
        # Dequantized MXFP4 experts: the packed module's forward needs the hub kernels, so the layer runs
        # the base rows too; and transformers' Mxfp4GptOssMLP sends the routes through this module's
        # forward (its router, then experts(hidden, indices, scores)) only when the experts are hooked.
        self.dequantized = isinstance(original, _DequantizedMxfp4Experts)
        if self.dequantized:
            self._is_hooked = True
        self.num_experts, two_i, self.hidden_dim = _expert_shape(original)
        self.identity_experts = _identity_experts(original)
        self.dense = _dense_form(original)
        self.post_expert_norm = _post_expert_norm(original)  # the model's own module (a child, as there)
        self.intermediate_dim = two_i // 2
        self.layer_id = int(layer_id)
        # Not registered as submodules: the original stays out of the module tree (and state_dict), and
        # the layer holds the same Parameters (its own registration of them must not add state_dict keys).
        object.__setattr__(self, "original", original)
        (w13, w2), parallel = _expert_weights(original), {}
        w13_bias, w2_bias = _expert_biases(original)
        if w13_bias is not None or w2_bias is not None:
            parallel.update(w13_bias=w13_bias, w2_bias=w2_bias)
        if process_group is not None:
            # This rank's part of gate/up and down (views of the DTensors' local shards, its I share or its
            # experts); the layer all-reduces its partial output over the group, as the plan's own
            # moe_tp_experts / AllReduceEP does for the original module.
            w13, w2 = w13.to_local().detach(), w2.to_local().detach()
            parallel = dict(process_group=process_group, reduce_results=True)
        if isinstance(original, _PackedMxfp4Experts):
            parallel["mxfp4"] = original.mxfp4
        if w13.dtype == torch.float8_e4m3fn:
            # transformers runs FP8 experts through its hub kernels; the layer serves base rows too.
            parallel["fp8"] = fp8_scales_of(original, "gate_up_proj", "down_proj")
        object.__setattr__(
            self,
            "layer",
            FusedMoEWithLoRA(
                w13, w2, pool=pool, layer_id=layer_id, routed_scaling_factor=1.0, activation=activation,
                path=path, cuda_graphs=cuda_graphs, graph_max_tokens=graph_max_tokens, **parallel,
            ),
        )
        object.__setattr__(self, "_selector", selector)

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor | None = None,
        top_k_weights: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        """``sum_k w_k * W2'(act(W_gate' x) * W_up' x)`` with each token's adapter (docs/design.md §1). The
        dense form (Llama-4) takes ``hidden_states`` alone, every expert's rows stacked, and returns each
        row's expert output."""
        if self.routed_block:
            return self._block_forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        hidden = hidden_states.shape[-1]
        num_tokens = hidden_states.numel() // hidden if hidden else 0
        copies = self.num_experts if self.dense else 1
        if num_tokens % copies:
            raise ValueError(f"the dense experts module got {num_tokens} rows, not {copies} experts' rows of "
                             "the same tokens")
        # With a post-expert norm the layer runs each routed pair as a row of its own (its token's adapter).
        repeat = top_k_index.shape[-1] if self.post_expert_norm is not None and top_k_index is not None else 1
        token_rows = None if self._token_types is None else self._token_types.rows_of(self.marked_tokens)
        batch = self._selector.batch_for(num_tokens // copies, copies=copies, repeat=repeat,
                                         expert_set=self.expert_set, token_rows=token_rows)
        # Outside any adapter context the model is the model: its own experts module, whatever base_experts.
        if ((batch is None or not batch.has_lora) and self.layer.fp8 is None and not self.dequantized
                and (not self.base_on_kernels or self._selector.active() is None)):
            if self.dense:
                return self.original(hidden_states, *args, **kwargs)
            return self.original(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        if self.dense and (top_k_index is not None or top_k_weights is not None):
            raise TypeError(f"{type(self.original).__name__}.forward takes hidden_states alone (the dense "
                            "form)")
        if args or kwargs:
            raise TypeError(
                f"MoELoRAExperts.forward takes (hidden_states, top_k_index, top_k_weights) only, got extra "
                f"{len(args)} positional and {sorted(kwargs)} keyword arguments"
            )
        hidden_states, top_k_index, top_k_weights = (t.to_local() if hasattr(t, "to_local") else t
                                                     for t in (hidden_states, top_k_index, top_k_weights))
        x = hidden_states.reshape(num_tokens, hidden)
        if self.dense:
            weights, ids = _dense_routing(x, self.num_experts)
        else:
            weights, ids = top_k_weights.reshape(num_tokens, -1), top_k_index.reshape(num_tokens, -1)
            selection = self._selector.active()
            padding = None if selection is None else selection.padding
            if padding is not None and padding.numel() == num_tokens:
                # Tokens whose outputs nobody reads (a padded batch's filler) route to no expert: no work.
                ids = ids.masked_fill(padding.view(num_tokens, 1), -1)
        lora_batch = batch if batch is not None and batch.has_lora else None
        if self.post_expert_norm is not None:
            def run(rows: torch.Tensor, w: torch.Tensor, pair_ids: torch.Tensor) -> torch.Tensor:
                return self.layer(rows, w, pair_ids, lora_batch)

            out = _per_pair(run, x, ids, weights, self.post_expert_norm)
        else:
            out = self.layer(x, weights, ids, lora_batch)
        if self.identity_experts:  # the layer skips ids past its experts; they return their input
            out = out + _identity_term(x, ids, weights.to(out.dtype), self.num_experts)
        return out.reshape(hidden_states.shape)

    def _block_forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """A routed block's forward (JetMoE): its router, then the experts with each token's adapter, then
        its output bias."""
        block = self.original.block
        hidden = hidden_states.shape[-1]
        num_tokens = hidden_states.numel() // hidden if hidden else 0
        batch = self._selector.batch_for(num_tokens)
        if batch is None or not batch.has_lora:
            return block(hidden_states, *(a for a in args if a is not None), **kwargs)
        if any(a is not None for a in args) or kwargs:
            raise TypeError(f"{type(block).__name__}.forward takes the hidden states alone")
        x = hidden_states.reshape(num_tokens, hidden)
        weights, ids = self.original.route(x)
        out = self.layer(x, weights, ids, batch) + block.bias
        return out.reshape(hidden_states.shape)

    def extra_repr(self) -> str:
        return (
            f"{type(self.original).__name__}, layer_id={self.layer_id}, experts={self.num_experts}, "
            f"hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
            f"activation={self.layer.activation}, path={self.layer.path}"
        )
