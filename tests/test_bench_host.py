"""benchmarks/bench_host.py: the dry run (tiny shape, CPU, Triton interpreter) times every call of every
(model, M) and writes its table and JSON."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_host.py"


def _load_bench_host():
    spec = importlib.util.spec_from_file_location("bench_host", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.interpreter
def test_bench_host_dry_run(tmp_path, capsys):
    bench_host = _load_bench_host()
    out = tmp_path / "h.json"
    assert bench_host.main(["--dry-run", "--out", str(out)]) == 0

    table = capsys.readouterr().out
    assert ("| model | M | base host µs | base GPU µs | LoRA host µs | LoRA GPU µs | base uncached host µs "
            "| LoRA graphed host µs | prepare_batch µs |") in table
    assert "cpu (TRITON_INTERPRET=1)" in table

    data = json.loads(out.read_text())
    assert data["device"] == "cpu (TRITON_INTERPRET=1)" and data["torch"] and data["triton"]
    records = data["records"]
    expected = [(bench_host.DRY_RUN_MODEL.name, m) for m in bench_host.DRY_RUN["M"]]
    assert sorted((r["model"], r["M"]) for r in records) == sorted(expected)
    for r in records:
        for name in ("base", "lora", "base_uncached", "lora_graphed", "prepare_batch"):
            assert r[f"{name}_host_us"] > 0, (r["M"], name)
            assert r[f"{name}_host_p10_us"] <= r[f"{name}_host_us"] <= r[f"{name}_host_p90_us"]
        assert r["base_gpu_us"] is None and r["lora_gpu_us"] is None
        assert r["n_adapters"] == 2 and r["rank"] == 4 and r["dtype"] == "float32"
        assert f"| {r['model']} | {r['M']} | " in table


def test_bench_host_batch_layout():
    """Decode: one token per sequence, adapters round-robin; prefill: one contiguous sequence per adapter."""
    bench_host = _load_bench_host()
    assert bench_host.batch_layout(5, 2) == (["a0", "a1", "a0", "a1", "a0"], None)
    names, lens = bench_host.batch_layout(258, 4)
    assert names == ["a0", "a1", "a2", "a3"] and lens == [65, 65, 64, 64]


def test_bench_host_orders():
    """--order rounds times one call of each function per round, rotating; blocks: all of one, then the
    next's."""
    bench_host = _load_bench_host()
    for order, expected in (("rounds", "abba"), ("blocks", "aabb")):
        seen: list[str] = []
        fns = {name: (lambda name=name, seen=seen: seen.append(name)) for name in "ab"}
        times = bench_host.host_times_us(fns, calls=2, warmup_calls=1, on_gpu=False, order=order)
        assert "".join(seen) == "ab" + expected, order
        assert {name: len(t) for name, t in times.items()} == {"a": 2, "b": 2}
        assert all(t > 0 for ts in times.values() for t in ts)
    assert bench_host.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 10) == 1.4
    with pytest.raises(ValueError, match="order"):
        bench_host.host_times_us({}, calls=1, warmup_calls=0, on_gpu=False, order="random")


def test_bench_host_busy_spin_is_not_timed():
    """--busy-us spins the host before each timed call; the spin is not part of the call's time."""
    bench_host = _load_bench_host()
    times = bench_host.host_times_us({"noop": lambda: None}, calls=5, warmup_calls=0, on_gpu=False,
                                     busy_us=20_000.0)
    assert max(times["noop"]) < 10_000.0  # a no-op call, far below the 20 ms spin before it


def test_bench_host_wait_choices():
    """--wait picks how the host waits for the GPU before each call; off the GPU both do nothing."""
    bench_host = _load_bench_host()
    for wait in bench_host.WAITS:
        times = bench_host.host_times_us({"noop": lambda: None}, calls=2, warmup_calls=0, on_gpu=False,
                                         wait=wait)
        assert len(times["noop"]) == 2
    with pytest.raises(ValueError, match="wait must be one of"):
        bench_host.gpu_wait("sleep", on_gpu=False)
