"""The lessons (lessons/): every code citation resolves, every command runs in bounded time,
every image is regenerable, every exercise check passes on its solution and fails on its
starter saying what to implement, and the layer files and the READMEs point to the lessons.

The commands are the lessons' own, run through the same parser and runner as
scripts/make_lesson_assets.py (the outputs in the lessons are not compared: they are whatever
that script last recorded, and timings differ from run to run)."""

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"_test_{path.stem}", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


assets = _load(ROOT / "scripts" / "make_lesson_assets.py")
checks = _load(ROOT / "lessons" / "checks.py")

LESSONS = assets.lesson_files()
PARTS = ("## The idea", "## Read the code", "## Run it", "## Exercises")
CITATION = re.compile(r"`(nanoserve/[\w/]+\.py):([\w.]+)`")
EXERCISE = re.compile(r"^### Exercise (\d+)\.(\d) \((predict, then check|build)\)", re.M)
# The layer files each lesson is about: their module docstrings point back to it.
LAYERS = {"api.py": [1], "engine.py": [1], "engine_core.py": [1], "kv_cache.py": [2, 4, 5],
          "paged_attention.py": [2], "scheduler.py": [3, 4], "config.py": [6, 7], "model_runner.py": [6],
          "model_loader.py": [6], "sampler.py": [7], "structured_output.py": [7],
          "spec_decode.py": [8], "models/mixture_of_experts.py": [9]}
# Commands whose output does not depend on the machine or the clock: what the lesson shows must
# be what they print today, so every figure in those outputs is checked.
DETERMINISTIC = ("nanoserve memory", "nanoserve cost")
# Figures quoted in a lesson's prose that one of its deterministic outputs must show.
FIGURES = {"06": ["21.60 GiB", "14.96 GiB", "0.55 GiB", "6.09 GiB", "3,119", "49,904",
                  "131,072", "$0.15", "$0.60", "$2.69", "86,400", "$810.00", "$1,936.80",
                  "432,000", "239,111", "23.1%"]}
# Figures in lessons 02-05's prose that a workload report or a trace frame must show (those
# outputs are checked against today's runs, timings masked: test_every_command_runs). Figures
# derived from them (sums, ratios) are recomputed in test_derived_figures_in_the_text.
FIGURES.update({
    "02": ["332 tokens", "384 slots", "86% used", "2048 slots", "16% used"],
    "04": ["240 computed tokens", "48 of 440 prompt tokens hit"],
    "05": ["448 of 640 prompt tokens"],
})
# Lesson 6's quantization section (issue 40): Llama-3-8B on 16 GiB in int8, one GPU and two.
FIGURES["06"] += ["14.40 GiB", "8.47 GiB", "2,758", "7.48 GiB", "6,789", "4.23 GiB", "10,115"]
COMMAND_LIMIT_S = 60        # "under a minute on a laptop CPU", each
TOTAL_LIMIT_S = 410         # every command and image of all ten lessons together (lesson 9: ~15 s,
                            # lesson 10: ~35 s)
seconds_per_lesson: dict[str, float] = {}


def is_stable(command: str) -> bool:
    """Workload reports and trace frames: steps, tokens, blocks, hits and preemptions are the same
    on every machine (model text is not: float rounding differs between CPUs)."""
    return (("lessons/workload.py" in command or command.startswith("nanoserve trace"))
            and "--show" not in command and "--plot" not in command)


def stable(output: str) -> str:
    """An output without its timings: the latency, time and per-step lines, `t = ... s` and the
    milliseconds of `--debug 1` lines."""
    lines = [line for line in output.splitlines()
             if not line.startswith(("latency (ms)", "time ", "per step (ms)"))]
    text = "\n".join(lines)
    return re.sub(r"t = [\d.]+ s *", "t = ", re.sub(r"[\d.]+ ms", "ms", text))


def section(text: str, heading: str) -> str:
    start = text.index(heading)
    following = [text.index(h) for h in PARTS if h in text and text.index(h) > start]
    return text[start:min(following, default=len(text))]


def defines(path: Path, dotted: str) -> bool:
    """Whether the file defines `dotted` (a function, class or assignment; Class.member)."""
    body = ast.parse(path.read_text()).body
    for name in dotted.split("."):
        found = None
        for node in body:
            names = [node.name] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                     ast.ClassDef)) else []
            if isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names = [node.target.id]
            if name in names:
                found = node
        if found is None:
            return False
        body = getattr(found, "body", [])
    return True


def test_ten_lessons_each_with_the_four_parts():
    assert [p.name[:2] for p in LESSONS] == ["01", "02", "03", "04", "05", "06", "07", "08", "09",
                                             "10"]
    for path in LESSONS:
        text = path.read_text()
        positions = [text.find(h) for h in PARTS]
        assert -1 not in positions and positions == sorted(positions), f"{path.name}: {PARTS}"
        assert len(CITATION.findall(section(text, "## Read the code"))) >= 5, path.name
        run = assets.parse(section(text, "## Run it").splitlines())
        assert any(p.kind == "command" for p in run), f"{path.name}: no command to run"
        assert any(p.kind == "image" for p in run), f"{path.name}: no replay frame or figure"
        kinds = [k for _, _, k in EXERCISE.findall(section(text, "## Exercises"))]
        assert len(kinds) >= 3 and set(kinds) == {"predict, then check", "build"}, path.name


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name[:2])
def test_every_citation_resolves(path):
    citations = CITATION.findall(path.read_text())
    missing = [f"{f}:{s}" for f, s in citations
               if not (ROOT / f).is_file() or not defines(ROOT / f, s)]
    assert not missing, f"{path.name} cites code that does not exist: {missing}"


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name[:2])
def test_every_command_runs(path, tmp_path):
    """Every command and image of the lesson, in order (later ones read earlier traces), then
    the figures of its Japanese translation (its commands are these: tests/test_lessons_ja.py)."""
    total = 0.0
    for part in assets.parse(path.read_text().splitlines()):
        if part.kind == "image":
            seconds = assets.make_image(part, tmp_path / Path(part.image).name, COMMAND_LIMIT_S)
            assert (tmp_path / Path(part.image).name).stat().st_size > 1000, part.command
        else:
            code, out, seconds = assets.run(part.command, COMMAND_LIMIT_S)
            if part.expects_error:     # the lesson shows an error on purpose: it must still be one
                assert code != 0 and "error:" in out.splitlines()[-1], (part.command, out)
            else:
                assert code == 0, f"{part.command}\n{out}"
            if part.command.startswith(DETERMINISTIC):
                assert out == part.output, f"{part.command}: the lesson shows an old output"
            elif is_stable(part.command):
                assert stable(out) == stable(part.output), \
                    f"{part.command}: the lesson shows an old output (timings aside)"
        assert seconds < COMMAND_LIMIT_S, part.command
        total += seconds
    (tmp_path / "ja").mkdir()
    for part in assets.japanese_figures(path):   # lessons/ja/'s figures, from the traces just made
        total += assets.make_image(part, tmp_path / "ja" / Path(part.image).name, COMMAND_LIMIT_S)
        assert (tmp_path / "ja" / Path(part.image).name).stat().st_size > 1000, part.command
    seconds_per_lesson[path.name] = total


def test_all_commands_within_the_total_budget():
    if len(seconds_per_lesson) < len(LESSONS):
        pytest.skip("needs every lesson's commands to have run in this session")
    assert sum(seconds_per_lesson.values()) < TOTAL_LIMIT_S, seconds_per_lesson


def test_images_are_in_the_repo_and_regenerable():
    referenced = set()
    for path in LESSONS:
        text = path.read_text()
        marked = {p.image for p in assets.parse(text.splitlines()) if p.kind == "image"}
        refs = set(assets.IMAGE_REF.findall(text))
        assert refs == marked, f"{path.name}: images without an <!-- image: --> marker"
        referenced |= refs
    for image in referenced:
        assert (ROOT / "lessons" / image).stat().st_size > 1000, image
    on_disk = {f"img/{p.name}" for p in (ROOT / "lessons" / "img").iterdir()}
    assert on_disk == referenced, f"unreferenced images: {on_disk - referenced}"


def test_build_exercises_are_the_checked_ones():
    built = {f"{n}.{k}" for p in LESSONS for n, k, kind in EXERCISE.findall(p.read_text())
             if kind == "build"}
    assert built == set(checks.EXERCISES)
    for eid in checks.EXERCISES:
        lesson = next(p for p in LESSONS if p.name.startswith(f"{eid.split('.')[0]:0>2}-"))
        assert f"nanoserve exercise check {eid}" in lesson.read_text(), eid
        assert checks.path_of(eid).is_file() and checks.path_of(eid, solution=True).is_file()


@pytest.mark.parametrize("eid", list(checks.EXERCISES))
def test_exercise_passes_on_its_solution(eid):
    said = []
    assert checks.check(eid, solution=True, say=said.append), "\n".join(said)


@pytest.mark.parametrize("eid", list(checks.EXERCISES))
def test_unimplemented_starter_fails_saying_what_to_implement(eid):
    said = []
    assert not checks.check(eid, say=said.append)
    assert "not implemented yet: implement" in "\n".join(said), said


def test_cli_exercise_check(capsys, monkeypatch):
    from nanoserve.cli import main
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as passed:
        main(["exercise", "check", "7.3", "--solution"])
    with pytest.raises(SystemExit) as failed:
        main(["exercise", "check", "7.3"])
    out = capsys.readouterr().out
    assert (passed.value.code, failed.value.code) == (0, 1)
    assert "passed" in out and "not implemented yet" in out
    with pytest.raises(SystemExit, match="exercise must be one of"):
        main(["exercise", "check", "9.9"])


def test_layer_files_and_lessons_point_to_each_other():
    for name, numbers in LAYERS.items():
        doc = ast.get_docstring(ast.parse((ROOT / "nanoserve" / name).read_text()))
        for n in numbers:
            lesson = next(p for p in LESSONS if p.name.startswith(f"0{n}"))
            assert f"lessons/{lesson.name}" in doc, f"{name}'s docstring lacks {lesson.name}"
            assert f"nanoserve/{name}:" in lesson.read_text(), f"{lesson.name} cites no {name}"


def test_readmes_link_every_lesson():
    readme = (ROOT / "README.md").read_text()
    index = (ROOT / "lessons" / "README.md").read_text()
    for path in LESSONS:
        assert f"(lessons/{path.name})" in readme, f"README.md does not link {path.name}"
        assert f"({path.name})" in index, f"lessons/README.md does not link {path.name}"


def shown_outputs(path: Path) -> tuple[list[str], str]:
    """(the lesson's checked outputs, in order; its prose, code blocks out, whitespace collapsed)."""
    text = path.read_text()
    outputs = [p.output for p in assets.parse(text.splitlines()) if p.kind == "command"
               and (p.command.startswith(DETERMINISTIC) or is_stable(p.command))]
    prose = re.sub(r"\s+", " ", re.sub(r"```.*?```", "", text, flags=re.S)).replace("**", "")
    return outputs, prose


def report(output: str, line: str) -> list[int]:
    """The integers of a workload report's line (`steps`, `tokens`, `preemptions`...)."""
    found = [l for l in output.splitlines() if l.startswith(line)]
    assert found, f"no {line!r} line in\n{output}"
    return [int(x) for x in re.findall(r"\d+", found[0].replace(",", ""))]


def frame(output: str) -> tuple[dict[str, str], dict[int, str]]:
    """A `nanoserve trace --step N` frame: ({request: its timeline row}, {block id: its label})."""
    rows = dict(re.findall(r"^│ (\d+) (\S+)", output, re.M))
    cells = {}
    for base, labels in re.findall(r"^│ +(\d+) │((?: +\S+)+) +│$", output, re.M):
        cells.update({int(base) + i: label for i, label in enumerate(labels.split())})
    return rows, cells


def test_figures_read_off_the_replay_frames():
    """What lessons 02-04 say they see in a replay frame is what the frame shows."""
    outputs, prose = shown_outputs(next(p for p in LESSONS if p.name.startswith("02")))
    _, cells = frame(next(o for o in outputs if "KV block pool" in o and "steps 1-20" in o))
    for request, says in (("1", "holds blocks"), ("7", "holds")):
        held = [b for b, label in sorted(cells.items()) if label == request]
        assert f"request {request} {says} {held[0]}, {held[1]} and {held[2]}" in prose
    outputs, prose = shown_outputs(next(p for p in LESSONS if p.name.startswith("03")))
    five = next(o for o in outputs if "steps 1-5" in o)
    assert "prefill 31, decode 1" in five and "a 31-token chunk" in prose
    assert frame(five)[0]["0"].startswith("▒▒▒▒█") and 3 * 32 + 4 == 100
    outputs, prose = shown_outputs(next(p for p in LESSONS if p.name.startswith("04")))
    eighteen = next(o for o in outputs if "steps 1-18" in o)
    preempted_at = {r: row.index("✗") + 1 for r, row in frame(eighteen)[0].items() if "✗" in row}
    assert preempted_at == {"2": 18, "3": 10, "4": 2}, preempted_at
    assert "Requests 4 and 3 went the same way at steps 2 and 10" in prose
    assert "2 preempted (40 tokens dropped)" in eighteen and "dropping 40 computed tokens" in prose


def test_derived_figures_in_the_text():
    """Sums and ratios the prose of lessons 03 and 04 computes from the outputs it shows."""
    outputs, prose = shown_outputs(next(p for p in LESSONS if p.name.startswith("03")))
    steps = [int(s) for s in re.findall(r"^steps +(\d+):", outputs[0], re.M)]
    assert steps[0] == 8 * 8 + 8 * 48 and f"One seat needs {steps[0]} steps" in prose
    assert f"Sixteen seats need {steps[2]}" in prose and steps[2] == 48
    outputs, prose = shown_outputs(next(p for p in LESSONS if p.name.startswith("04")))
    storm, sized = outputs[0], outputs[-1]
    computed, saved, needed = report(storm, "tokens")
    dropped = report(storm, "preemptions")[1]
    assert f"{report(storm, 'steps')[0]} steps with {report(storm, 'preemptions')[0]} " \
           f"preemptions" in prose
    assert f"{computed - needed} of them are computed again: {computed} tokens computed where " \
           f"{needed} were needed, {round(100 * (computed - needed) / needed)}% extra work" in prose
    assert f"The other {dropped - (computed - needed)} are saved" in prose and saved == 48
    assert -(-(24 + 40 - 1) // 8) == 8 and "ceil(63 / 8) = 8" in prose
    assert f"in {report(sized, 'steps')[0]} steps without a preemption" in prose
    assert f"against the storm's {report(storm, 'steps')[0]}" in prose
    outputs, prose = shown_outputs(next(p for p in LESSONS if p.name.startswith("05")))
    computed, hit, total = report(outputs[0], "tokens")
    assert (hit, report(outputs[0], "prefix cache")[:2]) == (7 * 64, [7 * 64, 8 * 80])
    assert f"{hit} of {8 * 80} prompt tokens, {round(100 * hit / (8 * 80))}%" in prose
    assert report(outputs[2], "tokens")[1] == 0 and "the hit rate is 0%" in prose


@pytest.mark.parametrize("lesson", list(FIGURES))
def test_figures_in_the_text_are_in_the_outputs(lesson):
    """A figure quoted in the prose is one a deterministic command shows (test_every_command_runs
    checks that those outputs are current), not a number typed in by hand."""
    path = next(p for p in LESSONS if p.name.startswith(lesson))
    outputs, prose = shown_outputs(path)
    shown = "\n".join(outputs)
    for figure in FIGURES[lesson]:
        assert figure in shown, f"{path.name}: no deterministic output shows {figure}"
        assert figure in prose, f"{path.name} does not quote {figure}"


def test_slot_arithmetic_examples_are_right():
    """The worked slot example in kv_cache.py's docstring and in lesson 2: each of its steps."""
    example = re.compile(r"block_table \[([\d, ]+)\], block_size (\d+), position (\d+)(.*?)slot "
                         r"(\d+) \* (\d+) \+ (\d+) = (\d+)", re.S)
    texts = {"kv_cache.py": (ROOT / "nanoserve" / "kv_cache.py").read_text(),
             "02": next(p for p in LESSONS if p.name.startswith("02")).read_text()}
    for name, text in texts.items():
        m = example.search(text)
        assert m, f"{name}: no worked slot example"
        table, size, pos = [int(x) for x in m[1].split(",")], int(m[2]), int(m[3])
        logical, offset = pos // size, pos % size
        steps = re.sub(r"\s+", " ", m[4])
        assert f"logical block {pos} // {size} = {logical}" in steps, (name, steps)
        assert f"{pos} % {size} = {offset}" in steps, (name, steps)
        physical = table[logical]
        assert [int(m[i]) for i in (5, 6, 7, 8)] == [physical, size, offset,
                                                     physical * size + offset], name


def test_gqa_primer_figures_match_the_configs():
    import json
    text = next(p for p in LESSONS if p.name.startswith("02")).read_text()
    for config, name in (("examples/llama-3-8b-config.json", "Llama-3-8B has"),
                         ("nanoserve/assets/nanoserve-tiny/config.json", "built-in model has")):
        cfg = json.loads((ROOT / config).read_text())
        heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        assert re.search(rf"{name} {heads} query heads\s+(but only|over) {kv} KV heads",
                         text), (config, heads, kv)
        assert f"groups of {heads // kv}" in text or f"groups of {heads} / {kv} = {heads // kv}" \
            in text, config


MUTANTS = ROOT / "tests" / "lesson_mutants"
EDITS = _load(MUTANTS / "edits.py").EDITS


def mutants_of(eid: str, folder: Path) -> list[Path]:
    """The wrong answers to exercise `eid`: whole files in tests/lesson_mutants/, and the one-edit
    ones of edits.py applied to the reference solution (written to `folder`)."""
    stem = checks.EXERCISES[eid].file[:-3]
    paths = sorted(MUTANTS.glob(f"{stem}__*.py"))
    reference = checks.path_of(eid, solution=True).read_text()
    for name, (why, edits) in EDITS.get(stem, {}).items():
        text = reference
        for old, new in edits:
            assert old in text, f"edits.py {stem}/{name}: {old!r} is not in the solution"
            text = text.replace(old, new)
        paths.append(folder / f"{stem}__{name}.py")
        paths[-1].write_text(f'"""Wrong answer to exercise {eid}: {why}."""\n{text}')
    return paths


@pytest.mark.parametrize("eid", list(checks.EXERCISES))
def test_check_rejects_every_wrong_answer(eid, tmp_path):
    """Plausible wrong answers to each exercise (their docstrings say what is wrong): the check
    must reject each one by a failed expectation, not because the check itself crashed
    (test_exercise_passes_on_its_solution: it accepts the reference)."""
    mutants = mutants_of(eid, tmp_path)
    assert len(mutants) >= 2, f"exercise {eid}: fewer than two wrong answers in {MUTANTS}"
    verdicts = []
    for mutant in mutants:
        said = []
        assert not checks.check(eid, say=said.append, path=mutant), f"{mutant.name} passed"
        verdicts.append("\n".join(said))
        assert "FAIL" in verdicts[-1] and "raised" not in verdicts[-1], (mutant.name, verdicts[-1])
    # One wrong answer, at least, hands the work to someone else's code (nanoserve's, the
    # reference solution's, a library's): the check must say it is not the learner's own.
    assert any(re.search(r"FAIL (your code ran|write .* in your own file)", v) for v in verdicts), \
        f"exercise {eid}: no wrong answer that hands the work to someone else's code"


ANSWERS = assets.answer_files()


def test_answer_key_covers_every_predict_item():
    """lessons/answers/NN-*.md answers each predict item of lesson NN, with a command that shows
    it, and the lesson links there (the lessons themselves do not print the answers)."""
    assert [p.name for p in ANSWERS] == [p.name for p in LESSONS]
    for lesson, answers in zip(LESSONS, ANSWERS):
        assert f"(answers/{lesson.name})" in lesson.read_text(), f"{lesson.name} links no answers"
        key = answers.read_text()
        for n, k, kind in EXERCISE.findall(lesson.read_text()):
            if kind == "build":
                continue
            assert f"### Exercise {n}.{k} (predict, then check)" in key, f"{answers.name}: {n}.{k}"
            part = key.split(f"### Exercise {n}.{k} ")[1].split("\n### ")[0]
            assert any(p.kind == "command" for p in assets.parse(part.splitlines())), f"{n}.{k}"


@pytest.mark.parametrize("path", ANSWERS, ids=lambda p: p.name[:2])
def test_answers_show_what_the_commands_print(path):
    """Every figure in the answer key comes from a command; the output recorded under it must
    be what it prints today (step counts, blocks, hits and memory figures are the same on
    every machine). Model text (generate, --show) is only run: float rounding may differ
    between CPUs."""
    for part in assets.parse(path.read_text().splitlines()):
        code, out, seconds = assets.run(part.command, COMMAND_LIMIT_S)
        assert code == 0 and seconds < COMMAND_LIMIT_S, f"{part.command}\n{out}"
        text_only = "--show" in part.command or (part.command.startswith("nanoserve generate")
                                                  and "trace" not in part.command)
        if not text_only:
            assert out == part.output, f"{path.name}: `{part.command}` now prints\n{out}"


def test_workload_runs_the_learners_classes_and_compares_the_traces(tmp_path):
    """`lessons/workload.py --block-pool FILE:NAME` runs the exercise's pool in the real engine
    (its evictions keep the storm's resumed requests' prefixes: more hits than LRU), and
    `nanoserve trace --compare` puts the two runs' summaries side by side."""
    storm = ("python lessons/workload.py --num-prompts 8 --prompt-len 24 --max-tokens 40 "
             "--block-size 8 --num-kv-blocks 16 --max-model-len 64")
    pool = "lessons/solutions/lesson5_hit_count_eviction.py:HitCountBlockPool"
    lru, hits = tmp_path / "lru.jsonl", tmp_path / "hits.jsonl"
    code, out, _ = assets.run(f"{storm} --trace {lru} && {storm} --trace {hits} --block-pool {pool}"
                              f" && nanoserve trace {hits} --compare {lru}", COMMAND_LIMIT_S * 2)
    assert code == 0, out
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:4]]
            for line in out.splitlines() if line.count("│") == 4}
    assert rows["prefix cache hit rate"] == ["14.5% of prompt tokens", "10.9% of prompt tokens"]
    code, out, _ = assets.run(f"{storm} --scheduler lessons/workload.py:NoSuchScheduler")
    assert code != 0 and "--scheduler: lessons/workload.py defines no NoSuchScheduler" in out


# Issue 54: every lesson opens with what the reader will be able to do, names the files of one
# vLLM release that do what its code does, and keeps its paragraphs short (asides go to notes).
VLLM_RELEASE = "0.32.0"
COUNTERPART = f"vLLM counterpart ({VLLM_RELEASE}): "
VLLM_PATH = re.compile(r"`(vllm/[\w/.]+\.py)`")
MAX_PARAGRAPH = 1200
LIST_ITEM = re.compile(r"^\s*([-*]|\d+\.) ")


def paragraphs(text: str) -> list[tuple[int, str]]:
    """(first line, text) of each paragraph outside code blocks, tables, headings and comments;
    a list item is a paragraph of its own."""
    found, current, fenced = [], [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        skip = fenced or line.startswith(("```", "#", "|", "<!--")) or not line.strip()
        if current and (skip or LIST_ITEM.match(line)):
            found.append((current[0][0], " ".join(part.strip() for _, part in current)))
            current = []
        if not skip:
            current.append((number, line))
    if current:
        found.append((current[0][0], " ".join(part.strip() for _, part in current)))
    return found


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name[:2])
def test_lesson_opens_with_what_you_will_be_able_to_do(path):
    opening = path.read_text().split("## The idea")[0]
    assert "By the end you can" in opening, f"{path.name}: no 'By the end you can' opening"
    after = opening.split("By the end you can", 1)[1].splitlines()[1:]
    items = [line for line in after if LIST_ITEM.match(line)]
    assert len(items) == 3, f"{path.name}: 'By the end you can' has {len(items)} lines, not 3"


def counterparts(path: Path) -> list[str]:
    """The paragraphs that open with 'vLLM counterpart (RELEASE): ' (a lesson has one)."""
    return [text for _, text in paragraphs(path.read_text()) if text.startswith(COUNTERPART)]


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name[:2])
def test_lesson_names_its_vllm_counterpart(path):
    found = counterparts(path)
    assert len(found) == 1, f"{path.name}: no paragraph '{COUNTERPART}...' (or more than one)"
    assert VLLM_PATH.search(found[0]), f"{path.name}: its vLLM counterpart names no vllm/ file"


@pytest.mark.parametrize("path", sorted((ROOT / "lessons").glob("*.md")), ids=lambda p: p.name)
def test_no_paragraph_over_1200_characters(path):
    long = [(line, len(text)) for line, text in paragraphs(path.read_text())
            if len(text) > MAX_PARAGRAPH]
    assert not long, f"{path.name}: paragraphs over {MAX_PARAGRAPH} characters (line, length): {long}"


def vllm_source() -> Path | None:
    """vLLM's installed source at the release the lessons cite (README: ~/vllm-venv), if here."""
    for site in sorted(Path.home().glob("vllm-venv/lib/python3*/site-packages")):
        version = site / "vllm" / "_version.py"
        if version.is_file() and f"'{VLLM_RELEASE}'" in version.read_text():
            return site
    return None


def test_vllm_counterpart_files_exist_in_that_release():
    site = vllm_source()
    if site is None:
        pytest.skip(f"vLLM {VLLM_RELEASE} is not installed in ~/vllm-venv (README: compare_vllm)")
    cited = {p for path in sorted((ROOT / "lessons").glob("*.md"))
             for text in counterparts(path) for p in VLLM_PATH.findall(text)}
    missing = sorted(p for p in cited if not (site / p).is_file())
    assert cited and not missing, f"not in vLLM {VLLM_RELEASE}: {missing}"


def test_clinic_figures_are_the_outputs():
    """Lesson 10's diagnoses (in its answer key) quote the evidence its outputs show, and the
    key's measured fixes are what its own commands print."""
    outputs, _ = shown_outputs(next(p for p in LESSONS if p.name.startswith("10")))
    key_path = next(p for p in ANSWERS if p.name.startswith("10"))
    key = re.sub(r"\s+", " ", re.sub(r"```.*?```", "", key_path.read_text(), flags=re.S))
    slow, step40, storm = outputs[0], outputs[1], outputs[2]
    assert f"at step 135 of {report(slow, 'steps')[0]}" in key
    assert "16 / 16  (prefill 15, decode 1)" in step40 and "15 of prefill, 1 of decode" in key
    blocks = report(storm, "engine")[1]
    computed, _, needed = report(storm, "tokens")
    count, dropped = report(storm, "preemptions")
    assert f"{blocks * 16:,} tokens, a maximum concurrency of {blocks / 32:.2f}" in key
    assert f"{count} preemptions" in key and f"dropped {dropped} computed tokens" in key
    assert f"{computed:,} tokens computed for {needed:,} needed, in " \
           f"{report(storm, 'steps')[0]} steps" in key
    fixes = [p.output for p in assets.parse(key_path.read_text().splitlines())][-1]
    pool, seats = [int(s) for s in re.findall(r"^steps +(\d+):", fixes, re.M)]
    assert f"the job runs in {pool} steps, half the storm's {report(storm, 'steps')[0]}" in key
    assert f"{seats} steps, one more than the storm" in key and seats == report(storm, "steps")[0] + 1
