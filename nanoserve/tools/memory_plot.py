"""memory_plot.py: `nanoserve memory --plot FILE`'s figure: memory against context and batch.

    nanoserve memory examples/llama-3-8b-config.json --device-memory-gb 24 --plot memory.png
    nanoserve memory examples/llama-3-8b-config.json --device-memory-gb 24 --plot m.png --lang ja

The numbers are memory.py's report; the words come from figure_text.py (English or Japanese).
"""

from __future__ import annotations

from matplotlib.figure import Figure

from nanoserve.tools.figure_text import t, use
from nanoserve.tools.memory import GiB, MemoryReport, verdict


def plot_memory(r: MemoryReport, path: str, lang: str = "en") -> None:
    """Memory, stacked (weights, reserve, KV cache) against the limit (dashed). Left: against
    context length, for as many sequences as fit at max_model_len; right: against the number
    of sequences of max_model_len. The dotted line marks the configured point. The words in
    `lang`; a title saying it does not fit stays English (it names the CLI's flags)."""
    use(lang)
    block_bytes = r.kv_bytes_per_token * r.block_size
    batch = max(r.num_seqs, 1)
    step = max(r.block_size, r.max_model_len // 64)
    contexts = list(range(r.block_size, 2 * r.max_model_len + 1, step))
    batches = list(range(1, 2 * batch + 2))
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    left, right = fig.subplots(1, 2)
    panels = ((left, contexts, [batch * -(-c // r.block_size) * block_bytes for c in contexts],
               t("context length", n=batch), r.max_model_len),
              (right, batches, [b * r.blocks_per_seq * block_bytes for b in batches],
               t("sequences of", n=r.max_model_len), batch))
    for ax, xs, kv, xlabel, mark in panels:
        ax.stackplot(xs, [r.weight_bytes / GiB] * len(xs), [r.activation_bytes / GiB] * len(xs),
                     [k / GiB for k in kv],
                     labels=[t("weights"), t("activation reserve"), t("KV cache")],
                     colors=["#4c72b0", "#dd8452", "#55a868"], alpha=0.85)
        ax.axhline(r.limit_bytes / GiB, color="black", linestyle="--",
                   label=t("limit", gib=f"{r.limit_bytes / GiB:.1f}"))
        ax.axvline(mark, color="grey", linestyle=":")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(t("GiB per GPU") if r.tensor_parallel_size > 1 else "GiB")
        ax.set_ylim(0, 1.3 * max(r.limit_bytes, r.weight_bytes + r.activation_bytes + kv[-1]) / GiB)
        ax.legend(loc="upper left", fontsize="small", ncol=2)
    fits = verdict(r).startswith("fits")
    title = t("fits", n=r.num_seqs, len=r.max_model_len) if fits else verdict(r)
    fig.suptitle(f"{r.model}: {title}", fontsize="medium")
    fig.savefig(path, dpi=120)
