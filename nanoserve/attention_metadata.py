"""attention_metadata.py: what one step's attention needs to know, built once per step by the model
runner and passed explicitly to every layer (no global context).

Every layer owns two cache tensors, K and V, each `[num_blocks, block_size, num_kv_heads, head_dim]`;
token position p of a request lives in physical slot

    slot = block_table[p // block_size] * block_size + p % block_size

so the metadata is the step's slots and block tables, and where each request's new tokens sit in
the flat batch. A backend may extend it with what its kernels read (cpu/backend.py: the step's
decodes and other requests as int32 arrays for the C kernels), as vLLM's attention backends build
their own metadata from the common one.

Lesson: lessons/02-paged-attention.md
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class AttentionMetadata:
    """Where this step's tokens go and what they attend to.

    Example, block_size 4: request 0 decodes its 10th token, request 1 prefills 3 prompt tokens.
        slot_mapping    [13, 20, 21, 22]       (position 9 of block table [7, 1, 3]; block 5)
        block_tables    [[7, 1, 3], [5, 0, 0]] (rows padded with 0)
        seq_lens        [10, 3]
        query_start_loc [0, 1, 4]
        max_query_len 3
    """

    slot_mapping: Tensor  # [num_tokens] int64: cache slot of each new token
    block_tables: Tensor  # [num_reqs, max_blocks_per_req] int32, rows padded with 0
    seq_lens: Tensor  # [num_reqs] int32: tokens in the cache per request after this step
    query_start_loc: Tensor  # [num_reqs + 1] int32: request i's tokens are query[qsl[i]:qsl[i+1]]
    max_query_len: int

    def __post_init__(self):
        # Shape checks only: they cost nothing and need no device sync, unlike value checks.
        num_reqs = self.seq_lens.shape[0]
        if self.slot_mapping.dim() != 1 or self.slot_mapping.dtype != torch.int64:
            raise ValueError(
                f"slot_mapping must be 1-D int64, got shape {tuple(self.slot_mapping.shape)} "
                f"dtype {self.slot_mapping.dtype}"
            )
        if self.seq_lens.dim() != 1:
            raise ValueError(f"seq_lens must be 1-D, got shape {tuple(self.seq_lens.shape)}")
        if self.block_tables.dim() != 2 or self.block_tables.shape[0] != num_reqs:
            raise ValueError(
                f"block_tables must be [num_reqs={num_reqs}, max_blocks_per_req], "
                f"got shape {tuple(self.block_tables.shape)}"
            )
        if tuple(self.query_start_loc.shape) != (num_reqs + 1,):
            raise ValueError(
                f"query_start_loc must have num_reqs + 1 = {num_reqs + 1} entries, "
                f"got shape {tuple(self.query_start_loc.shape)}"
            )

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]
