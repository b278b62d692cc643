"""graphs.py: CUDA graphs for decode-only steps: the model's own forward, captured once per batch
size and replayed as one launch (vLLM's CUDAGraphWrapper, in its FULL mode for decode batches).

Why: a decode step of the eager model launches ~40 kernels a layer from Python (~1,200 for
SmolLM2-135M's 30 layers), each ~26 µs of host time on the H200's machine, while the GPU needs
0.07 ms for the whole step's bytes: it waits on the launches. A replay launches them all at once.

How, as vLLM and nano-vllm do it (torch.cuda.CUDAGraph):
  - the runner calls `capture` once, after the KV cache is allocated (a graph records the caches'
    addresses) and after bind compiled every Triton variant (compile_kernels: nothing may compile
    inside a capture);
  - for each of `cudagraph_capture_sizes`, LARGEST FIRST, in ONE memory pool: a smaller graph's
    activations fit in the memory a larger one's left, so the pool holds about one graph's worth;
  - per size: one eager warm-up run (lazy initialisations: cuBLAS workspaces, allocator blocks),
    then the capture, both on an all-padding step of that size in the runner's persistent inputs
    (step_inputs.py);
  - what is captured is the MODEL's forward, module by module (forward hooks fire during the
    capture): nothing is rewritten, the graph is the code the lessons teach;
  - replay: the runner wrote the step into the same buffers, padded to the size; the graph writes
    every row's hidden state into its output, a tensor at a fixed address; the runner takes the
    real rows (logits_indices) and samples outside the graph.

Which steps replay, and why the others run eagerly (vLLM's FULL graphs cover uniform decode
batches too; its PIECEWISE graphs, everything but attention, need torch.compile to split the
model at attention: not built here):
  - decode-only (one new token a request, no drafts), up to the largest size: replay;
  - prefill and mixed steps: eager. Attention's launch grid follows the longest query (its tiles of
    BLOCK_Q tokens) and the tokens a request vary, so one graph per batch size cannot hold them;
  - speculative steps (1 + k tokens a request): eager, for the same reason (graphs of 1 + k tokens
    a request would do, as vLLM's uniform_decode_query_len; not built);
  - structured outputs: replay: the grammar bitmask masks the logits in the sampler, after it;
  - tensor parallel > 1: eager (bind captures nothing): each layer's all-reduce is a collective
    that every rank would have to replay in lockstep (vLLM captures its own all-reduce, on
    registered buffers); not built;
  - `enforce_eager`: nothing is captured.

The graph object is a parameter (`graph_type`), so that everything else (sizes, buffers, padding,
which step replays) runs on CPU in the tests with a stand-in that runs the forward. This file
imports no Triton and needs no GPU to import.

    pytest -q tests/test_cuda_graphs.py          # on CPU; scripts/gpu_smoke.py graphs on a GPU
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor


class CUDAGraph:
    """One captured forward (torch.cuda.CUDAGraph) in a pool shared with the other sizes."""

    def __init__(self, pool):
        self.graph, self.pool, self.output = torch.cuda.CUDAGraph(), pool, None

    @staticmethod
    def new_pool():
        return torch.cuda.graph_pool_handle()

    def capture(self, forward) -> Tensor:
        """Record forward(); its output is the tensor every replay rewrites. (torch.cuda.graph
        synchronizes and captures on a side stream of its own.)"""
        with torch.cuda.graph(self.graph, pool=self.pool):
            self.output = forward()
        return self.output

    def replay(self) -> Tensor:
        self.graph.replay()
        return self.output


class CUDAGraphWrapper:
    """Backend.forward on CUDA: the step's graph replayed where one was captured for it, else the
    model itself (the module docstring says which steps and why)."""

    def __init__(self, model, sizes: list[int], graph_type=CUDAGraph):
        self.model, self.sizes, self.graph_type = model, sorted(sizes), graph_type
        self.graphs: dict[int, tuple[object, Tensor]] = {}   # size -> (graph, its input_ids)
        self.kv_caches = None

    @torch.inference_mode()
    def capture(self, inputs, kv_caches) -> None:
        """Capture a graph per size on `inputs` (step_inputs.StepInputs) and `kv_caches`."""
        pool = self.graph_type.new_pool()
        for size in reversed(self.sizes):
            input_ids, positions, meta = inputs.padded_decode(size)
            forward = functools.partial(self.model, input_ids, positions, kv_caches, meta)
            forward()                              # the warm-up, outside the capture
            graph = self.graph_type(pool)
            graph.capture(forward)
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
            return self.model(input_ids, positions, kv_caches, attn_metadata)
        return graph.replay()
