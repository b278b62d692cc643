"""The README's test command is the one CI runs, and the layer table names real files."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_ci_runs_the_readme_test_command():
    main, tests = readme_commands()[:2]
    assert "nanoserve generate" in main and "pytest" in tests
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci_lines[-1] == tests


def test_layer_table_names_existing_files():
    for path in re.findall(r"\| `(nanoserve/[\w/]+\.py)` \|", (ROOT / "README.md").read_text()):
        assert (ROOT / path).is_file(), path
