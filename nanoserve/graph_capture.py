"""graph_capture.py: capture and replay, whichever the device: the model's own forward for a
decode step, captured once per batch size and replayed (vLLM's CUDAGraphWrapper, in its FULL mode
for decode batches).

Why: a decode step of the eager model is hundreds of small calls from Python (~40 a layer). On a
GPU each launch costs ~26 µs of host time while the step's bytes need 0.07 ms (SmolLM2-135M on an
H200): the GPU waits on Python. On a CPU the same Python costs ~1 ms a step at batch 1. A replay
makes the calls with no Python between them. Two graph types, one protocol (new_pool, capture,
replay):
  - cuda/graphs.py's `CUDAGraph`: torch.cuda.CUDAGraph;
  - cpu/graphs.py's `CpuGraph`: the C kernel calls and torch ops the forward made, as a list.

How, as vLLM and nano-vllm do it:
  - the runner calls `capture` once, after the KV cache is allocated (a graph records the caches'
    addresses) and after the backend compiled every kernel it needs;
  - for each of `cudagraph_capture_sizes`, LARGEST FIRST, in ONE memory pool: a smaller graph's
    activations fit in the memory a larger one's left, so the pool holds about one graph's worth;
  - per size, on an all-padding step of that size in the runner's persistent inputs
    (step_inputs.py): the graph type's own capture (CUDA warms up first, then records);
  - what is captured is the MODEL's forward, module by module (forward hooks fire during the
    capture): nothing is rewritten, the graph is the code the lessons teach;
  - replay: the runner wrote the step into the same buffers, padded to the size; the graph writes
    every row's hidden state into its output, a tensor at a fixed address; the runner takes the
    real rows (logits_indices) and samples outside the graph.

Which steps replay, and why the others run eagerly (vLLM's PIECEWISE graphs, everything but
attention, need torch.compile to split the model at attention: not built here):
  - decode-only (one new token a request, no drafts), up to the largest size: replay;
  - prefill and mixed steps: eager. Attention's work follows the longest query and the tokens a
    request vary, so one graph per batch size cannot hold them;
  - speculative steps (1 + k tokens a request): eager, for the same reason (graphs of 1 + k tokens
    a request would do, as vLLM's uniform_decode_query_len; not built);
  - structured outputs: replay: the grammar bitmask masks the logits in the sampler, after it;
  - tensor parallel > 1: eager (the backends capture nothing): each layer's all-reduce is a
    collective that every rank would have to replay in lockstep (vLLM captures its own
    all-reduce, on registered buffers); not built;
  - `enforce_eager`: nothing is captured;
  - mixtures of experts: replay. Which expert a token goes to is data, but each backend's form of
    FusedMoE keeps it inside: one opaque call in a CPU record (cpu/graphs.py), sync-free ops of
    fixed shapes on a GPU (cuda/fused_moe_triton.py). Only the torch reference groups tokens on
    the host (nonzero), and the torch backend captures nothing.

    pytest -q tests/test_cuda_graphs.py tests/test_cpu_graphs.py
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor


class GraphWrapper:
    """Backend.forward where steps are captured: the step's graph replayed where one was captured
    for it, else `forward` itself (the module docstring says which steps and why). `forward`:
    (input_ids, positions, kv_caches, attn_metadata) -> hidden, the model's."""

    def __init__(self, forward, sizes: list[int], graph_type):
        self.forward, self.sizes, self.graph_type = forward, sorted(sizes), graph_type
        self.graphs: dict[int, tuple[object, Tensor]] = {}   # size -> (graph, its input_ids)
        self.kv_caches = None

    @torch.inference_mode()
    def capture(self, inputs, kv_caches) -> None:
        """Capture a graph per size on `inputs` (step_inputs.StepInputs) and `kv_caches`."""
        pool = self.graph_type.new_pool()
        for size in reversed(self.sizes):
            input_ids, positions, meta = inputs.padded_decode(size)
            graph = self.graph_type(pool)
            graph.capture(functools.partial(self.forward, input_ids, positions, kv_caches, meta))
            self.graphs[size] = graph, input_ids
        self.kv_caches = kv_caches

    def __call__(self, input_ids: Tensor, positions: Tensor, kv_caches, attn_metadata) -> Tensor:
        size = input_ids.shape[0]
        graph, captured_ids = self.graphs.get(size, (None, None))
        # A replay reads the captured addresses: only a decode step of a captured size, in the
        # persistent inputs and this KV cache (not, say, the memory profile's own).
        if (graph is None or attn_metadata.max_query_len != 1 or attn_metadata.num_reqs != size
                or kv_caches is not self.kv_caches
                or input_ids.data_ptr() != captured_ids.data_ptr()):
            return self.forward(input_ids, positions, kv_caches, attn_metadata)
        return graph.replay()
