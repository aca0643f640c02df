"""Sizes that change with every batch must not multiply a kernel's compiled variants.

Triton compiles one binary per specialization of the integer arguments (divisible by 16 or not, and
== 1). A serving loop meets every token count, so an argument sized by the batch that keeps the
divisibility specialization compiles new binaries long after warm-up. Every launched kernel's
batch-sized arguments opt out (``do_not_specialize``, or ``do_not_specialize_on_alignment`` where the
one-token decode keeps its == 1 variant). Checked on the JIT functions themselves, so the test runs
in a fresh interpreter without ``TRITON_INTERPRET`` (the interpreter's functions carry no parameters).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Arguments whose value follows the batch's token count (or the routed pairs, blocks, chunks of it).
BATCH_SIZED = {"numel", "max_padded", "max_blocks", "num_tokens", "M", "rows", "num_chunks", "fill_stripe"}

_PROBE = """
import importlib, json, pkgutil
import triton
import triton_ops
found = {}
for info in pkgutil.iter_modules(triton_ops.__path__):
    module = importlib.import_module(f"triton_ops.{info.name}")
    for name, obj in vars(module).items():
        if isinstance(obj, triton.runtime.jit.JITFunction) and name.endswith("_kernel") \\
                and obj.__module__ == module.__name__:
            found[f"{info.name}.{name}"] = {
                p.name: [p.is_constexpr, p.do_not_specialize, p.do_not_specialize_on_alignment]
                for p in obj.params}
print(json.dumps(found))
"""


def _kernel_params() -> dict[str, dict[str, list[bool]]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_batch_sized_arguments_are_not_specialized():
    kernels = _kernel_params()
    assert "fused_moe._fused_moe_kernel" in kernels and len(kernels) >= 10, sorted(kernels)
    specialized = [
        f"{kernel}({name})"
        for kernel, params in kernels.items()
        for name, (constexpr, no_spec, no_align) in params.items()
        if name in BATCH_SIZED and not constexpr and not (no_spec or no_align)
    ]
    assert not specialized, f"batch-sized arguments still specialized: {specialized}"
    checked = sum(name in BATCH_SIZED for params in kernels.values() for name in params)
    assert checked >= 15, checked
