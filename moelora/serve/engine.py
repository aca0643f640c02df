"""The serving loop: requests of many adapters join and leave one running batch every step.

An :class:`Engine` owns a transformers MoE model with an attached :class:`moelora.integrations.MoELoRAHandle`
and runs one background thread. Each step:

1. requests leave: finished and cancelled ones drop out of the running batch, and the KV cache columns no
   remaining row needs are cut;
2. waiting requests are admitted while fewer than ``max_running`` run;
3. one decode forward runs every running request's next token together, each row with its own adapter
   (``handle.step``: the pool batch of each token count is rebuilt in place, not allocated);
4. prompts go through the model in chunks with what is left of the step's token budget
   (``max_step_tokens``, at least ``min_prefill_tokens``): a long prompt takes several steps and never
   stalls the decoding requests for longer than one chunk. A request whose prompt is done emits its first
   token and its cache joins the running batch, left-padded to the batch's length and masked.

Decode and prompt chunks run as separate forwards of one step: transformers' attention takes rows padded
to one length, and a decode row padded to a chunk's length would cost the chunk's work.

Adapters: ``load_adapter`` loads in the background while the loop keeps stepping (``load_adapter_async``);
``unload_adapter`` stops admitting requests for the adapter at once and unloads it after the running ones
finish (they never run on other weights). A request for an adapter in the pool's host tier brings it back.

Nothing here imports an HTTP framework: :mod:`moelora.serve.api` puts an OpenAI-compatible API on top.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

__all__ = ["Engine", "EngineRequest", "SamplingParams"]

log = logging.getLogger("moelora.serve")


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen. ``temperature`` 0 is greedy; ``stop`` strings end the text
    before them; ``seed`` makes sampling repeatable."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass
class EngineRequest:
    """One sequence to generate. The engine calls ``on_token(token_id, text_delta)`` for every new token
    and ``on_finish(reason)`` once (``"stop"``, ``"length"``, ``"cancelled"`` or ``"error: ..."``), both
    from its own thread."""

    prompt_ids: list[int]
    adapter: str | None
    params: SamplingParams
    on_token: Callable[[int, str], None] = lambda token, text: None
    on_finish: Callable[[str], None] = lambda reason: None
    request_id: str = ""
    # Filled by the engine.
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of ``text`` handed to on_token
    _prefix_offset: int = 0  # incremental detokenization: tokens decoded for context
    _read_offset: int = 0  # tokens whose text is in ``text``
    arrived: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    cancelled: bool = False
    _generator: torch.Generator | None = None


class _Prefill:
    """An admitted request whose prompt is still going through the model, a chunk per step."""

    __slots__ = ("cache", "done", "request")

    def __init__(self, request: EngineRequest) -> None:
        self.request, self.done, self.cache = request, 0, None


class _Row:
    """A running request's place in the batch: its real tokens so far (``length``)."""

    __slots__ = ("length", "request")

    def __init__(self, request: EngineRequest, length: int) -> None:
        self.request, self.length = request, length


class Engine:
    """Continuous batching over one model with many adapters.

    Args:
        model: a transformers causal LM, ``attach``-ed (``handle``), on its device, in eval mode.
        handle: the :class:`MoELoRAHandle` of ``model``.
        decode: ``token ids -> text`` (the tokenizer's decode).
        eos_token_ids: tokens that end a sequence.
        max_running: requests running (prefilling or decoding) at most.
        max_step_tokens: a step's token budget: every decode row's token, then prompt chunks.
        min_prefill_tokens: prompt tokens a step takes at least, even when decode rows fill the budget.
        max_waiting: requests waiting at most; :meth:`submit` refuses more (the server answers 429).
        max_defer_seconds: how long a request whose adapter finds no free pool slot lets younger requests
            of the running adapters go ahead of it; past it the engine admits nothing new until the running
            requests leave it a slot (no request waits forever behind busy adapters).
    """

    def __init__(
        self,
        model,
        handle,
        *,
        decode: Callable[[Sequence[int]], str],
        eos_token_ids: Sequence[int] = (),
        max_running: int = 32,
        max_waiting: int = 256,
        max_step_tokens: int = 512,
        min_prefill_tokens: int = 32,
        max_defer_seconds: float = 2.0,
    ) -> None:
        self.model, self.handle, self.decode = model, handle, decode
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_running, self.max_waiting = max_running, max_waiting
        self.max_step_tokens, self.min_prefill_tokens = max_step_tokens, min_prefill_tokens
        self.max_defer_seconds = max_defer_seconds
        self.device = next(model.parameters()).device
        # transformers renamed ``past_key_values`` to ``cache`` (5.24); older releases take the old name.
        self._cache_arg = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )
        self._waiting: deque[EngineRequest] = deque()
        self._rows: list[_Row] = []
        self._prefilling: deque[_Prefill] = deque()
        self._cache = None  # the running batch's KV cache, rows in self._rows' order, left-padded
        self._width = 0  # the cache's length (columns)
        self._lock = threading.Condition()
        self._draining: set[str] = set()  # adapters being unloaded: no new requests, unloaded when idle
        self._loading: dict[str, Future] = {}
        self._stop = False
        self._ids = itertools.count()
        self.stats = {
            "requests": 0,
            "finished": 0,
            "tokens": 0,
            "steps": 0,
            "loads": 0,
            "load_seconds": 0.0,
            "unloads": 0,
            "errors": 0,
        }
        self._thread = threading.Thread(target=self._loop, name="moelora-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------ requests

    def submit(self, request: EngineRequest) -> None:
        """Queues ``request``. ValueError for an unknown, loading or unloading adapter; OverflowError when
        ``max_waiting`` requests already wait."""
        with self._lock:
            if self._stop:
                raise RuntimeError("the engine is shutting down")
            name = request.adapter
            if name is not None:
                if name in self._draining:
                    raise ValueError(
                        f"adapter {name!r} is being unloaded; known adapters: {self.adapter_names()}"
                    )
                if name in self._loading:
                    raise ValueError(
                        f"adapter {name!r} is still loading; known adapters: {self.adapter_names()}"
                    )
                if name not in self.handle.pool:
                    raise ValueError(f"unknown adapter {name!r}; known adapters: {self.adapter_names()}")
            if len(self._waiting) >= self.max_waiting:
                raise OverflowError(
                    f"{len(self._waiting)} requests are waiting (max_waiting {self.max_waiting})"
                )
            if request.params.seed is not None:
                request._generator = torch.Generator(device=self.device).manual_seed(request.params.seed)
            request.request_id = request.request_id or f"req-{next(self._ids)}"
            self._waiting.append(request)
            self.stats["requests"] += 1
            self._lock.notify()

    def cancel(self, request: EngineRequest) -> None:
        """Ends ``request`` at the next step (a client that went away): its row leaves the batch."""
        request.cancelled = True
        with self._lock:
            self._lock.notify()

    @property
    def running(self) -> int:
        """Requests decoding or prefilling."""
        return len(self._rows) + len(self._prefilling)

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may hold: ``[0, vocab_size)``."""
        return self.model.get_input_embeddings().num_embeddings

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    # ------------------------------------------------------------------------------------------ adapters

    def adapter_names(self) -> list[str]:
        """Adapters requests may name: resident or in the host tier, not being unloaded."""
        state = self.handle.pool.state()
        return sorted((set(state.resident) | set(state.host)) - self._draining)

    def load_adapter(self, name: str, path) -> Future:
        """Loads ``path`` as ``name`` in the background; requests may name it once the future is done."""
        with self._lock:
            if name in self._loading or name in self._draining:
                doing = "loaded" if name in self._loading else "unloaded"
                raise ValueError(f"adapter {name!r} is being {doing}")
            if name in self.handle.pool:
                raise ValueError(f"adapter {name!r} is already loaded")
            started = time.monotonic()
            future = self.handle.load_adapter_async(name, path)
            self._loading[name] = future

        def done(f: Future) -> None:
            with self._lock:
                self._loading.pop(name, None)
                if f.exception() is None:
                    self.stats["loads"] += 1
                    self.stats["load_seconds"] += time.monotonic() - started
            log.info(
                "adapter %s loaded from %s in %.2f s%s",
                name,
                path,
                time.monotonic() - started,
                "" if f.exception() is None else f" FAILED: {f.exception()}",
            )

        future.add_done_callback(done)
        return future

    def unload_adapter(self, name: str) -> int:
        """Stops admitting requests for ``name`` and unloads it once no running or waiting request uses it
        (at once when none does). Returns how many requests it waits for."""
        with self._lock:
            if name not in self.handle.pool or name in self._draining:
                raise ValueError(f"unknown adapter {name!r}; known adapters: {self.adapter_names()}")
            self._draining.add(name)
            users = self._users_of(name)
            self._lock.notify()
        if not users:
            self._unload_drained()
        return users

    def users_of(self, name: str) -> int:
        """Requests running or waiting with adapter ``name``."""
        with self._lock:
            return self._users_of(name)

    def _users_of(self, name: str) -> int:
        return (
            sum(1 for r in self._rows if r.request.adapter == name)
            + sum(1 for p in self._prefilling if p.request.adapter == name)
            + sum(1 for r in self._waiting if r.adapter == name)
        )

    def _unload_drained(self) -> None:
        with self._lock:
            idle = [n for n in self._draining if not self._users_of(n)]
            for name in idle:
                self._draining.discard(name)
                try:
                    self.handle.unload_adapter(name)
                    if any(name in pool for pool in self.handle.pools.values()):
                        self.handle.unload_adapter(name)  # an API unload forgets the host copy too
                    self.stats["unloads"] += 1
                    log.info("adapter %s unloaded", name)
                except ValueError as err:  # pinned, or already gone
                    log.warning("adapter %s not unloaded: %s", name, err)

    # ------------------------------------------------------------------------------------------ warm-up

    def warm_up(self, *, progress: Callable[[str], None] | None = None) -> int:
        """Runs, before any request, one forward of every launch shape a step can meet, so that no request
        waits on a kernel compile, a launch plan or a CUDA graph capture later: token counts of powers of
        two up to ``max_step_tokens`` (and it), each with no adapter and with 1, 2, 3, 4, 8, 16 and 32 of
        the resident adapters (as many as there are), for each rank tile among them (every launch rule
        decides by the token count, the adapter count as ``launch_adapter_count`` plans it, and the rank
        tile). The forwards are one token per row, each row its own adapter, and change no state: no
        adapter is loaded, evicted or left in use. ``progress`` gets a line per rank tile. Returns the
        forwards run. RuntimeError while requests run or wait (a server calls it before it listens)."""
        from triton_ops.plan import lora_rank_block

        say = progress or log.info
        pool = self.handle.pool
        with self._lock:
            if self._waiting or self._rows or self._prefilling:
                raise RuntimeError("warm_up runs before requests: some are running or waiting")
            state = pool.state()
            tiles: dict[int, list[str]] = {}
            for name in state.resident:
                tile = lora_rank_block(pool.slot_rank_host[state.slots[name]])
                tiles.setdefault(tile, []).append(name)
            budget = self.max_step_tokens
            counts = sorted({1 << k for k in range(budget.bit_length())} | {budget})
            mixes: dict[str, list[list[str]]] = {"no adapter": [[]]}
            for tile in sorted(tiles):
                usable = tiles[tile] + [n for t in sorted(tiles) if t < tile for n in tiles[t]]
                mixes[f"rank tile {tile}"] = [usable[:n] for n in (1, 2, 3, 4, 8, 16, 32)
                                              if n <= min(len(usable), pool.max_loras)]
            vocab = self.vocab_size
            forwards, started = 0, time.monotonic()
            with torch.inference_mode(), _attention_without_cudnn():
                for label, name_sets in mixes.items():
                    began = time.monotonic()
                    for names in name_sets:
                        for tokens in counts:
                            if tokens < len(names):
                                continue
                            rows = [names[i % len(names)] if names else None for i in range(tokens)]
                            ids = torch.randint(0, vocab, (tokens, 1), device=self.device)
                            with self.handle.step(rows):
                                self.model(input_ids=ids, use_cache=False)
                            forwards += 1
                    say(f"warm-up: {label}, {len(name_sets)} adapter mixes x {len(counts)} token counts "
                        f"(1 to {counts[-1]}): {time.monotonic() - began:.1f} s")
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            say(f"warm-up done: {forwards} forwards in {time.monotonic() - started:.1f} s")
            return forwards

    # ------------------------------------------------------------------------------------------ lifecycle

    def shutdown(self, *, cancel: bool = False, timeout: float = 30.0) -> None:
        """Stops the loop once the running and waiting requests finished (``cancel``: ends them now)."""
        with self._lock:
            if cancel:
                for r in self._waiting:
                    r.cancelled = True
                for r in self._rows:
                    r.request.cancelled = True
                for p in self._prefilling:
                    p.request.cancelled = True
            self._stop = True
            self._lock.notify()
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self._waiting and not self._rows and not self._prefilling:
                    self._lock.wait()
                if self._stop and not self._waiting and not self._rows and not self._prefilling:
                    return
            try:
                with torch.inference_mode(), _attention_without_cudnn():
                    self._step()
            except Exception as err:  # noqa: BLE001 - a broken step fails its requests, not the server
                log.exception("engine step failed")
                self.stats["errors"] += 1
                for request in [r.request for r in self._rows] + [p.request for p in self._prefilling]:
                    self._finish(request, f"error: {err}")
                self._rows, self._cache, self._width = [], None, 0
                self._prefilling.clear()
            if self._draining:
                self._unload_drained()

    # ------------------------------------------------------------------------------------------ one step

    def _step(self) -> None:
        """One step: a decode forward of every running row, then prefill chunks of admitted requests
        with what is left of the step's token budget (``max_step_tokens``, decode rows counted first; at
        least ``min_prefill_tokens`` so a full batch never starves new requests)."""
        self.stats["steps"] += 1
        self._drop_rows([i for i, r in enumerate(self._rows) if r.request.cancelled], "cancelled")
        self._admit()
        if self._rows:
            self._decode()
        budget = max(self.max_step_tokens - len(self._rows), self.min_prefill_tokens)
        # Whole prompts that fit go through one left-padded forward together (their padded size counted
        # against the budget); a prompt longer than what is left goes alone, a chunk per step.
        group: list[_Prefill] = []
        width = 0
        while self._prefilling and budget > len(group) * width:
            job = self._prefilling[0]
            request = job.request
            if request.cancelled or (request.adapter is not None and request.adapter not in self.handle.pool):
                self._prefilling.popleft()
                gone = f"error: adapter {request.adapter!r} is no longer loaded"
                self._finish(request, "cancelled" if request.cancelled else gone)
                continue
            left = len(request.prompt_ids) - job.done
            if job.done == 0 and (len(group) + 1) * max(width, left) <= budget:
                group.append(self._prefilling.popleft())
                width = max(width, left)
                continue
            if group:
                break  # the next prompt waits for the next step
            take = min(budget, left)
            try:
                self._prefill_chunk(job, take)
            except ValueError as err:  # its adapter went away since the check above (AdapterLoadError too)
                self._prefilling.popleft()
                self._finish(request, f"error: {err}")
                continue
            budget -= take
            if job.done == len(request.prompt_ids):
                self._prefilling.popleft()
        if group:
            try:
                self._prefill_whole(group, width)
            except ValueError as err:
                for job in group:
                    self._finish(job.request, f"error: {err}")

    def _admit(self) -> None:
        """Waiting requests start, oldest first, while fewer than ``max_running`` run and their adapters fit
        the pool's slots beside those of the running ones. A request whose adapter does not fit yet waits,
        and younger requests of running adapters go ahead of it, for ``max_defer_seconds``; after that
        nothing younger starts until it does."""
        slots = self.handle.pool.max_loras
        now = time.monotonic()
        with self._lock:
            active = {r.request.adapter for r in self._rows} | {p.request.adapter for p in self._prefilling}
            active.discard(None)
            later: list[EngineRequest] = []
            while self._waiting and len(self._rows) + len(self._prefilling) < self.max_running:
                request = self._waiting.popleft()
                name = request.adapter
                if name is not None and name not in active and len(active) >= slots:
                    later.append(request)
                    if now - request.arrived > self.max_defer_seconds:
                        break  # it has waited long enough: the running adapters drain until it fits
                    continue
                if name is not None:
                    active.add(name)
                self._prefilling.append(_Prefill(request))
            self._waiting.extendleft(reversed(later))

    def _prefill_whole(self, jobs: list[_Prefill], width: int) -> None:
        """Whole prompts of ``jobs`` in one forward, left-padded to ``width``; each emits its first token
        and joins the running batch."""
        from transformers import DynamicCache

        ids = torch.zeros(len(jobs), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, job in enumerate(jobs):
            prompt = job.request.prompt_ids
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        # The left padding costs no expert work: its tokens route to no expert (their outputs are masked).
        padding = (mask == 0).flatten() if any(len(job.request.prompt_ids) < width for job in jobs) else None
        with self.handle.step([job.request.adapter for job in jobs], padding=padding):
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                             **{self._cache_arg: cache})
        rows = []
        tokens = self._choose([job.request for job in jobs], out.logits[:, -1])
        for row, (job, token) in enumerate(zip(jobs, tokens, strict=True)):
            job.done = len(job.request.prompt_ids)
            if not self._emit(job.request, token):
                rows.append(row)
        if rows:
            cache = out[self._cache_arg]
            if len(rows) < len(jobs):
                cache.batch_select_indices(torch.tensor(rows, device=self.device))
            self._join([_Row(jobs[r].request, jobs[r].done) for r in rows], cache, width)

    def _prefill_chunk(self, job: _Prefill, take: int) -> None:
        """The next ``take`` prompt tokens of ``job`` through the model (its own cache, one row); after the
        last chunk, its first token, and the request joins the running batch."""
        from transformers import DynamicCache

        request = job.request
        if job.cache is None:
            job.cache = DynamicCache(config=self.model.config)
        ids = torch.tensor([request.prompt_ids[job.done : job.done + take]], device=self.device)
        with self.handle.step([request.adapter]):
            out = self.model(input_ids=ids, use_cache=True, **{self._cache_arg: job.cache})
        job.cache, job.done = out[self._cache_arg], job.done + take
        if job.done < len(request.prompt_ids):
            return
        if self._emit(request, self._choose([request], out.logits[:, -1])[0]):
            return  # finished on its first token: never joins the batch
        self._join([_Row(request, job.done)], job.cache, job.done)

    def _join(self, rows: list[_Row], cache, width: int) -> None:
        """Adds prefilled ``rows`` (their cache: ``width`` columns, each row's real tokens the last
        ``row.length`` of them) to the running batch."""
        from transformers import DynamicCache

        if self._cache is None:
            self._cache, self._width, self._rows = cache, width, list(rows)
            return
        full = max(self._width, width)
        merged = DynamicCache(config=self.model.config)
        for idx, (old, new) in enumerate(zip(self._cache.layers, cache.layers, strict=True)):
            keys = torch.cat((_left_pad(old.keys, full), _left_pad(new.keys, full)))
            values = torch.cat((_left_pad(old.values, full), _left_pad(new.values, full)))
            merged.update(keys, values, idx)
        self._cache, self._width = merged, full
        self._rows.extend(rows)

    def _decode(self) -> None:
        rows = self._rows
        width = self._width
        ids = torch.tensor([[r.request.output_ids[-1]] for r in rows], device=self.device)
        lengths = torch.tensor([r.length for r in rows], device=self.device)
        columns = torch.arange(width + 1, device=self.device)
        # Row r's real tokens are the last length_r columns of the cache, then the new one.
        mask = (columns[None, :] >= (width - lengths)[:, None]).long()
        positions = lengths[:, None]
        with self.handle.step([r.request.adapter for r in rows]):
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{self._cache_arg: self._cache},
            )
        self._cache, self._width = out[self._cache_arg], width + 1
        done = []
        tokens = self._choose([row.request for row in rows], out.logits[:, -1])
        for i, (row, token) in enumerate(zip(rows, tokens, strict=True)):
            row.length += 1
            if self._emit(row.request, token):
                done.append(i)
        self._drop_rows(done, None)

    def _drop_rows(self, indices: list[int], reason: str | None) -> None:
        if not indices:
            return
        for i in indices:
            if reason is not None:
                self._finish(self._rows[i].request, reason)
        leaving = set(indices)
        keep = [i for i in range(len(self._rows)) if i not in leaving]
        self._rows = [self._rows[i] for i in keep]
        if not keep:
            self._cache, self._width = None, 0
            return
        index = torch.tensor(keep, device=self.device)
        self._cache.batch_select_indices(index)
        unused = self._width - max(r.length for r in self._rows)  # columns every remaining row pads
        if unused > 0:
            for layer in self._cache.layers:
                layer.keys = layer.keys[:, :, unused:]
                layer.values = layer.values[:, :, unused:]
            self._width -= unused

    # ------------------------------------------------------------------------------------------ tokens

    def _choose(self, requests: list[EngineRequest], logits: torch.Tensor) -> list[int]:
        """Each request's next token from its row of ``logits`` (rows, vocab): the greedy rows by one argmax
        and one read of the device for all of them, the sampled rows each with its own generator."""
        greedy = [i for i, r in enumerate(requests) if r.params.temperature <= 0.0]
        tokens = [0] * len(requests)
        if greedy:
            picked = logits if len(greedy) == len(requests) else logits[greedy]
            for i, token in zip(greedy, picked.argmax(dim=-1).tolist(), strict=True):
                tokens[i] = token
        for i, request in enumerate(requests):
            if request.params.temperature > 0.0:
                tokens[i] = self._sample(request, logits[i])
        return tokens

    def _emit(self, request: EngineRequest, token: int) -> bool:
        """Hands ``request`` its next token; True when the request is finished."""
        if request.cancelled:
            self._finish(request, "cancelled")
            return True
        request.output_ids.append(token)
        if request.first_token_at is None:
            request.first_token_at = time.monotonic()
        self.stats["tokens"] += 1
        if token in self.eos_token_ids:
            self._send(request, token, len(request.text))
            self._finish(request, "stop")
            return True
        text = request.text = request.text + self._new_text(request)
        stops = request.params.stop
        stop_at = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        if stop_at >= 0:  # the text ends before the stop string
            self._send(request, token, stop_at)
            request.text = text[:stop_at]
            self._finish(request, "stop")
            return True
        if len(request.output_ids) >= request.params.max_tokens:
            self._send(request, token, len(text))
            self._finish(request, "length")
            return True
        # Text that may be the start of a stop string waits until the next tokens tell.
        held = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        self._send(request, token, len(text) - held)
        return False

    def _new_text(self, request: EngineRequest) -> str:
        """The text the newest token adds, decoding a few tokens around it rather than the whole output
        (a token's text can depend on its neighbours; an incomplete character waits for the next token)."""
        ids = request.output_ids
        start, read = request._prefix_offset, request._read_offset
        before = self.decode(ids[start:read])
        after = self.decode(ids[start:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # nothing printable yet
        request._prefix_offset, request._read_offset = read, len(ids)
        return after[len(before):]

    @staticmethod
    def _send(request: EngineRequest, token: int, upto: int) -> None:
        """Hands the client ``request.text`` up to ``upto`` characters, past what it already has."""
        delta = request.text[request.sent : upto]
        request.sent = max(request.sent, upto)
        request.on_token(token, delta)

    @staticmethod
    def _sample(request: EngineRequest, logits: torch.Tensor) -> int:
        params = request.params
        logits = logits.float()
        probs = torch.softmax(logits / params.temperature, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(0) - sorted_probs < params.top_p  # the smallest set reaching top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs, 1, generator=request._generator))

    def _finish(self, request: EngineRequest, reason: str) -> None:
        self.stats["finished"] += 1
        try:
            request.on_finish(reason)
        except Exception:  # noqa: BLE001 - a client callback must not stop the loop
            log.exception("on_finish of %s failed", request.request_id)


# Engines of one process whose steps are running now, and the cuDNN SDPA flag from before the first.
class _SharedFlagOff:
    """A process-wide flag turned off while any of several overlapping users needs it off: the first to
    start saves it and turns it off, the last to end puts it back as it was. (Each user saving and
    restoring it, as ``torch.nn.attention.sdpa_kernel`` does, leaves it off for good when two users
    overlap: the second saves the first's "off".) ``get`` / ``set`` read and write the flag."""

    def __init__(self, get: Callable[[], bool], set: Callable[[bool], None]) -> None:  # noqa: A002
        self._get, self._set = get, set
        self._lock = threading.Lock()
        self.users = 0
        self._before = True

    @contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self.users == 0:
                self._before = self._get()
                self._set(False)
            self.users += 1
        try:
            yield
        finally:
            with self._lock:
                self.users -= 1
                if self.users == 0:
                    self._set(self._before)


#: SDPA without its cuDNN backend for the engine's forwards. cuDNN attention builds an execution plan for
#: every new query/key shape, and a serving batch's key length changes every step: each step then waits on
#: a plan build (tens to hundreds of milliseconds) where the other backends launch at once. torch keeps
#: the flag process-wide, so the steps of every engine in the process share one count.
_attention_without_cudnn = _SharedFlagOff(torch.backends.cuda.cudnn_sdp_enabled,
                                          torch.backends.cuda.enable_cudnn_sdp)


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` (B, heads, T, d) with zero columns in front up to ``width``."""
    missing = width - t.shape[2]
    if missing <= 0:
        return t
    return torch.cat((t.new_zeros(*t.shape[:2], missing, t.shape[3]), t), dim=2)
