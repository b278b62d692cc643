"""nanoserve bench: the FLOP count on a hand-checked example, and a tiny end-to-end run."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, MixtralConfig

from nanoserve.tools.bench import main as bench_main
from nanoserve.tools.bench import make_workload, run_bench, useful_flops


def test_useful_flops_by_hand():
    cfg = LlamaConfig(hidden_size=4, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, vocab_size=10)
    # per layer: q 4*4 + k,v 2*(4*2) + o 4*4 + mlp 3*4*8 = 144 weights; head_dim 2.
    # One request, prompt 2, output 2: 3 tokens fed -> 2*144*3 = 864; LM head 2*4*10*2 = 160;
    # attention 4 * 1 layer * 2 heads * 2 dims * (1 + 2 + 3) = 96.
    assert useful_flops(cfg, [[1, 2]], [2]) == 864 + 160 + 96
    # A mixture of experts: the router (4 x 3 experts) and 2 experts of 8 replace the MLP's 96:
    # 48 + 12 + 2 * 3 * 4 * 8 = 252 weights a layer, 2 * 252 * 3 = 1512 for the 3 tokens fed.
    moe = MixtralConfig(hidden_size=4, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, vocab_size=10, num_local_experts=3, num_experts_per_tok=2)
    assert useful_flops(moe, [[1, 2]], [2]) == 1512 + 160 + 96


def test_workload_is_seeded():
    assert make_workload(4, (3, 5), (1, 2), 100) == make_workload(4, (3, 5), (1, 2), 100)
    prompts, outs = make_workload(8, (3, 5), (1, 2), 100)
    assert all(3 <= len(p) <= 5 for p in prompts) and all(1 <= n <= 2 for n in outs)


def test_bench_runs_end_to_end(checkpoint):
    path, _ = checkpoint
    result = run_bench(path, num_prompts=3, input_len=(4, 20), output_len=(2, 5),
                       num_kv_blocks=64, max_model_len=256)
    assert result["output_tokens"] == sum(make_workload(3, (4, 20), (2, 5), 384)[1])
    assert result["output_tok_s"] > 0 and 1 <= result["mean_batch_size"] <= 3
    assert set(result["ms_per_step"]) == {"prepare", "forward", "sample", "schedule", "update",
                                          "grammar"}
    assert result["model_flop_s"] > 0


def test_bench_peak_is_measured_on_the_models_own_gemm_path(checkpoint, capsys):
    path, _ = checkpoint
    result = bench_main(path, num_prompts=2, input_len=(4, 8), output_len=(2, 3),
                        num_kv_blocks=64, max_model_len=256)
    assert result["matmul_peak_path"] in result["gemm_paths"].values()
    assert result["matmul_peak_flop_s"] > 0
    printed = capsys.readouterr().out
    assert f"matmul peak, {result['matmul_peak_path']}" in printed and "GEMM path" in printed


FAULTS_SCRIPT = """
import ctypes, resource, sys, torch
import nanoserve.model_runner  # the engine's imports, as at start-up: a bare process's first
# heap growth faults a few thousand pages in either case (15k seen), the engine's does not
from nanoserve.cpu.host_memory import keep_freed_memory
# glibc's starting point, pinned: blocks over 128 KiB come from mmap and go back on free. (Left
# alone, glibc's adaptive threshold lands anywhere between the two cases below, run to run.)
ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)
if sys.argv[1] == "tuned":
    keep_freed_memory()  # must override the pinned threshold, or this run faults like the other
def layer():  # a 2048-token prefill layer's big activations (25, 13, 13, 25 MB), alive together
    alive = [torch.ones(2048, n) for n in (3072, 1536, 1536, 3072)]
    del alive
for _ in range(3):
    layer()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    layer()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning")
def test_keep_freed_memory_stops_page_faults():
    def faults(mode):
        run = subprocess.run([sys.executable, "-c", FAULTS_SCRIPT, mode], stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, check=True)
        return int(run.stdout)
    # Unmapped on free, 10 x 75 MB of fresh pages: ~180k faults. Kept for reuse: ~0 here, a few
    # thousand on some machines (torch's own small allocations), so the test asks for 20x fewer.
    unmapped = faults("mmap")
    assert unmapped > 20_000
    assert faults("tuned") < unmapped / 20


def _huge_page_kib(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mappings that hold `tensor`, from /proc/self/smaps (madvise splits
    the allocation's mapping: the unaligned edges stay apart from the huge-page middle)."""
    first = tensor.data_ptr()
    last, total, inside = first + tensor.numel() * tensor.element_size(), 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start < last and first < end
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no THP here")
def test_kv_cache_memory_is_advised_huge_pages():
    from nanoserve.cpu.host_memory import advise_huge_pages
    cache = torch.empty(64 * 2**20 // 4)     # 64 MiB, as one layer's K of a 4 GiB pool
    advise_huge_pages(cache)
    cache.zero_()
    assert _huge_page_kib(cache) >= 2048     # at least one 2 MiB page (usually all 31 inside)
