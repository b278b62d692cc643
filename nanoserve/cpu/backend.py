"""backend.py: the CPU backend, bound to a loaded model once: each op's C form, each product's
path timed on this machine, and the fused step that runs every step where it can.

    backend = bind(model, config)     # None where the C kernels cannot be built here
    backend.forward(input_ids, positions, kv_caches, backend.build_metadata(attn_metadata))

What `bind` does, in order:
  1. glibc keeps freed activation memory (host_memory.py);
  2. every Linear gets the product path timed fastest here on its shape (gemm.py), and gives up
     its unpacked weight to it;
  3. RMSNorm, SiluAndMul, RopeStoreKV and Attention get their C forms (ops.py);
  4. where the model allows it (fused.py: FusedStep.supports), the step runs as the fused step:
     the same kernels in one flat loop, with the norms inside the products and silu(gate) * up on
     gate_up's tiles. NANOSERVE_CPU_FUSION=0 keeps the unfused forms (to compare the two).

NANOSERVE_CPU_KERNEL=0 skips the backend altogether (backends.py): the torch reference everywhere.

    pytest -q tests/test_cpu_backend.py tests/test_cpu_fused.py
"""

from __future__ import annotations

import functools
import os
from typing import Optional

from nanoserve.config import Config
from nanoserve.cpu import kernels as cpu_kernels
from nanoserve.cpu.fused import FusedStep
from nanoserve.cpu.gemm import choose_cpu_gemms
from nanoserve.cpu.host_memory import keep_freed_memory, new_kv_cache
from nanoserve.cpu.ops import CpuAttentionMetadata, attention, rms_norm, rope_store_kv, silu_and_mul
from nanoserve.layers import Attention, Backend, Linear, RMSNorm, RopeStoreKV, SiluAndMul


def fusion_enabled() -> bool:
    return os.environ.get("NANOSERVE_CPU_FUSION") != "0"


def bind(model, config: Config) -> Optional[Backend]:
    """Give `model`'s ops their CPU forms (the module docstring); None without the C kernels
    (kernels.load() has warned), and the model keeps its torch reference."""
    if cpu_kernels.load() is None:
        return None
    keep_freed_memory()
    fused = fusion_enabled() and FusedStep.supports(model)
    gemms, gemm_paths = choose_cpu_gemms(model, config, silu_fused=fused)
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
    forward = FusedStep.build(model, gemms) if fused else model
    # A request verifying k drafts is k + 1 decodes (vLLM's reorder_batch_threshold): cpu/ops.py
    spec = config.speculative_config
    build_metadata = functools.partial(CpuAttentionMetadata.of, max_decode_query_len=1 + (
        spec.num_speculative_tokens if spec is not None else 0))
    return Backend("cpu", forward, build_metadata=build_metadata, argmax=cpu_kernels.argmax,
                   new_kv_cache=new_kv_cache, gemm_paths=gemm_paths)
