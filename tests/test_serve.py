"""``moelora serve`` end to end on 127.0.0.1: the real server (a random free port, the embedded tiny
Qwen3-MoE, fp32 on the CPU) driven by the official ``openai`` client and by raw HTTP. Greedy outputs are
checked token for token against ``generate`` with PEFT's model of the same adapter; every loop is bounded.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

from moelora.demo import ADAPTERS_DIR  # noqa: E402
from moelora.serve.server import AsciiTokenizer, build_server, load_model  # noqa: E402

KEY = "test-key"
SERVED = ("chat", "math", "down-only")
BASE = "tiny"
TOK = AsciiTokenizer()


@pytest.fixture(scope="module")
def server():
    model, tokenizer = load_model(None, "cpu", None)
    srv = build_server(
        model,
        tokenizer,
        adapters={n: ADAPTERS_DIR / n for n in SERVED},
        base_name=BASE,
        api_key=KEY,
        allow_runtime_adapters=True,
        adapter_root=ADAPTERS_DIR,
        max_running=8,
        max_waiting=64,
        max_prompt_tokens=64,
        max_loras=4,
        max_cpu_loras=2,
        # A small step budget: prompts go through in chunks over several steps, beside decoding rows, and
        # the base rows run the layer's kernels (the server's default on CUDA).
        max_step_tokens=12,
        min_prefill_tokens=4,
        base_experts="kernels",
    )
    yield srv
    srv.stop(cancel=True)


@pytest.fixture(scope="module")
def oracle():
    """Greedy continuation of a prompt by ``generate`` with PEFT's model of the adapter (None: the base)."""
    import sys

    sys.path.insert(0, str(ADAPTERS_DIR.parent))
    import adapters.make_adapters as mk

    models = {None: mk.load_tiny_qwen3_moe().eval()}
    cache = {}

    def run(adapter: str | None, prompt: str, tokens: int) -> str:
        if (adapter, prompt, tokens) not in cache:
            if adapter not in models:
                models[adapter] = mk.load_tiny_qwen3_moe_peft(ADAPTERS_DIR / adapter)
            ids = torch.tensor([TOK.encode(prompt)])
            with torch.inference_mode():
                out = models[adapter].generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=tokens,
                    min_new_tokens=tokens,
                    do_sample=False,
                )
            cache[(adapter, prompt, tokens)] = TOK.decode(out[0, ids.shape[1] :].tolist())
        return cache[(adapter, prompt, tokens)]

    return run


def client(server, **kw):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60, **kw)


def post(server, path, body, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60, **kw)


def test_completions_equal_peft_for_each_adapter_and_the_base(server, oracle):
    c = client(server)
    long_prompt = "A prompt of forty-one characters, chunked."
    for model, adapter in [(BASE, None), *((n, n) for n in SERVED)]:
        got = c.completions.create(model=model, prompt=long_prompt, max_tokens=6, temperature=0)
        assert got.choices[0].text == oracle(adapter, long_prompt, 6), model
        got = c.completions.create(model=model, prompt="The sum of", max_tokens=6, temperature=0)
        assert got.choices[0].text == oracle(adapter, "The sum of", 6), model
        assert got.choices[0].finish_reason == "length" and got.usage.completion_tokens == 6
        streamed = c.completions.create(
            model=model, prompt="The sum of", max_tokens=6, temperature=0, stream=True
        )
        assert "".join(ch.choices[0].text for ch in streamed) == oracle(adapter, "The sum of", 6)


def test_chat_completions_use_the_chat_template(server, oracle):
    c = client(server)
    messages = [{"role": "user", "content": "hi"}]
    prompt = TOK.apply_chat_template(messages)
    got = c.chat.completions.create(model="math", messages=messages, max_tokens=5, temperature=0)
    assert got.choices[0].message.content == oracle("math", prompt, 5)
    parts = c.chat.completions.create(
        model="math", messages=messages, max_tokens=5, temperature=0, stream=True
    )
    assert "".join(p.choices[0].delta.content or "" for p in parts) == oracle("math", prompt, 5)


def test_sixteen_concurrent_requests_over_three_adapters_and_the_base_are_exact(server, oracle):
    c = client(server)
    jobs = [
        (model, f"q{i} " + "x" * (i % 5), 3 + i % 6, i % 2 == 0)
        for i, model in enumerate([BASE, *SERVED] * 5)
    ][:18]

    def run(job):
        model, prompt, tokens, stream = job
        if stream:
            parts = c.completions.create(
                model=model, prompt=prompt, max_tokens=tokens, temperature=0, stream=True
            )
            return "".join(p.choices[0].text for p in parts)
        return (
            c.completions.create(model=model, prompt=prompt, max_tokens=tokens, temperature=0).choices[0].text
        )

    with ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(run, jobs))
    for (model, prompt, tokens, _), text in zip(jobs, texts, strict=True):
        assert text == oracle(None if model == BASE else model, prompt, tokens), (model, prompt)


def test_sampling_n_seed_and_stop(server, oracle):
    c = client(server)
    a = c.completions.create(model="chat", prompt="ab", max_tokens=8, temperature=0.9, top_p=0.9, seed=7, n=2)
    b = c.completions.create(model="chat", prompt="ab", max_tokens=8, temperature=0.9, top_p=0.9, seed=7, n=2)
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices] and len(a.choices) == 2
    full = oracle("chat", "ab", 8)
    stop = full[3:5]
    got = c.completions.create(model="chat", prompt="ab", max_tokens=8, temperature=0, stop=[stop])
    assert got.choices[0].text == full[: full.index(stop)] and got.choices[0].finish_reason == "stop"


def test_models_and_runtime_load_unload_while_requests_run(server, oracle):
    c = client(server)
    assert {m.id for m in c.models.list()} == {BASE, *SERVED}
    background = ThreadPoolExecutor(4)
    running = [
        background.submit(
            lambda: (
                c.completions.create(model="chat", prompt="go", max_tokens=12, temperature=0).choices[0].text
            )
        )
        for _ in range(4)
    ]
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "gu", "lora_path": "gate-up-only"})
    assert r.status_code == 200, r.text
    assert "gu" in server.engine.adapter_names(), server.engine.handle.pool.state()
    got = c.completions.create(model="gu", prompt="go", max_tokens=5, temperature=0).choices[0].text
    assert got == oracle("gate-up-only", "go", 5)
    # Unloading an adapter that running requests use: they finish on its weights, new ones get 404.
    slow = [
        background.submit(
            lambda: (
                c.completions.create(model="gu", prompt="go", max_tokens=20, temperature=0).choices[0].text
            )
        )
        for _ in range(2)
    ]
    deadline = time.monotonic() + 20
    while server.engine.users_of("gu") < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "gu"})
    assert r.status_code == 200 and "removed" in r.text
    refused = post(server, "/v1/completions", {"model": "gu", "prompt": "go", "max_tokens": 2})
    assert refused.status_code == 404
    assert all(f.result(60) == oracle("gate-up-only", "go", 20) for f in slow)
    assert all(f.result(60) == oracle("chat", "go", 12) for f in running)
    deadline = time.monotonic() + 30
    while "gu" in {m.id for m in c.models.list()} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "gu" not in {m.id for m in c.models.list()}
    background.shutdown()


@pytest.mark.parametrize(
    ("path", "body", "key", "status", "words"),
    [
        ("/v1/completions", {"model": "nope", "prompt": "a"}, KEY, 404, "does not exist; models: ['tiny', "),
        ("/v1/completions", {"model": "chat", "prompt": "a"}, "wrong", 401, "API key"),
        ("/v1/completions", {"model": "chat", "prompt": "a"}, None, 401, "API key"),
        ("/v1/completions", {"model": "chat", "prompt": "a" * 65}, KEY, 400, "max_prompt_tokens 64"),
        (
            "/v1/completions",
            {"model": "chat", "prompt": "a", "max_tokens": 0},
            KEY,
            400,
            "'max_tokens' must be",
        ),
        (
            "/v1/completions",
            {"model": "chat", "prompt": "a", "temperature": "hot"},
            KEY,
            400,
            "'temperature'",
        ),
        ("/v1/completions", {"model": "chat", "prompt": 3}, KEY, 400, "'prompt' must be"),
        ("/v1/completions", {"model": "chat", "prompt": [5, 128]}, KEY, 400, "token ids must be in [0, 128)"),
        ("/v1/completions", {"model": "chat", "prompt": [-1]}, KEY, 400, "token ids must be in [0, 128)"),
        ("/v1/chat/completions", {"model": "chat", "messages": []}, KEY, 400, "'messages' must be"),
        (
            "/v1/load_lora_adapter",
            {"lora_name": "x", "lora_path": "../../etc"},
            KEY,
            403,
            "outside the adapter root",
        ),
        (
            "/v1/load_lora_adapter",
            {"lora_name": "x", "lora_path": "/tmp"},
            KEY,
            403,
            "outside the adapter root",
        ),
        (
            "/v1/load_lora_adapter",
            {"lora_name": "x", "lora_path": "tiny-qwen3-moe"},
            KEY,
            400,
            "was not loaded",
        ),
        ("/v1/load_lora_adapter", {"lora_name": "x"}, KEY, 400, "'lora_path' is required"),
        ("/v1/unload_lora_adapter", {"lora_name": "nope"}, KEY, 404, "unknown adapter 'nope'"),
    ],
)
def test_refusals(server, path, body, key, status, words, oracle):
    r = post(server, path, body, key=key)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]
    # Nothing lost: the server still answers, exactly, after every refusal.
    got = client(server).completions.create(model="chat", prompt="ok", max_tokens=3, temperature=0)
    assert got.choices[0].text == oracle("chat", "ok", 3)


def test_bad_json_and_symlink_escape(server, tmp_path):
    r = httpx.post(
        server.url + "/v1/completions",
        content=b"{not json",
        timeout=30,
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    link = ADAPTERS_DIR / "escape-link-test"
    link.symlink_to(tmp_path)
    try:
        r = post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "escape-link-test"})
        assert r.status_code == 403
    finally:
        link.unlink()


def test_client_disconnect_mid_stream_frees_its_row(server):
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        timeout=30,
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": "chat", "prompt": "x", "max_tokens": 2000, "stream": True},
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break
    deadline = time.monotonic() + 30
    while server.engine.running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.engine.running == 0


def test_full_queue_answers_429_with_retry_after():
    model, tokenizer = load_model(None, "cpu", None)
    srv = build_server(
        model,
        tokenizer,
        adapters={"chat": ADAPTERS_DIR / "chat"},
        base_name=BASE,
        max_running=1,
        max_waiting=1,
    )
    body = {"model": "chat", "prompt": "x", "max_tokens": 2000, "temperature": 0, "stream": True}

    def wait_for(condition):
        deadline = time.monotonic() + 30
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert condition()

    try:
        # One request running (a long stream), one waiting: the queue is full, the next is refused at once.
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as running:
            wait_for(lambda: srv.engine.running == 1)
            with ThreadPoolExecutor(1) as pool:
                queued = pool.submit(httpx.post, srv.url + "/v1/completions", timeout=60,
                                     json={"model": "chat", "prompt": "y", "max_tokens": 3, "temperature": 0})
                wait_for(lambda: srv.engine.waiting == 1)
                busy = httpx.post(srv.url + "/v1/completions", json={"model": "chat", "prompt": "z"},
                                  timeout=60)
                assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
                assert "busy" in busy.json()["error"]["message"]
                running.close()  # the client goes away: its row is freed and the queued request runs
                assert queued.result(timeout=60).status_code == 200
    finally:
        srv.stop(cancel=True)


def test_metrics_parse(server):
    client(server).completions.create(model="chat", prompt="m", max_tokens=3, temperature=0)
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    families = {f.name: f for f in prometheus_parser.text_string_to_metric_families(text)}
    for name in (
        "moelora_requests",
        "moelora_generated_tokens",
        "moelora_requests_running",
        "moelora_time_to_first_token_seconds",
        "moelora_inter_token_latency_seconds",
        "moelora_adapters",
        "moelora_pool_bytes",
    ):
        assert name in families, sorted(families)
    tiers = {s.labels["tier"]: s.value for s in families["moelora_adapters"].samples}
    assert tiers["resident"] >= 3
    health = httpx.get(server.url + "/health", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert health.json()["status"] == "ok"
    assert json.loads(health.text)["running"] >= 0
    assert threading.active_count() < 200


def _readme_serve_blocks() -> tuple[str, list[str], str]:
    """The serve section's command, curl and Python blocks of README.md."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("## Serve over HTTP\n", 1)[1].split("\n## ", 1)[0]
    bash = re.findall(r"```bash\n(.*?)```", section, re.S)
    python = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(bash) == 2 and len(python) == 1, section
    return bash[0], [bash[1]], python[0]


def test_readme_serve_examples_run_as_written(tmp_path):
    """``moelora serve --demo`` from the command line (a process of its own, stopped by SIGINT), then the
    README's curl and openai examples against it, with only the port changed."""
    import os
    import shutil
    import signal
    import socket
    import subprocess
    import sys

    command, (curl,), python = _readme_serve_blocks()
    assert command.startswith('pip install -e ".[serve]" && moelora serve --demo --port 8000')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    server = subprocess.Popen([sys.executable, "-m", "moelora.cli", "serve", "--demo", "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            pytest.fail("moelora serve --demo did not come up")
        here = f"127.0.0.1:{port}"
        if shutil.which("curl"):
            out = subprocess.run(["bash", "-c", curl.replace("localhost:8000", here)], capture_output=True,
                                 text=True, timeout=60, check=True).stdout
            reply = json.loads(out)
            assert reply["model"] == "chat" and len(reply["choices"][0]["text"]) > 0
        script = tmp_path / "example.py"
        script.write_text(python.replace("localhost:8000", here))
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                             check=True).stdout
        assert out.splitlines()[0] == str(["tiny-qwen3-moe", "chat", "gate-up-only", "math", "v4-style"])
    finally:
        server.send_signal(signal.SIGINT)
        try:
            log, _ = server.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            raise
    assert server.returncode == 0, log
    assert "shutting down" in log


@pytest.mark.parametrize(("argv", "words"), [
    (["serve"], "expected a MODEL directory (or --model DIR) or --demo"),
    (["serve", "/nonexistent-model-dir"], "no such directory; expected a transformers model directory"),
    (["serve", "--demo", "--adapter", "oops"], "--adapter oops: no '='; expected NAME=DIR"),
])
def test_serve_cli_refusals(argv, words, capsys):
    from moelora.cli import main

    assert main(argv) == 2
    assert words in capsys.readouterr().err


def test_more_adapters_than_slots_take_turns_through_the_host_tier(oracle):
    """One slot, three adapters: requests of every adapter at once are served in turns (an adapter waits
    until the slot is free), those evicted come back from the host tier, and every output is exact."""
    model, tokenizer = load_model(None, "cpu", None)
    srv = build_server(model, tokenizer, adapters={n: ADAPTERS_DIR / n for n in SERVED}, base_name=BASE,
                       max_loras=1, max_cpu_loras=3, max_running=8)
    try:
        assert srv.engine.handle.pool.state().host == ("chat", "math")  # loading each evicted the one before
        c = client(srv)
        jobs = [(name, f"t{i}", 4 + i % 3) for i, name in enumerate([*SERVED, BASE] * 3)]

        def run(job):
            name, prompt, tokens = job
            reply = c.completions.create(model=name, prompt=prompt, max_tokens=tokens, temperature=0)
            return reply.choices[0].text

        with ThreadPoolExecutor(len(jobs)) as pool:
            texts = list(pool.map(run, jobs))
        for (name, prompt, tokens), text in zip(jobs, texts, strict=True):
            assert text == oracle(None if name == BASE else name, prompt, tokens), (name, prompt)
    finally:
        srv.stop(cancel=True)


def test_incremental_detokenization_waits_for_whole_characters():
    """Byte tokens of UTF-8 text: a character split over tokens appears once whole, and the streamed pieces
    add up to the full decode."""
    import types

    from moelora.serve.engine import Engine, EngineRequest, SamplingParams

    def decode(ids):
        return bytes(ids).decode("utf-8", errors="replace")

    engine = types.SimpleNamespace(decode=decode)
    text = "héllo → wörld"
    request = EngineRequest([1], None, SamplingParams())
    pieces = []
    for byte in text.encode():
        request.output_ids.append(byte)
        piece = Engine._new_text(engine, request)
        request.text += piece
        pieces.append(piece)
    assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)
    assert pieces[1] == "" and pieces[2] == "é"  # the two bytes of "é": nothing, then the character


def test_streaming_n_and_stop(server, oracle):
    """n=2 streamed: each choice's pieces add up to its own text; a stop string cuts the streamed text too."""
    c = client(server)
    parts = c.completions.create(model="math", prompt="ab", max_tokens=6, temperature=0, n=2, stream=True)
    texts, reasons = ["", ""], [None, None]
    for part in parts:
        choice = part.choices[0]
        texts[choice.index] += choice.text
        reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert texts == [oracle("math", "ab", 6)] * 2 and reasons == ["length", "length"]
    full = oracle("chat", "ab", 8)
    stop = full[2:4]
    parts = c.completions.create(model="chat", prompt="ab", max_tokens=8, temperature=0, stop=stop,
                                 stream=True)
    assert "".join(p.choices[0].text for p in parts) == full[: full.index(stop)]


def test_a_request_behind_busy_adapters_waits_a_bounded_time():
    """One pool slot kept busy by a stream of requests for one adapter: a request for another adapter lets
    younger ones go ahead for ``max_defer_seconds`` only, then the stream drains and it runs."""
    import moelora.integrations as mi
    from moelora.serve.engine import Engine, EngineRequest, SamplingParams

    model, tokenizer = load_model(None, "cpu", None)
    handle = mi.attach(model, max_loras=1, max_cpu_loras=2)
    for name in ("chat", "math"):
        handle.load_adapter(name, ADAPTERS_DIR / name)
    engine = Engine(model, handle, decode=tokenizer.decode, max_running=2, max_defer_seconds=0.5)
    done = threading.Event()
    try:
        def feed() -> None:  # always a "chat" request waiting, until the "math" one is done (bounded)
            deadline = time.monotonic() + 30
            while not done.is_set() and time.monotonic() < deadline:
                if engine.waiting < 2:
                    engine.submit(EngineRequest(TOK.encode("c"), "chat", SamplingParams(max_tokens=3,
                                                                                         temperature=0)))
                time.sleep(0.01)

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        time.sleep(0.3)  # the stream runs
        started = time.monotonic()
        finished = []
        engine.submit(EngineRequest(TOK.encode("m"), "math", SamplingParams(max_tokens=2, temperature=0),
                                    on_finish=lambda reason: (finished.append(reason), done.set())))
        assert done.wait(20), "the request behind the busy adapter never ran"
        assert finished == ["length"] and time.monotonic() - started < 20
        feeder.join(35)
    finally:
        done.set()
        engine.shutdown(cancel=True)


def test_engine_forwards_run_without_cudnn_attention():
    """cuDNN's SDPA plans every new key length, and a serving batch's changes every step: the engine's
    forwards run with it off, and the process-wide flag is back on between steps."""
    import moelora.integrations as mi
    from moelora.serve.engine import Engine, EngineRequest, SamplingParams

    model, tokenizer = load_model(None, "cpu", None)
    handle = mi.attach(model, max_loras=1)
    seen: list[bool] = []
    hook = model.register_forward_pre_hook(lambda module, args: seen.append(
        torch.backends.cuda.cudnn_sdp_enabled()))
    engine = Engine(model, handle, decode=tokenizer.decode)
    finished = threading.Event()
    try:
        params = SamplingParams(max_tokens=3, temperature=0)
        engine.submit(EngineRequest(TOK.encode("hello there"), None, params,
                                    on_finish=lambda reason: finished.set()))
        assert finished.wait(60)
    finally:
        engine.shutdown(cancel=True)
        hook.remove()
    assert seen and not any(seen), seen
    # Back on once no engine's step runs (another test's engine may still be finishing one).
    from moelora.serve.engine import _attention_without_cudnn

    deadline = time.monotonic() + 30
    while _attention_without_cudnn.users and time.monotonic() < deadline:
        time.sleep(0.01)
    engines = [t.name for t in threading.enumerate() if t.name == "moelora-engine"]
    assert torch.backends.cuda.cudnn_sdp_enabled(), (_attention_without_cudnn.users, engines)


def test_overlapping_engine_steps_put_the_cudnn_flag_back():
    """Two engines' steps overlapping in one process (A starts, B starts, A ends, B ends): cuDNN attention
    is off while either runs and on again after both, whatever the order they end in. On a flag of the
    test's own (the process's torch flag is shared with any engine another test left running); the
    engines' counter drives torch's flag."""
    from moelora.serve.engine import _attention_without_cudnn, _SharedFlagOff

    assert _attention_without_cudnn._get is torch.backends.cuda.cudnn_sdp_enabled
    assert _attention_without_cudnn._set is torch.backends.cuda.enable_cudnn_sdp
    flag = [True]
    off = _SharedFlagOff(lambda: flag[0], lambda value: flag.__setitem__(0, value))
    for first_out in ("a", "b"):
        steps = {name: off() for name in ("a", "b")}
        steps["a"].__enter__()
        steps["b"].__enter__()
        assert flag == [False] and off.users == 2
        steps[first_out].__exit__(None, None, None)
        assert flag == [False]  # the other engine's step still runs
        steps["b" if first_out == "a" else "a"].__exit__(None, None, None)
        assert flag == [True] and off.users == 0
    flag[0] = False  # a flag off before the first step stays off after the last
    with off(), off():
        pass
    assert flag == [False]


def test_warm_up_runs_every_mix_and_changes_nothing(oracle):
    """``Engine.warm_up`` runs the token counts up to ``max_step_tokens`` without adapter and with each
    rank tile's mixes of 1, 2, 3 adapters, reports each, leaves the pool as it was (nothing loaded,
    evicted or in use), and the engine then serves exactly; it refuses to run beside requests."""
    import moelora.integrations as mi
    from moelora.serve.engine import Engine, EngineRequest, SamplingParams
    from triton_ops.plan import lora_rank_block

    model, tokenizer = load_model(None, "cpu", None)
    handle = mi.attach(model, max_loras=3, max_cpu_loras=1)
    for name in ("chat", "math", "sql"):
        handle.load_adapter(name, ADAPTERS_DIR / name)
    before = handle.pool.state()
    engine = Engine(model, handle, decode=tokenizer.decode, max_step_tokens=12)
    shapes: list[tuple[int, int]] = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: shapes.append(
        tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    lines: list[str] = []
    try:
        forwards = engine.warm_up(progress=lines.append)
        hook.remove()
        after = handle.pool.state()
        assert after.resident == before.resident and after.slots == before.slots
        assert all(users == 0 for users in after.users.values()) and after.evictions == before.evictions
        assert forwards == len(shapes) and {rows for rows, _ in shapes} == {1, 2, 4, 8, 12}
        assert all(width == 1 for _, width in shapes)
        labels = [line.split(",")[0] for line in lines[:-1]]
        assert labels[0] == "warm-up: no adapter" and len(labels) >= 2
        assert all(label.startswith("warm-up: rank tile ") for label in labels[1:])
        # no adapter at the 5 counts; per rank tile t, mixes of 1..min(3, adapters of tile <= t) adapters,
        # each at the counts >= its size
        state = handle.pool.state()
        ranks = [handle.pool.slot_rank_host[state.slots[n]] for n in state.resident]
        tiles = sorted({lora_rank_block(r) for r in ranks})
        usable = [sum(lora_rank_block(r) <= t for r in ranks) for t in tiles]
        at_least = {1: 5, 2: 4, 3: 3}
        assert len(labels) == 1 + len(tiles)
        assert forwards == 5 + sum(at_least[n] for u in usable for n in range(1, min(u, 3) + 1))
        assert lines[-1].startswith(f"warm-up done: {forwards} forwards")
        done = threading.Event()
        text: list[str] = []
        engine.submit(EngineRequest(TOK.encode("Hello"), "chat", SamplingParams(max_tokens=6, temperature=0),
                                    on_token=lambda token, delta: text.append(delta),
                                    on_finish=lambda reason: done.set()))
        assert done.wait(60)
        assert "".join(text) == oracle("chat", "Hello", 6)
        engine.submit(EngineRequest(TOK.encode("Hello"), None, SamplingParams(max_tokens=200, temperature=0)))
        with pytest.raises(RuntimeError, match="before requests"):
            engine.warm_up()
    finally:
        hook.remove()
        engine.shutdown(cancel=True)


@pytest.mark.parametrize(("flag", "expected"), [([], False), (["--warmup"], True), (["--no-warmup"], False)])
def test_serve_cli_warmup_flag(flag, expected, monkeypatch):
    """``--warmup`` / ``--no-warmup`` reach ``build_server``; without either, the warm-up runs on a GPU
    only (the demo's model is on the CPU here)."""
    import moelora.serve.server as server_module
    from moelora.cli import main

    seen = {}
    monkeypatch.setattr(server_module, "build_server",
                        lambda *args, **kwargs: seen.update(kwargs) or object())
    monkeypatch.setattr(server_module, "serve_forever", lambda server: None)
    assert main(["serve", "--demo", "--device", "cpu", *flag]) == 0
    assert seen["warmup"] is expected
