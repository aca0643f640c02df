"""LoRA overhead of the MoE layer, t(base+LoRA) / t(base) - 1, per path: now ``moelora bench``.

    python benchmarks/bench_lora.py             # every model, M 1..4096, rank 16/64, 1/4 adapters
    python benchmarks/bench_lora.py --models deepseek-v2-lite --M 1 64 --ranks 16
    python benchmarks/bench_lora.py --quick     # a few minutes on one H100
    python benchmarks/bench_lora.py --dry-run   # tiny shapes on CPU (Triton interpreter)

This script only forwards its arguments to ``moelora bench`` (moelora/bench.py), which keeps this
script's method: every call captured in a CUDA graph after a warm-up on a side stream and timed with
``triton.testing.do_bench`` (median) over ``graph.replay``. ``moelora bench --help`` lists the flags;
the old ones (--models, --M, --ranks, --adapters, --out) mean what they meant.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moelora.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
