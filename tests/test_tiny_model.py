"""test_tiny_model.py: the built-in model `nanoserve-tiny` loads offline and writes real text.

Only HF transformers and the shipped directory are used here (the engine has its own oracle
tests against HF). The asset is made by scripts/train_tiny_model.py; its grammar is the oracle
for "real words": greedy text must be made of words the grammar writes.

Run: pytest -x -q tests/test_tiny_model.py      (a few seconds on one CPU core)
"""

import importlib.util
import json
import math
import random
import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
ASSET = ROOT / "nanoserve" / "assets" / "nanoserve-tiny"


def _load_script():
    spec = importlib.util.spec_from_file_location("train_tiny_model", ROOT / "scripts" / "train_tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


script = _load_script()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ASSET, local_files_only=True)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    # float32 from the bfloat16 file: what the engine does on CPU, and what training_report.json measured.
    return AutoModelForCausalLM.from_pretrained(ASSET, local_files_only=True, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def words():
    return script.vocabulary()


def greedy(model, tokenizer, prompt: str, max_new_tokens: int) -> tuple[list[int], str]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    new = out[0, ids.shape[1]:].tolist()
    return new, tokenizer.decode(new, skip_special_tokens=True)


def test_asset_files_and_config(tokenizer, model):
    cfg = json.loads((ASSET / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA, so the engine's KV path is exercised
    assert cfg["tie_word_embeddings"] and cfg["max_position_embeddings"] == 512
    assert cfg["vocab_size"] == len(tokenizer)
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    assert tokenizer.eos_token_id == end == cfg["eos_token_id"] == model.generation_config.eos_token_id
    assert json.loads((ASSET / "tokenizer_config.json").read_text())["chat_template"] == script.CHAT_TEMPLATE
    size = sum(f.stat().st_size for f in ASSET.iterdir() if f.is_file())
    assert size < 10e6, f"asset is {size / 1e6:.1f} MB"
    report = json.loads((ASSET / "training_report.json").read_text())
    assert report["parameters"] == sum(p.numel() for p in model.parameters())
    assert math.isclose(report["heldout_perplexity"], math.exp(report["heldout_loss"]), rel_tol=1e-3)
    assert report["heldout_perplexity"] < 3.0  # a grammar-made corpus is very predictable once learned


def test_chat_template_matches_training_format(tokenizer):
    msgs = [{"role": "system", "content": "You are a friendly storyteller."},
            {"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Tell me a story about a cat."}]
    rendered = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert rendered == script.render_chat(msgs) + "<|assistant|>\n"  # the prompt is exactly what training saw
    assert rendered == ("<|system|>\nYou are a friendly storyteller.<|end|>\n<|user|>\nHi!<|end|>\n"
                        "<|assistant|>\nHello!<|end|>\n<|user|>\nTell me a story about a cat.<|end|>\n<|assistant|>\n")
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tokenizer.decode(ids) == rendered
    for special in script.SPECIAL_TOKENS:  # each special token is one id, never split into bytes
        assert tokenizer.convert_tokens_to_ids(special) == script.SPECIAL_TOKENS.index(special)
    with pytest.raises(Exception, match="role"):
        tokenizer.apply_chat_template([{"role": "robot", "content": "beep"}], tokenize=False)


def test_tokenizer_round_trips_the_corpus(tokenizer):
    for doc in script.corpus(seed=7, n_docs=20):
        ids = tokenizer(doc, add_special_tokens=False).input_ids
        assert tokenizer.decode(ids) == doc


def test_story_continuation_is_real_words(model, tokenizer, words):
    new, text = greedy(model, tokenizer, "Once upon a time", max_new_tokens=80)
    assert tokenizer.eos_token_id not in new[:60], f"stopped early: {text!r}"
    found = re.findall(r"[a-z]+", text.lower())
    unknown = [w for w in found if w not in words]
    assert len(found) >= 40 and len(unknown) <= 0.05 * len(found), (unknown, text)
    assert text.count(".") >= 3, text  # sentences end, the text does not run on


@pytest.mark.parametrize("name", ["Lily", "Max"])
def test_story_keeps_the_heros_name(model, tokenizer, name):
    # The model must look back and copy the name (the reason for train()'s curriculum), not guess one.
    _, text = greedy(model, tokenizer, f"Once upon a time, there was a little cat named {name}.", max_new_tokens=60)
    mentions = [w for w in re.findall(r"[A-Z][a-z]+", text) if w in script.NAMES]
    assert mentions and mentions[0] == name and mentions.count(name) >= 2, text


@pytest.mark.parametrize("animal", ["cat", "dog", "duck", "bird"])
def test_chat_story_fits_the_request(model, tokenizer, animal):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": f"Tell me a story about a {animal}."}],
                                           add_generation_prompt=True, tokenize=False)
    _, reply = greedy(model, tokenizer, prompt, max_new_tokens=60)
    # The story's hero must be what was asked for; a preface repeating the request is not enough.
    hero = re.search(r"\ban? (?:\w+ )?(\w+) (?:named|called) [A-Z]", reply)
    assert hero and hero.group(1) == animal, reply


def test_grammar_is_seeded_and_requests_fit():
    assert script.corpus(seed=3, n_docs=50) == script.corpus(seed=3, n_docs=50)
    assert script.corpus(seed=3, n_docs=50) != script.corpus(seed=4, n_docs=50)
    r = random.Random(0)
    for i in range(200):
        user, reply, facts = script.story_request(r, short=i % 2 == 1)
        kind = facts["hero"].kind
        story = reply.split("\n\n")[-1].removeprefix("Sure! ")  # the story itself, not a preface
        if f" {kind}" in user.replace("a story about", ""):  # the user asked for this kind of hero
            assert kind in re.findall(r"[a-z]+", story), (user, reply)


def test_pack_rows_start_at_documents():
    # Docs of 5, 4, 6, 3, 9 tokens start at 0, 5, 9, 15, 18; rows of 8 (seq_len 7 + the last target).
    docs = [[1] * 5, [2] * 4, [3] * 6, [4] * 3, [5] * 9]
    stream = [t for d in docs for t in d]
    assert script.pack(docs, seq_len=7).tolist() == [stream[s:s + 8] for s in [0, 5, 9, 15, 18]]
    # A document longer than a row is cut into row-sized pieces; no target is skipped.
    assert script.pack([list(range(20))], seq_len=7).tolist() == [list(range(0, 8)), list(range(7, 15))]
