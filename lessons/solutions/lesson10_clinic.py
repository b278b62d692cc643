"""Exercise 10.4, a reference solution: the clinic's three diagnoses (lessons/answers/10-clinic.md
has the reasoning and the measured effect of each fix)."""

EVIDENCE = {
    "A": 256,   # "the KV cache holds 16 blocks (256 tokens), less than one sequence of ... (512)"
    "B": 135,   # the trace: request 7 samples its first token at step 135
    "C": 8,     # the workload's report: "preemptions   8"
}
PRESCRIPTION = {
    "A": {"kv_cache_memory_gb": 0.002},       # 65 blocks: one sequence of 512 fits (2.03x)
    "B": {"max_num_batched_tokens": 2048},    # the default: all 8 prompts in the first step
    "C": {"kv_cache_memory_gb": 0.004},       # 131 blocks: 16 requests of 8 blocks all fit
}


def evidence(mystery: str) -> int:
    return EVIDENCE[mystery]


def prescribe(mystery: str) -> dict:
    return PRESCRIPTION[mystery]
