"""A compiled kernel may read a module-level number only through ``tl.constexpr(...)``.

Triton's compiler refuses a plain ``NAME = 32`` read inside an ``@triton.jit`` function ("Cannot access
global variable"), while the interpreter (the CPU tests) reads it happily: only a GPU run would find it.
Checked on the source of every JIT function of ``triton_ops``, in a fresh interpreter without
``TRITON_INTERPRET`` (the interpreter's functions hide their globals' kind).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
import ast, importlib, inspect, json, pkgutil, textwrap
import triton
import triton.language as tl
import triton_ops
checked, plain = 0, []
for info in pkgutil.iter_modules(triton_ops.__path__):
    module = importlib.import_module(f"triton_ops.{info.name}")
    for name, obj in vars(module).items():
        if not isinstance(obj, triton.runtime.jit.JITFunction) or obj.__module__ != module.__name__:
            continue
        checked += 1
        tree = ast.parse(textwrap.dedent(inspect.getsource(obj.fn)))
        local = {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)}
        local |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in local:
                value = obj.fn.__globals__.get(node.id)
                if isinstance(value, (int, float)) and not isinstance(value, tl.constexpr):
                    plain.append(f"{info.name}.{name} reads {node.id} = {value!r}")
print(json.dumps({"checked": checked, "plain": sorted(set(plain))}))
"""


def test_jit_functions_read_module_numbers_only_as_constexpr():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True, timeout=300)
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["checked"] >= 40, found["checked"]
    assert not found["plain"], "module-level numbers read in JIT functions without tl.constexpr: " + \
        "; ".join(found["plain"])
