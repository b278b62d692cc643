"""norm_rope_triton.py: Triton forms of two ops of layers.py that torch runs as many small kernels.

  rms_norm_triton       RMSNorm.forward: with a residual, residual += x in place, then the norm
                        (vLLM's fused_add_rms_norm): one launch instead of torch's ~8.
  rope_store_kv_triton  RopeStoreKV.forward: q and k rotated, the rotated k and v written into the
                        paged cache at slot_mapping, the rotated q returned: one launch instead of
                        torch's ~12 (two apply_rope) plus the store.

Why: a decode step of a small model is launch-bound (graphs.py: ~40 kernels a layer); these two
ops were a third of them. Each program is one token (and, for the norm, one head: Qwen3 normalises
each head of q and k), so any number of tokens runs on one compiled kernel.

Same numbers as forward_native, rounding where it rounds: the residual sum, the normalised x and
each RoPE product and sum are rounded to the model dtype, as torch's separate ops round them; only
the float32 sum of squares may add in another order. Example, hidden 4, eps 0: x = [1, 1, 1, 1]
with residual [1, 1, 1, 1] -> residual [2, 2, 2, 2], rms 2, out = weight * [1, 1, 1, 1].

    TRITON_INTERPRET=1 pytest -q tests/test_triton_ops.py     # on CPU, == forward_native
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# ---------------------------------------------------------------------------------------- RMSNorm


@triton.jit
def _rms_norm_kernel(
    out_ptr, x_ptr, residual_ptr, weight_ptr, eps,
    stride_ot, stride_oh, stride_xt, stride_xh, stride_rt, stride_rh,  # [tokens, heads, hidden]
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    token, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + token * stride_xt + head * stride_xh + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # residual.add_(x): the sum rounded to the model dtype, stored in place
        r_ptrs = residual_ptr + token * stride_rt + head * stride_rh + cols
        x = (x.to(tl.float32) + tl.load(r_ptrs, mask=mask).to(tl.float32)).to(x.dtype)
        tl.store(r_ptrs, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.math.div_rn(tl.sum(x32 * x32, axis=0), HIDDEN) + eps)  # IEEE, as mean()
    normed = (x32 * rstd).to(x.dtype).to(tl.float32)  # HF: normalised in float32, back to the dtype
    w = tl.load(weight_ptr + cols, mask=mask).to(tl.float32)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + cols,
             (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(weight: torch.Tensor, eps: float, x: torch.Tensor,
                    residual: torch.Tensor | None = None):
    """RMSNorm.forward_native's contract: x [tokens, hidden] (or [tokens, heads, head_dim], a
    view of the fused qkv rows is fine) -> normalised x; given a residual (x's shape), residual
    += x first, in place, and returns (normalised, residual)."""
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        raise ValueError(f"x: expected [tokens, (heads,) hidden] with unit last stride, got "
                         f"shape {tuple(x.shape)} strides {x.stride()}")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"residual: expected x's shape {tuple(x.shape)} with unit last stride, "
                         f"got {tuple(residual.shape)} strides {residual.stride()}")
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    x3, out3 = (x, out) if x.dim() == 3 else (x[:, None], out[:, None])
    r3 = x3 if residual is None else (residual if x.dim() == 3 else residual[:, None])
    if x.numel():
        block = triton.next_power_of_2(x.shape[-1])
        _rms_norm_kernel[x3.shape[:2]](
            out3, x3, r3, weight, eps, *out3.stride()[:2], *x3.stride()[:2], *r3.stride()[:2],
            HIDDEN=x.shape[-1], BLOCK=block, HAS_RESIDUAL=residual is not None,
            num_warps=max(1, min(8, block // 512)))
    return out if residual is None else (out, residual)


# ------------------------------------------------------------------------------ RoPE + K/V store


@triton.jit
def _rotate(x_ptr, offs, mask, cos, sin, HALF: tl.constexpr):
    """apply_rope on one token's heads: (x1 cos - x2 sin, x2 cos + x1 sin) with dim i paired with
    i + HALF; each product and each sum rounded to the model dtype, as torch rounds them."""
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0)
    x2 = tl.load(x_ptr + offs + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    a, b = (x1 * cos).to(dt).to(tl.float32), (x2 * sin).to(dt).to(tl.float32)
    c, d = (x2 * cos).to(dt).to(tl.float32), (x1 * sin).to(dt).to(tl.float32)
    return (a - b).to(dt), (c + d).to(dt)


@triton.jit
def _rope_store_kv_kernel(
    q_out_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_qot, stride_qoh, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cos, stride_sin,  # token strides of cos, sin [tokens, 1, HALF]
    stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch,  # caches' strides
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_ptr + token * stride_cos + i, mask=i < HALF).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_sin + i, mask=i < HALF).to(tl.float32)
    hq = tl.arange(0, BLOCK_HQ)[:, None]
    mask = (hq < NUM_Q_HEADS) & (i < HALF)
    q1, q2 = _rotate(q_ptr + token * stride_qt, hq * stride_qh + i, mask, cos, sin, HALF)
    q_out = q_out_ptr + token * stride_qot + hq * stride_qoh + i
    tl.store(q_out, q1, mask=mask)
    tl.store(q_out + HALF, q2, mask=mask)
    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:  # PAD_SLOT_ID (-1): a padded row of a captured step stores nothing
        h = tl.arange(0, BLOCK_HKV)[:, None]
        kv_mask = (h < NUM_KV_HEADS) & (i < HALF)
        k1, k2 = _rotate(k_ptr + token * stride_kt, h * stride_kh + i, kv_mask, cos, sin, HALF)
        k_dst = k_cache_ptr + (slot // BLOCK_SIZE) * stride_kcb + (slot % BLOCK_SIZE) * stride_kco
        tl.store(k_dst + h * stride_kch + i, k1, mask=kv_mask)
        tl.store(k_dst + h * stride_kch + i + HALF, k2, mask=kv_mask)
        v_src = v_ptr + token * stride_vt + h * stride_vh + i
        v_dst = (v_cache_ptr + (slot // BLOCK_SIZE) * stride_vcb + (slot % BLOCK_SIZE) * stride_vco
                 + h * stride_vch + i)
        tl.store(v_dst, tl.load(v_src, mask=kv_mask), mask=kv_mask)
        tl.store(v_dst + HALF, tl.load(v_src + HALF, mask=kv_mask), mask=kv_mask)


def rope_store_kv_triton(cos: torch.Tensor, sin: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> torch.Tensor:
    """RopeStoreKV.forward_native's contract: q [tokens, q_heads, head_dim], k and v [tokens,
    kv_heads, head_dim] (views of one qkv tensor are fine: any token and head strides), cos and
    sin [tokens, 1, head_dim // 2]; the rotated k and v go to the caches [blocks, block_size,
    kv_heads, head_dim] at slot_mapping (< 0: nowhere). Returns the rotated q, contiguous."""
    for name, t in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin),
                    ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the last dimension must be contiguous")
    if k.shape != v.shape or k_cache.shape[2:] != k.shape[1:] or v_cache.shape != k_cache.shape:
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} and the caches "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not match")
    num_tokens, num_q_heads, head_dim = q.shape
    if cos.shape != (num_tokens, 1, head_dim // 2) or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"cos {tuple(cos.shape)}, slot_mapping {tuple(slot_mapping.shape)}: "
                         f"expected [{num_tokens}, 1, {head_dim // 2}] and [{num_tokens}]")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    _rope_store_kv_kernel[(num_tokens,)](
        q_out, q, k, v, cos, sin, k_cache, v_cache, slot_mapping,
        *q_out.stride()[:2], *q.stride()[:2], *k.stride()[:2], *v.stride()[:2],
        cos.stride(0), sin.stride(0), *k_cache.stride()[:3], *v_cache.stride()[:3],
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=k.shape[1], HALF=head_dim // 2,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HKV=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        num_warps=1 if num_q_heads * head_dim <= 1024 else 4)
    return q_out
