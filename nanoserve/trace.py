"""trace.py: the trace format, both sides: the hook every layer writes to (`Tracer`), and the
reader that rebuilds a run from the file (`Trace`), which `nanoserve trace` replays and plots.

Off (the default), the tracer is `NULL_TRACER`, whose `enabled` is False: callers guard
the building of an event's fields with `if tracer.enabled:` so a run without a trace pays
one attribute check per event site and nothing else. On (`Config.trace = "run.jsonl"`),
every event is one JSON object per line with `ev`, `step` and `t` (seconds since the
engine started), plus the fields `FIELDS` lists (ARCHITECTURE.md, The trace format):

    {"ev": "alloc", "step": 3, "t": 0.0412, "req": "r1", "blocks": [5, 6]}

The scheduler advances `tracer.step` at the start of each step, so every event carries
the step it belongs to. Events are flushed at the end of each step, not per line.

Reading rebuilds the state after every step from the file alone, never the engine: which
request holds which KV block, who waits, who runs. Blocks are bookkeeping: `alloc` and
`prefix_hit` add the request as a holder of each block (ref count = number of holders), `free`
removes it. The trace does not say which *free* blocks still hold a prefix-cache hash, so that
is inferred. A block freed by a request that had computed all of its tokens keeps its hash;
the next time the block is taken, the trace settles it: `evict` or `prefix_hit` means it was
cached, a plain `alloc` that it was not. Example: block_size 4, request r1 holds [5, 2] and
has computed 6 tokens when it finishes -> block 5 (tokens 0-3, full) stays cached, block 2
(tokens 4-5) does not. Which requests sampled a token in a step follows the scheduler's rule:
those whose computed tokens reach prompt_len + tokens generated so far (a prefill chunk samples
nothing); a `spec_decode` event then corrects it for requests that verified drafts (each
gains accepted + 1 tokens, and its rejected drafts leave its computed count). Torch-free: the
tools that read traces never load the engine.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Optional

# Each event's fields besides ev, step and t, and their types (default: int).
FIELDS = {"config": "", "arrive": "req prompt_len max_tokens", "alloc": "req blocks",
          "prefix_hit": "req blocks tokens", "free": "req blocks", "evict": "block",
          "preempt": "req num_computed_tokens", "step_done": "duration_s sampled",
          "schedule": "scheduled running waiting num_prefill_tokens num_decode_tokens kv_used "
                      "kv_free kv_cached", "finish": "req reason prompt_len output_len",
          "grammar_bitmask": "reqs", "spec_decode": "proposed accepted", "expert_load": "counts"}
TYPES = {"t": (int, float), "duration_s": (int, float), "req": str, "reason": str, "blocks": list,
         "running": list, "waiting": list, "scheduled": dict, "sampled": dict, "reqs": list,
         "proposed": dict, "accepted": dict, "counts": list}


class Tracer:
    """Writes events as JSON lines. Use `Tracer.open(path)`: it gives NULL_TRACER for None."""

    enabled = True

    def __init__(self, path: str):
        self._file = open(path, "w", encoding="utf-8")
        self._t0 = time.perf_counter()
        self.step = 0

    @staticmethod
    def open(path: str | None) -> "Tracer | NullTracer":
        return Tracer(path) if path else NULL_TRACER

    def emit(self, ev: str, **fields: Any) -> None:
        record = {"ev": ev, "step": self.step, "t": round(time.perf_counter() - self._t0, 6)}
        record.update(fields)
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class NullTracer:
    """The tracer when tracing is off: every call does nothing."""

    enabled = False
    step = 0

    def emit(self, ev: str, **fields: Any) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


NULL_TRACER = NullTracer()


# -- reading -----------------------------------------------------------------
def load_events(path: str) -> list[dict]:
    """Parse and check every line; a ValueError naming the line for anything malformed."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as e:
        raise ValueError(f"cannot read trace {path}: {e.strerror}") from None
    events = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line.rstrip("\n"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}, column {e.colno}); "
                             "is the file truncated?") from None
        ev = event.get("ev") if isinstance(event, dict) else None
        if not isinstance(ev, str) or ev not in FIELDS:
            raise ValueError(f"{path}:{lineno}: not a trace event ('ev' must be one of "
                             f"{', '.join(FIELDS)})")
        names = ("step", "t", *FIELDS[ev].split())
        missing = [k for k in names if k not in event]
        if missing:
            raise ValueError(f"{path}:{lineno}: the {ev!r} event lacks {', '.join(missing)}")
        wrong = [k for k in names if not isinstance(event[k], TYPES.get(k, int))]
        if wrong:
            raise ValueError(f"{path}:{lineno}: the {ev!r} event's {', '.join(wrong)}: wrong type")
        if event["step"] < (events[-1]["step"] if events else 0):
            raise ValueError(f"{path}:{lineno}: step {event['step']} comes after step "
                             f"{events[-1]['step']}: steps never go back")
        event["line"] = lineno
        events.append(event)
    if not events:
        raise ValueError(f"{path}: the trace is empty")
    return events


@dataclass
class TracedRequest:
    """One request's history, as the trace tells it."""
    req: str
    label: str                 # its short name in a replay or a figure
    prompt_len: int
    max_tokens: int
    arrive_step: int           # arrived after this step ran: waits from the next one
    arrive_t: float
    work: dict[int, str] = field(default_factory=dict)   # step -> "prefill" | "decode"
    preempt_steps: list[int] = field(default_factory=list)
    token_steps: list[int] = field(default_factory=list)  # steps that sampled one of its tokens
    masked_steps: list[int] = field(default_factory=list)  # its grammar masked the sampling
    finish_step: Optional[int] = None
    finish_t: Optional[float] = None
    reason: Optional[str] = None

    def kind(self, step: int) -> Optional[str]:
        """What the request did in `step`: wait, prefill, decode, preempt, finish (or None)."""
        if step == self.finish_step or step in self.preempt_steps:
            return "finish" if step == self.finish_step else "preempt"
        if step in self.work:
            return self.work[step]
        alive = step > self.arrive_step and (self.finish_step is None or step < self.finish_step)
        return "wait" if alive else None


@dataclass
class Frame:
    """The state after one step (step 0: before the first)."""
    step: int
    t: float
    holders: dict[int, list[str]]   # block id -> requests holding it (ref count = len)
    running: list[str]
    waiting: list[str]
    schedule: dict                  # the step's `schedule` event ({} at step 0)
    notes: list[str]                # what else happened in the step, in words
    cached: set[int] = field(default_factory=set)   # free blocks still holding a hash
    spec: Optional[tuple[int, int]] = None   # speculative decoding: (drafts, accepted) this step


class Trace:
    """Everything a trace file says about a run, rebuilt step by step (`Trace.load(path)`)."""

    def __init__(self, events: list[dict], path: str = "trace"):
        self.path = path
        self.config = next((e for e in events if e["ev"] == "config"), {})
        self.budget = self.config.get("max_num_batched_tokens")
        self.requests: dict[str, TracedRequest] = {}
        self.frames: dict[int, Frame] = {}
        # step -> (start, end) in seconds: from step_done, else both the schedule's t
        self.spans: dict[int, tuple[float, float]] = {}
        self.prefix_queries = self.prefix_hits = 0        # tokens, counted like kv_cache.py
        self.max_block = -1                                # the highest block id in the trace
        # mixture of experts: step -> tokens each expert received, [moe layer][expert]
        self.expert_load: dict[int, list[list[int]]] = {}
        rebuild = _Rebuild(self)
        try:
            rebuild.run(events)
        except (KeyError, TypeError, ValueError, AttributeError) as e:   # named, not a crash
            raise ValueError(f"{path}:{rebuild.line}: inconsistent event: {e!r}") from None
        first = next((f.schedule for f in self.frames.values() if f.schedule), None)
        self.num_blocks = self.config.get("num_kv_blocks") or (
            first["kv_used"] + first["kv_free"] if first else self.max_block + 1)
        short = all(len(r) <= 4 for r in self.requests)
        for i, r in enumerate(self.requests.values()):
            r.label = r.req if short else str(i)

    @classmethod
    def load(cls, path: str) -> "Trace":
        return cls(load_events(path), path)

    def frame(self, step: int) -> Frame:
        if step not in self.frames:
            raise ValueError(f"step {step} is not in {self.path} (it has steps "
                             f"{min(self.frames)}..{max(self.frames)})")
        return self.frames[step]

    def token_times(self, r: TracedRequest) -> list[float]:
        return [self.spans[s][1] for s in r.token_steps]


class _Rebuild:
    """Reads a trace's events in order into `trace`: the live state (block holders, what each
    request has computed and generated, which free blocks may still be cached), one handler
    per event kind, and a Frame of that state at the end of every step."""

    def __init__(self, trace: Trace):
        self.trace = trace
        self.holders: dict[int, list[str]] = {}
        self.computed: dict[str, int] = {}        # request -> num_computed_tokens
        self.generated: dict[str, int] = {}       # request -> output tokens so far
        # request -> its kept drafts of the last step: computed, but not hashed until the next
        # schedule (allocate_slots hashes only blocks full of tokens known when it runs)
        self.unhashed: dict[str, int] = {}
        self.episode: dict[int, int] = {}         # free block -> index of its free in `kept_hash`
        self.kept_hash: list[bool] = []           # did that free leave the block cached?
        self.frame_episodes: list[dict[int, int]] = []
        self.running: list[str] = []              # request ids, as of the last event
        self.waiting: list[str] = []
        self.caching = trace.config.get("enable_prefix_caching", True)
        self.block_size = trace.config.get("block_size")
        self.step, self.sched, self.notes, self.t, self.line = 0, {}, [], 0.0, 0
        self.handlers = {"arrive": self.on_arrive, "evict": self.on_evict, "alloc": self.on_take,
                         "prefix_hit": self.on_take, "free": self.on_free,
                         "preempt": self.on_preempt, "schedule": self.on_schedule,
                         "step_done": self.on_step_done, "finish": self.on_finish,
                         "grammar_bitmask": self.on_grammar_bitmask,
                         "spec_decode": self.on_spec_decode, "expert_load": self.on_expert_load}
        self.spec: Optional[tuple[int, int]] = None

    def run(self, events: list[dict]) -> None:
        for e in events:
            self.line = e["line"]
            if e["step"] != self.step:
                self.snapshot()
                self.step, self.sched, self.notes, self.spec = e["step"], {}, [], None
            self.t = e["t"]
            if e["ev"] in self.handlers:          # `config` was read up front
                self.handlers[e["ev"]](e)
        self.snapshot()
        for f, eps in zip(self.trace.frames.values(), self.frame_episodes):
            f.cached = {b for b, i in eps.items() if self.kept_hash[i]}

    def snapshot(self) -> None:
        self.trace.frames[self.step] = Frame(
            self.step, self.t, {b: list(h) for b, h in self.holders.items()},
            list(self.running), list(self.waiting), self.sched, self.notes, spec=self.spec)
        self.frame_episodes.append(dict(self.episode))

    def on_arrive(self, e: dict) -> None:
        rid = e["req"]
        self.trace.requests[rid] = TracedRequest(rid, rid, e["prompt_len"], e["max_tokens"],
                                                 self.step, self.t)
        self.generated[rid] = self.computed[rid] = 0
        self.waiting.append(rid)

    def on_evict(self, e: dict) -> None:
        self.kept_hash[self.episode.pop(e["block"])] = True

    def on_take(self, e: dict) -> None:
        """`alloc` or `prefix_hit`: the request becomes a holder of each block."""
        rid, hit = e["req"], e["ev"] == "prefix_hit"
        self.trace.max_block = max([self.trace.max_block, *e["blocks"]])
        for b in e["blocks"]:
            if b in self.episode:     # a free block taken back: was it still cached?
                self.kept_hash[self.episode.pop(b)] = hit
            elif not hit and b in self.holders:
                raise ValueError(f"block {b} goes to {rid} but {self.holders[b]} hold it")
            self.holders.setdefault(b, []).append(rid)
        if hit:
            self.computed[rid] = e["tokens"]
            self.trace.prefix_hits += e["tokens"]
            self.notes.append(f"{rid} hit {len(e['blocks'])} cached blocks")

    def on_free(self, e: dict) -> None:
        rid, blocks, bs = e["req"], e["blocks"], self.block_size
        for pos, b in enumerate(blocks):     # tail first
            if rid not in self.holders.get(b, ()):
                raise ValueError(f"{rid} frees block {b}, which it does not hold")
            self.holders[b].remove(rid)
            if not self.holders[b]:
                del self.holders[b]
                logical = len(blocks) - 1 - pos
                self.episode[b] = len(self.kept_hash)
                full = bool(bs) and (logical + 1) * bs <= self.computed[rid] - self.unhashed.get(rid, 0)
                self.kept_hash.append(bool(self.caching) and full)
        self.computed[rid] = 0     # finish, abort and preemption all start it over

    def on_preempt(self, e: dict) -> None:
        self.trace.requests[e["req"]].preempt_steps.append(self.step)   # queues: at `schedule`
        self.notes.append(f"{e['req']} preempted ({e['num_computed_tokens']} tokens dropped)")

    def on_schedule(self, e: dict) -> None:
        self.sched, self.running, self.waiting = e, list(e["running"]), list(e["waiting"])
        self.trace.spans[self.step] = (self.t, self.t)
        for rid, n in e["scheduled"].items():
            r, c, generated = self.trace.requests[rid], self.computed[rid], self.generated[rid]
            if not r.work or max(r.work) < max(r.preempt_steps, default=-1):
                self.trace.prefix_queries += r.prompt_len + generated   # an admission
            r.work[self.step] = "decode" if n == 1 and c >= r.prompt_len else "prefill"
            self.computed[rid], self.unhashed[rid] = c + n, 0
            if c + n == r.prompt_len + generated:
                self.generated[rid] += 1
                r.token_steps.append(self.step)

    def on_spec_decode(self, e: dict) -> None:
        """Requests that verified k drafts: on_schedule counted k + 1 tokens as computed and
        none sampled; each kept `accepted` drafts and gained accepted + 1 tokens."""
        for rid, k in e["proposed"].items():
            r, accepted, n = self.trace.requests[rid], e["accepted"][rid], self.sched["scheduled"][rid]
            if n == k + 1 and self.computed[rid] - n >= r.prompt_len:
                r.work[self.step] = "decode"        # one token and its drafts
            self.computed[rid] -= k - accepted
            self.unhashed[rid] = accepted
            self.generated[rid] += accepted + 1
            r.token_steps += [self.step] * (accepted + 1)
        self.spec = (sum(e["proposed"].values()), sum(e["accepted"].values()))

    def on_step_done(self, e: dict) -> None:
        self.trace.spans[self.step] = (self.t - e["duration_s"], self.t)

    def on_grammar_bitmask(self, e: dict) -> None:
        for rid in e["reqs"]:
            self.trace.requests[rid].masked_steps.append(self.step)
        self.notes.append(f"grammar bitmask for {', '.join(e['reqs'])}")

    def on_expert_load(self, e: dict) -> None:
        """A mixture of experts' step: how many tokens each expert of each MoE layer received."""
        counts, earlier = e["counts"], next(iter(self.trace.expert_load.values()), None)
        if not counts or not all(isinstance(layer, list) and layer and all(
                isinstance(n, int) and n >= 0 for n in layer) for layer in counts):
            raise ValueError("expert_load counts must be non-empty lists (a layer) of token counts >= 0")
        if earlier is not None and [len(x) for x in counts] != [len(x) for x in earlier]:
            raise ValueError("expert_load counts change shape (layers x experts) between steps")
        self.trace.expert_load[self.step] = counts

    def on_finish(self, e: dict) -> None:
        rid, r = e["req"], self.trace.requests[e["req"]]
        r.finish_step, r.finish_t, r.reason = self.step, self.t, e["reason"]
        del r.token_steps[e["output_len"]:]      # a verified run a stop cut short kept fewer
        self.running, self.waiting = ([x for x in q if x != rid]
                                      for q in (self.running, self.waiting))
        self.notes.append(f"{rid} finished ({e['reason']}, {e['output_len']} tokens)")
