"""
vLLM's ``communication_op`` wrappers, at vLLM's module path
===========================================================

Thin functions over the tensor-parallel coordinator (defined in
:mod:`ftdist.coordinator.parallel_state`), so code written against
``vllm.distributed.communication_op`` ports by changing the import.
"""

from __future__ import annotations

from ftdist.coordinator.parallel_state import (
    broadcast_tensor_dict,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
    tensor_model_parallel_gather,
    tensor_model_parallel_reduce_scatter,
)

__all__ = [
    "broadcast_tensor_dict",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_gather",
    "tensor_model_parallel_reduce_scatter",
]
