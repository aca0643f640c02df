"""``moelora demo``: serve one MoE model with several LoRA adapters at once, checked against PEFT.

On the embedded default (the tiny transformers-5 Qwen3-MoE base and PEFT adapters in ``adapters/``):
three adapters are loaded into a three-slot pool, a mixed batch of requests (one with no adapter) is
decoded; while a second round is served, a fourth adapter is hot-loaded asynchronously, which evicts the
least recently used idle adapter; a third round routes new requests to the new adapter and to the
evicted one (brought back from the host tier). Each request's tokens are then checked against PEFT run
on the same inputs (max |delta| of the logits and the greedy continuation). Exit code 1 on any mismatch.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

# The tiny model and adapters are the repository's adapters/ folder, beside the package in a checkout (an
# editable install included); a wheel does not carry them (embedded_adapters_dir says so).
ADAPTERS_DIR = Path(__file__).resolve().parents[1] / "adapters"
DEFAULT_MODEL = ADAPTERS_DIR / "tiny-qwen3-moe"
# Expert-only fixture adapters, whose every LoRA weight the demo serves (``sql`` also carries attention
# LoRA; given with --adapter, the demo leaves it out of the PEFT comparison and says so).
DEFAULT_ADAPTER_NAMES = ("chat", "math", "v4-style", "gate-up-only")
DEFAULT_ADAPTERS = {n: ADAPTERS_DIR / n for n in DEFAULT_ADAPTER_NAMES}


def embedded_adapters_dir() -> Path:
    """The checkout's ``adapters/`` folder (the embedded tiny model and its adapters); ValueError, in one
    line, where this install has none (a wheel installed with ``pip install .``)."""
    if not (DEFAULT_MODEL / "config.json").is_file():
        raise ValueError(f"the embedded tiny model and adapters live in the repository's adapters/ folder, "
                         f"which this install does not have (looked in {ADAPTERS_DIR}): run from a git "
                         "checkout (pip install -e .), or give --model DIR and --adapter NAME=DIR")
    return ADAPTERS_DIR


def default_model() -> Path:
    """The embedded tiny Qwen3-MoE (:func:`embedded_adapters_dir`)."""
    return embedded_adapters_dir() / DEFAULT_MODEL.name


def default_adapters() -> dict[str, Path]:
    """The demo's default adapters by name (:func:`embedded_adapters_dir`)."""
    root = embedded_adapters_dir()
    return {name: root / name for name in DEFAULT_ADAPTER_NAMES}


@dataclass
class Request:
    rid: int
    adapter: str | None
    prompt: torch.Tensor  # (S,) token ids
    round: int
    tokens: torch.Tensor | None = None  # prompt + continuation
    max_delta: float = float("nan")
    same_tokens: bool = False
    notes: list[str] = field(default_factory=list)


class Progress:
    """A small progress bar on stderr (no dependency; quiet when stderr is not a terminal)."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.done, self.label = total, 0, label
        self.tty = sys.stderr.isatty()

    def step(self, what: str = "") -> None:
        self.done += 1
        width = 24
        filled = width * self.done // max(self.total, 1)
        line = f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {what:<28}"
        if self.tty:
            sys.stderr.write(line)
            if self.done == self.total:
                sys.stderr.write("\n")
        elif self.done == self.total:
            sys.stderr.write(line.lstrip("\r") + "\n")
        sys.stderr.flush()


def _generate(model, handle, requests: list[Request], new_tokens: int) -> None:
    """Greedy decode of equal-length prompts, one adapter per row, in one batch."""
    prompts = torch.stack([r.prompt for r in requests]).to(model.device)
    with torch.no_grad(), handle.adapters([r.adapter for r in requests]):
        out = model.generate(
            prompts, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens, pad_token_id=0
        )
    for r, row in zip(requests, out.cpu(), strict=True):
        r.tokens = row


def not_applied_modules(path: Path) -> dict[str, list[str]]:
    """The modules of the adapter at ``path`` whose LoRA moelora does not apply (attention, shared experts,
    dense MLPs, ``modules_to_save``: everything outside the routed experts), as {module: its safetensors
    keys}; read from the config and safetensors header alone."""
    from moelora.peft_loader import describe_peft_adapter

    modules: dict[str, list[str]] = {}
    for key in describe_peft_adapter(path).ignored_keys:
        module = re.sub(r"\.(lora_[A-Za-z_]+|modules_to_save)(\..*)?$", "", key)
        module = module.removeprefix("base_model.model.")
        modules.setdefault(module, []).append(key)
    return modules


def _fold_layers(modules: list[str]) -> list[str]:
    """Module names with their layer ids folded: ``model.layers.{0,1,2}.self_attn.q_proj``."""
    layers_of: dict[str, list[str]] = {}
    for module in modules:
        match = re.match(r"(.*\.layers\.)(\d+)(\..*)$", module)
        pattern, layer = (match.group(1) + "{}" + match.group(3), match.group(2)) if match else (module, "")
        layers_of.setdefault(pattern, []).append(layer)
    folded = []
    for pattern, layers in layers_of.items():
        ids = sorted({int(n) for n in layers if n})
        folded.append(pattern.format("{" + ",".join(map(str, ids)) + "}" if len(ids) > 1 else ids[0])
                      if ids else pattern)
    return folded


def _reference_adapter(path: Path, left_out: dict[str, list[str]], folder: Path) -> Path:
    """A copy of the adapter at ``path`` in ``folder`` without the keys of ``left_out``, for PEFT to apply
    only what moelora applies. PEFT still wraps those modules (their names stay in the config) but, with
    ``init_lora_weights`` true and their weights absent, as a LoRA whose B is zero or, for
    ``modules_to_save``, as an unchanged copy: they leave the outputs as the base model's."""
    import json

    from safetensors.torch import load_file, save_file

    dropped = {key for keys in left_out.values() for key in keys}
    tensors = load_file(str(path / "adapter_model.safetensors"))
    kept = {key: tensor for key, tensor in tensors.items() if key not in dropped}
    save_file(kept, str(folder / "adapter_model.safetensors"))
    config = json.loads((path / "adapter_config.json").read_text())
    config["init_lora_weights"] = True  # other inits (gaussian, PiSSA, ...) would change the outputs
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder


def _check_against_peft(
    model_dir: Path, adapters: dict[str, Path], requests: list[Request], handle, model, progress: Progress,
    left_out: dict[str, dict[str, list[str]]],
) -> None:
    """Logits of the served model on each request's full token sequence vs PEFT's, and PEFT's greedy
    continuation of the same prompt. PEFT applies only what moelora serves: an adapter's ``left_out``
    modules (outside the routed experts) are taken out of its PEFT reference."""
    import tempfile
    import warnings

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    by_adapter: dict[str | None, list[Request]] = {}
    for r in requests:
        by_adapter.setdefault(r.adapter, []).append(r)
    with tempfile.TemporaryDirectory(prefix="moelora-demo-ref-") as scratch:
        for name, group in by_adapter.items():
            ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
            if name is not None:
                path = adapters[name]
                if left_out.get(name):
                    path = _reference_adapter(path, left_out[name], Path(tempfile.mkdtemp(dir=scratch)))
                with warnings.catch_warnings():
                    # the left-out modules' keys are missing from the copy on purpose
                    warnings.filterwarnings("ignore", message=".*missing adapter keys.*")
                    ref = PeftModel.from_pretrained(ref, str(path)).eval()
            ref.to(model.device)
            for r in group:
                seq = r.tokens.unsqueeze(0).to(model.device)
                with torch.no_grad():
                    want = ref(seq).logits.float()
                    with handle.adapters([name]):
                        got = model(seq).logits.float()
                    prompt = r.prompt.unsqueeze(0).to(model.device)
                    cont = ref.generate(
                        prompt,
                        max_new_tokens=len(r.tokens) - len(r.prompt),
                        do_sample=False,
                        min_new_tokens=len(r.tokens) - len(r.prompt),
                        pad_token_id=0,
                    )
                r.max_delta = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
                r.same_tokens = torch.equal(cont[0].cpu(), r.tokens)
                progress.step(f"PEFT check {name or 'base'}")


def run_demo(
    model_dir: Path | None = None,
    adapters: dict[str, Path] | None = None,
    *,
    device: str = "auto",
    new_tokens: int = 8,
    prompt_len: int = 6,
    check: bool = True,
    tol: float = 1e-4,
    seed: int = 0,
    tp: int = 1,
    ep: int = 1,
) -> int:
    """Runs the demo (module docstring); returns the exit code. ``tp`` > 1: under ``torchrun
    --nproc-per-node tp``, the model is loaded with transformers' tensor-parallel plan
    (``DistributedConfig(tp_size=tp)``; with ``ep == tp`` also its expert-parallel plan over the same
    ranks), every rank serves the same requests and checks them against PEFT run in its own process,
    unsharded; rank 0 prints. ``model_dir`` None: the embedded tiny Qwen3-MoE."""
    model_dir = model_dir if model_dir is not None else default_model()
    if ep not in (1, tp):
        raise ValueError(f"--ep {ep}: expected 1 or equal to --tp ({tp}): the expert-parallel ranks are the "
                         "tensor-parallel ones (they hold the same batch)")
    if tp > 1:
        return _run_tensor_parallel(model_dir, adapters, device=device, new_tokens=new_tokens,
                                    prompt_len=prompt_len, check=check, tol=tol, seed=seed, tp=tp, ep=ep)
    return _run(model_dir, adapters, device=device, new_tokens=new_tokens, prompt_len=prompt_len,
                check=check, tol=tol, seed=seed)


def _run_tensor_parallel(model_dir: Path, adapters: dict[str, Path] | None, *, device: str, tp: int,
                         **kwargs) -> int:
    import contextlib
    import os

    import torch.distributed as dist

    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", 1)) != tp:
        raise ValueError(f"--tp {tp}: expected to run under torchrun --nproc-per-node {tp}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    try:
        quiet = dist.get_rank() != 0
        with contextlib.redirect_stdout(open(os.devnull, "w")) if quiet else contextlib.nullcontext():
            code = _run(model_dir, adapters, device=device, tp=tp, **kwargs)
        failed = torch.tensor([code], dtype=torch.int64)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        return int(failed.item())
    finally:
        dist.destroy_process_group()


def _run(
    model_dir: Path,
    adapters: dict[str, Path] | None,
    *,
    device: str,
    new_tokens: int,
    prompt_len: int,
    check: bool,
    tol: float,
    seed: int,
    tp: int = 1,
    ep: int = 1,
) -> int:
    import warnings

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    import moelora.integrations as mi

    hf_logging.disable_progress_bar()
    # PEFT 0.21 warns that pattern keys on target_parameters match nothing; they do apply (adapters/).
    warnings.filterwarnings("ignore", message="The following (rank|alpha)_pattern keys did not match")
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*is deprecated")
    # The handle warns of LoRA outside the routed experts; the demo says it in its own line below.
    warnings.filterwarnings("ignore", message="adapter .* outside the routed experts are not applied")
    adapters = dict(adapters or default_adapters())
    if len(adapters) < 2:
        raise ValueError(f"expected at least two adapters, got {len(adapters)}")
    names = list(adapters)
    resident, hot = names[:-1][:3], names[-1]
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    where = device if tp == 1 else f"{tp} {device} processes, tensor parallel" + (
        ", experts expert-parallel" if ep > 1 else "")
    print(f"moelora demo: {model_dir.name} on {where}, adapters {names} (pool of {len(resident)} slots)")
    left_out = {name: not_applied_modules(path) for name, path in adapters.items()}
    for name, modules in left_out.items():
        if modules:
            keys = sum(len(k) for k in modules.values())
            print(f"adapter {name!r}: LoRA of {', '.join(_fold_layers(list(modules)))} ({keys} tensors, "
                  "outside the routed experts) is not applied, and left out of the comparison with PEFT")

    t0 = time.perf_counter()
    if tp > 1:
        try:
            from transformers.distributed import DistributedConfig
        except ImportError as err:
            raise SystemExit("moelora demo --tp needs a transformers with transformers.distributed."
                             "DistributedConfig (5.24 has it)") from err
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32,
            distributed_config=DistributedConfig(tp_size=tp, **({"ep_size": ep} if ep > 1 else {}))).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval().to(device)
    handle = mi.attach(model, max_loras=len(resident), max_rank=64, max_cpu_loras=len(names))
    timings = {"load model + attach": time.perf_counter() - t0}
    for n in resident:
        t0 = time.perf_counter()
        handle.load_adapter(n, adapters[n])
        timings[f"load {n}"] = time.perf_counter() - t0

    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size

    def make(rid: int, adapter: str | None, rnd: int) -> Request:
        return Request(rid, adapter, torch.randint(1, vocab, (prompt_len,), generator=gen), rnd)

    # Round 1 uses every resident adapter; round 2 leaves the last one idle (the asynchronous load of
    # the new adapter evicts it); round 3 routes to the new adapter, round 4 to the evicted one (back
    # from the host tier, evicting the least recently used idle adapter).
    busy = resident[:-1] or [None]
    round1 = [resident[0], resident[1 % len(resident)], None, resident[-1], resident[0], resident[-1]]
    round2 = [busy[0], busy[-1], None, busy[0]]
    round3 = [hot, None, hot, busy[0]]
    round4 = [resident[-1], None]  # the evicted adapter, back from the host tier
    rounds, rid = [], 0
    for number, names_in_round in enumerate((round1, round2, round3, round4), start=1):
        rounds.append([make(rid + i, n, number) for i, n in enumerate(names_in_round)])
        rid += len(names_in_round)
    requests = [r for rnd in rounds for r in rnd]
    progress = Progress(len(rounds) + (len(requests) if check else 0), "serving")

    t0 = time.perf_counter()
    _generate(model, handle, rounds[0], new_tokens)
    timings["round 1 (6 requests)"] = time.perf_counter() - t0
    progress.step("round 1")

    # Round 2 leaves the last resident adapter idle: the asynchronous load of the fourth evicts it.
    t0 = time.perf_counter()
    future = handle.load_adapter_async(hot, adapters[hot])
    _generate(model, handle, rounds[1], new_tokens)
    future.result()
    timings[f"round 2 + async load of {hot}"] = time.perf_counter() - t0
    evicted = [n for n in resident if not handle.pool.is_resident(n)]
    progress.step("round 2")

    t0 = time.perf_counter()
    _generate(model, handle, rounds[2], new_tokens)
    timings[f"round 3 (new adapter {hot})"] = time.perf_counter() - t0
    progress.step("round 3")

    t0 = time.perf_counter()
    _generate(model, handle, rounds[3], new_tokens)
    timings[f"round 4 ({resident[-1]} back from the host tier)"] = time.perf_counter() - t0
    progress.step("round 4")

    if check:
        _check_against_peft(model_dir, adapters, requests, handle, model, progress, left_out)

    ok = True
    print()
    print("| req | round | adapter | prompt | new | max |Δ| logits (rel) | same tokens as PEFT |")
    print("|---:|---:|---|---:|---:|---:|:---:|")
    for r in requests:
        good = (not check) or (r.max_delta <= tol and r.same_tokens)
        ok &= good
        delta = f"{r.max_delta:.2e}" if check else "-"
        same = ("✓" if r.same_tokens else "✗") if check else "-"
        print(
            f"| {r.rid} | {r.round} | {r.adapter or '(none)'} | {len(r.prompt)} | "
            f"{len(r.tokens) - len(r.prompt)} | {delta} | {same} |"
        )
    print()
    print(
        f"evicted while serving (LRU, idle): {evicted}; resident now: {handle.pool.adapters()}; "
        f"host tier: {handle.pool.host_adapters()}"
    )
    for what, seconds in timings.items():
        print(f"  {what:44s} {seconds * 1e3:9.1f} ms")
    print(
        "all requests match PEFT" if ok else "MISMATCH against PEFT",
        f"(tolerance {tol:g} of the logit scale)",
    )
    handle.detach()
    handle.pool.close()
    return 0 if ok else 1
