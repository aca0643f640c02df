"""Programmatic dependent launch (PDL, Hopper and later) for the MoE layer's chain of kernels.

A kernel launched with PDL may be scheduled while the kernel before it in the stream still runs. Each
kernel here that takes ``USE_PDL`` calls ``wait_for_previous_kernel`` as its first statement: it waits
until the kernel before it is done (and its writes are visible), then lets the next one be scheduled. So
results and ordering are those of a plain launch; only the gap between launches can shrink (alignment,
GEMM1, GEMM2 and the top-k sum of a decode step are four dependent launches of a few microseconds each).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr):
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


def programmatic_launch(device: torch.device) -> dict:
    """Keyword arguments for a launch with PDL: ``{"USE_PDL": True, "launch_pdl": True}`` with
    ``MOELORA_PDL=1`` on an sm_90+ GPU, else ``{}``. Off by default until it is measured on the device
    (``benchmarks/ab_env.py --env MOELORA_PDL=1``)."""
    mode = os.environ.get("MOELORA_PDL", "")
    if mode not in ("", "0", "1"):
        raise ValueError(f"MOELORA_PDL must be 0 or 1, got {mode!r}")
    if mode != "1" or torch.device(device).type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return {}
    if torch.cuda.get_device_capability(device)[0] < 9:
        return {}
    return {"USE_PDL": True, "launch_pdl": True}
