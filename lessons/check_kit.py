"""check_kit.py: what every lesson check uses: import a file by path, fail with a message,
the model-free engine. (lessons/checks.py puts this folder on sys.path.)"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

LESSONS = Path(__file__).resolve().parent


def load(path: Path):
    """Import a Python file by its path (exercise files need not be on sys.path)."""
    name = f"_lesson_{path.parent.name}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)   # (dataclasses need it)
    spec.loader.exec_module(module)
    return module


def fake_engine():
    return load(LESSONS.parent / "tests" / "fake_engine.py")


def expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)
