"""A launch trace's replay in one C call: every recorded launch queued by ``cuLaunchKernelEx`` from C, with
the call's pointers patched into the recorded arguments.

Triton's own launcher costs several microseconds of host time per launch (a Python wrapper, then parsing
every argument from Python objects); a replay of the MoE layer makes 6 to 9 launches. Here the arguments of
every launch are packed once, when the trace is built, into one plan of 64-bit words; a replay passes the
plan, the call's base pointers and the stream to :func:`replay`, which copies each launch's argument words,
adds the bases at the recorded positions and launches. The same launch configuration as Triton's launcher:
``32 * num_warps`` threads, the binary's dynamic shared memory, and programmatic dependent launch where the
binary asks for it.

A plan is only built for binaries this launcher reproduces exactly: no global or profile scratch, one CTA per
cluster, no cooperative grid, no tensor descriptors, shared memory that fits without the oversize mode, and
scalar arguments of the types in ``_SCALAR_PACKERS`` (tuple arguments, an operand's bundle, flattened in order
as Triton's launcher does). Anything else keeps Triton's launcher for the whole trace. The C extension is
compiled on first use with the C compiler and Python headers Triton itself needs for its launchers, and
Triton's copy of ``cuda.h``; it is kept in ``MOELORA_CACHE_DIR`` (default ``~/.cache/moelora``).
``MOELORA_NATIVE_LAUNCH=0`` keeps Triton's launcher.

Plan layout (little-endian 64-bit words): the number of launches, then per launch the CUfunction, grid
x, y and z, threads per block, dynamic shared bytes, flags (bit 0: programmatic dependent launch), the
number of argument words P, the number of patches Q, the P argument words, and Q patches of three words
(argument index, source index, byte offset). A patch adds ``bases[source] + offset`` to the argument word.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

from triton_ops.configs import env_switch

# The most argument words one launch may have: the C side keeps them on its stack.
MAX_ARGUMENT_WORDS = 128

_SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>
#include "cuda.h"

#define MAX_ARGUMENT_WORDS %(max_words)d
#define MAX_BASES 64

typedef CUresult (*launch_ex_fn)(const CUlaunchConfig *, CUfunction, void **, void **);
typedef CUresult (*error_string_fn)(CUresult, const char **);

static launch_ex_fn launch_ex = NULL;
static error_string_fn error_string = NULL;

static int load_driver(void) {
  if (launch_ex != NULL) return 1;
  void *handle = dlopen("libcuda.so.1", RTLD_LAZY);
  if (handle == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "moelora native launch: cannot open libcuda.so.1");
    return 0;
  }
  error_string = (error_string_fn)dlsym(handle, "cuGetErrorString");
  launch_ex = (launch_ex_fn)dlsym(handle, "cuLaunchKernelEx");
  if (launch_ex == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "moelora native launch: libcuda.so.1 has no cuLaunchKernelEx");
    return 0;
  }
  return 1;
}

static PyObject *malformed(void) {
  PyErr_SetString(PyExc_ValueError, "moelora native launch: malformed plan");
  return NULL;
}

/* Whether every launch's header, argument words and patches lie inside the plan, and every patch names an
   argument word and a base that exist: checked before anything is launched. */
static int plan_is_valid(const uint64_t *plan, Py_ssize_t plan_words, uint64_t num_bases) {
  if (plan_words < 1) return 0;
  uint64_t at = 1, end = (uint64_t)plan_words;
  for (uint64_t launch = 0; launch < plan[0]; ++launch) {
    if (at + 9 > end) return 0;
    uint64_t num_words = plan[at + 7], num_patches = plan[at + 8];
    at += 9;
    if (num_words > MAX_ARGUMENT_WORDS || num_patches > end) return 0;
    if (at + num_words + 3 * num_patches > end) return 0;
    at += num_words;
    for (uint64_t p = 0; p < num_patches; ++p, at += 3) {
      if (plan[at] >= num_words || plan[at + 1] >= num_bases) return 0;
    }
  }
  return at == end;
}

static PyObject *replay(PyObject *Py_UNUSED(self), PyObject *args) {
  Py_buffer plan_buffer;
  PyObject *bases_tuple;
  unsigned long long stream;
  if (!PyArg_ParseTuple(args, "y*O!K", &plan_buffer, &PyTuple_Type, &bases_tuple, &stream)) return NULL;
  const uint64_t *plan = (const uint64_t *)plan_buffer.buf;
  Py_ssize_t plan_words = plan_buffer.len / 8;
  uint64_t bases[MAX_BASES];
  Py_ssize_t num_bases = PyTuple_GET_SIZE(bases_tuple);
  PyObject *result = NULL;
  if (num_bases > MAX_BASES) {
    PyErr_SetString(PyExc_ValueError, "moelora native launch: too many base pointers");
    goto done;
  }
  for (Py_ssize_t i = 0; i < num_bases; ++i) {
    bases[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(bases_tuple, i));
    if (PyErr_Occurred()) goto done;
  }
  if (plan_buffer.len %% 8 != 0 || !plan_is_valid(plan, plan_words, (uint64_t)num_bases)) {
    malformed();
    goto done;
  }
  if (!load_driver()) goto done;
  uint64_t words[MAX_ARGUMENT_WORDS];
  void *pointers[MAX_ARGUMENT_WORDS];
  CUresult status = CUDA_SUCCESS;
  Py_BEGIN_ALLOW_THREADS;
  Py_ssize_t at = 1;
  for (uint64_t launch = 0; launch < plan[0]; ++launch) {
    const uint64_t *head = plan + at;
    uint64_t num_words = head[7], num_patches = head[8];
    at += 9;
    memcpy(words, plan + at, num_words * 8);
    at += num_words;
    for (uint64_t p = 0; p < num_patches; ++p, at += 3) words[plan[at]] += bases[plan[at + 1]] + plan[at + 2];
    for (uint64_t w = 0; w < num_words; ++w) pointers[w] = &words[w];
    CUlaunchAttribute attributes[1];
    CUlaunchConfig config;
    memset(&config, 0, sizeof(config));
    config.gridDimX = (unsigned)head[1];
    config.gridDimY = (unsigned)head[2];
    config.gridDimZ = (unsigned)head[3];
    config.blockDimX = (unsigned)head[4];
    config.blockDimY = 1;
    config.blockDimZ = 1;
    config.sharedMemBytes = (unsigned)head[5];
    config.hStream = (CUstream)(uintptr_t)stream;
    config.attrs = attributes;
    config.numAttrs = 0;
    if (head[6] & 1) {
      memset(&attributes[0], 0, sizeof(attributes[0]));
      attributes[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
      attributes[0].value.programmaticStreamSerializationAllowed = 1;
      config.numAttrs = 1;
    }
    if (config.gridDimX == 0 || config.gridDimY == 0 || config.gridDimZ == 0) continue;
    status = launch_ex(&config, (CUfunction)(uintptr_t)head[0], pointers, NULL);
    if (status != CUDA_SUCCESS) break;
  }
  Py_END_ALLOW_THREADS;
  if (status != CUDA_SUCCESS) {
    const char *text = NULL;
    if (error_string != NULL) error_string(status, &text);
    PyErr_Format(PyExc_RuntimeError, "moelora native launch failed: %%s (CUresult %%d)",
                 text != NULL ? text : "unknown error", (int)status);
    goto done;
  }
  Py_INCREF(Py_None);
  result = Py_None;
done:
  PyBuffer_Release(&plan_buffer);
  return result;
}

static PyMethodDef methods[] = {
    {"replay", replay, METH_VARARGS, "replay(plan, bases, stream): queue every launch of a plan."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "%(name)s", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_%(name)s(void) { return PyModule_Create(&module); }
"""

# Scalar argument types and how a value becomes its argument word (the low bytes of a little-endian word
# hold the value; the driver reads as many bytes as the kernel's parameter has).
def _signed_word(value: Any) -> int:
    return int(value) & 0xFFFFFFFF_FFFFFFFF  # two's complement: the low bytes are the narrower int's


def _float_bits(value: Any) -> int:
    return struct.unpack("<I", struct.pack("<f", float(value)))[0]


_SCALAR_PACKERS = {
    **dict.fromkeys(("i1", "i8", "i16", "i32", "i64"), _signed_word),
    **dict.fromkeys(("u1", "u8", "u16", "u32", "u64"), int),
    "fp16": lambda v: struct.unpack("<H", struct.pack("<e", float(v)))[0],
    "bf16": lambda v: _float_bits(v) >> 16,  # truncated, as Triton's own launcher packs it
    "fp32": _float_bits,
    "f32": _float_bits,
    "fp64": lambda v: struct.unpack("<Q", struct.pack("<d", float(v)))[0],
}


def enabled() -> bool:
    """Whether replays may use the native launcher (``MOELORA_NATIVE_LAUNCH``, on by default)."""
    return env_switch("MOELORA_NATIVE_LAUNCH", True)


def _module_name(source: str) -> str:
    digest = hashlib.sha256(f"{source}{sys.version}{sysconfig.get_platform()}".encode()).hexdigest()[:16]
    return f"moelora_native_launch_{digest}"


def _cuda_include_dir() -> Path:
    import triton.backends.nvidia as nvidia

    return Path(nvidia.__file__).parent / "include"


def load() -> ModuleType | None:
    """The compiled extension (built on first use, then loaded from the cache directory), or None with a
    warning where it cannot be built. Python's module table keeps it once loaded."""
    source_template = _SOURCE
    name = _module_name(source_template)
    loaded = sys.modules.get(name)
    if loaded is not None:
        return loaded
    cache_dir = Path(os.environ.get("MOELORA_CACHE_DIR", Path.home() / ".cache" / "moelora"))
    library = cache_dir / f"{name}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    try:
        if not library.exists():
            _build(source_template % {"max_words": MAX_ARGUMENT_WORDS, "name": name}, library)
        loader = importlib.machinery.ExtensionFileLoader(name, str(library))
        spec = importlib.util.spec_from_file_location(name, str(library), loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except (OSError, ImportError, subprocess.CalledProcessError) as error:
        warnings.warn(f"moelora: the native launcher could not be built or loaded ({error}); replays use "
                      "Triton's launcher (set MOELORA_NATIVE_LAUNCH=0 to skip the attempt)", RuntimeWarning,
                      stacklevel=2)
        return None
    sys.modules[name] = module
    return module


def _build(source: str, library: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")
    if compiler is None:
        raise OSError("no C compiler found (set CC)")
    cuda_include = _cuda_include_dir()
    if not (cuda_include / "cuda.h").exists():
        raise OSError(f"Triton's cuda.h is not in {cuda_include}")
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as work:
        source_path = Path(work) / "native_launch.c"
        source_path.write_text(source)
        built = Path(work) / library.name
        command = [compiler, str(source_path), "-O2", "-shared", "-fPIC", "-o", str(built),
                   f"-I{sysconfig.get_paths()['include']}", f"-I{cuda_include}", "-ldl"]
        subprocess.run(command, check=True, capture_output=True)
        os.replace(built, library)  # atomic: a concurrent build of the same source writes the same file


def build_plan(launches: list[tuple[Any, tuple[int, int, int], list[Any], list[tuple[int, int, int]]]]
               ) -> bytes | None:
    """The plan of ``launches`` (binary, grid, its bound arguments with pointer slots at 0, and
    (argument position, source index, byte offset) per pointer), or None where a binary needs something
    this launcher does not do (module docstring)."""
    words = [len(launches)]
    for binary, grid, args, pointers in launches:
        encoded = _encode_launch(binary, grid, args, pointers)
        if encoded is None:
            return None
        words.extend(encoded)
    return struct.pack(f"<{len(words)}Q", *words)


def _encode_launch(binary: Any, grid: tuple[int, int, int], args: list[Any],
                   pointers: list[tuple[int, int, int]]) -> list[int] | None:
    metadata = binary.metadata
    signature = getattr(binary.src, "signature", None)
    if (signature is None or getattr(metadata, "num_ctas", 1) != 1
            or getattr(metadata, "launch_cooperative_grid", False)
            or getattr(metadata, "global_scratch_size", 0) or getattr(metadata, "profile_scratch_size", 0)
            or getattr(metadata, "tensordesc_meta", None) or metadata.shared > 228 * 1024
            or len(signature) != len(args)):
        return None
    pointer_positions = {_path(position): (source, offset) for position, source, offset in pointers}
    argument_words, patches = [], []
    if not _encode_arguments(args, list(signature.values()), (), pointer_positions, argument_words, patches):
        return None
    argument_words.extend((0, 0))  # global and profile scratch: none (checked above)
    if len(argument_words) > MAX_ARGUMENT_WORDS:
        return None
    flags = 1 if getattr(metadata, "launch_pdl", False) else 0
    head = [int(binary.function), *grid, 32 * metadata.num_warps, metadata.shared, flags, len(argument_words),
            len(patches) // 3]
    return head + argument_words + patches



def _path(position: int | tuple[int, ...]) -> tuple[int, ...]:
    return (position,) if isinstance(position, int) else tuple(position)


def _encode_arguments(args: list[Any], kinds: list[Any], path: tuple[int, ...],
                      pointer_positions: dict[tuple[int, ...], tuple[int, int]], argument_words: list[int],
                      patches: list[int]) -> bool:
    """Appends the argument words of ``args`` (their signature ``kinds``) in the launcher's order: tuples
    flattened, constexprs left out; a pointer at a recorded position becomes a patch. False for a kind
    this launcher does not pack."""
    if len(args) != len(kinds):
        return False
    for index, (value, kind) in enumerate(zip(args, kinds, strict=True)):
        position = (*path, index)
        if kind == "constexpr":
            continue
        if isinstance(kind, tuple):
            if not isinstance(value, tuple) or not _encode_arguments(
                    list(value), list(kind), position, pointer_positions, argument_words, patches):
                return False
            continue
        if not isinstance(kind, str):
            return False
        if kind.startswith("*"):
            if position in pointer_positions:
                source, offset = pointer_positions[position]
                patches.extend((len(argument_words), source, offset))
                argument_words.append(0)
            elif value is None or isinstance(value, int):
                argument_words.append(value or 0)
            else:
                return False
        elif kind in _SCALAR_PACKERS:
            argument_words.append(_SCALAR_PACKERS[kind](value))
        else:
            return False
    return True
