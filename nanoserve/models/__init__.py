"""models: the model registry, keyed by the `architectures` field of a checkpoint's config.json,
and what the engine asks of any model: its geometry (geometry.py) and whether it splits over a
number of ranks (`verify_with_parallel_config`).

    >>> from transformers import Qwen2Config
    >>> get_model_class(Qwen2Config(architectures=["Qwen2ForCausalLM"])).__name__
    'LlamaForCausalLM'

The engine imports this package, never a family's module: a new family adds a module and a line
in MODEL_REGISTRY. Its class is built as `cls(hf_config, tp, quantization, lm_head_quantization)`
and offers `forward`, `compute_logits`, `load_weights`, `config` and `sliding_window`.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoserve.distributed import ExpertExchange, TensorParallel
from nanoserve.models.geometry import (get_head_size, get_moe_shape, get_num_attention_heads,
                                       get_num_kv_heads, get_num_layers, get_total_num_kv_heads)
from nanoserve.models.llama import LlamaForCausalLM
from nanoserve.models.mixture_of_experts import MixtralForCausalLM, Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,  # also SmolLM, which ships the Llama architecture
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}


def get_model_class(hf_config) -> type[nn.Module]:
    """The module class for an HF config, from its `architectures` list."""
    architectures = getattr(hf_config, "architectures", None) or []
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(
        f"unsupported model architectures {architectures} (config.json `architectures`); "
        f"nanoserve supports: {', '.join(MODEL_REGISTRY)}"
    )


def verify_with_parallel_config(hf_config, tensor_parallel_size: int,
                                enable_expert_parallel: bool = False,
                                data_parallel_size: int = 1) -> None:
    """ValueError when `hf_config` cannot be split over `tensor_parallel_size` ranks (heads, MLP
    or expert sizes: each family checks its own as it builds a rank's modules), or under expert
    parallel its experts over the `data_parallel_size` ranks (DP+EP). Rank 0's modules
    are built on the "meta" device (shapes, no memory), so the error is raised in the caller's
    process before any worker starts (vLLM's ModelConfig.verify_with_parallel_config)."""
    dp = enable_expert_parallel and data_parallel_size > 1
    tp = TensorParallel(0, tensor_parallel_size, enable_expert_parallel,
                        expert_exchange=ExpertExchange(0, data_parallel_size) if dp else None)
    with torch.device("meta"):
        get_model_class(hf_config)(hf_config, tp)


__all__ = ["MODEL_REGISTRY", "LlamaForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM",
           "get_head_size", "get_model_class", "get_moe_shape",
           "get_num_attention_heads", "get_num_kv_heads", "get_num_layers",
           "get_total_num_kv_heads", "verify_with_parallel_config"]
