"""A gpt-oss-120b-shaped model with MXFP4-packed experts on one GPU: its memory, ``generate`` with adapters.

    python benchmarks/bench_gptoss_model.py --layers 36 --adapters 8 --batch 1 8 --new-tokens 32

Builds ``GptOssForCausalLM`` at gpt-oss-120b's sizes (hidden 2880, 128 experts of 2880, top-4, 64 query / 8
KV heads of 64, vocab 201088, sliding and full attention alternating; ``--layers`` layers, 36 in the real
model) with random weights, its experts packed as ``load_packed_gpt_oss`` loads a gpt-oss checkpoint
(``PackedGptOssExperts``: E2M1 blocks and E8M0 scales as stored): no bf16 copy of the experts exists at
any point, as 229 GB of them would not fit. ``attach`` serves the experts packed (the GEMMs decode the
blocks in place); ``--adapters`` random adapters of rank ``--rank`` on every expert's gate/up/down of every
layer are placed in the pool (``pool.add_adapter_weights``) and rows take them round-robin.

Reported: the packed experts' bytes, the pool's adapter bytes, the device's peak memory
(``torch.cuda.max_memory_allocated``) and, per batch size, ``generate`` tokens/s (greedy, exactly
``--new-tokens`` tokens after a ``--prompt``-token prompt, the prefill in the time, median of ``--repeats``
after a warm-up) without adapters and with them mixed in the batch (each MoE layer replayed from CUDA
graphs, the default of ``attach``).

``--dry-run`` builds a tiny model on the CPU (the layer's torch path) to check the script; its numbers
mean nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from unittest import mock

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generate import device_of, random_adapter, time_generate  # noqa: E402

from moelora.integrations.gpt_oss import PackedGptOssExperts  # noqa: E402
from moelora.integrations.transformers import attach  # noqa: E402

GPT_OSS_120B = dict(vocab_size=201088, hidden_size=2880, num_attention_heads=64, num_key_value_heads=8,
                    head_dim=64, intermediate_size=2880, num_local_experts=128, num_experts_per_tok=4,
                    sliding_window=128)
TINY = dict(vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=4)
SCALE_EXPONENTS = (118, 122)  # E8M0 scales 2^-9 .. 2^-6: weights of a few hundredths, as trained ones


class _NoExperts(nn.Module):
    """Stands in for ``GptOssExperts`` while the model is built: its bf16 weights are never allocated (empty
    parameters of its names, which the model's weight init visits)."""

    def __init__(self, config) -> None:
        super().__init__()
        for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            setattr(self, name, nn.Parameter(torch.empty(0), requires_grad=False))


def packed_experts(config, device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> nn.Module:
    """A ``PackedGptOssExperts`` (what ``load_packed_gpt_oss`` makes of a checkpoint) of random E2M1 codes
    and E8M0 scales drawn on ``device`` by ``gen``."""
    experts = PackedGptOssExperts(config, dtype, device=device)
    with torch.no_grad():
        for proj in ("gate_up_proj", "down_proj"):
            blocks, scales = getattr(experts, f"{proj}_blocks"), getattr(experts, f"{proj}_scales")
            blocks.copy_(torch.randint(0, 256, blocks.shape, dtype=torch.uint8, generator=gen, device=device))
            scales.copy_(torch.randint(*SCALE_EXPONENTS, scales.shape, dtype=torch.uint8, generator=gen,
                                       device=device))
            bias = getattr(experts, f"{proj}_bias")
            bias.copy_(torch.randn(bias.shape, generator=gen, device=device) * 0.05)
    return experts


def build_model(layers: int, dry_run: bool, device: torch.device, dtype: torch.dtype) -> nn.Module:
    import transformers
    from transformers.models.gpt_oss import modeling_gpt_oss

    size = TINY if dry_run else GPT_OSS_120B
    config = transformers.GptOssConfig(
        **size, num_hidden_layers=layers, swiglu_limit=7.0, max_position_embeddings=4096,
        layer_types=["sliding_attention" if n % 2 == 0 else "full_attention" for n in range(layers)],
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 150000.0})
    torch.manual_seed(0)
    with mock.patch.object(modeling_gpt_oss, "GptOssExperts", _NoExperts), torch.device(device):
        model = transformers.GptOssForCausalLM(config).to(dtype).eval()
    gen = torch.Generator(device).manual_seed(1)  # drawn where they live: 61 GB at 36 layers
    for layer in model.model.layers:
        layer.mlp.experts = packed_experts(config, device, dtype, gen)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def packed_bytes(model: nn.Module) -> int:
    """Bytes of the packed experts' blocks and scales."""
    return sum(p.numel() for m in model.modules() if isinstance(m, PackedGptOssExperts)
               for name, p in m.named_parameters() if name.endswith(("_blocks", "_scales")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per row")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, help="also write the results as JSON")
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU")
    args = parser.parse_args(argv)
    if args.layers < 1 or args.adapters < 1 or args.rank < 1 or min(args.batch) < 1:
        parser.error("--layers, --adapters, --rank and --batch must be at least 1")
    on_gpu, device, dtype = device_of(parser, args.dry_run)
    if args.dry_run:
        args.layers, args.adapters, args.batch = 2, 2, [2]
        args.new_tokens, args.prompt, args.repeats = 2, 4, 1
    model = build_model(args.layers, args.dry_run, device, dtype)
    experts_gb = packed_bytes(model) / 1e9
    names = [f"a{n}" for n in range(args.adapters)]
    records = []
    with attach(model, max_loras=args.adapters, max_rank=args.rank) as handle, torch.no_grad():
        for n, name in enumerate(names):
            handle.pool.add_adapter_weights(name, random_adapter(handle.pool, args.rank, seed=n))
            print(f"adapter {n + 1}/{args.adapters} placed", flush=True)
        memory = handle.pool.memory_report()
        adapter_gb, arena_gb = memory.used_bytes / 1e9, memory.arena_bytes / 1e9
        for batch in args.batch:
            gen = torch.Generator().manual_seed(batch)
            ids = torch.randint(2, model.config.vocab_size, (batch, args.prompt), generator=gen).to(device)
            rows = [names[r % len(names)] for r in range(batch)]
            base_s = time_generate(model, ids, args.new_tokens, args.repeats, on_gpu)
            with handle.adapters(rows):
                lora_s = time_generate(model, ids, args.new_tokens, args.repeats, on_gpu)
            row = {"batch": batch, "base_tok_s": batch * args.new_tokens / base_s,
                   "adapters_tok_s": batch * args.new_tokens / lora_s}
            records.append(row)
            print(row, flush=True)
    peak_gb = torch.cuda.max_memory_allocated() / 1e9 if on_gpu else None
    device_name = torch.cuda.get_device_name() if on_gpu else "cpu"
    shape = "tiny" if args.dry_run else "gpt-oss-120b sizes"
    print(f"\ngpt-oss with MXFP4-packed experts on {device_name}: {shape}, {args.layers} layers; "
          f"packed experts {experts_gb:.2f} GB, {args.adapters} adapters of rank {args.rank}"
          + f" ({adapter_gb:.2f} GB of a {arena_gb:.2f} GB arena)"
          + (f"; peak device memory {peak_gb:.1f} GB" if peak_gb is not None else "") + "\n")
    print("| batch | base tok/s | adapters tok/s | adapters / base |")
    print("|---:|---:|---:|---:|")
    for r in records:
        print(f"| {r['batch']} | {r['base_tok_s']:.1f} | {r['adapters_tok_s']:.1f} | "
              f"{r['adapters_tok_s'] / r['base_tok_s']:.2f} |")
    if args.out:
        args.out.write_text(json.dumps({"device": device_name, "args": vars(args) | {"out": str(args.out)},
                                        "packed_experts_gb": experts_gb, "adapter_gb": adapter_gb,
                                        "arena_gb": arena_gb,
                                        "peak_gb": peak_gb, "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
