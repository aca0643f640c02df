"""Expert parallel: the all-reduce combine the layer uses, against an all-to-all dispatch/combine that sends
only routed tokens (with their routing and adapter slot), communication alone.

    torchrun --nproc-per-node 2 benchmarks/bench_ep_dispatch.py --out results/bench_ep_dispatch.json
    torchrun --nproc-per-node 2 benchmarks/bench_ep_dispatch.py --dry-run     # CPU, gloo: checks the script

Both designs run the same expert work: each rank computes the (token, expert) pairs of its own experts.
They differ only in how tokens reach the experts' rank and how results come back, so timing the
communication alone compares them; the all-to-all's times are a lower bound for a real all-to-all path,
which would also exchange the per-rank counts (or pad to a capacity) and permute rows on both ends.

Per model shape and token count M (the routing of ``moelora.bench.make_routing``, experts split in
contiguous blocks over the ranks), two deployments:

* replicated tokens (tensor-parallel attention: every rank holds all M tokens and wants all M outputs;
  what ``FusedMoEWithLoRA(..., reduce_results=True)`` serves): ``all_reduce`` of the (M, H) output, against
  a sparse reduce-scatter (each rank sends the partial rows of tokens that have an expert on it to the
  token's owner rank, ``all_to_all_single``) followed by an ``all_gather`` of the owners' rows;
* sharded tokens (data-parallel attention: rank r holds its M/P tokens and wants their outputs):
  ``all_gather`` of the inputs then ``reduce_scatter`` of the outputs, against an all-to-all dispatch of
  each token to the ranks that hold one of its experts (once per rank; the row carries the hidden state,
  the top-k ids and weights and the adapter slot) and the all-to-all combine of the result rows.

Bytes are what one rank sends (rank 0's). Times are ``bench_parallel.timed_us``'s: each variant captured
in a CUDA graph (so no rank waits for another's host), the four replayed in turn, rank 0's CUDA-event
time, median of ``--reps``. The split sizes of the all-to-alls are computed on the host before capture.

Writes a markdown table to stdout and, with ``--out``, JSON plus the table as .md beside it (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_parallel import rank_setup, timed_us  # noqa: E402

from moelora.bench import MODELS, ModelShape, make_routing  # noqa: E402


def token_owners(m: int, world: int) -> torch.Tensor:
    """(M,) rank owning each token under sharded tokens: contiguous chunks, the first ranks one longer."""
    counts = [m // world + (1 if r < m % world else 0) for r in range(world)]
    return torch.repeat_interleave(torch.arange(world), torch.tensor(counts))


def destination_mask(ids: torch.Tensor, num_experts: int, world: int) -> torch.Tensor:
    """(M, P) bool: whether token t has at least one of its top-k experts on rank d (contiguous blocks)."""
    owner = (ids.long() * world) // num_experts
    mask = torch.zeros(ids.shape[0], world, dtype=torch.bool)
    mask.scatter_(1, owner, True)
    return mask


def a2a_splits(mask: torch.Tensor, owners: torch.Tensor, rank: int) -> tuple[list[int], list[int]]:
    """Rows rank ``rank`` sends to and receives from each rank in a dispatch: a token travels once to each
    other rank holding one of its experts; its own rank computes its pairs in place."""
    world = mask.shape[1]
    send = [int(mask[owners == rank, d].sum()) if d != rank else 0 for d in range(world)]
    recv = [int(mask[owners == s, rank].sum()) if s != rank else 0 for s in range(world)]
    return send, recv


# torch 2.13 renames the one-tensor all-gather and reduce-scatter; earlier versions have only the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_scatter(out: torch.Tensor, full: torch.Tensor, group: Any, on_gpu: bool) -> None:
    if on_gpu:
        _reduce_scatter(out, full, group=group)
    else:  # gloo has no reduce-scatter of one tensor: the same result through an all-reduce
        dist.all_reduce(full, group=group)
        out.copy_(full.view(-1, *out.shape)[dist.get_rank(group)])


def bench_point(shape: ModelShape, m: int, reps: int, dtype: torch.dtype, device: torch.device,
                on_gpu: bool, group: Any) -> dict[str, Any]:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    h, k, itemsize = shape.H, shape.top_k, torch.tensor([], dtype=dtype).element_size()
    _, ids = make_routing(m, shape, seed=m, device=torch.device("cpu"))
    mask = destination_mask(ids, shape.E, world)
    owners = token_owners(m, world)
    # Metadata per dispatched row, in the row's own dtype: top-k ids (int32), top-k weights (fp32), slot.
    meta_cols = (4 * (2 * k + 1)) // itemsize
    row = h + meta_cols

    # Replicated tokens.
    full = torch.randn(m, h, device=device).to(dtype)
    # Sparse reduce-scatter: partial rows of tokens with an expert here go to their owner.
    rs_send = [int(((owners == d) & mask[:, rank]).sum()) if d != rank else 0 for d in range(world)]
    rs_recv = [int(((owners == rank) & mask[:, s]).sum()) if s != rank else 0 for s in range(world)]
    rs_in = torch.randn(sum(rs_send), h, device=device).to(dtype)
    rs_out = torch.empty(sum(rs_recv), h, device=device, dtype=dtype)
    local = int((owners == rank).sum())
    max_local = m // world + (1 if m % world else 0)
    gathered = torch.empty(world * max_local, h, device=device, dtype=dtype)
    mine = torch.randn(max_local, h, device=device).to(dtype)

    def sparse_reduce_then_gather() -> None:
        dist.all_to_all_single(rs_out, rs_in, rs_recv, rs_send, group=group)
        _all_gather(gathered, mine, group=group)


    # Sharded tokens.
    x_local = torch.randn(max_local, h, device=device).to(dtype)
    x_all = torch.empty(world * max_local, h, device=device, dtype=dtype)
    out_all = torch.randn(world * max_local, h, device=device).to(dtype)
    out_local = torch.empty(max_local, h, device=device, dtype=dtype)

    def gather_then_reduce_scatter() -> None:
        _all_gather(x_all, x_local, group=group)
        reduce_scatter(out_local, out_all, group, on_gpu)

    send, recv = a2a_splits(mask, owners, rank)
    dispatch_in = torch.randn(sum(send), row, device=device).to(dtype)
    dispatch_out = torch.empty(sum(recv), row, device=device, dtype=dtype)
    combine_in = torch.randn(sum(recv), h, device=device).to(dtype)
    combine_out = torch.empty(sum(send), h, device=device, dtype=dtype)

    def dispatch_combine() -> None:
        dist.all_to_all_single(dispatch_out, dispatch_in, recv, send, group=group)
        dist.all_to_all_single(combine_out, combine_in, send, recv, group=group)

    allreduce_us, replicated_a2a_us, gather_rs_us, sharded_a2a_us = timed_us(
        [lambda: dist.all_reduce(full, group=group), sparse_reduce_then_gather, gather_then_reduce_scatter,
         dispatch_combine], reps, on_gpu)

    row_bytes, h_bytes = row * itemsize, h * itemsize
    return dict(
        model=shape.name, M=m, E=shape.E, top_k=k, H=h, world=world, local_tokens=local,
        ranks_per_token=float(mask.sum(dim=1).float().mean()),
        allreduce_us=allreduce_us, replicated_a2a_us=replicated_a2a_us,
        gather_rs_us=gather_rs_us, sharded_a2a_us=sharded_a2a_us,
        # What rank 0 sends (a ring all-reduce sends 2 (P-1)/P of the tensor).
        allreduce_bytes=2 * (world - 1) * m * h_bytes // world,
        replicated_a2a_bytes=sum(rs_send) * h_bytes + (world - 1) * max_local * h_bytes,
        gather_rs_bytes=2 * (world - 1) * max_local * h_bytes,
        sharded_a2a_bytes=sum(send) * row_bytes + sum(recv) * h_bytes,
    )


def markdown(records: list[dict[str, Any]], title: str) -> str:
    lines = [title, "", "| model | M | experts' ranks per token | replicated: all-reduce µs (KiB) "
             "| replicated: sparse reduce-scatter + all-gather µs (KiB) "
             "| sharded: all-gather + reduce-scatter µs (KiB) "
             "| sharded: all-to-all dispatch + combine µs (KiB) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        def cell(kind: str) -> str:
            return f"{r[f'{kind}_us']:.1f} ({r[f'{kind}_bytes'] / 1024:.0f})"

        lines.append(f"| {r['model']} | {r['M']} | {r['ranks_per_token']:.2f} | {cell('allreduce')} | "
                     f"{cell('replicated_a2a')} | {cell('gather_rs')} | {cell('sharded_a2a')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "deepseek-v3"], choices=list(MODELS))
    parser.add_argument("--M", nargs="+", type=int, default=[1, 64, 1024, 4096])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", type=Path, metavar="FILE.json")
    parser.add_argument("--dry-run", action="store_true", help="CPU, gloo, a tiny shape: checks the script")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        parser.error("run it under torchrun: torchrun --nproc-per-node N benchmarks/bench_ep_dispatch.py ...")
    on_gpu = not args.dry_run
    if on_gpu and not torch.cuda.is_available():
        parser.error("needs CUDA GPUs (or --dry-run)")
    if min(args.M) < 1 or args.reps < 1:
        parser.error("--M and --reps must be >= 1")
    dist.init_process_group("nccl" if on_gpu else "gloo")
    try:
        group = dist.group.WORLD
        device, dtype, models, ms = rank_setup(args.dry_run, args.models, args.M)
        reps = 3 if args.dry_run else args.reps
        records = []
        for shape in models:
            for m in ms:
                record = bench_point(shape, m, reps, dtype, device, on_gpu, group)
                records.append(record)
                if dist.get_rank() == 0:
                    print(f"{shape.name} M={m}: all-reduce {record['allreduce_us']:.1f} µs, sparse RS + AG "
                          f"{record['replicated_a2a_us']:.1f} µs; AG + RS {record['gather_rs_us']:.1f} µs, "
                          f"all-to-all {record['sharded_a2a_us']:.1f} µs", file=sys.stderr, flush=True)
        if dist.get_rank() == 0:
            name = torch.cuda.get_device_name(device) if on_gpu else "cpu (dry run)"
            world = dist.get_world_size()
            title = (f"Expert-parallel communication on {world} x {name}: the layer's all-reduce against "
                     f"all-to-all dispatch/combine of routed tokens; CUDA graphs, rank 0's µs, median of "
                     f"{reps}; KiB sent by rank 0")
            table = markdown(records, title)
            print(table)
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(dict(device=name, world=world, torch=torch.__version__,
                                                    records=records), indent=1))
                args.out.with_suffix(".md").write_text(table)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
