"""graphs.py: capture and replay on the CPU: the model's own forward for a decode step, recorded
once per batch size and replayed as one flat loop of calls (cuda/graphs.py's CUDA graphs, here).

A CUDA graph records the kernels a forward launches, with their arguments, and replays them with
no Python in between. On a CPU the backend's op forms are already C calls on tensors (ops.py), so
the same idea is a list: `CpuGraph.capture(forward)` runs the plain model once on the runner's
persistent step inputs (step_inputs.py) and notes, in order, every call that computes:

    every C kernel the op forms call   kernels.py's library, each kernel wrapped while recording
    every torch op outside them        the embedding, RoPE's table lookup (a TorchDispatchMode)

Views compute nothing, and allocations happen once: neither is replayed. What the model does in
Python (which module, which shape, which branch) is decided during the capture, as in a CUDA
graph; a capture that would read a tensor's values (.item(), nonzero) is refused.

An op whose work depends on values (FusedMoE: which expert gets which tokens, moe.py) is recorded
as ONE opaque call, as a C kernel is: a function wrapped by `opaque`, fn(*tensors), which writes
its result into a tensor it is given. The recorder keeps the call with its tensors (the step's
fixed buffers, bound into the arena like any other) and records nothing of what runs inside it;
the replay calls the function again on the same buffers, and it decides afresh from their values
(that call allocates its own temporaries, as the eager step does).

Two steps turn the record into the replay, as a CUDA graph's memory pool does:
  1. `plan_memory`: each tensor the forward allocated gets a place in ONE arena shared by every
     captured size (graphs never run at the same time), by its lifetime in the record: two tensors
     whose lives do not overlap share bytes. A 64-row step of SmolLM2-135M's shape keeps 0.8 MiB
     in bf16 (1.6 in float32), not the 33 MiB (66) of every tensor it made laid end to end.
  2. binding: every pointer and tensor of the record is rewritten into the arena.
A fusion would be a pass over the record between the two (as vLLM's passes over captured graphs).
Two were built and measured, and lost: the RMSNorm done inside the product after it, and
silu(gate) * up on gate_up's tiles (the engine ran 1.037x and 1.024x faster without them, 64
requests in bf16; at batch 1 no difference: scripts/results/README.md, a twenty-first session), so
the replay runs the model's own ops as recorded.

Replay: `for call in calls: call()`, 9 C calls a layer (rms_norm, gemm, rope_store_kv,
decode_attention, gemm, rms_norm, gemm, silu_and_mul, gemm); the step's inputs were written into
the same buffers by the runner (padded, as on a GPU) and the output is a tensor at a fixed address.
The record is what the model's code called: a forward hook on any module fires during capture.

    pytest -q tests/test_cpu_graphs.py
"""

from __future__ import annotations

import bisect
import ctypes
import functools
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from nanoserve.cpu import kernels as cpu_kernels

aten = torch.ops.aten
ALLOCATIONS = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided}
ALIGN = 64   # bytes: every planned tensor starts on a cache line (and on any dtype's alignment)


@dataclass
class Call:
    """One recorded call: a C kernel (`kernel`: its name) with its arguments, or a torch op that
    writes `out` (a functional op, replayed into the tensor it returned) or its own arguments, or
    an opaque function (which writes its own arguments, as an in-place op does)."""
    fn: object
    args: tuple
    kwargs: dict = field(default_factory=dict)
    kernel: Optional[str] = None
    out: Optional[Tensor] = None


@dataclass(frozen=True)
class Ref:
    """A place in memory the capture allocated: buffer `buffer`, `offset` bytes in; for a tensor,
    its dtype, sizes and strides too (a pointer of a C call has none)."""
    buffer: int
    offset: int
    tensor: Optional[tuple] = None   # (dtype, size, stride)


class Recorder(TorchDispatchMode):
    """Runs a forward and keeps every computing call (the module docstring), and every tensor
    the forward allocated (alive, so that each address stays the one recorded)."""

    active: Optional["Recorder"] = None   # the one recording now (opaque calls report to it)

    def __init__(self):
        super().__init__()
        self.calls: list[Call] = []
        self.made: dict[int, Tensor] = {}   # storage address -> a tensor on it
        self.inside_opaque = False          # within an opaque call: its work is not recorded

    def kernel(self, name: str, fn):
        def record(*args):
            if not self.inside_opaque:
                self.calls.append(Call(fn, args, kernel=name))
            return fn(*args)
        return record

    def opaque(self, fn, args):
        """fn(*args), kept as one call; nothing it runs is recorded (the module docstring)."""
        self.calls.append(Call(fn, args))
        self.inside_opaque = True
        try:
            return fn(*args)
        finally:
            self.inside_opaque = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.inside_opaque:
            return func(*args, **kwargs)
        if _reads_values(func, args):
            raise RuntimeError(f"{func} reads a tensor's values: that step cannot be captured")
        out = func(*args, **kwargs)
        outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor)]
        inputs = {_address(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
        if func.overloadpacket in ALLOCATIONS or not all(_address(t) in inputs for t in outputs):
            self.made.update((_address(t), t) for t in outputs
                             if t.layout == torch.strided and t.untyped_storage().nbytes())
        if func.overloadpacket in ALLOCATIONS:
            return out
        if func._schema.is_mutable:                       # in place, or out=
            self.calls.append(Call(func, args, kwargs))
        elif not all(_address(t) in inputs for t in outputs):   # functional: a new tensor
            if not isinstance(out, Tensor):
                raise RuntimeError(f"{func} returns several new tensors: not replayed here")
            self.calls.append(Call(func, args, kwargs, out=out))
        return out                                        # else a view: nothing computed

    def record(self, forward) -> Tensor:
        """forward() with every step kernel of the library recorded too."""
        library = cpu_kernels.load()
        originals = {name: getattr(library, name) for name in cpu_kernels.STEP_KERNELS}
        try:
            for name, fn in originals.items():
                setattr(library, name, self.kernel(name, fn))
            Recorder.active = self
            with self:
                return forward()
        finally:
            Recorder.active = None
            for name, fn in originals.items():
                setattr(library, name, fn)


def opaque(fn):
    """fn(*tensors), which writes its result into one of them, as one call of a captured step
    however data-dependent its work (the module docstring); outside a capture, just fn."""
    @functools.wraps(fn)
    def call(*args):
        recorder = Recorder.active
        if recorder is None or recorder.inside_opaque:
            return fn(*args)
        return recorder.opaque(fn, args)
    return call


def _reads_values(func, args) -> bool:
    """Whether func's result (a Python number, or its shape) depends on values: .item(), nonzero,
    a boolean mask; a gather by integer indices (RoPE's table lookup) does not."""
    if torch.Tag.data_dependent_output in func.tags:
        return True
    if torch.Tag.dynamic_output_shape not in func.tags:
        return False
    return func is not aten.index.Tensor or any(
        isinstance(t, Tensor) and t.dtype == torch.bool for t in pytree.tree_leaves(args))


def _address(t: Tensor) -> Optional[int]:
    """Where t's storage starts; None for an opaque tensor (oneDNN's packed weights: no storage)."""
    return t.untyped_storage().data_ptr() if t.layout == torch.strided else None


def _out_overload(func):
    """func's out= form (aten.embedding.default -> aten.embedding.out), or None."""
    arguments = [(a.name, str(a.type)) for a in func._schema.arguments]
    for name in func.overloadpacket.overloads():
        schema = getattr(func.overloadpacket, name)._schema
        if ([(a.name, str(a.type)) for a in schema.arguments if not a.is_out] == arguments
                and len(schema.arguments) > len(arguments)):
            return getattr(func.overloadpacket, name)
    return None


class Buffers:
    """The storages a capture allocated, by address: where a pointer or tensor of the record
    points, as a Ref."""

    def __init__(self, made: dict[int, Tensor]):
        self.bases = sorted(made)
        self.sizes = [made[base].untyped_storage().nbytes() for base in self.bases]

    def ref(self, address: Optional[int], tensor: Optional[tuple] = None) -> Optional[Ref]:
        i = bisect.bisect_right(self.bases, address or 0) - 1
        if i >= 0 and address < self.bases[i] + self.sizes[i]:
            return Ref(i, address - self.bases[i], tensor)
        return None

    def of(self, x):
        """x with a Ref in place of each tensor the capture allocated (others stay: weights,
        the KV cache, the runner's inputs are there for good)."""
        if isinstance(x, Tensor) and x.layout == torch.strided:
            return self.ref(x.data_ptr(), (x.dtype, tuple(x.shape), x.stride())) or x
        return x

    def symbolic(self, call: Call) -> Call:
        if call.kernel is None:
            args, kwargs = pytree.tree_map(self.of, (call.args, call.kwargs))
            return Call(call.fn, args, kwargs, out=None if call.out is None else self.of(call.out))
        pointers = [t is ctypes.c_void_p for t in call.fn.argtypes]
        return Call(call.fn, tuple(self.ref(a) or a if p else a for a, p in zip(call.args, pointers)),
                    kernel=call.kernel)


def refs(call: Call) -> list[Ref]:
    return [r for r in pytree.tree_leaves((call.args, call.kwargs, call.out)) if isinstance(r, Ref)]


def plan_memory(calls: list[Call], sizes: list[int], output: Ref) -> tuple[dict[int, int], int]:
    """Where each buffer lives in the arena ({buffer: offset}) and the arena's size: a buffer is
    alive from the first call that uses it to the last (the output: to the end), and takes the
    lowest gap that no buffer alive at the same time holds. Example: buffers a (calls 0-1),
    b (1-2), c (2-3), 64 bytes each: a at 0, b at 64, c at 0 (a is dead by call 2)."""
    first, last = {}, {}
    for i, call in enumerate(calls):
        for r in refs(call):
            first.setdefault(r.buffer, i)
            last[r.buffer] = i
    last[output.buffer], where, live, size = len(calls), {}, [], 0
    first.setdefault(output.buffer, len(calls))
    for buffer in sorted(first, key=first.get):
        live = sorted((o, e, b) for o, e, b in live if last[b] >= first[buffer])
        need, offset = -(-sizes[buffer] // ALIGN) * ALIGN, 0
        for start, end, _ in live:
            if offset + need <= start:
                break
            offset = max(offset, end)
        where[buffer] = offset
        live.append((offset, offset + need, buffer))
        size = max(size, offset + need)
    return where, size


def _run(fn, args, kwargs) -> None:
    fn(*args, **kwargs)     # a torch op's result is its out= tensor: nothing to return


def _copy_into(out: Tensor, fn, args, kwargs) -> None:
    out.copy_(fn(*args, **kwargs))


def _replay(call: Call, args, kwargs, out):
    """The zero-argument form of one bound call."""
    if call.kernel is not None:
        return functools.partial(call.fn, *args)
    if out is None:                                   # in place, or out=
        return functools.partial(_run, call.fn, args, kwargs)
    if call.fn.overloadpacket is aten.to:             # a dtype conversion: copy_ converts
        return functools.partial(_run, out.copy_, (args[0],), {})
    out_form = _out_overload(call.fn)
    if out_form is None:   # oneDNN's packed product has none: its result is copied in
        return functools.partial(_copy_into, out, call.fn, args, kwargs)
    return functools.partial(_run, out_form, args, {**kwargs, "out": out})


class CpuGraphPool:
    """The arena every captured size shares (only one replays at a time), grown to the largest
    plan; growing it rebinds the graphs already in it."""

    def __init__(self):
        self.arena, self.graphs = torch.empty(0, dtype=torch.uint8), []

    def add(self, graph: "CpuGraph") -> None:
        self.graphs.append(graph)
        if graph.size > self.arena.numel():
            self.arena = torch.empty(graph.size, dtype=torch.uint8)
            for g in self.graphs:
                g.bind(self.arena)
        else:
            graph.bind(self.arena)


class CpuGraph:
    """One captured decode step: `capture(forward)` once, then `replay()` (graph_capture.py's
    graph type on a CPU, as cuda/graphs.py's CUDAGraph is on a GPU)."""

    def __init__(self, pool: CpuGraphPool):
        self.pool, self.calls, self.output = pool, [], None

    @staticmethod
    def new_pool() -> CpuGraphPool:
        return CpuGraphPool()

    def capture(self, forward) -> Tensor:
        recorder = Recorder()
        output = recorder.record(forward)
        buffers = Buffers(recorder.made)
        self.output_ref = buffers.of(output)
        if not isinstance(self.output_ref, Ref):
            raise RuntimeError("the captured forward must return a tensor it allocated")
        self.record = [buffers.symbolic(call) for call in recorder.calls]
        self.buffer_sizes = buffers.sizes
        self.where, self.size = plan_memory(self.record, buffers.sizes, self.output_ref)
        self.pool.add(self)
        return self.output

    def bind(self, arena: Tensor) -> None:
        """The record's Refs as places in `arena`: the calls a replay makes."""
        base = arena.data_ptr()

        def place(x):
            if not isinstance(x, Ref):
                return x
            offset = self.where[x.buffer] + x.offset
            if x.tensor is None:
                return base + offset
            dtype, size, stride = x.tensor
            return arena.view(dtype).as_strided(size, stride, offset // dtype.itemsize)

        self.calls = [_replay(call, *pytree.tree_map(place, (call.args, call.kwargs, call.out)))
                      for call in self.record]
        self.output = place(self.output_ref)

    @torch.inference_mode()     # the arena was made in the capture's: its tensors are inference tensors
    def replay(self) -> Tensor:
        if any([call() for call in self.calls]):    # a C kernel's status: out of memory
            raise MemoryError("a CPU kernel could not allocate its buffers during a step")
        return self.output
