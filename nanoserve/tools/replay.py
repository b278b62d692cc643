"""replay.py: `nanoserve trace FILE`, a step-by-step replay of what the engine did.

A trace (design.md §8, from `--trace run.jsonl`) has one JSON event per line. This module
reads only that file, never the engine, and rebuilds the state after every step: which
request holds which KV block, who waits, who runs, how the token budget was spent.

    nanoserve trace traces/preemption_storm.jsonl            # animated; keys: space n b q
    nanoserve trace traces/preemption_storm.jsonl --step 12  # one frame, then exit (no TTY needed)
    nanoserve trace run.jsonl --summary --plot figs/ --chrome run.chrome.json

Rebuilding the pool is bookkeeping: `alloc` and `prefix_hit` add the request as a holder
of each block (ref count = number of holders), `free` removes it. The trace does not say
which *free* blocks still hold a prefix-cache hash, so that is inferred. A block freed by a
request that had computed all of its tokens keeps its hash; the next time the block is
taken, the trace settles it: `evict` or `prefix_hit` means it was cached, a plain `alloc`
that it was not. Example: block_size 4, request r1 holds [5, 2] and has computed 6 tokens
when it finishes -> block 5 (tokens 0-3, full) stays cached, block 2 (tokens 4-5) does not.

Which requests sampled a token in a step follows the scheduler's rule: those whose computed
tokens reach prompt_len + tokens generated so far (a prefill chunk samples nothing).
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

from rich.columns import Columns
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

# Each event's fields besides ev, step and t (design.md §8), and their types (default: int).
FIELDS = {"config": "", "arrive": "req prompt_len max_tokens", "alloc": "req blocks",
          "prefix_hit": "req blocks tokens", "free": "req blocks", "evict": "block",
          "preempt": "req num_computed_tokens", "step_done": "duration_s sampled",
          "schedule": "scheduled running waiting num_prefill_tokens num_decode_tokens kv_used "
                      "kv_free kv_cached", "finish": "req reason prompt_len output_len"}
TYPES = {"t": (int, float), "duration_s": (int, float), "req": str, "reason": str, "blocks": list,
         "running": list, "waiting": list, "scheduled": dict, "sampled": dict}
# What a request did in a step: timeline glyph and colour.
GLYPHS = {"wait": ("·", "grey50"), "prefill": ("▒", "yellow"), "decode": ("█", "green"),
          "preempt": ("✗", "bold red"), "finish": ("✓", "bold cyan"), None: (" ", "")}
PALETTE = ("red", "green", "yellow", "blue", "magenta", "cyan", "orange3", "purple", "gold3",
           "bright_red", "bright_green", "bright_blue", "bright_magenta", "turquoise2")
MAX_ROWS = 20          # timeline rows; the requests active at the frame's step come first
MAX_GRID_BLOCKS = 512  # a big pool shows its first blocks (the free queue hands out low ids first)


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
class Request:
    req: str
    label: str                 # what the timeline and the block grid show
    prompt_len: int
    max_tokens: int
    arrive_step: int           # arrived after this step ran: waits from the next one
    arrive_t: float
    work: dict[int, str] = field(default_factory=dict)   # step -> "prefill" | "decode"
    preempt_steps: list[int] = field(default_factory=list)
    token_steps: list[int] = field(default_factory=list)  # steps that sampled one of its tokens
    finish_step: Optional[int] = None
    finish_t: Optional[float] = None
    reason: Optional[str] = None

    def kind(self, step: int) -> Optional[str]:
        """What the request did in `step` (a GLYPHS key)."""
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


class Trace:
    """Everything the replay shows, rebuilt from the events of one trace file."""

    def __init__(self, events: list[dict], path: str = "trace"):
        self.path = path
        self.config = next((e for e in events if e["ev"] == "config"), {})
        self.budget = self.config.get("max_num_batched_tokens")
        self.requests: dict[str, Request] = {}
        self.frames: dict[int, Frame] = {}
        # step -> (start, end) in seconds: from step_done, else both the schedule's t
        self.spans: dict[int, tuple[float, float]] = {}
        self.prefix_queries = self.prefix_hits = 0        # tokens, counted like kv_cache.py
        self.max_block = -1                                # the highest block id in the trace
        try:
            self._rebuild(events)
        except (KeyError, TypeError, ValueError, AttributeError) as e:   # named, not a crash
            raise ValueError(f"{path}:{self._line}: inconsistent event: {e!r}") from None
        first = next((f.schedule for f in self.frames.values() if f.schedule), None)
        self.num_blocks = self.config.get("num_kv_blocks") or (
            first["kv_used"] + first["kv_free"] if first else self.max_block + 1)
        self.grid_blocks = min(self.num_blocks, MAX_GRID_BLOCKS, max(self.max_block + 16, 64))
        short = all(len(r) <= 4 for r in self.requests)
        for i, r in enumerate(self.requests.values()):
            r.label = r.req if short else str(i)
        self.colours = {rid: PALETTE[i % len(PALETTE)] for i, rid in enumerate(self.requests)}
        self.label_width = max((len(r.label) for r in self.requests.values()), default=1)

    @classmethod
    def load(cls, path: str) -> "Trace":
        return cls(load_events(path), path)

    def _rebuild(self, events: list[dict]) -> None:
        holders: dict[int, list[str]] = {}
        computed: dict[str, int] = {}        # request -> num_computed_tokens
        generated: dict[str, int] = {}       # request -> output tokens so far
        episode: dict[int, int] = {}         # free block -> index of its free in `kept_hash`
        kept_hash: list[bool] = []        # did that free leave the block cached?
        frame_episodes: list[dict[int, int]] = []
        running, waiting = [], []            # request ids, as of the last event
        caching = self.config.get("enable_prefix_caching", True)
        bs = self.config.get("block_size")
        step, sched, notes, t = 0, {}, [], 0.0

        def snapshot():
            self.frames[step] = Frame(step, t, {b: list(h) for b, h in holders.items()},
                                      list(running), list(waiting), sched, notes)
            frame_episodes.append(dict(episode))

        for e in events:
            self._line = e["line"]
            ev, rid = e["ev"], e.get("req")
            if e["step"] != step:
                snapshot()
                step, sched, notes = e["step"], {}, []
            t = e["t"]
            if ev == "arrive":
                self.requests[rid] = Request(rid, rid, e["prompt_len"], e["max_tokens"], step, t)
                generated[rid] = computed[rid] = 0
                waiting.append(rid)
            elif ev == "evict":
                kept_hash[episode.pop(e["block"])] = True
            elif ev in ("alloc", "prefix_hit"):
                self.max_block = max([self.max_block, *e["blocks"]])
                for b in e["blocks"]:
                    if b in episode:     # a free block taken back: was it still cached?
                        kept_hash[episode.pop(b)] = ev == "prefix_hit"
                    elif ev == "alloc" and b in holders:
                        raise ValueError(f"block {b} goes to {rid} but {holders[b]} hold it")
                    holders.setdefault(b, []).append(rid)
                if ev == "prefix_hit":
                    computed[rid] = e["tokens"]
                    self.prefix_hits += e["tokens"]
                    notes.append(f"{rid} hit {len(e['blocks'])} cached blocks")
            elif ev == "free":
                for pos, b in enumerate(e["blocks"]):     # tail first
                    if rid not in holders.get(b, ()):
                        raise ValueError(f"{rid} frees block {b}, which it does not hold")
                    holders[b].remove(rid)
                    if not holders[b]:
                        del holders[b]
                        logical = len(e["blocks"]) - 1 - pos
                        episode[b] = len(kept_hash)
                        full = bool(bs) and (logical + 1) * bs <= computed[rid]
                        kept_hash.append(bool(caching) and full)
                computed[rid] = 0     # finish, abort and preemption all start it over
            elif ev == "preempt":
                self.requests[rid].preempt_steps.append(step)   # the queues: at `schedule`
                notes.append(f"{rid} preempted ({e['num_computed_tokens']} tokens dropped)")
            elif ev == "schedule":
                sched, running, waiting = e, list(e["running"]), list(e["waiting"])
                self.spans[step] = (t, t)
                for sid, n in e["scheduled"].items():
                    r, c = self.requests[sid], computed[sid]
                    if not r.work or max(r.work) < max(r.preempt_steps, default=-1):
                        self.prefix_queries += r.prompt_len + generated[sid]   # an admission
                    r.work[step] = "decode" if n == 1 and c >= r.prompt_len else "prefill"
                    computed[sid] = c + n
                    if c + n == r.prompt_len + generated[sid]:
                        generated[sid] += 1
                        r.token_steps.append(step)
            elif ev == "step_done":
                self.spans[step] = (t - e["duration_s"], t)
            elif ev == "finish":
                r = self.requests[rid]
                r.finish_step, r.finish_t, r.reason = step, t, e["reason"]
                running, waiting = ([x for x in q if x != rid] for q in (running, waiting))
                notes.append(f"{rid} finished ({e['reason']}, {e['output_len']} tokens)")
        snapshot()
        for f, eps in zip(self.frames.values(), frame_episodes):
            f.cached = {b for b, i in eps.items() if kept_hash[i]}

    def frame(self, step: int) -> Frame:
        if step not in self.frames:
            raise ValueError(f"step {step} is not in {self.path} (it has steps "
                             f"{min(self.frames)}..{max(self.frames)})")
        return self.frames[step]

    def token_times(self, r: Request) -> list[float]:
        return [self.spans[s][1] for s in r.token_steps]


# -- rendering ---------------------------------------------------------------
def _timeline(trace: Trace, frame: Frame, width: int) -> Panel:
    lw = trace.label_width
    num_cols = max(8, width - lw - 22)         # room left after the label and the status
    first = max(1, frame.step - num_cols + 1)
    steps = range(first, frame.step + 1)
    shown = [r for r in trace.requests.values() if r.arrive_step <= frame.step
             and (r.finish_step is None or r.finish_step >= first)]
    active = set(frame.running) | set(frame.waiting)    # rows: these first, then the latest done
    ranked = sorted(shown, key=lambda r: (r.req not in active, -(r.finish_step or 0)))
    kept = {r.req for r in ranked[:MAX_ROWS]}
    hidden, shown = len(shown) - len(kept), [r for r in shown if r.req in kept]
    table = Table.grid(padding=(0, 1))
    for r in shown:
        row = Text.assemble(*(GLYPHS[r.kind(s)] for s in steps))
        done = sum(1 for s in r.token_steps if s <= frame.step)
        status = (r.reason if r.finish_step is not None and r.finish_step <= frame.step
                  else f"{done}/{r.max_tokens} tok")
        table.add_row(Text(r.label.rjust(lw), style=f"bold {trace.colours[r.req]}"), row,
                      Text(status, style="grey62"))
    if hidden:
        table.add_row("", Text(f"... {hidden} more requests", style="grey50"), "")
    legend = "  ".join(f"[{style}]{g}[/] {k}" for k, (g, style) in GLYPHS.items() if k)
    return Panel(table, title=f"requests · steps {first}-{frame.step}", title_align="left",
                 subtitle=legend, subtitle_align="left")


def _pool(trace: Trace, frame: Frame) -> Panel:
    w, cols = trace.label_width + 1, 16 if trace.label_width <= 2 else 8
    text = Text()
    for start in range(0, trace.grid_blocks, cols):
        text.append(f"{start:>4} │ ", style="grey50")
        for b in range(start, min(start + cols, trace.grid_blocks)):
            h = frame.holders.get(b)
            if h:      # coloured by its first holder; "+" and underlined when shared
                cell = trace.requests[h[0]].label + ("+" if len(h) > 1 else "")
                style = f"{'bold underline ' if len(h) > 1 else ''}black on {trace.colours[h[0]]}"
            else:
                cell, style = ("c", "bold green") if b in frame.cached else ("·", "grey37")
            text.append(cell.rjust(w), style).append(" ")
        text.append("\n")
    if trace.grid_blocks < trace.num_blocks:
        text.append(f"  blocks {trace.grid_blocks}-{trace.num_blocks - 1}: not shown\n", "grey50")
    text.append("label = owner, + = shared (ref>1), c = cached free, · = free", "grey62")
    return Panel(text, title=f"KV block pool · {trace.num_blocks} blocks", title_align="left")


def _bar(parts: list[tuple[int, str, str]], total: int, width: int = 24) -> Text:
    bar, left = Text(), width
    for n, char, style in parts:
        cells = min(left, round(width * n / total)) if total else 0
        bar.append(char * cells, style)
        left -= cells
    return bar.append("░" * left, "grey37")


def _queues(trace: Trace, frame: Frame) -> Panel:
    s, g = frame.schedule, Table.grid(padding=(0, 1))

    def ids(xs: list[str]) -> str:
        return " ".join(trace.requests[x].label for x in xs[:12]) + (" ..." if len(xs) > 12 else "")

    g.add_row("step", f"{frame.step} of {max(trace.frames)}   t = {frame.t:.3f} s")
    g.add_row("running", f"({len(frame.running)}) {ids(frame.running)}")
    g.add_row("waiting", f"({len(frame.waiting)}) {ids(frame.waiting)}")
    if s:
        pre, dec = s["num_prefill_tokens"], s["num_decode_tokens"]
        bar = _bar([(pre, "█", "yellow"), (dec, "█", "green")], trace.budget or pre + dec)
        g.add_row("tokens", bar)
        g.add_row("", f"{pre + dec} / {trace.budget or '?'}  (prefill {pre}, decode {dec})")
    used, cached = len(frame.holders), len(frame.cached)
    g.add_row("KV blocks", _bar([(used, "█", "magenta"), (cached, "▒", "green")],
                                trace.num_blocks))
    g.add_row("", f"used {used} · free {trace.num_blocks - used} ({cached} of them cached)")
    for note in frame.notes:
        g.add_row("", Text(note, style="bold red" if "preempted" in note else "cyan"))
    return Panel(g, title="queues and budget", title_align="left")


def render(trace: Trace, frame: Frame, width: int = 100, hint: str = "") -> Group:
    """The three panels of one frame (and a line of help under them in the live replay)."""
    below = Columns([_pool(trace, frame), _queues(trace, frame)])   # side by side if they fit
    return Group(_timeline(trace, frame, width), below, *([Text(hint, "grey50")] if hint else []))


# -- the command ---------------------------------------------------------------
@contextmanager
def _keyboard():
    """Yields read_key(timeout) -> the key pressed, or None after `timeout` seconds (None:
    wait for a key). On a TTY keys arrive unbuffered (cbreak mode), else it only sleeps."""
    if not sys.stdin.isatty() or os.name == "nt":
        yield lambda timeout: time.sleep(timeout or 0)
        return
    import termios
    import tty
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def read_key(timeout: Optional[float]) -> Optional[str]:
        ready, _, _ = select.select([fd], [], [], timeout)
        return os.read(fd, 8).decode(errors="ignore") if ready else None
    try:
        yield read_key
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def play(trace: Trace, speed: float, console: Console) -> None:
    """Animate the frames at `speed` steps per second. Keys (on a TTY): space pauses,
    n or right arrow steps forward, b or left arrow back, q quits."""
    steps, i, paused = sorted(trace.frames), 0, False
    moves = {None: 1, "n": 1, "\x1b[C": 1, "b": -1, "\x1b[D": -1}   # \x1b[C: right arrow
    with _keyboard() as read_key, Live(console=console, auto_refresh=False) as live:
        while True:
            hint = "space pause · n/b step · q quit" + ("   [paused]" if paused else "")
            live.update(render(trace, trace.frames[steps[i]], console.width, hint), refresh=True)
            key = read_key(None if paused else 1 / speed)
            if key == "q" or (key is None and i == len(steps) - 1):
                break
            paused ^= key == " "
            i = max(0, min(i + moves.get(key, 0), len(steps) - 1))


def main(path: str, step: Optional[int] = None, speed: float = 4.0, plot: Optional[str] = None,
         summary: bool = False, chrome: Optional[str] = None, compare: Optional[str] = None,
         console: Optional[Console] = None) -> None:
    """`nanoserve trace`: with no option, the animated replay; else each output asked for
    (`compare`: a second trace whose summary goes beside this one's)."""
    if speed <= 0:
        raise ValueError(f"speed must be > 0 steps per second (got {speed})")
    trace, console = Trace.load(path), console or Console()
    if step is not None:
        console.print(render(trace, trace.frame(step), console.width))
    from nanoserve.tools.replay_plots import chrome_trace, summary_table, write_plots   # (matplotlib)
    if summary or compare:
        console.print(summary_table(trace, *([Trace.load(compare)] if compare else [])))
    for written in write_plots(trace, plot) if plot else []:
        console.print(f"wrote {written}")
    if chrome:
        with open(chrome, "w", encoding="utf-8") as f:
            json.dump(chrome_trace(trace), f)
        console.print(f"wrote {chrome} (open it in ui.perfetto.dev)")
    if step is None and not (summary or plot or chrome or compare):
        play(trace, speed, console)
