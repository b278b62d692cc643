"""Exercise 6.3 (reference solution): the KV cache budget in numbers."""


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    # K and V, in every layer, for every KV head
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def num_kv_blocks(kv_budget_bytes: float, bytes_per_token: int, block_size: int) -> int:
    # only whole blocks: the remainder of the budget is left unused
    return int(kv_budget_bytes // (bytes_per_token * block_size))


def max_model_len_for(num_blocks: int, block_size: int, num_seqs: int) -> int:
    # each sequence may grow to max_model_len, in whole blocks
    return num_blocks // num_seqs * block_size
