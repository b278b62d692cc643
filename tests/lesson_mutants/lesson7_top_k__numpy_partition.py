"""Wrong answer to exercise 7.3: hands each row to numpy's partition (an introselect: it orders
the row around the k-th), which no torch op shows."""

import numpy as np


def top_k_mask(logits, top_k):
    rows, out = logits.numpy(), logits.clone()
    for i, k in enumerate(top_k.tolist()):
        if k < rows.shape[1]:
            kth = float(np.partition(rows[i], -k)[-k])
            out[i] = out[i].masked_fill(logits[i] < kth, float("-inf"))
    return out
