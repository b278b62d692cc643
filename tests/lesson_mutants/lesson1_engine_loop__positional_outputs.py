"""Wrong answer to exercise 1.3: files a step's outputs by their position in the list, as if
every step returned one output per prompt, in prompt order."""

from nanoserve.sampling_params import SamplingParams
from nanoserve.scheduler import Request


def generate(core, prompts, max_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(Request(f"m{i}", prompt, params))
    tokens = [[] for _ in prompts]
    while core.has_unfinished_requests():
        for i, output in enumerate(core.step()):
            tokens[i] += output.new_token_ids
    return tokens
