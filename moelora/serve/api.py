"""An OpenAI-compatible HTTP API over an :class:`moelora.serve.engine.Engine` (FastAPI; ``pip install
"moelora[serve]"``).

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (streaming as server-sent events, or whole),
``/v1/models``, ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's names and bodies; only
with ``allow_runtime_adapters``, paths only under ``adapter_root``), ``/health`` and ``/metrics``
(Prometheus text). The request's ``model`` picks the adapter; the base model's name means no adapter.
With ``api_key`` every endpoint wants ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from moelora.serve.engine import Engine, EngineRequest, SamplingParams

__all__ = ["ServeConfig", "build_app"]

log = logging.getLogger("moelora.serve")


@dataclass
class ServeConfig:
    """Limits and switches of the HTTP layer."""

    base_name: str
    api_key: str | None = None
    allow_runtime_adapters: bool = False
    adapter_root: Path | None = None
    max_prompt_tokens: int = 4096
    max_tokens_limit: int = 2048
    max_n: int = 8
    retry_after_s: int = 1


class _BadRequest(Exception):
    def __init__(
        self, status: int, message: str, field: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.field, self.headers = status, message, field, headers


def _error(status: int, message: str, field: str | None = None, headers: dict | None = None) -> JSONResponse:
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        429: "rate_limit_error",
    }.get(status, "server_error")
    body = {"error": {"message": message, "type": kind, "param": field, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def _field(
    body: dict, name: str, kind: type | tuple[type, ...], default: Any = None, *, check=None, what: str = ""
) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise _BadRequest(400, f"'{name}' must be {what or names}, got {json.dumps(value)[:80]}", name)
    if check is not None and not check(value):
        raise _BadRequest(400, f"'{name}' must be {what}, got {json.dumps(value)[:80]}", name)
    return value


class _Metrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("moelora_requests", "requests finished, by reason", ["reason"], registry=r)
        self.tokens = Counter("moelora_generated_tokens", "tokens generated", registry=r)
        self.running = Gauge("moelora_requests_running", "requests in the running batch", registry=r)
        self.waiting = Gauge("moelora_requests_waiting", "requests waiting to be admitted", registry=r)
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
        self.ttft = Histogram(
            "moelora_time_to_first_token_seconds", "time to first token", registry=r, buckets=buckets
        )
        self.itl = Histogram(
            "moelora_inter_token_latency_seconds", "time between tokens", registry=r, buckets=buckets
        )
        self.adapters = Gauge("moelora_adapters", "adapters by tier", ["tier"], registry=r)
        self.loads = Gauge("moelora_adapter_loads", "adapters loaded through the API", registry=r)
        self.load_seconds = Gauge("moelora_adapter_load_seconds", "seconds spent in those loads", registry=r)
        self.unloads = Gauge("moelora_adapter_unloads", "adapters unloaded through the API", registry=r)
        self.evictions = Gauge(
            "moelora_adapter_evictions", "adapters LRU eviction took out of slots", registry=r
        )
        self.pool_bytes = Gauge("moelora_pool_bytes", "adapter arena bytes", ["state"], registry=r)

    def render(self, engine: Engine) -> bytes:
        from prometheus_client import generate_latest

        self.running.set(engine.running)
        self.waiting.set(engine.waiting)
        state = engine.handle.pool.state()
        self.adapters.labels("resident").set(len(state.resident))
        self.adapters.labels("host").set(len(state.host))
        self.adapters.labels("loading").set(len(state.loading))
        self.loads.set(engine.stats["loads"])
        self.load_seconds.set(engine.stats["load_seconds"])
        self.unloads.set(engine.stats["unloads"])
        self.evictions.set(state.evictions)
        report = engine.handle.pool.memory_report()
        self.pool_bytes.labels("used").set(report.used_bytes)
        self.pool_bytes.labels("free").set(report.free_bytes)
        return generate_latest(self.registry)


def build_app(engine: Engine, tokenizer, config: ServeConfig) -> FastAPI:
    """The FastAPI app serving ``engine``. ``tokenizer`` has ``encode(text) -> ids``, ``decode(ids)`` and
    ``apply_chat_template(messages, add_generation_prompt=True, tokenize=False)``."""
    app = FastAPI(title="moelora", docs_url=None, redoc_url=None)
    metrics = _Metrics()

    @app.middleware("http")
    async def auth_and_errors(request: Request, call_next):
        if config.api_key is not None and request.headers.get("authorization") != f"Bearer {config.api_key}":
            return _error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
        try:
            return await call_next(request)
        except _BadRequest as err:
            return _error(err.status, err.message, err.field, err.headers)

    async def body_of(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as err:
            raise _BadRequest(400, f"the body is not JSON: {err}") from None
        if not isinstance(body, dict):
            raise _BadRequest(400, "the body must be a JSON object")
        return body

    def adapter_of(body: dict) -> str | None:
        model = _field(body, "model", str, config.base_name)
        if model == config.base_name:
            return None
        known = engine.adapter_names()
        if model not in known:
            raise _BadRequest(
                404, f"model {model!r} does not exist; models: {[config.base_name, *known]}", "model"
            )
        return model

    def sampling_of(body: dict) -> tuple[SamplingParams, int, bool]:
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and (
            not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)
        ):
            raise _BadRequest(400, "'stop' must be a string or a list of non-empty strings", "stop")
        params = SamplingParams(
            max_tokens=_field(
                body,
                "max_tokens",
                int,
                16,
                check=lambda v: 1 <= v <= config.max_tokens_limit,
                what=f"an integer from 1 to {config.max_tokens_limit}",
            ),
            temperature=float(
                _field(
                    body,
                    "temperature",
                    (int, float),
                    1.0,
                    check=lambda v: 0 <= v <= 2,
                    what="a number from 0 to 2",
                )
            ),
            top_p=float(
                _field(
                    body, "top_p", (int, float), 1.0, check=lambda v: 0 < v <= 1, what="a number in (0, 1]"
                )
            ),
            seed=_field(body, "seed", int),
            stop=tuple(stop or ()),
        )
        n = _field(
            body,
            "n",
            int,
            1,
            check=lambda v: 1 <= v <= config.max_n,
            what=f"an integer from 1 to {config.max_n}",
        )
        stream = _field(body, "stream", bool, False)
        return params, n, stream

    def check_prompt(ids: list[int]) -> None:
        if not ids:
            raise _BadRequest(400, "the prompt is empty", "prompt")
        vocab = engine.vocab_size
        if not all(0 <= t < vocab for t in ids):  # an id past the embedding would fail the whole step
            raise _BadRequest(400, f"'prompt' token ids must be in [0, {vocab})", "prompt")
        if len(ids) > config.max_prompt_tokens:
            raise _BadRequest(
                400,
                f"the prompt has {len(ids)} tokens, more than max_prompt_tokens {config.max_prompt_tokens}",
                "prompt",
            )

    async def generate(
        request: Request,
        prompt_ids: list[int],
        adapter: str | None,
        params: SamplingParams,
        n: int,
        stream: bool,
        chat: bool,
        model_name: str,
    ):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        created, rid = int(time.time()), f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        requests = []
        for index in range(n):
            seed = None if params.seed is None else params.seed + index
            per = SamplingParams(params.max_tokens, params.temperature, params.top_p, seed, params.stop)

            def on_token(token, text, index=index):
                loop.call_soon_threadsafe(events.put_nowait, ("token", index, text))

            def on_finish(reason, index=index):
                loop.call_soon_threadsafe(events.put_nowait, ("finish", index, reason))

            requests.append(
                EngineRequest(
                    list(prompt_ids), adapter, per, on_token, on_finish, request_id=f"{rid}-{index}"
                )
            )
        try:
            for r in requests:
                engine.submit(r)
        except OverflowError as err:
            for r in requests:
                engine.cancel(r)
            raise _BadRequest(
                429,
                f"the server is busy: {err}; retry later",
                headers={"Retry-After": str(config.retry_after_s)},
            ) from None
        except ValueError as err:
            for r in requests:
                engine.cancel(r)
            raise _BadRequest(404, str(err), "model") from None

        def chunk(index: int, text: str, reason: str | None) -> dict:
            if chat:
                delta = {"content": text} if text else {}
                choice = {"index": index, "delta": delta, "finish_reason": reason}
                return {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model_name,
                    "choices": [choice],
                }
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model_name,
                "choices": [{"index": index, "text": text, "finish_reason": reason, "logprobs": None}],
            }

        last_token_at: dict[int, float] = {}

        def observe(index: int) -> None:
            now = time.monotonic()
            if index in last_token_at:
                metrics.itl.observe(now - last_token_at[index])
            else:
                metrics.ttft.observe(now - requests[index].arrived)
            last_token_at[index] = now
            metrics.tokens.inc()

        def finish_reason(reason: str) -> str:
            metrics.requests.labels(reason.split(":")[0]).inc()
            return "stop" if reason in ("stop", "cancelled") else "length" if reason == "length" else reason

        def log_line(index: int, reason: str) -> None:
            r = requests[index]
            ttft = (r.first_token_at - r.arrived) if r.first_token_at else float("nan")
            log.info(
                "%s model=%s prompt=%d out=%d ttft=%.3fs total=%.3fs finish=%s",
                r.request_id,
                model_name,
                len(prompt_ids),
                len(r.output_ids),
                ttft,
                time.monotonic() - r.arrived,
                reason,
            )

        if stream:

            async def sse():
                open_ = n
                try:
                    if chat:
                        for index in range(n):
                            first = chunk(index, "", None)
                            first["choices"][0]["delta"] = {"role": "assistant"}
                            yield f"data: {json.dumps(first)}\n\n"
                    while open_:
                        kind, index, value = await events.get()
                        if kind == "token":
                            observe(index)
                            if value:
                                yield f"data: {json.dumps(chunk(index, value, None))}\n\n"
                        else:
                            open_ -= 1
                            log_line(index, value)
                            yield f"data: {json.dumps(chunk(index, '', finish_reason(value)))}\n\n"
                    yield "data: [DONE]\n\n"
                finally:  # the client went away (or the stream ended): free its rows
                    for r in requests:
                        engine.cancel(r)

            return StreamingResponse(sse(), media_type="text/event-stream")

        texts, reasons, open_ = [""] * n, [None] * n, n
        try:
            while open_:
                try:
                    kind, index, value = await asyncio.wait_for(events.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        raise asyncio.CancelledError from None
                    continue
                if kind == "token":
                    observe(index)
                    texts[index] += value
                else:
                    open_ -= 1
                    reasons[index] = finish_reason(value)
                    log_line(index, value)
        finally:
            for r in requests:
                engine.cancel(r)
        completion_tokens = sum(len(r.output_ids) for r in requests)
        usage = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(prompt_ids) + completion_tokens,
        }
        if chat:
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": texts[i]},
                    "finish_reason": reasons[i],
                }
                for i in range(n)
            ]
            return {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": model_name,
                "choices": choices,
                "usage": usage,
            }
        choices = [
            {"index": i, "text": texts[i], "finish_reason": reasons[i], "logprobs": None} for i in range(n)
        ]
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model_name,
            "choices": choices,
            "usage": usage,
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request)
        adapter = adapter_of(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = list(tokenizer.encode(prompt))
        elif (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            ids = list(prompt)
        else:
            raise _BadRequest(400, "'prompt' must be a string or a list of token ids", "prompt")
        check_prompt(ids)
        params, n, stream = sampling_of(body)
        return await generate(
            request, ids, adapter, params, n, stream, False, body.get("model") or config.base_name
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await body_of(request)
        adapter = adapter_of(body)
        messages = body.get("messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            )
        ):
            raise _BadRequest(
                400, "'messages' must be a non-empty list of {role, content} strings", "messages"
            )
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = list(tokenizer.encode(text))
        check_prompt(ids)
        params, n, stream = sampling_of(body)
        return await generate(
            request, ids, adapter, params, n, stream, True, body.get("model") or config.base_name
        )

    @app.get("/v1/models")
    async def models():
        names = [config.base_name, *engine.adapter_names()]
        return {
            "object": "list",
            "data": [
                {
                    "id": n,
                    "object": "model",
                    "owned_by": "moelora",
                    "root": config.base_name,
                    "parent": None if n == config.base_name else config.base_name,
                }
                for n in names
            ],
        }

    def runtime_allowed() -> None:
        if not config.allow_runtime_adapters:
            raise _BadRequest(
                403, "runtime adapter loading is off: start the server with --allow-runtime-adapters"
            )

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        runtime_allowed()
        body = await body_of(request)
        name = _field(body, "lora_name", str, check=lambda v: bool(v.strip()), what="a non-empty string")
        raw = _field(body, "lora_path", str, check=lambda v: bool(v.strip()), what="a non-empty string")
        if name is None or raw is None:
            missing = "lora_name" if name is None else "lora_path"
            raise _BadRequest(400, f"'{missing}' is required", missing)
        if name == config.base_name:
            raise _BadRequest(400, f"'lora_name' may not be the base model's name {name!r}", "lora_name")
        path = _inside_root(raw, config.adapter_root)
        try:
            future = engine.load_adapter(name, path)
        except ValueError as err:
            raise _BadRequest(400, str(err), "lora_name") from None
        try:
            await asyncio.wrap_future(future)
        except Exception as err:  # noqa: BLE001 - AdapterLoadError and friends: the reason, as 400
            raise _BadRequest(400, f"adapter {name!r} was not loaded: {err}", "lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        runtime_allowed()
        body = await body_of(request)
        name = _field(body, "lora_name", str)
        if name is None:
            raise _BadRequest(400, "'lora_name' is required", "lora_name")
        try:
            waits = engine.unload_adapter(name)
        except ValueError as err:
            raise _BadRequest(404, str(err), "lora_name") from None
        later = f" after its {waits} running request(s) finish" if waits else ""
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed{later}.")

    @app.get("/health")
    async def health():
        return {"status": "ok", "running": engine.running, "waiting": engine.waiting}

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST

        return PlainTextResponse(metrics.render(engine), media_type=CONTENT_TYPE_LATEST)

    return app


def _inside_root(raw: str, root: Path | None) -> Path:
    """``raw`` resolved (symlinks followed) and refused unless it lies under ``root``."""
    if root is None:
        raise _BadRequest(403, "no --adapter-root was given: adapter paths are refused", "lora_path")
    if "\0" in raw:
        raise _BadRequest(400, "'lora_path' holds a NUL character", "lora_path")
    base = root.resolve()
    path = Path(raw)
    path = (path if path.is_absolute() else base / path).resolve()
    if path != base and base not in path.parents:
        raise _BadRequest(403, f"'lora_path' {raw!r} is outside the adapter root", "lora_path")
    return path
