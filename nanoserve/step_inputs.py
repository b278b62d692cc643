"""step_inputs.py: one step's inputs at fixed addresses, and the padding that lets a decode step
replay a captured graph.

The runner builds each step's flat batch on the host (model_runner.prepare_inputs) and places it
here: written into ONE pinned host buffer, then ONE host-to-device copy into the device buffer,
whose views are the tensors the model reads. On CPU the two buffers are one: nothing is copied.

Why fixed addresses: a CUDA graph (cuda/graphs.py) records the addresses its kernels read, and a
replay reads whatever is there. So every step writes its inputs to the same addresses, allocated
once, for the largest step (max_num_batched_tokens tokens, max_num_seqs requests, block tables as
wide as max_model_len allows), as vLLM's GPUModelRunner sizes its input buffers; eager steps use
them too, so there is one way to build a step's inputs.

Why padding: a graph is captured for one batch size (`cudagraph_capture_sizes`). A decode step
of n requests (one new token each) runs as the next captured size P >= n (`padded_batch_size`),
its rows n .. P-1 inert:

    input_ids, positions   0               any token: its row's results are never read
    slot_mapping          -1               nothing stored (every store form skips a slot < 0)
    seq_lens               0               nothing attended
    query_start_loc        n, n, ...       no query tokens

Example, 3 decodes padded to 4: slot_mapping [13, 20, 41, -1], seq_lens [10, 5, 30, 0],
query_start_loc [0, 1, 2, 3, 3].

    pytest -q tests/test_cuda_graphs.py
"""

from __future__ import annotations

import bisect
import math
from typing import Optional

import torch
from torch import Tensor

from nanoserve.attention_metadata import AttentionMetadata

PAD_SLOT_ID = -1   # vLLM's name: a token with no cache slot
ALIGN = 16         # bytes: Triton specialises a kernel on 16-byte aligned pointers: keep all so


def padded_batch_size(n: int, sizes: list[int]) -> Optional[int]:
    """The smallest captured size >= n (`sizes` ascending); None above the largest (the step runs
    eagerly, as it is).

    >>> padded_batch_size(3, [1, 2, 4, 8]), padded_batch_size(8, [1, 2, 4, 8])
    (4, 8)
    >>> padded_batch_size(9, [1, 2, 4, 8]) is None
    True
    """
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class StepInputs:
    """The persistent buffers: `views` (on the device) and `host_views` (pinned on CUDA), by name.
    The block tables come last, so that a step copies only the prefix it uses: the token
    arrays whole (64 KiB at 2,048 tokens) and its requests' rows of the block table."""

    def __init__(self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int,
                 device: torch.device):
        self.shapes = {name: ((max_num_tokens,), torch.int64) for name in
                       ("input_ids", "positions", "slot_mapping", "logits_indices")}
        self.shapes.update(seq_lens=((max_num_reqs,), torch.int32),
                           query_start_loc=((max_num_reqs + 1,), torch.int32),
                           block_tables=((max_num_reqs, max_blocks_per_req), torch.int32))
        self.max_num_tokens, self.max_num_reqs = max_num_tokens, max_num_reqs
        self.max_blocks_per_req = max_blocks_per_req
        self.offsets, size = {}, 0
        for name, (shape, dtype) in self.shapes.items():
            self.offsets[name] = size
            size += -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN
        cuda = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.uint8, pin_memory=cuda)
        self.buffer = torch.zeros(size, dtype=torch.uint8, device=device) if cuda else self.host
        # Set once a step's copy is queued: the next step waits on it before it rewrites the
        # pinned buffer the copy reads (vLLM's prepare_inputs_event).
        self.copied = torch.cuda.Event() if cuda else None
        self.host_views = {name: self._view(self.host, name) for name in self.shapes}
        self.views = {name: self._view(self.buffer, name) for name in self.shapes}

    def _view(self, buffer: Tensor, name: str) -> Tensor:
        shape, dtype = self.shapes[name]
        return buffer[self.offsets[name]:].view(dtype)[:math.prod(shape)].view(shape)

    def place(self, input_ids: Tensor, positions: Tensor, slot_mapping: Tensor, seq_lens: Tensor,
              query_start_loc: Tensor, block_tables: Tensor, logits_indices: Tensor,
              max_query_len: int, num_rows: Optional[int] = None):
        """The step's host tensors written into the buffers, padded with inert rows up to
        `num_rows` tokens and requests where given (a decode step: one token a request), and
        copied to the device at once. Returns (input_ids, positions, AttentionMetadata,
        logits_indices): views of the device buffer."""
        num_tokens, num_reqs, width = len(input_ids), len(seq_lens), block_tables.shape[1]
        rows, reqs = (num_rows, num_rows) if num_rows else (num_tokens, num_reqs)
        if (rows > self.max_num_tokens or reqs > self.max_num_reqs
                or width > self.max_blocks_per_req):
            raise ValueError(f"a step of {rows} tokens, {reqs} requests and {width} blocks a "
                             f"request is past the step buffers' {self.max_num_tokens}, "
                             f"{self.max_num_reqs} and {self.max_blocks_per_req}")
        if self.copied is not None:
            self.copied.synchronize()
        host = self.host_views
        for name, values, length, pad in (
                ("input_ids", input_ids, rows, 0), ("positions", positions, rows, 0),
                ("slot_mapping", slot_mapping, rows, PAD_SLOT_ID), ("seq_lens", seq_lens, reqs, 0),
                ("query_start_loc", query_start_loc, reqs + 1, num_tokens),
                ("logits_indices", logits_indices, len(logits_indices), 0)):
            n = values.shape[0]
            host[name][:n].copy_(values)
            if length > n:
                host[name][n:length] = pad
        host["block_tables"][:num_reqs, :width].copy_(block_tables)   # padded rows: never read
        if self.buffer is not self.host:
            end = self.offsets["block_tables"] + reqs * self.max_blocks_per_req * 4
            self.buffer[:end].copy_(self.host[:end], non_blocking=True)
            self.copied.record()
        dev = self.views
        meta = AttentionMetadata(
            slot_mapping=dev["slot_mapping"][:rows],
            block_tables=dev["block_tables"][:reqs, :width],
            seq_lens=dev["seq_lens"][:reqs], query_start_loc=dev["query_start_loc"][:reqs + 1],
            max_query_len=max_query_len)
        return (dev["input_ids"][:rows], dev["positions"][:rows], meta,
                dev["logits_indices"][:len(logits_indices)])

    def padded_decode(self, size: int) -> tuple[Tensor, Tensor, AttentionMetadata]:
        """A decode step of `size` rows, all of them padding (the step a graph is captured on):
        (input_ids, positions, AttentionMetadata) over the whole width of the block tables."""
        none = torch.zeros(0, dtype=torch.int64)
        tables = torch.zeros(0, self.max_blocks_per_req, dtype=torch.int32)
        input_ids, positions, meta, _ = self.place(none, none, none, none, torch.zeros(1), tables,
                                                   none, max_query_len=1, num_rows=size)
        return input_ids, positions, meta
