"""backend.py: the CPU backend, bound to a loaded model once: each op's C form, each product's
path timed on this machine, and decode steps captured and replayed (graphs.py).

    backend = bind(model, config)     # None where the C kernels cannot be built here
    backend.forward(input_ids, positions, kv_caches, backend.build_metadata(attn_metadata))

What `bind` does, in order:
  1. glibc keeps freed activation memory (host_memory.py);
  2. every Linear gets the product path timed fastest here on its shape (gemm.py), and gives up
     its unpacked weight to it;
  3. RMSNorm, SiluAndMul, RopeStoreKV and Attention get their C forms (ops.py), FusedMoE its
     grouped form (moe.py: each expert's products on the path timed for its shape);
  4. at one rank, in float32 or bf16 (the dtypes of the C forms) and unless enforce_eager, the
     forward is wrapped for capture (graph_capture.py with graphs.py's CpuGraph): the runner
     captures a decode step per size once its KV cache exists, and those steps replay.

NANOSERVE_CPU_KERNEL=0 skips the backend altogether (backends.py): the torch reference everywhere.

    pytest -q tests/test_cpu_backend.py tests/test_cpu_graphs.py
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from nanoserve.config import Config
from nanoserve.cpu import kernels as cpu_kernels
from nanoserve.cpu.gemm import choose_cpu_gemms
from nanoserve.cpu.graphs import CpuGraph
from nanoserve.cpu.host_memory import keep_freed_memory, new_kv_cache
from nanoserve.cpu.moe import CpuFusedMoE
from nanoserve.cpu.ops import CpuAttentionMetadata, attention, rms_norm, rope_store_kv, silu_and_mul
from nanoserve.graph_capture import GraphWrapper
from nanoserve.layers import (Attention, Backend, FusedMoE, Linear, RMSNorm, RopeStoreKV, SiluAndMul,
                              model_dtype)


def model_step(model, build_metadata, input_ids, positions, kv_caches, attn_metadata):
    """The model on the CPU's metadata, built here when the caller has not (a capture: then the
    building is recorded with the step, on the runner's inputs)."""
    return model(input_ids, positions, kv_caches, build_metadata(attn_metadata))


def bind(model, config: Config) -> Optional[Backend]:
    """Give `model`'s ops their CPU forms (the module docstring); None without the C kernels
    (kernels.load() has warned), and the model keeps its torch reference."""
    if cpu_kernels.load() is None:
        return None
    keep_freed_memory()
    dtype = model_dtype(model)    # the activations'
    gemms, gemm_paths = choose_cpu_gemms(model, config)
    for module in model.modules():
        if isinstance(module, Linear):
            module.impl, module.weight = gemms[module].product, None   # the gemm holds what it needs
        elif isinstance(module, RMSNorm):
            module.impl = functools.partial(rms_norm, module)
        elif isinstance(module, SiluAndMul):
            module.impl = silu_and_mul
        elif isinstance(module, RopeStoreKV):
            module.impl = functools.partial(rope_store_kv, module)
        elif isinstance(module, Attention):
            module.impl = functools.partial(attention, module)
        elif isinstance(module, FusedMoE):
            module.impl = CpuFusedMoE(module, dtype, config, gemm_paths).forward
    capturable = config.tensor_parallel_size == 1 and dtype in (torch.float32, torch.bfloat16)
    sizes = config.cudagraph_capture_sizes if capturable else []
    # A request verifying k drafts is k + 1 decodes (vLLM's reorder_batch_threshold): cpu/ops.py
    spec = config.speculative_config
    build_metadata = functools.partial(CpuAttentionMetadata.of, max_decode_query_len=1 + (
        spec.num_speculative_tokens if spec is not None else 0))
    if not sizes:
        return Backend("cpu", model, build_metadata=build_metadata, argmax=cpu_kernels.argmax,
                       new_kv_cache=new_kv_cache, gemm_paths=gemm_paths)
    graphs = GraphWrapper(functools.partial(model_step, model, build_metadata), sizes, CpuGraph)
    return Backend("cpu", graphs, build_metadata=build_metadata, argmax=cpu_kernels.argmax,
                   new_kv_cache=new_kv_cache, gemm_paths=gemm_paths,
                   cudagraph_capture_sizes=sizes, capture=graphs.capture)
