"""Exercise 6.3 (reference solution): the KV cache budget from a model's config.json.

One token's K and V: two tensors, in every layer, for every KV head this GPU holds, each
head_dim wide. Two details the lesson's formula hides: `head_dim` is its own field in some
configs (Qwen3: heads x head_dim need not be hidden_size), else hidden_size / heads; and with
tensor parallelism each GPU holds its share of the KV heads, but never less than one (more GPUs
than KV heads: each keeps a replica). A config without `num_key_value_heads` is plain
multi-head attention: one KV head per query head.
"""


def kv_bytes_per_token(config: dict, dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    kv_heads_here = max(1, kv_heads // tensor_parallel_size)
    return 2 * config["num_hidden_layers"] * kv_heads_here * head_dim * dtype_bytes


def max_model_len_for(num_blocks: int, block_size: int, num_seqs: int) -> int:
    # each sequence may grow to max_model_len, in whole blocks
    return num_blocks // num_seqs * block_size
