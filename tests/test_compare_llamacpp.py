"""test_compare_llamacpp.py: what scripts/compare_llamacpp.py does without llama.cpp (CI has none):
it reads llama-bench's `-o json` and llama-batched-bench's `--output-format jsonl` (samples of
their real output, fields the script does not read left out), and it gives the converter a BPE
tokenizer when the checkpoint's is word-level, without touching the checkpoint.

Run: pytest -q tests/test_compare_llamacpp.py      (a second)
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
spec = importlib.util.spec_from_file_location("compare_llamacpp", ROOT / "scripts" / "compare_llamacpp.py")
compare_llamacpp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_llamacpp)

# llama-bench -m ...-q8_0.gguf -t 2 -r 1 -o json -p 32 -n 4 (llama.cpp from llama-cpp-python 0.3.36)
LLAMA_BENCH_JSON = """[
  {
    "model_type": "llama 256M Q8_0",
    "n_threads": 2,
    "n_prompt": 32,
    "n_gen": 0,
    "n_depth": 0,
    "avg_ns": 65839814,
    "avg_ts": 486.028105,
    "stddev_ts": 0.000000,
    "samples_ts": [ 486.028 ]
  },
  {
    "model_type": "llama 256M Q8_0",
    "n_threads": 2,
    "n_prompt": 0,
    "n_gen": 4,
    "n_depth": 0,
    "avg_ns": 35572671,
    "avg_ts": 112.445872,
    "stddev_ts": 0.000000,
    "samples_ts": [ 112.446 ]
  }
]
"""

# llama-batched-bench ... -npl 4 -npp 32 -ntg 8 --output-format jsonl (the same build), whole line
BATCHED_BENCH_JSONL = (
    '{"n_kv_max": 1024, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, '
    '"n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 32, "tg": 8, "pl": 4, '
    '"n_kv": 160, "t_pp": 0.233741, "speed_pp": 547.614685, "t_tg": 0.230624, "speed_tg": '
    '138.753983, "t": 0.464365, "speed": 344.556549}\n\n')


def test_llama_bench_json_gives_decode_and_prefill_rates():
    assert compare_llamacpp.parse_llama_bench(LLAMA_BENCH_JSON) == {
        "decode": 112.445872, "prefill": 486.028105}


def test_batched_bench_output_rate_counts_generated_tokens_over_the_whole_time():
    rate = compare_llamacpp.parse_batched_bench(BATCHED_BENCH_JSONL, num_seqs=4)
    assert rate == pytest.approx(4 * 8 / 0.464365)   # prompt time included, as nanoserve's is
    with pytest.raises(ValueError, match="64 sequences"):
        compare_llamacpp.parse_batched_bench(BATCHED_BENCH_JSONL, num_seqs=64)


def write_checkpoint(path: Path, tokenizer_model: str, vocab_size: int = 49152) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"vocab_size": vocab_size}))
    (path / "model.safetensors").write_bytes(b"weights")
    (path / "tokenizer.json").write_text(json.dumps({"model": {"type": tokenizer_model}}))
    return path


def test_word_level_checkpoint_is_converted_beside_the_builtin_bpe_tokenizer(tmp_path):
    checkpoint = write_checkpoint(tmp_path / "ckpt", "WordLevel")
    source = compare_llamacpp.gguf_source(checkpoint, tmp_path / "staging")
    assert source == tmp_path / "staging" and compare_llamacpp.has_bpe_tokenizer(source)
    assert (source / "model.safetensors").resolve() == (checkpoint / "model.safetensors").resolve()
    builtin = compare_llamacpp.BUILTIN_TOKENIZER / "tokenizer.json"
    assert (source / "tokenizer.json").read_bytes() == builtin.read_bytes()
    assert json.loads((checkpoint / "tokenizer.json").read_text())["model"]["type"] == "WordLevel"
    assert compare_llamacpp.gguf_source(checkpoint, tmp_path / "staging") == source   # again: reused


def test_bpe_checkpoint_is_converted_as_it_is_and_a_too_small_vocabulary_is_refused(tmp_path):
    bpe = write_checkpoint(tmp_path / "bpe", "BPE")
    assert compare_llamacpp.gguf_source(bpe, tmp_path / "staging") == bpe
    small = write_checkpoint(tmp_path / "small", "WordLevel", vocab_size=100)
    with pytest.raises(SystemExit, match="do not fit"):
        compare_llamacpp.gguf_source(small, tmp_path / "staging2")


def test_a_child_killed_by_a_signal_is_named_not_a_bare_failed():
    """A crash prints nothing on stderr: the message names the signal (it used to be 'failed:')."""
    import subprocess
    crash = subprocess.run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), "
                            "signal.SIGSEGV)"], capture_output=True, text=True)
    message = compare_llamacpp.failure("llama-bench -m model-Q8_0.gguf", crash)
    assert "killed by SIGSEGV" in message and "(nothing on stderr)" in message, message
    exited = subprocess.run([sys.executable, "-c", "import sys; sys.exit('bad model')"],
                            capture_output=True, text=True)
    assert "exit status 1" in compare_llamacpp.failure("x", exited) and "bad model" in exited.stderr
