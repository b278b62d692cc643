"""Exercise 7.3: top-k without sorting the whole vocabulary (lesson 07-sampling-and-config.md).

Goal: `top_k_mask(logits, top_k)` keeps, in each row, the k largest logits and every logit
tied with the k-th largest, and sets the rest to -inf; k is the row's own. Rows whose k is
off (k >= vocab) keep everything. Do it without sorting a row: sorting costs
O(vocab log vocab) per row where the answer needs much less.

Interface: `logits` is [num_rows, vocab] float; `top_k` is [num_rows] int64; return a tensor
shaped like `logits`. The check compares it with nanoserve's sampler on rows full of ties and
rejects any sort (torch.sort, argsort, Python's sorted, or one hidden in another op) and a
topk over the whole vocabulary.
Check: `nanoserve exercise check 7.3`.
"""

import torch  # noqa: F401


def top_k_mask(logits, top_k):
    raise NotImplementedError(
        "implement top_k_mask in lessons/exercises/lesson7_top_k.py: mask each row below its "
        "k-th largest logit, without sorting the row")
