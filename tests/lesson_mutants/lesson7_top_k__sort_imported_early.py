"""Wrong answer to exercise 7.3: sorts every row, through a reference to torch.sort taken when
the module is imported."""

from torch import sort


def top_k_mask(logits, top_k):
    vocab = logits.shape[1]
    ordered = sort(logits, dim=-1, descending=True).values
    kth = ordered.gather(1, (top_k.clamp(max=vocab) - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))
