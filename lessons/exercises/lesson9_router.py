"""Exercise 9.3: the router of a mixture of experts (lesson 09-mixture-of-experts.md).

Goal: `select_experts(router_logits, top_k, renormalize)` picks each token's experts and their
weights, as vLLM's FusedMoE does for Mixtral and Qwen3-MoE:

1. a softmax over ALL the experts' logits of the token, computed in float32;
2. the top_k largest probabilities: those are the experts, and their probabilities the weights;
3. if `renormalize` (Mixtral always; Qwen3-MoE when its config says norm_topk_prob), divide the
   k weights by their sum, so that they add up to 1.

Example, top_k 2, renormalize: logits [0, 2, 1, 2] -> softmax [0.05, 0.40, 0.15, 0.40] ->
experts 1 and 3, weights 0.5 and 0.5 (without renormalize: 0.40 and 0.40).

Interface: `router_logits` is a tensor [tokens, num_experts] (bfloat16 or float32 in the
engine); return (weights, ids): weights a float32 tensor [tokens, top_k], ids an integer tensor
[tokens, top_k] of expert indices. The order of the k columns does not matter (the experts'
outputs are summed), and neither does which of two tied experts you pick.

The check compares your router with nanoserve's (nanoserve/layers.py:select_experts) on small
cases and on 60 and 128 experts up to top-8, then puts it into the real engine (every
FusedMoE's `custom_routing_function`) on a tiny random Qwen3-MoE and a tiny Mixtral, and asks
for HF transformers' greedy tokens.
Check: `nanoserve exercise check 9.3`.
"""


def select_experts(router_logits, top_k, renormalize):
    raise NotImplementedError(
        "implement select_experts in lessons/exercises/lesson9_router.py: a float32 softmax over "
        "every expert, the top_k probabilities and their experts, renormalized if asked")
