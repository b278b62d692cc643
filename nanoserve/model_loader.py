"""model_loader.py: finding and reading a checkpoint, and sizing the KV cache from its config.

Loading follows HF's format: config.json, *.safetensors (one file, or shards with
model.safetensors.index.json) and tokenizer files, from a directory, the built-in
`nanoserve-tiny`, or a hub id when the hub is reachable. The sizing functions are the ones
both the ModelRunner (model_runner.py) and the `nanoserve memory` calculator (memory.py) use, so
the two never disagree about how many KV blocks fit.

Lesson: lessons/06-length-and-memory.md
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch

from nanoserve.config import DEFAULT_MODEL
from nanoserve.models import get_head_size, get_moe_shape, get_num_kv_heads, get_num_layers

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_CACHE_GB = 1.0     # the CPU default: room for ~45k tokens of nanoserve-tiny, fits a laptop


def resolve_model_path(model: str) -> Path:
    """A local checkpoint directory for `model`: the built-in one, a path, or a hub download."""
    if model == DEFAULT_MODEL:
        return Path(__file__).parent / "assets" / DEFAULT_MODEL
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {path} has no config.json")
        return path
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors",
                                                             "tokenizer*", "*.model"]))
    except Exception as e:  # offline, unknown id, gated repo...: all mean "cannot get it"
        raise ValueError(f"model {model!r} is not a local directory and the Hugging Face hub "
                         f"could not provide it ({type(e).__name__}: {e})") from None


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's weight files: the shards its index names, else every *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text())["weight_map"].values())
        return [path / name for name in sorted(shards)]
    return sorted(path.glob("*.safetensors"))


def iterate_weights(path: Path):
    """(name, slice) for every tensor of the checkpoint, file by file: a slice reads from the
    file only the part it is indexed with, so a tensor-parallel rank reads only its shard."""
    from safetensors import safe_open
    files = safetensors_files(path)
    if not files:
        raise ValueError(f"no *.safetensors weights in {path}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                yield key, f.get_slice(key)


def resolve_device(device: str) -> str:
    """'auto' -> cuda when torch sees a GPU, else cpu. ValueError for 'cuda' where torch has none,
    saying why: a CPU build of torch, or a CUDA build that finds no GPU (driver, CUDA_VISIBLE_DEVICES)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        build = torch.version.cuda or torch.version.hip
        why = (f"torch {torch.__version__} is a CPU build (torch.version.cuda is None)" if build is None
               else f"torch {torch.__version__} built for CUDA/ROCm {build} finds no GPU (driver? "
                    "CUDA_VISIBLE_DEVICES?)")
        raise ValueError(f"device 'cuda': torch.cuda.is_available() is False: {why}; use device 'cpu'")
    return device


class GpuInfo(NamedTuple):
    """What resolve_dtype asks of a GPU."""
    name: str
    capability: tuple[int, int]   # compute capability, (8, 0) for an A100
    torch_bf16: bool              # torch.cuda.is_bf16_supported(including_emulation=False)

    @property
    def bf16(self) -> bool:
        # bf16 tensor cores, which the Triton kernels' tl.dot and cuBLAS need to be fast, start at sm_80.
        return self.torch_bf16 and self.capability >= (8, 0)


def gpu_info(device: torch.device) -> Optional[GpuInfo]:
    """The GPU `device` names, or None where torch sees no GPU (`nanoserve memory` sizing one
    from a CPU machine). Tests replace this function to play other GPUs."""
    if not torch.cuda.is_available():
        return None
    return GpuInfo(torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device),
                   torch.cuda.is_bf16_supported(including_emulation=False))


class DeviceMemory(NamedTuple):
    """What the memory profile reads of a device (each called with the torch.device, empty_cache
    with nothing): torch.cuda's functions on a GPU, a test's stand-ins on a CPU."""
    mem_get_info: Callable            # (free, total) bytes: every process's use, torch's or not
    memory_allocated: Callable        # bytes this process's live tensors hold
    max_memory_allocated: Callable    # their peak since reset_peak_memory_stats
    reset_peak_memory_stats: Callable
    empty_cache: Callable             # hand the allocator's unused cached blocks back
    synchronize: Callable


def device_memory(device: torch.device) -> Optional[DeviceMemory]:
    """The figures ModelRunner's profile sizes the pool with, or None where there is nothing to
    profile (a CPU: a fixed pool). Tests replace this function to run the profile on CPU."""
    if device.type != "cuda":
        return None
    c = torch.cuda
    return DeviceMemory(c.mem_get_info, c.memory_allocated, c.max_memory_allocated,
                        c.reset_peak_memory_stats, c.empty_cache, c.synchronize)


def resolve_dtype(dtype: str, device: torch.device, hf_config) -> torch.dtype:
    """The model dtype, vLLM's rule. CPU 'auto': float32 (CPUs without bf16 units are slow in
    half precision). CUDA 'auto': the checkpoint's dtype, but a float32 (or unnamed) checkpoint
    runs in bfloat16, or float16 on a GPU without bf16 (before sm_80), which also gets a bf16
    checkpoint in float16: float32 doubles the memory and keeps attention off the tensor cores."""
    if device.type == "cpu":
        return torch.float32 if dtype == "auto" else DTYPES[dtype]
    gpu = gpu_info(device)
    half = torch.bfloat16 if gpu is None or gpu.bf16 else torch.float16   # None: assume a current GPU
    if dtype != "auto":
        if DTYPES[dtype] == torch.bfloat16 and half != torch.bfloat16:
            raise ValueError(f"dtype 'bfloat16' is not supported on {gpu.name} (compute capability "
                             f"{gpu.capability[0]}.{gpu.capability[1]}; bf16 needs 8.0+): use "
                             "dtype 'float16' or 'auto'")
        return DTYPES[dtype]
    checkpoint = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    checkpoint = DTYPES.get(checkpoint) if isinstance(checkpoint, str) else checkpoint
    return torch.float16 if checkpoint == torch.float16 else half


def kv_cache_bytes_per_token(hf_config, dtype: torch.dtype, tensor_parallel_size: int = 1) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element, on one of
    `tensor_parallel_size` ranks (its KV heads: geometry.py)."""
    return (2 * get_num_layers(hf_config) * get_num_kv_heads(hf_config, tensor_parallel_size)
            * get_head_size(hf_config) * dtype.itemsize)


def num_blocks_for_memory(memory_bytes: float, hf_config, dtype: torch.dtype, block_size: int,
                          tensor_parallel_size: int = 1) -> int:
    """How many KV blocks fit in `memory_bytes` of one rank: the engine and `nanoserve memory`
    both use it."""
    return int(memory_bytes // (kv_cache_bytes_per_token(hf_config, dtype, tensor_parallel_size)
                                * block_size))


def kv_cache_memory_budget(total_bytes: float, gpu_memory_utilization: float,
                           used_bytes: float, activation_bytes: float) -> float:
    """The KV pool's share of a GPU: total x gpu_memory_utilization - used - peak activations.
    `used` is all the device holds once the weights are loaded (total - free, vLLM's start): the
    weights, and on a real GPU also what torch does not count (the CUDA context, NCCL buffers,
    the caching allocator's slack, other processes). `nanoserve memory` knows only the weights.
    May be <= 0 (the model does not fit); the engine and `nanoserve memory` both use it."""
    return total_bytes * gpu_memory_utilization - used_bytes - activation_bytes


# A pool sized from GPU memory is capped at what the scheduler can ever hold at once, max_num_seqs
# sequences of max_model_len, x 2: with every seat full, the prefix cache still keeps as many
# blocks again of finished requests for later hits. Past that, blocks only cost start-up:
# BlockPool makes a Python object per block, ~1.1 s and ~200 MiB of host RAM per million
# (measured on a 2-core x86 host); uncapped, nanoserve-tiny in bfloat16 on a 141 GB GPU would get
# ~7.7 million blocks, ~8 s and ~1.5 GiB.
KV_BLOCKS_CAP_FACTOR = 2


def max_useful_kv_blocks(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """The cap on a pool sized from GPU memory (never on a given num_kv_blocks or
    kv_cache_memory_gb); the engine and `nanoserve memory` both use it."""
    return KV_BLOCKS_CAP_FACTOR * max_num_seqs * -(-max_model_len // block_size)


def estimate_activation_bytes(hf_config, dtype: torch.dtype, max_num_batched_tokens: int,
                              max_num_seqs: int, block_size: int, tensor_parallel_size: int = 1,
                              enable_expert_parallel: bool = False) -> int:
    """What `ModelRunner._profile_free_cuda_memory` would measure on one of
    `tensor_parallel_size` ranks, estimated where no GPU can run the profile (`nanoserve memory`).
    Its forward of n = max_num_batched_tokens tokens holds, at its peak, the sum of:
      - its own KV cache for n tokens (block-rounded);
      - the widest point of one layer, the MLP: the residual and its normed copy [n, hidden],
        gate_up [n, 2 x intermediate], silu(gate) and the product [n, intermediate] each (the
        rank's share); a mixture of experts' block (if wider) holds the router's logits [n,
        experts] (and in float32) and the output [n, hidden], and for each of the n x top_k
        (token, expert) pairs its gathered row, gate_up, silu·mul, output and weighted copy: an
        expert's whole width under expert parallel (all pairs may land on one rank's experts);
      - the logits of max_num_seqs rows (the rank's share of the vocabulary), in the model dtype
        and again in float32.
    The last two never coincide, so the sum errs on the safe (high) side. Attention adds only
    its [n, q_size] output: the paged kernels never build an n x n score matrix.

    Qwen3-30B-A3B (hidden 2048, intermediate 6144; 128 experts, top-8 of width 768), per token in
    bf16 values: the dense MLP's 2 x 2048 + 4 x 6144 = 28,672 against the block's (3 x 2048 + 128)
    + 4 x 128 / 2 + 8 x (3 x 2048 + 3 x 768) = 74,112."""
    n, item, tp = max_num_batched_tokens, dtype.itemsize, tensor_parallel_size
    hidden = hf_config.hidden_size
    profile_kv = -(-n // block_size) * block_size * kv_cache_bytes_per_token(hf_config, dtype, tp)
    mlp = n * (2 * hidden + 4 * (hf_config.intermediate_size // tp)) * item
    if moe := get_moe_shape(hf_config):
        experts, top_k, width = moe
        width = width if enable_expert_parallel else width // tp
        pairs = top_k * (3 * hidden + 3 * width) * item
        mlp = max(mlp, n * ((3 * hidden + experts) * item + 4 * experts + pairs))
    logits = min(n, max_num_seqs) * -(-hf_config.vocab_size // tp) * (item + 4)
    return profile_kv + mlp + logits


def max_len_of(model) -> int:
    """The longest sequence the engine serves: max_position_embeddings, capped by a sliding
    window (paged attention attends to the whole sequence; past the window HF would not)."""
    max_len = model.config.max_position_embeddings
    return min(max_len, model.sliding_window) if getattr(model, "sliding_window", None) else max_len
