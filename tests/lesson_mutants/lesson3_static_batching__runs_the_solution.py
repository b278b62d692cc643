"""Wrong answer to exercise 3.4: loads the reference solution from its file and hands every step
to it; the method is written here, the work is not."""

import importlib.util
from pathlib import Path

_path = Path(__file__).resolve().parents[2] / "lessons" / "solutions" / "lesson3_static_batching.py"
_spec = importlib.util.spec_from_file_location("static_reference", _path)
_reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_reference)


class StaticBatchScheduler(_reference.StaticBatchScheduler):
    def schedule(self):
        return super().schedule()
