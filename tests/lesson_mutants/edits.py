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
    },
    "lesson6_kv_sizing": {
        "k_only": ("counts K but not V", [("return 2 * num_layers", "return num_layers")]),
        "rounded_blocks": (
            "rounds the block count to the nearest, promising a block the budget cannot hold",
            [("int(kv_budget_bytes // (bytes_per_token * block_size))",
              "round(kv_budget_bytes / (bytes_per_token * block_size))")]),
        "tokens_not_blocks": (
            "shares the pool's tokens among the sequences, forgetting whole blocks",
            [("num_blocks // num_seqs * block_size", "num_blocks * block_size // num_seqs")]),
    },
    "lesson8_ngram_proposer": {
        "oldest_match": (
            "takes the earliest occurrence of the n-gram instead of the most recent one",
            [("for start in range(end - n - 1, -1, -1):", "for start in range(0, end - n):")]),
        "shortest_first": (
            "tries the shortest n-gram first, so a one-token match beats a longer one",
            [("range(max_n, min_n - 1, -1)", "range(min_n, max_n + 1)")]),
        "suffix_matches_itself": (
            "lets the last n tokens match themselves, which proposes nothing useful",
            [("range(end - n - 1, -1, -1)", "range(end - n, -1, -1)")]),
    },
}
