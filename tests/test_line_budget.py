"""The published line budget (README): nanoserve stays small enough to read in an afternoon.
Each layer file must fit in one sitting, and the whole package under a fixed total."""

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "nanoserve"
MAX_LINES_PER_FILE = 400
# 5,000 until the CPU GEMM paths (models/linear.py: oneDNN packing chosen by timing at start-up)
# needed a file of their own; the process layout and tensor parallel need more room again:
# 5,400 -> 5,600 for tensor parallel (executor.py: worker processes and their supervision;
# distributed.py: the collectives; the shard-aware loader in models/llama.py).
MAX_LINES_TOTAL = 5600


def test_line_budget():
    sizes = {p.relative_to(PACKAGE.parent).as_posix(): len(p.read_text().splitlines())
             for p in PACKAGE.rglob("*.py")}
    too_long = {name: n for name, n in sizes.items() if n > MAX_LINES_PER_FILE}
    assert not too_long, f"over {MAX_LINES_PER_FILE} lines: {too_long}"
    assert sum(sizes.values()) <= MAX_LINES_TOTAL, sizes
