"""nanoserve: a small, readable LLM serving engine built the way vLLM V1 is built.

    from nanoserve import LLM, SamplingParams
    print(LLM().generate("Once upon a time", SamplingParams(max_tokens=40))[0].outputs[0].text)

The names below load lazily, so `from nanoserve import Config` does not import torch.
"""

import importlib

_EXPORTS = {
    "Config": "nanoserve.config",
    "SamplingParams": "nanoserve.sampling_params",
    "StructuredOutputsParams": "nanoserve.sampling_params",
    "LLM": "nanoserve.engine",
    "EngineCore": "nanoserve.engine_core",
    "AsyncLLM": "nanoserve.engine",
    "RequestOutput": "nanoserve.output_processor",
    "CompletionOutput": "nanoserve.output_processor",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'nanoserve' has no attribute {name!r}")
