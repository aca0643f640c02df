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


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA with compiled Triton (TRITON_INTERPRET unset)")
    skip_interp = pytest.mark.skip(reason="runs Triton kernels on CPU tensors: set TRITON_INTERPRET=1")
    for item in items:
        if "gpu" in item.keywords and (not HAS_CUDA or INTERPRET):
            item.add_marker(skip_gpu)
        if "interpreter" in item.keywords and not INTERPRET:
            item.add_marker(skip_interp)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _release_cuda_cache(request):
    """After a GPU test, hand the caching allocator's free blocks back to the driver: parallel pytest
    shards on one GPU (tests/gpu_shards.sh) otherwise hold each other's peaks and run out of memory."""
    yield
    if HAS_CUDA and "gpu" in request.keywords:
        gc.collect()
        torch.cuda.empty_cache()
