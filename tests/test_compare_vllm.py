"""test_compare_vllm.py: scripts/compare_vllm.py's protocol, without vLLM: the engines take turns,
the vLLM side is driven line by line (a stand-in script here), a failure shows vLLM's log, the
CPU time of a waiting engine's processes is read from /proc, and a paused vLLM side uses none and
does not outlive a killed script.

Run: pytest -q tests/test_compare_vllm.py      (a few seconds)
"""

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
spec = importlib.util.spec_from_file_location("compare_vllm", ROOT / "scripts" / "compare_vllm.py")
compare_vllm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_vllm)

# Stands in for vLLM: log lines first, READY once started, then one RESULT per line it is sent.
FAKE_SIDE = r"""
import json, sys
spec = json.load(open(sys.argv[1]))
print("INFO a log line that is not the answer", flush=True)
print("READY", flush=True)
for i, _ in enumerate(sys.stdin):
    print("INFO step", flush=True)
    print("RESULT", json.dumps({"output_tok_s": spec["speeds"][i]}), flush=True)
"""


def test_engines_take_turns_first_place_alternating():
    calls = []
    compare_vllm.take_turns(4, lambda: calls.append("ours"), lambda: calls.append("theirs"),
                            lambda i: calls.append(f"report {i}"))
    assert calls == ["ours", "theirs", "report 0", "theirs", "ours", "report 1",
                     "ours", "theirs", "report 2", "theirs", "ours", "report 3"]


def test_vllm_side_is_driven_one_run_per_line(tmp_path):
    engine = compare_vllm.EngineProcess(sys.executable, {"speeds": [101.5, 99.0, 103.25]},
                                     str(tmp_path), side=FAKE_SIDE)
    try:
        assert [engine.run() for _ in range(3)] == [101.5, 99.0, 103.25]
    finally:
        engine.close()
    assert engine.proc.returncode == 0          # EOF on its stdin ended it


def test_a_failing_vllm_side_shows_its_log(tmp_path):
    side = "import sys\nprint('no module named vllm', file=sys.stderr)\nsys.exit(1)\n"
    with pytest.raises(SystemExit, match="no module named vllm"):
        compare_vllm.EngineProcess(sys.executable, {}, str(tmp_path), side=side)


def test_cpu_seconds_of_a_process_group():
    busy = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 0.5\n"
                             "while time.time() < end: pass\ntime.sleep(30)"],
                            start_new_session=True)
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                            start_new_session=True)
    try:
        time.sleep(1.0)
        assert compare_vllm.group_cpu_seconds(busy.pid) >= 0.3
        assert compare_vllm.group_cpu_seconds(idle.pid) < 0.2
    finally:
        busy.kill(), idle.kill()


def test_a_vllm_side_that_does_not_stop_is_killed_on_close(tmp_path, monkeypatch):
    side = "import sys, time\nprint('READY', flush=True)\nsys.stdin.read()\ntime.sleep(60)\n"
    monkeypatch.setattr(compare_vllm, "CLOSE_TIMEOUT_S", 0.5)
    engine = compare_vllm.EngineProcess(sys.executable, {}, str(tmp_path), side=side)
    start = time.perf_counter()
    engine.close()
    assert engine.proc.returncode == -9 and time.perf_counter() - start < 10


# Stands in for a vLLM that keeps a core busy while it waits for its next run.
SPINNING_SIDE = r"""
import json, sys, threading
threading.Thread(target=lambda: [None for _ in iter(int, 1)], daemon=True).start()
print("READY", flush=True)
for _ in sys.stdin:
    print("RESULT", json.dumps({"output_tok_s": 1.0}), flush=True)
"""


def test_a_paused_vllm_side_uses_no_cpu_and_runs_after(tmp_path):
    engine = compare_vllm.EngineProcess(sys.executable, {}, str(tmp_path), side=SPINNING_SIDE)
    cpu = lambda: compare_vllm.group_cpu_seconds(engine.proc.pid)   # noqa: E731
    try:
        with engine.paused():
            before = cpu()
            time.sleep(0.5)
            assert cpu() - before < 0.05
        before = cpu()
        time.sleep(0.5)
        assert cpu() - before > 0.2                  # running again: it spins
        assert engine.run() == 1.0
    finally:
        engine.close()


# Starts a stand-in, pauses it, prints its pid and waits: to be killed while vLLM is stopped.
PAUSING_PARENT = r"""
import importlib.util, sys, tempfile, time
spec = importlib.util.spec_from_file_location("compare_vllm", sys.argv[1])
compare_vllm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_vllm)
side = "import sys\nprint('READY', flush=True)\nfor _ in sys.stdin: pass\n"
engine = compare_vllm.EngineProcess(sys.executable, {}, tempfile.mkdtemp(), side=side)
print(engine.proc.pid, flush=True)
with engine.paused():
    time.sleep(60)
"""


def test_a_paused_vllm_side_does_not_outlive_a_killed_script(tmp_path):
    parent_script = tmp_path / "parent.py"
    parent_script.write_text(PAUSING_PARENT)
    parent = subprocess.Popen([sys.executable, str(parent_script), str(ROOT / "scripts" / "compare_vllm.py")],
                              stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.time() + 10
    while _running(child) and time.time() < deadline:
        time.sleep(0.1)
    alive = _running(child)
    if alive:
        subprocess.run(["kill", "-9", str(child)])
    assert not alive


def _running(pid: int) -> bool:
    """Whether pid exists and is not a zombie (one nobody has reaped yet has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
