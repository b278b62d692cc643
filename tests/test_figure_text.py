"""The figures' words in Japanese (nanoserve/tools/figure_text.py): every one has its glyphs.

    python -m pytest -q tests/test_figure_text.py

A character the font lacks renders as an empty box, and matplotlib only warns. So: every
character of every Japanese string in the table is in the Japanese font's character map, and
drawing the figures (a trace's, `nanoserve memory`'s) in Japanese emits no "Glyph ...
missing" warning.
"""

import io
import warnings
from pathlib import Path

import matplotlib
import pytest
from matplotlib.ft2font import FT2Font

from nanoserve.tools import figure_text, replay_plots
from nanoserve.trace import Trace

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def japanese():
    """Figures drawn in Japanese inside the test, English (and matplotlib's fonts) after it."""
    with matplotlib.rc_context():
        figure_text.use("ja")
        yield
    figure_text.use("en")


def test_every_key_has_every_language():
    for key, texts in figure_text.TEXT.items():
        assert set(texts) == set(figure_text.LANGS), key


def test_the_font_has_every_character_of_the_table():
    import matplotlib_fontja
    charmap = FT2Font(matplotlib_fontja.get_font_ttf_path()).get_charmap()
    missing = {(key, ch) for key, texts in figure_text.TEXT.items()
               for ch in texts["ja"] if ord(ch) not in charmap}
    assert not missing, f"characters without a glyph in the Japanese font: {sorted(missing)}"


def test_japanese_figures_draw_without_missing_glyphs(japanese):
    trace = Trace.load(str(ROOT / "traces" / "preemption_storm.jsonl"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for draw in (replay_plots.gantt, replay_plots.kv_blocks, replay_plots.tokens,
                     replay_plots.latency_cdf):
            fig = draw(trace)
            assert figure_text.t("step") == "ステップ"
            fig.savefig(io.BytesIO(), format="png")
    glyphs = [str(w.message) for w in caught if "missing from" in str(w.message)]
    assert not glyphs, glyphs


def test_the_memory_figure_in_japanese_draws_without_missing_glyphs(japanese, tmp_path):
    from nanoserve.tools.memory import memory_report
    from nanoserve.tools.memory_plot import plot_memory
    report = memory_report(str(ROOT / "examples" / "llama-3-8b-config.json"), device_memory_gb=24)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plot_memory(report, str(tmp_path / "memory.png"), "ja")
    assert not [w for w in caught if "missing from" in str(w.message)]


def test_without_the_font_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib_fontja", None)
    with pytest.raises(SystemExit, match=r"nanoserve\[ja\]"):
        figure_text.use("ja")
    assert figure_text.t("step") == "step"


def test_unknown_language_is_refused():
    with pytest.raises(ValueError, match="en, ja"):
        figure_text.use("fr")


def test_trace_plot_lang_ja_from_the_cli(japanese, tmp_path):
    from nanoserve.cli import main
    main(["trace", str(ROOT / "traces" / "preemption_storm.jsonl"), "--plot", str(tmp_path),
          "--lang", "ja"])
    assert (tmp_path / "kv_blocks.png").stat().st_size > 1000
    assert figure_text.t("free") == "空き"
