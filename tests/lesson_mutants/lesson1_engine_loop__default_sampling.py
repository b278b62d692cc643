"""Wrong answer to exercise 1.3: keeps SamplingParams' default temperature (1.0), so the
tokens are sampled, not greedy."""

from nanoserve.sampling_params import SamplingParams
from nanoserve.scheduler import Request


def generate(core, prompts, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(Request(f"m{i}", prompt, params))
    tokens = {f"m{i}": [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for output in core.step():
            tokens[output.request_id] += output.new_token_ids
    return [tokens[f"m{i}"] for i in range(len(prompts))]
