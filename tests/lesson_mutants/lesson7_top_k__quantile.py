"""Wrong answer to exercise 7.3: finds the k-th largest as a quantile, which sorts the row
inside torch.quantile."""

import torch


def top_k_mask(logits, top_k):
    vocab = logits.shape[1]
    q = 1 - (top_k.clamp(max=vocab).to(logits.dtype) - 1) / (vocab - 1)
    kth = torch.stack([torch.quantile(row, p, interpolation="lower")
                       for row, p in zip(logits, q)])[:, None]
    return logits.masked_fill(logits < kth, float("-inf"))
