"""Exercise 7.3: top-k without sorting, without topk (lesson 07-sampling-and-config.md).

Goal: `top_k_mask(logits, top_k)` keeps, in each row, the k largest logits and every logit
tied with the k-th largest, and sets the rest to -inf; k is the row's own. Rows whose k is
off (k >= vocab) keep everything. nanoserve's sampler does this with torch.topk; here you may
not: no sort, no topk, no kthvalue, no quantile, nothing that orders a row. What you need of
a row is one number, its k-th largest logit; find it by comparing and counting, with an
amount of work per row that does not grow with k (hint: a float32 has 2^32 possible values).

Interface: `logits` is [num_rows, vocab] float32; `top_k` is [num_rows] int64; return a tensor
shaped like `logits`. The check compares it with nanoserve's sampler on rows full of ties, with
k from 1 to the vocabulary, and on rows holding -inf (what min_p, a grammar mask or min_tokens
leave), and rejects every op that orders a row, numpy and Python's sorting included.
Check: `nanoserve exercise check 7.3`.
"""

import torch  # noqa: F401


def top_k_mask(logits, top_k):
    raise NotImplementedError(
        "implement top_k_mask in lessons/exercises/lesson7_top_k.py: mask each row below its "
        "k-th largest logit, by comparing and counting")
