"""End-to-end decode speed of a transformers MoE model: ``generate`` tokens/s with adapters off, with four
adapters mixed in the batch (eager, and with each MoE layer replayed from CUDA graphs), per batch size.

    python benchmarks/bench_generate.py --batch 1 8 32 --layers 4 --new-tokens 64

The model is a ``Qwen3MoeForCausalLM`` at Qwen3-30B-A3B layer sizes (hidden 2048, 128 experts of 768, top-8,
32 query / 4 KV heads of 128) with ``--layers`` layers and random bf16 weights, built on the GPU. The
adapters are random, rank ``--rank``, on every expert's gate/up/down of every layer, placed straight into
the pool (``pool.add_adapter_weights``). Rows take adapters round-robin (``a0, a1, a2, a3, a0, ...``).

Timed per batch size, after a warm-up ``generate`` of each mode: ``generate(prompt of --prompt tokens,
max_new_tokens = min_new_tokens = --new-tokens, greedy)``, synchronized, median of ``--repeats``; reported
as generated tokens/s (batch x new tokens / time; the prefill is in the time). Modes: ``off`` (outside any
``handle.adapters`` context: the model's own experts modules run), ``eager`` (four adapters,
``layer.cuda_graphs = False``) and ``graphs`` (four adapters, the default of ``attach``).

``--dry-run`` builds a tiny model on the CPU (torch path) to check the script; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moelora.adapter_weights import LoRAProjection, ReferenceLoRA  # noqa: E402
from moelora.integrations.transformers import attach  # noqa: E402

MODES = ("off", "eager", "graphs")


def build_model(layers: int, dry_run: bool, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    import transformers

    if dry_run:
        size = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    moe_intermediate_size=16, intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                    vocab_size=96)
    else:
        size = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                    moe_intermediate_size=768, intermediate_size=6144, num_experts=128, num_experts_per_tok=8,
                    vocab_size=32000)
    config = transformers.Qwen3MoeConfig(**size, num_hidden_layers=layers, max_position_embeddings=4096,
                                         norm_topk_prob=True, tie_word_embeddings=False, pad_token_id=0,
                                         bos_token_id=1, eos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen3MoeForCausalLM(config).to(dtype).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def device_of(parser: argparse.ArgumentParser, dry_run: bool) -> tuple[bool, torch.device, torch.dtype]:
    """(on a GPU, device, dtype): CUDA in bf16, or the CPU in fp32 for ``--dry-run``; a usage error
    without a GPU otherwise."""
    on_gpu = torch.cuda.is_available() and not dry_run
    if not on_gpu and not dry_run:
        parser.error("needs a CUDA GPU (or --dry-run)")
    return on_gpu, torch.device("cuda" if on_gpu else "cpu"), torch.bfloat16 if on_gpu else torch.float32


def random_adapter(pool: Any, rank: int, seed: int) -> dict[int, ReferenceLoRA]:
    """One adapter on every expert of every pool layer: one random A/B per projection shape, each expert a
    different scaling of it (the content does not matter for speed; building it stays fast)."""
    gen = torch.Generator().manual_seed(seed)
    h, i = pool.hidden_size, pool.intermediate_size

    def proj(in_f: int, out_f: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.randn(rank, in_f, generator=gen) / in_f**0.5
        return a, torch.randn(out_f, rank, generator=gen) * 0.01

    (ga, gb), (ua, ub), (da, db) = proj(h, i), proj(h, i), proj(i, h)
    layers = {}
    for lid in pool.layer_ids:
        lora = ReferenceLoRA()
        for e in range(pool.num_experts):
            s = 1.0 + e / pool.num_experts
            lora.gate[e] = LoRAProjection(ga, gb * s, 2.0)
            lora.up[e] = LoRAProjection(ua, ub * s, 2.0)
            lora.down[e] = LoRAProjection(da, db * s, 2.0)
        layers[lid] = lora
    return layers


def time_generate(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, repeats: int,
                  on_gpu: bool) -> float:
    """Median seconds of one greedy ``generate`` of exactly ``new_tokens`` tokens."""
    def once() -> float:
        if on_gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False)
        if on_gpu:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    once()  # warm-up: compiles, builds the batch infos, captures the layer graphs
    return statistics.median(once() for _ in range(repeats))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per row")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--out", type=Path, help="also write the records as JSON")
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU")
    args = parser.parse_args(argv)
    on_gpu, device, dtype = device_of(parser, args.dry_run)
    if args.dry_run:
        args.batch, args.new_tokens, args.prompt, args.repeats, args.layers = [1, 3], 3, 4, 1, 2
    model = build_model(args.layers, args.dry_run, device, dtype)
    names = [f"a{i}" for i in range(4)]
    records = []
    with attach(model, max_loras=4, max_rank=max(16, args.rank)) as handle, torch.no_grad():
        for i, name in enumerate(names):
            handle.pool.add_adapter_weights(name, random_adapter(handle.pool, args.rank, seed=i))
        for batch in args.batch:
            gen = torch.Generator().manual_seed(batch)
            ids = torch.randint(2, model.config.vocab_size, (batch, args.prompt), generator=gen).to(device)
            rows = [names[r % len(names)] for r in range(batch)]
            row = {"batch": batch}
            for mode in args.modes:
                for module in handle.modules.values():
                    module.layer.cuda_graphs = mode == "graphs"
                if mode == "off":
                    seconds = time_generate(model, ids, args.new_tokens, args.repeats, on_gpu)
                else:
                    with handle.adapters(rows):
                        seconds = time_generate(model, ids, args.new_tokens, args.repeats, on_gpu)
                row[f"{mode}_tok_s"] = batch * args.new_tokens / seconds
            records.append(row)
            print(row, flush=True)
    device_name = torch.cuda.get_device_name() if on_gpu else "cpu"
    shape = "tiny" if args.dry_run else "Qwen3-30B-A3B layer sizes"
    print(f"\ngenerate tokens/s on {device_name}: {shape}, {args.layers} layers, prompt {args.prompt}, "
          f"{args.new_tokens} new tokens, 4 adapters of rank {args.rank} round-robin over rows\n")
    print("| batch | " + " | ".join(f"{m} tok/s" for m in args.modes) + " | adapters (graphs) / off |")
    print("|---:|" + "---:|" * (len(args.modes) + 1))
    for r in records:
        ratio = r.get("graphs_tok_s", float("nan")) / r.get("off_tok_s", float("nan"))
        cells = " | ".join(f"{r[f'{m}_tok_s']:.1f}" for m in args.modes)
        print(f"| {r['batch']} | {cells} | {ratio:.2f} |")
    if args.out:
        args.out.write_text(json.dumps({"device": device_name, "args": vars(args) | {"out": str(args.out)},
                                        "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
