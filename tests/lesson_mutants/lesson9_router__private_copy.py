"""Wrong answer to exercise 9.3: hands the routing to nanoserve's select_experts, from a private
copy of layers.py loaded again under another name."""

import importlib.util
import sys
from pathlib import Path

import nanoserve

_spec = importlib.util.spec_from_file_location("my_layers", Path(nanoserve.__file__).parent / "layers.py")
_copy = sys.modules["my_layers"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_copy)


def select_experts(router_logits, top_k, renormalize):
    return _copy.select_experts(router_logits, top_k, renormalize)
