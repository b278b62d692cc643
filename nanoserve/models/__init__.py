"""models: the model registry, keyed by the `architectures` field of a checkpoint's config.json.

    >>> from transformers import Qwen2Config
    >>> get_model_class(Qwen2Config(architectures=["Qwen2ForCausalLM"])).__name__
    'LlamaForCausalLM'

Every supported architecture is a Llama variant, so one parametrised class (models/llama.py)
serves them all; a new family adds a module and a line here.
"""

from __future__ import annotations

from torch import nn

from nanoserve.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,  # also SmolLM, which ships the Llama architecture
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
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


__all__ = ["MODEL_REGISTRY", "LlamaForCausalLM", "get_model_class"]
