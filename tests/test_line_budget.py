"""The published line budget (README): nanoserve stays small enough to read in an afternoon.
Each layer file must fit in one sitting, and the whole package under a fixed total."""

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "nanoserve"
MAX_LINES_PER_FILE = 400
# 5000 until `nanoserve trace --compare` (a learner's run beside the reference run) took 10 more.
MAX_LINES_TOTAL = 5010


def test_line_budget():
    sizes = {p.relative_to(PACKAGE.parent).as_posix(): len(p.read_text().splitlines())
             for p in PACKAGE.rglob("*.py")}
    too_long = {name: n for name, n in sizes.items() if n > MAX_LINES_PER_FILE}
    assert not too_long, f"over {MAX_LINES_PER_FILE} lines: {too_long}"
    assert sum(sizes.values()) <= MAX_LINES_TOTAL, sizes
