"""trace.py: the hook every layer reports to, so `nanoserve trace` can replay a run.

Off (the default), the tracer is `NULL_TRACER`, whose `enabled` is False: callers guard
the building of an event's fields with `if tracer.enabled:` so a run without a trace pays
one attribute check per event site and nothing else. On (`Config.trace = "run.jsonl"`),
every event is one JSON object per line with `ev`, `step` and `t` (seconds since the
engine started), plus the fields of design.md §8:

    {"ev": "alloc", "step": 3, "t": 0.0412, "req": "r1", "blocks": [5, 6]}

The scheduler advances `tracer.step` at the start of each step, so every event carries
the step it belongs to. Events are flushed at the end of each step, not per line.
"""

from __future__ import annotations

import json
import time
from typing import Any


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
