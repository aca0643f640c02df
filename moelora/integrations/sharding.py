"""Experts sharded by transformers' tensor- or expert-parallel plans (DTensors): which shard this rank
serves (:func:`_sharding_of`), as a :class:`moelora.parallel.MoEShard`, and over which process group the
layer all-reduces."""

from __future__ import annotations

from torch import nn

from moelora.integrations.families import UnsupportedModelError, _gate_up_name
from moelora.parallel import MoEShard


def _sharding_of(name: str, module: nn.Module, model: nn.Module) -> tuple[MoEShard, object] | None:
    """(this rank's :class:`MoEShard`, the process group to all-reduce over) of an experts module that
    transformers sharded with one of its plans, None for plain tensors:

    - tensor parallel (``packed_colwise`` gate_up_proj: each rank its rows of gate, then of up; ``rowwise``
      down_proj: its columns; ``moe_tp_experts`` all-reduces over the tp group);
    - expert parallel (``grouped_gemm``: contiguous experts per rank) where the expert-parallel ranks hold
      the same batch (the ep group is the model's tp group): transformers then runs each rank's experts on
      the whole batch and all-reduces (``AllReduceEP``), which is what a moelora expert-parallel layer does.

    Raises UnsupportedModelError for any other sharding (an all-to-all expert-parallel layout among them)."""
    try:
        from torch.distributed import get_process_group_ranks
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor shards nothing
        return None
    w13, w2 = getattr(module, _gate_up_name(module)), module.down_proj
    if not isinstance(w13, DTensor) and not isinstance(w2, DTensor):
        return None
    where = f"experts module {name!r} ({type(module).__name__})"
    if not (isinstance(w13, DTensor) and isinstance(w2, DTensor)):
        raise UnsupportedModelError(f"{where}: only one of gate_up_proj and down_proj is sharded (a "
                                  "DTensor); moelora serves transformers' tensor- or expert-parallel plans, "
                                  "which shard both")
    if w13.device_mesh.ndim != 1:
        raise UnsupportedModelError(f"{where}: its expert tensors are sharded over a mesh of "
                                  f"{w13.device_mesh.ndim} dims; moelora serves transformers' 1-D tensor- or "
                                  "expert-parallel plans")
    mesh = w13.device_mesh
    size, rank, group = mesh.size(), mesh.get_local_rank(), mesh.get_group()
    e, two_i, h = w13.shape
    i = two_i // 2
    local13, local2 = tuple(w13.to_local().shape), tuple(w2.to_local().shape)
    placements = (tuple(getattr(p, "dim", None) for p in w13.placements),
                  tuple(getattr(p, "dim", None) for p in w2.placements))
    if placements == ((1,), (2,)) and i % size == 0 and local13 == (e, two_i // size, h) \
            and local2 == (e, h, i // size):
        return MoEShard(e, i, tp_rank=rank, tp_size=size), group
    if placements == ((0,), (0,)) and e % size == 0 and local13 == (e // size, two_i, h) \
            and local2 == (e // size, h, i):
        model_mesh = getattr(model, "_device_mesh", None)
        tp_ranks = None
        if model_mesh is not None and "tp" in (getattr(model_mesh, "mesh_dim_names", None) or ()):
            tp_ranks = get_process_group_ranks(model_mesh["tp"].get_group())
        if tp_ranks != get_process_group_ranks(group):
            raise UnsupportedModelError(
                f"{where}: expert parallel across ranks that hold different batches (transformers moves the "
                "tokens with an all-to-all there); moelora serves expert parallelism where the expert-"
                "parallel ranks are the tensor-parallel ones (ep_size == tp_size), combined by all-reduce")
        return MoEShard(e, i, ep_rank=rank, ep_size=size), group
    raise UnsupportedModelError(
        f"{where}: sharded as {w13.placements} / {w2.placements} with local shapes {local13} / {local2}; "
        "moelora serves transformers' tensor-parallel plan (packed_colwise gate_up_proj, rowwise down_proj) "
        "and its expert-parallel plan (grouped_gemm)")


def _shard_layout(shard: MoEShard | None) -> tuple | None:
    return None if shard is None else (shard.tp_rank, shard.tp_size, shard.experts)
