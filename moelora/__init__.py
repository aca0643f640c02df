"""moelora: serve many LoRA adapters of one Mixture-of-Experts model at once, with Triton kernels.

Importing the package does not compile or load any Triton kernel: the kernel modules are imported
when a layer first runs on the Triton path, so ``TRITON_INTERPRET`` can still be set after import.
"""

from moelora.activations import GatedActivation
from moelora.adapter_weights import AdapterLoadError, LoRAProjection, ReferenceLoRA
from moelora.batch_info import MoELoRABatchInfo, StaleBatchError
from moelora.layer import FusedMoEWithLoRA
from moelora.pool import LoRALayerBuffers, MoELoRAMemoryPool
from moelora.pool_report import AdapterMemory, PoolMemoryReport, PoolState

__all__ = [
    "AdapterLoadError",
    "AdapterMemory",
    "FusedMoEWithLoRA",
    "GatedActivation",
    "LoRALayerBuffers",
    "LoRAProjection",
    "MoELoRABatchInfo",
    "MoELoRAMemoryPool",
    "PoolMemoryReport",
    "PoolState",
    "ReferenceLoRA",
    "StaleBatchError",
]
