"""figure_text.py: every word the figures print, in English and Japanese, in one table.

    nanoserve trace traces/preemption_storm.jsonl --plot figs/ --lang ja   # the figures in Japanese

The plotting code (replay_plots.py, memory_plot.py) is written once and asks `t(key)` for each
title, axis label and legend entry; `use(lang)` picks the language of the figures drawn after it.
Japanese needs a font with Japanese glyphs: the `ja` extra installs matplotlib-fontja (IPAex
Gothic), and `use("ja")` makes it the figures' font. The Japanese terms are the glossary's
(lessons/ja/用語集.md).
The terminal's replay frames and tables stay in English (the CLI speaks English), as do
numbers, file names and code names (`max_num_batched_tokens`).
tests/test_figure_text.py checks that the font has a glyph for every character of the table.
"""

from __future__ import annotations

LANGS = ("en", "ja")

TEXT: dict[str, dict[str, str]] = {
    # axes and titles
    "step": {"en": "step", "ja": "ステップ"},
    "request": {"en": "request", "ja": "リクエスト"},
    "requests over steps": {"en": "requests over steps", "ja": "ステップごとのリクエスト"},
    "KV blocks": {"en": "KV blocks", "ja": "KVブロック数"},
    "KV cache pool": {"en": "KV cache pool ({n} blocks)", "ja": "KVキャッシュのプール({n} ブロック)"},
    "tokens": {"en": "tokens", "ja": "トークン数"},
    "tokens per step": {"en": "tokens per step", "ja": "ステップごとのトークン数"},
    "budget": {"en": "budget (max_num_batched_tokens) = {n}",
               "ja": "トークン予算(max_num_batched_tokens)= {n}"},
    "far above": {"en": "{budget}: far above these bars", "ja": "{budget}:棒よりはるかに上"},
    "share of tokens": {"en": "share of the layer's tokens", "ja": "その層のトークンに占める割合"},
    "expert": {"en": "expert", "ja": "エキスパート"},
    "MoE layer": {"en": "MoE layer", "ja": "MoE 層"},
    "imbalance": {"en": "imbalance (max / mean)", "ja": "偏り(最大 / 平均)"},
    "expert load": {"en": "expert load ({experts} experts, {layers} MoE layers)",
                    "ja": "エキスパートの負荷({experts} エキスパート、{layers} MoE 層)"},
    "time to first token": {"en": "time to first token (s)", "ja": "最初のトークンまでの時間(秒)"},
    "end-to-end latency": {"en": "end-to-end latency (s)", "ja": "全体のレイテンシ(秒)"},
    "fraction of requests": {"en": "fraction of requests", "ja": "リクエストの割合"},
    "latency CDFs": {"en": "latency CDFs", "ja": "レイテンシの累積分布"},
    # nanoserve memory --plot (memory_plot.py)
    "context length": {"en": "context length (tokens) of {n} sequence(s)",
                       "ja": "{n} 本のシーケンスのコンテキスト長(トークン)"},
    "sequences of": {"en": "sequences of max_model_len {n}", "ja": "max_model_len {n} のシーケンス数"},
    "GiB per GPU": {"en": "GiB per GPU", "ja": "GPU あたりの GiB"},
    "fits": {"en": "fits: {n} sequences of max_model_len {len} at once",
             "ja": "収まる:max_model_len {len} のシーケンスが同時に {n} 本"},
    # legends
    "wait": {"en": "wait", "ja": "待機"},
    "prefill": {"en": "prefill", "ja": "プリフィル"},
    "decode": {"en": "decode", "ja": "デコード"},
    "preempted": {"en": "preempted", "ja": "プリエンプション"},
    "preemption": {"en": "preemption", "ja": "プリエンプション"},
    "used": {"en": "used", "ja": "使用中"},
    "cached": {"en": "cached (free, hashed)", "ja": "キャッシュ済み(空き、ハッシュあり)"},
    "free": {"en": "free", "ja": "空き"},
    "weights": {"en": "weights", "ja": "重み"},
    "activation reserve": {"en": "activation reserve", "ja": "活性化の予約"},
    "KV cache": {"en": "KV cache", "ja": "KVキャッシュ"},
    "limit": {"en": "limit {gib} GiB", "ja": "上限 {gib} GiB"},
}

_lang = "en"


def use(lang: str) -> None:
    """Draw the following figures in `lang`; for "ja", with the `ja` extra's Japanese font."""
    global _lang
    if lang not in LANGS:
        raise ValueError(f"--lang must be one of {', '.join(LANGS)} (got {lang!r})")
    if lang == "ja":
        import matplotlib
        matplotlib.rcParams["font.family"] = font_family()
    _lang = lang


def font_family() -> str:
    """The Japanese font's family name, registered with matplotlib (IPAex Gothic)."""
    try:
        import matplotlib_fontja
    except ImportError:
        raise SystemExit("error: --lang ja needs a Japanese font: pip install 'nanoserve[ja]' "
                         "(the ja extra: matplotlib-fontja)") from None
    from matplotlib import font_manager
    font_manager.fontManager.addfont(matplotlib_fontja.get_font_ttf_path())
    return font_manager.FontProperties(fname=matplotlib_fontja.get_font_ttf_path()).get_name()


def t(key: str, **values) -> str:
    """The text `key` in the current language, with its {placeholders} filled from `values`."""
    return TEXT[key][_lang].format(**values)
