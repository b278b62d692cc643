"""worker.py: one tensor-parallel rank in its own process: join the group, load the shard, step.

    MultiprocExecutor (executor.py, in the engine core process) starts one `run_worker` process
    per rank; each builds a `Worker`, whose ModelRunner (model_runner.py) holds that rank's shard
    of the weights and of the KV heads. Every step the executor sends the SchedulerOutput down a
    pipe to every rank; all ranks run it (the collectives meet inside the model); rank 0 sends
    back the sampled tokens.

A worker exits as soon as its parent does, even while it waits inside a collective, so no
worker outlives the engine core.

Run the tests:
    pytest -q tests/test_tensor_parallel.py
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import traceback
from dataclasses import dataclass, fields
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch

from nanoserve.config import Config
from nanoserve.distributed import TensorParallel, init_tensor_parallel
from nanoserve.model_loader import resolve_device
from nanoserve.model_runner import ModelRunner


@dataclass
class RunnerInfo:
    """What the engine core and its users read of a ModelRunner, sent once by rank 0: both
    executors (executor.py) hold these as attributes of the same names."""

    config: Config               # resolved (max_model_len, num_kv_blocks): fixed from here on
    model_path: Path
    hf_config: Any               # the checkpoint's transformers PretrainedConfig
    vocab_size: int
    dtype: torch.dtype
    device: torch.device
    gemm_paths: dict[str, str]   # each Linear's matmul path on this CPU

    @classmethod
    def of(cls, runner: ModelRunner) -> RunnerInfo:
        return cls(**{f.name: getattr(runner, f.name) for f in fields(cls)})


class Worker:
    """One rank: joins the group, picks its device, then loads its shard into a ModelRunner."""

    def __init__(self, config: Config, rank: int, init_method: str):
        size = config.tensor_parallel_size
        device = init_tensor_parallel(rank, size, init_method, resolve_device(config.device),
                                      len(config.data_parallel_ranks_here))
        tp = TensorParallel(rank, size, config.enable_expert_parallel)
        self.runner = ModelRunner(config, tp, device)


def _exit_with_parent() -> None:
    """Exit this process the moment its parent does (even while stuck in a collective)."""
    parent = multiprocessing.parent_process()

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def run_worker(config: Config, rank: int, init_method: str, conn) -> None:
    """A worker process's main loop: a SchedulerOutput in, a step; None in, stop."""
    _exit_with_parent()
    try:
        worker = Worker(config, rank, init_method)
        conn.send(("ready", RunnerInfo.of(worker.runner) if rank == 0 else None))
        while (scheduler_output := conn.recv()) is not None:
            result = worker.runner.execute_model(scheduler_output)
            if rank == 0:    # with this step's timings, which start again from zero, and
                timings = worker.runner.timings     # its expert load (--trace, expert_load.py)
                conn.send(("result", (*result, dict(timings), worker.runner.step_expert_load)))
                timings.update(dict.fromkeys(timings, 0.0))
    except EOFError:     # the engine core closed the pipe: nothing left to do
        pass
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
