"""Wrong answer to exercise 2.3: hands the work to a private copy of nanoserve's paged attention,
loaded again from its file under another name (a patch of the imported module does not see it)."""

import importlib.util
from pathlib import Path

import torch

import nanoserve

_path = Path(nanoserve.__file__).parent / "paged_attention.py"
_spec = importlib.util.spec_from_file_location("my_attention", _path)
_copy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_copy)


def paged_decode_attention(query, k_cache, v_cache, block_table, seq_len, scale):
    size = k_cache.shape[1]
    slot = block_table[(seq_len - 1) // size] * size + (seq_len - 1) % size
    meta = _copy.AttentionMetadata(torch.tensor([slot]),
                                   torch.tensor([block_table], dtype=torch.int32),
                                   torch.tensor([seq_len], dtype=torch.int32),
                                   torch.tensor([0, 1], dtype=torch.int32), 1)
    return _copy.paged_attention_torch(query[None], k_cache, v_cache, meta, scale)[0]
