"""Wrong answer to exercise 7.3: finds each row's k-th largest with Python's heapq.nlargest, which
keeps a heap of the k largest: it orders them, and its work grows with k."""

import heapq


def top_k_mask(logits, top_k):
    out = logits.clone()
    for i, k in enumerate(top_k.tolist()):
        if k < logits.shape[1]:
            kth = heapq.nlargest(k, logits[i].tolist())[-1]
            out[i] = out[i].masked_fill(logits[i] < kth, float("-inf"))
    return out
