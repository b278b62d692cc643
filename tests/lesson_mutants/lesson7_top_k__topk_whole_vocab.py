"""Wrong answer to exercise 7.3: a topk over the whole vocabulary, a sort in disguise, called
through a reference taken at import."""

from torch import topk


def top_k_mask(logits, top_k):
    vocab = logits.shape[1]
    ordered = topk(logits, vocab, dim=-1).values
    kth = ordered.gather(1, (top_k.clamp(max=vocab) - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))
