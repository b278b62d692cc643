"""Wrong answer to exercise 1.3: leaves the stepping to the engine's own busy loop
(engine_core.run_busy_loop), fed from a queue, instead of calling core.step() itself."""

from nanoserve import engine_core
from nanoserve.request import Request
from nanoserve.sampling_params import SamplingParams


def generate(core, prompts, max_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"loop-{i}" for i in range(len(prompts))]
    inputs = [("add", [Request(rid, p, params)]) for rid, p in zip(ids, prompts)]
    tokens = {rid: [] for rid in ids}

    def get_inputs(block):
        if inputs:
            return [inputs.pop(0) for _ in range(len(inputs))]
        return [("shutdown", None)] if not core.has_unfinished_requests() else []

    def put(message):
        for output in getattr(message, "outputs", []):
            tokens[output.request_id] += output.new_token_ids
    engine_core.run_busy_loop(core, get_inputs, put)
    return [tokens[rid] for rid in ids]
