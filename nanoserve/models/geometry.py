"""geometry.py: what the engine needs to know of a model's shape, read from its HF config, for
any family (vLLM's `ModelConfig.get_head_size()`, `get_num_kv_heads()`, `get_num_layers()`).

The KV cache is [num_blocks, block_size, KV heads per rank, head size] per layer; its sizing
(model_loader.py, `nanoserve memory`) and its allocation (model_runner.py) read these functions
and nothing of a model's modules, so a new family needs no change in the engine:

    >>> from transformers import Qwen3Config
    >>> cfg = Qwen3Config(num_attention_heads=16, num_key_value_heads=4, head_dim=128)
    >>> get_head_size(cfg), get_num_kv_heads(cfg, tensor_parallel_size=8)
    (128, 1)

Whether a config splits over a number of ranks at all (heads, MLP and expert sizes) is each
family's own check, made where it builds a rank's modules (models/__init__.py
`verify_with_parallel_config` builds rank 0's on the "meta" device to ask it).
"""

from __future__ import annotations


def get_head_size(hf_config) -> int:
    """Each attention head's width. Qwen3 sets head_dim explicitly (and num_heads * head_dim may
    differ from hidden_size)."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def get_total_num_kv_heads(hf_config) -> int:
    """K/V heads of the whole model (GQA); a config without num_key_value_heads has one per
    attention head."""
    return getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads


def get_num_attention_heads(hf_config, tensor_parallel_size: int = 1) -> int:
    """Query heads per rank: each of `tensor_parallel_size` ranks computes its share."""
    return hf_config.num_attention_heads // tensor_parallel_size


def get_num_kv_heads(hf_config, tensor_parallel_size: int = 1) -> int:
    """K/V heads per rank, never below one: with more ranks than KV heads each rank keeps a
    replica of one (as vLLM does)."""
    return max(1, get_total_num_kv_heads(hf_config) // tensor_parallel_size)


def get_num_layers(hf_config) -> int:
    """Decoder layers, each with a K and a V cache of its own."""
    return hf_config.num_hidden_layers


def get_num_experts(hf_config) -> int:
    """Experts of each MoE layer (Qwen3-MoE's num_experts, Mixtral's num_local_experts); 0 for a
    dense model, which expert parallel leaves alone (as vLLM: it applies to MoE layers only)."""
    return getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None) or 0
