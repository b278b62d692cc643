"""Exercise 7.3: top-k without sorting the whole vocabulary (lesson 07-sampling-and-config.md).

`logits` is [num_rows, vocab]; `top_k` is [num_rows] int64, one k per row (a request's own
top_k; k >= vocab means off). Return logits where, in each row, every logit smaller than
that row's k-th largest is -inf (logits tied with the k-th largest stay). Rows that are off
keep everything.

Do it without sorting a row: the check forbids torch.sort / argsort, and a torch.topk over
the whole vocabulary. One row needs only its k-th largest value.
Check: `nanoserve exercise check 7.3`.
"""

import torch  # noqa: F401


def top_k_mask(logits, top_k):
    raise NotImplementedError(
        "implement top_k_mask in lessons/exercises/lesson7_top_k.py: find each row's k-th "
        "largest logit without a full sort (torch.topk with the largest k needed), then set "
        "everything below it to -inf")
