"""Exercise 6.3: the KV budget from a model's config.json (lesson 06-length-and-memory.md).

Two functions behind `nanoserve memory` and the engine's start-up:

- kv_bytes_per_token(config, dtype_bytes, tensor_parallel_size): the bytes one token's K and V
  take on ONE GPU, from the model's config.json (a dict), for a KV cache of `dtype_bytes` per
  element, the model split over `tensor_parallel_size` GPUs. Read the fields as a loader must:
  not every config spells out every size, and not every split divides evenly;
- max_model_len_for(num_blocks, block_size, num_seqs): the largest max_model_len (a whole
  number of blocks) at which num_seqs sequences of that length fit in num_blocks at once.

The check compares them with `nanoserve memory` on Llama-3-8B (also at 2 and 16 GPUs, and in
fp8), on nanoserve-tiny, and on variants of Llama-3-8B's config (its own head_dim; no
num_key_value_heads); max_model_len_for with blocks of 8, 16 and 32 tokens, and one token more
than your answer must not fit.
Check: `nanoserve exercise check 6.3`.
"""


def kv_bytes_per_token(config: dict, dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
    raise NotImplementedError(
        "implement kv_bytes_per_token in lessons/exercises/lesson6_kv_sizing.py: the bytes of "
        "one token's K and V on one GPU, from the model's config.json")


def max_model_len_for(num_blocks: int, block_size: int, num_seqs: int) -> int:
    raise NotImplementedError("implement max_model_len_for: the largest max_model_len, in whole "
                              "blocks, at which num_seqs sequences fit in num_blocks")
