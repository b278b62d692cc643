"""Wrong answer to exercise 6.3: rounds the number of blocks to the nearest instead of down,
promising a block the budget cannot hold."""


def kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes):
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def num_kv_blocks(kv_budget_bytes, bytes_per_token, block_size):
    return round(kv_budget_bytes / (bytes_per_token * block_size))


def max_model_len_for(num_blocks, block_size, num_seqs):
    return num_blocks // num_seqs * block_size
