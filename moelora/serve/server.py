"""``moelora serve``: a transformers MoE model, its adapters and the HTTP API, in one process."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from moelora.serve.engine import Engine

__all__ = ["AsciiTokenizer", "Server", "build_server"]

log = logging.getLogger("moelora.serve")


class AsciiTokenizer:
    """The embedded tiny model's tokenizer: one token per ASCII character (its vocabulary is 128), other
    characters as ``?``; a plain ``role: content`` chat template."""

    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return [b if b < 128 else ord("?") for b in text.encode("ascii", errors="replace")]

    def decode(self, ids) -> str:
        return "".join(chr(i) if 0 <= i < 128 else "?" for i in ids)

    def apply_chat_template(
        self, messages, add_generation_prompt: bool = True, tokenize: bool = False
    ) -> str:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant:" if add_generation_prompt else "")


@dataclass
class Server:
    """A running server: ``url``, and ``stop()`` (finishes in-flight requests, then returns)."""

    url: str
    engine: Engine
    _uvicorn: object
    _thread: threading.Thread

    def stop(self, *, cancel: bool = False) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(30)
        self.engine.shutdown(cancel=cancel)


def load_model(model_dir: Path | None, device: str, dtype: torch.dtype | None):
    """The model and its tokenizer: ``model_dir`` (a transformers checkpoint with its tokenizer; a gpt-oss
    one with MXFP4 experts through ``load_packed_gpt_oss``, its experts packed), or the embedded tiny
    Qwen3-MoE with the ASCII tokenizer when None. ValueError, naming the directory or the
    device, for a CUDA device torch does not see or a checkpoint transformers cannot load."""
    from transformers import AutoModelForCausalLM

    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: torch sees no CUDA GPU on this machine; expected 'cpu'")
    if model_dir is None:
        from moelora.demo import default_model

        model = AutoModelForCausalLM.from_pretrained(default_model(), dtype=dtype or torch.float32)
        tokenizer = AsciiTokenizer()
    else:
        from transformers import AutoTokenizer

        from moelora.integrations.gpt_oss import is_packed_gpt_oss_checkpoint, load_packed_gpt_oss

        # transformers says OSError for missing files and ValueError for an unknown model type
        try:
            if is_packed_gpt_oss_checkpoint(model_dir):  # its MXFP4 experts kept packed, read onto the device
                model = load_packed_gpt_oss(model_dir, device, dtype)
            else:
                model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or "auto")
        except (OSError, ValueError) as err:
            raise ValueError(f"model directory {model_dir}: transformers cannot load it as a causal LM "
                             f"({err})") from err
        try:
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
        except (OSError, ValueError) as err:
            raise ValueError(f"model directory {model_dir}: transformers finds no tokenizer in it ({err}); "
                             "expected the tokenizer files beside the model") from err
    return model.to(device).eval(), tokenizer


def build_server(
    model,
    tokenizer,
    *,
    adapters: dict[str, Path] | None = None,
    base_name: str = "base",
    host: str = "127.0.0.1",
    port: int = 0,
    max_loras: int = 8,
    max_rank: int = 64,
    max_cpu_loras: int = 4,
    max_running: int = 32,
    max_waiting: int = 256,
    max_step_tokens: int = 512,
    min_prefill_tokens: int = 32,
    max_defer_seconds: float = 2.0,
    base_experts: str = "auto",
    warmup: bool = False,
    **config,
) -> Server:
    """Attaches a pool to ``model``, loads ``adapters`` and starts the API on ``host:port`` (0: a free port)
    in a background thread. ``warmup``: run :meth:`Engine.warm_up` first (every launch shape compiled and
    captured before the first request). ``config``: the fields of :class:`moelora.serve.api.ServeConfig`."""
    import uvicorn

    import moelora.integrations as mi
    from moelora.serve.api import ServeConfig, build_app

    handle = mi.attach(model, max_loras=max_loras, max_rank=max_rank, max_cpu_loras=max_cpu_loras,
                       base_experts=base_experts)
    if config.get("allow_runtime_adapters"):
        # The load process imports torch for seconds: started now, not at the first runtime load.
        for pool in handle.pools.values():
            with contextlib.suppress(ValueError):  # a pool that loads in a thread (CPU)
                pool.start_load_process()
    for name, path in (adapters or {}).items():
        handle.load_adapter(name, path)
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos |= set(config_eos) if isinstance(config_eos, (list, tuple)) else {config_eos} - {None}
    engine = Engine(
        model,
        handle,
        decode=tokenizer.decode,
        eos_token_ids=sorted(eos),
        max_running=max_running,
        max_waiting=max_waiting,
        max_step_tokens=max_step_tokens,
        min_prefill_tokens=min_prefill_tokens,
        max_defer_seconds=max_defer_seconds,
    )
    if warmup:
        engine.warm_up()
    app = build_app(engine, tokenizer, ServeConfig(base_name=base_name, **config))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    server.install_signal_handlers = lambda: None  # the caller's thread owns the signals
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="moelora-http", daemon=True)
    thread.start()
    bound_host, bound_port = sock.getsockname()[:2]
    while not server.started and thread.is_alive():
        threading.Event().wait(0.01)
    return Server(f"http://{bound_host}:{bound_port}", engine, server, thread)


def serve_forever(server: Server) -> None:
    """Blocks until SIGINT/SIGTERM, then stops: no new requests, in-flight ones finish."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"moelora serving on {server.url} (Ctrl-C stops)", flush=True)
    stop.wait()
    print("shutting down: finishing in-flight requests", flush=True)
    server.stop()
