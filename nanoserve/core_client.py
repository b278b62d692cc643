"""core_client.py: how the server's AsyncLLM reaches its engine cores, in either process layout.

    API server process (AsyncLLM)                   engine core process, one per data-parallel rank
    MPClient.send ---- ZMQ ROUTER, signed msgpack -> run_engine_core_process (a DEALER named by rank):
      AddRequests to the least loaded rank            run_busy_loop(EngineCore): drain, step
      AbortRequests to the rank that holds them
    MPClient.get_output <----------------------     one Outputs per step (a Ping when idle)

`MPClient` (the default, vLLM V1's layout) starts each engine core in a process of its own, so
that HTTP, tokenization and detokenization (Python CPU work) never stall the step loop. They are
started with "spawn" (a fork of a process running torch's threads may deadlock), which
re-imports the main module: a script that makes an AsyncLLM needs `if __name__ == "__main__":`.
`InprocClient` (`--no-engine-process`) runs the same loop in a thread of this process (lessons,
debugging). Both offer `send`, `get_output`, `shutdown` and what the front end must know (the
resolved config, vocab_size, model_path, each engine's first stats, the processes' pids).

Data parallel (`data_parallel_size` N): N engine cores behind one ROUTER socket. A new request
goes to the rank with the fewest unfinished requests, a waiting one counting WAITING_WEIGHT
running ones (vLLM's rule; ties to the lowest rank); an n > 1 request's children go together
(they share its prefix cache) and its aborts follow. Ranks past `data_parallel_size_local` run on
other hosts (`nanoserve serve --headless`, `run_headless`), over TCP to the same socket. The
wire (serial_utils.py): typed msgpack, never pickle, every frame signed with the rpc secret; a
frame that fails a check is dropped and logged, never reaching the busy loop or the front end.

Supervision: an engine core exits when its parent's pipe reaches EOF, or when its connection to
the API server drops (another host), so it never outlives them, even after SIGKILL; it ignores
SIGINT (Ctrl-C reaches the whole process group: its parent stops it). It pings after HEARTBEAT_S
without a message; a rank silent for `engine_iteration_timeout_s` (a step that long, a hang,
SIGSTOP, a lost host) is dead, and so is a local one whose process exited (its sentinel; it is
reaped). A dead rank is reported within a second (`dead`, naming the rank): the front end fails
every open stream, and answers 503 from then on.

Tests: tests/test_api.py -k "engine_core or outlives", test_data_parallel.py, test_security_wire.py
"""

from __future__ import annotations

import asyncio
import atexit
import multiprocessing
import os
import queue
import signal
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import wait
from typing import Optional

import zmq
import zmq.asyncio

from nanoserve.config import Config
from nanoserve.distributed import place_data_parallel_rank
from nanoserve.engine_core import EngineCore, Inputs, run_busy_loop
from nanoserve.errors import EngineDeadError
from nanoserve.request import EngineCoreOutputs
from nanoserve.serial_utils import (CoreCodec, Outputs, Ping, Ready, ServerCodec, StartupError,
                                    WireError, take_rpc_secret)

STOP_TIMEOUT_S = 5       # how long shutdown waits for an engine core before terminating it
HEARTBEAT_S = 1.0        # an engine core that has sent nothing for this long sends a ping
WAITING_WEIGHT = 4       # in load balancing, a waiting request weighs as much as 4 running ones
MAX_FRAME_BYTES = 64 << 20   # the largest frame the API server takes (the engine cores' are small)


class InprocClient:
    """The busy loop in a daemon thread: inputs through a queue, outputs to the event loop."""

    def __init__(self, config: Config):
        self.core = EngineCore(take_rpc_secret(config)[0])    # (no socket: no secret)
        self.config, self.vocab_size, self.model_path = (self.core.config, self.core.vocab_size,
                                                         self.core.model_path)
        self.stats = [self.core.get_stats()]
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

    def _get_inputs(self, wait_s: Optional[float]) -> Inputs:
        items = [] if wait_s == 0 else [self._inputs.get()]    # (no DP here: 0 or None)
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
    """The engine cores in child processes (or on --headless hosts), one ROUTER socket to all."""

    def __init__(self, config: Config):
        config, secret = take_rpc_secret(config)        # ValueError first: remote ranks need one
        self.num_engines, ranks_here = config.data_parallel_size, config.data_parallel_ranks_here
        self._codec = ServerCodec(secret, self.num_engines)
        self._dir = tempfile.TemporaryDirectory(prefix="nanoserve-")
        self._zmq = zmq.Context()
        self._socket = self._zmq.socket(zmq.ROUTER)     # sends to, and hears from, each by rank
        # Never drop or block (queues are the backlog); a peer's frame is checked once it is in.
        for option, value in ((zmq.LINGER, 0), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0),
                              (zmq.MAXMSGSIZE, MAX_FRAME_BYTES)):
            self._socket.setsockopt(option, value)
        address = f"ipc://{self._dir.name}/engine-cores"
        self._socket.bind(address)
        if len(ranks_here) < self.num_engines:          # the others connect from --headless hosts
            remote = f"tcp://{config.data_parallel_address}:{config.data_parallel_rpc_port}"
            self._socket.bind(remote)
            print(f"nanoserve serve: waiting for the engine cores of data-parallel ranks "
                  f"{len(ranks_here)}..{self.num_engines - 1} at {remote}", file=sys.stderr)
        self._procs = start_engine_cores(config, address, secret, f"{self._dir.name}/expert-group")
        atexit.register(self.shutdown)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._exited: Optional[asyncio.Future] = None    # a local engine core's rank, once dead
        self._recv: Optional[asyncio.Future] = None
        self._dead_since: Optional[float] = None         # when a rank was first seen dead
        try:
            ready = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.config, self.vocab_size, self.model_path = (ready[0].config, ready[0].vocab_size,
                                                         ready[0].model_path)
        self.stats = [r.stats for r in ready]
        self.processes = [("api server", os.getpid())]
        for rank, r in enumerate(ready):
            where = "" if rank in self._procs else " (--headless host)"
            self.processes += [(f"engine core {rank}{where}", r.pid)] + [
                (f"engine core {rank} worker rank {w}{where}", p) for w, p in enumerate(r.worker_pids)]
        self._rank_of: dict[str, int] = {}                # unfinished request id -> its rank
        self._unfinished, self._running = [0] * self.num_engines, [0] * self.num_engines

    def _wait_ready(self) -> list[Ready]:
        """Each rank's "ready" report, rank order (they load the model: wait, but not for a dead
        child); raises the error of one that failed to start."""
        ready = self._codec.ready
        while len(ready) < self.num_engines:
            if self._socket.poll(100):
                _, message = self._codec.decode(self._socket.recv_multipart(),
                                                self._socket.send_multipart)
                if isinstance(message, StartupError):
                    raise message.error.to_exception()
                continue
            for rank, (proc, _) in self._procs.items():
                if rank not in ready and not proc.is_alive() and not self._socket.poll(1000):
                    raise EngineDeadError(f"the engine core process of data-parallel rank {rank} "
                                          f"exited while starting (exit code {proc.exitcode})")
        seen = {rank: (r.config.max_model_len, r.vocab_size, r.device)   # each must serve alike
                for rank, r in sorted(ready.items())}
        if len(set(seen.values())) > 1:
            raise ValueError(f"the data-parallel ranks differ in (max_model_len, vocab_size, "
                             f"device): {seen}; give every host the same model flags")
        return [ready[rank] for rank in range(self.num_engines)]

    def send(self, kind: str, payload) -> None:
        if kind == "add":    # one request's children (n > 1) all go to one rank
            rank = min(range(self.num_engines), key=lambda r: (self._load(r), r))
            self._rank_of.update((request.request_id, rank) for request in payload)
            self._unfinished[rank] += len(payload)
            self._send(rank, kind, payload)
            return
        by_rank: dict[int, list] = {}
        for request_id in payload:           # an abort goes where its request is (if unfinished)
            if (rank := self._rank_of.get(request_id)) is not None:
                by_rank.setdefault(rank, []).append(request_id)
        for rank, ids in by_rank.items():
            self._send(rank, kind, ids)

    def _load(self, rank: int) -> int:
        """Unfinished requests of `rank`, those not running (waiting) counted WAITING_WEIGHT times."""
        running = min(self._running[rank], self._unfinished[rank])
        return WAITING_WEIGHT * (self._unfinished[rank] - running) + running

    def _send(self, rank: int, kind: str, payload) -> None:
        # A rank that is gone drops it silently (ROUTER); get_output says it died.
        self._socket.send_multipart(self._codec.encode(rank, kind, payload))

    async def get_output(self) -> EngineCoreOutputs:
        if self._loop is None:
            self._watch()
        while True:
            if self._recv is None:
                self._recv = asyncio.ensure_future(self._socket.recv_multipart())
            dead = self._dead_rank()
            if dead is not None and time.monotonic() > self._dead_since + 1.0:
                return EngineCoreOutputs(dead=True, error=self._why_dead(dead), engine_index=dead)
            # Once a rank is dead, its last message (why) has a second to come.
            await asyncio.wait((self._recv,) if dead is not None else (self._recv, self._exited),
                               timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            if self._recv.done():
                parts, self._recv = self._recv.result(), None
                rank, message = self._codec.decode(parts, self._socket.send_multipart)
                if message is not None:                  # signed by the rank: it is alive
                    self._last_heard[rank] = time.monotonic()
                if isinstance(message, Outputs):
                    return self._track(rank, message.to_outputs())

    def _watch(self) -> None:
        """Start watching each local engine core's sentinel (from the event loop's thread)."""
        self._loop = asyncio.get_running_loop()
        self._exited = self._loop.create_future()
        for rank, (proc, _) in self._procs.items():
            self._loop.add_reader(proc.sentinel, self._on_exit, rank)
        self._socket = zmq.asyncio.Socket.from_socket(self._socket)
        self._last_heard = [time.monotonic()] * self.num_engines   # pings queued until now

    def _on_exit(self, rank: int) -> None:
        proc = self._procs[rank][0]
        self._loop.remove_reader(proc.sentinel)
        proc.join()                                      # reaped: no zombie
        if not self._exited.done():
            self._exited.set_result(rank)

    def _track(self, rank: int, message: EngineCoreOutputs) -> EngineCoreOutputs:
        """Bookkeeping for balancing: what finished leaves its rank; the rank's running count."""
        message.engine_index = rank
        if message.dead:
            message.error = f"data-parallel rank {rank}: {message.error}"
        if message.stats:
            self._running[rank] = message.stats["num_requests_running"]
        done = [o.request_id for o in message.outputs if o.finish_reason is not None]
        for request_id in done + list(message.failed):
            if self._rank_of.pop(request_id, None) is not None:
                self._unfinished[rank] -= 1
        return message

    def _dead_rank(self) -> Optional[int]:
        """A local engine core that exited, or any rank silent past engine_iteration_timeout_s (a
        step that long, a hang, a stopped process, a lost host), or None."""
        now, timeout = time.monotonic(), self.config.engine_iteration_timeout_s
        silent = [r for r in range(self.num_engines) if now - self._last_heard[r] > timeout]
        rank = self._exited.result() if self._exited.done() else (silent or [None])[0]
        if rank is None:           # (heard again: a silence the event loop caused, not the rank)
            self._dead_since = None
        elif self._dead_since is None:
            self._dead_since = now
        return rank

    def _why_dead(self, rank: int) -> str:
        proc = self._procs[rank][0] if rank in self._procs else None
        who = (f"the engine core of data-parallel rank {rank} (on a --headless host)" if proc is None
               else f"the engine core process of data-parallel rank {rank} (pid {proc.pid})")
        if proc is not None and proc.exitcode is not None:
            return f"{who} died, exit code {proc.exitcode}"
        return (f"{who} sent nothing for {self.config.engine_iteration_timeout_s:g} s "
                f"(engine_iteration_timeout_s: a step that long, a hang, a stopped process)")

    def shutdown(self) -> None:
        """Stop the local engine cores; closing the socket stops the remote ones."""
        atexit.unregister(self.shutdown)
        if self._dir is None:               # already shut down
            return
        if self._loop is not None and not self._loop.is_closed():
            for proc, _ in self._procs.values():
                self._loop.remove_reader(proc.sentinel)
            if self._recv is not None:
                self._recv.cancel()
        stop_engine_cores(self._procs)
        self._zmq.destroy(linger=0)
        self._dir.cleanup()
        self._dir = None


def start_engine_cores(config: Config, address: str, secret: bytes,
                       expert_store: Optional[str] = None) -> dict[int, tuple]:
    """Spawn this host's engine cores (`config.data_parallel_ranks_here`), each connecting to
    `address`, signing with `secret`, under DP+EP meeting at `expert_store` (a file in the API
    server's private directory; executor.py): {rank: (process, our end of its lifeline pipe)}."""
    context, procs = multiprocessing.get_context("spawn"), {}
    for local_index, rank in enumerate(config.data_parallel_ranks_here):
        conn, child_conn = context.Pipe()
        # Not daemonic: with tensor parallel it starts the worker processes itself, which a
        # daemonic process may not. The pipe (EOF when we are gone) stops it instead.
        proc = context.Process(target=run_engine_core_process, name=f"nanoserve-engine-core-{rank}",
                               args=(config, address, rank, local_index, child_conn, secret, expert_store))
        proc.start()
        child_conn.close()
        procs[rank] = (proc, conn)
    return procs


def stop_engine_cores(procs: dict[int, tuple]) -> None:
    """Close each lifeline pipe (an engine core stops at its EOF); terminate, then kill, the rest."""
    for _, conn in procs.values():
        conn.close()
    for proc, _ in procs.values():
        proc.join(STOP_TIMEOUT_S)
        for stop in (proc.terminate, proc.kill):
            if proc.is_alive():
                stop()
                proc.join(STOP_TIMEOUT_S)


def run_headless(config: Config) -> None:
    """`nanoserve serve --headless`: this host's engine cores, for the API server at the rpc
    address, until one exits (that server stopped or died) or SIGTERM / Ctrl-C: then all."""
    config, secret = take_rpc_secret(config)        # ValueError when none is given
    address = f"tcp://{config.data_parallel_address}:{config.data_parallel_rpc_port}"
    procs = start_engine_cores(config, address, secret)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))    # exit through `finally`
    for rank, (proc, _) in procs.items():
        print(f"nanoserve serve --headless: engine core {rank}: pid {proc.pid}, for {address}",
              file=sys.stderr, flush=True)
    try:
        wait([proc.sentinel for proc, _ in procs.values()])
    finally:
        stop_engine_cores(procs)


class EngineCoreSocket:
    """The engine core's DEALER to the API server (named by its rank, signing with CoreCodec),
    and its two lifelines: the parent's pipe (EOF: gone) and the connection's drop."""

    def __init__(self, address: str, rank: int, conn, codec: CoreCodec, heartbeat: float):
        self.context = zmq.Context()
        self.sock = sock = self.context.socket(zmq.DEALER)
        # ZMTP heartbeats: an API server's host that vanishes without closing TCP drops too.
        for option, value in ((zmq.IDENTITY, str(rank).encode()), (zmq.SNDHWM, 0),
                              (zmq.HEARTBEAT_IVL, 1000), (zmq.HEARTBEAT_TIMEOUT, 10_000)):
            sock.setsockopt(option, value)
        self.dropped = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)   # the API server is gone
        sock.connect(address)
        self.poller = zmq.Poller()
        for source in (sock, self.dropped, conn.fileno()):
            self.poller.register(source, zmq.POLLIN)
        self.conn, self.codec, self.heartbeat, self.last_sent = conn, codec, heartbeat, 0.0
        sock.send(codec.hello())       # the API server's Welcome answers it (CoreCodec.welcomed)

    def send(self, message) -> None:
        self.sock.send(self.codec.encode(message))
        self.last_sent = time.monotonic()

    def receive(self, timeout_s: float) -> Optional[Inputs]:
        """What the API server sent (checked, decoded; [] if nothing); None once a parent is gone."""
        ready = dict(self.poller.poll(int(timeout_s * 1000)))
        if self.conn.fileno() in ready or self.dropped in ready:   # outlive neither parent
            return None
        item = self.codec.decode(self.sock.recv()) if self.sock in ready else None
        return [] if item is None else [item]

    def get_inputs(self, wait_s: Optional[float]) -> Inputs:
        """run_busy_loop's inputs: what is there, having waited up to `wait_s` (None: until
        something comes) for the first, in heartbeat slices."""
        items: Inputs = []
        end = time.monotonic() + (float("inf") if wait_s is None else wait_s)
        while True:
            if time.monotonic() - self.last_sent >= self.heartbeat:
                self.send(Ping())          # silence would mean a hung engine core
            new = self.receive(0 if items else min(self.heartbeat, max(0.0, end - time.monotonic())))
            if new is None:
                return [("shutdown", None)]
            items += new
            if not new and (items or time.monotonic() >= end):
                return items


def run_engine_core_process(config: Config, address: str, rank: int, local_index: int,
                            conn, secret: bytes, expert_store: Optional[str]) -> None:
    """The engine core process of data-parallel `rank`: Hello, build the core, the API server's
    Welcome, "ready" (or why not), then the busy loop until told to stop or a parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    link = EngineCoreSocket(address, rank, conn, CoreCodec(secret, rank),
                            min(HEARTBEAT_S, config.engine_iteration_timeout_s / 4))
    try:
        ranks_here = len(config.data_parallel_ranks_here)
        if ranks_here > 1:        # its share of this host's GPUs or cores
            place_data_parallel_rank(local_index, ranks_here, config.tensor_parallel_size)
        core, failure = EngineCore(config, rank, expert_store), None
    except Exception as e:        # e.g. a bad model path: the API server raises it (by name
        traceback.print_exc()     # and message), and this host's log has its traceback
        core, failure = None, e
    try:
        while not link.codec.welcomed:
            if link.receive(link.heartbeat) is None:
                return
        link.send(Ready.from_core(core) if failure is None
                  else StartupError(WireError.from_exception(failure)))
        if failure is None:
            run_busy_loop(core, link.get_inputs, lambda message: link.send(Outputs.from_outputs(message)))
    finally:
        link.context.destroy(linger=1000)   # let the last message (e.g. why it died) go out
