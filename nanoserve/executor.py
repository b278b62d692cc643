"""executor.py: how the engine core runs the model (vLLM's executors): `UniProcExecutor`, the
ModelRunner in this process (one device), or `MultiprocExecutor`, one `Worker` process per
tensor-parallel rank. Both have the calls of `EngineCore`'s one code path: `execute_model`,
`timings`, `expert_load` (the last step's, traced), `worker_pids()` (the server prints them), the
runner's `RunnerInfo` as attributes.
With `tensor_parallel_size` N > 1 (`LLM(model, tensor_parallel_size=2)`, or `nanoserve serve
--tensor-parallel-size 2`) the layout is:

    engine core process                       worker processes, one per rank (spawned)
    MultiprocExecutor --- pipe per rank --->  Worker: join the group (gloo on CPU, NCCL on
      send SchedulerOutput to every rank        CUDA, one GPU per rank) -> ModelRunner(shard)
      <--- (sampled, logprobs, failed)          all ranks run the step; rank 0 samples
           from rank 0

Every rank, rank 0 included, has its own process, and the engine core is no member of the
torch.distributed group. Why: a process waiting inside a collective cannot notice that a peer
died (gloo waits out its timeout, NCCL may wait forever). The engine core only waits on pipes
and on the workers' process sentinels at once (`multiprocessing.connection.wait`), so a dead or
failing worker is an error at once, never a hang; and a step with no answer within
`engine_iteration_timeout_s` (a worker hung, or stopped) is an error too. A thread sends the
steps, so that a worker that stops reading fills its pipe and blocks that thread, not the
engine core. On a GPU it also keeps the engine core free of a CUDA context. The cost: the
SchedulerOutput is pickled once per rank per step.

The group meets through a file in a private directory (mode 0700, removed at `close()`), not a
TCP port: torch's TCPStore listens on every interface whatever address the init method names
(distributed.py keeps the group's other sockets on loopback).

Data parallel + expert parallel is the one layout where engine cores ARE members of a group: the
N cores' own (`join_data_parallel_experts`; TP is 1, so each core's model is in its process).
There a dead peer is noticed by the API server (its sentinel, or silence past
engine_iteration_timeout_s), which fails every stream; a survivor waiting in a collective fails
when gloo sees the peer's connection close, or at the group's timeout (that same
engine_iteration_timeout_s), and shutdown terminates it after STOP_TIMEOUT_S in any case.

No orphans: workers are daemonic (stopped when the engine core exits), `close()` (also run when
the executor is garbage-collected) stops them, and each worker exits as soon as its parent dies.

Run the tests:
    pytest -q tests/test_tensor_parallel.py
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import queue
import shutil
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import wait
from pathlib import Path
from typing import Optional

from nanoserve.config import Config
from nanoserve.distributed import SINGLE, TensorParallel, init_data_parallel_experts
from nanoserve.errors import WorkerError
from nanoserve.models import get_moe_shape, verify_with_parallel_config
from nanoserve.model_loader import resolve_device, resolve_model_path
from nanoserve.model_runner import ModelRunner
from nanoserve.request import SchedulerOutput
from nanoserve.worker import RunnerInfo, run_worker

JOIN_TIMEOUT_S = 5.0


class UniProcExecutor:
    """One device: the ModelRunner (`model_runner`) in the engine core's own process; under DP+EP
    (`tp` from join_data_parallel_experts) its model holds this data-parallel rank's experts."""

    def __init__(self, config: Config, tp: TensorParallel = SINGLE):
        self.model_runner = ModelRunner(config, tp)
        vars(self).update(vars(RunnerInfo.of(self.model_runner)))   # config, vocab_size, ...
        self.timings = self.model_runner.timings

    def execute_model(self, scheduler_output: SchedulerOutput):
        return self.model_runner.execute_model(scheduler_output)

    def execute_dummy_batch(self) -> None:
        self.model_runner.execute_dummy_batch()

    @property
    def expert_load(self) -> Optional[list[list[int]]]:
        """The last step's [MoE layer][expert] token counts under --trace (expert_load.py)."""
        return self.model_runner.step_expert_load

    def worker_pids(self) -> list[int]:
        return []       # no worker process: the model runs in this one


def join_data_parallel_experts(config: Config, data_parallel_rank: int,
                               store_file: str) -> tuple[Config, TensorParallel]:
    """DP+EP (`data_parallel_size` N with `enable_expert_parallel`; TP 1, every rank on this host,
    as Config checks): for a mixture of experts, join the N engine cores' group (distributed.py)
    and return (the config to run with, the TensorParallel naming this rank's experts). Else
    (config, SINGLE): plain data parallel, also for a dense model under DP+EP, since expert
    parallel applies to MoE layers only (as in vLLM). The group is gloo: CPU engine cores only,
    in this version."""
    from transformers import AutoConfig
    if not (config.enable_expert_parallel and config.data_parallel_size > 1):
        return config, SINGLE
    hf_config = AutoConfig.from_pretrained(resolve_model_path(config.model))
    if not get_moe_shape(hf_config):     # a dense model: plain DP
        return config, SINGLE
    # N must divide the experts: a ValueError now, before this rank waits for the others
    verify_with_parallel_config(hf_config, 1, True, config.data_parallel_size)
    if resolve_device(config.device) != "cpu":
        raise ValueError("device: data parallel + expert parallel runs on CPU engine cores (a gloo "
                         "group) in this version; on GPUs use --tensor-parallel-size with it")
    tp = init_data_parallel_experts(data_parallel_rank, config.data_parallel_size, store_file,
                                    config.engine_iteration_timeout_s)
    # Eager: a captured step (cpu/graphs.py) replays fixed shapes and no collective, but the
    # exchange's shapes follow the other ranks' tokens, and every rank's capture would be a round
    # of collectives of its own. (vLLM pads every rank to the same size to keep its graphs.)
    return dataclasses.replace(config, enforce_eager=True), tp


class MultiprocExecutor:
    """N worker processes behind ModelRunner's `execute_model` (see the module docstring)."""

    def __init__(self, config: Config):
        from transformers import AutoConfig
        # A size the model cannot be split into is a ValueError here, not N worker tracebacks.
        verify_with_parallel_config(AutoConfig.from_pretrained(resolve_model_path(config.model)),
                                    config.tensor_parallel_size, config.enable_expert_parallel)
        ctx = multiprocessing.get_context("spawn")   # no forked copies of threads or CUDA state
        # The rendezvous: a FileStore that only this user can reach (mkdtemp: mode 0700).
        self.rendezvous_dir = tempfile.mkdtemp(prefix="nanoserve-tp-")
        init_method = (Path(self.rendezvous_dir) / "store").as_uri()
        self.conns, self.procs, self.error = [], [], None
        self.timeout_s = config.engine_iteration_timeout_s
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()    # steps for the sender thread
        self._finalizer = weakref.finalize(self, _stop, self.procs, self._outbox,
                                           self.rendezvous_dir)
        for rank in range(config.tensor_parallel_size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=run_worker, args=(config, rank, init_method, theirs),
                               name=f"nanoserve-worker-{rank}", daemon=True)
            proc.start()
            theirs.close()     # only the child holds it now: its death closes the pipe
            self.conns.append(ours)
            self.procs.append(proc)
        # One thread sends the steps: a worker that stops reading (hung, stopped) may block it
        # on a full pipe, never the engine core, which waits for the answer under the watchdog.
        threading.Thread(target=_send_steps, args=(self._outbox, self.conns, self.procs),
                         name="nanoserve-tp-sender", daemon=True).start()
        try:
            info: RunnerInfo = self._receive(range(len(self.procs)))[0]
        except WorkerError:
            self.close()
            raise
        vars(self).update(vars(info))      # config, model_path, hf_config, vocab_size, ...
        self.timings = {"prepare": 0.0, "forward": 0.0, "sample": 0.0}   # rank 0's
        self.expert_load: Optional[list[list[int]]] = None    # rank 0's, of the last step

    def worker_pids(self) -> list[int]:
        """Each rank's process id, rank order."""
        return [proc.pid for proc in self.procs]

    def execute_model(self, scheduler_output: SchedulerOutput):
        """Send the step to every rank; return rank 0's ({request id: [tokens]}, logprobs, failed)."""
        if self.error:
            raise WorkerError(f"tensor-parallel workers are down: {self.error}")
        self._outbox.put(scheduler_output)
        try:
            sampled, logprobs, failed, timings, self.expert_load = self._receive([0], self.timeout_s)[0]
        except WorkerError as e:
            self.error = str(e)
            for proc in self.procs:    # mid-step: a rank may wait in a collective, or be stopped
                proc.kill()
            self.close()
            raise WorkerError(self.error) from None
        for name, seconds in timings.items():
            self.timings[name] += seconds
        return sampled, logprobs, failed

    def _receive(self, ranks, timeout_s: Optional[float] = None) -> dict:
        """{rank: its next message} for `ranks`; WorkerError as soon as any rank reports an
        error, dies, or closes its pipe (waiting on pipes and process sentinels together), or
        when `timeout_s` passes first. The step watchdog, as vLLM's MultiprocExecutor gives
        execute_model VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS: a rank hung or stopped mid-step (the
        others then wait for it inside a collective) must not hold the engine core forever.
        Loading the model (the "ready" message) has no timeout: it may take minutes."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        got: dict = {}
        while len(got) < len(ranks):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait([*self.conns, *sentinels], left)
            if not ready:     # (only with a timeout)
                raise WorkerError(f"tensor-parallel workers sent no result for {timeout_s:g} s "
                                  f"(engine_iteration_timeout_s): a worker is hung or stopped")
            # A rank that died first (its peers' errors are about it), after its last words.
            dead_first = sorted(range(len(self.procs)),
                                key=lambda r: self.procs[r].sentinel not in ready)
            for r in dead_first:
                if self.conns[r] in ready:
                    got[r] = self._message(r)
                if self.procs[r].sentinel in ready:
                    raise self._died(r)
        return got

    def _message(self, rank: int):
        """Rank's next message; WorkerError if it is an error, or if the pipe is closed."""
        try:
            kind, payload = self.conns[rank].recv()
        except (EOFError, OSError):    # it died: its exit code says how
            raise self._died(rank) from None
        if kind == "error":
            raise WorkerError(f"tensor-parallel worker rank {rank} failed: {payload}")
        return payload

    def _died(self, rank: int) -> WorkerError:
        proc = self.procs[rank]
        proc.join(JOIN_TIMEOUT_S)      # reap it, for its exit code
        return WorkerError(f"tensor-parallel worker rank {rank} (pid {proc.pid}) died with "
                           f"exit code {proc.exitcode}")

    def close(self) -> None:
        """Stop every worker (also run when the executor is garbage-collected)."""
        self._finalizer()


def _send_steps(outbox: queue.SimpleQueue, conns, procs) -> None:
    """The sender thread: each SchedulerOutput to every rank, in order, until None (which the
    workers get too: stop); then it closes the pipes. A step it cannot send (a bug: it does not
    pickle) is logged and ends the workers, so the engine core hears of it at once (their
    sentinels), not after the watchdog's timeout."""
    while True:
        message = outbox.get()
        for conn in conns:
            try:
                conn.send(message)
            except OSError:                       # a worker gone: its sentinel says so
                pass
            except Exception:
                logging.getLogger("nanoserve").exception("a step could not be sent to the "
                                                         "tensor-parallel workers")
                for proc in procs:
                    proc.kill()
                return
        if message is None:
            for conn in conns:
                conn.close()
            return


def _stop(procs, outbox: queue.SimpleQueue, rendezvous_dir: str) -> None:
    """Ask each worker to stop, then terminate, then kill whoever is still there; remove the
    rendezvous directory."""
    outbox.put(None)
    for proc in procs:
        proc.join(JOIN_TIMEOUT_S)
        if proc.is_alive():
            proc.terminate()
            proc.join(JOIN_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
    shutil.rmtree(rendezvous_dir, ignore_errors=True)
