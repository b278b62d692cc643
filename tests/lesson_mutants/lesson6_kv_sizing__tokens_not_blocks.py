"""Wrong answer to exercise 6.3: shares the pool's tokens among the sequences, forgetting that
each sequence holds whole blocks."""


def kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes):
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def num_kv_blocks(kv_budget_bytes, bytes_per_token, block_size):
    return int(kv_budget_bytes // (bytes_per_token * block_size))


def max_model_len_for(num_blocks, block_size, num_seqs):
    return num_blocks * block_size // num_seqs
