"""Triton kernels of moelora and their launch wrappers (no CUDA/C++ extension anywhere)."""

from triton_ops.activation import act_and_mul, gelu_and_mul, silu_and_mul
from triton_ops.configs import GemmConfig, MoEConfig, get_moe_config
from triton_ops.fused_experts import fused_experts
from triton_ops.fused_moe import invoke_fused_moe_kernel
from triton_ops.moe_align import moe_align_block_size
from triton_ops.moe_sum import moe_sum_reduce

__all__ = [
    "GemmConfig",
    "MoEConfig",
    "act_and_mul",
    "fused_experts",
    "gelu_and_mul",
    "get_moe_config",
    "invoke_fused_moe_kernel",
    "moe_align_block_size",
    "moe_sum_reduce",
    "silu_and_mul",
]
