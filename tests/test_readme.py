"""The README's test command is the one CI runs, the layer table names real files, and the
Japanese README (README.ja.md) shows the same two commands."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands(name: str = "README.md") -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / name).read_text(encoding="utf-8"))


def test_ci_runs_the_readme_test_command():
    main, tests = readme_commands()[:2]
    assert "nanoserve generate" in main and "pytest" in tests
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci_lines[-1] == tests


def test_layer_table_names_existing_files():
    for path in re.findall(r"\| `(nanoserve/[\w/]+\.py)` \|", (ROOT / "README.md").read_text()):
        assert (ROOT / path).is_file(), path


def test_japanese_readme_shows_the_same_two_commands():
    assert readme_commands("README.ja.md") == readme_commands()[:2]
    assert "](README.ja.md)" in (ROOT / "README.md").read_text()
