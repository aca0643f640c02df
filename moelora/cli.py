"""The ``moelora`` command line (also ``python -m moelora``).

Without a CUDA GPU the Triton kernels run in Triton's interpreter; the switch has to be set before any
kernel module is imported, which is why the kernel imports below happen inside the commands.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch


class UsageError(ValueError):
    """Bad input on the command line: :func:`main` prints it as one line, ``moelora <cmd>: error: ...``,
    and exits with code 2."""


def _check_device(requested: str) -> str:
    """The device ``--device`` names ("auto": CUDA where torch sees a GPU, else the CPU); a UsageError for
    CUDA on a machine without it, before any model is read."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA GPU on this machine (torch.cuda.is_available() "
                         "is False); expected --device cpu or auto")
    return requested


def _select_device(requested: str) -> torch.device:
    """:func:`_check_device`, and on the CPU Triton's interpreter switched on for the kernels to come."""
    device = _check_device(requested)
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return torch.device(device)


# The files one of which a transformers checkpoint's weights are in (``save_pretrained`` writes one of them).
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


def _check_model_dir(flag: str, value: str) -> Path:
    """``value`` as a transformers checkpoint directory (config.json and weights), or a UsageError that
    names the flag, the value and what is missing, before transformers reads anything."""
    import json

    folder = Path(value)
    expected = "expected a transformers model directory (config.json and model weights, as save_pretrained " \
               "writes them)"
    if not folder.exists():
        raise UsageError(f"{flag} {value}: no such directory; {expected}")
    if not folder.is_dir():
        raise UsageError(f"{flag} {value}: a file, not a directory; {expected}")
    config = folder / "config.json"
    if not config.is_file():
        raise UsageError(f"{flag} {value}: not a transformers checkpoint (no config.json in it); {expected}")
    try:
        parsed = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise UsageError(f"{flag} {value}: config.json is not readable JSON ({err}); {expected}") from None
    if not isinstance(parsed, dict) or "model_type" not in parsed:
        raise UsageError(f"{flag} {value}: config.json has no model_type, so it is not a transformers "
                         f"config; {expected}")
    if not any((folder / name).is_file() for name in _WEIGHT_FILES) and not any(folder.glob("*.safetensors")):
        raise UsageError(f"{flag} {value}: no model weights in it (none of {', '.join(_WEIGHT_FILES)}); "
                         f"{expected}")
    return folder


def _parse_adapters(specs: list[str]) -> dict[str, Path]:
    """``--adapter NAME=DIR`` flags as {name: directory}; a UsageError for a spec without ``=``, an empty
    name or directory, a name given twice, or a directory that is not a servable PEFT adapter (read from
    its config and safetensors header only)."""
    from moelora.adapter_weights import AdapterLoadError
    from moelora.peft_loader import AdapterInputError, describe_peft_adapter

    adapters: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            raise UsageError(f"--adapter {spec}: no '='; expected NAME=DIR (a name, then a PEFT adapter "
                             "directory)")
        if not name.strip():
            raise UsageError(f"--adapter {spec}: empty name; expected NAME=DIR with a non-empty NAME")
        if not path.strip():
            raise UsageError(f"--adapter {spec}: empty directory; expected NAME=DIR with a PEFT adapter "
                             "directory")
        if name in adapters:
            raise UsageError(f"--adapter {spec}: the name {name!r} is given twice; expected distinct names")
        try:
            describe_peft_adapter(path)
        except AdapterInputError as err:
            raise UsageError(f"--adapter {spec}: {_one_line(err)}; expected a PEFT adapter directory "
                             "(adapter_config.json and adapter_model.safetensors)") from None
        except AdapterLoadError as err:
            raise UsageError(f"--adapter {spec}: moelora cannot serve this adapter: {_one_line(err)}") \
                from None
        adapters[name] = Path(path)
    return adapters


def cmd_smoke(args: argparse.Namespace) -> int:
    """Base fused MoE on a small embedded shape, checked against the fp32 reference."""
    device = _select_device(args.device)
    from moelora.reference import reference_moe, softmax_topk
    from triton_ops import fused_experts

    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    if device.type == "cpu" and dtype == torch.bfloat16:
        raise UsageError("--dtype bf16 on the CPU: Triton's interpreter computes bf16 dot products wrongly; "
                         "expected --dtype fp32 or fp16 (or a CUDA GPU)")
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    failed = False
    print(f"moelora smoke: base fused MoE (Triton) vs fp32 reference on {device} ({args.dtype})")
    print(f"| {'E':>3} | {'top_k':>5} | {'H':>4} | {'I':>4} | {'M':>4} | {'max |Δ|':>9} | {'rel':>8} | "
          f"{'ms':>8} | ok |")
    print("|" + "|".join("-" * w for w in (5, 7, 6, 6, 6, 11, 10, 10, 4)) + "|")
    shapes = ((8, 2, 64, 48, 6), (16, 4, 96, 80, 13), (6, 1, 48, 40, 3))  # (E, top_k, H, I, M)
    for num_experts, top_k, hidden, inter, tokens in shapes:
        x = torch.randn(tokens, hidden, generator=gen)
        w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
        w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
        weights, ids = softmax_topk(torch.randn(tokens, num_experts, generator=gen), top_k)
        expected = reference_moe(x, w13, w2, weights, ids)
        args_dev = [t.to(device) for t in (x, w13, w2)]
        args_dev = [t.to(dtype) for t in args_dev] + [weights.to(device), ids.to(device)]
        start = time.perf_counter()
        out = fused_experts(*args_dev)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed_ms = (time.perf_counter() - start) * 1e3
        err = (out.float().cpu() - expected).abs().max().item()
        rel = err / max(expected.abs().max().item(), 1e-12)
        ok = bool(torch.isfinite(out).all()) and rel <= (1e-4 if dtype == torch.float32 else 2e-2)
        failed |= not ok
        rows.append((num_experts, top_k, hidden, inter, tokens, err, rel, elapsed_ms, ok))
        print(f"| {num_experts:>3} | {top_k:>5} | {hidden:>4} | {inter:>4} | {tokens:>4} | {err:9.2e} | "
              f"{rel:8.1e} | {elapsed_ms:8.1f} | {'✓' if ok else '✗'}  |")
    print("all outputs match the reference" if not failed else "MISMATCH against the reference")
    return 1 if failed else 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job: serve a MoE model with several adapters at once and check it against PEFT."""
    from moelora.demo import default_adapters, default_model, run_demo

    # usage errors first (exit code 2), before the model is loaded
    if args.tp < 1 or args.ep not in (1, args.tp):
        raise UsageError(f"--tp {args.tp} --ep {args.ep}: expected --tp at least 1 and --ep 1 or equal to "
                         "--tp")
    if args.tp == 1:
        _check_device(args.device)  # with --tp, each torchrun rank picks its own
    if args.model and not args.adapter:
        raise UsageError(f"--model {args.model} without --adapter: expected the adapters too (--adapter "
                         "NAME=DIR, at least two)")
    model = _check_model_dir("--model", args.model) if args.model else default_model()
    adapters = _parse_adapters(args.adapter) if args.adapter else default_adapters()
    if len(adapters) < 2:
        raise UsageError(f"--adapter: {len(adapters)} adapter given; expected at least two (the demo "
                         "hot-loads the last one while the others serve)")
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as err:
        print(f"moelora demo needs the transformers extra: pip install -e \".[transformers]\" ({err})",
              file=sys.stderr)
        return 2
    return run_demo(model, adapters, device=args.device, new_tokens=args.new_tokens, check=not args.no_check,
                    tp=args.tp, ep=args.ep)


def _local_model_dir(name: str, adapter_dir: Path) -> Path | None:
    """The local folder ``base_model_name_or_path`` names, if it holds a ``config.json``: tried as given
    (relative to the working directory, as PEFT and transformers read it), then relative to the adapter
    directory. ``None`` for a hub id or a folder that is not here."""
    tries = [Path(name)] + ([] if Path(name).is_absolute() else [adapter_dir / name])
    for folder in tries:
        try:
            if (folder / "config.json").is_file():
                return folder.resolve()
        except (OSError, ValueError):  # a name too long, a NUL byte, ...
            continue
    return None


def _fmt_num(x: float) -> str:
    return f"{x:g}"


def _print_summary(s, show_ignored: int) -> None:
    """The adapter on its own (:class:`moelora.peft_loader.AdapterSummary`)."""
    from collections import Counter

    def line(label: str, text: str) -> None:
        print(f"{label:<12} {text}")

    line("adapter", s.path)
    line("format", s.format + (f" (PEFT {s.peft_version})" if s.peft_version else ""))
    line("layout", s.layout)
    for name in s.module_names:
        line("modules", name)
    line("MoE layers", f"{s.layers} ({len(s.layers)} layer{'s' if len(s.layers) != 1 else ''} with expert "
         "LoRA weights)")
    covered = {lid: len(es) for lid, es in s.experts_per_layer.items()}
    if s.num_experts is not None:
        line("experts", f"{s.num_experts} (fused: lora_A holds num_experts x r rows), all in every layer")
    else:
        every = len(set(covered.values())) == 1 and next(iter(covered.values())) == s.min_experts
        line("experts", f"at least {s.min_experts} (per-expert modules cannot tell the model's count): "
             + (f"ids 0-{s.min_experts - 1} in every layer" if every else f"covered per layer {covered}"))
    projs = {tuple(p) for p in s.projections.values()}
    line("projections", ", ".join(next(iter(projs))) if len(projs) == 1 else str(s.projections))
    if s.hidden_size is not None:
        line("sizes", f"H={s.hidden_size} I={s.intermediate_size} (from the tensor shapes; I: expert FFN "
             "width)")
    else:
        options = " or ".join(f"H={h} I={i} ({fmt})" for h, i, fmt in s.size_candidates)
        line("sizes", f"undecided from the adapter alone: {options}")
    by_rank = Counter(s.ranks.values())
    dist = ", ".join(f"r={r}: {n} module{'s' if n != 1 else ''}" for r, n in sorted(by_rank.items(),
                                                                                   reverse=True))
    line("ranks", f"max {s.max_rank}; {dist}")
    if s.rank_pattern or s.alpha_pattern:
        line("patterns", f"rank_pattern {s.rank_pattern}, alpha_pattern {s.alpha_pattern}; "
             f"{len(s.pattern_modules)} module{'s' if len(s.pattern_modules) != 1 else ''} matched"
             + (f", e.g. {s.pattern_modules[0]}" if s.pattern_modules else ""))
    formula = "alpha / sqrt(r) (rsLoRA)" if s.use_rslora else "alpha / r"
    groups = Counter((s.ranks[n], s.alphas[n], s.scalings[n]) for n in s.ranks)
    parts = [
        f"{_fmt_num(a)}/{'sqrt(' + str(r) + ')' if s.use_rslora else r} = {_fmt_num(round(sc, 6))}"
        + (f" ({n} module{'s' if n != 1 else ''})" if len(groups) > 1 else "")
        for (r, a, sc), n in sorted(groups.items(), reverse=True)
    ]
    line("scaling", f"{formula}: {', '.join(parts)} (config: r={s.r}, lora_alpha={_fmt_num(s.lora_alpha)}, "
         f"use_rslora={str(s.use_rslora).lower()})")
    reasons = Counter(why for why in s.ignored_keys.values())
    line("ignored", f"{len(s.ignored_keys)} key{'s' if len(s.ignored_keys) != 1 else ''} outside the routed "
         "experts" + (" (not served)" if s.ignored_keys else ""))
    budget = show_ignored
    for why, n in reasons.most_common():
        print(f"  {n} x {why}")
        keys = [k for k, w in s.ignored_keys.items() if w == why]
        for key in keys[:budget]:
            print(f"    {key}")
        if len(keys) > budget:
            print(f"    ... {len(keys) - budget} more")
        budget = max(0, budget - len(keys))
    line("bytes", f"{s.file_bytes:,} (adapter_model.safetensors; expert LoRA factors {s.lora_bytes:,} in "
         f"{'/'.join(s.dtypes)}, ignored tensors {s.ignored_bytes:,})")
    for note in s.notes:
        line("note", note)


def _print_check(args: argparse.Namespace, shape, source: str) -> int:
    """The full check: :func:`read_peft_adapter` with the model's sizes, as ``--model`` always did."""
    from moelora.adapter_weights import AdapterLoadError
    from moelora.peft_loader import read_peft_adapter

    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    print(f"compatibility check against {source}")
    print(f"model        {shape.model_type}: E={shape.num_experts} H={shape.hidden_size} "
          f"I={shape.intermediate_size}, MoE layers {list(shape.layer_ids)}")
    try:
        _, report = read_peft_adapter(
            args.path, num_experts=shape.num_experts, hidden_size=shape.hidden_size,
            intermediate_size=shape.intermediate_size, layer_ids=shape.layer_ids, max_rank=args.max_rank,
            dtype=torch.float32, pool_dtype=dtype,
        )
    except AdapterLoadError as err:
        print("result       FAILED (reason on stderr)")
        print(f"moelora inspect: cannot serve this adapter on {source}: {err}", file=sys.stderr)
        return 1
    except ValueError as err:  # invalid sizes or --max-rank (not an adapter problem)
        raise UsageError(str(err)) from None
    ranks = sorted(set(report.ranks.values()))
    scalings = sorted({round(s, 6) for s in report.scalings.values()})
    experts = {lid: len(e) for lid, e in report.experts_per_layer.items()}
    print(f"format       {report.format}" + (f" (PEFT {report.peft_version})" if report.peft_version else ""))
    print(f"ranks        {ranks} (slot rank {report.max_rank}; {len(report.ranks)} expert modules)")
    print(f"scalings     {scalings}")
    print(f"layers       {report.layers} (experts covered per layer: {experts})")
    blocks = sum(experts.values())
    print(f"pool bytes   {report.pool_bytes:,} in a pool's arena ({blocks} layer-expert blocks of rank "
          f"{report.max_rank}, {args.dtype})")
    print(f"ignored keys {len(report.ignored_keys)}")
    for note in report.notes:
        print(f"note         {note}")
    print("result       OK: the adapter loads into this model")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    """Shows what a PEFT adapter holds (from the adapter alone) and checks it against a model's MoE shape
    when one is known: --model, the shape flags, or a local base_model_name_or_path folder."""
    from moelora.adapter_weights import AdapterLoadError
    from moelora.model_config import MoEShape, moe_shape_from_dir
    from moelora.peft_loader import AdapterInputError, describe_peft_adapter

    # usage errors first (exit code 2), before anything is read
    shape, source = None, ""
    flags = (args.experts, args.hidden, args.intermediate, args.layers)
    if args.model:
        try:
            shape = moe_shape_from_dir(args.model)
        except ValueError as err:
            raise UsageError(f"--model {args.model}: {err}") from None
        source = f"--model {args.model}"
    elif any(f is not None for f in flags):
        if None in flags:
            raise UsageError("expected all of --experts, --hidden, --intermediate and --layers (or --model "
                             "DIR, a Hugging Face model directory)")
        try:
            layer_ids = tuple(int(n) for n in args.layers.split(","))
        except ValueError:
            raise UsageError(f"--layers {args.layers}: expected comma-separated layer ids, e.g. 1,2,3") \
                from None
        shape = MoEShape(args.experts, args.hidden, args.intermediate, layer_ids, 0, "given")
        source = "the given shape (--experts/--hidden/--intermediate/--layers)"

    try:
        summary = describe_peft_adapter(args.path)
    except AdapterInputError as err:
        raise UsageError(f"{args.path}: not a readable PEFT adapter: {err}") from None
    except AdapterLoadError as err:
        print(f"moelora inspect: cannot serve this adapter: {err}", file=sys.stderr)
        return 1
    _print_summary(summary, args.show_ignored)

    base = summary.base_model
    if shape is None:
        label = "base model"
        if base is None:
            print(f"{label:<12} not named (no base_model_name_or_path in the config): the compatibility "
                  "check needs --model DIR")
            return 0
        folder = _local_model_dir(base, Path(summary.path))
        if folder is None:
            print(f"{label:<12} {base} (base_model_name_or_path; no local folder with a config.json: a hub "
                  "id?): the compatibility check needs --model DIR, the model's local folder")
            return 0
        try:
            shape = moe_shape_from_dir(folder)
        except ValueError as err:
            print(f"{label:<12} {base} -> {folder}: cannot read its MoE shape ({err}); compatibility check "
                  "not run (give --model DIR)")
            return 0
        print(f"{label:<12} {base} (base_model_name_or_path) -> local folder {folder}")
        source = f"{folder} (base_model_name_or_path)"
    elif base is not None:
        print(f"{'base model':<12} {base} (base_model_name_or_path; {source.split(' (')[0]} is used instead)")
    return _print_check(args, shape, source)


def cmd_bench(args: argparse.Namespace) -> int:
    """Times the MoE LoRA layer per path against the base fused MoE (moelora/bench.py says how)."""
    if args.dry_run and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton_ops
    from moelora.bench import BenchError, run_bench

    try:
        return run_bench(args)
    except BenchError as err:
        print(f"moelora bench: {err}", file=sys.stderr)
        return 2


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _add_bench_parser(sub) -> None:
    bench = sub.add_parser(
        "bench", help="time the LoRA overhead of the MoE layer per path (markdown, JSON, PNG)",
        description="LoRA overhead t(base+LoRA)/t(base) - 1 of the MoE layer, per path, in one run: CUDA "
        "graphs, median of replays after an L2 flush each. Writes a markdown table to stdout and JSON, "
        "markdown and a PNG plot to benchmarks/results/.",
    )
    bench.add_argument("--models", "--model", nargs="+", metavar="NAME",
                       help="deepseek-v2-lite, deepseek-v2, deepseek-v3, qwen3-30b-a3b, mixtral-8x7b "
                       "(default: all; with --config only the config's model)")
    bench.add_argument("--config", action="append", metavar="FILE.json",
                       help='a model shape {"name": .., "E": .., "top_k": .., "H": .., "I": ..} (repeatable)')
    ints = dict(nargs="+", type=_positive_int)
    bench.add_argument("--M", **ints, help="token counts (default 1 16 64 256 1024 4096)")
    bench.add_argument("--ranks", **ints, help="LoRA ranks (default 16 64)")
    bench.add_argument("--adapters", **ints, help="adapters in the batch (default 1 4)")
    bench.add_argument("--popularity", nargs="+", choices=["uniform", "zipf"],
                       help="how tokens (M <= 64) or sequences pick adapters: uniform (default) or zipf, "
                       "s=1.1")
    bench.add_argument("--dtype", choices=["bf16", "fp16"], help="default bf16 (fp16 in the CPU dry run)")
    bench.add_argument("--paths", nargs="+",
                       choices=["naive", "base", "fused", "split", "staged", "auto"],
                       help="default: base fused split staged auto (naive: a PyTorch loop, eager)")
    bench.add_argument("--quick", action="store_true",
                       help="deepseek-v2-lite, qwen3-30b-a3b and deepseek-v3, M 1 64 1024, rank 16, paths "
                       "base split auto, shorter do_bench (about a minute on an H100); explicit flags win")
    bench.add_argument("--dry-run", action="store_true",
                       help="tiny shapes (CPU: Triton interpreter, fp16, perf_counter timing): checks the "
                       "pipeline, writes JSON + PNG")
    bench.add_argument("--out", type=Path, metavar="FILE.json",
                       help="JSON path; the .md and .png go beside it (default "
                       "benchmarks/results/bench_<device>_<UTC time>.json)")
    bench.add_argument("--warmup", type=float, help="timer warm-up in ms (default 25; 10 with --quick)")
    bench.add_argument("--rep", type=float,
                       help="measurement time in ms (default 100; 30 with --quick)")
    bench.add_argument("--l2-flush", choices=["read", "write"], default="read",
                       help="how L2 is emptied before each timed call: read a 256 MB buffer (default; L2 "
                       "then holds clean lines) or write it as triton.testing.do_bench does (its ~50 MB of "
                       "dirty lines are written back inside the timed call: +9-10 us per decode layer on an "
                       "H100)")
    bench.add_argument("--naive-max-s", type=float, default=0.5,
                       help="skip the naive path when one call is estimated slower (GPU; default 0.5 s)")
    bench.add_argument("--rounds", type=int, default=1,
                       help="interleaved (base, LoRA) timing rounds per point; a row is the round of median "
                            "overhead, each round's overhead in its JSON (default 1)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--pool-rank", type=int, default=None,
                       help="size the LoRA buffers for this max rank (adapters keep --ranks): the cost of a "
                            "small adapter in a big pool")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    bench.set_defaults(func=cmd_bench)


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrorParser(prog="moelora", description="Serve many LoRA adapters of one MoE model.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="serve a MoE model with several adapters, checked against PEFT")
    demo.add_argument("--model", help="Hugging Face MoE model dir (default: the tiny Qwen3-MoE in adapters/)")
    demo.add_argument("--adapter", action="append", metavar="NAME=DIR", help="PEFT adapter (repeat; >= 2)")
    demo.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    demo.add_argument("--new-tokens", type=_positive_int, default=8)
    demo.add_argument("--no-check", action="store_true", help="skip the comparison with PEFT")
    demo.add_argument("--tp", type=int, default=1,
                      help="tensor-parallel processes: run under torchrun --nproc-per-node N (transformers' "
                           "tensor-parallel plan; each rank holds its share of every expert and adapter)")
    demo.add_argument("--ep", type=int, default=1,
                      help="with --tp N: N shards the experts by expert instead (transformers' "
                           "expert-parallel plan over the same ranks)")
    demo.set_defaults(func=cmd_demo)
    smoke = sub.add_parser("smoke", help="run the base fused MoE on small shapes and check it")
    smoke.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    smoke.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default=None)
    smoke.add_argument("--seed", type=int, default=0)
    smoke.set_defaults(func=cmd_smoke)

    inspect = sub.add_parser(
        "inspect", help="show what a PEFT MoE adapter holds; check it against its model",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="""\
Shows what a PEFT LoRA adapter of an MoE model holds, from the adapter alone
(adapter_config.json and the safetensors header): its format (per-expert modules,
Mixtral w1/w2/w3, fused target_parameters), the MoE layers it touches, the experts
it covers, the hidden size H and expert FFN width I its tensor shapes imply, ranks,
lora_alpha / scaling (rsLoRA), the keys it would ignore (attention, shared experts,
dense MLPs) and its size in bytes.

Then the full compatibility check (the adapter read as a pool reads it, with the
model's sizes), against the first of:
  --model DIR
  --experts, --hidden, --intermediate and --layers (all four)
  base_model_name_or_path of the adapter's config, when it is a local folder
  holding a config.json (as given, else relative to the adapter directory)
A hub id or a missing name is only reported: give --model DIR to check.""",
        epilog="""\
exit status:
  0  the adapter was read (and, when checked, fits the model)
  1  the adapter cannot be served: by any model, or by the one checked against
     (the reason on stderr)
  2  usage error: no such adapter directory, no adapter files in it, a config
     that is not a JSON object, or bad options""",
    )
    inspect.add_argument("path", help="PEFT adapter dir (adapter_config.json + adapter_model.safetensors)")
    inspect.add_argument("--model", help="Hugging Face model directory whose config.json gives the MoE shape "
                         "to check against (default: base_model_name_or_path, if a local folder)")
    inspect.add_argument("--experts", type=_positive_int,
                         help="routed experts per MoE layer E (with the next three: a shape to check)")
    inspect.add_argument("--hidden", type=_positive_int, help="hidden size H")
    inspect.add_argument("--intermediate", type=_positive_int, help="per-expert FFN width I")
    inspect.add_argument("--layers", help="comma-separated MoE layer ids, e.g. 1,2,3")
    inspect.add_argument("--max-rank", type=_positive_int, default=64,
                         help="pool max_rank to check against (default 64)")
    inspect.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="bf16",
                         help="pool dtype to check against (default bf16)")
    inspect.add_argument("--show-ignored", type=int, default=10, help="ignored keys to list (default 10)")
    inspect.set_defaults(func=cmd_inspect)

    _add_serve_parser(sub)
    _add_bench_parser(sub)
    return parser


def _add_serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="serve a MoE model and its adapters over an OpenAI-compatible API")
    serve.add_argument("model", nargs="?", help="transformers MoE model directory (with its tokenizer)")
    serve.add_argument("--model", dest="model_flag", metavar="DIR", help="the same as MODEL")
    serve.add_argument("--demo", action="store_true",
                       help="the embedded tiny Qwen3-MoE with the shipped adapters (no download)")
    serve.add_argument("--adapter", action="append", default=[], metavar="NAME=DIR",
                       help="PEFT adapter (repeat)")
    serve.add_argument("--served-model-name", default=None, help="the base model's name in the API")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every endpoint")
    serve.add_argument("--allow-runtime-adapters", action="store_true",
                       help="enable /v1/load_lora_adapter and /v1/unload_lora_adapter")
    serve.add_argument("--adapter-root", type=Path, default=None,
                       help="runtime loads may only read adapters under this directory")
    serve.add_argument("--max-loras", type=_positive_int, default=8, help="adapters resident at once")
    serve.add_argument("--max-rank", type=_positive_int, default=64)
    serve.add_argument("--max-cpu-loras", type=int, default=4, help="host-tier copies of evicted adapters")
    serve.add_argument("--max-running", type=_positive_int, default=32, help="requests in the running batch")
    serve.add_argument("--max-waiting", type=_positive_int, default=256, help="queued requests before 429")
    serve.add_argument("--max-prompt-tokens", type=_positive_int, default=4096)
    serve.add_argument("--max-tokens", type=_positive_int, default=2048,
                       help="the largest max_tokens a request may ask")
    serve.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                       help="before listening, run every launch shape a step can meet, so no request waits "
                            "on a kernel compile (default: on a GPU)")
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    """Serves a model and its adapters over the OpenAI-compatible API until SIGINT/SIGTERM."""
    # usage errors first (exit code 2), before the serve extra is imported and the model is loaded
    if args.model and args.model_flag and args.model != args.model_flag:
        raise UsageError(f"MODEL {args.model} and --model {args.model_flag}: expected one model directory")
    model_arg = args.model or args.model_flag
    flag = "MODEL" if args.model else "--model"
    if args.demo == bool(model_arg):
        raise UsageError("expected a MODEL directory (or --model DIR) or --demo, not both and not neither")
    device = _check_device(args.device)
    model_dir = _check_model_dir(flag, model_arg) if model_arg else None
    from moelora.demo import default_adapters, embedded_adapters_dir

    adapters = default_adapters() if args.demo else {}
    for name, path in _parse_adapters(args.adapter).items():
        adapters[name] = path  # a name of the demo's set is replaced by the one given
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        print(f"moelora serve needs the serve extra: pip install -e \".[serve]\" ({err})", file=sys.stderr)
        return 2
    import logging

    from moelora.serve.server import build_server, load_model, serve_forever

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    model, tokenizer = load_model(model_dir, device, None)
    name = args.served_model_name or ("tiny-qwen3-moe" if args.demo else model_dir.name)
    root = args.adapter_root or (embedded_adapters_dir() if args.demo else None)
    try:
        server = build_server(
            model, tokenizer, adapters=adapters, base_name=name, host=args.host, port=args.port,
            max_loras=args.max_loras, max_rank=args.max_rank, max_cpu_loras=args.max_cpu_loras,
            max_running=args.max_running, max_waiting=args.max_waiting, api_key=args.api_key,
            allow_runtime_adapters=args.allow_runtime_adapters, adapter_root=root,
            max_prompt_tokens=args.max_prompt_tokens, max_tokens_limit=args.max_tokens,
            warmup=args.warmup if args.warmup is not None else next(model.parameters()).is_cuda)
    except (ValueError, OSError) as err:
        print(f"moelora serve: error: {_one_line(err)}", file=sys.stderr)
        return 1
    serve_forever(server)
    return 0


def _one_line(err: BaseException) -> str:
    """An exception's message on one line (a multi-line message would read as several errors)."""
    return "; ".join(part.strip() for part in str(err).splitlines() if part.strip()) or type(err).__name__


class _OneLineErrorParser(argparse.ArgumentParser):
    """argparse's own errors (an unknown choice, a missing value) in the commands' format: one line,
    ``moelora <cmd>: error: ...``, exit code 2; the usage is one ``--help`` away."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    """Runs one command; returns its exit code. Bad input (a :class:`UsageError`, or a ValueError, TypeError
    or AdapterLoadError the library raises about it) is one line on stderr and exit code 2; any other
    exception keeps its traceback."""
    from moelora.adapter_weights import AdapterLoadError

    args = build_parser().parse_args(argv)
    if args.command == "smoke" and args.dtype is None:
        args.dtype = "bf16" if args.device != "cpu" and torch.cuda.is_available() else "fp32"
    try:
        return args.func(args)
    except (ValueError, TypeError, AdapterLoadError) as err:
        print(f"moelora {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
