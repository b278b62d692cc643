"""check_kit.py: what every lesson check uses: import a file by path, fail with a message,
the model-free engine, and the real engine with HF transformers' greedy tokens as its oracle.
(lessons/checks.py puts this folder on sys.path.)"""

from __future__ import annotations

import ast
import importlib.util
import sys
from functools import lru_cache
from pathlib import Path

LESSONS = Path(__file__).resolve().parent
# The build-the-mechanism workload: four stories, 16 greedy tokens each, in a pool so small
# that requests are preempted and a budget so small that prompts are chunked.
PROMPTS = ("Once upon a time", "The cat sat on the mat", "Tom and Lily went to the park",
           "One day, a little girl named Sue")
SMALL_ENGINE = dict(block_size=4, num_kv_blocks=14, max_model_len=32, max_num_seqs=4,
                    max_num_batched_tokens=16)


def load(path: Path):
    """Import a Python file by its path (exercise files need not be on sys.path)."""
    name = f"_lesson_{path.parent.name}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)   # (dataclasses need it)
    spec.loader.exec_module(module)
    return module


def fake_engine():
    return load(LESSONS.parent / "tests" / "fake_engine.py")


def expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


def names_used(module) -> set[str]:
    """Every name and attribute the module's source mentions (what it may call)."""
    tree = ast.parse(Path(module.__file__).read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {a.name.split(".")[-1] for n in ast.walk(tree)
              if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    return names


def forbid(module, names: set[str], why: str) -> None:
    used = sorted(names & names_used(module))
    expect(not used, f"your file uses {', '.join(used)}: {why}")


def small_llm(**overrides):
    """The real engine (the built-in model), sized for SMALL_ENGINE's preemption and chunking."""
    from nanoserve import LLM
    return LLM(**{**SMALL_ENGINE, **overrides})


def prompt_ids(llm) -> list[list[int]]:
    return [llm.tokenizer.encode(p) for p in PROMPTS]


def greedy(llm, prompts: list[list[int]], max_tokens: int = 16) -> list[list[int]]:
    from nanoserve import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, progress=False)]


@lru_cache(maxsize=None)
def hf_greedy(model_path: str, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    """HF transformers' greedy tokens, EOS ignored (its eos_token_id unset: min_new_tokens would
    mask EOS, which ignore_eos must not do)."""
    import torch
    model = hf_model(model_path)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


@lru_cache(maxsize=None)
def hf_model(model_path: str):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging
    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def expect_hf_greedy(llm, prompts: list[list[int]], max_tokens: int = 16) -> None:
    """The engine, with the learner's piece in it, gives HF transformers' greedy tokens."""
    got = greedy(llm, prompts, max_tokens)
    for prompt, tokens in zip(prompts, got):
        want = hf_greedy(str(llm.engine.model_path), tuple(prompt), max_tokens)
        expect(tokens == want, f"prompt {prompt}: the engine with your code generated "
               f"{tokens}, HF transformers' greedy tokens are {want}")
    pool = llm.engine.kv_cache_manager.pool
    expect(pool.num_free_blocks == pool.num_blocks, "blocks leaked: not all free at the end")
