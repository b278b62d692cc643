"""`nanoserve trace` (trace.py's reader, replay.py, replay_plots.py): the state it rebuilds
from a trace file equals the live KV manager's state after every step (the oracle: the
model-free scheduler of fake_engine.py, driven the way EngineCore.step() drives it); the
summary equals numbers worked out by hand on a small trace; the figures and Chrome JSON are
written; a malformed line gets an error that names it.

    pytest -q tests/test_replay.py
"""

import dataclasses
import io
import json
import random
import re

import pytest
from rich.console import Console

from fake_engine import FakeRunner, make_request, make_scheduler
from nanoserve import cli
from nanoserve.tools.replay import Layout, main, render
from nanoserve.tools.replay_plots import chrome_trace, summary, summary_table, write_plots
from nanoserve.trace import Trace, Tracer


def traced_run(path, num_blocks=20, block_size=4, seed=1, **cfg):
    """Run a shared-prefix workload (some requests arrive after step 3) through the
    scheduler, writing a trace the way EngineCore does (config, ..., step_done). Returns
    the scheduler and, per step, the live truth: block -> holders, cached free blocks, and
    the requests that sampled a token."""
    rng = random.Random(seed)
    prefix = [rng.randrange(50) for _ in range(12)]
    spec = [(f"r{i}", prefix + [rng.randrange(50) for _ in range(rng.randint(1, 30))],
             rng.randint(1, 25)) for i in range(12)]
    tracer = Tracer(str(path))
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size, tracer=tracer, **cfg)
    tracer.emit("config", **dataclasses.asdict(sched.config))
    runner = FakeRunner(num_blocks, block_size)
    for s in spec[:8]:
        sched.add_request(make_request(*s))
    truth = {}
    while sched.has_unfinished_requests():
        if sched.num_steps == 3:
            for s in spec[8:]:
                sched.add_request(make_request(*s))
        out = sched.schedule()
        sampled = runner.execute(out)
        sched.update(out, sampled)
        tracer.emit("step_done", duration_s=0.001, sampled=sampled)
        owners: dict[int, set] = {}
        for rid, block_ids in sched.kv.req_to_block_ids.items():
            for b in block_ids:
                owners.setdefault(b, set()).add(rid)
        cached = {b.block_id for b in sched.kv.pool.free_queue.values() if b.block_hash is not None}
        truth[sched.num_steps] = (owners, cached, set(sampled))
    tracer.close()
    return sched, truth


def test_every_frame_equals_the_live_kv_state(tmp_path):
    sched, truth = traced_run(tmp_path / "t.jsonl")
    trace = Trace.load(str(tmp_path / "t.jsonl"))
    events = {json.loads(line)["ev"] for line in (tmp_path / "t.jsonl").read_text().splitlines()}
    assert {"prefix_hit", "preempt", "evict"} <= events       # the workload exercises them all
    assert sorted(trace.frames) == [0, *truth]
    for step, (owners, cached, sampled) in truth.items():
        frame = trace.frame(step)
        assert {b: set(h) for b, h in frame.holders.items()} == owners, step
        assert frame.cached == cached, step
        assert {r.req for r in trace.requests.values() if step in r.token_steps} == sampled, step
    assert any(len(h) > 1 for owners, _, _ in truth.values() for h in owners.values())
    assert sum(len(r.preempt_steps) for r in trace.requests.values()) == sched.num_preemptions_total
    assert trace.prefix_hits == sched.kv.prefix_cache_hits
    assert trace.prefix_queries == sched.kv.prefix_cache_queries


def grid_cells(text: str, trace: Trace) -> dict[int, str]:
    """The block grid of a rendered frame: block id -> what its cell shows."""
    cells, layout = {}, Layout.of(trace)
    for start, rest in re.findall(r"^│\s+(\d+) │(.*)$", text, re.M):
        n = min(16 if layout.label_width <= 2 else 8, layout.grid_blocks - int(start))
        cells.update({int(start) + i: tok for i, tok in enumerate(rest.split()[:n])})
    return cells


def test_frame_shows_the_block_owners_the_trace_gives(tmp_path):
    _, truth = traced_run(tmp_path / "t.jsonl")
    trace = Trace.load(str(tmp_path / "t.jsonl"))
    # the step with the most shared blocks, so that "+" cells are checked too
    step = max(truth, key=lambda s: sum(len(h) > 1 for h in truth[s][0].values()))
    console = Console(width=140, record=True, file=io.StringIO(), color_system=None)
    console.print(render(trace, trace.frame(step), console.width))
    cells = grid_cells(console.export_text(), trace)
    owners, cached, _ = truth[step]
    assert sorted(cells) == list(range(Layout.of(trace).grid_blocks)) == list(range(20))
    for b, cell in cells.items():
        if b in owners:
            assert cell.rstrip("+") in owners[b] and cell.endswith("+") == (len(owners[b]) > 1)
        else:
            assert cell == ("c" if b in cached else "·"), b


# A trace small enough to check by hand: block_size 4, 4 blocks, budget 8 tokens. r1 and r2
# (5-token prompts) share step 1 (r2 gets a 3-token chunk); r1 finishes at step 2 and its
# full block 0 stays cached; r3 arrives after step 2 and hits it.
HAND = [
    dict(ev="config", step=0, t=0.0, num_kv_blocks=4, block_size=4, max_num_batched_tokens=8,
         enable_prefix_caching=True),
    dict(ev="arrive", step=0, t=0.0, req="r1", prompt_len=5, max_tokens=2),
    dict(ev="arrive", step=0, t=0.0, req="r2", prompt_len=5, max_tokens=2),
    dict(ev="alloc", step=1, t=0.1, req="r1", blocks=[0, 1]),
    dict(ev="alloc", step=1, t=0.1, req="r2", blocks=[2]),
    dict(ev="schedule", step=1, t=0.1, scheduled={"r1": 5, "r2": 3}, running=["r1", "r2"],
         waiting=[], num_prefill_tokens=8, num_decode_tokens=0, kv_used=3, kv_free=1, kv_cached=0),
    dict(ev="step_done", step=1, t=0.2, duration_s=0.1, sampled={"r1": [7]}),
    dict(ev="alloc", step=2, t=0.3, req="r2", blocks=[3]),
    dict(ev="schedule", step=2, t=0.3, scheduled={"r1": 1, "r2": 2}, running=["r1", "r2"],
         waiting=[], num_prefill_tokens=2, num_decode_tokens=1, kv_used=4, kv_free=0, kv_cached=0),
    dict(ev="free", step=2, t=0.4, req="r1", blocks=[1, 0]),
    dict(ev="finish", step=2, t=0.4, req="r1", reason="length", prompt_len=5, output_len=2),
    dict(ev="step_done", step=2, t=0.4, duration_s=0.1, sampled={"r1": [8], "r2": [9]}),
    dict(ev="arrive", step=2, t=0.45, req="r3", prompt_len=5, max_tokens=2),
    dict(ev="prefix_hit", step=3, t=0.5, req="r3", blocks=[0], tokens=4),
    dict(ev="alloc", step=3, t=0.5, req="r3", blocks=[1]),
    dict(ev="schedule", step=3, t=0.5, scheduled={"r2": 1, "r3": 1}, running=["r2", "r3"],
         waiting=[], num_prefill_tokens=1, num_decode_tokens=1, kv_used=4, kv_free=0, kv_cached=0),
    dict(ev="grammar_bitmask", step=3, t=0.5, reqs=["r3"]),     # r3 has a grammar (and r2 not)
    dict(ev="free", step=3, t=0.6, req="r2", blocks=[3, 2]),
    dict(ev="finish", step=3, t=0.6, req="r2", reason="length", prompt_len=5, output_len=2),
    dict(ev="step_done", step=3, t=0.65, duration_s=0.15, sampled={"r2": [1], "r3": [2]}),
    dict(ev="schedule", step=4, t=0.7, scheduled={"r3": 1}, running=["r3"], waiting=[],
         num_prefill_tokens=0, num_decode_tokens=1, kv_used=2, kv_free=2, kv_cached=1),
    dict(ev="grammar_bitmask", step=4, t=0.7, reqs=["r3"]),
    dict(ev="free", step=4, t=0.8, req="r3", blocks=[1, 0]),
    dict(ev="finish", step=4, t=0.8, req="r3", reason="length", prompt_len=5, output_len=2),
    dict(ev="step_done", step=4, t=0.8, duration_s=0.1, sampled={"r3": [3]}),
]


@pytest.fixture
def hand_trace(tmp_path):
    path = tmp_path / "hand.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in HAND))
    return str(path)


def test_hand_trace_frames_and_summary(hand_trace):
    trace = Trace.load(hand_trace)
    f2, f3, f4 = trace.frame(2), trace.frame(3), trace.frame(4)
    assert (f2.holders, f2.cached) == ({2: ["r2"], 3: ["r2"]}, {0})
    assert (f2.running, f2.waiting) == (["r2"], ["r3"])
    assert (f3.holders, f3.cached) == ({0: ["r3"], 1: ["r3"]}, {2})
    assert (f4.holders, f4.cached) == ({}, {0, 2})
    r3 = trace.requests["r3"]
    assert (r3.work, r3.token_steps) == ({3: "prefill", 4: "decode"}, [3, 4])   # last prompt token
    assert [trace.requests["r2"].kind(s) for s in (1, 2, 3)] == ["prefill", "prefill", "finish"]
    s = summary(trace)
    assert (s["requests"], s["finished"], s["steps"], s["preemptions"]) == (3, {"length": 3}, 4, 0)
    assert s["prefix_hit_rate"] == pytest.approx(4 / 15)            # 4 of 3 x 5 prompt tokens
    assert s["mean_batch_size"] == pytest.approx(7 / 4)             # 2 + 2 + 2 + 1 requests
    assert s["mean_tokens_per_step"] == pytest.approx(14 / 4)       # 8 + 3 + 2 + 1 tokens
    assert s["output_tokens"] == 6
    assert (s["structured_requests"], s["masked_steps"]) == (1, 2)     # r3, at steps 3 and 4
    # first tokens at step ends: r1 0.2 - 0, r2 0.4 - 0, r3 0.65 - 0.45
    assert s["ttft_s"] == pytest.approx({"p50": 0.2, "p90": 0.36, "p99": 0.396})
    # gaps: r1 0.4 - 0.2, r2 0.65 - 0.4, r3 0.8 - 0.65
    assert s["itl_s"] == pytest.approx({"p50": 0.2, "p90": 0.24, "p99": 0.249})
    # finish - arrive: 0.4, 0.6, 0.35
    assert s["e2e_s"]["p50"] == pytest.approx(0.4)


def test_plots_and_chrome_trace(tmp_path):
    traced_run(tmp_path / "t.jsonl")
    trace = Trace.load(str(tmp_path / "t.jsonl"))
    paths = write_plots(trace, str(tmp_path / "figs"))
    assert [p.rsplit("/", 1)[1] for p in paths] == ["gantt.png", "kv_blocks.png", "tokens.png",
                                                    "latency_cdf.png"]
    for p in paths:
        data = open(p, "rb").read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, p
    chrome = json.loads(json.dumps(chrome_trace(trace)))
    slices = [e for e in chrome["traceEvents"] if e["ph"] == "X" and e["tid"] > 0]
    schedules = [f.schedule for f in trace.frames.values() if f.schedule]
    assert len(slices) == sum(len(s["scheduled"]) for s in schedules)
    assert {e["name"] for e in slices} == {"prefill", "decode"}
    assert sum(e["name"] == "preempt" for e in chrome["traceEvents"]) == sum(
        len(r.preempt_steps) for r in trace.requests.values())


@pytest.mark.parametrize("damage, message", [
    (lambda lines: lines[:-1] + [lines[-1][:30]], r":25: not valid JSON .* truncated"),
    (lambda lines: lines[:4] + [lines[4].replace('"blocks"', '"blokcs"')] + lines[5:],
     r":5: the 'alloc' event lacks blocks"),
    (lambda lines: lines[:9] + [lines[9].replace("[1, 0]", "[1, 2]")] + lines[10:],
     r":10: inconsistent event: .*r1 frees block 2, which it does not hold"),
    (lambda lines: lines[:6] + [lines[6].replace('"step": 1', '"step": 0')] + lines[7:],
     r":7: step 0 comes after step 1: steps never go back"),
    (lambda lines: lines[:3] + [lines[3].replace("[0, 1]", '"0, 1"')] + lines[4:],
     r":4: the 'alloc' event.s blocks: wrong type"),
])
def test_malformed_trace_names_the_line(hand_trace, damage, message, capsys):
    lines = open(hand_trace).read().splitlines()
    with open(hand_trace, "w") as f:
        f.write("\n".join(damage(lines)) + "\n")
    with pytest.raises(ValueError, match=re.escape(hand_trace) + message):
        Trace.load(hand_trace)
    with pytest.raises(SystemExit, match="nanoserve: error: .*" + message):
        cli.main(["trace", hand_trace, "--step", "1"])


def test_cli_step_summary_and_animation(hand_trace, tmp_path, capsys):
    chrome = str(tmp_path / "c.json")
    cli.main(["trace", hand_trace, "--step", "3", "--summary", "--chrome", chrome])
    out = capsys.readouterr().out
    assert "step      3 of 4" in out and "r1 finished" not in out and "r2 finished" in out
    assert "prefix cache hit rate" in out and "26.7%" in out
    assert json.loads(open(chrome).read())["traceEvents"]
    with pytest.raises(SystemExit, match="step 9 is not in .* steps 0..4"):
        cli.main(["trace", hand_trace, "--step", "9"])
    # No option: the animation, which without a TTY just plays every frame through.
    console = Console(width=100, file=io.StringIO(), color_system=None)
    main(hand_trace, speed=1000.0, console=console)
    assert "step      4 of 4" in console.file.getvalue()


def test_compare_puts_two_summaries_side_by_side(hand_trace, tmp_path, capsys):
    traced_run(tmp_path / "t.jsonl")
    other = summary(Trace.load(str(tmp_path / "t.jsonl")))
    cli.main(["trace", hand_trace, "--compare", str(tmp_path / "t.jsonl")])
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:4]]
            for line in capsys.readouterr().out.splitlines() if line.count("│") == 4}
    assert rows["steps"] == ["4", str(other["steps"])]
    assert rows["preemptions"] == ["0", str(other["preemptions"])]
    assert rows["prefix cache hit rate"][0] == "26.7% of prompt tokens"


def test_expert_load_summary_and_figure(hand_trace, tmp_path):
    """A mixture of experts' trace: 2 MoE layers of 4 experts. Layer 0's totals [4, 4, 4, 4] are
    even (imbalance 1.0); layer 1's [8, 4, 4, 0] give max / mean = 8 / 4 = 2.0."""
    loads = {1: [[2, 2, 2, 2], [4, 2, 2, 0]], 2: [[1, 1, 1, 1], [3, 1, 0, 0]],
             3: [[1, 1, 1, 1], [1, 1, 2, 0]]}
    lines = open(hand_trace).read().splitlines()
    out = []
    for line in lines:
        out.append(line)
        e = json.loads(line)
        if e["ev"] == "step_done" and e["step"] in loads:
            out.append(json.dumps(dict(ev="expert_load", step=e["step"], t=e["t"],
                                       counts=loads[e["step"]])))
    path = tmp_path / "moe.jsonl"
    path.write_text("\n".join(out) + "\n")
    trace = Trace.load(str(path))
    load = summary(trace)["expert_load"]
    assert load["totals"] == [[4, 4, 4, 4], [8, 4, 4, 0]]
    assert load["imbalance"] == pytest.approx([1.0, 2.0])
    assert summary(Trace.load(hand_trace))["expert_load"] is None     # a dense model's trace
    paths = write_plots(trace, str(tmp_path / "figs"))
    assert paths[-1].endswith("expert_load.png") and open(paths[-1], "rb").read()[:4] == b"\x89PNG"
    console = Console(width=200, file=io.StringIO(), color_system=None)
    console.print(summary_table(trace))
    assert ("4 experts x 2 MoE layers; imbalance (max/mean) 1.50 on average, 2.00 at worst "
            "(MoE layer 1)") in console.file.getvalue()
    # A step whose counts change shape is named, not a crash.
    bad = [line.replace("[[1, 1, 1, 1], [1, 1, 2, 0]]", "[[1, 1, 1], [1, 1, 2, 0]]") for line in out]
    path.write_text("\n".join(bad) + "\n")
    with pytest.raises(ValueError, match="counts change shape"):
        Trace.load(str(path))
    for empty in ("[]", "[[], []]"):     # nothing to summarise: named, not an IndexError later
        path.write_text("\n".join(line.replace("[[1, 1, 1, 1], [1, 1, 2, 0]]", empty) for line in out) + "\n")
        with pytest.raises(ValueError, match="non-empty lists"):
            Trace.load(str(path))
