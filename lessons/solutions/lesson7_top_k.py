"""Exercise 7.3 (reference solution): top-k by bisection, without sorting or selecting.

A row only needs its k-th largest logit, the threshold t with count(row >= t) >= k and
count(row > t) < k. Count is monotone in t, so bisection finds it: but over what? Over the
float32 values' bit patterns, read as integers after a flip that makes their order the floats'
order (negative floats have their bits counted backwards). Then there are 2^32 candidates, and
32 halvings find the exact threshold, each one comparison pass over the row: 32 x vocab work per
row, whatever k is, and every row bisects at once. Ties with the k-th stay: only logits below
the threshold go. Rows whose top_k is off (>= vocab) keep everything.
"""

import torch


def ordered_bits(x):
    """float32 -> int64 with the same order: x < y exactly when ordered_bits(x) < ordered_bits(y)."""
    bits = x.contiguous().view(torch.int32).long()
    return torch.where(bits < 0, -(bits & 0x7FFFFFFF) - 1, bits)


def top_k_mask(logits, top_k):
    keys = ordered_bits(logits.float())
    low = torch.full((logits.shape[0], 1), -2**31, dtype=torch.int64)   # count(keys >= low) = vocab
    high = torch.full_like(low, 2**31 - 1)
    k = top_k[:, None]
    for _ in range(32):                    # invariant: count(keys >= low) >= k
        mid = (low + high + 1) // 2
        enough = (keys >= mid).sum(dim=-1, keepdim=True) >= k
        low, high = torch.where(enough, mid, low), torch.where(enough, high, mid - 1)
    off = top_k[:, None] >= logits.shape[1]
    return logits.masked_fill((keys < low) & ~off, float("-inf"))
