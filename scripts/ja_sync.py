"""ja_sync.py: is the Japanese edition of the course (lessons/ja/) in step with the English one?

    python scripts/ja_sync.py            # every difference, one a line; exit status 1 if any
    python scripts/ja_sync.py --refresh  # after make_lesson_assets.py: copy new outputs over

lessons/ja/ mirrors lessons/ file for file (lessons/ja/answers/01-the-map.md translates
lessons/answers/01-the-map.md), plus a glossary, lessons/ja/用語集.md. Line 1 of every mirror:

    <!-- synced-with: lessons/01-the-map.md commit=<40 hex> blob=<40 hex> -->

`blob` is `git hash-object` of the English file when it was translated: the English file is
stale-checked against it (computed here, so any clone works, even a shallow one); `commit`, the
last commit that touched the English file then, is for people: `git diff COMMIT -- FILE`.

What a translation keeps exactly as in English (the CLI speaks English), and is checked here:
- the console blocks: each command and its output, verbatim, in the same order;
- the headings: their number, levels and order (the words are translated);
- the code citations (`nanoserve/scheduler.py:Scheduler.schedule`) and exercise ids (the number
  after a level-3 heading's first word, `### 演習 3.3`, and in `nanoserve exercise check 3.3`);
- the images. A figure (its marker's command writes `{file}` or into `{dir}`) is drawn in
  Japanese: the same marker command with ` --lang ja` appended, and `![日本語](img/NAME)`, the
  image lessons/ja/img/NAME (scripts/make_lesson_assets.py draws it). A replay frame (a marker
  with neither: the terminal's replay, which stays English) keeps the English marker and shows
  the English image: `![日本語](../img/NAME)`.
tests/test_lessons_ja.py runs this check on every mirror.

When make_lesson_assets.py runs an English lesson again, its outputs change (timings) and so
does its blob. `--refresh` then copies the new outputs into each translation whose English file
changed in its console outputs only (the old text read with `git cat-file blob`) and records the
new blob; a change in the prose is left to the translator (`git diff COMMIT -- FILE`).
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

from make_lesson_assets import ROOT, parse

JA = ROOT / "lessons" / "ja"
GLOSSARY = "用語集.md"
HEADER = re.compile(r"<!-- synced-with: (\S+) commit=([0-9a-f]{40}) blob=([0-9a-f]{40}) -->")
CITATION = re.compile(r"`(nanoserve/[\w/]+\.py:[\w.]+)`")
EXERCISE_ID = re.compile(r"^###\s+\S+\s+(\d+\.\d+)\b|exercise check (\d+\.\d+)\b", re.M)
LANG_JA = " --lang ja"


def blob_sha(data: bytes) -> str:
    """What `git hash-object` prints for a file with these bytes."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def english_files(root: Path = ROOT) -> list[Path]:
    """The files the Japanese edition mirrors: lessons, answers, README, TEACHING, quiz, appendices."""
    lessons = root / "lessons"
    return sorted([*lessons.glob("*.md"), *(lessons / "answers").glob("*.md")])


def mirror(english: Path, root: Path = ROOT) -> Path:
    return root / "lessons" / "ja" / english.relative_to(root / "lessons")


def missing_translations(root: Path = ROOT) -> list[str]:
    return [str(p.relative_to(root)) for p in english_files(root) if not mirror(p, root).exists()]


def headings(lines: list[str]) -> list[int]:
    """The level of each Markdown heading, in order, outside fenced blocks."""
    levels, fenced = [], False
    for line in lines:
        fenced ^= line.startswith("```")
        if not fenced and re.match(r"#{1,6} ", line):
            levels.append(len(line.split(" ", 1)[0]))
    return levels


def exercise_ids(text: str) -> list[str]:
    return [a or b for a, b in EXERCISE_ID.findall(text)]


def expected_image(part) -> tuple[str, str]:
    """The (marker command, image path) a Japanese lesson shows for an English image part."""
    if "{file}" in part.command or "{dir}" in part.command:      # a figure, drawn in Japanese
        return part.command + LANG_JA, part.image
    return part.command, "../" + part.image                     # a replay frame, in English


def compare(english: list[str], japanese: list[str], name: str) -> list[str]:
    """The differences in what a translation keeps verbatim, each as a sentence."""
    problems = []
    en_parts, ja_parts = parse(english), parse(japanese)
    en_cmds = [(p.command, p.output) for p in en_parts if p.kind == "command"]
    ja_cmds = [(p.command, p.output) for p in ja_parts if p.kind == "command"]
    for i, (en, ja) in enumerate(zip(en_cmds, ja_cmds)):
        if en != ja:
            problems.append(f"{name}: console block {i + 1} differs: English `$ {en[0]}`, "
                            f"Japanese `$ {ja[0]}` (commands and outputs stay verbatim)")
    if len(en_cmds) != len(ja_cmds):
        problems.append(f"{name}: {len(en_cmds)} console blocks in English, {len(ja_cmds)} here")
    en_images = [expected_image(p) for p in en_parts if p.kind == "image"]
    ja_images = [(p.command, p.image) for p in ja_parts if p.kind == "image"]
    if en_images != ja_images:
        problems.append(f"{name}: images {ja_images}, expected {en_images} (a figure: the marker "
                        f"+{LANG_JA} and img/NAME; a replay frame: the English marker and ../img/NAME)")
    for what, pick in (("headings (levels, in order)", headings),
                       ("code citations", lambda ls: CITATION.findall("\n".join(ls))),
                       ("exercise ids", lambda ls: exercise_ids("\n".join(ls)))):
        en, ja = pick(english), pick(japanese)
        if en != ja:
            problems.append(f"{name}: {what} differ: English {en}, Japanese {ja}")
    return problems


def check(ja_path: Path, root: Path = ROOT) -> list[str]:
    """Everything wrong with one Japanese file, as sentences (empty: in step)."""
    lines = ja_path.read_text(encoding="utf-8").splitlines()
    name = str(ja_path.relative_to(root))
    header = HEADER.fullmatch(lines[0].strip()) if lines else None
    if not header:
        return [f"{name}: line 1 must be <!-- synced-with: lessons/X.md commit=SHA blob=SHA -->"]
    source, commit, blob = header.groups()
    english = root / source
    if english != root / "lessons" / ja_path.relative_to(root / "lessons" / "ja"):
        return [f"{name}: synced with {source}, but it mirrors a file of the same name"]
    if not english.is_file():
        return [f"{name}: synced with {source}, which does not exist"]
    data = english.read_bytes()
    problems = compare(data.decode().splitlines(), lines[1:], name)
    if blob_sha(data) != blob:
        problems.insert(0, f"{source} changed since the Japanese edition was synced at commit "
                           f"{commit}: see git diff {commit} -- {source}")
    return problems


def without_outputs(lines: list[str]) -> list[str]:
    """The text with every console block's output left out (its command kept)."""
    kept, last = [], 0
    for part in (p for p in parse(lines) if p.kind == "command"):
        kept += lines[last:part.start]
        last = part.end
    return kept + lines[last:]


def git(root: Path, *args: str) -> str | None:
    proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else None


def refresh(ja_path: Path, root: Path = ROOT) -> bool:
    """Copy the English file's new console outputs into its translation and record its blob,
    if that is all that changed since the sync; True if the translation was rewritten."""
    lines = ja_path.read_text(encoding="utf-8").splitlines()
    header = HEADER.fullmatch(lines[0].strip()) if lines else None
    if not header or not (root / header[1]).is_file():
        return False
    source, _, blob = header.groups()
    data = (root / source).read_bytes()
    new, old = data.decode().splitlines(), git(root, "cat-file", "blob", blob)
    if blob_sha(data) == blob or old is None:
        return False
    outputs = [p.output for p in parse(new) if p.kind == "command"]
    ja, kept, last = lines[1:], [], 0
    blocks = [p for p in parse(ja) if p.kind == "command"]
    if without_outputs(old.splitlines()) != without_outputs(new) or len(blocks) != len(outputs):
        return False
    for part, output in zip(blocks, outputs):
        kept += ja[last:part.start] + output.splitlines()
        last = part.end
    commit = (git(root, "log", "-1", "--format=%H", "--", source) or "").strip()
    line1 = f"<!-- synced-with: {source} commit={commit} blob={blob_sha(data)} -->"
    ja_path.write_text("\n".join([line1, *kept, *ja[last:]]) + "\n", encoding="utf-8")
    return True


def japanese_files(root: Path = ROOT) -> list[Path]:
    """Every Markdown file of lessons/ja/ but the glossary."""
    return sorted(p for p in (root / "lessons" / "ja").rglob("*.md") if p.name != GLOSSARY)


def main() -> int:
    if "--refresh" in sys.argv[1:]:
        for path in japanese_files():
            if refresh(path):
                print(f"refreshed {path.relative_to(ROOT)}: the English outputs, the new blob")
    problems = [line for path in japanese_files() for line in check(path)]
    for line in problems:
        print(line)
    missing = missing_translations()
    print(f"{len(japanese_files())} Japanese files, {len(problems)} differences; "
          f"not translated yet: {', '.join(missing) or 'none'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
