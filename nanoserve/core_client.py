"""core_client.py: how the server's AsyncLLM reaches its engine core, in either process layout.

    API server process (AsyncLLM)                 engine core process
    MPClient.send ---- ZMQ PUSH, pickles ---->    run_engine_core_process:
      ("add", [Request]) / ("abort", ids)           run_busy_loop(EngineCore): drain, step
    MPClient.get_output <---- ZMQ PULL -------      one EngineCoreOutputs per step

`MPClient` (the default, vLLM V1's layout) starts the engine core in a process of its own, so
that HTTP, tokenization and detokenization (Python CPU work) never stall the step loop. It is
started with "spawn" (a fork of a process running torch's threads may deadlock), which
re-imports the main module: a script that makes an AsyncLLM needs `if __name__ == "__main__":`.
`InprocClient` (`--no-engine-process`) runs the same loop in a thread of this process, for
lessons and debugging (one process to step through). Both offer the same four calls: `send`,
`get_output`, `shutdown` and, once started, what the front end must know (the resolved
config, vocab_size, model_path, the first stats, the processes and their pids).

Supervision: the engine core process watches a pipe from the API server and exits when it
reads EOF, so it never outlives its parent, even one killed with SIGKILL; it ignores SIGINT
(Ctrl-C reaches the whole process group: the API server stops it). The API server watches
the child's sentinel: a dead engine core is reported at once (`dead`), never waited on.

Run the tests: `pytest tests/test_api.py -k "engine_core or outlives"`.
"""

from __future__ import annotations

import asyncio
import atexit
import multiprocessing
import os
import pickle
import queue
import signal
import tempfile
import threading
from typing import Optional

import zmq
import zmq.asyncio

from nanoserve.config import Config
from nanoserve.engine_core import EngineCore, Inputs, run_busy_loop
from nanoserve.errors import EngineDeadError
from nanoserve.request import EngineCoreOutputs

STOP_TIMEOUT_S = 5       # how long shutdown waits for the engine core before terminating it


class InprocClient:
    """The busy loop in a daemon thread of this process: inputs through a queue, outputs handed
    to the event loop."""

    def __init__(self, config: Config):
        self.core = EngineCore(config)
        self.config, self.vocab_size, self.model_path = (self.core.config, self.core.vocab_size,
                                                         self.core.model_path)
        self.stats = self.core.get_stats()
        self.processes = [("api server + engine core thread", os.getpid())]
        self._inputs: queue.SimpleQueue = queue.SimpleQueue()
        self._outputs: Optional[asyncio.Queue] = None
        self._thread: Optional[threading.Thread] = None

    def send(self, kind: str, payload) -> None:
        self._inputs.put((kind, payload))

    async def get_output(self) -> EngineCoreOutputs:
        if self._thread is None:           # started here: the loop's outputs need the event loop
            loop, self._outputs = asyncio.get_running_loop(), asyncio.Queue()
            put = lambda message: loop.call_soon_threadsafe(self._outputs.put_nowait, message)
            self._thread = threading.Thread(target=run_busy_loop, name="nanoserve-engine-core",
                                            args=(self.core, self._get_inputs, put), daemon=True)
            self._thread.start()
        return await self._outputs.get()

    def _get_inputs(self, block: bool) -> Inputs:
        items = [self._inputs.get()] if block else []
        while not self._inputs.empty():
            items.append(self._inputs.get_nowait())
        return items

    def shutdown(self) -> None:
        if self._thread is None:
            self.core.tracer.close()
            return
        self.send("shutdown", None)
        self._thread.join(STOP_TIMEOUT_S)


class MPClient:
    """The engine core in a child process; requests in and outputs out over two ZMQ sockets."""

    def __init__(self, config: Config):
        self._dir = tempfile.TemporaryDirectory(prefix="nanoserve-")
        addresses = [f"ipc://{self._dir.name}/{name}" for name in ("input", "output")]
        self._zmq = zmq.Context()
        self._input, self._output = self._zmq.socket(zmq.PUSH), self._zmq.socket(zmq.PULL)
        for sock, address in zip((self._input, self._output), addresses):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)   # never drop or block: the queue is the backlog
            sock.bind(address)
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        # Not daemonic: with tensor parallel it starts the worker processes itself, which a
        # daemonic process may not. The parent pipe (below) and atexit stop it instead.
        self.process = context.Process(target=run_engine_core_process, name="nanoserve-engine-core",
                                       args=(config, *addresses, child_conn))
        self.process.start()
        atexit.register(self.shutdown)
        child_conn.close()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._exited: Optional[asyncio.Future] = None
        try:
            while not self._conn.poll(0.1):    # it loads the model: wait, but not for a dead child
                if not self.process.is_alive():
                    raise EOFError
            kind, payload = self._conn.recv()
        except EOFError:
            self.shutdown()
            raise EngineDeadError(f"the engine core process exited while starting (exit code "
                                  f"{self.process.exitcode})") from None
        if kind == "error":
            self.shutdown()
            raise payload
        self.config, self.vocab_size, self.model_path, self.stats, workers = payload
        self.processes = [("api server", os.getpid()), ("engine core", self.process.pid)] + [
            (f"worker rank {rank}", pid) for rank, pid in enumerate(workers)]

    def send(self, kind: str, payload) -> None:
        try:
            self._input.send(pickle.dumps((kind, payload), pickle.HIGHEST_PROTOCOL), zmq.NOBLOCK)
        except zmq.Again:    # no engine core connected: it died, and get_output says so
            pass

    async def get_output(self) -> EngineCoreOutputs:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._exited = self._loop.create_future()
            self._loop.add_reader(self.process.sentinel, self._on_exit)
            self._output = zmq.asyncio.Socket.from_socket(self._output)
        recv = asyncio.ensure_future(self._output.recv())
        await asyncio.wait((recv, self._exited), return_when=asyncio.FIRST_COMPLETED)
        if not recv.done():                # it exited; its last message (why) may be on the way
            await asyncio.wait((recv,), timeout=1.0)
        if recv.done():
            return pickle.loads(recv.result())
        recv.cancel()
        return EngineCoreOutputs(dead=True, error=f"the engine core process (pid "
                                 f"{self.process.pid}) died, exit code {self.process.exitcode}")

    def _on_exit(self) -> None:
        self._loop.remove_reader(self.process.sentinel)
        if not self._exited.done():
            self._exited.set_result(None)

    def shutdown(self) -> None:
        """Ask the engine core to stop; terminate, then kill it if it does not."""
        atexit.unregister(self.shutdown)
        if self._dir is None:               # already shut down
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.process.sentinel)
        if self.process.is_alive():
            self.send("shutdown", None)
            self.process.join(STOP_TIMEOUT_S)
        for stop in (self.process.terminate, self.process.kill):
            if self.process.is_alive():
                stop()
                self.process.join(STOP_TIMEOUT_S)
        self._zmq.destroy(linger=0)
        self._dir.cleanup()
        self._dir = None


def run_engine_core_process(config: Config, input_address: str, output_address: str,
                            conn) -> None:
    """The engine core process: build the core, say "ready" (or why not) on the pipe, then run
    the busy loop until told to stop or the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        core = EngineCore(config)
    except Exception as e:                 # e.g. a bad model path: the API server raises it
        conn.send(("error", e))
        return
    context = zmq.Context()
    inputs, outputs = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.SNDHWM, 0)
    inputs.connect(input_address)
    outputs.connect(output_address)
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    poller.register(conn.fileno(), zmq.POLLIN)
    conn.send(("ready", (core.config, core.vocab_size, core.model_path, core.get_stats(),
                         core.worker_pids())))

    def get_inputs(block: bool) -> Inputs:
        items: Inputs = []
        while True:                        # idle: wait in 1 s slices; busy: take what is there
            ready = dict(poller.poll(1000 if block and not items else 0))
            if conn.fileno() in ready:     # EOF: the API server is gone, do not outlive it
                return [("shutdown", None)]
            if inputs in ready:
                items.append(pickle.loads(inputs.recv()))
            elif items or not block:
                return items

    try:
        run_busy_loop(core, get_inputs, lambda message: outputs.send(
            pickle.dumps(message, pickle.HIGHEST_PROTOCOL)))
    finally:
        context.destroy(linger=1000)       # let the last message (e.g. why it died) go out
