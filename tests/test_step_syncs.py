"""The step's sync points (issue 52): a step that samples reads the device ONCE, a `.tolist()` of
the sampled ids (the logprobs, when asked for, travel in the same copy); building the inputs, the
sampling metadata, the grammar rows and the logprobs reads nothing back.

On a CPU nothing ever waits, so the test marks what would live on the GPU: the logits the model
returns, and every tensor the step sends to the device (`.to(device)`, `torch.tensor(...,
device=...)`), and follows them through every op (a TorchDispatchMode). It counts as a sync:

- a marked tensor read on the host: `.tolist()`, `.cpu()`, `.numpy()`, `.item()`, `int()`,
  `bool()` (`aten._local_scalar_dense`);
- an op on a marked tensor whose output's size depends on its values (`nonzero`, boolean
  indexing, `masked_select`, `unique`, `repeat_interleave`): it must read them first;
- a blocking host-to-device copy (`torch.tensor(..., device=...)`, `.to(device)` without
  `non_blocking`): on CUDA it waits for every kernel queued before it, the forward's too.

The backend's forward is not counted: on CUDA it is one graph replay or Triton kernels (their
launches: scripts/gpu_graphs.py), and the CPU backend is host code by nature.

    pytest -q tests/test_step_syncs.py
"""

from __future__ import annotations

import functools
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from nanoserve import LLM, SamplingParams
from nanoserve.sampling_params import StructuredOutputsParams

aten = torch.ops.aten
DATA_DEPENDENT = {aten._local_scalar_dense.default, aten.nonzero.default,
                  aten.masked_select.default, aten.repeat_interleave.Tensor, aten._unique2.default, aten.unique_dim.default,
                  aten.unique_consecutive.default, aten.equal.default, aten.is_nonzero.default}
INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _where() -> str:
    """The innermost nanoserve frame that made the call."""
    frames = [f for f in traceback.extract_stack() if "/nanoserve/" in f.filename]
    return f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else "?"


class SyncCounter(TorchDispatchMode):
    """Marks the step's device tensors and records each sync (what, where) while `counting`."""

    def __init__(self):
        super().__init__()
        self.marked: dict[int, torch.Tensor] = {}     # id -> tensor, kept alive: ids stay unique
        self.syncs: list[str] = []
        self.in_step = self.counting = False

    def mark(self, tree):
        if self.in_step:
            self.marked.update((id(t), t) for t in _tensors(tree))
        return tree

    def on_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and self.marked.get(id(t)) is t

    def record(self, what: str) -> None:
        if self.counting:
            self.syncs.append(f"{what} at {_where()}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        from_device = any(self.on_device(t) for t in _tensors((args, kwargs)))
        bool_index = func in INDEXING and any(
            t.dtype in (torch.bool, torch.uint8) for t in _tensors(args[1]))
        if from_device and (func in DATA_DEPENDENT or bool_index):
            self.record(str(func))
        out = func(*args, **kwargs)
        return self.mark(out) if from_device else out


def _device_of(args, kwargs):
    device = kwargs.get("device")
    return device if device is not None else next(
        (a for a in args if isinstance(a, (str, torch.device))), None)


@pytest.fixture
def counted(monkeypatch):
    """The counter, with the host reads and device copies of torch routed through it."""
    counter = SyncCounter()

    def read(name):
        real = getattr(torch.Tensor, name)

        @functools.wraps(real)
        def reading(self, *args, **kwargs):
            if counter.on_device(self):
                counter.record(f"Tensor.{name}")
            return real(self, *args, **kwargs)
        return reading

    def to(real):
        @functools.wraps(real)
        def copying(self, *args, **kwargs):
            device = _device_of(args, kwargs)
            if device is None:
                return real(self, *args, **kwargs)
            if not kwargs.get("non_blocking") and not counter.on_device(self):
                counter.record("blocking Tensor.to(device)")
            return counter.mark(real(self, *args, **kwargs))
        return copying

    def factory(real):
        @functools.wraps(real)
        def creating(*args, **kwargs):
            if kwargs.get("device") is None:
                return real(*args, **kwargs)
            counter.record(f"blocking torch.{real.__name__}(..., device=)")
            return counter.mark(real(*args, **kwargs))
        return creating

    for name in ("tolist", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, read(name))
    monkeypatch.setattr(torch.Tensor, "to", to(torch.Tensor.to))
    monkeypatch.setattr(torch, "tensor", factory(torch.tensor))
    monkeypatch.setattr(torch, "as_tensor", factory(torch.as_tensor))
    return counter


def instrument(llm: LLM, counter: SyncCounter, monkeypatch) -> list[tuple[str, list[str]]]:
    """Each step's (kind, its syncs), counted from its start to its end except in the forward."""
    runner = llm.engine.executor.model_runner
    steps = []

    def wrap(obj, name, around):
        real = getattr(obj, name)
        monkeypatch.setattr(obj, name, functools.wraps(real)(lambda *a, **k: around(real, *a, **k)))

    def step(real, out):
        counter.syncs, counter.marked, counter.in_step = [], {}, True
        counter.counting = True
        try:
            with counter:
                result = real(out)
        finally:
            counter.in_step = counter.counting = False
            counter.marked = {}
        kinds = [k for k, on in (("drafts", out.scheduled_spec_decode_tokens),
                                 ("grammar", out.grammar_bitmask is not None),
                                 ("logprobs", result[1])) if on]
        steps.append(("+".join(kinds) or ("samples" if result[0] else "prefill"),
                      counter.syncs))
        return result

    def forward(real, *args):
        counter.counting = False
        try:
            return real(*args)
        finally:
            counter.counting = True

    wrap(runner, "execute_model", step)
    wrap(runner.backend, "forward", forward)
    wrap(runner.model, "compute_logits", lambda real, *a: counter.mark(real(*a)))
    return steps


def test_a_step_reads_the_device_once(counted, monkeypatch):
    """Greedy, sampled (every knob, seeded), logprobs, a grammar and drafts, side by side: every
    step that samples has exactly one sync, the sampled ids' `.tolist()`; one that does not (a
    prefill chunk) has none."""
    llm = LLM("nanoserve-tiny", max_model_len=512, max_num_batched_tokens=16,
              speculative_config=SPEC)
    steps = instrument(llm, counted, monkeypatch)
    story = "Once upon a time there was a cat. Once upon a time there was a cat. Once upon a"
    every_knob = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=3,
                                repetition_penalty=1.2, frequency_penalty=0.5,
                                presence_penalty=0.2, min_tokens=4, max_tokens=12)
    params = [SamplingParams(temperature=0.0, max_tokens=24), every_knob,
              SamplingParams(temperature=0.7, logprobs=3, max_tokens=12),
              SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=
                             StructuredOutputsParams(choice=["yes", "no"]))]
    llm.generate([story] * len(params), params, progress=False)
    kinds = {kind for kind, _ in steps}
    assert {"prefill", "samples", "drafts", "grammar", "logprobs"} <= {k for kind in kinds
                                                           for k in kind.split("+")}, kinds
    wrong = [f"a {kind} step: {len(syncs)} syncs: " + "; ".join(syncs) for kind, syncs in steps
             if len(syncs) != (kind != "prefill") or not all("Tensor.tolist" in s for s in syncs)]
    assert not wrong, "\n".join(wrong)
