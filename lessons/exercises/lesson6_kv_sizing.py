"""Exercise 6.3: the KV budget in numbers (lesson 06-length-and-memory.md).

Three functions, the arithmetic behind `nanoserve memory` and the engine's start-up:

- kv_bytes_per_token: the K and V of one token, over every layer and KV head;
- num_kv_blocks: how many whole blocks of block_size tokens fit in a byte budget;
- max_model_len_for: the largest max_model_len (a whole number of blocks) at which
  num_seqs sequences of that length fit in num_blocks blocks at once.

The check compares them with `nanoserve memory` on Llama-3-8B and nanoserve-tiny.
Check: `nanoserve exercise check 6.3`.
"""


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    raise NotImplementedError(
        "implement kv_bytes_per_token in lessons/exercises/lesson6_kv_sizing.py: the bytes of "
        "one token's K and V in every layer and KV head")


def num_kv_blocks(kv_budget_bytes: float, bytes_per_token: int, block_size: int) -> int:
    raise NotImplementedError("implement num_kv_blocks: whole blocks of block_size tokens that "
                              "fit in kv_budget_bytes")


def max_model_len_for(num_blocks: int, block_size: int, num_seqs: int) -> int:
    raise NotImplementedError("implement max_model_len_for: the largest max_model_len, in whole "
                              "blocks, at which num_seqs sequences fit in num_blocks")
