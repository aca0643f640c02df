"""Test setup shared by every test file.

Without a GPU the Triton kernels run in the interpreter, which must be switched on before triton is
imported anywhere; that is why this happens at the top of the conftest. GPU tests (marked ``gpu``)
need CUDA and a compiled Triton, so they are skipped under the interpreter; the CPU kernel tests
(marked ``interpreter``) are skipped on a CUDA machine unless TRITON_INTERPRET=1 is set.
"""

import gc
import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

import pytest  # noqa: E402


def _round_fp8_like_the_gpu() -> None:
    """Triton's interpreter rounds float -> float8_e4m3fn without carrying a round-up into the exponent
    (``interpreter._convert_float``: 127.6 becomes 64, not 128), where the GPU's conversion rounds to
    nearest even. FP8 kernels are tested against PyTorch's conversion, which the GPU's matches, so under the
    interpreter that one conversion goes through PyTorch. Every other conversion is the interpreter's."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    convert = interpreter._convert_float
    sources = {tl.float32: (np.float32, torch.float32), tl.float16: (np.float16, torch.float16)}

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        if output_dtype == tl.float8e4nv and input_dtype in sources:
            np_dtype, torch_dtype = sources[input_dtype]
            values = torch.from_numpy(np.ascontiguousarray(input).view(np_dtype).copy())
            return values.to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(input.shape)
        return convert(input, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert_float


if INTERPRET:
    _round_fp8_like_the_gpu()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:  # only the interpreter stands in the way
        skip_gpu = pytest.mark.skip(reason="needs compiled Triton: unset TRITON_INTERPRET (it is 1 here)")
    else:
        skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch sees none here)")
    skip_interp = pytest.mark.skip(reason="runs Triton kernels on CPU tensors: set TRITON_INTERPRET=1")
    for item in items:
        if "gpu" in item.keywords and (not HAS_CUDA or INTERPRET):
            item.add_marker(skip_gpu)
        if "interpreter" in item.keywords and not INTERPRET:
            item.add_marker(skip_interp)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _pool_invariants():
    """Every pool of the test suite checks its invariants after each of its transactions."""
    from moelora.pool import MoELoRAMemoryPool

    MoELoRAMemoryPool.debug_invariants = True
    yield
    MoELoRAMemoryPool.debug_invariants = False


@pytest.fixture(autouse=True)
def _release_cuda_cache(request):
    """After a GPU test, hand the caching allocator's free blocks back to the driver: parallel pytest
    shards on one GPU (tests/gpu_shards.sh) otherwise hold each other's peaks and run out of memory."""
    yield
    if HAS_CUDA and "gpu" in request.keywords:
        gc.collect()
        torch.cuda.empty_cache()
