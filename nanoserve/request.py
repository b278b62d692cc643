"""request.py: what travels between the layers: a Request, one step's SchedulerOutput, and what
the engine core sends back (EngineCoreOutput, batched per step into EngineCoreOutputs).

These are plain classes with no behaviour beyond bookkeeping, so every layer can import them
without importing each other (the scheduler, the KV cache manager, the worker, the front ends).
Between the API server process and the engine core process they travel as typed msgpack, never
pickled: their wire forms (EngineCoreRequest, Outputs) are in serial_utils.py.
`fit_error` is the one answer to "can this request ever run?": `check_fits` raises it for
Processor (processor.py), which both front ends pass through before anything reaches the engine;
the scheduler only asserts it.

Lessons: lessons/03-continuous-batching.md, lessons/04-preemption.md
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from nanoserve.config import Config
from nanoserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # A structured request whose grammar still compiles (vLLM's name): the scheduler passes it
    # over, the requests behind it go ahead; the engine core moves it on to WAITING once compiled.
    WAITING_FOR_FSM = "waiting_for_fsm"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH_CAPPED = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED,
                        RequestStatus.FINISHED_ABORTED)


class Request:
    """One sequence in the engine: its tokens, its progress and its status."""

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, eos_token_id: Optional[int] = None,
                 arrival_time: Optional[float] = None, priority: int = 0):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority          # lower value = served first (vLLM's convention)
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.block_hashes: list[bytes] = []   # filled by the KV cache manager
        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None   # the stop token id, when one ended it
        self.max_tokens = 0                   # set by the scheduler: max_tokens capped by room

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finish_reason(self) -> Optional[str]:
        return self.status.value if self.status.is_finished else None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, computed "
                f"{self.num_computed_tokens}/{self.num_tokens})")


@dataclass
class SchedulerOutput:
    """What the worker runs this step. Parallel lists, one entry per scheduled request, in
    batch order (running requests first, then newly admitted ones)."""

    requests: list[Request]
    num_scheduled_tokens: list[int]    # new tokens this step
    num_computed_tokens: list[int]     # tokens already in the cache before this step
    block_tables: list[list[int]]      # physical block ids of each request, logical order
    preempted_req_ids: list[str] = field(default_factory=list)
    # Requests finished or aborted since the last step: the worker drops their state.
    finished_req_ids: set[str] = field(default_factory=set)
    # Structured outputs (structured_output.py): the step's one bitmask, a CPU int32 tensor
    # [rows, ceil(vocab / 32)] the engine core builds (the scheduler knows no tensors), and the
    # request each row belongs to; None when no structured request samples this step.
    grammar_bitmask: Any = None
    structured_output_request_ids: list[str] = field(default_factory=list)
    # Speculative decoding: request id -> its draft tokens, fed after its last token (they are
    # counted in num_scheduled_tokens); the runner verifies k + 1 positions (spec_decode.py).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)


@dataclass
class EngineCoreOutput:
    """What one request gained in one step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: Optional[str] = None     # "stop" | "length" | "abort"
    stop_reason: Optional[int] = None       # the stop token id that ended it, if any
    new_logprobs: Any = None                # the sampler's logprobs for the new token


@dataclass
class EngineCoreOutputs:
    """Everything one pass of the engine core's loop has to say, sent as ONE message: the step's
    outputs, the requests that failed (id -> the error their front end raises), the engine's
    stats for /metrics, and `dead` when the loop itself stopped (then `error` says why).
    `engine_index`: the data-parallel rank it came from (the client sets it)."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    failed: dict[str, Exception] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)
    dead: bool = False
    error: Optional[str] = None
    engine_index: int = 0


def fit_error(config: Config, prompt_len: int, max_tokens: Optional[int]) -> Optional[str]:
    """Why (and by how much) a request could never finish, or None when it can. A request that
    needs more slots than the whole pool would preempt itself forever in the scheduler."""
    max_model_len, bs, num_blocks = config.max_model_len, config.block_size, config.num_kv_blocks
    if prompt_len == 0:
        return "prompt is empty: at least one token is needed"
    if prompt_len > max_model_len:
        return (f"prompt has {prompt_len} tokens, {prompt_len - max_model_len} more "
                f"than max_model_len ({max_model_len})")
    final_len = min(prompt_len + (max_tokens or max_model_len), max_model_len)
    # The last sampled token is never fed back, so at most final_len - 1 slots are used.
    slots = max(prompt_len, final_len - 1)
    capacity = num_blocks * bs
    if slots > capacity:
        return (f"prompt ({prompt_len} tokens) + max_tokens needs {slots} KV cache slots, "
                f"{slots - capacity} more than the whole pool holds ({num_blocks} blocks "
                f"of {bs}); lower max_tokens or give the KV cache more memory")
    return None


def check_fits(config: Config, prompt_len: int, max_tokens: Optional[int]) -> None:
    """ValueError (why, and by how much) for a request that could never finish."""
    if (why := fit_error(config, prompt_len, max_tokens)) is not None:
        raise ValueError(why)
