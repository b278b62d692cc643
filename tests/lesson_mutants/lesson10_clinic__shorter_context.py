"""Wrong answer to exercise 10.4: A is made to start by halving max_model_len to what the pool
holds (vLLM's other advice), but the patient needs sequences of 512 tokens."""

EVIDENCE = {
    "A": 256,   # "the KV cache holds 16 blocks (256 tokens), less than one sequence of ... (512)"
    "B": 135,   # the trace: request 7 samples its first token at step 135
    "C": 8,     # the workload's report: "preemptions   8"
}
PRESCRIPTION = {
    "A": {"max_model_len": 256},             # what the pool holds: the context is cut
    "B": {"max_num_batched_tokens": 2048},    # the default: all 8 prompts in the first step
    "C": {"kv_cache_memory_gb": 0.004},       # 131 blocks: 16 requests of 8 blocks all fit
}


def evidence(mystery: str) -> int:
    return EVIDENCE[mystery]


def prescribe(mystery: str) -> dict:
    return PRESCRIPTION[mystery]
