"""replay.py: `nanoserve trace FILE`, a step-by-step replay of what the engine did.

A trace (ARCHITECTURE.md, The trace format; from `--trace run.jsonl`) has one JSON event per
line. nanoserve/trace.py reads it (`Trace`: the state after every step, rebuilt from the file
alone, never the engine); this module draws those frames in the terminal: which request holds
which KV block, who waits, who runs, how the token budget was spent.

    nanoserve trace traces/preemption_storm.jsonl            # animated; keys: space n b q
    nanoserve trace traces/preemption_storm.jsonl --step 12  # one frame, then exit (no TTY needed)
    nanoserve trace run.jsonl --summary --plot figs/ --chrome run.chrome.json

The summary, figures and Chrome trace are replay_plots.py's; cli.py calls both modules, and
neither imports the other.
"""

from __future__ import annotations

import os
import select
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

from rich.columns import Columns
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from nanoserve.trace import Frame, Trace

# What a request did in a step: timeline glyph and colour.
GLYPHS = {"wait": ("·", "grey50"), "prefill": ("▒", "yellow"), "decode": ("█", "green"),
          "preempt": ("✗", "bold red"), "finish": ("✓", "bold cyan"), None: (" ", "")}
PALETTE = ("red", "green", "yellow", "blue", "magenta", "cyan", "orange3", "purple", "gold3",
           "bright_red", "bright_green", "bright_blue", "bright_magenta", "turquoise2")
MAX_ROWS = 20          # timeline rows; the requests active at the frame's step come first
MAX_GRID_BLOCKS = 512  # a big pool shows its first blocks (the free queue hands out low ids first)


@dataclass
class Layout:
    """How a trace is drawn: each request's colour, the width of the label column, and how
    many blocks the grid shows."""
    colours: dict[str, str]
    label_width: int
    grid_blocks: int

    @classmethod
    def of(cls, trace: Trace) -> "Layout":
        colours = {rid: PALETTE[i % len(PALETTE)] for i, rid in enumerate(trace.requests)}
        label_width = max((len(r.label) for r in trace.requests.values()), default=1)
        grid_blocks = min(trace.num_blocks, MAX_GRID_BLOCKS, max(trace.max_block + 16, 64))
        return cls(colours, label_width, grid_blocks)


# -- rendering ---------------------------------------------------------------
def _timeline(trace: Trace, layout: Layout, frame: Frame, width: int) -> Panel:
    lw = layout.label_width
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
        table.add_row(Text(r.label.rjust(lw), style=f"bold {layout.colours[r.req]}"), row,
                      Text(status, style="grey62"))
    if hidden:
        table.add_row("", Text(f"... {hidden} more requests", style="grey50"), "")
    legend = "  ".join(f"[{style}]{g}[/] {k}" for k, (g, style) in GLYPHS.items() if k)
    return Panel(table, title=f"requests · steps {first}-{frame.step}", title_align="left",
                 subtitle=legend, subtitle_align="left")


def _pool(trace: Trace, layout: Layout, frame: Frame) -> Panel:
    w, cols = layout.label_width + 1, 16 if layout.label_width <= 2 else 8
    text = Text()
    for start in range(0, layout.grid_blocks, cols):
        text.append(f"{start:>4} │ ", style="grey50")
        for b in range(start, min(start + cols, layout.grid_blocks)):
            h = frame.holders.get(b)
            if h:      # coloured by its first holder; "+" and underlined when shared
                cell = trace.requests[h[0]].label + ("+" if len(h) > 1 else "")
                style = f"{'bold underline ' if len(h) > 1 else ''}black on {layout.colours[h[0]]}"
            else:
                cell, style = ("c", "bold green") if b in frame.cached else ("·", "grey37")
            text.append(cell.rjust(w), style).append(" ")
        text.append("\n")
    if layout.grid_blocks < trace.num_blocks:
        text.append(f"  blocks {layout.grid_blocks}-{trace.num_blocks - 1}: not shown\n", "grey50")
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
    if frame.spec:
        g.add_row("drafts", f"{frame.spec[1]} of {frame.spec[0]} accepted (speculative decoding)")
    used, cached = len(frame.holders), len(frame.cached)
    g.add_row("KV blocks", _bar([(used, "█", "magenta"), (cached, "▒", "green")],
                                trace.num_blocks))
    g.add_row("", f"used {used} · free {trace.num_blocks - used} ({cached} of them cached)")
    for note in frame.notes:
        g.add_row("", Text(note, style="bold red" if "preempted" in note else "cyan"))
    return Panel(g, title="queues and budget", title_align="left")


def render(trace: Trace, frame: Frame, width: int = 100, hint: str = "") -> Group:
    """The three panels of one frame (and a line of help under them in the live replay)."""
    layout = Layout.of(trace)
    below = Columns([_pool(trace, layout, frame), _queues(trace, frame)])   # side by side if room
    return Group(_timeline(trace, layout, frame, width), below,
                 *([Text(hint, "grey50")] if hint else []))


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


def main(path: str, step: Optional[int] = None, speed: float = 4.0, animate: bool = True,
         console: Optional[Console] = None) -> Trace:
    """`nanoserve trace`'s replay: the frame of `step` if given, else (when `animate`) the
    animation. Returns the trace, for the other outputs (replay_plots.py; cli.py asks)."""
    if speed <= 0:
        raise ValueError(f"speed must be > 0 steps per second (got {speed})")
    trace, console = Trace.load(path), console or Console()
    if step is not None:
        console.print(render(trace, trace.frame(step), console.width))
    elif animate:
        play(trace, speed, console)
    return trace
