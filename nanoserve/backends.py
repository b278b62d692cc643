"""backends.py: the seam's registry. Which form each op of the model takes (layers.py), chosen once
at load for the device, and never per call:

    cuda   cuda/backend.py: Triton kernels for every op but the products (cuBLAS, F.linear);
           decode steps replayed as CUDA graphs (cuda/graphs.py)
    cpu    cpu/backend.py: the C kernels, each product on the path timed fastest on this CPU, and
           the fused step; where the C kernels cannot be built, the torch reference
    else   the torch reference (layers.py's forward_native), also on CPU with NANOSERVE_CPU_KERNEL=0

    backend = load_backend(model, config, torch.device("cpu"))
    hidden = backend.forward(input_ids, positions, kv_caches, backend.build_metadata(attn_metadata))

The teaching core imports cpu/ and cuda/ here alone, and only for the device it runs on (a GPU
rank never builds the CPU kernels; a CPU never imports Triton).
"""

from __future__ import annotations

import os

import torch

from nanoserve.config import Config
from nanoserve.layers import Backend, Linear, gemm_label


def load_backend(model, config: Config, device: torch.device) -> Backend:
    """Bind `model`'s ops to the backend for `device` (the module docstring)."""
    if device.type == "cuda":
        from nanoserve.cuda.backend import bind
        return bind(model, config, torch_gemm_paths(model))
    if device.type == "cpu" and os.environ.get("NANOSERVE_CPU_KERNEL") != "0":
        from nanoserve.cpu.backend import bind
        backend = bind(model, config)
        if backend is not None:
            return backend
    return Backend("torch", model, gemm_paths=torch_gemm_paths(model))


def torch_gemm_paths(model) -> dict[str, str]:
    """Backend.gemm_paths where every product is F.linear."""
    return {gemm_label(m, m.weight.dtype): "torch" for m in model.modules() if isinstance(m, Linear)}
