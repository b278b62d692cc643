"""moe_checkpoint.py: a tiny random mixture-of-experts checkpoint for lesson 9.

    python lessons/moe_checkpoint.py /tmp/moe            # Qwen3-MoE: 8 experts, top-2
    python lessons/moe_checkpoint.py /tmp/mixtral --arch mixtral

The built-in model's tokenizer and width (hidden 192, 4 layers, 6 query heads / 2 KV heads),
each MLP replaced by `--experts` experts of which each token reads `--top-k`. The weights are
random (HF's init, seeded): the text is noise, but every mechanism of lesson 9 runs on it, and
HF transformers loads the same directory, so it is also the oracle of exercise 9.3.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run from anywhere


def build(path, arch: str = "qwen3_moe", experts: int = 8, top_k: int = 2, seed: int = 0,
          **overrides) -> Path:
    """Write a random `arch` ("qwen3_moe" or "mixtral") checkpoint and the built-in tokenizer
    to `path` (`overrides`: config fields, e.g. num_hidden_layers=2); returns the path."""
    import torch
    import transformers as tf

    from nanoserve.config import DEFAULT_MODEL
    from nanoserve.model_loader import resolve_model_path
    base = resolve_model_path(DEFAULT_MODEL)
    dense = tf.AutoConfig.from_pretrained(base)
    width = dict(hidden_size=dense.hidden_size, num_hidden_layers=dense.num_hidden_layers,
                 num_attention_heads=dense.num_attention_heads, head_dim=dense.head_dim,
                 num_key_value_heads=dense.num_key_value_heads, vocab_size=dense.vocab_size,
                 max_position_embeddings=dense.max_position_embeddings, eos_token_id=0,
                 bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    if arch == "qwen3_moe":
        config = tf.Qwen3MoeConfig(**{**width, "num_experts": experts, "num_experts_per_tok": top_k,
                                      "moe_intermediate_size": 128, "norm_topk_prob": True,
                                      **overrides})
        model_cls = tf.Qwen3MoeForCausalLM
    else:
        config = tf.MixtralConfig(**{**width, "num_local_experts": experts,
                                     "num_experts_per_tok": top_k, "intermediate_size": 128,
                                     **overrides})
        model_cls = tf.MixtralForCausalLM
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():   # HF's init (std 0.02) leaves the router near-uniform and the
        for name, p in model.named_parameters():   # logits near-tied: spread both
            if ".mlp.experts." in name or name.endswith(".mlp.gate.weight"):
                p.mul_(10.0)
        model.lm_head.weight.mul_(20.0)
    tf.utils.logging.disable_progress_bar()
    model.save_pretrained(path)
    tf.AutoTokenizer.from_pretrained(base).save_pretrained(path)
    return Path(path)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="the directory to write")
    parser.add_argument("--arch", choices=("qwen3_moe", "mixtral"), default="qwen3_moe")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    args = parser.parse_args()
    path = build(args.path, args.arch, args.experts, args.top_k)
    print(f"wrote {path}: {args.arch}, {args.experts} experts, top-{args.top_k}")
