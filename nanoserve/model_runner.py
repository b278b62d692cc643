"""model_runner.py: the ModelRunner, which turns one SchedulerOutput into sampled tokens.

It owns everything with a tensor in it: the weights, the KV cache tensors, the flat
batch inputs and the sampler. Once per step it builds ONE flat batch of every scheduled
token (no batch dimension; padded only to replay a captured decode step) plus the metadata
that tells attention where each request's tokens live. Example, block_size 4, request A
decodes its 10th token with block table [7, 1, 3], request B prefills a 3-token prompt into
block [5]:

    input_ids       [a9, b0, b1, b2]
    positions       [9, 0, 1, 2]
    slot_mapping    [13, 20, 21, 22]      block_table[p // 4] * 4 + p % 4
    query_start_loc [0, 1, 4]             A's tokens are [0:1], B's [1:4]
    seq_lens        [10, 3]
    logits_indices  [0, 3]                the last token of each request that samples

Only requests that reach the end of their known tokens sample; a prefill chunk that stops
short of its prompt's end computes K/V and nothing else. A request with k speculative drafts
(`scheduled_spec_decode_tokens`) feeds its last token and the drafts, and its last k + 1
positions all get logits: the sampler verifies them in the same step (spec_decode.py).

Finding and reading the checkpoint, and the KV pool's sizing formulas, are in model_loader.py
(`nanoserve memory` uses them too, without a ModelRunner).

The model is plain torch; how its ops run on this device (the Triton kernels on CUDA, the C
kernels and a fused step on CPU, or the torch reference) is the backend's, chosen once at load
(backends.py): the runner calls `backend.forward`, never a kernel.

Under tensor parallel each rank's ModelRunner (worker.py) holds its shard of the weights and
of the KV heads, runs the same step on the same flat batch, and only rank 0 samples.

Lesson: lessons/06-length-and-memory.md
"""

from __future__ import annotations

import functools
import time
from types import SimpleNamespace
from typing import Optional

import torch

from nanoserve.backends import load_backend
from nanoserve.config import Config
from nanoserve.distributed import SINGLE, TensorParallel
from nanoserve.expert_load import ExpertLoad
from nanoserve.model_loader import (CPU_KV_CACHE_GB, DeviceMemory, device_memory,
                                    iterate_weights, kv_cache_memory_budget, max_len_of,
                                    max_useful_kv_blocks, num_blocks_for_memory, resolve_device,
                                    resolve_dtype, resolve_model_path)
from nanoserve.models import get_head_size, get_model_class, get_num_kv_heads, get_num_layers
from nanoserve.quantization import check_quantization, log_widening
from nanoserve.request import SchedulerOutput
from nanoserve.sampler import Sampler, SamplingMetadata
from nanoserve.spec_decode import sampled_per_request, verification_rows
from nanoserve.step_inputs import StepInputs, padded_batch_size


def batch_indices(num_scheduled: torch.Tensor, num_computed: torch.Tensor,
                  block_tables: torch.Tensor, block_size: int):
    """(positions, slot_mapping, query_start_loc) of one flat batch, int64: request r's tokens are
    rows query_start_loc[r]:query_start_loc[r + 1], at positions num_computed[r] onwards, each
    stored in the slot its block table gives (block_tables: [num_reqs, max_blocks], padded)."""
    query_start_loc = torch.zeros(len(num_scheduled) + 1, dtype=torch.long)
    torch.cumsum(num_scheduled, 0, out=query_start_loc[1:])
    # Token t of request r sits at position num_computed[r] + (t - query_start_loc[r]).
    req_of_token = torch.repeat_interleave(torch.arange(len(num_scheduled)), num_scheduled)
    positions = (torch.arange(int(query_start_loc[-1]))
                 - (query_start_loc[:-1] - num_computed)[req_of_token])
    slot_mapping = (block_tables[req_of_token, positions // block_size].long() * block_size
                    + positions % block_size)
    return positions, slot_mapping, query_start_loc


class ModelRunner:
    """`tp` and `device`: given by a tensor-parallel Worker (worker.py); then the model is this
    rank's shard, the KV cache holds this rank's KV heads, and only rank 0 samples."""

    # The flat batch's indices; lesson 2's exercise 2.4 runs an engine with a student's function
    # here instead (runner.batch_indices = theirs), to check it against HF's greedy tokens.
    batch_indices = staticmethod(batch_indices)

    def __init__(self, config: Config, tp: TensorParallel = SINGLE,
                 device: Optional[torch.device] = None):
        from transformers import AutoConfig
        self.model_path = resolve_model_path(config.model)
        self.hf_config = AutoConfig.from_pretrained(self.model_path)
        self.tp = tp
        self.device = device or torch.device(resolve_device(config.device))
        self.dtype = resolve_dtype(config.dtype, self.device, self.hf_config)
        check_quantization(config.quantization, self.hf_config, self.device)
        self.model = self._load_model(config.quantization, config.quantize_lm_head)
        # Each op's form for this device, chosen once (backends.py); the model itself stays plain.
        self.backend = load_backend(self.model, config, self.device)
        self.gemm_paths = self.backend.gemm_paths
        log_widening(self.gemm_paths)    # one line where fp8 weights are widened in the product
        self.vocab_size = self.hf_config.vocab_size
        self.block_size = config.block_size
        # Every step's inputs, the memory profile's too, at fixed addresses (step_inputs.py).
        max_len = min(config.max_model_len or max_len_of(self.model), max_len_of(self.model))
        self.inputs = StepInputs(config.max_num_batched_tokens, config.max_num_seqs,
                                 max_len // self.block_size + 1, self.device)
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
        # --trace on a mixture of experts: each step's expert load (rank 0's; before the capture,
        # which then records the copy of the router logits it makes)
        # (Not under DP+EP: there each FusedMoE runs on every rank's tokens, the exchange's.)
        self.expert_load = (ExpertLoad.of(self.model, config.max_num_batched_tokens, self.device)
                            if config.trace and self.tp.rank == 0 and not self.tp.expert_exchange
                            else None)
        self.step_expert_load: Optional[list[list[int]]] = None   # [MoE layer][expert], last step
        # A captured graph reads these caches and inputs where they are: captured now, once.
        self.backend.capture(self.inputs, self.kv_caches)
        self.sampler = Sampler(torch.Generator(self.device).manual_seed(config.seed),
                               argmax=self.backend.argmax)
        self.generators: dict[str, torch.Generator] = {}   # request id -> its seeded generator
        self.timings = {"prepare": 0.0, "forward": 0.0, "sample": 0.0}   # seconds, summed

    def _load_model(self, quantization: Optional[str], quantize_lm_head: bool) -> torch.nn.Module:
        """The model in the target dtype on the device, built with its quantization fixed, then
        filled one checkpoint tensor at a time (this rank's slice of each, quantized as read)."""
        model_class = get_model_class(self.hf_config)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)    # parameters are created in the target dtype
        try:
            with self.device:
                model = model_class(self.hf_config, self.tp, quantization,
                                    quantization if quantize_lm_head else None)
        finally:
            torch.set_default_dtype(default_dtype)
        model.load_weights(iterate_weights(self.model_path))
        return model.eval()

    def _num_kv_blocks(self, config: Config) -> int:
        """The pool, per rank: each rank's memory holds its own KV heads (`nanoserve memory
        --tensor-parallel-size` sizes with the same figures), and all ranks use the smallest. A
        pool sized from GPU memory is capped at what can ever be used (max_useful_kv_blocks)."""
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        memory = device_memory(self.device)
        fit = functools.partial(num_blocks_for_memory, hf_config=self.hf_config, dtype=self.dtype,
                                block_size=config.block_size, tensor_parallel_size=self.tp.size)
        if config.kv_cache_memory_gb is not None or memory is None:
            blocks = fit((config.kv_cache_memory_gb or CPU_KV_CACHE_GB) * 2**30)
        else:
            # (A max_model_len past the model's positions: Config.resolve refuses it just after.)
            max_len = min(config.max_model_len or max_len_of(self.model), max_len_of(self.model))
            budget = self._profile_free_cuda_memory(config, memory, max_len)
            blocks = min(fit(budget),
                         max_useful_kv_blocks(config.max_num_seqs, max_len, config.block_size))
        return self.tp.min_int(blocks, self.device) if self.tp.size > 1 else blocks

    @torch.inference_mode()
    def _profile_free_cuda_memory(self, config: Config, memory: DeviceMemory, max_len: int) -> float:
        """kv_cache_memory_budget() from what the device holds (total - free: what torch does not
        count, the CUDA context and other processes, is inside the budget, as in vLLM) and the
        peak a forward of the scheduler's biggest step adds, with a KV cache just big enough.
        The step is split into sequences of at most max_len tokens, as nano-vllm's warm-up does:
        one longer sequence would index the RoPE tables past their rows (on CUDA, an assert)."""
        memory.empty_cache()
        memory.reset_peak_memory_stats(self.device)
        n = min(config.max_num_batched_tokens, config.max_num_seqs * max_len)
        lens = [min(max_len, n - start) for start in range(0, n, max_len)]
        tables, num_blocks = [], 0
        for length in lens:
            tables.append(list(range(num_blocks, num_blocks + -(-length // self.block_size))))
            num_blocks += len(tables[-1])
        dummies = [SimpleNamespace(all_token_ids=[0] * k, num_tokens=k) for k in lens]
        input_ids, positions, meta, _, _ = self.prepare_inputs(
            SchedulerOutput(dummies, lens, [0] * len(lens), tables))
        caches = self._allocate_kv_caches(num_blocks)
        hidden = self.backend.forward(input_ids, positions, caches, self.backend.build_metadata(meta))
        # The logits in the model dtype and the float32 copy a sampling stage makes (TP: rank 0 only).
        logits = self.model.compute_logits(hidden[-config.max_num_seqs:])
        logits = None if logits is None else logits.float()
        memory.synchronize(self.device)
        del caches, hidden, logits
        memory.empty_cache()
        free, total = memory.mem_get_info(self.device)
        peak = memory.max_memory_allocated(self.device) - memory.memory_allocated(self.device)
        usable = kv_cache_memory_budget(total, config.gpu_memory_utilization, total - free, peak)
        if usable <= 0:
            raise ValueError(f"no GPU memory left for the KV cache: {total / 2**30:.1f} GiB x "
                             f"gpu_memory_utilization {config.gpu_memory_utilization} - in use "
                             f"{(total - free) / 2**30:.2f} GiB (weights, CUDA context, other "
                             f"processes) - activations {peak / 2**30:.2f} GiB")
        return usable

    def _allocate_kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cfg = self.hf_config     # this rank's KV heads (geometry.py)
        shape = (num_blocks, self.block_size, get_num_kv_heads(cfg, self.tp.size), get_head_size(cfg))
        new = self.backend.new_kv_cache
        return [(new(shape, self.dtype, self.device), new(shape, self.dtype, self.device))
                for _ in range(get_num_layers(cfg))]

    # -- one step --------------------------------------------------------------
    def prepare_inputs(self, out: SchedulerOutput):
        """The flat batch: (input_ids, positions, AttentionMetadata, logits_indices, rows that
        sample). See the module docstring for a worked example. A decode-only step (one new
        token a request) is padded with inert rows up to the backend's next capture size, where
        it replays a captured graph (step_inputs.py); the tensors are views of `self.inputs`."""
        input_ids: list[int] = []
        spec = out.scheduled_spec_decode_tokens
        num_drafts = [len(spec.get(req.request_id, ())) if spec else 0 for req in out.requests]
        for req, n, c in zip(out.requests, out.num_scheduled_tokens, out.num_computed_tokens):
            # With drafts: the slice is the last real token, the drafts follow it.
            input_ids += req.all_token_ids[c:c + n] + (spec.get(req.request_id, []) if spec else [])
        num_scheduled = torch.tensor(out.num_scheduled_tokens)
        num_computed = torch.tensor(out.num_computed_tokens)
        seq_lens = num_computed + num_scheduled
        max_blocks = max(len(bt) for bt in out.block_tables)
        block_tables = torch.tensor([bt + [0] * (max_blocks - len(bt)) for bt in out.block_tables],
                                    dtype=torch.int32)
        positions, slot_mapping, query_start_loc = self.batch_indices(
            num_scheduled, num_computed, block_tables, self.block_size)
        samples = [c + n == req.num_tokens + k for req, n, c, k in
                   zip(out.requests, out.num_scheduled_tokens, out.num_computed_tokens, num_drafts)]
        if spec:       # k + 1 rows for a request with k drafts
            logits_indices = verified_positions(query_start_loc, samples, num_drafts)
        else:          # the last token of each request that samples
            logits_indices = (query_start_loc[1:] - 1)[torch.tensor(samples, dtype=torch.bool)]
        max_query_len = max(out.num_scheduled_tokens)
        padded = (padded_batch_size(len(out.requests), self.backend.cudagraph_capture_sizes)
                  if max_query_len == 1 else None)
        input_ids, positions, meta, logits_indices = self.inputs.place(
            torch.tensor(input_ids), positions, slot_mapping, seq_lens, query_start_loc,
            block_tables, logits_indices, max_query_len, num_rows=padded)
        return (input_ids, positions, meta, logits_indices,
                [r for r, s in zip(out.requests, samples) if s])

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput
                      ) -> tuple[dict[str, list[int]], dict[str, object], dict[str, str]]:
        """Run one step. Returns ({request id: its new tokens}, {request id: TokenLogprobs},
        {request id: why its row failed}): one token a request, or with drafts the tokens it
        gains (vLLM's sampled_token_ids); a failed request has no tokens and no logprobs (its
        row's fault fails it alone: engine_core.py)."""
        for request_id in out.finished_req_ids:
            self.generators.pop(request_id, None)
        start = time.perf_counter()
        input_ids, positions, meta, logits_indices, sampling = self.prepare_inputs(out)
        forward_start = time.perf_counter()
        hidden = self._forward(input_ids, positions, meta)
        if self.expert_load is not None:     # the real rows only: padding is never counted
            self.step_expert_load = self.expert_load.counts(sum(out.num_scheduled_tokens))
        self.timings["prepare"] += forward_start - start
        if not sampling:
            self.timings["forward"] += time.perf_counter() - forward_start
            return {}, {}, {}
        logits = self.model.compute_logits(hidden[logits_indices])
        if logits is None:     # a tensor-parallel rank other than 0: rank 0 samples
            return {}, {}, {}
        # On CUDA the forward runs asynchronously: its time lands in "sample", at the sync.
        sample_start = time.perf_counter()
        self.timings["forward"] += sample_start - forward_start
        # One row per request; with drafts, k + 1 for a request with k (the positions it verifies).
        spec = out.scheduled_spec_decode_tokens
        rows = verification_rows(sampling, spec) if spec else [(r, r.output_token_ids)
                                                               for r in sampling]
        failed: dict[str, str] = {}
        metadata = SamplingMetadata.from_requests(
            [r.sampling_params for r, _ in rows], [r.prompt_token_ids for r, _ in rows],
            [output for _, output in rows], [self._generator(r, failed) for r, _ in rows],
            eos_token_id=sampling[0].eos_token_id, vocab_size=self.vocab_size, device=self.device)
        if out.grammar_bitmask is not None:
            metadata.grammar_bitmask, metadata.grammar_rows = self._grammar_bitmask(out, rows)
        # The step's one sync: the sampled ids (with the logprobs) to the host.
        row_tokens, row_logprobs = self.sampler(logits, metadata).tolists(metadata)
        for (request, _), token in zip(rows, row_tokens):
            if token < 0:      # the sampler's mark of a row that was not finite
                failed.setdefault(request.request_id, "its logits or probabilities were not "
                                  "finite (NaN or infinity)")
        logprobs = {r.request_id: lp for (r, _), lp in zip(rows, row_logprobs)
                    if lp is not None and r.request_id not in failed}
        sampled = (sampled_per_request(sampling, spec, row_tokens) if spec
                   else {r.request_id: [token] for r, token in zip(sampling, row_tokens)})
        for request_id in failed:
            del sampled[request_id]
        self.timings["sample"] += time.perf_counter() - sample_start
        return sampled, logprobs, failed

    @torch.inference_mode()
    def execute_dummy_batch(self) -> None:
        """A forward of one inert row (vLLM's execute_dummy_batch; step_inputs.py's padding: slot
        -1 stores no KV, length 0 attends nothing) that samples nothing: under DP+EP a core with
        no work of its own runs it, to meet the MoE exchanges of the ranks that have some."""
        self._forward(*self.inputs.padded_decode(1))

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """The step's forward; under DP+EP first every rank's rows, gathered once for all the
        MoE layers' exchanges (distributed.py's ExpertExchange.begin)."""
        if self.tp.expert_exchange:
            self.tp.expert_exchange.begin(input_ids.shape[0])
        return self.backend.forward(input_ids, positions, self.kv_caches,
                                    self.backend.build_metadata(meta))

    def _grammar_bitmask(self, out: SchedulerOutput, rows: list):
        """The step's grammar bitmask (the engine core's, structured_output.py) on this device, a
        row per logits row as xgrammar's op wants it, built on the host (no sync); and the rows it
        masks (`rows`: the verification rows; a structured request has no drafts, so one row).
        Under tensor parallel only rank 0 gets here: it holds the gathered logits."""
        row_of = {r.request_id: i for i, (r, _) in enumerate(rows)}
        masked = [row_of[request_id] for request_id in out.structured_output_request_ids]
        full = torch.full((len(rows), out.grammar_bitmask.shape[1]), -1, dtype=torch.int32,
                          pin_memory=self.device.type == "cuda")
        full[masked] = out.grammar_bitmask
        return full.to(self.device, non_blocking=True), masked

    def _generator(self, request, failed: dict[str, str]) -> Optional[torch.Generator]:
        """The request's own generator; a request's k + 1 verified rows draw from it in turn.
        A seed no generator takes (past 64 bits: SamplingParams refuses it, but a Request can be
        built by hand) fails its request alone, in `failed`; its row draws from a throwaway."""
        seed = request.sampling_params.seed
        if seed is None:
            return None
        if request.request_id not in self.generators:
            generator = torch.Generator(self.device)
            try:
                generator.manual_seed(seed)
            except (ValueError, RuntimeError) as e:       # "Overflow when unpacking long long"
                failed[request.request_id] = f"its seed cannot seed a generator: {e}"
                return generator
            self.generators[request.request_id] = generator
        return self.generators[request.request_id]


def verified_positions(query_start_loc: torch.Tensor, samples: list[bool],
                       num_drafts: list[int]) -> torch.Tensor:
    """The flat-batch rows whose logits the sampler reads: the last token of each request that
    samples, and for one with k drafts its last k + 1 (query_start_loc [0, 1, 4], the second
    request with 2 drafts -> [0, 1, 2, 3])."""
    ends = query_start_loc[1:].tolist()
    return torch.tensor([i for end, s, k in zip(ends, samples, num_drafts) if s
                         for i in range(end - 1 - k, end)], dtype=torch.long)
