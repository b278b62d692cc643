"""Wrong answer to exercise 10.4: loads the reference solution and hands both answers to it; the
functions are written here, the diagnosis is not."""

import importlib.util
from pathlib import Path

_path = Path(__file__).resolve().parents[2] / "lessons" / "solutions" / "lesson10_clinic.py"
_spec = importlib.util.spec_from_file_location("clinic_reference", _path)
_reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_reference)


def evidence(mystery: str) -> int:
    return _reference.evidence(mystery)


def prescribe(mystery: str) -> dict:
    return _reference.prescribe(mystery)
