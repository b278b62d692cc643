"""serial_utils.py: what crosses seam 1's socket (API server <-> engine cores), and how it is framed.

Every message is a msgspec Struct, sent as msgpack and decoded against its type, as vLLM's
`vllm/v1/serial_utils.py` and `EngineCoreRequest` do: a frame is data, never code (a pickled
frame can run anything on its receiver: vLLM's CVE-2025-30165). Decoding rebuilds SamplingParams
and Config through their own validation, so a frame with wrong values is refused as one with
wrong bytes is.

    engine core -> API server    Hello, Ready | StartupError, then Outputs (one per step) and Ping
    API server -> engine core    Welcome, then AddRequests([EngineCoreRequest]), AbortRequests

Each frame is signed with the shared secret (`take_rpc_secret`), HMAC-SHA256:

    frame = mac (32 bytes) | counter (8 bytes) | msgpack body
    mac   = HMAC(secret, session | channel | counter | body)

`channel` names sender and receiver (b"api>1", b"1>api"): a frame cannot be reflected, nor sent
to another rank. `counter` grows with each frame, and a receiver drops one not above the last it
took on that channel: no replay within a session. `session` is a nonce from each end (the engine
core's Hello, the API server's Welcome; only the Hello is signed without one): no replay of a
frame from an earlier run. A frame that fails a check is dropped and logged (`decode` returns
None, never raises): what arrives on the port is untrusted until its MAC says otherwise.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import secrets
import time
from typing import Optional, Union

import msgspec

from nanoserve.config import Config
from nanoserve.errors import (EngineDeadError, EngineOverloadedError, EngineStepError,
                              RequestTimeoutError, WorkerError)
from nanoserve.request import EngineCoreOutput, EngineCoreOutputs, Request
from nanoserve.sampling_params import SamplingParams

RPC_SECRET_ENV = "NANOSERVE_RPC_SECRET"
MIN_SECRET_CHARS = 16       # shorter is guessable offline from one captured frame
MAC_BYTES, COUNTER_BYTES = 32, 8
NONCE_BYTES = 16
DROP_LOG_EVERY_S = 10.0     # at most one line per this long about dropped frames (a flood is one)
# The errors a failed request may carry across; any other becomes its nearest listed base class.
WIRE_ERRORS = {e.__name__: e for e in (ValueError, TypeError, OSError, RuntimeError,
                                       EngineStepError, EngineDeadError, RequestTimeoutError,
                                       EngineOverloadedError, WorkerError)}
Stats = dict[str, Union[int, float, list[int]]]   # EngineCore.get_stats (lists: per draft position)


def take_rpc_secret(config: Config) -> tuple[Config, bytes]:
    """(the config without the secret, the secret every frame is signed with). From here on only
    the codecs hold it, never a Config (which a trace, a log line or "ready" may show).

    The secret: --data-parallel-rpc-secret, else the environment's NANOSERVE_RPC_SECRET; when
    neither is set and every rank runs on this host, a random one for this run (the engine cores
    get it at spawn). A rank on another host needs it: ValueError."""
    secret = config.data_parallel_rpc_secret or os.environ.get(RPC_SECRET_ENV)
    config = dataclasses.replace(config, data_parallel_rpc_secret=None)
    remote = config.headless or len(config.data_parallel_ranks_here) < config.data_parallel_size
    if not secret and not remote:
        return config, secrets.token_bytes(32)
    if not secret or len(secret) < MIN_SECRET_CHARS:
        raise ValueError(
            f"data-parallel ranks on other hosts need a shared secret of at least "
            f"{MIN_SECRET_CHARS} characters, the same on every host: set {RPC_SECRET_ENV} "
            f"(e.g. to the output of `openssl rand -hex 32`) or --data-parallel-rpc-secret")
    return config, secret.encode()


# -- API server -> engine core ------------------------------------------------------------------
class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A Request as it crosses: what the engine core needs to rebuild it, nothing of its progress."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams      # validated again as it is decoded
    eos_token_id: Optional[int]
    arrival_time: float
    priority: int = 0

    @classmethod
    def from_request(cls, r: Request) -> "EngineCoreRequest":
        return cls(r.request_id, r.prompt_token_ids, r.sampling_params, r.eos_token_id,
                   r.arrival_time, r.priority)

    def to_request(self) -> Request:
        return Request(self.request_id, self.prompt_token_ids, self.sampling_params,
                       self.eos_token_id, self.arrival_time, self.priority)


class Welcome(msgspec.Struct, tag="welcome", array_like=True):
    nonce: bytes                         # the API server's half of the session


class AddRequests(msgspec.Struct, tag="add", array_like=True):
    requests: list[EngineCoreRequest]    # one request's children (n > 1) together


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


EngineCoreInput = Union[Welcome, AddRequests, AbortRequests]


# -- engine core -> API server ------------------------------------------------------------------
class Hello(msgspec.Struct, tag="hello", array_like=True):
    nonce: bytes                         # the engine core's half of the session


class Logprobs(msgspec.Struct, gc=False):
    """sampler.TokenLogprobs (which is encoded as it is), torch-free: the API server reads it."""

    logprob: float
    rank: int
    top: list[tuple[int, float]]


class Output(msgspec.Struct, gc=False):
    """request.EngineCoreOutput's fields (the dataclass is encoded as it is)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: Optional[str] = None
    stop_reason: Optional[int] = None
    new_logprobs: Optional[Logprobs] = None


class WireError(msgspec.Struct, array_like=True):
    """An exception as (class name from WIRE_ERRORS, message)."""

    kind: str
    message: str

    @classmethod
    def from_exception(cls, e: BaseException) -> "WireError":
        kind = next((c.__name__ for c in type(e).__mro__ if WIRE_ERRORS.get(c.__name__) is c), None)
        return cls(kind, str(e)) if kind else cls("RuntimeError", f"{type(e).__name__}: {e}")

    def to_exception(self) -> Exception:
        return WIRE_ERRORS.get(self.kind, RuntimeError)(self.message)


class Outputs(msgspec.Struct, tag="outputs", array_like=True, gc=False):
    """request.EngineCoreOutputs, its failed requests' errors as WireErrors."""

    outputs: list[Output]
    failed: dict[str, WireError]
    stats: Stats
    dead: bool
    error: Optional[str]

    @classmethod
    def from_outputs(cls, m: EngineCoreOutputs) -> "Outputs":
        failed = {request_id: WireError.from_exception(e) for request_id, e in m.failed.items()}
        return cls(m.outputs, failed, m.stats, m.dead, m.error)

    def to_outputs(self) -> EngineCoreOutputs:
        outputs = [EngineCoreOutput(o.request_id, o.new_token_ids, o.finish_reason,
                                    o.stop_reason, o.new_logprobs) for o in self.outputs]
        failed = {request_id: e.to_exception() for request_id, e in self.failed.items()}
        return EngineCoreOutputs(outputs, failed, self.stats, self.dead, self.error)


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """A rank is up: what the front end must know. The config never holds the rpc secret."""

    config: Config                       # resolved; validated again as it is decoded
    vocab_size: int
    model_path: str
    stats: Stats
    device: str
    pid: int
    worker_pids: list[int]

    @classmethod
    def from_core(cls, core) -> "Ready":
        return cls(core.config, core.vocab_size, core.model_path, core.get_stats(),
                   core.executor.device.type, os.getpid(), core.executor.worker_pids())


class StartupError(msgspec.Struct, tag="error", array_like=True):
    error: WireError                     # why the rank could not start (the API server raises it)


class Ping(msgspec.Struct, tag="ping", array_like=True):
    """Sent after HEARTBEAT_S without another message: silence means a hung or lost rank."""


EngineCoreMessage = Union[Hello, Ready, StartupError, Outputs, Ping]


class FrameCodec:
    """One end of the socket: signs and encodes what it sends, checks and decodes (against
    `decode_type`) what it hears; drops, and logs at most every DROP_LOG_EVERY_S, what fails."""

    def __init__(self, secret: bytes, decode_type):
        self._secret = secret
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(decode_type)
        self._counter = 0
        self._last_counter: dict[bytes, int] = {}      # session + channel -> last counter taken
        self._dropped, self._next_log = 0, 0.0
        self.num_dropped_total = 0

    def encode(self, channel: bytes, message, session: bytes) -> bytes:
        self._counter += 1
        counter = self._counter.to_bytes(COUNTER_BYTES, "big")
        body = self._encoder.encode(message)
        return self._mac(session, channel, counter, body) + counter + body

    def decode(self, channel: bytes, frame: bytes, *sessions: bytes):
        """The message of a frame signed under one of `sessions`, or None (dropped, logged)."""
        counter, body = frame[MAC_BYTES:MAC_BYTES + COUNTER_BYTES], frame[MAC_BYTES + COUNTER_BYTES:]
        if len(frame) < MAC_BYTES + COUNTER_BYTES:
            return self.drop(f"a frame of {len(frame)} bytes on {channel.decode()}: too short")
        session = next((s for s in sessions if hmac.compare_digest(
            frame[:MAC_BYTES], self._mac(s, channel, counter, body))), None)
        if session is None:
            return self.drop(f"a frame on {channel.decode()} with a bad MAC (is the rpc secret, "
                             f"--data-parallel-rpc-secret or {RPC_SECRET_ENV}, the same "
                             f"on every host?)")
        key, number = session + channel, int.from_bytes(counter, "big")
        if session and number <= self._last_counter.get(key, 0):    # (a Hello may come again)
            return self.drop(f"a replayed frame on {channel.decode()} (counter {number})")
        try:
            message = self._decoder.decode(body)
        except Exception as e:    # msgspec's errors, and what a __post_init__ raises
            return self.drop(f"a signed frame on {channel.decode()} that does not decode: {e}")
        self._last_counter[key] = number
        return message

    def _mac(self, session: bytes, channel: bytes, counter: bytes, body: bytes) -> bytes:
        mac = hmac.new(self._secret, digestmod=hashlib.sha256)
        for part in (session, channel, counter):      # each with its length: no ambiguity
            mac.update(len(part).to_bytes(4, "big") + part)
        mac.update(body)
        return mac.digest()

    def drop(self, why: str) -> None:
        self._dropped, self.num_dropped_total = self._dropped + 1, self.num_dropped_total + 1
        if (now := time.monotonic()) >= self._next_log:
            logging.getLogger("nanoserve").warning(
                "nanoserve: dropped %d frame(s) on the engine-core socket, the last: %s",
                self._dropped, why)
            self._dropped, self._next_log = 0, now + DROP_LOG_EVERY_S


class CoreCodec:
    """The engine core's end of its socket: a Hello with its nonce, the API server's Welcome (signed
    under that nonce) with the other, then every frame signed under both (the session)."""

    def __init__(self, secret: bytes, rank: int):
        self._codec = FrameCodec(secret, EngineCoreInput)
        self._to, self._from = f"{rank}>api".encode(), f"api>{rank}".encode()
        self._nonce = self._session = secrets.token_bytes(NONCE_BYTES)
        self.welcomed = False

    def hello(self) -> bytes:
        return self._codec.encode(self._to, Hello(self._nonce), b"")

    def encode(self, message) -> bytes:
        return self._codec.encode(self._to, message, self._session)

    def decode(self, frame: bytes) -> Optional[tuple[str, list]]:
        """One input of run_busy_loop, ("add", [Request]) or ("abort", [request id]); None for a
        Welcome (taken here) or a dropped frame."""
        message = self._codec.decode(self._from, frame, self._session)
        if isinstance(message, Welcome) and not self.welcomed:
            self._session, self.welcomed = message.nonce + self._nonce, True
        if isinstance(message, AddRequests):
            return "add", [request.to_request() for request in message.requests]
        return ("abort", message.request_ids) if isinstance(message, AbortRequests) else None


class ServerCodec:
    """The API server's end, for every rank: a rank's Hello starts its session (until it is ready:
    after that a Hello is a replay), answered with a Welcome; its frames are checked against it."""

    def __init__(self, secret: bytes, num_ranks: int):
        self._codec = FrameCodec(secret, EngineCoreMessage)
        self._nonce = secrets.token_bytes(NONCE_BYTES)
        self._ranks = {str(rank).encode(): rank for rank in range(num_ranks)}
        self._sessions: dict[int, bytes] = {}
        self.ready: dict[int, Ready] = {}
        self.drop = self._codec.drop

    @property
    def num_dropped_total(self) -> int:
        return self._codec.num_dropped_total

    def encode(self, rank: int, kind: str, payload: list) -> list[bytes]:
        """The ROUTER's frames (identity, signed message) that take ("add", [Request]) or
        ("abort", [request id]) to `rank`."""
        message = (AddRequests([EngineCoreRequest.from_request(r) for r in payload])
                   if kind == "add" else AbortRequests(list(payload)))
        frame = self._codec.encode(f"api>{rank}".encode(), message, self._sessions[rank])
        return [str(rank).encode(), frame]

    def decode(self, parts: list[bytes], reply) -> tuple[Optional[int], object]:
        """(rank, message) of what the ROUTER heard; message None when dropped (an identity that
        is no rank's, a bad MAC, a replay, undecodable) or a Hello, whose Welcome goes out through
        `reply`. Never raises: whoever reaches the port may send anything."""
        rank = self._ranks.get(parts[0]) if len(parts) == 2 else None
        if rank is None:
            self.drop(f"{len(parts)} frames from identity {parts[0][:16]!r}: no rank's")
            return None, None
        sessions = [s for s in (self._sessions.get(rank), b"") if s is not None]
        message = self._codec.decode(f"{rank}>api".encode(), parts[1], *sessions)
        if isinstance(message, Ready):
            self.ready[rank] = message
        if not isinstance(message, Hello):
            return rank, message
        if rank not in self.ready:        # (after Ready, a Hello is a replay)
            self._sessions[rank] = self._nonce + message.nonce
            reply([parts[0], self._codec.encode(f"api>{rank}".encode(), Welcome(self._nonce),
                                                message.nonce)])
        return rank, None
