"""Wrong answers that differ from the reference solution (lessons/solutions/) by one edit.

EDITS[solution file stem][mutant name] = (what is wrong, [(old, new), ...]): the mutant is the
solution with every `old` replaced by `new`. tests/test_lessons.py applies them, and fails if
an `old` no longer occurs (an edit must never silently turn into the reference itself). The
wrong answers that are not one edit away are whole files beside this one.
"""

EDITS = {
    "lesson1_engine_loop": {
        "fixed_step_count": (
            "steps max_tokens times, as if every request ran in every step (true only while "
            "every request has a seat and its blocks)",
            [("while core.has_unfinished_requests():", "for _ in range(max_tokens):")]),
        "positional_outputs": (
            "files a step's outputs by their position, as if every step returned one output "
            "per prompt, in prompt order",
            [("for output in core.step():\n            tokens[output.request_id]",
              "for output, request_id in zip(core.step(), ids):\n            tokens[request_id]")]),
        "default_sampling": (
            "keeps SamplingParams' default temperature 1.0: sampled tokens, not greedy",
            [("SamplingParams(temperature=0.0, ", "SamplingParams(")]),
    },
    "lesson2_paged_decode": {
        "kv_head_modulo": (
            "pairs query head h with KV head h % num_kv_heads, but a GQA group is consecutive "
            "query heads",
            [("repeat_interleave(group, dim=1)", "repeat(1, group, 1)")]),
        "whole_last_block": (
            "attends over every slot of the request's blocks, the unfilled tail of the last included",
            [(".flatten(0, 1)[:seq_len]", ".flatten(0, 1)")]),
        "group_of_two": (
            "pairs query head h with KV head h // 2: right for 4 query heads over 2 KV heads, "
            "wrong for any other grouping",
            [("k = k.repeat_interleave(group, dim=1)",
              "k = k[:, torch.arange(query.shape[0]) // 2 % k.shape[1]]"),
             ("v = v.repeat_interleave(group, dim=1)",
              "v = v[:, torch.arange(query.shape[0]) // 2 % v.shape[1]]")]),
        "default_scale": (
            "scales the scores by head_dim ** -0.5, not by the `scale` it is given",
            [("* scale", "* query.shape[-1] ** -0.5")]),
    },
    "lesson3_shortest_job_first": {
        "prompt_only": ("a job's size taken as its prompt alone",
                        [("request.num_prompt_tokens + request.max_tokens",
                          "request.num_prompt_tokens")]),
        "max_tokens_only": ("a job's size taken as its max_tokens alone",
                            [("request.num_prompt_tokens + request.max_tokens",
                              "request.max_tokens")]),
        "insertion_order_ties": (
            "equal sizes go in the order they were added, not by arrival (a preempted request "
            "is added again long after it arrived)",
            [(", request.arrival_time)", ", 0)")]),
        "outputs_not_recomputed": (
            "sizes a job by the tokens it has left to generate: a preempted request seems to "
            "shrink, though its outputs so far are lost with its blocks and computed again",
            [("request.num_prompt_tokens + request.max_tokens",
              "request.num_prompt_tokens + request.max_tokens - request.num_output_tokens")]),
    },
    "lesson3_static_batching": {
        "drops_preempted": (
            "forgets the members preempted during a batch (they went to the hidden queue)",
            [("            for request in reversed(list(self.waiting)):\n"
              "                waiting.add(request, front=True)\n", "")]),
        "preempted_to_back": (
            "members preempted during a batch go to the back of the waiting queue, behind "
            "requests that arrived after them",
            [("for request in reversed(list(self.waiting)):\n"
              "                waiting.add(request, front=True)",
              "for request in self.waiting:\n                waiting.add(request)")]),
        "admits_when_seat_free": (
            "admits whenever a seat is free: that is continuous batching again",
            [("if not self.running:", "if len(self.running) < self.config.max_num_seqs:")]),
    },
    "lesson4_cheapest_victim": {
        "first_among_equals": ("among equal costs, the first admitted instead of the last",
                               [("][-1]", "][0]")]),
        "fewest_output_tokens": (
            "the fewest *output* tokens, forgetting that the prompt's K/V are lost too",
            [("num_computed_tokens", "num_output_tokens")]),
    },
    "lesson5_hit_count_eviction": {
        "keeps_hits_after_eviction": (
            "an evicted block keeps its count: new content inherits the old prefix's hits",
            [("                self.hits[block.block_id] = 0\n", "")]),
        "hits_only": (
            "orders free blocks by hits alone: an empty block and a never-hit cached one tie, "
            "and the cached prefix may be lost for nothing",
            [("key=lambda b: (b.block_hash is not None, self.hits[b.block_id])",
              "key=lambda b: self.hits[b.block_id]")]),
        "most_recent_among_equals": (
            "among equal hits, the most recently freed instead of the least",
            [("sorted(self.free_queue.values(),", "sorted(reversed(self.free_queue.values()),")]),
        "counts_lookups": (
            "counts a hit at every lookup of a cached block, though a request that waits for "
            "free blocks is looked up again at every step: its prefix seems hot",
            [("    def touch(self, blocks) -> None:\n"
              "        for block in blocks:\n"
              "            self.hits[block.block_id] += 1\n",
              "    def get_cached_block(self, block_hash):\n"
              "        block = super().get_cached_block(block_hash)\n"
              "        if block is not None:\n"
              "            self.hits[block.block_id] += 1\n"
              "        return block\n\n"
              "    def touch(self, blocks) -> None:\n")]),
    },
    "lesson6_kv_sizing": {
        "k_only": ("counts K but not V", [("return 2 * config", "return config")]),
        "head_dim_from_hidden": (
            "always derives head_dim from hidden_size, though a config may set its own",
            [('config.get("head_dim") or ', "")]),
        "kv_heads_not_split": (
            "forgets that each GPU holds only its share of the KV heads",
            [("max(1, kv_heads // tensor_parallel_size)", "kv_heads")]),
        "no_replica": (
            "splits the KV heads even when there are fewer than GPUs: zero heads, zero bytes",
            [("max(1, kv_heads // tensor_parallel_size)", "kv_heads // tensor_parallel_size")]),
        "tokens_not_blocks": (
            "shares the pool's tokens among the sequences, forgetting whole blocks",
            [("num_blocks // num_seqs * block_size", "num_blocks * block_size // num_seqs")]),
        "one_token_short": (
            "answers one token short of whole blocks: the sequences fit, but the length is not "
            "the largest that does",
            [("return num_blocks // num_seqs * block_size", "return num_blocks // num_seqs * block_size - 1")]),
        "block_size_16": (
            "counts every block as 16 tokens (nanoserve memory's default), whatever the block size",
            [("num_blocks // num_seqs * block_size", "num_blocks // num_seqs * 16")]),
    },
    "lesson2_batch_indices": {
        "positions_from_zero": (
            "numbers each request's tokens from 0, forgetting the tokens already in its cache "
            "(right for a first prefill only)",
            [("positions = num_computed[req_of_token] + offset_in_request",
              "positions = offset_in_request")]),
        "logical_block_as_physical": (
            "takes the logical block for the physical one, as if every request's blocks were "
            "contiguous from block 0",
            [("physical = block_tables[req_of_token, positions // block_size].long()",
              "physical = positions // block_size")]),
        "offset_within_the_step": (
            "takes the offset in the block from the token's place in this step, not from its "
            "position in the request",
            [("+ positions % block_size", "+ offset_in_request % block_size")]),
        "offset_modulo_4": (
            "takes the offset in the block modulo 4, the block size it was tried with",
            [("+ positions % block_size", "+ positions % 4")]),
    },
    "lesson3_chunked_running": {
        "no_budget_cap": (
            "gives every running request all it lacks, past the step's token budget",
            [("num_new = min(request.num_tokens - request.num_computed_tokens, budget)",
              "num_new = request.num_tokens - request.num_computed_tokens")]),
        "decode_only": (
            "one token per running request, as if running meant decoding: a prompt being "
            "computed in chunks crawls on one token a step",
            [("num_new = min(request.num_tokens - request.num_computed_tokens, budget)",
              "num_new = min(1, budget)")]),
        "stops_at_any_preemption": (
            "ends the step's running half whenever someone was preempted, though the requests "
            "admitted before the victim still have their blocks",
            [("if request in victims:", "if victims:")]),
        "victims_never_scheduled": (
            "assumes a victim is always behind the request (true under FCFS): under `priority` "
            "a victim scheduled earlier in the step keeps its tokens",
            [("            for victim in victims:\n"
              "                budget += scheduled.pop(victim.request_id, 0)\n", "")]),
        "next_index": (
            "moves on to the next index, as if no victim could sit ahead of the request (true "
            "under FCFS): under `priority` one request is skipped",
            [("i = self.running.index(request) + 1", "i += 1")]),
    },
    "lesson4_allocate_slots": {
        "floor_blocks": (
            "counts whole blocks by rounding down: the last, partly filled block is missing",
            [("-(-total // self.block_size)", "total // self.block_size")]),
        "empty_table_left": (
            "registers the request's block table before knowing the allocation succeeds: a "
            "failed admission leaves an empty table behind",
            [("held = self.req_to_block_ids.get(request.request_id, [])",
              "held = self.req_to_block_ids.setdefault(request.request_id, [])")]),
        "one_block_spare": (
            "always takes one block more than needed, just in case",
            [("- len(new_computed_blocks))", "- len(new_computed_blocks)) + 1")]),
        "free_hits_counted_twice": (
            "counts a hit block nobody holds as free too, though the hit takes it out of the "
            "free queue: the pool runs short in the middle of the call",
            [("if num_new_blocks > self.pool.num_free_blocks - free_hits:",
              "if num_new_blocks > self.pool.num_free_blocks:")]),
        "hit_blocks_allocated_anew": (
            "takes new blocks for the tokens the prefix hit brings, as if the hit held none",
            [("- len(held) - len(new_computed_blocks))", "- len(held))")]),
        "never_caches": (
            "never enters a full block into the prefix cache: no later request can hit it",
            [("        if self.enable_caching:", "        if False:")]),
    },
    "lesson5_hash_chain": {
        "no_parent": (
            "hashes each block's tokens alone: a block that repeats, or reappears at another "
            "position, is taken for one whose K/V were computed after other tokens",
            [("hashlib.sha256(hashes[-1] if hashes else b\"\")", "hashlib.sha256(b\"\")")]),
        "hashes_partial_block": (
            "hashes the last block while it is still partly filled; the hash is never redone "
            "when the block fills up",
            [("len(tokens) // size)", "-(-len(tokens) // size))")]),
        "parent_is_first_block": (
            "chains every block to the first block's hash instead of its own parent's",
            [("hashes[-1] if hashes", "hashes[0] if hashes")]),
        "digits_without_separator": (
            "writes a block's token ids as digits run together: [1, 23] and [12, 3] collide",
            [('array("q", tokens[i * size:(i + 1) * size]).tobytes()',
              '"".join(map(str, tokens[i * size:(i + 1) * size])).encode()')]),
        "one_byte_per_token": (
            "keeps one byte of each token id: 257 and 1 collide (vocabularies are larger)",
            [('array("q", tokens[i * size:(i + 1) * size]).tobytes()',
              'bytes(t % 256 for t in tokens[i * size:(i + 1) * size])')]),
    },
    "lesson7_exponential_race": {
        "uniform_noise": (
            "races with uniform noise instead of exponential: argmax p_i / U_i does not pick "
            "token i with probability p_i",
            [("noise = (-torch.log1p(-noise))", "noise = (noise)")]),
        "times_noise": ("multiplies by the noise instead of dividing",
                        [("(probs / noise)", "(probs * noise)")]),
        "batch_noise_only": (
            "draws every row's noise from the batch's generator, ignoring the seeded rows' own",
            [("        for row, generator in generators.items():\n"
              "            noise[row].uniform_(generator=generator)\n", "")]),
        "reseeds_every_call": (
            "draws the unseeded rows' noise from a generator seeded anew at every call: each "
            "call repeats the one before (right when all samples come from one call)",
            [("uniform_(generator=self.generator)",
              "uniform_(generator=torch.Generator().manual_seed(0))")]),
        "seeded_rows_restart": (
            "restarts each seeded row's generator from its seed at every call: the request "
            "draws the same noise at every step",
            [("noise[row].uniform_(generator=generator)",
              "noise[row].uniform_(generator=torch.Generator().manual_seed(generator.initial_seed()))")]),
    },
    "lesson7_top_k": {
        "strict_count": (
            "keeps a threshold only while more than k logits reach it: one logit too few",
            [(">= k\n", "> k\n")]),
        "masks_ties": ("masks the k-th largest too, and every logit tied with it",
                       [("(keys < low)", "(keys <= low)")]),
        "raw_float_bits": (
            "bisects over the raw bit patterns, whose order is backwards for negative floats",
            [("return torch.where(bits < 0, -(bits & 0x7FFFFFFF) - 1, bits)", "return bits")]),
    },
    "lesson8_ngram_proposer": {
        "earliest_match": (
            "takes the earliest occurrence (vLLM 0.32.0's rule), where the exercise asks for "
            "nanoserve's, the most recent",
            [("for start in range(end - n - 1, -1, -1):", "for start in range(0, end - n):")]),
        "shortest_first": (
            "tries the shortest n-gram first, so a one-token match beats a longer one",
            [("range(max_n, min_n - 1, -1)", "range(min_n, max_n + 1)")]),
        "suffix_matches_itself": (
            "lets the last n tokens match themselves, which proposes nothing useful",
            [("range(end - n - 1, -1, -1)", "range(end - n, -1, -1)")]),
        "recent_window": (
            "looks for the match only among the last 32 tokens: right on short sequences",
            [("for start in range(end - n - 1, -1, -1):",
              "for start in range(end - n - 1, max(-1, end - 33), -1):")]),
        "n_capped_at_6": (
            "never tries an n-gram longer than 6, whatever max_n says",
            [("range(max_n, min_n - 1, -1)", "range(min(max_n, 6), min_n - 1, -1)")]),
    },
    "lesson9_router": {
        "always_renormalizes": (
            "renormalizes the k weights even when the model says not to (Qwen3-MoE with "
            "norm_topk_prob false)",
            [("    if renormalize:\n", "    if True:\n")]),
        "bfloat16_softmax": (
            "takes the softmax in the logits' own dtype (bfloat16 in the engine), not float32",
            [("router_logits.float()", "router_logits")]),
        "first_16_experts": (
            "looks for the top_k among the first 16 experts only, enough for the small models "
            "it was tried on",
            [("order = torch.argsort(probs, dim=-1,", "order = torch.argsort(probs[:, :16], dim=-1,")]),
    },
}
