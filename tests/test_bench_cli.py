"""``moelora bench``: the dry run (tiny shapes, Triton interpreter) writes JSON + PNG; bad requests fail
clearly."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from moelora.cli import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REQUIRED = ("device", "model", "M", "rank", "n_adapters", "path", "base_us", "base_lora_us")


def _load(out):
    payload = json.loads(out.read_text())
    for key in ("device", "torch", "triton", "date", "args", "records"):
        assert key in payload, key
    for rec in payload["records"]:
        missing = [k for k in REQUIRED if k not in rec]
        assert not missing, (missing, rec)
    return payload


@pytest.mark.interpreter
def test_dry_run_writes_json_png_and_a_table(tmp_path, capsys):
    out = tmp_path / "tmp" / "x.json"
    assert main(["bench", "--dry-run", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "| model | M | rank | n_adapters | popularity | path | base µs |" in captured.out
    assert "/33" in captured.err  # the progress bar: 3 M x (base + 2 adapter counts x 5 paths)

    payload = _load(out)
    records = payload["records"]
    assert {r["path"] for r in records} == {"naive", "base", "fused", "split", "staged", "auto"}
    assert {r["M"] for r in records} == {1, 8, 80}  # decode (per-token adapters) and prefill layouts
    assert payload["args"]["dry_run"] is True and payload["resolved"]["dtype"] == "fp16"
    for r in records:
        assert r["base_us"] > 0 and r["base_lora_us"] > 0
        assert r["overhead"] == pytest.approx(r["base_lora_us"] / r["base_us"] - 1)
        assert r["pct_hbm_peak"] is None and r["pct_tc_peak"] is None  # no peak known for the CPU
        if r["path"] == "base":
            assert r["base_lora_us"] == r["base_us"] and r["lora_bytes"] == 0
        else:
            assert r["rank"] == 8 and r["n_adapters"] in (1, 4) and r["lora_bytes"] > 0
        if r["path"] == "auto":
            assert r["resolved_path"] in ("fused", "split")
        if r["path"] in ("fused", "split", "staged"):  # every Triton path agrees with the naive loop
            assert r["rel_err_vs_naive"] < 2e-2
    assert out.with_suffix(".png").read_bytes()[:8] == PNG_SIGNATURE
    assert out.with_suffix(".md").read_text().count("\n| tiny |") == len(records)


@pytest.mark.interpreter
def test_dry_run_with_a_custom_config(tmp_path, capsys):
    config = tmp_path / "mini.json"
    config.write_text(json.dumps({"name": "mini-moe", "E": 4, "top_k": 2, "H": 32, "I": 16}))
    out = tmp_path / "mini.json.out" / "r.json"
    argv = ["bench", "--dry-run", "--config", str(config), "--M", "2", "70", "--ranks", "4",
            "--adapters", "3", "--popularity", "uniform", "zipf", "--paths", "base", "split", "auto",
            "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    assert "mini-moe" in capsys.readouterr().out
    records = _load(out)["records"]
    assert {r["model"] for r in records} == {"mini-moe"}
    assert {(r["E"], r["top_k"], r["H"], r["I"]) for r in records} == {(4, 2, 32, 16)}
    lora = [r for r in records if r["path"] != "base"]
    assert len(lora) == 2 * 2 * 2  # M x popularity x (split, auto)
    assert {r["popularity"] for r in lora} == {"uniform", "zipf"}
    assert out.with_suffix(".png").read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.interpreter
def test_pool_rank_runs_small_adapters_in_big_buffers(tmp_path, capsys):
    # Rank 4 in buffers of rank 32 whose rows past rank 4 hold random values: the kernels must never read
    # them (the naive loop slices each slot to its real rank), and the records say which pool it was.
    config = tmp_path / "mini.json"
    config.write_text(json.dumps({"name": "mini-moe", "E": 4, "top_k": 2, "H": 32, "I": 16}))
    out = tmp_path / "pool.json"
    argv = ["bench", "--dry-run", "--config", str(config), "--M", "3", "70", "--ranks", "4", "--pool-rank",
            "32", "--adapters", "2", "--paths", "naive", "base", "fused", "split", "staged",
            "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    assert "4 (pool 32)" in capsys.readouterr().out
    lora = [r for r in _load(out)["records"] if r["path"] not in ("base", "naive")]
    assert len(lora) == 2 * 3
    for r in lora:
        assert r["rank"] == 4 and r["pool_rank"] == 32
        assert r["rel_err_vs_naive"] < 2e-2


def test_unknown_model_is_a_clear_error(tmp_path, capsys):
    assert main(["bench", "--dry-run", "--models", "gpt-moe-9000", "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'gpt-moe-9000'" in err and "deepseek-v2-lite" in err and "--config" in err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"name": "m", "E": 8, "top_k": 2, "H": 64}', "missing I"),
        ('{"name": "m", "E": 8, "top_k": 2, "H": 64, "I": 0}', "I must be a positive integer"),
        ('{"name": "m", "E": 2, "top_k": 4, "H": 64, "I": 32}', "top_k=4 exceeds E=2"),
        ('{"name": "m", "E": 8, "top_k": 2, "H": 64, "I": 32, "rank": 8}', "unknown keys rank"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path, capsys, content, message):
    config = tmp_path / "model.json"
    if content is not None:
        config.write_text(content)
    assert main(["bench", "--dry-run", "--config", str(config), "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moelora bench: --config") and message in err, err


def test_l2_flush_mode_is_checked_before_any_gpu_work():
    from moelora.bench import cold_l2_time_ms

    with pytest.raises(ValueError, match=r"flush must be one of \('read', 'write'\), got 'erase'"):
        cold_l2_time_ms(lambda: None, 1.0, 1.0, flush="erase")


def test_l2_flush_flag_rejects_unknown_modes(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--dry-run", "--l2-flush", "erase"])
    assert "invalid choice: 'erase'" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("flush", ["read", "write"])
def test_cold_l2_timer_times_a_kernel(flush):
    # A 64 MB copy must take at least its bytes over a generous 10 TB/s, whichever flush runs before it.
    import torch

    from moelora.bench import cold_l2_time_ms

    src = torch.ones(16 * 1024**2, device="cuda")
    dst = torch.empty_like(src)
    ms = cold_l2_time_ms(lambda: dst.copy_(src), 5.0, 20.0, flush=flush)
    assert 2 * src.numel() * 4 / (ms * 1e-3) < 10e12
    assert torch.equal(dst, src)


def test_interleaved_timer_needs_a_function():
    from moelora.bench import cold_l2_times_ms

    with pytest.raises(ValueError, match="nothing to time"):
        cold_l2_times_ms([], 1.0, 1.0)


@pytest.mark.gpu
def test_interleaved_timer_keeps_each_functions_time():
    # Two copies of 4x different size timed in turn: each median is its own call's (ordered, and the
    # big one within its bytes over a generous 10 TB/s), not a mix of the two.
    import torch

    from moelora.bench import cold_l2_times_ms

    small_src = torch.ones(4 * 1024**2, device="cuda")
    big_src = torch.ones(16 * 1024**2, device="cuda")
    small_dst, big_dst = torch.empty_like(small_src), torch.empty_like(big_src)
    small_ms, big_ms = cold_l2_times_ms([lambda: small_dst.copy_(small_src), lambda: big_dst.copy_(big_src)],
                                        5.0, 20.0)
    assert small_ms < big_ms
    assert 2 * big_src.numel() * 4 / (big_ms * 1e-3) < 10e12
    assert torch.equal(big_dst, big_src) and torch.equal(small_dst, small_src)


def test_median_round_keeps_one_rounds_pair():
    from moelora.bench import median_round

    # Overheads +10 %, +30 %, +5 %: the median is round 0's, and its base stays with its LoRA time.
    base, lora, overheads = median_round([10.0, 10.0, 12.0], [11.0, 13.0, 12.6])
    assert (base, lora) == (10.0, 11.0) and overheads == pytest.approx([0.1, 0.3, 0.05])
    assert median_round([10.0, 10.0], [12.0, 11.0])[:2] == (10.0, 11.0)  # even count: the lower one
    assert median_round([4.0], [5.0]) == (4.0, 5.0, [0.25])
    with pytest.raises(ValueError, match="one base and one LoRA time per round, got 2 and 1"):
        median_round([1.0, 2.0], [1.0])


def test_graph_rounds_time_each_call_once_a_round(monkeypatch):
    # CPU stand-ins for the graph capture and the interleaved timer: round r times call j as 10*r + j ms.
    from moelora import bench, bench_timing

    rounds_seen = []
    # Capture failed: the calls are timed eagerly.
    monkeypatch.setattr(bench_timing, "_capture", lambda fn: None)

    def fake_timer(fns, warmup_ms, rep_ms, flush):
        rounds_seen.append(len(fns))
        return [10.0 * (len(rounds_seen) - 1) + j for j in range(len(fns))]

    monkeypatch.setattr(bench_timing, "cold_l2_times_ms", fake_timer)
    times, used = bench.graph_rounds_us([lambda: None, lambda: None], 1.0, 1.0, rounds=3)
    assert times == [[0.0, 10e3, 20e3], [1e3, 11e3, 21e3]] and used == [False, False]
    assert rounds_seen == [2, 2, 2]
    assert bench.graph_times_us([lambda: None], 1.0, 1.0) == [(30e3, False)]
    with pytest.raises(ValueError, match="rounds must be >= 1, got 0"):
        bench.graph_rounds_us([lambda: None], 1.0, 1.0, rounds=0)


def test_rounds_flag(tmp_path, capsys):
    assert main(["bench", "--dry-run", "--rounds", "0", "--out", str(tmp_path / "x.json")]) == 2
    assert "--rounds must be positive, got [0]" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
    out = tmp_path / "r.json"
    # one token count, one adapter count and one LoRA path: what --rounds changes is in every cell alike
    assert main(["bench", "--dry-run", "--rounds", "2", "--M", "8", "--adapters", "1", "--paths", "base",
                 "split", "--out", str(out), "--no-progress"]) == 0
    payload = json.loads(out.read_text())
    assert payload["resolved"]["rounds"] == 2 and {r["path"] for r in payload["records"]} >= {"base", "split"}


def _script(name: str):
    """``benchmarks/<name>.py`` as a module (benchmarks/ is a folder of scripts, not a package), registered
    in ``sys.modules`` while it runs (its dataclasses look their module up there)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module



def _run(date, models, ranks=(16, 64), rounds=None):
    """A minimal ``moelora bench`` JSON of one run over ``models`` (``rounds`` None: a run made before
    ``--rounds``, which did not record it)."""
    resolved = {"models": [{"name": m} for m in models], "ranks": list(ranks), "adapters": [1, 4],
                "popularity": ["uniform"], "paths": ["base", "auto"], "M": [1, 16], "dtype": "bf16",
                "warmup_ms": 25.0, "rep_ms": 100.0}
    if rounds is not None:
        resolved["rounds"] = rounds
    return {"device": "GPU X", "date": date, "timing": "t", "args": {"ranks": list(ranks)},
            "resolved": resolved,
            "records": [{"model": m, "M": mm, "rank": 16, "n_adapters": 1, "popularity": "uniform",
                         "path": "auto", "base_us": 10.0, "base_lora_us": 11.0, "overhead": 0.1, "tbps": 1.0,
                         "pct_hbm_peak": 30.0, "tflops": 1.0, "pct_tc_peak": 0.1}
                        for m in models for mm in (1, 16)]}


def test_merge_results_keeps_model_order_and_provenance(tmp_path):
    """Runs over different models of one device and settings merge into one table in MODELS order (the
    second run's DeepSeek-V2 before the first's Qwen3), each run's date kept in the note."""
    merge_runs, write_table = _script("merge_results").merge_runs, _script("merge_results").write_table

    # "my-moe" (a --config model, not in MODELS) goes after the known ones, beside them in one run.
    runs = [_run("d1", ["qwen3-30b-a3b"]), _run("d2", ["my-moe", "deepseek-v2", "mixtral-8x7b"])]
    merged = merge_runs(runs, "at abc")
    order = ["deepseek-v2", "qwen3-30b-a3b", "mixtral-8x7b", "my-moe"]
    assert [r["model"] for r in merged["records"]] == [m for m in order for _ in range(2)]
    assert merged["date"] == "d1 to d2" and merged["args"]["note"].startswith("at abc: qwen3-30b-a3b d1;")
    assert [m["name"] for m in merged["resolved"]["models"]] == order
    out = tmp_path / "t.json"
    write_table(merged, out)
    assert json.loads(out.read_text())["records"] == merged["records"]
    assert "at abc" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize(
    "second, message",
    [(_run("d2", ["qwen3-30b-a3b"]), "qwen3-30b-a3b M=1 is in two runs"),
     (_run("d2", ["deepseek-v2"], ranks=(16,)), "runs with different ranks"),
     (dict(_run("d2", ["deepseek-v2"]), device="GPU Y"), "runs of different devices"),
     # a run without "rounds" (before --rounds) ran one round a point
     (_run("d2", ["deepseek-v2"], rounds=3), "runs with different rounds: 1 and 3")],
    ids=["same-model", "other-ranks", "other-device", "other-rounds"])
def test_merge_results_refuses_runs_that_do_not_fit(second, message):
    merge_runs = _script("merge_results").merge_runs

    with pytest.raises(ValueError, match=message):
        merge_runs([_run("d1", ["qwen3-30b-a3b"]), second])


def test_merge_results_replace_refreshes_one_model():
    """With replace, a later run's model takes the place of that model in an earlier (merged) table: its
    records and resolved entry are the later run's, the other models' stay, the note dates each."""
    merge_runs = _script("merge_results").merge_runs

    table = merge_runs([_run("d1", ["deepseek-v2-lite", "qwen3-30b-a3b"]), _run("d2", ["mixtral-8x7b"])])
    fresh = _run("d3", ["qwen3-30b-a3b"])
    for record in fresh["records"]:
        record["overhead"] = 0.05
    refreshed = merge_runs([table, fresh], "refresh", replace=True)

    by_model = {}
    for record in refreshed["records"]:
        by_model.setdefault(record["model"], []).append(record["overhead"])
    assert by_model == {"deepseek-v2-lite": [0.1, 0.1], "qwen3-30b-a3b": [0.05, 0.05],
                        "mixtral-8x7b": [0.1, 0.1]}
    assert [r["model"] for r in refreshed["records"]] == [
        "deepseek-v2-lite", "deepseek-v2-lite", "qwen3-30b-a3b", "qwen3-30b-a3b", "mixtral-8x7b",
        "mixtral-8x7b"]
    assert [m["name"] for m in refreshed["resolved"]["models"]] == [
        "deepseek-v2-lite", "qwen3-30b-a3b", "mixtral-8x7b"]
    assert refreshed["args"]["note"].endswith("qwen3-30b-a3b d3")
    assert "deepseek-v2-lite, mixtral-8x7b d1 to d2" in refreshed["args"]["note"]
    # Without replace the same runs still refuse to merge.
    with pytest.raises(ValueError, match="qwen3-30b-a3b M=1 is in two runs"):
        merge_runs([table, fresh])


def test_merge_results_replace_one_point():
    """A later run over fewer M replaces only those (model, M) points; the table keeps M order within each
    model and the note names the M the run gave. Without replace the repeated point is refused."""
    merge_runs = _script("merge_results").merge_runs

    table = merge_runs([_run("d1", ["deepseek-v2-lite", "qwen3-30b-a3b"])])
    fresh = _run("d3", ["qwen3-30b-a3b"])
    fresh["resolved"]["M"] = [16]
    fresh["records"] = [dict(r, overhead=0.05) for r in fresh["records"] if r["M"] == 16]
    refreshed = merge_runs([table, fresh], replace=True)

    assert [(r["model"], r["M"], r["overhead"]) for r in refreshed["records"]] == [
        ("deepseek-v2-lite", 1, 0.1), ("deepseek-v2-lite", 16, 0.1), ("qwen3-30b-a3b", 1, 0.1),
        ("qwen3-30b-a3b", 16, 0.05)]
    assert refreshed["resolved"]["M"] == [1, 16]
    assert [m["name"] for m in refreshed["resolved"]["models"]] == ["deepseek-v2-lite", "qwen3-30b-a3b"]
    # d1 keeps only M=1 of Qwen3 now, and the note says so
    assert refreshed["args"]["note"] == "deepseek-v2-lite, qwen3-30b-a3b M=1 d1; qwen3-30b-a3b M=16 d3"
    with pytest.raises(ValueError, match="qwen3-30b-a3b M=16 is in two runs"):
        merge_runs([table, fresh])
    # An M the table does not have, for one model only, would leave a hole: refused even with replace.
    fresh["resolved"]["M"] = [16, 4096]
    fresh["records"].append(dict(fresh["records"][0], M=4096))
    with pytest.raises(ValueError, match="deepseek-v2-lite has no M=4096 in any run"):
        merge_runs([table, fresh], replace=True)


def test_merge_results_runs_split_by_m():
    """A table taken in two runs over the same models, small M then large M (one device call holds
    neither whole), merges into one table of every M, each model's points in M order; a model missing
    from one of the runs would leave holes and is refused."""
    merge_runs = _script("merge_results").merge_runs

    small = _run("d1", ["qwen3-30b-a3b", "deepseek-v2-lite"])
    large = _run("d2", ["deepseek-v2-lite", "qwen3-30b-a3b"])
    large["resolved"]["M"] = [1024, 4096]
    large["records"] = [dict(r, M={1: 1024, 16: 4096}[r["M"]]) for r in large["records"]]
    merged = merge_runs([small, large], "at abc")

    assert merged["resolved"]["M"] == [1, 16, 1024, 4096]
    assert [(r["model"], r["M"]) for r in merged["records"]] == [
        (model, m) for model in ("deepseek-v2-lite", "qwen3-30b-a3b") for m in (1, 16, 1024, 4096)]
    assert merged["args"]["note"] == (
        "at abc: deepseek-v2-lite, qwen3-30b-a3b M=1/16 d1; deepseek-v2-lite, qwen3-30b-a3b M=1024/4096 d2")
    large["records"] = [r for r in large["records"] if r["model"] == "qwen3-30b-a3b"]
    with pytest.raises(ValueError, match="deepseek-v2-lite has no M=1024/4096 in any run"):
        merge_runs([small, large])


@pytest.mark.interpreter
def test_mxfp4_bench_dry_run_rows_and_bad_arguments(tmp_path, capsys):
    """benchmarks/bench_mxfp4.py's dry run (tiny shape, Triton interpreter) times the bf16 and MXFP4 bases
    with and without LoRA for each M: a row per M with a speedup, its target and both LoRA overheads, the
    expert bytes of the model, and MXFP4 outputs equal to those of the decoded bf16-path weights. A bad
    argument is a usage error (exit code 2) before anything runs."""
    bench = _script("bench_mxfp4")
    out = tmp_path / "mx.json"
    assert bench.main(["--dry-run", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert out.with_suffix(".md").read_text() == table.removesuffix("\n")  # print() adds one
    assert ("| model | M | bf16 base µs | MXFP4 base µs | MXFP4 speedup | target | MXFP4 weight TB/s "
            "(roofline) | LoRA r4 x2: bf16 / MXFP4 overhead |") in table

    payload = json.loads(out.read_text())
    assert payload["device"] == "cpu (TRITON_INTERPRET=1)" and payload["dry_run"] is True
    records = payload["records"]
    assert [(r["model"], r["M"]) for r in records] == [("tiny", 1), ("tiny", 5)]
    for r in records:
        t = r["times_us"]
        assert set(t) == {"bf16", "mxfp4", "bf16 r4 x2", "mxfp4 r4 x2"} and min(t.values()) > 0
        assert r["mxfp4_speedup"] == pytest.approx(t["bf16"] / t["mxfp4"])
        assert r["target_speedup"] == 1.8 and r["target_met"] == (r["mxfp4_speedup"] >= 1.8)
        assert r["overheads"] == pytest.approx({f"{base} r4 x2": t[f"{base} r4 x2"] / t[base] - 1
                                                for base in ("bf16", "mxfp4")})
        assert r["mxfp4_weight_tbps"] > 0 and r["mxfp4_roofline"] is None  # no HBM peak for the CPU
        # float32 dense copy of the same values: the MXFP4 GEMMs compute the same outputs
        assert set(r["mxfp4_rel_err_vs_bf16"]) == {"mxfp4", "mxfp4 r4 x2"}
        assert max(r["mxfp4_rel_err_vs_bf16"].values()) < 1e-5
        row = f"| tiny | {r['M']} | {t['bf16']:.1f} | {t['mxfp4']:.1f} | {r['mxfp4_speedup']:.2f} | "
        assert row in table
    assert table.count("\n| tiny | ") == len(records) + 1  # + the expert-bytes row
    (model,) = payload["models"]
    # E x 3 x H x I values: 17 bytes per 32 packed (16 of codes, 1 scale), 64 in bf16
    assert model["packed_gb"] == pytest.approx(4 * 3 * 64 * 32 * 17 / 32 / 1e9)
    assert model["bf16_gb"] == pytest.approx(4 * 3 * 64 * 32 * 2 / 1e9)
    assert "| tiny | 4 | 2 | 64 | 32 | silu | no |" in table

    assert bench.target_for(64) == 1.8 and bench.target_for(256) is None and bench.target_for(4096) == 0.9
    shape = bench.SHAPES["gpt-oss-120b"]
    assert (shape.E, shape.top_k, shape.H, shape.I, shape.biases) == (128, 4, 2880, 2880, True)
    assert shape.activation == bench.SHAPES["gpt-oss-20b"].activation

    with pytest.raises(SystemExit) as exc:
        bench.main(["--dry-run", "--adapters", "9", "--out", str(tmp_path / "bad.json")])
    assert exc.value.code == 2 and "--adapters in [1, 8]" in capsys.readouterr().err
    assert not (tmp_path / "bad.json").exists()


def test_many_adapters_mixed_step_layout_and_floor():
    """A mixed serving step: the decode tokens draw their adapters one by one, the prefill chunk is one
    adapter's; its byte floor counts the (adapter, expert) pairs of that layout."""
    from moelora.bench import MODELS

    bench = _script("bench_many_adapters")
    slots = bench.step_slots(2048, 32, "zipf", decode=192)
    assert slots.shape == (2048,) and slots.dtype == torch.int32
    assert slots[192:].unique().numel() == 1 and slots[:192].unique().numel() > 8
    assert torch.equal(slots, bench.step_slots(2048, 32, "zipf", decode=192))  # reproducible
    with pytest.raises(ValueError, match="0 < decode tokens < M"):
        bench.step_slots(64, 8, "uniform", decode=64)
    shape = MODELS["qwen3-30b-a3b"]
    mixed = bench.floor_bytes(shape, 2048, 32, "zipf", decode=192)
    one = bench.floor_bytes(shape, 2048, 32, "zipf", one_rank=64, decode=192)
    spread = bench.floor_bytes(shape, 2048, 32, "zipf")
    assert one < mixed < spread  # one chunk of one adapter has fewer (adapter, expert) pairs than 32 runs
    assert bench.step_label({"M": 2048, "decode": 192}) == "192 decode + 1856 prefill"
    assert bench.step_label({"M": 1024}) == "M=1024"


def test_many_adapters_trained_fraction_counts_only_trained_experts(monkeypatch, capsys):
    """``--trained F``: each adapter (and the one-adapter reference) trains a fixed F of the experts, and
    the byte floor counts only the (adapter, expert) pairs it trains; F outside (0, 1] is refused."""
    from moelora.bench import MODELS

    bench = _script("bench_many_adapters")
    shape = MODELS["qwen3-30b-a3b"]
    eighth = bench.trained_experts(3, shape.E, 0.125)
    assert len(eighth) == shape.E // 8 and eighth == bench.trained_experts(3, shape.E, 0.125)
    assert eighth != bench.trained_experts(4, shape.E, 0.125)  # each adapter its own experts
    assert bench.trained_experts(3, shape.E, 1.0) == list(range(shape.E))
    assert bench.trained_experts(bench.ONE, 5, 0.01) != []  # at least one
    full = bench.floor_bytes(shape, 1024, 32, "uniform")
    part = bench.floor_bytes(shape, 1024, 32, "uniform", trained=0.125)
    base = bench.floor_bytes(shape, 1024, 32, "uniform", trained=1e-9)  # one expert an adapter
    assert base < part < full
    assert bench.floor_bytes(shape, 1024, 32, "uniform", one_rank=64, trained=0.125) < bench.floor_bytes(
        shape, 1024, 32, "uniform", one_rank=64)
    for bad in ("0", "1.5"):
        monkeypatch.setattr(sys, "argv", ["bench_many_adapters.py", "--trained", bad, "--out", "unused"])
        with pytest.raises(SystemExit) as exc:
            bench.main()
        assert exc.value.code == 2 and "--trained takes a fraction in (0, 1]" in capsys.readouterr().err


def test_many_adapters_ab_overrides_are_checked_before_anything_runs(monkeypatch, capsys):
    """``--ab NAME=VALUE`` takes launch overrides, checked by name and value before any GPU work."""
    bench = _script("bench_many_adapters")
    for bad, message in (("lora_ext=2", "lora_ext must be 0, 1, gemm1 or gemm2"),
                         ("no_such=1", "unknown launch override 'no_such'"), ("lora_ext", "NAME=VALUE")):
        monkeypatch.setattr(sys, "argv", ["bench_many_adapters.py", "--ab", bad, "--out", "unused"])
        with pytest.raises(SystemExit) as exc:
            bench.main()
        assert exc.value.code == 2 and message in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["bench_many_adapters.py", "--ab-path", "staged", "--out", "unused"])
    with pytest.raises(SystemExit) as exc:
        bench.main()
    assert exc.value.code == 2 and "--ab-path needs --ab" in capsys.readouterr().err


def test_ab_rules_covers_every_launch_override():
    """benchmarks/ab_rules.py has one entry per launch override, each forcing a value the override takes,
    on models the benchmarks know (its own check), and the verdict keeps a rule at a 2 % loss."""
    from triton_ops.overrides import CHOICES

    module = _script("ab_rules")
    assert set(module.RULES) == set(CHOICES)
    module.check_rules(module.RULES)
    assert module.KEEP_AT == 1.02


def test_gptoss_model_bench_dry_run_serves_packed_experts(tmp_path, capsys):
    """benchmarks/bench_gptoss_model.py's dry run (tiny gpt-oss, the CPU): the experts are built packed (no
    bf16 expert weights ever allocated), attach serves the packed bytes in place, adapters are placed and
    both modes generate; the JSON holds the memory figures and a row per batch."""
    pytest.importorskip("transformers.models.gpt_oss", exc_type=ImportError)
    from moelora.integrations.gpt_oss import PackedGptOssExperts

    bench = _script("bench_gptoss_model")
    model = bench.build_model(2, True, torch.device("cpu"), torch.float32)
    assert all(isinstance(layer.mlp.experts, PackedGptOssExperts) for layer in model.model.layers)
    assert all(layer.mlp.experts.gate_up_proj_bias.numel() > 0 for layer in model.model.layers)
    assert not any(p.dtype == torch.float32 and p.dim() == 3 for p in model.parameters())  # no dense experts
    # E x 3 x H x I values, 17 bytes per 32 (16 of codes, 1 scale), two layers
    assert bench.packed_bytes(model) == 2 * 8 * 3 * 64 * 32 * 17 // 32

    out = tmp_path / "gptoss.json"
    assert bench.main(["--dry-run", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    payload = json.loads(out.read_text())
    assert payload["device"] == "cpu" and payload["peak_gb"] is None
    assert payload["adapter_gb"] > 0 and payload["arena_gb"] >= payload["adapter_gb"]
    (row,) = payload["records"]
    assert row["batch"] == 2 and row["base_tok_s"] > 0 and row["adapters_tok_s"] > 0
    assert "| batch | base tok/s | adapters tok/s | adapters / base |" in table
    with pytest.raises(SystemExit) as exc:
        bench.main(["--dry-run", "--adapters", "0"])
    assert exc.value.code == 2
