"""``moelora serve`` as users meet it: a load generator over real HTTP against the server.

    python benchmarks/bench_serve.py --layers 4 --requests 64 --rates 2 8 32 --out benchmarks/results/serve

The model is bench_generate's ``Qwen3MoeForCausalLM`` at Qwen3-30B-A3B layer sizes with random bf16 weights;
33 random adapters (ranks 8/16/32/64 in turn, every expert of every layer) sit in the pool. Prompts are token
ids. Each cell sends ``--requests`` streaming completions with Poisson arrivals at a rate (requests/s),
prompt lengths drawn from (64, 128, 256, 512) and output lengths from (32, 64, 128) with a fixed seed, each
request's adapter drawn among ``N`` of them (N = 0: the base model) uniformly or by popularity (zipf, s=1.1).
The load generator runs in its own process (``--client``), so its Python work takes nothing from the
server's. Per cell: output tokens/s over the cell's wall time, time to first token and inter-token latency
p50/p99.

After the engine's warm-up (every launch shape, as `moelora serve --warmup`) and an untimed warm-up (the
cells' workloads at the highest rate, other seeds), cells: N = 0 and N = 32
zipf at every rate; N = 1, 8 (uniform and zipf) and 32 uniform at the highest rate;
N = 8 uniform at the middle rate with one adapter loaded through ``/v1/load_lora_adapter`` when half the
requests were sent (inter-token p99 of the gaps that ended during the load, against those before it); and
the baseline a user has without moelora: the N = 8 uniform workload through transformers' ``generate`` with
PEFT, one adapter at a time (left-padded batches of up to 32 requests of an adapter, each run to the
longest output of its batch; only the requested tokens count).

``--dry-run``: a tiny model on the CPU, a few requests, to check the script; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

PROMPTS = (64, 128, 256, 512)
OUTPUTS = (32, 64, 128)
RANKS = (8, 16, 32, 64)


def workload(n_requests: int, n_adapters: int, popularity: str, vocab: int, seed: int, dry_run: bool):
    """(prompt ids, output length, adapter name or None) per request, the same for a given seed."""
    rng = random.Random(seed)
    prompts, outputs = ((4, 9), (3, 5)) if dry_run else (PROMPTS, OUTPUTS)
    weights = [1.0 / (k + 1) ** 1.1 for k in range(n_adapters)] if popularity == "zipf" else None
    jobs = []
    for _ in range(n_requests):
        length = rng.choice(prompts)
        adapter = None
        if n_adapters:
            adapter = f"a{rng.choices(range(n_adapters), weights=weights)[0]}"
        jobs.append(([rng.randrange(2, vocab) for _ in range(length)], rng.choice(outputs), adapter))
    return jobs


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# ---------------------------------------------------------------------------------------------- client


async def _client(url: str, jobs, rate: float, base: str, load: dict | None, seed: int) -> dict:
    import httpx

    rng = random.Random(seed)
    records, load_window = [], [None, None]
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1000)) as client:

        async def one(prompt, max_tokens, adapter):
            body = {"model": adapter or base, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "stream": True}
            sent, stamps = time.perf_counter(), []
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    records.append({"error": r.status_code})
                    return
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"text": ""' not in line:
                        stamps.append(time.perf_counter())
            records.append({"sent": sent, "stamps": stamps, "wanted": max_tokens})

        async def load_adapter():
            load_window[0] = time.perf_counter()
            r = await client.post(url + "/v1/load_lora_adapter", json=load)
            load_window[1] = time.perf_counter()
            if r.status_code != 200:
                raise RuntimeError(f"runtime load failed: {r.status_code} {r.text}")

        tasks, start = [], time.perf_counter()
        for k, (prompt, max_tokens, adapter) in enumerate(jobs):
            if load is not None and k == len(jobs) // 2:
                tasks.append(asyncio.create_task(load_adapter()))
            tasks.append(asyncio.create_task(one(prompt, max_tokens, adapter)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    done = [r for r in records if "stamps" in r]
    end = max((r["stamps"][-1] for r in done if r["stamps"]), default=start)
    tokens = sum(len(r["stamps"]) for r in done)
    gaps = [(b - a, b) for r in done for a, b in zip(r["stamps"], r["stamps"][1:], strict=False)]
    ttft = [r["stamps"][0] - r["sent"] for r in done if r["stamps"]]
    result = {
        "requests": len(jobs), "errors": len(records) - len(done), "output_tokens": tokens,
        "short_outputs": sum(len(r["stamps"]) != r["wanted"] for r in done),
        "seconds": end - start, "tok_s": tokens / (end - start) if end > start else 0.0,
        "ttft_p50": _percentile(ttft, 0.5), "ttft_p99": _percentile(ttft, 0.99),
        "itl_p50": _percentile([g for g, _ in gaps], 0.5), "itl_p99": _percentile([g for g, _ in gaps], 0.99),
    }
    if load is not None:
        t0, t1 = load_window
        during = [g for g, at in gaps if t0 <= at <= t1]
        before = [g for g, at in gaps if at < t0]
        result |= {"load_seconds": t1 - t0, "itl_p99_before_load": _percentile(before, 0.99),
                   "itl_p99_during_load": _percentile(during, 0.99), "gaps_during_load": len(during)}
    return result


def run_cell(url: str, spec: dict) -> dict:
    """One cell through a client process (``--client``)."""
    out = subprocess.run([sys.executable, __file__, "--client", url, json.dumps(spec)], capture_output=True,
                         text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"client failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------- baseline


def peft_baseline(model, jobs, adapters: dict[str, int], device, batch_limit: int = 32) -> dict:
    """The workload through PEFT's ``generate``, one adapter at a time (see the module doc)."""
    import torch
    from peft import LoraConfig, get_peft_model

    names = sorted(adapters)
    targets = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    peft_model = None
    for name in names:
        config = LoraConfig(r=adapters[name], lora_alpha=2 * adapters[name], target_modules=[],
                            target_parameters=targets, init_lora_weights=False)
        if peft_model is None:
            peft_model = get_peft_model(model, config, adapter_name=name)
        else:
            peft_model.add_adapter(name, config)
    peft_model.eval()
    by_adapter: dict[str, list] = {n: [] for n in names}
    for prompt, out_len, adapter in jobs:
        by_adapter[adapter].append((prompt, out_len))
    torch.cuda.synchronize() if device.type == "cuda" else None
    start, useful = time.perf_counter(), 0
    with torch.no_grad():
        for name in names:
            peft_model.set_adapter(name)
            group = by_adapter[name]
            for k in range(0, len(group), batch_limit):
                part = group[k : k + batch_limit]
                width = max(len(p) for p, _ in part)
                ids = torch.zeros(len(part), width, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for row, (p, _) in enumerate(part):
                    ids[row, width - len(p):] = torch.tensor(p)
                    mask[row, width - len(p):] = 1
                longest = max(n for _, n in part)
                peft_model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                    max_new_tokens=longest, min_new_tokens=longest, do_sample=False)
                useful += sum(n for _, n in part)
    torch.cuda.synchronize() if device.type == "cuda" else None
    seconds = time.perf_counter() - start
    return {"requests": len(jobs), "output_tokens": useful, "seconds": seconds, "tok_s": useful / seconds}


# ---------------------------------------------------------------------------------------------- main


class _IdTokenizer:
    """Prompts come as token ids; a token's text is its id (every token is one non-empty chunk)."""

    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids) -> str:
        return "".join(f" {i}" for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False) -> str:
        return " ".join(m["content"] for m in messages)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rates", nargs=3, type=float, default=[2.0, 8.0, 32.0])
    parser.add_argument("--max-running", type=int, default=64)
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--out", type=Path, help="write <out>.json and <out>.md")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--client", nargs=2, metavar=("URL", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        spec = json.loads(args.client[1])
        print(json.dumps(asyncio.run(_client(args.client[0], spec["jobs"], spec["rate"], spec["base"],
                                              spec.get("load"), spec["seed"]))))
        return 0

    import torch
    from bench_generate import build_model, device_of, random_adapter
    from bench_hotload import write_f1_adapter

    from moelora.serve.server import build_server

    on_gpu, device, dtype = device_of(parser, args.dry_run)
    if args.dry_run:
        args.requests, args.layers, args.rates = 6, 2, [4.0, 8.0, 16.0]
    model = build_model(args.layers, args.dry_run, device, dtype)
    vocab = model.config.vocab_size
    n_max = 32 if not args.dry_run else 4
    adapter_root = Path(tempfile.mkdtemp(prefix="moelora-bench-"))
    server = build_server(model, _IdTokenizer(), base_name="base", max_loras=n_max + 2, max_rank=64,
                          max_cpu_loras=0, max_running=args.max_running, max_waiting=10_000,
                          max_prompt_tokens=4096, allow_runtime_adapters=True, adapter_root=adapter_root,
                          warmup=False)
    pool = server.engine.handle.pool
    ranks = {f"a{k}": RANKS[k % len(RANKS)] for k in range(n_max)}
    for k, (name, rank) in enumerate(ranks.items()):
        pool.add_adapter_weights(name, random_adapter(pool, rank, seed=k))
    print(f"# model and {n_max} adapters ready", file=sys.stderr, flush=True)
    # The adapter loaded at runtime: a PEFT directory under the server's adapter root.
    write_f1_adapter(adapter_root / "hot", list(server.engine.handle.layer_ids), pool.num_experts,
                     pool.hidden_size, pool.intermediate_size, 16, torch.bfloat16, seed=99)
    started = time.perf_counter()
    server.engine.warm_up()  # the server's --warmup, after the adapters are resident
    print(f"# engine warm-up: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    low, mid, high = args.rates
    cells = [(0, "uniform", r) for r in args.rates] + [(n_max, "zipf", r) for r in args.rates]
    few = min(8, n_max)
    cells += [(1, "uniform", high), (few, "uniform", high), (few, "zipf", high), (n_max, "uniform", high)]
    # Warm-up, untimed: the workloads of the cells at the highest rate (other seeds), so that the kernel
    # variants and layer graphs the cells meet (token counts, rank tiles, adapters per batch) exist first.
    for n, popularity in ((0, "uniform"), (n_max, "zipf"), (few, "zipf"), (n_max, "uniform")):
        warm = workload(args.requests, n, popularity, vocab, seed=7 + n, dry_run=args.dry_run)
        started = time.perf_counter()
        run_cell(server.url, {"jobs": warm, "rate": high, "base": "base", "seed": 7})
        seconds = time.perf_counter() - started
        print(f"# warm-up N={n} {popularity}: {seconds:.0f} s", file=sys.stderr, flush=True)
    results = []
    for n, popularity, rate in cells:
        jobs = workload(args.requests, n, popularity, vocab, seed=1, dry_run=args.dry_run)
        row = run_cell(server.url, {"jobs": jobs, "rate": rate, "base": "base", "seed": 1})
        results.append({"adapters": n, "popularity": popularity, "rate": rate, **row})
        print(json.dumps(results[-1]), flush=True)
    jobs = workload(args.requests, few, "uniform", vocab, seed=1, dry_run=args.dry_run)
    row = run_cell(server.url, {"jobs": jobs, "rate": mid, "base": "base", "seed": 1,
                                "load": {"lora_name": "hot", "lora_path": "hot"}})
    results.append({"adapters": few, "popularity": "uniform", "rate": mid, "runtime_load": True, **row})
    print(json.dumps(results[-1]), flush=True)
    server.stop()
    baseline = None
    if not args.no_baseline:
        server.engine.handle.detach()
        try:
            baseline = peft_baseline(model, jobs, {f"a{k}": ranks[f"a{k}"] for k in range(few)}, device)
        except Exception as err:  # noqa: BLE001 - an older PEFT without target_parameters: say so
            baseline = {"error": f"{type(err).__name__}: {err}"}
        print(json.dumps({"baseline": baseline}), flush=True)
    device_name = torch.cuda.get_device_name() if on_gpu else "cpu (dry run)"
    report = {"device": device_name, "layers": args.layers, "requests": args.requests, "rates": args.rates,
              "cells": results, "peft_baseline": baseline}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
        args.out.with_suffix(".md").write_text(render(report))
    print(render(report))
    return 0


def render(report: dict) -> str:
    lines = [f"# moelora serve, {report['device']}, {report['layers']} layers, {report['requests']} requests "
             "per cell", "", "| adapters | popularity | rate (req/s) | output tok/s | TTFT p50 / p99 (s) | "
             "ITL p50 / p99 (ms) | note |", "|---:|---|---:|---:|---|---|---|"]
    for c in report["cells"]:
        note = ""
        if c.get("runtime_load"):
            before, during = 1e3 * c["itl_p99_before_load"], 1e3 * c["itl_p99_during_load"]
            note = (f"runtime load {c['load_seconds']:.2f} s: ITL p99 {before:.1f} ms before, "
                    f"{during:.1f} ms during ({c['gaps_during_load']} gaps)")
        if c["errors"] or c["short_outputs"]:
            note += f" errors {c['errors']}, short {c['short_outputs']}"
        lines.append(f"| {c['adapters']} | {c['popularity']} | {c['rate']:g} | {c['tok_s']:.0f} | "
                     f"{c['ttft_p50']:.3f} / {c['ttft_p99']:.3f} | {1e3 * c['itl_p50']:.1f} / "
                     f"{1e3 * c['itl_p99']:.1f} | {note} |")
    base = report.get("peft_baseline")
    if base:
        told = f"{base['tok_s']:.0f} output tok/s" if "tok_s" in base else base["error"]
        lines += ["", f"PEFT generate, one adapter at a time (the N=8 uniform workload): {told}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
