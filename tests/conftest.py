"""Shared fixtures: tiny random HF checkpoints written with save_pretrained, so the real
loading code (model_runner.py) reads them exactly as it reads a downloaded model."""

import pytest
import torch

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=384, max_position_embeddings=512)


def make_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on a few sentences, with an EOS token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["the quick brown fox jumps over the lazy dog", "hello world, hello engine",
            "paged attention keeps the KV cache in blocks", "a cat sat on a mat"] * 20
    tok.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def build_checkpoint(path, arch: str = "llama", tie: bool = False, **overrides):
    """Save a random model of the given family (scaled LM head: no near-tied logits; a mixture of
    experts' router and experts scaled too) and a tokenizer to `path`; returns the HF model for
    use as the oracle."""
    import transformers as tf
    cfg_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
    }[arch]
    config = cfg_cls(**{**TINY, **overrides}, tie_word_embeddings=tie, eos_token_id=0,
                     bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)    # spread the logits: greedy must not hinge on 1e-5 gaps
        for name, p in model.named_parameters():
            # HF's init (std 0.02) leaves the experts' output tiny beside the residual and the
            # router's logits near-uniform: scaled, the experts decide the logits and the router
            # spreads tokens over them clearly.
            if ".mlp.experts." in name or name.endswith(".mlp.gate.weight"):
                p.mul_(10.0)
    model.save_pretrained(path)
    make_tokenizer(config.vocab_size).save_pretrained(path)
    model.generation_config.eos_token_id = None   # the oracle never stops early
    return model


@pytest.fixture(scope="session", params=["llama", "qwen2", "qwen3"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = build_checkpoint(path, request.param, tie=request.param == "qwen2")
    return str(path), model
