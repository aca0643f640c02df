"""LoRA overhead of the MoE layer: t(base+LoRA) / t(base) - 1, per path, in one run on one GPU.

    python benchmarks/bench_lora.py                       # four models, M 1..4096, rank 16/64, 1/4 adapters
    python benchmarks/bench_lora.py --models deepseek-v2-lite --M 1 64 --ranks 16

Base = ``fused_experts`` without adapters; base+LoRA = the same call with every token on one of
``n_adapters`` adapters (decode, M <= 64: a random adapter per token, each token its own sequence;
prefill: n_adapters contiguous sequences of M / n_adapters tokens), for the "fused" (all-in-one),
"split" and "staged" paths and "auto" (what the layer picks). Adapter buffers are a max_loras=8 pool
of max_rank = the adapter rank, filled with random weights. Each call is captured in a CUDA graph and
timed with ``triton.testing.do_bench`` (median; L2 flushed before every replay). Writes JSON and a
markdown table to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moelora.layer import choose_lora_path  # noqa: E402
from triton_ops.fused_experts import MoELoRAInputs, fused_experts  # noqa: E402

MODELS = {
    "deepseek-v2-lite": (64, 6, 2048, 1408),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "deepseek-v3": (256, 8, 7168, 2048),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}


def graph_time_us(fn) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median") * 1000


def make_lora(num_experts: int, hidden: int, inter: int, rank: int, n_adapters: int, tokens: int,
              dtype: torch.dtype, max_loras: int = 8) -> MoELoRAInputs:
    gen = torch.Generator(device="cuda").manual_seed(1)

    def rnd(*shape: int, fan_in: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen) / fan_in**0.5

    # One adapter per sequence, sequences contiguous (as prepare_batch lays them out): at decode every
    # token is its own sequence and takes a random adapter; a prefill batch of M tokens holds
    # n_adapters sequences of about M / n_adapters tokens each.
    if tokens <= 64:
        slots = torch.randint(0, n_adapters, (tokens,), device="cuda", generator=gen, dtype=torch.int32)
    else:
        slots = (torch.arange(tokens, device="cuda") * n_adapters // tokens).to(torch.int32)
    ranks = torch.zeros(max_loras, dtype=torch.int32, device="cuda")
    ranks[:n_adapters] = rank
    return MoELoRAInputs(
        token_slots=slots,
        gate_up_a=rnd(max_loras, num_experts, 2 * rank, hidden, fan_in=hidden),
        gate_up_b=rnd(max_loras, num_experts, 2 * inter, rank, fan_in=rank),
        down_a=rnd(max_loras, num_experts, rank, inter, fan_in=inter),
        down_b=rnd(max_loras, num_experts, hidden, rank, fan_in=rank),
        slot_ranks=ranks,
        slot_scalings=torch.full((max_loras,), 2.0, device="cuda"),
        max_rank=rank,
    )


def bench_model(name: str, token_counts: list[int], ranks: list[int], adapter_counts: list[int],
                dtype: torch.dtype) -> list[dict]:
    num_experts, top_k, hidden, inter = MODELS[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device="cuda", dtype=dtype, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, device="cuda", dtype=dtype, generator=gen) / inter**0.5
    records = []
    for m in token_counts:
        x = torch.randn(m, hidden, device="cuda", dtype=dtype, generator=gen)
        logits = torch.randn(m, num_experts, device="cuda", generator=gen)
        weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        ids = ids.to(torch.int32)
        base_us = graph_time_us(lambda: fused_experts(x, w13, w2, weights, ids))
        for rank in ranks:
            for n_adapters in adapter_counts:
                lora = make_lora(num_experts, hidden, inter, rank, n_adapters, m, dtype)
                auto = choose_lora_path(m, top_k, num_experts, rank, hidden)
                row = dict(model=name, E=num_experts, top_k=top_k, H=hidden, I=inter, M=m, rank=rank,
                           n_adapters=n_adapters, dtype=str(dtype).removeprefix("torch."), base_us=base_us,
                           auto_path=auto)
                for path in ("fused", "split", "staged"):
                    us = graph_time_us(lambda p=path, lr=lora: fused_experts(
                        x, w13, w2, weights, ids, lora=lr, lora_path=p))
                    row[f"{path}_us"] = us
                    row[f"{path}_overhead"] = us / base_us - 1
                row["base_lora_us"] = row[f"{auto}_us"]
                row["auto_overhead"] = row[f"{auto}_overhead"]
                records.append(row)
                print(f"{name:17s} M={m:5d} r={rank:3d} n={n_adapters}  base {base_us:8.1f} us  "
                      f"fused {row['fused_us']:8.1f} ({row['fused_overhead']:+7.1%})  "
                      f"split {row['split_us']:8.1f} ({row['split_overhead']:+7.1%})  "
                      f"staged {row['staged_us']:8.1f} ({row['staged_overhead']:+7.1%})  auto={auto}",
                      flush=True)
                del lora
        torch.cuda.empty_cache()
    return records


def markdown(records: list[dict], device: str) -> str:
    lines = [f"# MoE LoRA overhead on {device} ({dt.date.today()})", "",
             "t(base+LoRA)/t(base) - 1; CUDA graphs, do_bench median, bf16; M <= 64: random adapter per "
             "token, larger M: n_adapters contiguous sequences.",
             "",
             "| model | M | rank | adapters | base µs | fused ovh | split ovh | staged ovh | auto (ovh) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in records:
        lines.append(f"| {r['model']} | {r['M']} | {r['rank']} | {r['n_adapters']} | {r['base_us']:.1f} | "
                     f"{r['fused_overhead']:+.1%} | {r['split_overhead']:+.1%} | "
                     f"{r['staged_overhead']:+.1%} | "
                     f"{r['auto_path']} ({r['auto_overhead']:+.1%}) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--M", nargs="+", type=int, default=[1, 16, 64, 256, 1024, 4096])
    parser.add_argument("--ranks", nargs="+", type=int, default=[16, 64])
    parser.add_argument("--adapters", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--out", type=Path, default=None, help="JSON path (markdown beside it)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_lora.py needs a CUDA GPU")
    device = torch.cuda.get_device_name()
    records = []
    for name in args.models:
        records += bench_model(name, args.M, args.ranks, args.adapters, torch.bfloat16)
    out = args.out or Path(__file__).parent / "results" / f"bench_lora_{device.replace(' ', '_')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(device=device, torch=torch.__version__, triton=triton.__version__,
                date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
    out.write_text(json.dumps(dict(meta, records=records), indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(records, device))
    print(markdown(records, device))


if __name__ == "__main__":
    main()
