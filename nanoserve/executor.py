"""executor.py: tensor parallel as processes: one `Worker` per rank, driven by the engine core.

    LLM(model, tensor_parallel_size=2)      # or: nanoserve serve --tensor-parallel-size 2

With `tensor_parallel_size` N > 1, `EngineCore` holds a `MultiprocExecutor` where it would hold
a ModelRunner; it has the same `execute_model(scheduler_output)`, `timings`, and the attributes
rank 0 reports once (worker.py's `RunnerInfo`: config, model_path, hf_config, vocab_size, ...).
`worker_pids()` names the worker processes (the server prints them). The layout:

    engine core process                       worker processes, one per rank (spawned)
    MultiprocExecutor --- pipe per rank --->  Worker: join the group (gloo on CPU, NCCL on
      send SchedulerOutput to every rank        CUDA, one GPU per rank) -> ModelRunner(shard)
      <--- (sampled, logprobs, failed)          all ranks run the step; rank 0 samples
           from rank 0

Every rank, rank 0 included, has its own process, and the engine core is no member of the
torch.distributed group. Why: a process waiting inside a collective cannot notice that a peer
died (gloo waits out its timeout, NCCL may wait forever). The engine core only waits on pipes
and on the workers' process sentinels at once (`multiprocessing.connection.wait`), so a dead or
failing worker is an error at once, never a hang. On a GPU it also keeps the engine core free of
a CUDA context. The cost: the SchedulerOutput is pickled once per rank per step.

No orphans: workers are daemonic (stopped when the engine core exits), `close()` (also run when
the executor is garbage-collected) stops them, and each worker exits as soon as its parent dies.

Run the tests:
    pytest -q tests/test_tensor_parallel.py
"""

from __future__ import annotations

import multiprocessing
import weakref
from multiprocessing.connection import wait

from nanoserve.config import Config
from nanoserve.distributed import free_port
from nanoserve.errors import WorkerError
from nanoserve.models.llama import shard_for_tp
from nanoserve.model_loader import resolve_model_path
from nanoserve.request import SchedulerOutput
from nanoserve.worker import RunnerInfo, run_worker

JOIN_TIMEOUT_S = 5.0


class MultiprocExecutor:
    """N worker processes behind ModelRunner's `execute_model` (see the module docstring)."""

    def __init__(self, config: Config):
        from transformers import AutoConfig
        # A size the model cannot be split into is a ValueError here, not N worker tracebacks.
        shard_for_tp(AutoConfig.from_pretrained(resolve_model_path(config.model)),
                     config.tensor_parallel_size)
        ctx = multiprocessing.get_context("spawn")   # no forked copies of threads or CUDA state
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.conns, self.procs, self.error = [], [], None
        for rank in range(config.tensor_parallel_size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=run_worker, args=(config, rank, init_method, theirs),
                               name=f"nanoserve-worker-{rank}", daemon=True)
            proc.start()
            theirs.close()     # only the child holds it now: its death closes the pipe
            self.conns.append(ours)
            self.procs.append(proc)
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns)
        try:
            info: RunnerInfo = self._receive(range(len(self.procs)))[0]
        except WorkerError:
            self.close()
            raise
        self.config, self.model_path, self.hf_config = info.config, info.model_path, info.hf_config
        self.vocab_size, self.dtype, self.device = info.vocab_size, info.dtype, info.device
        self.gemm_paths = info.gemm_paths
        self.timings = {"prepare": 0.0, "forward": 0.0, "sample": 0.0}   # rank 0's

    def worker_pids(self) -> list[int]:
        """Each rank's process id, rank order."""
        return [proc.pid for proc in self.procs]

    def execute_model(self, scheduler_output: SchedulerOutput):
        """Send the step to every rank; return rank 0's ({request id: token}, logprobs, failed)."""
        if self.error:
            raise WorkerError(f"tensor-parallel workers are down: {self.error}")
        try:
            for rank, conn in enumerate(self.conns):
                try:
                    conn.send(scheduler_output)
                except OSError:       # its end of the pipe is gone: so is it
                    raise self._died(rank) from None
            sampled, logprobs, failed, timings = self._receive([0])[0]
        except WorkerError as e:
            self.error = str(e)
            self.close()
            raise WorkerError(self.error) from None
        for name, seconds in timings.items():
            self.timings[name] += seconds
        return sampled, logprobs, failed

    def _receive(self, ranks) -> dict:
        """{rank: its next message} for `ranks`; WorkerError as soon as any rank reports an
        error, dies, or closes its pipe (waiting on pipes and process sentinels together)."""
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        got: dict = {}
        while len(got) < len(ranks):
            ready = wait([*self.conns, *sentinels])
            for r, conn in enumerate(self.conns):
                if conn not in ready:
                    continue
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):    # it died: its exit code says how
                    raise self._died(r) from None
                if kind == "error":
                    raise WorkerError(f"tensor-parallel worker rank {r} failed: {payload}")
                got[r] = payload
            for s in (s for s in sentinels if s in ready):
                raise self._died(sentinels[s])
        return got

    def _died(self, rank: int) -> WorkerError:
        proc = self.procs[rank]
        proc.join(JOIN_TIMEOUT_S)      # reap it, for its exit code
        return WorkerError(f"tensor-parallel worker rank {rank} (pid {proc.pid}) died with "
                           f"exit code {proc.exitcode}")

    def close(self) -> None:
        """Stop every worker (also run when the executor is garbage-collected)."""
        self._finalizer()


def _stop(procs, conns) -> None:
    """Ask each worker to stop, then terminate, then kill whoever is still there."""
    for conn in conns:
        try:
            conn.send(None)
        except OSError:      # that worker is gone already
            pass
    for proc in procs:
        proc.join(JOIN_TIMEOUT_S)
        if proc.is_alive():
            proc.terminate()
            proc.join(JOIN_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()
