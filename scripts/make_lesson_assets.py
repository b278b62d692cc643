"""make_lesson_assets.py: run every lesson command; write back its real output and its images.

    python scripts/make_lesson_assets.py          # every lesson and its answers, a few minutes
    python scripts/make_lesson_assets.py 3 4      # lessons 03 and 04 (and their answers) only
    python scripts/make_lesson_assets.py --ja 2   # lessons/ja/img/'s figures of lesson 02 only

A lesson (lessons/NN-*.md) has two kinds of generated parts:

- a command block: a ```console fence whose first line is `$ COMMAND` (a line ending in `\\`
  continues it). Everything after the command is its output, replaced by what running it in
  the repository root prints (stdout and stderr). A command may fail on purpose, to show an
  error: its output then ends with the `... error: ...` line.
- an image: `<!-- image: COMMAND -->` on the line before `![alt](img/NAME)`. In COMMAND,
  `{file}` stands for the image's path and `{dir}` for a scratch directory, from which the
  file named like NAME without its `NN-` prefix is kept (`--plot {dir}` writes gantt.png,
  kv_blocks.png, ...); with neither, COMMAND's terminal output (a replay frame) is drawn as
  an SVG image.

The parts run in document order, since later commands replay the traces earlier ones write.
A lesson translated into Japanese (lessons/ja/, scripts/ja_sync.py) has its figures drawn again
after it, in Japanese, into lessons/ja/img/ (the same commands with ` --lang ja`). The outputs
written back change the English file: `python scripts/ja_sync.py --refresh` then copies them
into the translations.

Every command runs with OMP_NUM_THREADS=1: on a shared machine one thread per process keeps
step times steady, and a 2M-parameter model loses nothing by it. tests/test_lessons.py runs
every command through the same `parse` and `run`, so what a lesson shows is what CI runs.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LESSONS = ROOT / "lessons"
IMAGE = re.compile(r"<!-- image: (.+) -->")
IMAGE_REF = re.compile(r"!\[[^\]]*\]\(((?:\.\./)?img/[^)]+)\)")   # ../img/: lessons/ja/ showing an English frame
FRAME_COLUMNS = 100      # the width replay frames are drawn at in SVG images


@dataclass
class Part:
    kind: str            # "command" or "image"
    command: str
    start: int           # command: the lines [start, end) are its output; image: start = end
    end: int
    image: str = ""      # image: its path relative to lessons/
    output: str = ""     # command: the output the lesson shows now

    @property
    def expects_error(self) -> bool:
        lines = self.output.strip().splitlines()
        return bool(lines) and "error:" in lines[-1]


def lesson_files() -> list[Path]:
    return sorted(LESSONS.glob("[0-9][0-9]-*.md"))


def answer_files() -> list[Path]:
    """The answer key, lessons/answers/NN-*.md: command blocks like the lessons', no images."""
    return sorted((LESSONS / "answers").glob("[0-9][0-9]-*.md"))


def parse(lines: list[str]) -> list[Part]:
    """The command blocks and image markers of a lesson, in document order."""
    parts, i = [], 0
    while i < len(lines):
        marker = IMAGE.fullmatch(lines[i].strip())
        if lines[i] == "```console":
            j = i + 1
            if not lines[j].startswith("$ "):
                raise ValueError(f"line {j + 1}: a console block starts with '$ COMMAND'")
            command = [lines[j][2:]]
            while command[-1].endswith("\\"):
                j += 1
                command.append(lines[j])
            end = lines.index("```", j + 1)
            parts.append(Part("command", "\n".join(command), j + 1, end,
                              output="\n".join(lines[j + 1:end])))
            i = end
        elif marker:
            ref = IMAGE_REF.search(lines[i + 1]) if i + 1 < len(lines) else None
            if not ref:
                raise ValueError(f"line {i + 2}: an image marker must precede ![...](img/...)")
            parts.append(Part("image", marker.group(1), i + 2, i + 2, image=ref.group(1)))
        i += 1
    return parts


def env(**extra: str) -> dict:
    out = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "FORCE_COLOR")}
    out.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return out


def run(command: str, timeout: float = 120, **extra_env: str) -> tuple[int, str, float]:
    """(exit status, stdout + stderr with trailing spaces stripped, seconds)."""
    start = time.perf_counter()
    # -e -o pipefail: a failure anywhere in a loop or pipeline fails the whole command.
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", command], cwd=ROOT,
                          env=env(**extra_env), timeout=timeout, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    text = "\n".join(line.rstrip() for line in proc.stdout.rstrip().splitlines())
    return proc.returncode, text, time.perf_counter() - start


def make_image(part: Part, target: Path, timeout: float = 120) -> float:
    """Run an image part's command and write the image to `target`; returns its seconds."""
    with tempfile.TemporaryDirectory() as scratch:
        command = part.command.replace("{file}", str(target)).replace("{dir}", scratch)
        svg = "{file}" not in part.command and "{dir}" not in part.command
        extra = dict(FORCE_COLOR="1", COLUMNS=str(FRAME_COLUMNS)) if svg else {}
        code, out, seconds = run(command, timeout, **extra)
        if code:
            raise RuntimeError(f"{command} failed ({code}):\n{out}")
        if svg:
            target.write_text(frame_svg(out, part.command))
        elif "{dir}" in part.command:
            shutil.copy(Path(scratch) / target.name.split("-", 1)[1], target)
    return seconds


def frame_svg(ansi: str, title: str) -> str:
    from rich.console import Console
    from rich.text import Text
    console = Console(record=True, width=FRAME_COLUMNS, file=io.StringIO(), force_terminal=True,
                      color_system="truecolor")
    console.print(Text.from_ansi(ansi))
    return console.export_svg(title=title)


def japanese_figures(path: Path) -> list[Part]:
    """The figures of the Japanese translation of `path` (lessons/ja/, none if untranslated):
    the English markers' commands + ` --lang ja`, drawn into lessons/ja/img/ from the traces the
    English lesson's commands just wrote. Its replay frames show the English images (../img/)."""
    ja = LESSONS / "ja" / path.relative_to(LESSONS)
    if not ja.exists():
        return []
    return [p for p in parse(ja.read_text(encoding="utf-8").splitlines())
            if p.kind == "image" and not p.image.startswith("../")]


def make(path: Path, japanese_only: bool = False) -> None:
    """Run the lesson's parts and write back their outputs and images, then draw its Japanese
    figures; `japanese_only`: run its commands for their traces, but change no English file."""
    lines = path.read_text().splitlines()
    new, last = [], 0
    for part in parse(lines):
        if part.kind == "image":
            if not japanese_only:
                seconds = make_image(part, LESSONS / part.image)
                print(f"  {seconds:5.1f} s  {part.image}")
            continue
        code, out, seconds = run(part.command)
        print(f"  {seconds:5.1f} s  $ {part.command.splitlines()[0]}")
        if code and "error:" not in (out.splitlines() or [""])[-1]:
            raise RuntimeError(f"{path.name}: `{part.command}` failed ({code}):\n{out}")
        new += lines[last:part.start] + out.splitlines()
        last = part.end
    if not japanese_only:
        path.write_text("\n".join(new + lines[last:]) + "\n")
    for part in japanese_figures(path):
        (LESSONS / "ja" / "img").mkdir(exist_ok=True)
        seconds = make_image(part, LESSONS / "ja" / part.image)
        print(f"  {seconds:5.1f} s  ja/{part.image}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lessons", nargs="*", type=int, help="Lesson numbers (default: all).")
    parser.add_argument("--ja", action="store_true", help="Only the Japanese figures "
                        "(lessons/ja/img/): the English files stay as they are.")
    args = parser.parse_args()
    for path in lesson_files() + ([] if args.ja else answer_files()):
        if not args.lessons or int(path.name[:2]) in args.lessons:
            print(path.relative_to(ROOT))
            make(path, japanese_only=args.ja)


if __name__ == "__main__":
    main()
