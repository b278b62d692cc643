"""Wrong answer to exercise 1.3: does not write the loop: builds an LLM around the engine core it
is given and lets LLM.generate step it."""

import itertools

from nanoserve.engine import LLM
from nanoserve.output_processor import OutputProcessor, load_tokenizer
from nanoserve.processor import Processor
from nanoserve.sampling_params import SamplingParams


def generate(core, prompts, max_tokens):
    llm = LLM.__new__(LLM)
    llm.engine, llm.config = core, core.config
    llm.tokenizer = load_tokenizer(core.config, core.model_path)
    llm.processor = Processor(core.config, llm.tokenizer, core.vocab_size, core.model_path)
    llm.output_processor, llm._ids = OutputProcessor(llm.tokenizer), itertools.count()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, progress=False)
    return [o.outputs[0].token_ids for o in outputs]
