"""Programmatic dependent launch (PDL, Hopper and later) for the MoE layer's chain of kernels.

A kernel launched with PDL may be scheduled while the kernel before it in the stream still runs. Each
kernel here that takes ``USE_PDL`` calls ``wait_for_previous_kernel`` as its first statement: it waits
until the kernel before it is done (and its writes are visible), then lets the next one be scheduled. So
results and ordering are those of a plain launch; only the gap between launches can shrink (alignment,
GEMM1, GEMM2 and the top-k sum of a decode step are four dependent launches of a few microseconds each).

One overlap goes further (``decode_shrink_overlap``): one decode token's GEMM1 reads only the LoRA shrink
partials from the launch before it (the gate/up shrink), so it starts while that launch still runs,
streams its base weights, and waits for it only before its epilogue. Past decode both GEMMs do the same
with the shrink launch before each (``prefill_shrink_overlap``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from triton_ops import overrides
from triton_ops.launch import planned


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr):
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def wait_for_previous_kernel_late(LATE_WAIT: tl.constexpr):
    """The wait of a kernel launched with ``late_wait``: placed after the work that does not read what the
    previous kernel writes (it does not let the next kernel be scheduled early: that one waits at once)."""
    if LATE_WAIT:
        gdc_wait()


@triton.jit
def release_next_then_wait(RELEASE_FIRST: tl.constexpr):
    """The prologue of a kernel launched dependently between a kernel it reads and one that waits late:
    it lets the next kernel be scheduled at once (that one waits for this one, hence for the one before,
    only before it reads their output), then waits for the kernel before it."""
    if RELEASE_FIRST:
        gdc_launch_dependents()
        gdc_wait()


def dependent_launch_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can be launched dependently (sm_90+; not the Triton interpreter)."""
    if torch.device(device).type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def require_dependent_launch(device: torch.device, what: str) -> None:
    """Raises ``ValueError`` naming ``what`` (a launch option) where dependent launch is not available."""
    if not dependent_launch_supported(device):
        raise ValueError(f"{what} needs dependent launch (an sm_90+ GPU), not {device}")


def decode_shrink_overlap(device: torch.device) -> bool:
    """Whether one decode token's GEMM1 overlaps the gate/up shrink launch before it: that launch lets
    the next one be scheduled as soon as its programs start, and GEMM1 (launched dependently) streams its
    base weights first and waits for the shrink only before its epilogue. On by default where dependent
    launch exists; ``shrink_overlap=0`` turns it off (to compare)."""
    return overrides.switch("shrink_overlap", default=True) and dependent_launch_supported(device)


def prefill_shrink_overlap(device: torch.device) -> bool:
    """Whether a batch's GEMMs (past one decode token) overlap the LoRA shrink launch before each: the
    shrink (``moe_lora_a``) lets the next launch be scheduled as soon as its programs start, and the GEMM
    (launched dependently) runs its K-loop over the base weights while the shrink still runs, waiting for
    it only before its epilogue (through a split-sum launch after the shrink only where
    ``fused_experts.overlap_through_split_sum`` says so: enough routed pairs or a wide rank tile). The
    shrinks read the LoRA A weights and re-read x or h: memory-bound work that the GEMMs' K-loops leave
    room for (docs/performance.md, 'Levers': GEMMs overlap prefill shrinks).
    On by default where dependent launch exists; ``prefill_shrink_overlap=0`` turns it off."""
    return overrides.switch("prefill_shrink_overlap", default=True) and dependent_launch_supported(device)


def dependent_fp8_decode(device: torch.device) -> bool:
    """Whether one decode token's FP8 layer chains its launches (x quantization, GEMM1, h quantization,
    GEMM2) by dependent launch: each is scheduled while the one before it runs and waits for it as its
    first instruction, so only the launch gaps shrink (same bits). With adapters (split path) the gate/up
    shrink's launch is the link after the x quantization, and GEMM1 keeps its late wait on that launch.
    On by default where dependent launch exists; ``fp8_dependent_decode=0`` turns it off."""
    return (overrides.switch("fp8_dependent_decode", default=True)
            and dependent_launch_supported(device))


def releasing_launch(device: torch.device, release_next: bool, *, dependent: bool = False) -> dict:
    """Keyword arguments for a launch of a kernel whose ``USE_PDL`` prologue waits for the kernel before
    it and then releases the next (``wait_for_previous_kernel``): the prologue compiled in with
    ``release_next``, the launch itself dependent with ``dependent`` (``programmatic_launch``)."""
    return programmatic_launch(device, dependent) | ({"USE_PDL": True} if release_next else {})


def programmatic_launch(device: torch.device, dependent: bool) -> dict:
    """Keyword arguments for a launch: ``{"USE_PDL": True, "launch_pdl": True}`` for a ``dependent`` one on
    an sm_90+ GPU (the kernel waits for the one before it as its first instruction), else ``{}``. Only
    launches whose own rule says so are dependent: every launch of the layer dependent did not win
    (docs/performance.md, 'Levers': every launch dependent). Made once per device in the active
    ``LaunchCache``."""
    if not dependent:
        return {}
    return planned(("programmatic_launch", device), lambda: _programmatic_launch(device))


def _programmatic_launch(device: torch.device) -> dict:
    if not dependent_launch_supported(device):
        return {}
    return {"USE_PDL": True, "launch_pdl": True}
