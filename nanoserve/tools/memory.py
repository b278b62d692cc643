"""memory.py: `nanoserve memory`, do this model's weights and its KV cache fit on the GPU?

    nanoserve memory path/to/checkpoint --device-memory-gb 80 --max-model-len 8192
    nanoserve memory examples/llama-3-8b-config.json --device-memory-gb 24 --plot memory.png
    nanoserve memory Qwen/Qwen3-8B --device-memory-gb 24   # a Hugging Face id: config.json only
    nanoserve memory                     # the built-in model on this machine's GPU, or CPU rule

A Hugging Face model id is read as a VRAM calculator reads it: its config.json alone is
downloaded (into the hub's cache; a token in HF_TOKEN for gated models), never the weights, and
the parameters are counted on the engine's own model built on the "meta" device. Offline, the
`examples/` configs and any local config.json work the same.

It sizes the KV pool with the engine's own functions from model_loader.py, so the block count it
prints is the block count the engine allocates at start-up:

    KV budget  = device x gpu_memory_utilization - weights - activation reserve
    KV / token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element
    blocks     = KV budget // (KV / token x block_size), at most 2 x max_num_seqs x
                 ceil(max_model_len / block_size) (max_useful_kv_blocks: all it can use)

Worked example, Llama-3-8B (32 layers, 8 KV heads, head_dim 128) in bfloat16: a token's K and V
take 2 x 32 x 8 x 128 x 2 = 131,072 bytes (128 KiB), a 16-token block 2 MiB. On an 80 GiB GPU
at 0.9 utilisation that leaves 72 - 14.96 (weights) - 0.55 (reserve) = 56.49 GiB: 28,924
blocks, 462,784 tokens, 56 sequences of 8192 tokens at once.

Weights are parameters x dtype bytes, counted from the checkpoint's safetensors headers (never
the tensor data) or, with only a config.json, from the engine's own model built on the "meta"
device (shapes without memory); the RoPE tables the model builds at load are added. The
activation reserve is the engine's profile, estimated: `estimate_activation_bytes` (model_loader.py).
With --tensor-parallel-size N everything is per GPU: each holds 1/N of the weights and of the
KV heads (at least one), as vLLM and the engine's own --tensor-parallel-size shard them
(models/geometry.py). nanoserve stores KV in the model dtype; other --kv-cache-dtype values answer "what would vLLM's do".
With --data-parallel-size D every figure is still per rank: each of the D engine cores holds a
whole copy (its weights and a KV pool of its own, on its own TP GPUs), and the last row says
what the D of them hold together.

A mixture of experts (Qwen3-MoE, Mixtral) adds its active parameters: all but the experts a token
is not routed to; --enable-expert-parallel gives each GPU E/N whole experts (vLLM's flag).

With --quantization int8|fp8 the weights are the engine's quantized modules' bytes (1 byte a
weight of every Linear but the LM head, plus a float32 scale per output row), and the table says
how many more KV blocks that leaves than the model dtype's weights.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from rich.console import Console
from rich.table import Table

from nanoserve.config import DEFAULT_MODEL, Config
from nanoserve.models import (get_head_size, get_model_class, get_num_kv_heads, get_num_layers,
                              verify_with_parallel_config)
from nanoserve.model_loader import (CPU_KV_CACHE_GB, KV_BLOCKS_CAP_FACTOR,
                                    estimate_activation_bytes, kv_cache_bytes_per_token,
                                    kv_cache_memory_budget, max_len_of, max_useful_kv_blocks,
                                    num_blocks_for_memory, resolve_dtype, resolve_model_path,
                                    safetensors_files)
from nanoserve.layers import FusedMoE
from nanoserve.quantization import quantized_weight_bytes

GiB = 2**30
HF_MODEL_ID = re.compile(r"[\w.-]+/[\w.-]+")     # "organisation/name", as the hub spells ids
KV_CACHE_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16,
                   "float16": torch.float16, "fp8": torch.float8_e4m3fn}


@dataclass(frozen=True)
class MemoryReport:
    model: str
    dtype: torch.dtype
    quantization: Optional[str]      # None, "int8" or "fp8": the Linears' weights (quantization.py)
    kv_cache_dtype: torch.dtype
    tensor_parallel_size: int
    num_params: int
    params_from: str                 # "safetensors headers" or "config.json"
    buffer_bytes: int                # the RoPE cos/sin tables (float32), whole model
    weight_bytes: float              # per GPU: (parameters + buffers) / tensor_parallel_size
    device_bytes: Optional[float]    # per GPU; None: no GPU, the engine's CPU rule
    gpu_memory_utilization: float
    activation_bytes: float          # per GPU; 0 without a GPU (nothing is profiled)
    activation_from: str
    kv_budget_bytes: float
    kv_budget_from: str
    num_layers: int
    num_kv_heads: int                # per GPU
    head_dim: int
    kv_bytes_per_token: int          # per GPU
    block_size: int
    num_blocks: int
    max_model_len: int
    max_num_seqs: int
    data_parallel_size: int = 1      # engine cores, each holding all of the above
    active_params: Optional[int] = None   # a mixture of experts: the parameters a token uses
    experts: Optional[str] = None         # and how its experts sit on each GPU

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def num_seqs(self) -> int:
        """Sequences of max_model_len that fit in the pool at once."""
        return self.num_blocks // self.blocks_per_seq

    @property
    def used_bytes(self) -> float:
        return self.weight_bytes + self.activation_bytes + max(self.kv_budget_bytes, 0)

    @property
    def limit_bytes(self) -> float:
        """What the engine may use: the device's share, or (CPU rule) exactly what it uses."""
        if self.device_bytes is None:
            return self.used_bytes
        return self.device_bytes * self.gpu_memory_utilization


def load_hf_config(model: str):
    """(HF config, checkpoint directory or None) for the built-in model, a checkpoint directory
    or a config.json file (a checkpoint when safetensors files lie beside it)."""
    from transformers import AutoConfig
    path = resolve_model_path(model) if model == DEFAULT_MODEL else Path(model).expanduser()
    if not path.exists() and HF_MODEL_ID.fullmatch(model):
        path = fetch_config(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model: the directory {path} has no config.json")
        return AutoConfig.from_pretrained(path), path
    if not path.is_file():
        raise ValueError(f"model: {model!r} is neither a checkpoint directory nor a config.json")
    try:
        return AutoConfig.from_pretrained(path), path.parent
    except (OSError, ValueError) as e:
        raise ValueError(f"model: {path} is not a readable HF config.json ({e})") from None


def fetch_config(model_id: str) -> Path:
    """The config.json of Hugging Face model `model_id` ("Qwen/Qwen3-8B"), downloaded alone."""
    from huggingface_hub import hf_hub_download
    try:
        return Path(hf_hub_download(model_id, "config.json"))
    except Exception as e:     # offline, unknown id, gated without a token: the hub's own words
        raise ValueError(f"model: {model_id!r} is no local directory or file, and its config.json "
                         f"could not be fetched from the Hugging Face hub ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None


def checkpoint_num_params(path: Path, tied: bool) -> Optional[int]:
    """Parameters the engine loads from the checkpoint, read from the safetensors headers alone
    (each file opens with an 8-byte little-endian length, then that many bytes of JSON: name ->
    dtype, shape, offsets). None when there are no safetensors files."""
    files = safetensors_files(path)
    if not files:
        return None
    total = 0
    for file in files:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, info in header.items():
            # The engine's loader skips these (models/llama.py load_weights).
            skipped = name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight")
            if name != "__metadata__" and not skipped:
                total += math.prod(info["shape"])
    return total


def _check_arguments(device_memory_gb: Optional[float], activation_reserve_gb: Optional[float],
                     tp: int, kv_cache_dtype: str, dp: int = 1) -> None:
    """The checks of memory_report's own arguments (Config checks the engine's)."""
    if device_memory_gb is not None and not device_memory_gb > 0:
        raise ValueError(f"device_memory_gb must be > 0 (got {device_memory_gb})")
    if activation_reserve_gb is not None and not activation_reserve_gb >= 0:
        raise ValueError(f"activation_reserve_gb must be >= 0 (got {activation_reserve_gb})")
    for name, size in (("tensor_parallel_size", tp), ("data_parallel_size", dp)):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"{name} must be a positive integer (got {size!r})")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} "
                         f"(got {kv_cache_dtype!r})")


def memory_report(model: str = DEFAULT_MODEL, *, device_memory_gb: Optional[float] = None,
                  gpu_memory_utilization: float = 0.9, max_model_len: Optional[int] = None,
                  dtype: str = "auto", kv_cache_dtype: str = "auto", block_size: int = 16,
                  tensor_parallel_size: int = 1, kv_cache_memory_gb: Optional[float] = None,
                  activation_reserve_gb: Optional[float] = None,
                  max_num_batched_tokens: int = 2048, max_num_seqs: int = 64,
                  data_parallel_size: int = 1, quantization: Optional[str] = None,
                  enable_expert_parallel: bool = False) -> MemoryReport:
    """Size the KV pool exactly as the engine would for these settings (see the module doc)."""
    # Config checks what the engine checks (block_size, gpu_memory_utilization, dtype, ...).
    config = Config(model=model, dtype=dtype, block_size=block_size, max_model_len=max_model_len,
                    quantization=quantization, kv_cache_memory_gb=kv_cache_memory_gb,
                    max_num_seqs=max_num_seqs, gpu_memory_utilization=gpu_memory_utilization,
                    max_num_batched_tokens=max_num_batched_tokens)
    tp = tensor_parallel_size
    _check_arguments(device_memory_gb, activation_reserve_gb, tp, kv_cache_dtype, data_parallel_size)
    hf_config, checkpoint = load_hf_config(model)
    device_bytes = device_memory_gb * GiB if device_memory_gb is not None else (
        torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None)
    model_dtype = resolve_dtype(dtype, torch.device("cpu" if device_bytes is None else "cuda"),
                                hf_config)
    kv_dtype = KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype
    meta, num_params, params_from, buffer_bytes, weight_bytes = _weights(
        hf_config, checkpoint, model_dtype, quantization)
    weight_bytes /= tp
    verify_with_parallel_config(hf_config, tp, enable_expert_parallel)   # the engine's ValueError
    active_params, experts = _experts(meta, num_params, tp, enable_expert_parallel)

    # The engine's rule (ModelRunner._num_kv_blocks): a given pool size, or without a GPU a fixed
    # default, is used as is; on a GPU the pool gets what weights and activations leave, capped.
    resolved = config.resolve(max_position_embeddings=max_len_of(meta), num_kv_blocks=None)
    activation_bytes, activation_from = 0.0, "none: without a GPU nothing is profiled"
    if device_bytes is not None and activation_reserve_gb is not None:
        activation_bytes, activation_from = activation_reserve_gb * GiB, "given"
    elif device_bytes is not None:
        activation_bytes = estimate_activation_bytes(hf_config, model_dtype, max_num_batched_tokens,
                                                     max_num_seqs, block_size, tp, enable_expert_parallel)
        activation_from = f"estimated profile: a forward of {max_num_batched_tokens} tokens"
    if kv_cache_memory_gb is not None or device_bytes is None:
        kv_budget, cap = (kv_cache_memory_gb or CPU_KV_CACHE_GB) * GiB, math.inf
        kv_budget_from = ("kv_cache_memory_gb" if kv_cache_memory_gb is not None
                          else f"the engine's CPU default, {CPU_KV_CACHE_GB} GiB")
    else:     # the weights stand for all the device holds: no context nor other processes here
        kv_budget = kv_cache_memory_budget(device_bytes, gpu_memory_utilization, weight_bytes,
                                           activation_bytes)
        kv_budget_from = "device x utilisation - weights - reserve"
        cap = max_useful_kv_blocks(max_num_seqs, resolved.max_model_len, block_size)
    num_blocks = max(0, min(num_blocks_for_memory(kv_budget, hf_config, kv_dtype, block_size, tp), cap))
    return MemoryReport(
        model=model, dtype=model_dtype, quantization=quantization, kv_cache_dtype=kv_dtype,
        tensor_parallel_size=tp,
        num_params=num_params, params_from=params_from, buffer_bytes=buffer_bytes,
        weight_bytes=weight_bytes, device_bytes=device_bytes,
        gpu_memory_utilization=gpu_memory_utilization, activation_bytes=activation_bytes,
        activation_from=activation_from, kv_budget_bytes=kv_budget, kv_budget_from=kv_budget_from,
        num_layers=get_num_layers(hf_config), num_kv_heads=get_num_kv_heads(hf_config, tp),
        head_dim=get_head_size(hf_config), data_parallel_size=data_parallel_size,
        kv_bytes_per_token=kv_cache_bytes_per_token(hf_config, kv_dtype, tp), block_size=block_size,
        num_blocks=num_blocks, max_model_len=resolved.max_model_len, max_num_seqs=max_num_seqs,
        active_params=active_params, experts=experts)


def _weights(hf_config, checkpoint: Optional[Path], dtype: torch.dtype, quantization: Optional[str]):
    """(meta model, parameters, where they were counted, RoPE table bytes, weight bytes of the
    whole model). Quantized: the engine's own modules built with the quantization on the "meta"
    device (shapes and dtypes, no memory) say which weights are 1 byte and what their scales take."""
    with torch.device("meta"):         # the engine's own modules, shapes only: no memory
        meta = get_model_class(hf_config)(hf_config)
        quantized = quantization and get_model_class(hf_config)(hf_config, quantization=quantization)
    num_params = checkpoint and checkpoint_num_params(checkpoint, meta.tie_word_embeddings)
    params_from = "safetensors headers" if num_params else "config.json"
    num_params = num_params or sum(p.numel() for p in meta.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in meta.buffers())
    weight_bytes = (quantized_weight_bytes(quantized, dtype) if quantized
                    else num_params * dtype.itemsize)
    return meta, num_params, params_from, buffer_bytes, weight_bytes + buffer_bytes


def _experts(meta, num_params: int, tp: int, expert_parallel: bool):
    """A mixture of experts' (parameters active per token, where its experts sit); (None, None)
    for a dense model. Active: all but the experts a token does not pick (E - top_k of E)."""
    moes = [m for m in meta.modules() if isinstance(m, FusedMoE)]
    if not moes:
        return None, None
    unused = sum((m.w13_weight.numel() + m.w2_weight.numel()) * (1 - m.top_k / m.num_experts)
                 for m in moes)
    e, k = moes[0].num_experts, moes[0].top_k
    where = (f"{e // tp} of {e} whole experts per GPU (expert parallel)" if expert_parallel
             else f"a 1/{tp} slice of each of {e} experts per GPU" if tp > 1 else f"{e} experts")
    return round(num_params - unused), f"{where}, top-{k} a token, {len(moes)} MoE layers"


def verdict(r: MemoryReport) -> str:
    if r.kv_budget_bytes <= 0:
        return (f"does not fit: weights and activations alone exceed {_gib(r.limit_bytes)}; "
                f"try a larger --tensor-parallel-size, a smaller --dtype or a bigger GPU")
    if r.used_bytes > r.limit_bytes + 1:     # + 1: float rounding when the pool fills the rest
        return (f"does not fit: weights + reserve + the KV pool take {_gib(r.used_bytes)} of "
                f"{_gib(r.limit_bytes)}; lower --kv-cache-memory-gb")
    if r.num_seqs == 0:
        return (f"does not fit: one sequence of max_model_len {r.max_model_len} needs "
                f"{r.blocks_per_seq} blocks, the pool has {r.num_blocks}; the largest "
                f"max_model_len that fits is {r.num_blocks * r.block_size}")
    return f"fits: {r.num_seqs} sequences of max_model_len {r.max_model_len} at once"


def print_report(r: MemoryReport, console: Optional[Console] = None,
                 unquantized: Optional[MemoryReport] = None) -> None:
    """The table and the verdict; `unquantized`: the same settings without quantization, for the
    KV blocks that quantizing frees."""
    tp = r.tensor_parallel_size
    per_gpu = f" per GPU (TP {tp}: weights and KV heads split {tp} ways)" if tp > 1 else ""
    per_gpu += f", per rank (DP {r.data_parallel_size})" if r.data_parallel_size > 1 else ""
    table = Table(title=f"nanoserve memory · {r.model}{per_gpu}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_column(style="dim")
    item = r.dtype.itemsize
    if r.device_bytes is None:
        device = ("no GPU", "the engine's CPU rule: a fixed KV pool (pass --device-memory-gb to "
                  "size a GPU)")
    else:
        device = (_gib(r.limit_bytes), f"{_gib(r.device_bytes)} x gpu_memory_utilization "
                  f"{r.gpu_memory_utilization}")
    rows = [
        ("device", *device),
        ("weights", _gib(r.weight_bytes),
         (f"{r.num_params:,} params x {item} bytes ({str(r.dtype)[6:]}, from {r.params_from})"
          if r.quantization is None else f"{r.num_params:,} params: the Linears' {r.quantization} (1 "
          f"byte + a float32 scale per row), embedding and LM head {str(r.dtype)[6:]}")
         + f" + {r.buffer_bytes / 2**20:.1f} MiB RoPE tables" + (f", / {tp} GPUs" if tp > 1 else "")),
        *([("active / token", f"{r.active_params:,}", f"params, {r.active_params / r.num_params:.1%}"
            f": {r.experts}; a decode batch reads each expert any of its tokens picked")]
          if r.active_params else []),
        ("activation reserve", _gib(r.activation_bytes), r.activation_from),
        ("KV cache budget", _gib(r.kv_budget_bytes), r.kv_budget_from),
        ("KV bytes / token", f"{r.kv_bytes_per_token:,}",
         f"2 x {r.num_layers} layers x {r.num_kv_heads} kv_heads x {r.head_dim} head_dim x "
         f"{r.kv_cache_dtype.itemsize} bytes ({str(r.kv_cache_dtype)[6:]})"),
        ("KV bytes / block", f"{r.kv_bytes_per_token * r.block_size:,}",
         f"x block_size {r.block_size}"),
        ("blocks", f"{r.num_blocks:,}", "KV cache budget // bytes per block"
         if r.num_blocks == max(0, int(r.kv_budget_bytes // (r.kv_bytes_per_token * r.block_size)))
         else f"capped: {KV_BLOCKS_CAP_FACTOR} x max_num_seqs x {r.blocks_per_seq}, all it can use"),
        ("tokens in the cache", f"{r.num_blocks * r.block_size:,}", "blocks x block_size"),
        ("sequences at once", f"{r.num_seqs:,}",
         f"of max_model_len {r.max_model_len} ({r.blocks_per_seq} blocks each)"
         + (f"; the scheduler runs at most max_num_seqs {r.max_num_seqs}"
            if r.num_seqs > r.max_num_seqs else "")),
    ]
    if (dp := r.data_parallel_size) > 1:
        rows.append((f"x {dp} data-parallel ranks", f"{dp * tp} GPUs" if r.device_bytes else "",
                     f"each rank holds all of the above; together {_gib(dp * r.weight_bytes * tp)}"
                     f" of weights, {dp * r.num_blocks * r.block_size:,} tokens, "
                     f"{dp * r.num_seqs:,} sequences of max_model_len"))
    if unquantized is not None:
        rows.insert(2, ("KV blocks freed", f"{r.num_blocks - unquantized.num_blocks:+,}",
                        f"vs {str(r.dtype)[6:]} weights ({_gib(unquantized.weight_bytes)}: "
                        f"{unquantized.num_blocks:,} blocks)"))
    for row in rows:
        table.add_row(*row)
    console = console or Console()
    console.print(table)
    style = "bold green" if verdict(r).startswith("fits") else "bold red"
    console.print(verdict(r), style=style)


def main(plot: Optional[str] = None, lang: str = "en", **kwargs) -> None:
    report = memory_report(**kwargs)
    unquantized = memory_report(**{**kwargs, "quantization": None}) if report.quantization else None
    print_report(report, unquantized=unquantized)
    if plot:
        from nanoserve.tools.memory_plot import plot_memory     # the figure's words in `lang`
        plot_memory(report, plot, lang)
        print(f"wrote {plot}")


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"
