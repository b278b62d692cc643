"""Exercise 9.3 (reference solution): the router.

Probabilities first, over every expert and in float32 (a bfloat16 softmax rounds the weights to
3 significant digits); then sort each token's probabilities, largest first, and keep the first
top_k columns; their sum is below 1 unless renormalized. (nanoserve's select_experts does the
same with one topk.)
"""

import torch


def select_experts(router_logits, top_k, renormalize):
    probs = torch.softmax(router_logits.float(), dim=-1)
    order = torch.argsort(probs, dim=-1, descending=True, stable=True)
    ids = order[:, :top_k]
    weights = torch.gather(probs, 1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
