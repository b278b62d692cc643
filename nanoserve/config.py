"""config.py: the one `Config` object that every layer of nanoserve reads.

Built once at start-up, validated, then resolved against the model (max_model_len capped by
the checkpoint's max_position_embeddings) and the memory profile (num_kv_blocks), and never
changed again. Every field carries its default and its help text, so the CLI flags
(`--max-model-len`, `--no-enable-prefix-caching`, ...) are generated from this file alone:

    >>> Config(block_size=16).block_size
    16
    >>> Config(block_size=0)
    Traceback (most recent call last):
    ...
    ValueError: block_size must be a positive integer (got 0)

This module must not import torch: the CLI, the calculators and the trace replay read it.
Lessons: lessons/06-length-and-memory.md, lessons/07-sampling-and-config.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Optional

DEFAULT_MODEL = "nanoserve-tiny"
QUANTIZATION_METHODS = ("int8", "fp8")   # weight-only, quantized at load (quantization.py)


def _f(default: Any, help: str, choices: tuple | None = None, repr: bool = True):
    """A dataclass field with the help text the CLI shows (and the allowed choices); a secret
    has repr=False."""
    return field(default=default, repr=repr, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class Config:
    # -- model ---------------------------------------------------------------
    model: str = _f(DEFAULT_MODEL, "HF-format checkpoint directory, hub id, or the built-in "
                    "'nanoserve-tiny'.")
    tokenizer: Optional[str] = _f(None, "Tokenizer directory or hub id (default: the model's).")
    dtype: str = _f("auto", "Weight and activation dtype. 'auto': float32 on CPU; on CUDA the "
                    "checkpoint's, with float32 served in bfloat16 (float16 on GPUs without bf16).",
                    ("auto", "float32", "bfloat16", "float16"))
    device: str = _f("auto", "'auto': cuda when available, else cpu.", ("auto", "cpu", "cuda"))
    seed: int = _f(0, "Seed for requests that have no seed of their own.")
    skip_tokenizer_init: bool = _f(False, "Load no tokenizer: prompts must be "
                                   "{'prompt_token_ids': [...]} and outputs carry token ids only.")
    cpu_gemm: str = _f("auto", "How Linear layers multiply on CPU. 'auto': the fastest path on "
                       "this machine, timed at start-up on the model's shapes ('int8pack': "
                       "torch's int8 product, for --quantization int8).",
                       ("auto", "torch", "onednn", "onednn-fp32", "kernel", "amx", "int8pack"))
    quantization: Optional[str] = _f(None, "Quantize the weights at load, weight-only, one scale "
                                     "per output channel (every Linear but the LM head): 'int8', "
                                     "or 'fp8' (e4m3; torch._scaled_mm on GPUs with fp8, else "
                                     "widened to --dtype in the product). Activations keep --dtype.",
                                     QUANTIZATION_METHODS)
    quantize_lm_head: bool = _f(False, "With --quantization: quantize the LM head too, as "
                                "llama.cpp's Q8_0 does (vLLM keeps it in --dtype: the default).")
    tensor_parallel_size: int = _f(1, "Split the model over this many worker processes "
                                   "(torch.distributed: NCCL, one GPU each; gloo on CPU).")
    enable_expert_parallel: bool = _f(False, "A mixture-of-experts model's experts shared out "
                                      "whole among the tensor-parallel ranks (each holds "
                                      "num_experts / tensor_parallel_size of them) instead of "
                                      "each expert sliced across all of them. With "
                                      "--data-parallel-size N (tensor_parallel_size 1, every rank "
                                      "on this host, CPU): among the N engine cores, which "
                                      "exchange tokens in each MoE layer and step in lockstep; "
                                      "attention stays data parallel (vLLM's DP attention + EP). "
                                      "A dense model: plain data parallel.")
    max_model_len: Optional[int] = _f(None, "Longest sequence (prompt + output) in tokens. "
                                      "Default and cap: the model's max_position_embeddings.")
    # -- KV cache ------------------------------------------------------------
    block_size: int = _f(16, "Tokens per KV cache block.")
    num_kv_blocks: Optional[int] = _f(None, "Override the computed KV pool size (in blocks); "
                                      "never capped, unlike a pool sized from GPU memory.")
    kv_cache_memory_gb: Optional[float] = _f(None, "KV cache size in GiB. Default: profiled on "
                                             "CUDA, 1 GiB on CPU.")
    gpu_memory_utilization: float = _f(0.9, "Fraction of the GPU's memory nanoserve may use, "
                                       "counting what the device holds already (CUDA context, "
                                       "other processes). The KV pool gets what is left, at most "
                                       "2 x max_num_seqs sequences of max_model_len.")
    enable_prefix_caching: bool = _f(True, "Reuse KV blocks of identical prompt prefixes.")
    # -- scheduler -----------------------------------------------------------
    max_num_seqs: int = _f(64, "Most requests running in one step.")
    max_num_batched_tokens: int = _f(2048, "Token budget of one step (prefill + decode).")
    enable_chunked_prefill: bool = _f(True, "Split long prompts over several steps.")
    scheduling_policy: str = _f("fcfs", "Who is admitted first, and who is preempted first.",
                                ("fcfs", "priority"))
    # -- CUDA graphs (vLLM's names; cuda/graphs.py) -----------------------------
    enforce_eager: bool = _f(False, "Run every step op by op: capture no CUDA graphs.")
    cudagraph_capture_sizes: Optional[list[int]] = _f(
        None, "Batch sizes at which decode-only steps are captured as CUDA graphs and replayed "
        "(a step is padded up to the next size; above the largest it runs eagerly). Default: "
        "vLLM's 1 2 4 8 16 ... 248 (by 8) 256 272 ... (by 16), up to max_num_seqs.")
    # -- sampling and observability -----------------------------------------
    max_logprobs: int = _f(20, "Largest `logprobs` a request may ask for.")
    speculative_config: Optional[SpeculativeConfig] = _f(
        None, "Speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5}' "
        "proposes up to num_speculative_tokens tokens by looking the last 2-5 tokens up in the "
        "request's own prompt and output, and verifies them in one step (lessons/08).")
    # -- admission (the server) ------------------------------------------------
    max_waiting_requests: int = _f(512, "Sequences (prompts x n) the server holds that have "
                                   "not produced a token yet; beyond it new requests get HTTP 503 "
                                   "with Retry-After, and one asking for more alone gets 400.")
    request_timeout_s: Optional[float] = _f(None, "Abort a request still unfinished after this "
                                            "many seconds; its client is told why.")
    trace: Optional[str] = _f(None, "Write a JSONL trace of every step to this path.")
    debug: int = _f(0, "Show more: 1 prints one line per step to stderr; 2 also asserts the KV "
                    "cache invariants after every step.")
    # -- processes -----------------------------------------------------------
    engine_process: bool = _f(True, "Serve with the engine core in its own process (vLLM V1's "
                              "layout); --no-engine-process steps it in a thread of the API "
                              "server (lessons, debugging). The offline LLM always steps it itself.")
    engine_iteration_timeout_s: float = _f(60.0, "The step watchdog (vLLM's "
                                           "VLLM_ENGINE_ITERATION_TIMEOUT_S): an engine core or a "
                                           "TP worker silent this many seconds (a step that long, "
                                           "a hang, a stopped process) marks the engine dead.")
    # -- data parallel (the server): one engine core per rank, vLLM's names -----
    data_parallel_size: int = _f(1, "Serve this many copies of the model, one engine core "
                                 "process each (with its own scheduler, KV cache and TP workers); "
                                 "the API server sends each request to the least loaded one.")
    data_parallel_size_local: Optional[int] = _f(None, "Engine cores this host runs: ranks "
                                                 "S .. S+N-1 (S: the start rank, else 0). Default: "
                                                 "every rank from S on. The other ranks run on "
                                                 "--headless hosts.")
    data_parallel_start_rank: Optional[int] = _f(None, "With --headless: the first of the "
                                                 "data-parallel ranks this host runs.")
    data_parallel_rank: Optional[int] = _f(None, "With --headless: the one data-parallel rank "
                                           "this host runs.")
    data_parallel_address: str = _f("127.0.0.1", "The API server's host, which --headless hosts "
                                    "connect to (ZeroMQ over TCP).")
    data_parallel_rpc_port: int = _f(29550, "The API server's port for the engine cores of "
                                     "--headless hosts.")
    data_parallel_rpc_secret: Optional[str] = _f(
        None, "The secret that signs every message between the API server and the engine cores "
        "(HMAC-SHA256): ranks on other hosts need it, the same on every host. Prefer the "
        "environment variable NANOSERVE_RPC_SECRET (a flag shows in `ps`). Default: a random "
        "one per run when every rank runs on this host.", repr=False)
    headless: bool = _f(False, "Run engine cores only (no API server): they connect to the API "
                        "server at --data-parallel-address:--data-parallel-rpc-port.")

    def __post_init__(self):
        _positive_int(self, "block_size")
        _positive_int(self, "max_num_seqs")
        _positive_int(self, "max_num_batched_tokens")
        _positive_int(self, "max_waiting_requests")
        for name in ("request_timeout_s", "engine_iteration_timeout_s"):
            if (value := getattr(self, name)) is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 (got {value})")
        _positive_int(self, "tensor_parallel_size")
        _check_data_parallel(self)
        if self.enable_expert_parallel and self.data_parallel_size > 1:
            _check_data_parallel_experts(self)
        for name in ("max_model_len", "num_kv_blocks"):
            if getattr(self, name) is not None:
                _positive_int(self, name)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer (got {self.seed!r})")
        if not isinstance(self.debug, int) or not 0 <= self.debug <= 2:
            raise ValueError(f"debug must be 0, 1 or 2 (got {self.debug!r})")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an integer >= 0 (got {self.max_logprobs!r})")
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0 (got {self.kv_cache_memory_gb})")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1] "
                             f"(got {self.gpu_memory_utilization})")
        for f in dataclasses.fields(self):
            choices, value = f.metadata.get("choices"), getattr(self, f.name)
            if choices and value not in choices and not (value is None and f.default is None):
                raise ValueError(f"{f.name} must be one of {', '.join(choices)} "
                                 f"(got {getattr(self, f.name)!r})")
        if self.quantize_lm_head and self.quantization is None:
            raise ValueError("quantize_lm_head needs --quantization (int8 or fp8)")
        if self.speculative_config is not None:
            # Kept as a SpeculativeConfig (a dict or JSON string is parsed here, once).
            object.__setattr__(self, "speculative_config",
                               SpeculativeConfig.parse(self.speculative_config))
        object.__setattr__(self, "cudagraph_capture_sizes", _capture_sizes(self))
        if (not self.enable_chunked_prefill and self.max_model_len is not None
                and self.max_num_batched_tokens < self.max_model_len):
            # Without chunking a whole prompt must fit in one step's budget.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) when enable_chunked_prefill is off")

    @property
    def data_parallel_ranks_here(self) -> range:
        """The data-parallel ranks whose engine cores this host runs.

        >>> list(Config(data_parallel_size=4, data_parallel_size_local=2).data_parallel_ranks_here)
        [0, 1]
        >>> list(Config(data_parallel_size=4, data_parallel_start_rank=2, headless=True)
        ...      .data_parallel_ranks_here)
        [2, 3]
        """
        rank, local = self.data_parallel_rank, self.data_parallel_size_local
        start = rank if rank is not None else self.data_parallel_start_rank or 0
        if local is None:
            local = 1 if rank is not None else self.data_parallel_size - start
        return range(start, start + local)

    def resolve(self, *, max_position_embeddings: int, num_kv_blocks: int) -> "Config":
        """The start-up step: fix the values that depend on the model and the memory.

        max_model_len defaults to, and is capped by, the model's max_position_embeddings.
        """
        if self.max_model_len is not None and self.max_model_len > max_position_embeddings:
            raise ValueError(f"max_model_len ({self.max_model_len}) is larger than the model's "
                             f"max_position_embeddings ({max_position_embeddings})")
        return dataclasses.replace(self, max_model_len=self.max_model_len or max_position_embeddings,
                                   num_kv_blocks=num_kv_blocks)

    # -- CLI -----------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        """Add one flag per field: max_model_len -> --max-model-len (bools get --no-...)."""
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            kind = _base_type(f.type)
            if f.type == "Optional[list[int]]":     # --cudagraph-capture-sizes 1 2 4 8
                parser.add_argument(flag, type=int, nargs="+", default=f.default,
                                    help=f.metadata["help"])
            elif kind is bool:
                parser.add_argument(flag, action=argparse.BooleanOptionalAction,
                                    default=f.default, help=f.metadata["help"])
            else:
                parser.add_argument(flag, type=kind, default=f.default,
                                    choices=f.metadata.get("choices"), help=f.metadata["help"])

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "Config":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` keys for the n-gram (prompt lookup) proposer:

        >>> spec = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}')
        >>> spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
        (4, 5, 5)
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: Optional[int] = None   # as vLLM: one given sets the other; none: 5 and 5
    prompt_lookup_max: Optional[int] = None
    # No drafts while more requests than this are in: a CPU, or a big batch, is compute-bound and
    # rejected drafts cost real time (lesson 8). vLLM V0's key (V1: ..._per_batch_size ranges).
    disable_by_batch_size: Optional[int] = None

    @classmethod
    def parse(cls, value: Any) -> "SpeculativeConfig":
        """A SpeculativeConfig from itself, a dict or a JSON string; ValueError naming the bad key."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object (got {value!r})")
        known = {f.name for f in dataclasses.fields(cls)}
        for key in value:
            if key not in known:
                raise ValueError(f"speculative_config: unknown key {key!r} "
                                 f"(known: {', '.join(sorted(known))})")
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise ValueError(f"speculative_config: {key!r} is required")
        return cls(**value)

    def __post_init__(self):
        if self.method != "ngram":
            raise ValueError(f"speculative_config: method must be 'ngram' (got {self.method!r})")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = 5
        low, high = (high if low is None else low), (low if high is None else high)
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "disable_by_batch_size"):
            value = getattr(self, name)
            if name == "disable_by_batch_size" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config: {name} must be a positive integer "
                                 f"(got {value!r})")
        if low > high:
            raise ValueError(f"speculative_config: prompt_lookup_min ({low}) must be <= "
                             f"prompt_lookup_max ({high})")


def _positive_int(config: Config, name: str) -> None:
    value = getattr(config, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer (got {value!r})")


def _capture_sizes(config: Config) -> list[int]:
    """The decode batch sizes to capture, ascending; none under enforce_eager.

    >>> Config(max_num_seqs=20).cudagraph_capture_sizes
    [1, 2, 4, 8, 16]
    """
    if config.enforce_eager:
        return []
    sizes = config.cudagraph_capture_sizes
    if sizes is None:
        # vLLM's default list (vllm/config/vllm.py, VllmConfig._set_cudagraph_sizes): every size
        # up to 4, then every 8th below 256, then every 16th.
        sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, config.max_num_seqs + 1, 16))
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes):
        raise ValueError(f"cudagraph_capture_sizes must be positive integers (got {sizes!r})")
    # vLLM caps its list at 2 x max_num_seqs (room for speculative decoding's k + 1 tokens a
    # request); here only steps of one token a request are captured: at most max_num_seqs rows.
    limit = min(config.max_num_seqs, config.max_num_batched_tokens)
    return sorted({s for s in sizes if s <= limit})


def _check_data_parallel(config: Config) -> None:
    _positive_int(config, "data_parallel_size")
    _positive_int(config, "data_parallel_rpc_port")
    size, local = config.data_parallel_size, config.data_parallel_size_local
    for name in ("data_parallel_rank", "data_parallel_start_rank"):
        rank = getattr(config, name)
        if rank is not None and not config.headless:
            raise ValueError(f"{name} is for --headless hosts (the API server's host runs ranks "
                             f"0 .. data_parallel_size_local - 1)")
        if rank is not None and not (isinstance(rank, int) and 0 <= rank < size):
            raise ValueError(f"{name} must be in [0, {size}) (got {rank!r})")
    if config.data_parallel_rank is not None and (config.data_parallel_start_rank is not None
                                                  or local not in (None, 1)):
        raise ValueError("data_parallel_rank names one rank: for several on this host, give "
                         "data_parallel_start_rank and data_parallel_size_local")
    start = config.data_parallel_start_rank or 0
    if local is not None and not (isinstance(local, int) and 0 <= local <= size - start):
        raise ValueError(f"data_parallel_size_local must be in [0, {size - start}] (got {local!r})")
    if config.headless and local == 0:
        raise ValueError("data_parallel_size_local must be >= 1 on a --headless host")
    if size > 1 and not config.engine_process:
        raise ValueError("data_parallel_size > 1 needs engine core processes (no "
                         "--no-engine-process)")


def _check_data_parallel_experts(config: Config) -> None:
    """DP+EP, as built: one host, TP 1 (executor.py's join_data_parallel_experts)."""
    if config.tensor_parallel_size > 1:
        raise ValueError("enable_expert_parallel with data_parallel_size > 1 needs "
                         "tensor_parallel_size 1 (the experts are shared out among the "
                         "data-parallel ranks; TP x DP expert groups are not built)")
    if config.headless or len(config.data_parallel_ranks_here) < config.data_parallel_size:
        raise ValueError("enable_expert_parallel with data_parallel_size > 1 needs every rank "
                         "on this host (data_parallel_size_local = data_parallel_size, no "
                         "--headless): the ranks' group meets through a file in the API "
                         "server's private directory; across hosts it would need a TCP store, "
                         "which listens on every interface unauthenticated")


def _base_type(annotation: str) -> type:
    """'Optional[int]' -> int: the type argparse should parse the flag's value with."""
    for name, kind in (("bool", bool), ("int", int), ("float", float)):
        if annotation.replace("Optional[", "").rstrip("]") == name:
            return kind
    return str
