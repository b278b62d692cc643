"""check_kit.py: what every lesson check uses: import a file by path, fail with a message,
make sure the learner's own code does the work (own_work), the model-free engine, and the real
engine with HF transformers' greedy tokens as its oracle.
(lessons/checks.py puts this folder on sys.path.)"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import threading
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from types import CodeType, FunctionType

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
    for guard in GUARDS:              # (own_work: a violation fails at once)
        guard.expect_clean()
    if not ok:
        raise AssertionError(message)


def code_of(fn) -> CodeType | None:
    fn = inspect.unwrap(getattr(fn, "__func__", fn))
    return getattr(fn, "__code__", None)


def fingerprint(code: CodeType) -> tuple:
    """What a copy of a function keeps wherever it is loaded from, whatever it is named."""
    return code.co_code, code.co_names


def functions_in(path: Path):
    """The code of every function (def) in a file, classes' methods included."""
    todo = [compile(path.read_text(), str(path), "exec")]
    while todo:
        consts = [c for c in todo.pop().co_consts if isinstance(c, CodeType)]
        yield from (c for c in consts if not c.co_name.startswith("<"))
        todo += consts


def expect_defined(mod, names) -> None:
    """Each of `names` (a function, or Class.method) is written in the learner's own file: not
    inherited from nanoserve's class, not assigned from someone else's code."""
    for dotted in names:
        obj = mod
        for part in dotted.split("."):
            obj = getattr(obj, part, None)
        code = code_of(obj)
        whose = "missing" if obj is None else "not a function" if code is None else \
            f"{Path(code.co_filename).name}'s"
        expect(code is not None and code.co_filename == mod.__file__,
               f"write {dotted} in your own file (yours is {whose})")


@contextmanager
def own_work(mod, names, forbidden=(), why="write it yourself", shun=()):
    """While the block runs, the learner's code does the work itself: `names` are defined in the
    learner's file (expect_defined), and no frame runs a `forbidden` function (nanoserve's own
    version of the mechanism) nor a function of the reference solution, however it was reached:
    imported, looked up by a string, loaded again from a private copy (a copy runs the same
    bytecode). `shun`: modules and builtins the learner's code may not call (numpy, sorted).
    The check's own oracle calls go in a `with oracle():` block. A violation fails the next
    expect(), or the block's end.

        with own_work(mod, ["MyKVCacheManager.allocate_slots"], [KVCacheManager.allocate_slots]):
            run_the_engine_with(mod.MyKVCacheManager)
    """
    expect_defined(mod, names)
    banned = {fingerprint(code_of(f)): f"nanoserve's {f.__qualname__}" for f in forbidden}
    solution = getattr(mod, "reference_solution", None)
    if solution is not None and solution != Path(mod.__file__).resolve():
        banned |= {fingerprint(c): "the reference solution's "
                   + getattr(c, "co_qualname", c.co_name) for c in functions_in(solution)}
    guard = Guard(banned, mod.__file__, set(shun), why)
    previous = sys.getprofile()
    sys.setprofile(guard.hook)
    threading.setprofile(guard.hook)            # (threads the learner's code starts)
    GUARDS.append(guard)
    try:
        yield
    finally:
        GUARDS.remove(guard)
        watched = sys.getprofile() == guard.hook
        threading.setprofile(None)
        sys.setprofile(previous)
    guard.expect_clean()
    expect(watched, "your code switched off the profile hook that watches it")


GUARDS: list = []       # own_work's guards now watching


@contextmanager
def oracle():
    """The check's own oracle (nanoserve's code, HF transformers) runs here, unwatched."""
    for guard in GUARDS:
        guard.pause += 1
    try:
        yield
    finally:
        for guard in GUARDS:
            guard.pause -= 1


class Guard:
    """own_work's profile hook: it remembers the first banned code that ran (an exception raised
    in a profile hook would switch the hook off, and the learner's code could catch it)."""

    def __init__(self, banned: dict, own_file: str, shun: set, why: str):
        self.banned, self.own_file, self.shun, self.why = banned, own_file, shun, why
        self.verdicts: dict[int, str | None] = {}
        self.keep: list = []              # the codes judged stay alive, so their ids stay theirs
        self.seen, self.pause = None, 0

    def expect_clean(self) -> None:
        if self.seen is not None:
            raise AssertionError(f"your code ran {self.seen}: {self.why}")

    def judge(self, code: CodeType) -> str | None:
        return None if code.co_filename == self.own_file else self.banned.get(fingerprint(code))

    def hook(self, frame, event, arg) -> None:
        if self.pause or self.seen:
            return
        if event == "call":
            code = frame.f_code
            verdict = self.verdicts.get(id(code), 0)
            if verdict == 0:
                self.keep.append(code)
                verdict = self.verdicts[id(code)] = self.judge(code)
            self.seen = verdict or self.shunned(code.co_filename, code.co_name, frame.f_back)
        elif event == "c_call" and (arg is sys.setprofile or arg is sys.settrace) \
                and frame.f_code.co_filename != __file__:
            self.seen = f"{arg.__module__}.{arg.__name__}: the check watches your code"
        elif event == "c_call" and self.shun:
            owner = getattr(arg, "__self__", None)
            where = getattr(arg, "__module__", None) or type(owner).__module__
            self.seen = self.shunned(where, getattr(arg, "__name__", ""), frame)

    def shunned(self, where: str, name: str, caller) -> str | None:
        """A shunned module's function (from its file or its C module), or a shunned name,
        called by the learner's own code (torch may use numpy inside: that is not theirs)."""
        if not self.shun or caller is None or caller.f_code.co_filename != self.own_file:
            return None
        module = Path(where).stem if where.endswith(".py") else where.split(".")[0]
        places = set(Path(where).parts) | {module.lstrip("_")}
        return f"{name} ({where})" if name in self.shun or places & self.shun else None


@contextmanager
def untouched(path: Path):
    """The learner's file (at `path`) may not replace functions of nanoserve, of the checks or of
    the model-free engine with its own code: a patched oracle agrees with anything. What it
    replaced is put back, and the check fails."""
    before = functions_of_ours(path)
    try:
        yield
    finally:
        replaced = [(owner, name, before.get((owner, name)))
                    for (owner, name), fn in functions_of_ours(path).items()
                    if getattr(code_of(fn), "co_filename", None) == str(path)]
        for owner, name, fn in replaced:
            if fn is None:
                delattr(owner, name)
            else:
                setattr(owner, name, fn)
    expect(not replaced, "your code replaced " + ", ".join(
        f"{getattr(owner, '__qualname__', owner.__name__)}.{name}" for owner, name, _ in replaced)
        + ": leave nanoserve and the check as they are")


def functions_of_ours(learners: Path) -> dict:
    """{(module or class, name): function} over the loaded modules of nanoserve, lessons/ and
    tests/ (the learner's file aside), and their classes."""
    roots = tuple(str(LESSONS.parent / d) for d in ("nanoserve", "lessons", "tests"))
    found = {}
    for module in list(sys.modules.values()):
        file = str(getattr(module, "__file__", None) or "")
        if not file.startswith(roots) or file == str(learners):
            continue
        owners = [module] + [v for v in vars(module).values()
                             if isinstance(v, type) and v.__module__ == module.__name__]
        found.update({(owner, name): value for owner in owners
                      for name, value in list(vars(owner).items())
                      if isinstance(value, (FunctionType, staticmethod, classmethod))})
    return found


@contextmanager
def aten_ops():
    """The names of the aten ops run in the block (below torch's Python API: torch.quantile's
    sort, a multinomial reached by any name), in a list filled as they run."""
    from torch.utils._python_dispatch import TorchDispatchMode
    ops: list[str] = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))
    with Watch():
        yield ops


def small_llm(**overrides):
    """The real engine (the built-in model), sized for SMALL_ENGINE's preemption and chunking."""
    from nanoserve import LLM
    with oracle():                      # (building the engine runs nanoserve's own pieces)
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
        with oracle():
            want = hf_greedy(str(llm.engine.model_path), tuple(prompt), max_tokens)
        expect(tokens == want, f"prompt {prompt}: the engine with your code generated "
               f"{tokens}, HF transformers' greedy tokens are {want}")
    pool = llm.engine.kv_cache_manager.pool
    expect(pool.num_free_blocks == pool.num_blocks, "blocks leaked: not all free at the end")
