"""The Japanese edition of the course (lessons/ja/) is in step with the English one.

    python -m pytest -q tests/test_lessons_ja.py
    python scripts/ja_sync.py                      # the same check, for a translator

Each Japanese file names, on line 1, the English file and the git blob it was translated from
(scripts/ja_sync.py says what is kept verbatim). The commands are NOT run again here: they are
the English lesson's, verbatim, which tests/test_lessons.py runs.
"""

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import ja_sync  # noqa: E402  (scripts/ is not a package)
from make_lesson_assets import IMAGE_REF, parse  # noqa: E402



@pytest.mark.parametrize("path", ja_sync.japanese_files(), ids=lambda p: str(p.relative_to(ja_sync.JA)))
def test_japanese_file_is_in_step_with_its_english_one(path):
    problems = ja_sync.check(path)
    assert not problems, "\n".join(problems)


def test_every_english_file_has_its_japanese_counterpart():
    missing = ja_sync.missing_translations()
    assert not missing, f"not translated yet: {missing}"


def test_japanese_images_are_in_the_repo():
    """The figures a Japanese lesson shows are in lessons/ja/img/ (make_lesson_assets.py draws
    them; tests/test_lessons.py draws them again after the English lesson's commands), its replay
    frames are the English ones, and lessons/ja/img/ holds nothing else."""
    referenced = set()
    for path in ja_sync.JA.glob("[0-9][0-9]-*.md"):
        text = path.read_text(encoding="utf-8")
        images = [p.image for p in parse(text.splitlines()) if p.kind == "image"]
        assert set(IMAGE_REF.findall(text)) == set(images), f"{path.name}: unmarked images"
        for image in images:
            assert (ja_sync.JA / image).stat().st_size > 1000, f"{path.name}: {image}"
        referenced |= {i for i in images if i.startswith("img/")}
    folder = ja_sync.JA / "img"
    on_disk = {f"img/{p.name}" for p in folder.iterdir()} if folder.exists() else set()
    assert on_disk == referenced, f"unreferenced images: {on_disk - referenced}"


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_every_link_of_the_japanese_edition_resolves():
    """A link to a lesson goes to its Japanese file once it exists (not to the English one marked
    as untranslated), and every relative link, to code or to English files, resolves."""
    for path in sorted(ja_sync.JA.rglob("*.md")):
        for target in LINK.findall(path.read_text(encoding="utf-8")):
            if "://" in target or target.startswith("mailto:"):
                continue
            resolved = (path.parent / target).resolve()
            assert resolved.exists(), f"{path.relative_to(ROOT)}: {target} does not resolve"
            english = ja_sync.JA.parent.resolve()
            if resolved.parent == english and (ja_sync.JA / resolved.name).exists():
                raise AssertionError(f"{path.relative_to(ROOT)}: {target} is translated: link "
                                     f"the Japanese {resolved.name}")


LESSON = """# Lesson 9: a lesson
## Run it
```console
$ nanoserve generate "Once upon a time" --max-tokens 4
Once upon a time, a
```
<!-- image: nanoserve trace /tmp/l9.jsonl --plot {dir} -->
![tokens per step](img/09-tokens.png)
<!-- image: nanoserve trace /tmp/l9.jsonl --step 3 -->
![a replay frame](img/09-step3.svg)
Open `nanoserve/scheduler.py:Scheduler.schedule`.
### Exercise 9.1 (build)
```sh
# not a heading: a comment in a fenced block
nanoserve exercise check 9.1
```
"""
JAPANESE = """# レッスン 9: レッスン
## 動かしてみる
```console
$ nanoserve generate "Once upon a time" --max-tokens 4
Once upon a time, a
```
<!-- image: nanoserve trace /tmp/l9.jsonl --plot {dir} --lang ja -->
![ステップごとのトークン数](img/09-tokens.png)
<!-- image: nanoserve trace /tmp/l9.jsonl --step 3 -->
![リプレイのフレーム](../img/09-step3.svg)
`nanoserve/scheduler.py:Scheduler.schedule` を開いてください。
### 演習 9.1 (実装)
```sh
nanoserve exercise check 9.1
```
"""


def write(root: Path, english: str, japanese: str, synced_from: str | None = None) -> Path:
    """A repository in `root`: lessons/09-a.md and its translation, synced from `synced_from`."""
    (root / "lessons" / "ja").mkdir(parents=True)
    (root / "lessons" / "09-a.md").write_text(english)
    blob = ja_sync.blob_sha((synced_from or english).encode())
    header = f"<!-- synced-with: lessons/09-a.md commit={'c' * 40} blob={blob} -->\n"
    path = root / "lessons" / "ja" / "09-a.md"
    path.write_text(header + japanese, encoding="utf-8")
    return path


def test_blob_is_gits():
    assert ja_sync.blob_sha(b"hello\n") == "ce013625030ba8dba906f756967f9e9ca394464a"


def test_an_accurate_translation_passes(tmp_path):
    assert ja_sync.check(write(tmp_path, LESSON, JAPANESE), tmp_path) == []


def test_an_english_change_since_the_sync_is_reported(tmp_path):
    changed = LESSON.replace("--max-tokens 4\nOnce upon a time, a", "--max-tokens 3\nOnce upon a time,")
    problems = ja_sync.check(write(tmp_path, changed, JAPANESE, synced_from=LESSON), tmp_path)
    assert problems[0] == (f"lessons/09-a.md changed since the Japanese edition was synced at "
                           f"commit {'c' * 40}: see git diff {'c' * 40} -- lessons/09-a.md")
    assert "console block 1 differs" in problems[1]


@pytest.mark.parametrize("edit, complaint", [
    (("Once upon a time, a\n", "昔々\n"), "console block 1 differs"),
    ((" --lang ja -->", " -->"), "images"),
    (("(../img/09-step3.svg)", "(img/09-step3.svg)"), "images"),
    (("## 動かしてみる", "### 動かしてみる"), "headings"),
    (("Scheduler.schedule`", "Scheduler.step`"), "code citations"),
    (("### 演習 9.1", "### 演習 9.2"), "exercise ids"),
])
def test_what_a_translation_keeps_verbatim_is_checked(tmp_path, edit, complaint):
    problems = ja_sync.check(write(tmp_path, LESSON, JAPANESE.replace(*edit)), tmp_path)
    assert len(problems) == 1 and complaint in problems[0], problems


def test_a_file_without_its_header_is_reported(tmp_path):
    path = write(tmp_path, LESSON, JAPANESE)
    path.write_text(JAPANESE, encoding="utf-8")
    assert "line 1 must be <!-- synced-with:" in ja_sync.check(path, tmp_path)[0]


def test_refresh_copies_new_outputs_but_not_a_new_text(tmp_path):
    """make_lesson_assets.py ran the English lesson again: `--refresh` brings the translation
    along when only outputs changed, and leaves it stale when the prose changed too."""
    path = write(tmp_path, LESSON, JAPANESE)

    def commit(text: str) -> None:
        (tmp_path / "lessons" / "09-a.md").write_text(text)
        for args in (["add", "lessons/09-a.md"], ["commit", "-qm", "lesson 9"]):
            assert ja_sync.git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", *args) is not None
    assert ja_sync.git(tmp_path, "init", "-q") is not None
    commit(LESSON)
    rerun = LESSON.replace("Once upon a time, a\n", "Once upon a time, a\nsecond line\n")
    commit(rerun)
    assert ja_sync.refresh(path, tmp_path) and ja_sync.check(path, tmp_path) == []
    assert "second line" in path.read_text(encoding="utf-8")
    commit(rerun.replace("Open `", "First open `"))
    assert not ja_sync.refresh(path, tmp_path)
    assert "changed since the Japanese edition was synced" in ja_sync.check(path, tmp_path)[0]
