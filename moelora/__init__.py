"""moelora: serve many LoRA adapters of one Mixture-of-Experts model at once, with Triton kernels.

Importing the package does not compile or load any Triton kernel: the kernel modules are imported
when a layer first runs on the Triton path, so ``TRITON_INTERPRET`` can still be set after import.
"""

from moelora.batch_info import MoELoRABatchInfo
from moelora.layer import FusedMoEWithLoRA
from moelora.pool import AdapterLoadError, LoRALayerBuffers, MoELoRAMemoryPool

__all__ = [
    "AdapterLoadError",
    "FusedMoEWithLoRA",
    "LoRALayerBuffers",
    "MoELoRABatchInfo",
    "MoELoRAMemoryPool",
]
