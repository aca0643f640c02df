"""``FusedMoEWithLoRA``: one MoE layer that adds every token's own adapter delta (docs/design.md §1).

Paths (``path=``):
  "fused"   all-in-one: the LoRA shrink runs inside the base GEMMs (the activation tile is already
            loaded), the expands in their epilogues; the same launches as the base fused MoE.
  "split"   each shrink once per routed pair (``moe_lora_a``), the expands in the base GEMMs'
            epilogues: two launches more than the base path at prefill, no shrink recomputed per N
            tile; at decode the gate/up shrink rides in the alignment's launch and (few GEMM1 N tiles)
            the down shrink in GEMM1's epilogue: the base path's launches.
  "staged"  separate shrink, gate_up-expand+activation and down+combine kernels around the base GEMMs.
  "torch"   the vectorised PyTorch path (what CPU tensors use when Triton is not interpreting).
  "auto"    torch for CPU tensors outside the Triton interpreter, else split, or staged for prefill
            steps of many adapters (``triton_ops.plan.auto_lora_path``).
A batch in which no token has an adapter (known on the host from ``prepare_batch``) runs the base path.
Nothing in ``forward`` reads a device value on the host, so it can be captured in a CUDA graph for a
fixed token count (replay with a new token->adapter mapping via ``pool.prepare_batch(..., out=batch)``).
"""

from __future__ import annotations

import dataclasses
import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from moelora.activations import GatedActivation, as_gated_activation
from moelora.batch_info import MoELoRABatchInfo
from moelora.pool import MoELoRAMemoryPool
from moelora.torch_path import moe_lora_forward_torch
from triton_ops.configs import env_switch
from triton_ops.fused_experts import MoELoRAInputs, fused_experts
from triton_ops.hostmath import next_power_of_2
from triton_ops.launch import LaunchCache, launch_hooks_idle
from triton_ops.plan import auto_lora_path, auto_path_needs_trained_share

if TYPE_CHECKING:
    from triton_ops.fp8 import BlockFp8Weights
    from triton_ops.mxfp4 import Mxfp4Weights

PATHS = ("auto", "fused", "split", "staged", "torch")


def _triton_can_run(x: torch.Tensor) -> bool:
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


class FusedMoEWithLoRA(nn.Module):
    """Routed experts of one MoE layer with per-token LoRA adapters from a ``MoELoRAMemoryPool``.

    Args:
        w13: (E, 2I, H) base gate (rows [0, I)) and up (rows [I, 2I)) weights, or a (E, 2, I, H) view whose
            dim 1 picks the gate or up half (layouts no (E, 2I, H) view has: gpt-oss' interleaved columns,
            an ungated up projection standing as both halves); shared, not copied; any strides.
        w2: (E, H, I) base down weights; shared, not copied.
        pool: the adapter pool; ``layer_id`` (the model's own layer index) must be one of its layers.
        routed_scaling_factor: rsf of docs/design.md §1 (DeepSeek-V3: 2.5 unless the router already applied
            it).
        activation: the gated activation: "silu" (default), "gelu" (exact), "gelu_tanh", or a
            :class:`moelora.activations.GatedActivation` (the clamped SwiGLUs of gpt-oss-style families).
        apply_router_weight_on_input: scale x by the routing weight before GEMM1 (top-1 models, Llama-4).
        w13_bias, w2_bias: (E, 2I) (gate then up) and (E, H) expert biases in the activations' dtype, or
            None (gpt-oss has them): ``gu = W13 x + b13`` before the activation, ``y = W2 h + b2`` inside
            the routed weight, each with its LoRA delta.
        path: "auto", "fused", "split", "staged" or "torch" (see the module docstring).
        fp8: block scales of float8_e4m3fn ``w13``/``w2`` (``triton_ops.fp8.BlockFp8Weights``): the base
            GEMMs run W8A8 (x and h quantized per token and 128-column group), the LoRA stays in the pool's
            dtype and reads x and h unquantized; path "fused" is refused (its shrink reads the GEMM's x).
        mxfp4: the E8M0 scales of MXFP4 experts (``triton_ops.mxfp4.Mxfp4Weights``): ``w13`` / ``w2`` are
            then their packed uint8 E2M1 blocks, (E, 2I, H / 2) (or its halves view) and (E, H, I / 2), which
            the GEMMs decode in their K-loops (W4A16: x, h and the LoRA in the pool's dtype). The torch path
            decodes a dense copy once. One device (no tensor or expert parallelism).
        process_group, reduce_results: a tensor- or expert-parallel layer (a pool with a
            ``moelora.parallel.MoEShard``; w13/w2 the shard's part, ``shard.split_weights``) returns this
            rank's partial output; with ``reduce_results`` it all-reduces it over ``process_group`` (the
            ranks that hold the other parts), so every rank returns the whole layer's output.
        cuda_graphs: replay eager calls from CUDA graphs, one per token count and adapter mix (see below).
        graph_max_tokens: calls of more tokens than this always run eagerly (prefill: each prompt length
            would be a graph of its own, with its own intermediate buffers).
        max_graphs: graphs kept at most; past it the least recently replayed one is dropped (with its
            buffers) and captured again if its key comes back.

    With ``cuda_graphs``, the second call of a (token count, dtypes, adapter mix) on CUDA captures the
    forward in a CUDA graph and later calls replay it: the inputs are copied into the graph's buffers, the
    batch is still checked against the pool on the host first, and the output is a fresh tensor. Token
    counts share graphs by the next power of two (at most ``graph_max_tokens``): a call of 5 tokens replays
    the graph of 8, whose 3 extra rows route to no expert and cost no expert work; the adapter mix counts
    by its rank tile and its adapter count as the launches see them (``launch_adapter_count``). A server
    whose batch size and adapters change every step so meets a few graphs, not one per step. The graph
    reads the adapter slots at replay, so adapters loaded into them later are used (a batch refreshed with
    ``prepare_batch(..., out=)``). Calls made while the stream is already being captured run eagerly
    (the outer capture records them). A call's host time is then a few copies and a graph launch, instead
    of the planning and launches of each kernel.

    The layer keeps its launch decisions and compiled-kernel lookups in ``launch_cache``
    (``triton_ops.launch.LaunchCache``), made once per token count and adapter mix, so an eager call pays
    only for what depends on its inputs. The launch overrides (``triton_ops.overrides``) are read the first
    time a token count is seen; ``launch_cache.clear()`` makes the next calls read them again.
    """

    def __init__(
        self,
        w13: torch.Tensor,
        w2: torch.Tensor,
        *,
        pool: MoELoRAMemoryPool,
        layer_id: int,
        routed_scaling_factor: float = 1.0,
        activation: str | GatedActivation = "silu",
        apply_router_weight_on_input: bool = False,
        path: str = "auto",
        cuda_graphs: bool = False,
        graph_max_tokens: int = 512,
        max_graphs: int = 32,
        process_group: object | None = None,
        reduce_results: bool = False,
        fp8: BlockFp8Weights | None = None,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
        mxfp4: Mxfp4Weights | None = None,
    ) -> None:
        super().__init__()
        if reduce_results and process_group is None:
            raise ValueError("reduce_results=True needs the process_group to all-reduce over (the group of "
                             "the tensor- and expert-parallel ranks that share this layer)")
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        for name, value in (("graph_max_tokens", graph_max_tokens), ("max_graphs", max_graphs)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        from triton_ops.moe_inputs import gate_up_dims, is_gate_up_halves

        per_byte = 2 if mxfp4 is not None else 1  # MXFP4: two values a stored byte along K
        expected = (pool.num_experts, 2 * pool.intermediate_size, pool.hidden_size // per_byte)
        layout, halves = ("(E, 2I, H)", "(E, 2, I, H)") if per_byte == 1 else \
            ("(E, 2I, H / 2) uint8 MXFP4 blocks", "(E, 2, I, H / 2)")
        if not isinstance(w13, torch.Tensor) or (w13.dim() != 3 and not is_gate_up_halves(w13)) or \
                gate_up_dims(w13) != expected:
            raise ValueError(f"w13 must be {layout} = {expected}, or its {halves} halves view, to match the "
                             f"pool, got {tuple(getattr(w13, 'shape', ()))}")
        expected_w2 = (pool.num_experts, pool.hidden_size, pool.intermediate_size // per_byte)
        if tuple(w2.shape) != expected_w2:
            layout = "(E, H, I)" if per_byte == 1 else "(E, H, I / 2)"
            raise ValueError(f"w2 must be {layout} = {expected_w2} to match the pool, got {tuple(w2.shape)}")
        from triton_ops.fp8 import check_block_fp8, uses_block_fp8
        from triton_ops.mxfp4 import check_mxfp4_experts

        if mxfp4 is not None:
            if fp8 is not None:
                raise ValueError("pass fp8= or mxfp4=, not both: the experts are in one format")
            check_mxfp4_experts(w13, w2, mxfp4)
            if pool.shard is not None or process_group is not None:
                raise ValueError("MXFP4 experts are served on one device: shard the model's bf16 experts "
                                 "for tensor or expert parallelism")
        elif fp8 is not None or uses_block_fp8(w13, w2):
            check_block_fp8(w13, w2, fp8)
            if path == "fused":
                raise ValueError("FP8 experts take path 'auto', 'split', 'staged' or 'torch': the fused "
                                 "path's LoRA shrink would read the FP8 copy of x (docs/design.md §1)")
        elif w13.dtype != pool.dtype or w2.dtype != pool.dtype:
            raise TypeError(f"w13/w2 must have the pool's dtype {pool.dtype}, got {w13.dtype}/{w2.dtype}")
        if w13.device.type != torch.device(pool.device).type or w2.device.type != w13.device.type:
            raise ValueError(f"w13/w2 are on {w13.device}/{w2.device} but the pool is on {pool.device}")
        biases = (("w13_bias", w13_bias, expected[:2]), ("w2_bias", w2_bias, expected_w2[:2]))
        for name, bias, shape in biases:
            if bias is None:
                continue
            if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != shape:
                got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
                raise ValueError(f"{name} must be a tensor of shape {shape}, got {got}")
            float_dtypes = (torch.float32, torch.float16, torch.bfloat16)
            if bias.dtype not in float_dtypes or bias.device.type != w13.device.type:
                raise TypeError(f"{name} must be a float tensor on {w13.device}, got {bias.dtype} on "
                                f"{bias.device}")
        sharded = pool.shard is not None or process_group is not None
        if (w13_bias is not None or w2_bias is not None) and sharded:
            raise ValueError("expert biases are served on one device: a tensor- or expert-parallel layer "
                             "would add the down bias once per rank (serve the model unsharded)")
        self.buffers_ = pool.layer(layer_id)
        self.pool = pool
        self.layer_id = layer_id
        self.w13 = w13
        self.w2 = w2
        self.fp8 = fp8
        self.mxfp4 = mxfp4
        self._mxfp4_dense: tuple[torch.Tensor, torch.Tensor] | None = None  # the torch path's decoded copy
        self.w13_bias = w13_bias
        self.w2_bias = w2_bias
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.activation = as_gated_activation(activation)
        self.apply_router_weight_on_input = apply_router_weight_on_input
        self.path = path
        self.launch_cache = None  # a triton_ops.launch.LaunchCache once a Triton path has run
        self.cuda_graphs = bool(cuda_graphs)
        self.graph_max_tokens = graph_max_tokens
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[tuple, _GraphedCall] = OrderedDict()
        self._graph_keys_seen: set[tuple] = set()
        # (batch max rank, adapters in the batch) -> _lora_hints' answer: asked on every call, a handful of
        # distinct answers.
        self._lora_hints_memo: dict[tuple[int, int], tuple[int, int]] = {}
        self.process_group = process_group
        self.reduce_results = bool(reduce_results)
        # Expert-parallel pool: global expert id -> local index, -1 for another rank's expert, and -1 again
        # at index E for an id outside [0, E) (clamped to -1 or E before the lookup).
        self._expert_map = None
        if pool.expert_map is not None:
            self._expert_map = torch.cat([pool.expert_map, pool.expert_map.new_full((1,), -1)])

    @classmethod
    def from_base(
        cls, base: nn.Module, *, pool: MoELoRAMemoryPool, layer_id: int, **kwargs
    ) -> FusedMoEWithLoRA:
        """Wrap a base fused-MoE module, sharing its weights: SGLang/vLLM style (``w13_weight``,
        ``w2_weight``) or transformers 5 experts (``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I)).
        FP8 experts (float8_e4m3fn weights with ``<name>_scale_inv`` block scales and ``block_size``, as
        transformers' fine-grained ``FP8Experts`` holds them) come with their scales as ``fp8=``."""
        for w13_name, w2_name in (("w13_weight", "w2_weight"), ("gate_up_proj", "down_proj"), ("w13", "w2")):
            w13 = getattr(base, w13_name, None)
            w2 = getattr(base, w2_name, None)
            if isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor):
                kwargs.setdefault("routed_scaling_factor", getattr(base, "routed_scaling_factor", 1.0) or 1.0)
                if torch.float8_e4m3fn in (w13.dtype, w2.dtype) and "fp8" not in kwargs:
                    kwargs["fp8"] = fp8_scales_of(base, w13_name, w2_name)
                return cls(w13.data, w2.data, pool=pool, layer_id=layer_id, **kwargs)
        raise TypeError(
            f"{type(base).__name__} has no (w13_weight, w2_weight), (gate_up_proj, down_proj) or (w13, w2) "
            "expert tensors to wrap"
        )

    def resolve_path(self, x: torch.Tensor, batch: MoELoRABatchInfo | None = None) -> str:
        """The LoRA path a forward on ``x`` with ``batch`` runs (``self.path`` with "auto" resolved; without
        a batch, as for one adapter)."""
        if self.path == "torch" or not _triton_can_run(x):
            if self.path in ("fused", "split", "staged"):
                raise ValueError(f"path={self.path!r} needs CUDA tensors or TRITON_INTERPRET=1")
            return "torch"
        if self.path != "auto":
            return self.path
        return self._auto_path(x.shape[0], batch)

    def _auto_path(self, rows: int, batch: MoELoRABatchInfo | None) -> str:
        """``triton_ops.plan.auto_lora_path`` for ``rows`` tokens of ``batch`` (host facts only; the trained
        experts are counted only where the rule can turn on them)."""
        if batch is None or not batch.has_lora:
            return auto_lora_path(rows, 1)
        num_adapters = self._lora_hints(batch)[1]
        share = 1.0
        if auto_path_needs_trained_share(rows, num_adapters):
            share = self.pool.trained_experts(batch, self.layer_id) / (
                len(batch.slots_used) * self.pool.num_experts)
        return auto_lora_path(rows, num_adapters, share)

    def forward(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        batch: MoELoRABatchInfo | None = None,
    ) -> torch.Tensor:
        """(M, H) = rsf * sum_k w_k * W2'(act(W_gate' x) * W_up' x) with each token's adapter
        (docs/design.md §1).

        ``batch`` must come from this layer's pool and be current: a batch from another pool, or one
        whose adapter was unloaded or evicted since ``prepare_batch``, is refused (a host-side check).
        A routed pair whose expert id is outside ``[0, E)`` contributes nothing."""
        weights_dtype = self.pool.dtype if self.mxfp4 is not None else self.w13.dtype
        if (isinstance(x, torch.Tensor) and x.is_floating_point() and self.fp8 is None
                and x.dtype != weights_dtype and self.w13.dtype != torch.float8_e4m3fn):
            # Said here, for the layer's user: the kernels' own check would blame the weights. (A
            # non-float x gets the inputs' check, which lists the dtypes x may have.)
            name = str(weights_dtype).removeprefix("torch.")
            raise TypeError(f"x's dtype ({str(x.dtype).removeprefix('torch.')}) differs from the layer's "
                            f"expert weights' dtype ({name}): cast x first, x.to(torch.{name})")
        if batch is None:
            return self._call(x, topk_weights, topk_ids, None)
        # Held until the kernels are queued: a slot write queued by another thread after the check lands
        # after this forward's kernels on the stream, never between the check and them.
        with self.pool.lock:
            self.pool.check_batch(batch)
            return self._call(x, topk_weights, topk_ids, batch)

    def _call(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              batch: MoELoRABatchInfo | None) -> torch.Tensor:
        """The forward, replayed from a CUDA graph where ``cuda_graphs`` allows it (class docstring)."""
        key = self._graph_key(x, topk_weights, topk_ids, batch)
        if key is None:
            return self._forward(x, topk_weights, topk_ids, batch)
        rows = key[0]
        graphed = self._graphs.get(key)
        if graphed is None:
            if key not in self._graph_keys_seen:  # a one-off shape is not worth a graph: eager first
                # Keys seen once are only remembered to spot the second call: forgetting them all now and
                # then bounds the set on a server that sees endless one-off shapes, at worst one more eager
                # call per key.
                if len(self._graph_keys_seen) >= 64 * self.max_graphs:
                    self._graph_keys_seen.clear()
                self._graph_keys_seen.add(key)
                return self._forward(x, topk_weights, topk_ids, batch)
            graphed = _GraphedCall.capture(self, rows, x, topk_weights, topk_ids, batch)
            self._keep_graph(key, graphed)
        else:
            self._graphs.move_to_end(key)
        return graphed.replay(x, topk_weights, topk_ids, batch)

    def _keep_graph(self, key: tuple, graphed: _GraphedCall) -> None:
        """Stores a captured graph, dropping the least recently replayed past ``max_graphs``. A drop waits
        for the stream first (the one host sync of this path, only on eviction): a graph is not destroyed
        while a replay of it may still run."""
        self._graphs[key] = graphed
        if len(self._graphs) > self.max_graphs and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)

    def _graph_key(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   batch: MoELoRABatchInfo | None) -> tuple | None:
        """What a captured forward depends on besides the values it copies in; None: run eagerly."""
        if (not self.cuda_graphs or not x.is_cuda or x.shape[0] == 0 or x.shape[0] > self.graph_max_tokens
                or torch.cuda.is_current_stream_capturing()):
            return None
        if batch is not None and batch.num_tokens != x.shape[0]:
            return None  # _forward raises the mismatch
        has_lora = batch is not None and batch.has_lora
        if has_lora and self.resolve_path(x) == "torch":
            return None
        rows = min(next_power_of_2(x.shape[0]), self.graph_max_tokens)
        # Batches of the same hints may still take different paths at ``rows`` tokens (the experts their
        # adapters train): then the path the capture takes is part of the key.
        lora = None
        if has_lora:
            lora = self._lora_hints(batch)
            if self.path == "auto" and auto_path_needs_trained_share(rows, lora[1]):
                lora = (*lora, self._auto_path(rows, batch))
        return (rows, x.shape[1:], x.dtype, x.device, topk_ids.shape[1:], topk_ids.dtype, topk_weights.dtype,
                topk_weights.shape[1:], lora)

    def _lora_hints(self, batch: MoELoRABatchInfo) -> tuple[int, int]:
        """The largest rank and the adapter count the launches are planned for: the batch's rank rounded up
        to its rank tile (within the pool's rank) and its adapter count as the launch rules tell counts apart
        (``launch_adapter_count``). Batches that agree on these run the same launches, so they share launch
        traces and graphs."""
        facts = (batch.max_rank, len(batch.slots_used))
        hints = self._lora_hints_memo.get(facts)
        if hints is None:
            from triton_ops.plan import launch_adapter_count, lora_rank_block

            hints = self._lora_hints_memo[facts] = (min(lora_rank_block(facts[0]), self.pool.max_rank),
                                                    launch_adapter_count(facts[1]))
        return hints

    def _forward(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        batch: MoELoRABatchInfo | None,
    ) -> torch.Tensor:
        """This rank's part of the layer (its experts, its I share), summed over the process group with
        ``reduce_results`` (moelora/parallel.py has the math)."""
        if self._expert_map is not None:
            num_experts = self._expert_map.shape[0] - 1
            topk_ids = self._expert_map[topk_ids.clamp(-1, num_experts)]
        out = self._local_forward(x, topk_weights, topk_ids, batch)
        if self.reduce_results:
            import torch.distributed as dist

            dist.all_reduce(out, group=self.process_group)
        return out

    def _local_forward(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        batch: MoELoRABatchInfo | None,
    ) -> torch.Tensor:
        if batch is not None and batch.num_tokens != x.shape[0]:
            raise ValueError(
                f"the batch info describes {batch.num_tokens} tokens but x has {x.shape[0]}: "
                "prepare_batch must see the same sequence lengths as the forward"
            )
        has_lora = batch is not None and batch.has_lora
        path = self.resolve_path(x, batch) if has_lora else None
        if path == "torch" or (not has_lora and (self.path == "torch" or not _triton_can_run(x))):
            w13, w2 = self.w13, self.w2
            if self.mxfp4 is not None:
                if self._mxfp4_dense is None:
                    from triton_ops.mxfp4 import dequantize_mxfp4_torch

                    self._mxfp4_dense = (dequantize_mxfp4_torch(w13, self.mxfp4.w13_scale, x.dtype),
                                         dequantize_mxfp4_torch(w2, self.mxfp4.w2_scale, x.dtype))
                w13, w2 = self._mxfp4_dense
            return moe_lora_forward_torch(
                x, w13, w2, topk_weights, topk_ids,
                self.buffers_ if has_lora else None, batch if has_lora else None,
                routed_scaling_factor=self.routed_scaling_factor, activation=self.activation,
                apply_router_weight_on_input=self.apply_router_weight_on_input, fp8=self.fp8,
                w13_bias=self.w13_bias, w2_bias=self.w2_bias,
            )
        if self.launch_cache is None:
            self.launch_cache = LaunchCache()
        cache = self.launch_cache
        buffers = self.buffers_
        # What fused_experts would convert inside, converted here, so the call stays traceable.
        if topk_weights.dtype != torch.float32 or not topk_weights.is_contiguous():
            topk_weights = topk_weights.float().contiguous()
        if not x.is_contiguous():
            x = x.contiguous()
        if not topk_ids.is_contiguous():
            topk_ids = topk_ids.contiguous()
        inputs = [x, topk_weights, topk_ids, self.w13, self.w2]
        if self.fp8 is not None:
            inputs += [self.fp8.w13_scale, self.fp8.w2_scale]
        if self.mxfp4 is not None:
            inputs += [self.mxfp4.w13_scale, self.mxfp4.w2_scale]
        w13_bias, w2_bias = (None if b is None else b.to(x.dtype).contiguous()
                             for b in (self.w13_bias, self.w2_bias))
        inputs += [b for b in (w13_bias, w2_bias) if b is not None]
        if has_lora:
            inputs += [batch.token_slots, buffers.slot_ranks, batch.slot_scalings, buffers.blocks,
                       *(w.data for w in buffers.tensors())]
        key = self._trace_key(x, topk_weights, topk_ids, batch if has_lora else None, path, inputs)
        if key is not None:
            trace = cache.traces.get(key)
            if trace is not None:
                return trace.replay(inputs)

        lora = None
        if has_lora:
            max_rank, num_adapters = self._lora_hints(batch)
            lora = MoELoRAInputs(
                token_slots=batch.token_slots,
                gate_up_a=buffers.gate_up_a,
                gate_up_b=buffers.gate_up_b,
                down_a=buffers.down_a,
                down_b=buffers.down_b,
                slot_ranks=buffers.slot_ranks,  # this layer's rank of each slot
                slot_scalings=batch.slot_scalings,
                max_rank=max_rank,
                num_adapters=num_adapters,
                slots_checked=True,  # the pool's batch: slots in [-1, L), ranks its own
            )

        def run() -> torch.Tensor:
            return fused_experts(
                x, self.w13, self.w2, topk_weights, topk_ids,
                activation=self.activation,
                apply_router_weight_on_input=self.apply_router_weight_on_input,
                routed_scaling_factor=self.routed_scaling_factor,
                lora=lora,
                lora_path=path or "fused",
                sparse_routing=self._expert_map is not None,
                fp8=self.fp8,
                w13_bias=w13_bias,
                w2_bias=w2_bias,
                mxfp4=self.mxfp4,
            )

        with cache:
            if key is None:
                return run()
            with cache.recording(inputs) as recorder:
                out = run()
            cache.keep_trace(key, recorder.trace(out))
            return out

    def _trace_key(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   lora_batch: MoELoRABatchInfo | None, path: str | None,
                   inputs: list[torch.Tensor]) -> tuple | None:
        """The key of this call's launch trace (``triton_ops.launch.LaunchTrace``), or None where a call
        must run through ``fused_experts``: a trace replays the launches recorded for the key with the
        inputs' pointers put in, so the key holds everything else the launches depend on (shapes, dtypes,
        the layer's settings, the adapter mix), and a call is traced only where ``fused_experts`` makes
        nothing but Triton launches: contiguous fp32 routing weights, contiguous inputs (``_local_forward``
        converts them before asking), every pointer 16-byte aligned as Triton's specialization assumed (a
        misaligned view runs eagerly). ``MOELORA_LAUNCH_TRACE=0`` turns traces off; so does a Triton
        launch hook (it would see the replay's bare pointers)."""
        cache = self.launch_cache
        if not cache.plan("MOELORA_LAUNCH_TRACE", lambda: env_switch("MOELORA_LAUNCH_TRACE", default=True)):
            return None
        if not launch_hooks_idle():
            return None
        pointer_bits = 0
        for tensor in inputs:
            pointer_bits |= tensor.data_ptr()
        if pointer_bits & 15:
            return None
        lora = None
        if lora_batch is not None:
            if not lora_batch.token_slots.is_contiguous():
                return None
            lora = (path, self._lora_hints(lora_batch), tuple(w.data.shape for w in self.buffers_.tensors()))
        w13, w2 = self.w13, self.w2
        return (x.shape, x.dtype, x.device, topk_weights.shape, topk_ids.shape, topk_ids.dtype, lora,
                w13.shape, w13.stride(), w13.dtype, w2.shape, w2.stride(), self.activation,
                self.routed_scaling_factor, self.apply_router_weight_on_input,
                None if self.fp8 is None else self.fp8.block_shape, self.w13_bias is not None,
                self.w2_bias is not None)

    def extra_repr(self) -> str:
        from triton_ops.moe_inputs import gate_up_dims

        num_experts, two_i, hidden = gate_up_dims(self.w13)
        return (f"layer_id={self.layer_id}, experts={num_experts}, hidden={hidden}, "
                f"intermediate={two_i // 2}, rsf={self.routed_scaling_factor}, path={self.path}")


def _weight_block_size(base: nn.Module) -> Sequence[int] | None:
    """The FP8 weight block of ``base``: transformers' ``block_size``, or ``weight_block_size`` on the
    module or its quantization config (vLLM's and SGLang's fused MoE keep it in
    ``quant_method.quant_config``); None where none is set (per-tensor, per-channel or per-half scales)."""
    quant_config = getattr(base, "quant_config", None)
    method_config = getattr(getattr(base, "quant_method", None), "quant_config", None)
    for holder, name in ((base, "block_size"), (base, "weight_block_size"),
                         (quant_config, "weight_block_size"), (method_config, "weight_block_size")):
        value = getattr(holder, name, None)
        if value is not None:
            return value
    return None


def fp8_scales_of(base: nn.Module, w13_name: str, w2_name: str) -> BlockFp8Weights:
    """The scales of ``base``'s float8_e4m3fn experts: ``<name>_scale_inv`` (fp32, or power-of-two UE8M0
    read as fp32) with their block (``_weight_block_size``), or per tensor, per channel or per gate/up half
    without one (``BlockFp8Weights.from_scales``); ValueError where they are missing or fit none of these.
    transformers' ``FP8Experts`` and vLLM/SGLang-style ``w13_weight_scale_inv`` modules alike."""
    from triton_ops.fp8 import BlockFp8Weights

    where = type(base).__name__
    scales = [getattr(base, f"{name}_scale_inv", None) for name in (w13_name, w2_name)]
    if not all(isinstance(scale, torch.Tensor) for scale in scales):
        raise ValueError(f"{where}: float8_e4m3fn experts need {w13_name}_scale_inv and {w2_name}_scale_inv "
                         "scales")
    block_size = _weight_block_size(base)
    if block_size is not None and len(block_size) != 2:
        raise ValueError(f"{where}: block_size must be (block_n, block_k) or None, got {block_size!r}")
    try:
        return BlockFp8Weights.from_scales(
            getattr(base, w13_name).data, getattr(base, w2_name).data, scales[0].data, scales[1].data,
            block_size=None if block_size is None else (int(block_size[0]), int(block_size[1])))
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from err


_GRAPH_POOLS: dict[torch.device, tuple] = {}


def _graph_pool(device: torch.device) -> tuple:
    """The memory pool every layer graph on ``device`` captures into. Sharing it is safe because replays
    run one at a time on the caller's stream and each copies its output out before the next can run: the
    scratch of one graph may then be the scratch of another, and a model of many layers with a few graphs
    each holds the scratch of one forward rather than one per graph."""
    pool = _GRAPH_POOLS.get(device)
    if pool is None:
        pool = _GRAPH_POOLS[device] = torch.cuda.graph_pool_handle()
    return pool


class _GraphedCall:
    """One forward of a ``FusedMoEWithLoRA`` captured in a CUDA graph, with the input buffers it reads."""

    def __init__(self, graph: torch.cuda.CUDAGraph, x: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, token_slots: torch.Tensor | None, out: torch.Tensor) -> None:
        self.graph = graph
        self.x, self.topk_weights, self.topk_ids, self.token_slots = x, topk_weights, topk_ids, token_slots
        self.out = out
        # Token count -> the first rows of (x, topk_weights, topk_ids, token_slots, out): views made once,
        # as slicing a tensor costs the host about as much as the copy it feeds.
        self._views: dict[int, tuple] = {}
        self._rows_written = 0  # rows the last fill wrote: past a call's rows they must route nowhere again

    def _rows(self, m: int) -> tuple:
        views = self._views.get(m)
        if views is None:
            full = m == self.x.shape[0]
            views = self._views[m] = tuple(
                None if t is None else (t if full else t[:m])
                for t in (self.x, self.topk_weights, self.topk_ids, self.token_slots, self.out))
        return views

    @classmethod
    def capture(cls, layer: FusedMoEWithLoRA, rows: int, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, batch: MoELoRABatchInfo | None) -> _GraphedCall:
        """Captures ``layer``'s forward of ``rows`` tokens (at least the call's): rows past the call's route
        to no expert (id -1, weight 0) and use no adapter (slot -1)."""
        static_x = x.new_zeros(rows, *x.shape[1:])
        static_w = topk_weights.new_zeros(rows, *topk_weights.shape[1:])
        static_ids = topk_ids.new_full((rows, *topk_ids.shape[1:]), -1)
        # A batch without adapters runs the base path, which reads nothing of it.
        static_batch, token_slots = None, None
        if batch is not None and batch.has_lora:
            token_slots = batch.token_slots.new_full((rows,), -1)
            static_batch = dataclasses.replace(batch, token_slots=token_slots, num_tokens=rows)
        graphed = cls(None, static_x, static_w, static_ids, token_slots, None)
        graphed.fill(x, topk_weights, topk_ids, batch)

        def run() -> torch.Tensor:
            return layer._forward(static_x, static_w, static_ids, static_batch)

        side = torch.cuda.Stream(device=x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            run()  # warm-up off the capture: compiles and fills the launch cache
        torch.cuda.current_stream(x.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=_graph_pool(x.device)):
            out = run()
        graphed.graph, graphed.out = graph, out
        graphed._views.clear()  # the views made before the capture lack its output
        return graphed

    def fill(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
             batch: MoELoRABatchInfo | None) -> None:
        """Copies a call's inputs into the graph's first rows (the rest keep routing nowhere)."""
        m = x.shape[0]
        static_x, static_w, static_ids, static_slots, _ = self._rows(m)
        static_x.copy_(x)
        static_w.copy_(topk_weights)
        static_ids.copy_(topk_ids)
        if static_slots is not None:
            static_slots.copy_(batch.token_slots)
        if m < self._rows_written:  # a bigger call's rows would route to experts and cost their work
            self.topk_ids[m:self._rows_written].fill_(-1)
            if self.token_slots is not None:
                self.token_slots[m:self._rows_written].fill_(-1)
        self._rows_written = m

    def replay(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
               batch: MoELoRABatchInfo | None) -> torch.Tensor:
        self.fill(x, topk_weights, topk_ids, batch)
        self.graph.replay()
        return self._rows(x.shape[0])[4].clone()
