"""ops.py: the CPU backend's form of each op of the seam (layers.py), on the C kernels (kernels.py).

Each computes what the op's `forward_native` computes, and falls back to it wherever a kernel cannot
take the tensors it is given (a dtype other than float32 or bf16, a non-contiguous view, no C
compiler here). cpu/backend.py sets them as the ops' `impl` once, at load.

Attention reads `CpuAttentionMetadata`: the common metadata plus the step's decodes and its other
requests as the two attention kernels take them (contiguous int32 arrays and their addresses),
built once a step by the model runner (`Backend.build_metadata`), not once a layer.

    pytest -q tests/test_cpu_backend.py
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from nanoserve.attention_metadata import AttentionMetadata
from nanoserve.cpu import kernels as cpu_kernels
from nanoserve.layers import Attention, RMSNorm, RopeStoreKV, SiluAndMul
from nanoserve.paged_attention import attend_each

NATIVE_SILU_AND_MUL = SiluAndMul()   # the reference, where silu_and_mul.c cannot run


def rms_norm(norm: RMSNorm, x: Tensor, residual: Optional[Tensor] = None):
    """RMSNorm.forward: norm(x), or (norm(x + residual), residual) with the residual updated in
    place; rms_norm.c in one pass. Qwen3's q and k norms get views of qkv's columns, made
    contiguous first: one copy, where torch's form is seven passes."""
    if residual is None and x.stride(-1) == 1 and not x.is_contiguous():
        x = x.contiguous()
    out = cpu_kernels.rms_norm(x, residual, norm.weight, norm.eps)
    if out is None:
        return norm.forward_native(x, residual)
    return out if residual is None else (out, residual)


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """SiluAndMul.forward: silu_and_mul.c, into the contiguous rows down_proj reads."""
    out = cpu_kernels.silu_and_mul(gate_up)
    return NATIVE_SILU_AND_MUL.forward_native(gate_up) if out is None else out


def fused_rows(q: Tensor, k: Tensor, v: Tensor) -> Optional[Tensor]:
    """The qkv rows [tokens, q + 2 kv] that q, k and v were split from, where they are its three
    column blocks in order (the model's split views, no Qwen3 q/k norm between); else None."""
    n, item = q.shape[0], q.element_size()
    widths = [t[0].numel() if n else 0 for t in (q, k, v)]
    row = sum(widths)
    # (one token: torch's view may give its size-1 row dimension any stride)
    same_rows = all((n == 1 or t.stride(0) == row) and t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]
                    for t in (q, k, v))
    adjacent = (k.data_ptr() == q.data_ptr() + widths[0] * item
                and v.data_ptr() == k.data_ptr() + widths[1] * item
                and q.untyped_storage().data_ptr() == v.untyped_storage().data_ptr())
    return q.as_strided((n, row), (row, 1)) if n and same_rows and adjacent else None


def rope_store_kv(op: RopeStoreKV, rope, q: Tensor, k: Tensor, v: Tensor, kv_cache, slot_mapping):
    """RopeStoreKV.forward: rope.c reads the fused qkv rows, rotates q and k, stores k and v. Where
    q and k are not qkv's own columns (Qwen3 normalised them), their rows are put side by side
    first: one copy, and the step stays C calls (and capturable: graphs.py)."""
    qkv = fused_rows(q, k, v)
    if qkv is None and q.dtype == k.dtype == v.dtype:
        qkv = torch.cat([t.reshape(t.shape[0], -1) for t in (q, k, v)], dim=1)
    out = None if qkv is None else cpu_kernels.rope_store_kv(qkv, rope, slot_mapping, *kv_cache,
                                                             q.shape[1])
    return op.forward_native(rope, q, k, v, kv_cache, slot_mapping) if out is None else out


class RequestGroup(NamedTuple):
    """Some of a step's requests, in contiguous int32 tensors (what the C kernels read): one entry
    per request, or for decode_attention.c one per query token (`per_token`)."""
    indices: list[int]     # which of the step's requests
    query_start: Tensor    # [n]: each one's first row in the flat batch
    query_len: Tensor      # [n]
    block_tables: Tensor   # [n, max_blocks_per_req]
    seq_lens: Tensor       # [n]
    arguments: tuple[int, ...]   # the 4 addresses, n, max_blocks_per_req: once a step, not a layer

    @staticmethod
    def of(md: AttentionMetadata, selected: Tensor) -> "RequestGroup":
        rows = selected.nonzero().flatten()
        qsl = md.query_start_loc
        arrays = (qsl[rows].to(torch.int32), (qsl[rows + 1] - qsl[rows]).to(torch.int32),
                  md.block_tables[rows].to(torch.int32), md.seq_lens[rows].to(torch.int32))
        return RequestGroup(rows.tolist(), *arrays,
                            (*(a.data_ptr() for a in arrays), len(rows), arrays[2].shape[1]))

    @staticmethod
    def every(md: AttentionMetadata) -> "RequestGroup":
        """All of a decode-only step's requests, read where they are (the runner's int32 step
        inputs, no copy where they are contiguous) and without reading a value: a captured step
        (graphs.py) replays the same addresses. Padded rows (seq_len 0) are attended to nothing."""
        qsl = md.query_start_loc.to(torch.int32)
        arrays = (qsl[:-1], qsl[1:] - qsl[:-1], md.block_tables.to(torch.int32).contiguous(),
                  md.seq_lens.to(torch.int32).contiguous())
        return RequestGroup(list(range(md.num_reqs)), *arrays,
                            (*(a.data_ptr() for a in arrays), md.num_reqs, arrays[2].shape[1]))

    @staticmethod
    def per_token(md: AttentionMetadata, selected: list[bool]) -> "RequestGroup":
        """Each query token of the selected requests as a decode of its own, seeing the keys up
        to its own position: a request verifying 2 drafts with seq_len 10 (rows 4-6) ->
        query_start [4, 5, 6], seq_lens [8, 9, 10], query_len 1 each. Built in Python lists:
        for a step's few requests, cheaper than a dozen small tensor ops."""
        qsl, seq_lens = md.query_start_loc.tolist(), md.seq_lens.tolist()
        rows = [r for r, s in enumerate(selected) if s]
        tokens = [(r, j, qsl[r + 1] - qsl[r]) for r in rows for j in range(qsl[r + 1] - qsl[r])]
        arrays = (torch.tensor([qsl[r] + j for r, j, _ in tokens], dtype=torch.int32),
                  torch.ones(len(tokens), dtype=torch.int32),
                  md.block_tables[[r for r, _, _ in tokens]].to(torch.int32),
                  torch.tensor([seq_lens[r] - (n - 1 - j) for r, j, n in tokens], dtype=torch.int32))
        return RequestGroup(rows, *arrays,
                            (*(a.data_ptr() for a in arrays), len(tokens), arrays[2].shape[1]))


# A step's empty group (a decode-only step has no other requests): built once, nothing to read.
NO_REQUESTS = RequestGroup([], *(torch.zeros(0, dtype=torch.int32) for _ in range(2)),
                           torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                           (0, 0, 0, 0, 0, 1))


@dataclass
class CpuAttentionMetadata(AttentionMetadata):
    decodes: Optional[RequestGroup] = None   # query_len <= max_decode_query_len: decode_attention.c
    others: Optional[RequestGroup] = None    # the rest: prefill_attention.c

    @staticmethod
    def of(md: AttentionMetadata, max_decode_query_len: int = 1) -> "CpuAttentionMetadata":
        """max_decode_query_len: 1 + num_speculative_tokens with speculation (vLLM's
        reorder_batch_threshold): a request verifying k drafts runs as k + 1 decodes, each
        token against the keys up to its own position (causal), in decode_attention.c."""
        if isinstance(md, CpuAttentionMetadata):
            return md
        common = {f.name: getattr(md, f.name) for f in dataclasses.fields(AttentionMetadata)}
        if md.max_query_len == 1:
            return CpuAttentionMetadata(**common, decodes=RequestGroup.every(md),
                                        others=NO_REQUESTS)
        query_len = md.query_start_loc[1:] - md.query_start_loc[:-1]
        if max_decode_query_len == 1:
            return CpuAttentionMetadata(**common, decodes=RequestGroup.of(md, query_len == 1),
                                        others=RequestGroup.of(md, query_len > 1))
        short = query_len <= max_decode_query_len
        return CpuAttentionMetadata(**common, decodes=RequestGroup.per_token(md, short.tolist()),
                                    others=RequestGroup.of(md, ~short))


def paged_attention_cpu(q: Tensor, k_cache: Tensor, v_cache: Tensor, md: AttentionMetadata,
                        scale: float, out: Optional[Tensor] = None) -> Tensor:
    """paged_attention_torch's result, the decodes by decode_attention.c and the other requests by
    prefill_attention.c, which read K/V in place. Whatever a kernel does not take goes through
    the torch loop. `out`: where to write it (a new tensor if None)."""
    md, out = CpuAttentionMetadata.of(md), torch.empty_like(q) if out is None else out
    left: list[int] = []
    for kernel, group in (("decode_attention", md.decodes), ("prefill_attention", md.others)):
        if group.indices and not cpu_kernels.attention_kernel(kernel, q, out, k_cache, v_cache,
                                                              group, scale):
            left += group.indices
    if left:
        attend_each(q, out, k_cache, v_cache, md, scale, left)
    return out


def attention(op: Attention, q: Tensor, kv_cache, attn_metadata: AttentionMetadata) -> Tensor:
    """Attention.forward on the C kernels."""
    return paged_attention_cpu(q, *kv_cache, attn_metadata, op.scale)
