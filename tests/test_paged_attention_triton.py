"""Oracle tests for the Triton kernels in nanoserve/cuda/paged_attention_triton.py.

Runs on CPU through the Triton interpreter (no GPU needed):
    pytest -q tests/test_paged_attention_triton.py
On a GPU machine, TRITON_INTERPRET=0 runs the same tests against the compiled kernels on CUDA.

The oracle is dense causal SDPA per request over the request's full K/V sequence, built straight from the
random per-request tensors, never read back from the paged cache. Cache slots no request owns are filled
with NaN, so a kernel that reads a wrong slot (or one past the end of a sequence) fails loudly.
At real head shapes (head_dim 64-128, GQA groups 1-8) the oracle is the torch reference
(nanoserve.paged_attention) run on the same step; a step past 2^31 cache elements checks the int64 offsets.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must happen before triton is imported

import functools
import math
import subprocess
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from nanoserve.paged_attention import paged_attention_torch, store_kv_torch  # noqa: E402
from triton_kit import triton_modules  # noqa: E402

INTERPRET = os.environ["TRITON_INTERPRET"] == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA device", allow_module_level=True)
pat, dat, _, _, _, cuda_backend = triton_modules()

TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@dataclass
class Metadata:  # the fields of AttentionMetadata that the kernels and the torch reference read
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int

    @property
    def num_reqs(self) -> int:  # read by the torch reference
        return self.seq_lens.shape[0]


def make_batch(query_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """Random per-request Q/K/V, scattered into a paged cache over shuffled (non-contiguous) blocks."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 2  # spare blocks that belong to nobody
    physical = torch.randperm(num_blocks, generator=g).tolist()
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    # One padding column beyond the longest table, as the worker pads rows with 0.
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_req) + 1, dtype=torch.int32)
    queries, ks, vs, slot_mapping = [], [], [], []
    for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        table = [physical.pop() for _ in range(blocks_per_req[i])]
        block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        k = torch.randn(s_len, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(s_len, num_kv_heads, head_dim, generator=g).to(dtype)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(s_len)])
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = k
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = v
        queries.append(torch.randn(q_len, num_q_heads, head_dim, generator=g).to(dtype))
        ks.append(k)
        vs.append(v)
        slot_mapping.append(slots[s_len - q_len:])
    qsl = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    md = Metadata(torch.cat(slot_mapping).to(DEVICE), block_tables.to(DEVICE),
                  torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), qsl.to(DEVICE),
                  max(query_lens))
    return torch.cat(queries).to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), md, queries, ks, vs


def dense_attention(queries, ks, vs, scale):
    """Per request: causal SDPA in float32, query j at position seq_len - query_len + j."""
    outs = []
    for q, k, v in zip(queries, ks, vs):
        q_len, s_len, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # q head h -> kv head h // group
        mask = torch.arange(s_len)[None, :] <= torch.arange(s_len - q_len, s_len)[:, None]
        o = F.scaled_dot_product_attention(q.float().transpose(0, 1), k.float().transpose(0, 1),
                                           v.float().transpose(0, 1), attn_mask=mask, scale=scale)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


CASES = {  # name: (query_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size)
    "prefill": ([5, 9], [5, 9], 2, 2, 32, 16),
    "prefill_cached_prefix": ([4, 7], [20, 39], 2, 2, 32, 16),
    "decode": ([1, 1, 1], [1, 17, 40], 2, 2, 64, 16),
    "mixed": ([3, 1, 12, 1], [19, 33, 12, 5], 4, 2, 32, 16),
    "gqa_4_to_1_multi_q_tile": ([37, 1], [50, 9], 4, 1, 32, 16),  # BLOCK_Q = 16: three q tiles
    "gqa_group_3": ([6, 1], [6, 30], 6, 2, 32, 8),  # group not a power of two: padded rows
    "head_dim_128_block_32": ([3, 1], [40, 70], 2, 1, 128, 32),
    "head_dim_48_block_4": ([5, 1], [13, 6], 2, 2, 48, 4),  # head_dim not a power of two: masked lanes
}


@pytest.mark.parametrize("case", CASES)
def test_attention_matches_dense(case):
    query_lens, seq_lens, hq, hkv, d, bs = CASES[case]
    query, k_cache, v_cache, md, queries, ks, vs = make_batch(query_lens, seq_lens, hq, hkv, d, bs, torch.float32)
    out = pat.paged_attention_triton(query, k_cache, v_cache, md, d**-0.5)
    torch.testing.assert_close(out.cpu(), dense_attention(queries, ks, vs, d**-0.5), atol=1e-4, rtol=1e-4)


# The interpreter keeps bfloat16 as raw uint16 bits and its tl.dot multiplies those bits (triton-lang/triton
# #11584: bf16 math is unsupported there), so bf16 attention is checked on GPUs only (TRITON_INTERPRET=0).
BF16_ON_GPU_ONLY = pytest.mark.skipif(INTERPRET, reason="Triton interpreter has no bfloat16 tl.dot")


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=BF16_ON_GPU_ONLY)])
def test_attention_half_precision(dtype):
    query, k_cache, v_cache, md, queries, ks, vs = make_batch([6, 1], [22, 17], 4, 2, 64, 16, dtype, seed=1)
    out = pat.paged_attention_triton(query, k_cache, v_cache, md, 0.125)
    assert out.dtype == dtype
    torch.testing.assert_close(out.cpu().float(), dense_attention(queries, ks, vs, 0.125),
                               atol=TOL[dtype], rtol=TOL[dtype])


def test_attention_non_contiguous_query():
    # In the model, q is a slice of the fused qkv projection: its token stride is not num_heads * head_dim.
    query, k_cache, v_cache, md, queries, ks, vs = make_batch([4, 1], [10, 21], 2, 1, 32, 16, torch.float32)
    fused = torch.cat([query, torch.full_like(query, float("nan"))], dim=1)
    out = pat.paged_attention_triton(fused[:, :2], k_cache, v_cache, md, 0.2)
    torch.testing.assert_close(out.cpu(), dense_attention(queries, ks, vs, 0.2), atol=1e-4, rtol=1e-4)


def test_decode_after_prefill_through_store_kv():
    """The engine's order: store_kv this step's K/V, then attend (prefill step, then one decode step)."""
    hkv, d, bs, prompt = 2, 32, 4, 7
    g = torch.Generator().manual_seed(3)
    k_cache = torch.full((6, bs, hkv, d), float("nan"), device=DEVICE)
    v_cache = k_cache.clone()
    table = torch.tensor([[4, 0, 2]], dtype=torch.int32, device=DEVICE)  # positions 0..8 -> blocks 4, 0, 2
    k, v, q = (torch.randn(prompt + 1, hkv * (1 + (i == 2)), d, generator=g) for i in range(3))
    for start, end in ((0, prompt), (prompt, prompt + 1)):
        slots = torch.tensor([table[0, p // bs].item() * bs + p % bs for p in range(start, end)], device=DEVICE)
        pat.store_kv_triton(k[start:end].to(DEVICE), v[start:end].to(DEVICE), k_cache, v_cache, slots)
        qsl = torch.tensor([0, end - start], dtype=torch.int32, device=DEVICE)
        md = Metadata(slots, table, torch.tensor([end], dtype=torch.int32, device=DEVICE), qsl, end - start)
        out = pat.paged_attention_triton(q[start:end].to(DEVICE), k_cache, v_cache, md, 0.3)
        expected = dense_attention([q[start:end]], [k[:end]], [v[:end]], 0.3)
        torch.testing.assert_close(out.cpu(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_places_tokens_at_their_slots(dtype):
    num_blocks, bs, hkv, d = 5, 4, 3, 16  # 3 kv heads: a non-power-of-two head count, masked lanes
    g = torch.Generator().manual_seed(2)
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype).to(DEVICE)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype).to(DEVICE)
    # Non-contiguous key/value: slices of a fused projection, like the model hands them over.
    fused = torch.randn(6, 3 * hkv, d, generator=g).to(dtype).to(DEVICE)
    key, value = fused[:, hkv: 2 * hkv], fused[:, 2 * hkv:]
    slot_mapping = torch.tensor([13, 0, -1, 19, 6, -1], device=DEVICE)  # -1: padding, stored nowhere
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    keep = slot_mapping >= 0
    expected_k.view(-1, hkv, d)[slot_mapping[keep]] = key[keep]
    expected_v.view(-1, hkv, d)[slot_mapping[keep]] = value[keep]
    pat.store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    # Sanity of the expectation itself: slot 13 is block 3, offset 1.
    assert torch.equal(k_cache[3, 1], key[0])


def test_bad_input_names_the_field():
    query, k_cache, v_cache, md, *_ = make_batch([2], [5], 3, 2, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="num_q_heads"):
        pat.paged_attention_triton(query, k_cache, v_cache, md, 1.0)
    query, k_cache, v_cache, md, *_ = make_batch([2], [5], 2, 2, 16, 4, torch.float32)
    md.seq_lens = md.seq_lens.long()
    with pytest.raises(ValueError, match="seq_lens"):
        pat.paged_attention_triton(query, k_cache, v_cache, md, 1.0)
    with pytest.raises(ValueError, match="slot_mapping"):
        pat.store_kv_triton(query, query, k_cache, v_cache, md.slot_mapping.int())
    with pytest.raises(ValueError, match="v_cache"):
        pat.store_kv_triton(query, query, k_cache, v_cache.half(), md.slot_mapping)


# Real models' head shapes: head_dim 64 (SmolLM2, Llama-3.2-1B), 80 (Phi-2), 96 (Phi-3-mini), 128
# (Llama-3-8B, Mistral, Qwen2.5); GQA groups 1 (multi-head), 4 (Llama-3-8B), 8 (Llama-3-70B). Two kv
# heads and a few dozen tokens keep each case well under a second in the interpreter.
STEPS = {  # name: (query_lens, seq_lens), block_size 16
    "decode": ([1, 1, 1], [1, 17, 45]),
    "chunked_prefill": ([7, 1, 13], [38, 9, 13]),  # a chunk after a cached prefix, a decode, a first chunk
}


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_real_shapes_match_torch_reference(head_dim, group, step):
    """One engine step: store the step's K/V, then attend. Both caches and the output equal what
    the torch reference (nanoserve.paged_attention) makes of the same step."""
    query_lens, seq_lens = STEPS[step]
    query, k_cache, v_cache, md, _, ks, vs = make_batch(query_lens, seq_lens, 2 * group, 2, head_dim, 16,
                                                        torch.float32, seed=head_dim + group)
    new_k, new_v = (torch.cat([t[s - q:] for t, q, s in zip(ts, query_lens, seq_lens)]).to(DEVICE)
                    for ts in (ks, vs))
    for cache in (k_cache, v_cache):  # the step's own slots start empty: only the store fills them
        cache.view(-1, 2, head_dim)[md.slot_mapping] = float("nan")
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    pat.store_kv_triton(new_k, new_v, k_cache, v_cache, md.slot_mapping)
    store_kv_torch(new_k, new_v, ref_k, ref_v, md.slot_mapping)
    torch.testing.assert_close(k_cache, ref_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, ref_v, atol=0, rtol=0, equal_nan=True)
    out = pat.paged_attention_triton(query, k_cache, v_cache, md, head_dim**-0.5)
    expected = paged_attention_torch(query, ref_k, ref_v, md, head_dim**-0.5)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def attend_past_int32() -> None:
    """A step whose blocks sit past 2^31 elements of a float16 cache (4 GiB, of which only the
    touched pages are ever real on CPU): store, attend, compare. Offsets computed in int32 wrap
    there to an address 4 GiB below the cache: a crash or garbage."""
    bs, hkv, hq, d = 16, 2, 8, 128
    num_blocks = 2**31 // (bs * hkv * d) + 8
    cache = torch.empty(num_blocks, bs, hkv, d, dtype=torch.float16, device=DEVICE)
    # One tensor serves as both caches (8 GiB would be two): V's store overwrites K's, so K == V.
    tables = [[num_blocks - 1, 3, num_blocks - 6, num_blocks - 3], [num_blocks - 2, 0, 0, 0]]
    query_lens, seq_lens = [7, 1], [50, 17]
    g = torch.Generator().manual_seed(5)
    values = [torch.randn(s, hkv, d, generator=g).half() for s in seq_lens]
    queries = [torch.randn(q, hq, d, generator=g).half() for q in query_lens]
    slots = [torch.tensor([t[p // bs] * bs + p % bs for p in range(s)]) for t, s in zip(tables, seq_lens)]
    everything = torch.cat(values).to(DEVICE)
    pat.store_kv_triton(everything, everything, cache, cache, torch.cat(slots).to(DEVICE))
    md = Metadata(torch.cat([sl[s - q:] for sl, q, s in zip(slots, query_lens, seq_lens)]).to(DEVICE),
                  torch.tensor(tables, dtype=torch.int32, device=DEVICE),
                  torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                  torch.tensor([0, 7, 8], dtype=torch.int32, device=DEVICE), 7)
    out = pat.paged_attention_triton(torch.cat(queries).to(DEVICE), cache, cache, md, d**-0.5)
    expected = dense_attention(queries, values, values, d**-0.5)
    torch.testing.assert_close(out.cpu().float(), expected, atol=TOL[torch.float16], rtol=TOL[torch.float16])


def test_offsets_past_int32():
    # In a child process: a wild read kills it (SIGSEGV on CPU, a CUDA fault on a GPU), not pytest.
    child = subprocess.run([sys.executable, "-c", f"import {__name__} as t; t.attend_past_int32()"],
                           cwd=os.path.dirname(__file__), capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, f"the step past 2^31 cache elements failed ({child.returncode}):\n{child.stderr}"


def test_compile_kernels_runs_every_variant():
    for head_dim, group in ((64, 1), (80, 8)):
        cuda_backend.compile_kernels(2 * group, 2, head_dim, 16, torch.float32, torch.device(DEVICE))
    with pytest.raises(ValueError, match="num_kv_heads"):
        cuda_backend.compile_kernels(6, 4, 64, 16, torch.float32, torch.device(DEVICE))
    with pytest.raises(ValueError, match="block_size"):
        cuda_backend.compile_kernels(4, 2, 64, 0, torch.float32, torch.device(DEVICE))


@pytest.mark.skipif(INTERPRET, reason="compiles happen on GPUs only")
def test_compile_kernels_leaves_no_compile_to_serving():
    cuda_backend.compile_kernels(8, 2, 128, 16, torch.bfloat16, torch.device(DEVICE))
    kernels = (pat._unified_attention_kernel, dat._split_kv_decode_kernel, dat._reduce_segments_kernel)
    compiled = sum(len(k.device_caches[torch.cuda.current_device()][0]) for k in kernels)
    # make_batch's tables are one block wider than the longest sequence: 2, 16, 4 and 22 wide here;
    # decodes of 1 and 2 requests run split-K, of 64 (x 2 kv heads) the unified kernel.
    for query_lens, seq_lens in (([1], [5]), ([1, 1], [20, 240]), ([3, 1], [40, 17]), ([9], [9 + 16 * 20]),
                                 ([1] * 64, [20] * 63 + [240])):
        query, k_cache, v_cache, md, *_ = make_batch(query_lens, seq_lens, 8, 2, 128, 16, torch.bfloat16)
        cuda_backend.attention(SimpleNamespace(scale=0.1), query, (k_cache, v_cache), md)
    assert compiled == sum(len(k.device_caches[torch.cuda.current_device()][0]) for k in kernels)


# ----------------------------------------------------------------------------------------------------
# split-K decode (decode_attention_triton.py): steps with few (request, kv head) programs

SPLIT_KV = {  # name: (seq_lens, num_q_heads, num_kv_heads, head_dim, block_size); one token a request
    "shorter_than_a_segment": ([1, 5, 31], 2, 2, 32, 16),  # 15 of 16 segments empty
    "segments_of_two_tiles": ([600, 33], 8, 2, 64, 16),  # 600 > 16 x 32: 64 keys a segment
    "gqa_group_3_block_8": ([70, 2], 6, 2, 48, 8),  # q-head rows padded to 16, head_dim lanes masked
}


@pytest.mark.parametrize("case", SPLIT_KV)
def test_split_kv_decode_matches_torch_reference(case):
    seq_lens, hq, hkv, d, bs = SPLIT_KV[case]
    query, k_cache, v_cache, md, *_ = make_batch([1] * len(seq_lens), seq_lens, hq, hkv, d, bs,
                                                 torch.float32, seed=len(case))
    out = dat.split_kv_decode_attention(query, k_cache, v_cache, md, d**-0.5)
    expected = paged_attention_torch(query, k_cache, v_cache, md, d**-0.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_split_kv_decode_skips_padded_rows():
    """A decode of 2 requests padded to 4 as a captured graph runs it (step_inputs.py): rows 2, 3
    have seq_len 0 and no query token (NaN queries: never read); the real rows are as unpadded."""
    query, k_cache, v_cache, md, *_ = make_batch([1, 1], [40, 3], 4, 2, 32, 16, torch.float32)
    expected = dat.split_kv_decode_attention(query, k_cache, v_cache, md, 0.2)
    ints = functools.partial(torch.tensor, dtype=torch.int32, device=DEVICE)
    padded = Metadata(torch.cat([md.slot_mapping, torch.full((2,), -1, device=DEVICE)]),
                      torch.cat([md.block_tables, torch.zeros_like(md.block_tables)]),
                      ints(md.seq_lens.tolist() + [0, 0]), ints([0, 1, 2, 2, 2]), 1)
    rows = torch.cat([query, torch.full_like(query, float("nan"))])
    out = dat.split_kv_decode_attention(rows, k_cache, v_cache, padded, 0.2)
    torch.testing.assert_close(out[:2], expected, atol=0, rtol=0)


def test_uses_split_kv_from_shapes_only():
    assert dat.uses_split_kv(1, 1, 3)  # batch 1 on SmolLM2-135M: 3 programs unsplit
    assert dat.uses_split_kv(1, 42, 3) and not dat.uses_split_kv(1, 43, 3)  # 126 and 129 programs
    assert not dat.uses_split_kv(2, 1, 3)  # a prefill or mixed step: the unified kernel
    with pytest.raises(ValueError, match="max_query_len"):
        query, k_cache, v_cache, md, *_ = make_batch([2], [5], 2, 2, 16, 4, torch.float32)
        dat.split_kv_decode_attention(query, k_cache, v_cache, md, 1.0)
