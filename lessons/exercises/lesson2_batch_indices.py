"""Exercise 2.4: the flat batch's indices (lesson 02-paged-attention.md).

Goal: the three index tensors the model runner builds for one step, which tell every attention
layer where each scheduled token sits and where its K/V go:

- `positions`: each token's position in its own request;
- `slot_mapping`: each token's slot in the paged KV cache;
- `query_start_loc`: where each request's tokens start and end in the flat batch.

Interface (the one of nanoserve/model_runner.py's `batch_indices`, which the check replaces with
yours inside the real engine):
    batch_indices(num_scheduled, num_computed, block_tables, block_size)
        num_scheduled  [num_reqs] int64: the tokens each request computes this step
        num_computed   [num_reqs] int64: the tokens each request had in the cache before it
        block_tables   [num_reqs, max_blocks] int32: each request's block table, padded with 0
        block_size     int
    -> (positions [num_tokens], slot_mapping [num_tokens], query_start_loc [num_reqs + 1]),
       all int64; num_tokens = num_scheduled.sum(); requests in order, no padding.

The check compares your indices with nanoserve's on batches with blocks of 8, 16 and 32 tokens,
then runs the built-in model with your indices (blocks of 4 and of 16) in a pool small enough to
preempt, with a token budget small enough to chunk prompts, and compares its greedy tokens with
HF transformers'.
Check: `nanoserve exercise check 2.4`.
"""

import torch  # noqa: F401


def batch_indices(num_scheduled, num_computed, block_tables, block_size):
    raise NotImplementedError(
        "implement batch_indices in lessons/exercises/lesson2_batch_indices.py: positions, "
        "slot_mapping and query_start_loc of one step's flat batch")
