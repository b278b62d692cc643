"""compare_llamacpp.py: nanoserve and llama.cpp, the CPU engine most people run small models on,
side by side on the same checkpoint, the same shapes and the same threads: batch-1 decode, a
512-token prefill and 64 sequences at once; llama.cpp in F32, BF16 and Q8_0 (its int8 weight
format), nanoserve in float32, bfloat16 and `--quantization int8`. One table, with the machine.

    python scripts/compare_llamacpp.py --llama-cpp ~/llama.cpp             # 3 rounds
    python scripts/compare_llamacpp.py --llama-cpp ~/llama.cpp --quick     # a smoke run, 1 round

It installs nothing. `--llama-cpp` is a llama.cpp checkout built with cmake (binaries under
build/bin; see the README for the commands), whose convert_hf_to_gguf.py turns the checkpoint
into GGUF files (cached under --gguf-dir). The converter needs `sentencepiece` besides torch,
numpy and transformers; `--convert-python` names a python that has them (default: this one).

The checkpoint (default: nanoserve bench's random SmolLM2-135M-shaped weights) is converted by
llama.cpp's own converter, which reads the tokenizer too: a word-level one (the bench
checkpoint's) it rejects, so the weights are converted beside the built-in model's BPE tokenizer
(nanoserve/assets/nanoserve-tiny), padded to the checkpoint's vocabulary. Its pre-tokenizer is
GPT-2's byte-level regex, but the converter knows pre-tokenizers only by a hash of its output on
a test string, and this tokenizer's hash is not in its list: the converter's own code then runs
with that one method (TextModel.get_vocab_base_pre) falling back to "gpt-2" instead of raising,
and the table says so. Tokenization is in none of the timed figures (token ids in, ids out).
Checked once by hand (llama-cpp-python's bindings on the same build): from one prompt, llama.cpp
on the F32 and BF16 files writes the same 16 greedy token ids as nanoserve in float32 and bfloat16;
Q8_0 and int8, two different quantizations, part at the 6th token.

The shapes, the same in both engines (token ids random, greedy, ignore_eos):
- batch-1 decode: `llama-bench -n 128 -p 0` runs 128 single-token steps; nanoserve runs a
  1-token prompt to 128 output tokens (128 forward passes as well). Output tok/s.
- prefill 512: `llama-bench -p 512 -n 0`; nanoserve: one 512-token prompt, 1 output token.
- 64 sequences: `llama-batched-bench -npl 64 -npp 272 -ntg 144` (the mean prompt and output
  lengths of `nanoserve bench`'s workload): 64 prompts at once, then 144 steps of 64 tokens.
  nanoserve runs the same 64 prompts to 145 tokens (its prompt pass samples the first one): the
  same forward passes. Both count 64 x 144 tokens over the whole time, prefill included.
The engines take turns (compare_vllm.take_turns): each round runs nanoserve's three engines,
then llama.cpp on its three files (the other way round every other round); medians over the
rounds. Run it on an idle machine: llama.cpp's threads spin-wait for each other (OpenMP), and a
core taken by another process slowed its decode >10x here; the title shows the load average.
Prefix caching is off in nanoserve (rounds repeat the same prompts). KV caches are each engine's
default: F16 in llama.cpp, the model dtype in nanoserve.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_vllm import take_turns  # noqa: E402  (engines in turns, each first half the time)

import nanoserve  # noqa: E402
from nanoserve.tools.bench import (cpu_description, make_bench_llm, make_checkpoint,  # noqa: E402
                                   make_workload, time_workload)

BUILTIN_TOKENIZER = Path(nanoserve.__file__).parent / "assets" / "nanoserve-tiny"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
GGUF_TYPES = {"F32": "f32", "BF16": "bf16", "Q8_0": "q8_0"}   # row label -> converter --outtype
NANOSERVE_ENGINES = {"float32": {"dtype": "float32"}, "bfloat16": {"dtype": "bfloat16"},
                     "int8": {"dtype": "bfloat16", "quantization": "int8"},
                     # llama.cpp's Q8_0 quantizes the LM head too: nanoserve's opt-in to the same
                     "int8, int8 head": {"dtype": "bfloat16", "quantization": "int8", "quantize_lm_head": True}}
COLUMNS = {"decode": "batch-1 decode tok/s", "prefill": "prefill 512 tok/s",
           "batch64": "64 sequences output tok/s"}
FULL = {"decode_len": 128, "prefill_len": 512, "num_seqs": 64, "seq_prompt_len": 272,
        "seq_output_len": 144}
QUICK = {**FULL, "decode_len": 16, "seq_prompt_len": 32, "seq_output_len": 8}
FALLBACK_MARK = "PRE-TOKENIZER FALLBACK"

# Runs llama.cpp's converter (argv: llama.cpp dir, then the converter's own arguments), with an
# unknown BPE pre-tokenizer hash mapped to "gpt-2" instead of an error (see the docstring).
CONVERT_DRIVER = r"""
import runpy, sys
llama_cpp = sys.argv.pop(1)
sys.path[:0] = [llama_cpp, llama_cpp + "/gguf-py"]
from conversion.base import TextModel
known_pre_tokenizer = TextModel.get_vocab_base_pre

def get_vocab_base_pre(self, tokenizer):
    try:
        return known_pre_tokenizer(self, tokenizer)
    except NotImplementedError:
        print("PRE-TOKENIZER FALLBACK: unknown hash, gpt-2", flush=True)
        return "gpt-2"

TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv[0] = llama_cpp + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def has_bpe_tokenizer(checkpoint: Path) -> bool:
    path = checkpoint / "tokenizer.json"
    return path.is_file() and json.loads(path.read_text())["model"]["type"] == "BPE"


def gguf_source(checkpoint: Path, staging: Path) -> Path:
    """The directory the converter reads: the checkpoint itself when its tokenizer is BPE, else
    its files linked into `staging` beside the built-in model's BPE tokenizer."""
    if has_bpe_tokenizer(checkpoint):
        return checkpoint
    vocab = json.loads((BUILTIN_TOKENIZER / "tokenizer.json").read_text())["model"]["vocab"]
    if len(vocab) > json.loads((checkpoint / "config.json").read_text())["vocab_size"]:
        raise SystemExit(f"{checkpoint}: no BPE tokenizer, and the built-in one's {len(vocab)} "
                         f"tokens do not fit its vocabulary")
    staging.mkdir(parents=True, exist_ok=True)
    for path in checkpoint.iterdir():
        if path.name not in TOKENIZER_FILES and not (staging / path.name).exists():
            (staging / path.name).symlink_to(path.resolve())
    for name in TOKENIZER_FILES:
        (staging / name).write_bytes((BUILTIN_TOKENIZER / name).read_bytes())
    return staging


def convert(llama_cpp: Path, checkpoint: Path, gguf_dir: Path, python: str) -> tuple[dict, bool]:
    """({row label: GGUF path}, whether the pre-tokenizer fallback was used): llama.cpp's converter
    run once per type; a file converted before is reused (with its fallback mark)."""
    # named by the checkpoint's path too, so that two checkpoints in folders of one name differ
    where = checkpoint.resolve()
    name = f"{where.name}-{hashlib.sha1(str(where).encode()).hexdigest()[:8]}"
    paths, fell_back = {}, False
    for label, outtype in GGUF_TYPES.items():
        out = gguf_dir / f"{name}-{outtype}.gguf"
        mark = out.with_suffix(".fallback")
        if not out.is_file():
            source = gguf_source(checkpoint, gguf_dir / f"{name}-source")
            print(f"converting {checkpoint} to {out.name} (llama.cpp's convert_hf_to_gguf.py)",
                  flush=True)
            done = subprocess.run([python, "-c", CONVERT_DRIVER, str(llama_cpp), str(source),
                                   "--outtype", outtype, "--outfile", str(out)],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                out.unlink(missing_ok=True)
                raise SystemExit(failure(f"conversion to {outtype}", done))
            if FALLBACK_MARK in done.stdout:
                mark.touch()
        paths[label] = out
        fell_back |= mark.is_file()
    return paths, fell_back


def parse_llama_bench(output: str) -> dict:
    """llama-bench's `-o json` (a list, one object per test) as {"decode"|"prefill": tok/s}:
    a test with n_gen > 0 is decode (tg), one with n_prompt > 0 is prefill (pp)."""
    rates = {}
    for test in json.loads(output):
        rates["decode" if test["n_gen"] > 0 else "prefill"] = test["avg_ts"]
    return rates


def parse_batched_bench(output: str, num_seqs: int) -> float:
    """Output tok/s from llama-batched-bench's `--output-format jsonl` line for `num_seqs`
    sequences: pl x tg generated tokens over t, the prompt processing included."""
    for line in output.splitlines():
        if line.startswith("{") and (row := json.loads(line))["pl"] == num_seqs:
            return row["pl"] * row["tg"] / row["t"]
    raise ValueError(f"no result for {num_seqs} sequences in llama-batched-bench's output")


def failure(what: str, done: subprocess.CompletedProcess) -> str:
    """Why a child failed: its exit status, or the signal that killed it (a crash prints nothing
    on stderr: llama.cpp's AMX build of GGML_NATIVE=ON died of SIGSEGV in Q8_0 on one machine),
    and the end of its stderr."""
    status = (f"killed by {signal.Signals(-done.returncode).name}" if done.returncode < 0
              else f"exit status {done.returncode}")
    return f"{what} failed ({status}):\n{done.stderr[-3000:] or '(nothing on stderr)'}"


def run_binary(llama_cpp: Path, name: str, args: list[str]) -> str:
    done = subprocess.run([str(llama_cpp / "build" / "bin" / name), *args],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(failure(f"{name} {' '.join(args)}", done))
    return done.stdout


def llama_cpp_rates(llama_cpp: Path, gguf: Path, threads: int, shapes: dict) -> dict:
    """One run of each shape in llama.cpp: llama-bench's decode and prefill tests (one repetition
    each: the rounds repeat), then llama-batched-bench's 64 sequences."""
    rates = parse_llama_bench(run_binary(llama_cpp, "llama-bench", [
        "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json",
        "-p", str(shapes["prefill_len"]), "-n", str(shapes["decode_len"])]))
    n, pp, tg = shapes["num_seqs"], shapes["seq_prompt_len"], shapes["seq_output_len"]
    rates["batch64"] = parse_batched_bench(run_binary(llama_cpp, "llama-batched-bench", [
        "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-c", str(n * (pp + tg)),
        "-npl", str(n), "-npp", str(pp), "-ntg", str(tg), "--output-format", "jsonl"]), n)
    return rates


def nanoserve_rates(llm, shapes: dict) -> dict:
    """One run of each shape in nanoserve, timed by nanoserve bench's own time_workload."""
    vocab = llm.engine.executor.vocab_size
    decode = time_workload(llm, *make_workload(1, (1, 1), (shapes["decode_len"],) * 2, vocab))
    prefill = time_workload(llm, *make_workload(1, (shapes["prefill_len"],) * 2, (1, 1), vocab))
    n, tg = shapes["num_seqs"], shapes["seq_output_len"]
    # tg + 1 tokens: the prompt pass samples the first, then tg steps, as llama.cpp runs them
    batch = time_workload(llm, *make_workload(n, (shapes["seq_prompt_len"],) * 2, (tg + 1,) * 2,
                                              vocab))
    return {"decode": decode["output_tok_s"],
            "prefill": prefill["prompt_tokens"] / prefill["elapsed_s"],
            "batch64": n * tg / batch["elapsed_s"]}


def measure(args, ggufs: dict, llms: dict, shapes: dict) -> dict:
    """{row: {column: [rate per round]}}, llama.cpp and nanoserve taking turns each round."""
    samples = {row: {c: [] for c in COLUMNS} for row in [*ggufs, *llms]}

    def record(row: str, rates: dict) -> None:
        for column, rate in rates.items():
            samples[row][column].append(rate)

    def run_nanoserve():
        for name, llm in llms.items():
            record(name, nanoserve_rates(llm, shapes))

    def run_llama_cpp():
        for label, gguf in ggufs.items():
            record(label, llama_cpp_rates(args.llama_cpp, gguf, args.threads, shapes))

    take_turns(args.rounds, run_nanoserve, run_llama_cpp,
               lambda i: print(f"round {i + 1} of {args.rounds} done", flush=True))
    return samples


def print_table(samples: dict, shapes: dict, args, fell_back: bool) -> None:
    from rich.console import Console
    from rich.table import Table
    medians = {row: {c: statistics.median(v) for c, v in cols.items()} for row, cols in samples.items()}
    caption = ("llama.cpp's Q8_0 quantizes the tied embedding / LM head too; nanoserve's int8 "
               "(like vLLM) leaves the LM head in the model dtype (bfloat16) unless asked "
               "(--quantize-lm-head: 'int8, int8 head'). KV caches: F16 in llama.cpp, the model "
               "dtype in nanoserve.")
    if fell_back:
        caption += (" The GGUF's BPE pre-tokenizer hash was unknown to the converter and mapped to "
                    "gpt-2; tokenization is in no figure (token ids in, token ids out).")
    table = Table(title=f"{cpu_description()}\n{args.threads} threads each, medians of "
                        f"{args.rounds} round(s), engines taking turns; load average "
                        f"{args.load_average:.1f} at the start", caption=caption)
    table.add_column("engine", no_wrap=True)
    shape_notes = {"decode": f"{shapes['decode_len']} tokens",
                   "prefill": f"{shapes['prefill_len']} tokens",
                   "batch64": f"{shapes['num_seqs']} x ({shapes['seq_prompt_len']} + "
                              f"{shapes['seq_output_len']})"}
    for column, title in COLUMNS.items():
        table.add_column(f"{title}\n({shape_notes[column]})", justify="right")
    for row, rates in medians.items():
        engine = "llama.cpp" if row in GGUF_TYPES else "nanoserve"
        table.add_row(f"{engine} {row}", *(f"{rates[c]:,.1f}" for c in COLUMNS))
    Console().print(table)
    for ours, theirs in (("bfloat16", "BF16"), ("int8", "Q8_0"), ("int8, int8 head", "Q8_0")):
        ratio = medians[ours]["decode"] / medians[theirs]["decode"]
        print(f"nanoserve {ours} / llama.cpp {theirs} at batch 1: {ratio:.2f}x "
              f"({medians[ours]['decode']:.1f} / {medians[theirs]['decode']:.1f} tok/s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", type=Path, required=True,
                        help="a llama.cpp checkout built with cmake (binaries in build/bin)")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="a Llama-family HF checkpoint (default: nanoserve bench's random "
                             "SmolLM2-135M-shaped one)")
    parser.add_argument("--gguf-dir", type=Path, default=Path(tempfile.gettempdir()) / "nanoserve-gguf",
                        help="where the GGUF files are written, and reused from (delete to convert again)")
    parser.add_argument("--convert-python", default=sys.executable,
                        help="python for llama.cpp's converter (needs torch, transformers, "
                             "sentencepiece; default: this one)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="threads for each engine (default: torch's, one per core)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of turns; medians are printed")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: short decode and 64 short sequences, one round")
    args = parser.parse_args()
    for binary in ("llama-bench", "llama-batched-bench"):
        if not (args.llama_cpp / "build" / "bin" / binary).is_file():
            raise SystemExit(f"{args.llama_cpp}/build/bin/{binary} not found: build llama.cpp first")
    args.load_average = os.getloadavg()[0]   # another process's load skews both engines
    shapes = QUICK if args.quick else FULL
    args.rounds = 1 if args.quick else args.rounds
    torch.set_num_threads(args.threads)
    checkpoint = args.checkpoint or make_checkpoint()
    args.gguf_dir.mkdir(parents=True, exist_ok=True)
    ggufs, fell_back = convert(args.llama_cpp, checkpoint, args.gguf_dir, args.convert_python)
    kv_gb = 2.0   # 64 x (272 + 145) tokens need 1.2 GiB in float32 (30 layers, 3 KV heads of 64)
    llms = {name: make_bench_llm(str(checkpoint), enable_prefix_caching=False,
                                 kv_cache_memory_gb=kv_gb, **engine)
            for name, engine in NANOSERVE_ENGINES.items()}
    print_table(measure(args, ggufs, llms, shapes), shapes, args, fell_back)


if __name__ == "__main__":
    main()
