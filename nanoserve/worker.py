"""worker.py: the ModelRunner, which turns one SchedulerOutput into sampled tokens.

It owns everything with a tensor in it: the weights, the KV cache tensors, the flat
batch inputs and the sampler. Once per step it builds ONE flat batch of every scheduled
token (no padding, no batch dimension) plus the metadata that tells attention where each
request's tokens live. Example, block_size 4, request A decodes its 10th token with block
table [7, 1, 3], request B prefills a 3-token prompt into block [5]:

    input_ids       [a9, b0, b1, b2]
    positions       [9, 0, 1, 2]
    slot_mapping    [13, 20, 21, 22]      block_table[p // 4] * 4 + p % 4
    query_start_loc [0, 1, 4]             A's tokens are [0:1], B's [1:4]
    seq_lens        [10, 3]
    logits_indices  [0, 3]                the last token of each request that samples

Only requests that reach the end of their known tokens sample; a prefill chunk that stops
short of its prompt's end computes K/V and nothing else.

Under tensor parallel each rank's ModelRunner (executor.py) holds its shard of the weights and
of the KV heads, runs the same step on the same flat batch, and only rank 0 samples.

Loading follows HF's format: config.json, *.safetensors (one file, or shards with
model.safetensors.index.json) and tokenizer files, from a directory, the built-in
`nanoserve-tiny`, or a hub id when the hub is reachable.

Lesson: lessons/06-length-and-memory.md
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from nanoserve.config import DEFAULT_MODEL, Config
from nanoserve.distributed import SINGLE, TensorParallel
from nanoserve.models import get_model_class
from nanoserve.models.linear import choose_cpu_gemms
from nanoserve.paged_attention import AttentionMetadata
from nanoserve.paged_attention_cpu import load as load_cpu_kernel
from nanoserve.sampler import Sampler, SamplingMetadata
from nanoserve.scheduler import SchedulerOutput

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_CACHE_GB = 1.0     # the CPU default: room for ~45k tokens of nanoserve-tiny, fits a laptop


def keep_freed_memory() -> None:
    """Ask glibc (Linux) to keep freed activation memory for reuse instead of unmapping it.

    Why: a 2048-token prefill allocates and frees activations of up to ~25 MB in every layer.
    By default glibc serves big blocks with fresh mmap()s and gives them back on free(), so each
    such step pays ~350k page faults (~0.3 s of a 2.4 s prefill step on the bench model). With
    the mmap threshold at glibc's 32 MiB maximum and trimming only above 1 GiB, memory is reused."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (e.g. musl): nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    libc.mallopt(m_mmap_threshold, 32 * 2**20)
    libc.mallopt(m_trim_threshold, 2**30)


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
    return device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(dtype: str, device: torch.device, hf_config) -> torch.dtype:
    if dtype != "auto":
        return DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32    # CPUs without bf16 units are slow in half precision
    checkpoint = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(checkpoint, str):
        checkpoint = DTYPES.get(checkpoint)
    return checkpoint if checkpoint in DTYPES.values() else torch.bfloat16


def kv_cache_bytes_per_token(hf_config, dtype: torch.dtype) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    return 2 * hf_config.num_hidden_layers * num_kv_heads * head_dim * dtype.itemsize


def num_blocks_for_memory(memory_bytes: float, hf_config, dtype: torch.dtype, block_size: int) -> int:
    """How many KV blocks fit in `memory_bytes`: the engine and `nanoserve memory` both use it."""
    return int(memory_bytes // (kv_cache_bytes_per_token(hf_config, dtype) * block_size))


def kv_cache_memory_budget(total_bytes: float, gpu_memory_utilization: float,
                           weight_bytes: float, activation_bytes: float) -> float:
    """The KV pool's share of a GPU: total x gpu_memory_utilization - weights - peak activations.
    May be <= 0 (the model does not fit); the engine and `nanoserve memory` both use it."""
    return total_bytes * gpu_memory_utilization - weight_bytes - activation_bytes


def estimate_activation_bytes(hf_config, dtype: torch.dtype, max_num_batched_tokens: int,
                              max_num_seqs: int, block_size: int) -> int:
    """What `ModelRunner._profile_free_cuda_memory` would measure, estimated where no GPU can run
    the profile (`nanoserve memory`). Its forward of n = max_num_batched_tokens tokens holds, at
    its peak, the sum of:
      - its own KV cache for n tokens (block-rounded);
      - the widest point of one layer, the MLP: the residual and its normed copy [n, hidden],
        gate_up [n, 2 x intermediate], silu(gate) and the product [n, intermediate] each;
      - the logits of max_num_seqs rows, in the model dtype and again in float32.
    The last two never coincide, so the sum errs on the safe (high) side. Attention adds only
    its [n, q_size] output: the paged kernels never build an n x n score matrix."""
    n, item = max_num_batched_tokens, dtype.itemsize
    profile_kv = -(-n // block_size) * block_size * kv_cache_bytes_per_token(hf_config, dtype)
    mlp = n * (2 * hf_config.hidden_size + 4 * hf_config.intermediate_size) * item
    logits = min(n, max_num_seqs) * hf_config.vocab_size * (item + 4)
    return profile_kv + mlp + logits


def max_len_of(model) -> int:
    """The longest sequence the engine serves: max_position_embeddings, capped by a sliding
    window (paged attention attends to the whole sequence; past the window HF would not)."""
    max_len = model.config.max_position_embeddings
    return min(max_len, model.sliding_window) if getattr(model, "sliding_window", None) else max_len


class ModelRunner:
    """`tp` and `device`: given by a tensor-parallel Worker (executor.py); then the model is this
    rank's shard, the KV cache holds this rank's KV heads, and only rank 0 samples."""

    def __init__(self, config: Config, tp: TensorParallel = SINGLE,
                 device: Optional[torch.device] = None):
        from transformers import AutoConfig
        self.model_path = resolve_model_path(config.model)
        self.hf_config = AutoConfig.from_pretrained(self.model_path)
        self.tp = tp
        self.device = device or torch.device(resolve_device(config.device))
        if self.device.type == "cpu":
            keep_freed_memory()
            load_cpu_kernel()  # build it (or warn) now, not in the middle of the first decode
        self.dtype = resolve_dtype(config.dtype, self.device, self.hf_config)
        self.model = self._load_model()
        self.gemm_paths = {"all": "cuBLAS"} if self.device.type == "cuda" else choose_cpu_gemms(
            self.model.linears(config.max_num_batched_tokens, config.max_num_seqs),
            config.cpu_gemm, shared=frozenset({id(self.model.model.embed_tokens.weight)}))
        self.vocab_size = self.hf_config.vocab_size
        self.block_size = config.block_size
        self.config = config.resolve(max_position_embeddings=max_len_of(self.model),
                                     num_kv_blocks=self._num_kv_blocks(config))
        needed = -(-self.config.max_model_len // self.block_size)
        if needed > self.config.num_kv_blocks:
            raise ValueError(
                f"the KV cache holds {self.config.num_kv_blocks} blocks "
                f"({self.config.num_kv_blocks * self.block_size} tokens), less than one sequence "
                f"of max_model_len ({self.config.max_model_len}); lower max_model_len or raise "
                f"num_kv_blocks / kv_cache_memory_gb / gpu_memory_utilization")
        self.kv_caches = self._allocate_kv_caches(self.config.num_kv_blocks)
        self.sampler = Sampler(torch.Generator(self.device).manual_seed(config.seed))
        self.generators: dict[str, torch.Generator] = {}   # request id -> its seeded generator
        self.timings = {"prepare": 0.0, "forward": 0.0, "sample": 0.0}   # seconds, summed

    def _load_model(self) -> torch.nn.Module:
        model_class = get_model_class(self.hf_config)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)    # parameters are created in the target dtype
        try:
            with self.device:
                model = model_class(self.hf_config, self.tp)
        finally:
            torch.set_default_dtype(default_dtype)
        model.load_weights(iterate_weights(self.model_path))
        return model.eval()

    def _num_kv_blocks(self, config: Config) -> int:
        """The pool, per rank: each rank's memory holds its own KV heads (`nanoserve memory
        --tensor-parallel-size` sizes with the same shard), and all ranks use the smallest."""
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        if config.kv_cache_memory_gb is not None or self.device.type != "cuda":
            memory = (config.kv_cache_memory_gb or CPU_KV_CACHE_GB) * 2**30
        else:
            memory = self._profile_free_cuda_memory(config)
        blocks = num_blocks_for_memory(memory, self.model.shard_config, self.dtype, config.block_size)
        return self.tp.min_int(blocks, self.device) if self.tp.size > 1 else blocks

    @torch.inference_mode()
    def _profile_free_cuda_memory(self, config: Config) -> float:
        """kv_cache_memory_budget() with the weights and the peak activations measured on a
        forward of max_num_batched_tokens tokens (with a KV cache just big enough for them)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        weights = torch.cuda.memory_allocated(self.device)
        n = config.max_num_batched_tokens
        caches = self._allocate_kv_caches(-(-n // config.block_size))
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, device=self.device),
            block_tables=torch.arange(-(-n // config.block_size), dtype=torch.int32,
                                      device=self.device)[None],
            seq_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            max_query_len=n, max_seq_len=n)
        hidden = self.model(torch.zeros(n, dtype=torch.long, device=self.device),
                            torch.arange(n, device=self.device), caches, meta)
        self.model.compute_logits(hidden[-config.max_num_seqs:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - weights
        del caches, hidden
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        usable = kv_cache_memory_budget(total, config.gpu_memory_utilization, weights, peak)
        if usable <= 0:
            raise ValueError(f"no GPU memory left for the KV cache: {total / 2**30:.1f} GiB x "
                             f"gpu_memory_utilization {config.gpu_memory_utilization} - weights "
                             f"{weights / 2**30:.2f} GiB - activations {peak / 2**30:.2f} GiB")
        return usable

    def _allocate_kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cfg = self.model.shard_config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = (num_blocks, self.block_size,
                 getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads, head_dim)
        return [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                 torch.zeros(shape, dtype=self.dtype, device=self.device))
                for _ in range(cfg.num_hidden_layers)]

    # -- one step --------------------------------------------------------------
    def prepare_inputs(self, out: SchedulerOutput):
        """The flat batch: (input_ids, positions, AttentionMetadata, logits_indices, rows that
        sample). See the module docstring for a worked example."""
        input_ids: list[int] = []
        for req, n, c in zip(out.requests, out.num_scheduled_tokens, out.num_computed_tokens):
            input_ids += req.all_token_ids[c:c + n]
        num_scheduled = torch.tensor(out.num_scheduled_tokens)
        num_computed = torch.tensor(out.num_computed_tokens)
        seq_lens = num_computed + num_scheduled
        query_start_loc = torch.zeros(len(out.requests) + 1, dtype=torch.long)
        torch.cumsum(num_scheduled, 0, out=query_start_loc[1:])
        # Token t of request r sits at position num_computed[r] + (t - query_start_loc[r]).
        req_of_token = torch.repeat_interleave(torch.arange(len(out.requests)), num_scheduled)
        positions = torch.arange(len(input_ids)) - (query_start_loc[:-1] - num_computed)[req_of_token]
        max_blocks = max(len(bt) for bt in out.block_tables)
        block_tables = torch.tensor([bt + [0] * (max_blocks - len(bt)) for bt in out.block_tables],
                                    dtype=torch.int32)
        slot_mapping = (block_tables[req_of_token, positions // self.block_size].long()
                        * self.block_size + positions % self.block_size)
        samples = [c + n == req.num_tokens for req, n, c in
                   zip(out.requests, out.num_scheduled_tokens, out.num_computed_tokens)]
        logits_indices = (query_start_loc[1:] - 1)[torch.tensor(samples, dtype=torch.bool)]
        to = dict(device=self.device, non_blocking=True)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(**to), block_tables=block_tables.to(**to),
            seq_lens=seq_lens.to(dtype=torch.int32, **to),
            query_start_loc=query_start_loc.to(dtype=torch.int32, **to),
            max_query_len=max(out.num_scheduled_tokens), max_seq_len=int(seq_lens.max()))
        return (torch.tensor(input_ids, device=self.device), positions.to(**to), meta,
                logits_indices.to(**to), [r for r, s in zip(out.requests, samples) if s])

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> tuple[dict[str, int], dict[str, object]]:
        """Run one step. Returns ({request id: sampled token}, {request id: TokenLogprobs})."""
        for request_id in out.finished_req_ids:
            self.generators.pop(request_id, None)
        start = time.perf_counter()
        input_ids, positions, meta, logits_indices, sampling = self.prepare_inputs(out)
        forward_start = time.perf_counter()
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        self.timings["prepare"] += forward_start - start
        if not sampling:
            self.timings["forward"] += time.perf_counter() - forward_start
            return {}, {}
        logits = self.model.compute_logits(hidden[logits_indices])
        if logits is None:     # a tensor-parallel rank other than 0: rank 0 samples
            return {}, {}
        # On CUDA the forward runs asynchronously: its time lands in "sample", at the sync.
        sample_start = time.perf_counter()
        self.timings["forward"] += sample_start - forward_start
        metadata = SamplingMetadata.from_requests(
            [r.sampling_params for r in sampling], [r.prompt_token_ids for r in sampling],
            [r.output_token_ids for r in sampling], [self._generator(r) for r in sampling],
            eos_token_id=sampling[0].eos_token_id, vocab_size=self.vocab_size, device=self.device)
        result = self.sampler(logits, metadata)
        ids = [r.request_id for r in sampling]
        logprobs = {rid: lp for rid, lp in zip(ids, result.logprobs) if lp is not None}
        sampled = dict(zip(ids, result.sampled_token_ids.tolist()))
        self.timings["sample"] += time.perf_counter() - sample_start
        return sampled, logprobs

    def _generator(self, request) -> Optional[torch.Generator]:
        seed = request.sampling_params.seed
        if seed is None:
            return None
        if request.request_id not in self.generators:
            self.generators[request.request_id] = torch.Generator(self.device).manual_seed(seed)
        return self.generators[request.request_id]
