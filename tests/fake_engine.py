"""A model-free engine for testing the scheduler and the KV cache manager.

The fake model stores each scheduled token's id in a fake KV cache at its slot (through
the block table, as store_kv does), then reads the whole sequence back through the block
table and computes the next token from what it read. A wrong block table, a bad prefix
hit or an evicted block that is still in use therefore changes the output, and
`reference_tokens` (the same rule on the true token list) is the oracle.
"""

from __future__ import annotations

from nanoserve.config import Config
from nanoserve.kv_cache import KVCacheManager
from nanoserve.sampling_params import SamplingParams
from nanoserve.request import Request, RequestStatus
from nanoserve.scheduler import Scheduler
from nanoserve.spec_decode import accepted_tokens

VOCAB = 50


def next_token(seq: list[int]) -> int:
    """Deterministic 'model': a function of the last three tokens and the length."""
    a, b, c = ([0, 0] + seq)[-3:]
    return (a + 3 * b + 7 * c + len(seq)) % VOCAB


def reference_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(max_tokens):
        out.append(next_token(seq))
        seq.append(out[-1])
    return out


def make_scheduler(num_blocks=64, block_size=4, max_model_len=256, tracer=None, **kwargs):
    config = Config(block_size=block_size, max_model_len=max_model_len, num_kv_blocks=num_blocks,
                    **kwargs)
    from nanoserve.trace import NULL_TRACER
    tracer = tracer or NULL_TRACER
    kv = KVCacheManager(num_blocks, block_size, config.enable_prefix_caching, tracer)
    return Scheduler(config, kv, tracer)


class FakeRunner:
    """Plays the worker: store through slot_mapping, read back through block tables."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.cache = [-1] * (num_blocks * block_size)

    def slot(self, block_table: list[int], pos: int) -> int:
        return block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, out) -> dict[str, list[int]]:
        # Store every scheduled token first, then read: the real model does the same per
        # layer, which is what lets an n > 1 sibling share blocks computed in the same step.
        # Speculative drafts are stored after a request's tokens and verified like the runner
        # does (spec_decode.accepted_tokens against the model's token at each position).
        drafts = out.scheduled_spec_decode_tokens
        for req, n, c, bt in zip(out.requests, out.num_scheduled_tokens, out.num_computed_tokens,
                                 out.block_tables):
            tokens = req.all_token_ids + drafts.get(req.request_id, [])
            for pos in range(c, c + n):
                self.cache[self.slot(bt, pos)] = tokens[pos]
        sampled = {}
        for req, n, c, bt in zip(out.requests, out.num_scheduled_tokens, out.num_computed_tokens,
                                 out.block_tables):
            mine = drafts.get(req.request_id, [])
            if c + n == req.num_tokens + len(mine):
                seq = [self.cache[self.slot(bt, p)] for p in range(c + n)]
                assert seq == req.all_token_ids + mine, f"{req.request_id} read back wrong KV"
                targets = [next_token(seq[:req.num_tokens + j]) for j in range(len(mine) + 1)]
                sampled[req.request_id] = accepted_tokens(mine, targets)
        return sampled


def run(scheduler: Scheduler, requests: list[Request], check=None, runner=None,
        max_steps=10_000, grammar_ready=None):
    """Add the requests, step until all finish; returns ({request_id: output token ids},
    the SchedulerOutput of every step). Pass the same runner to keep its cache.
    `grammar_ready`: {request id: the step its grammar has compiled by}: until then it waits as
    WAITING_FOR_FSM (the engine core's part, played here) and must not be scheduled."""
    runner = runner or FakeRunner(scheduler.kv.num_blocks, scheduler.block_size)
    grammar_ready = grammar_ready or {}
    for r in requests:
        scheduler.add_request(r)
        if r.request_id in grammar_ready:
            r.status = RequestStatus.WAITING_FOR_FSM
    steps = []
    while scheduler.has_unfinished_requests():
        for r in requests:
            if (r.status == RequestStatus.WAITING_FOR_FSM
                    and grammar_ready[r.request_id] <= len(steps)):
                r.status = RequestStatus.WAITING
        out = scheduler.schedule()
        assert all(grammar_ready.get(r.request_id, 0) <= len(steps) for r in out.requests), \
            "a request ran before its grammar compiled"
        steps.append(out)
        scheduler.update(out, runner.execute(out))
        if check:
            check(scheduler)
        assert len(steps) < max_steps, "scheduler made no progress"
    return {r.request_id: r.output_token_ids for r in requests}, steps


def make_request(rid: str, prompt: list[int], max_tokens: int, **params) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params))
