"""Wrong: the softmax is taken over the top_k logits only. Renormalized, that is the same
weights; without renormalize (Qwen3-MoE's norm_topk_prob false) the weights sum to 1 when they
should not."""

import torch


def select_experts(router_logits, top_k, renormalize):
    logits, ids = torch.topk(router_logits.float(), top_k, dim=-1)
    return torch.softmax(logits, dim=-1), ids
