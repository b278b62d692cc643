"""graphs.py: the CUDA graph type of graph_capture.py: torch.cuda.CUDAGraph, one per captured
decode batch size, all in one memory pool; graph_capture.GraphWrapper says which steps replay.

Why on a GPU: a decode step of the eager model launches ~40 kernels a layer from Python (~1,200
for SmolLM2-135M's 30 layers), each ~26 µs of host time on the H200's machine, while the GPU needs
0.07 ms for the whole step's bytes: it waits on the launches. A replay launches them all at once.

Each capture is preceded by one eager warm-up run of the same step (lazy initialisations: cuBLAS
workspaces, allocator blocks), and every Triton variant was compiled by bind before (nothing may
compile inside a capture). This file imports no Triton and needs no GPU to import.

    python scripts/gpu_smoke.py graphs          # on a GPU; the bookkeeping: tests/test_cuda_graphs.py
"""

from __future__ import annotations

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
        """A warm-up run of forward(), then forward() recorded; its output is the tensor every
        replay rewrites. (torch.cuda.graph synchronizes and captures on a side stream of its own.)"""
        forward()
        with torch.cuda.graph(self.graph, pool=self.pool):
            self.output = forward()
        return self.output

    def replay(self) -> Tensor:
        self.graph.replay()
        return self.output
