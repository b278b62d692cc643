"""sampler.py: one batched call that turns a step's logits into one token per request, each
request with its own SamplingParams.

The order is vLLM's:

    raw logits ──────────────────────────────> logprobs (log_softmax of the RAW logits)
      │ grammar bitmask: -inf where a structured request's grammar forbids the token
      │ min_tokens: EOS and stop_token_ids -> -inf while the output is too short
      │ penalties: repetition (prompt + output), frequency and presence (output)
      ├──> argmax ───────────────────────────> greedy rows (temperature 0)
      │ temperature -> min_p -> top_k -> top_p
      └──> sample (exponential race) ────────> sampled rows; a seeded row draws its noise
                                                from its own torch.Generator

Every parameter is a per-row tensor, so greedy and sampled rows, penalised and plain rows, mix in
one batch with no Python loop over rows (only over the seeded ones, for their generators). A
stage no row needs is skipped: its metadata field is None, and an all-greedy batch is masks +
penalties + argmax. Worked example, one row, temperature 0.5, top_k 2:

    logits [2.0, 1.0, 0.5, -1.0] / 0.5        -> [4.0, 2.0, 1.0, -2.0]
    top_k 2 keeps the two largest             -> [4.0, 2.0, -inf, -inf]
    softmax: token 0 w.p. 0.881, token 1 w.p. 0.119, tokens 2 and 3 never

A row whose logits or probabilities are not finite (a NaN, an inf: a model's overflow, or what a
parameter made of them) samples no token: -1, which fails that row's request alone.

The model runner builds `SamplingMetadata.from_requests(...)` once per step (host values copied
without waiting: `to_device`), calls `Sampler()`, then `SamplerOutput.tolists`: the one sync.
Tests: pytest -x -q tests/test_sampler.py
Lesson: lessons/07-sampling-and-config.md
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from nanoserve.layers import greedy_argmax
from nanoserve.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class SamplingMetadata:
    """The batch's sampling parameters as per-row tensors (row i = the i-th scheduled request).

    A field is None when no row needs that stage this step: that is how the sampler skips it.
    Knobs of greedy rows are set to "off" (their token is an argmax, so the knobs cannot matter).
    """

    num_rows: int
    vocab_size: int
    all_greedy: bool
    greedy: Optional[Tensor]               # [n] bool, rows with temperature 0; None unless mixed
    temperature: Optional[Tensor]          # [n] float32, 1.0 = off
    min_p: Optional[Tensor]                # [n] float32, 0.0 = off
    top_k: Optional[Tensor]                # [n] int64, vocab_size = off
    max_top_k: int                         # largest top_k of the rows that use it
    top_p: Optional[Tensor]                # [n] float32, 1.0 = off
    generators: dict[int, torch.Generator]  # sampled row -> the request's own generator
    min_tokens_rows: Optional[Tensor]      # [m] int64 } the (row, token id) pairs that get -inf:
    min_tokens_token_ids: Optional[Tensor]  # [m] int64 } EOS + stop ids of too-short outputs
    repetition_penalty: Optional[Tensor]   # [n] float32, 1.0 = off
    prompt_mask: Optional[Tensor]          # [n, vocab] bool, the token occurs in the prompt
    frequency_penalty: Optional[Tensor]    # [n] float32, 0.0 = off
    presence_penalty: Optional[Tensor]     # [n] float32, 0.0 = off
    output_counts: Optional[Tensor]        # [n, vocab] float32, occurrences in the output
    num_logprobs: list[Optional[int]]      # per row: the request's `logprobs` (None = no)
    logprobs_rows: Optional[Tensor]        # [r] int64, the rows that asked
    max_num_logprobs: int                  # largest `logprobs` of the batch
    # Structured outputs: the step's grammar bitmask [n, ceil(vocab / 32)] int32 (structured_output.py)
    # and the rows it masks (host ints); set by the runner, None when no row is structured.
    grammar_bitmask: Optional[Tensor] = None
    grammar_rows: Optional[list[int]] = None

    @classmethod
    def from_requests(cls, params: list[SamplingParams], prompt_token_ids: list[list[int]],
                      output_token_ids: list[list[int]],
                      generators: list[Optional[torch.Generator]], eos_token_id: Optional[int],
                      vocab_size: int, device) -> "SamplingMetadata":
        """Build the metadata of one step. `generators[i]` is request i's own generator
        (`torch.Generator(device).manual_seed(seed)`, kept by the engine across steps) or None."""
        _check_batch(params, prompt_token_ids, output_token_ids, generators, eos_token_id,
                     vocab_size)
        greedy = [p.is_greedy for p in params]
        all_greedy = all(greedy)

        def row_tensor(values: list, dtype) -> Optional[Tensor]:
            return to_device(values, dtype, device) if values else None

        def knob(values: list, off, dtype) -> Optional[Tensor]:
            """A per-row tensor, or None when no sampled row turns this knob."""
            values = [off if g else v for v, g in zip(values, greedy)]
            return None if all(v == off for v in values) else row_tensor(values, dtype)

        top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        mask_rows, mask_ids = _min_tokens_mask(params, output_token_ids, eos_token_id)
        rep_on, out_on, prompt_mask, output_counts = _penalty_counts(
            params, prompt_token_ids, output_token_ids, vocab_size, device)
        return cls(
            num_rows=len(params),
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            greedy=row_tensor(greedy, torch.bool) if any(greedy) and not all_greedy else None,
            temperature=knob([p.temperature for p in params], 1.0, torch.float32),
            min_p=knob([p.min_p for p in params], 0.0, torch.float32),
            top_k=knob(top_ks, vocab_size, torch.int64),
            max_top_k=max((k for k, g in zip(top_ks, greedy) if not g and k < vocab_size),
                          default=0),
            top_p=knob([p.top_p for p in params], 1.0, torch.float32),
            generators={i: gen for i, (gen, g) in enumerate(zip(generators, greedy))
                        if gen is not None and not g},
            min_tokens_rows=row_tensor(mask_rows, torch.int64),
            min_tokens_token_ids=row_tensor(mask_ids, torch.int64),
            repetition_penalty=row_tensor([p.repetition_penalty for p in params], torch.float32)
            if rep_on else None,
            prompt_mask=prompt_mask,
            frequency_penalty=row_tensor([p.frequency_penalty for p in params], torch.float32)
            if out_on else None,
            presence_penalty=row_tensor([p.presence_penalty for p in params], torch.float32)
            if out_on else None,
            output_counts=output_counts,
            num_logprobs=[p.logprobs for p in params],
            logprobs_rows=row_tensor([i for i, p in enumerate(params) if p.logprobs is not None],
                                     torch.int64),
            max_num_logprobs=max((p.logprobs or 0 for p in params), default=0),
        )


def _check_batch(params: list[SamplingParams], prompt_token_ids: list[list[int]],
                 output_token_ids: list[list[int]], generators: list[Optional[torch.Generator]],
                 eos_token_id: Optional[int], vocab_size: int) -> None:
    """ValueError for a batch the caller put together wrong. The parameters' own values were
    checked once, by SamplingParams and Processor (processor.py): here they are only asserted."""
    n = len(params)
    for name, per_row in (("prompt_token_ids", prompt_token_ids),
                          ("output_token_ids", output_token_ids), ("generators", generators)):
        if len(per_row) != n:
            raise ValueError(f"{name} must have one entry per request "
                             f"(got {len(per_row)} for {n} requests)")
    if not (isinstance(vocab_size, int) and vocab_size > 0):
        raise ValueError(f"vocab_size must be a positive integer (got {vocab_size!r})")
    if eos_token_id is not None and not 0 <= eos_token_id < vocab_size:
        raise ValueError(f"eos_token_id must be in [0, {vocab_size}) (got {eos_token_id})")
    for p, gen in zip(params, generators):
        assert all(t < vocab_size for t in p.stop_token_ids), \
            f"stop_token_ids {p.stop_token_ids} reached the sampler unchecked (vocab {vocab_size})"
        assert p.logprobs is None or p.logprobs <= vocab_size, \
            f"logprobs {p.logprobs} reached the sampler unchecked (vocab {vocab_size})"
        if p.seed is not None and gen is None:
            raise ValueError(f"generators: a request with seed {p.seed} needs its generator")


def _min_tokens_mask(params: list[SamplingParams], output_token_ids: list[list[int]],
                     eos_token_id: Optional[int]) -> tuple[list[int], list[int]]:
    """The (row, token id) pairs to set to -inf: EOS and the stop ids of each row whose output
    is still shorter than min_tokens. vLLM masks the model's EOS even under ignore_eos
    (ignore_eos only tells the scheduler not to stop on it)."""
    mask_rows, mask_ids = [], []
    for i, (p, out) in enumerate(zip(params, output_token_ids)):
        if len(out) < p.min_tokens:
            stop_ids = set(p.stop_token_ids)
            if eos_token_id is not None:
                stop_ids.add(eos_token_id)
            mask_rows += [i] * len(stop_ids)
            mask_ids += sorted(stop_ids)
    return mask_rows, mask_ids


def _penalty_counts(params: list[SamplingParams], prompt_token_ids: list[list[int]],
                    output_token_ids: list[list[int]], vocab_size: int, device
                    ) -> tuple[bool, bool, Optional[Tensor], Optional[Tensor]]:
    """(any repetition penalty, any frequency/presence penalty, prompt_mask, output_counts).
    Penalties need token counts; only the rows that use a penalty pay for building them."""
    rep = [p.repetition_penalty for p in params]
    rep_on = any(r != 1.0 for r in rep)
    out_on = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params)
    prompt_mask = output_counts = None
    if rep_on:
        prompt_mask = _token_counts([ids if r != 1.0 else [] for ids, r in
                                     zip(prompt_token_ids, rep)], vocab_size, device) > 0
    if rep_on or out_on:
        penalised = [r != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
                     for r, p in zip(rep, params)]
        output_counts = _token_counts([ids if on else [] for ids, on in
                                       zip(output_token_ids, penalised)], vocab_size, device)
    return rep_on, out_on, prompt_mask, output_counts


def to_device(values: list, dtype: torch.dtype, device) -> Tensor:
    """Host values on `device` without a sync: pinned, copied asynchronously (`torch.tensor(values,
    device="cuda")` copies from pageable memory, waiting for every kernel queued: the forward)."""
    cuda = torch.device(device).type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=cuda).to(device, non_blocking=True)


def _token_counts(token_ids: list[list[int]], vocab_size: int, device) -> Tensor:
    """[n, vocab] float32: how often each token occurs in each row's list. Rows are padded with
    the id `vocab_size`, whose counts land in an extra column that is then cut off:
    [[3, 1, 3], [2]], vocab 4 -> padded [[3, 1, 3], [2, 4, 4]] -> [[0, 1, 0, 2], [0, 0, 1, 0]]."""
    width = max((len(ids) for ids in token_ids), default=0)
    padded = to_device([ids + [vocab_size] * (width - len(ids)) for ids in token_ids],
                       torch.int64, device).view(len(token_ids), width)
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


@dataclass
class TokenLogprobs:
    """The logprobs one row asked for, all from the raw logits (before penalties/temperature)."""

    logprob: float                   # of the sampled token
    rank: int                        # 1 = the sampled token was the most likely one
    top: list[tuple[int, float]]     # the `logprobs` most likely (token id, logprob), best first


@dataclass
class SamplerOutput:
    """On the device until `tolists` fetches it, in the step's one device-to-host copy."""

    sampled_token_ids: Tensor                  # [n] int64; -1: the row was not finite
    logprobs_tensors: Optional[Tensor]         # [r, 2 (1 + max n)] float64: `_logprobs`

    def tolists(self, md: SamplingMetadata) -> tuple[list[int], list[Optional[TokenLogprobs]]]:
        """(token per row, logprobs per row: None where the request did not ask). The logprobs
        travel in the tokens' copy as float64 (exact for token ids and for float32 values)."""
        n, table = md.num_rows, self.logprobs_tensors
        if table is None:
            return self.sampled_token_ids.tolist(), [None] * n
        host = torch.cat([self.sampled_token_ids.double(), table.flatten()]).tolist()
        out, width = [None] * n, table.shape[1] // 2       # a row: its values, then its ids
        rows = [i for i, k in enumerate(md.num_logprobs) if k is not None]
        for row, start in zip(rows, range(n, len(host), 2 * width)):
            k, v = md.num_logprobs[row], host[start:start + width]
            t = [int(x) for x in host[start + width:start + 2 * width]]
            out[row] = TokenLogprobs(logprob=v[0], rank=t[0], top=list(zip(t[1:k + 1], v[1:k + 1])))
        return [int(t) for t in host[:n]], out


def apply_grammar_bitmask(logits: Tensor, bitmask: Tensor, rows: list[int]) -> Tensor:
    """-inf wherever a structured row's grammar forbids the token, in place, for all of the
    step's structured rows at once (`rows`; bitmask row i masks logits row i); the other rows
    are not touched. `bitmask` is xgrammar's layout, 32 tokens per int32 word: token t is allowed
    when bit t % 32 of word t // 32 is set. Vocabulary 3, bitmask row [0b110]: tokens 1 and 2
    keep their logits, token 0 gets -inf. In torch that is

        allowed = ((bitmask[rows, :, None] >> torch.arange(32)) & 1).flatten(1)[:, :vocab].bool()
        logits[rows] = logits[rows].masked_fill(~allowed, -inf)

    which xgrammar's own op does without the [rows, vocab] temporaries (C++ on a CPU, a kernel
    on a GPU): 4x faster for 64 rows of a 49k vocabulary on a CPU (11 ms against 45)."""
    import xgrammar
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)
    return logits


def apply_penalties(logits: Tensor, md: SamplingMetadata) -> Tensor:
    """vLLM/OpenAI penalties (the result may reuse `logits`' storage). Repetition (tokens of prompt + output): a positive logit
    is divided by the penalty, a negative one multiplied, so penalty > 1 always pushes down.
    Frequency and presence (output tokens only): logit -= freq * count + presence * (count > 0)."""
    if md.repetition_penalty is not None:
        seen = md.prompt_mask | (md.output_counts > 0)
        rep = md.repetition_penalty[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    if md.frequency_penalty is not None:
        logits -= md.frequency_penalty[:, None] * md.output_counts
        logits -= md.presence_penalty[:, None] * (md.output_counts > 0)
    return logits


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens whose probability is below min_p * (the row's highest probability)."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill_(probs < threshold, _NEG_INF)


def apply_top_k_top_p(logits: Tensor, top_k: Optional[Tensor], max_top_k: int,
                      top_p: Optional[Tensor]) -> Tensor:
    """Keep each row's top_k largest logits, then its nucleus: the smallest set of most likely
    tokens whose probability (renormalised after top_k) reaches top_p. Tokens tied with the k-th
    largest logit are all kept."""
    if top_p is None:
        # top_k alone needs only each row's k-th largest logit: topk(max k) beats a full sort.
        largest = logits.topk(max_top_k, dim=-1).values                # [n, max_top_k]
        kth = largest.gather(1, top_k.clamp(max=max_top_k)[:, None] - 1)
        kth.masked_fill_(top_k[:, None] > max_top_k, _NEG_INF)          # rows with top_k off
        return logits.masked_fill_(logits < kth, _NEG_INF)
    sorted_logits, order = logits.sort(dim=-1)                          # ascending: tail first
    if top_k is not None:
        kth = sorted_logits.gather(1, (logits.shape[1] - top_k)[:, None])
        sorted_logits.masked_fill_(sorted_logits < kth, _NEG_INF)
    # Drop the tail: the least likely tokens whose mass together is <= 1 - top_p. Written this
    # way, top_p = 1 drops only tokens of probability 0, whatever the rounding of the cumsum.
    tail = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)[:, None]
    tail[:, -1] = False                                  # the most likely token always stays
    sorted_logits.masked_fill_(tail, _NEG_INF)
    return logits.scatter_(1, order, sorted_logits)


class Sampler:
    """`Sampler(generator)(logits, metadata) -> SamplerOutput`. Rows without a generator of
    their own draw from `generator` (the global torch RNG when None). `argmax`: each row's
    argmax, the backend's (the CPU backend's reads bf16 logits as they are, vectorised)."""

    def __init__(self, generator: Optional[torch.Generator] = None,
                 argmax: Callable[[Tensor], Tensor] = greedy_argmax):
        self.generator, self.argmax = generator, argmax

    def __call__(self, logits: Tensor, md: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or tuple(logits.shape) != (md.num_rows, md.vocab_size):
            raise ValueError(f"logits must have shape [{md.num_rows}, {md.vocab_size}] "
                             f"(got {list(logits.shape)})")
        raw_logits = logits
        # Float32 wherever a stage computes with the logits, a copy where one works in place (the
        # raw logits feed the logprobs). An all-greedy batch with no min_tokens or penalty reads
        # them as the model gave them, in its dtype (widening cannot change which is largest).
        in_place = not md.all_greedy or md.min_tokens_rows is not None or md.frequency_penalty is not None
        if in_place or md.repetition_penalty is not None:
            logits = logits.to(torch.float32, copy=in_place)
        if md.grammar_bitmask is not None:   # first: every later stage sees only allowed tokens
            logits = apply_grammar_bitmask(logits.clone() if logits is raw_logits else logits,
                                           md.grammar_bitmask, md.grammar_rows)
        if md.min_tokens_rows is not None:
            logits[md.min_tokens_rows, md.min_tokens_token_ids] = _NEG_INF
        logits = apply_penalties(logits, md)

        # Each row's largest logit (NaN if it has one): a NaN, an inf or -inf (every token
        # masked) there, and the row has no probabilities and no token: -1, fetched with the
        # tokens (no extra sync), which fails that request alone (engine_core.py).
        if md.all_greedy:
            sampled = self.argmax(logits)
            row_max = logits.gather(1, sampled[:, None]).squeeze(1)   # the argmax picks a NaN
        else:
            greedy_ids = self.argmax(logits) if md.greedy is not None else None
            if md.temperature is not None:
                logits.div_(md.temperature[:, None])
            if md.min_p is not None:
                logits = apply_min_p(logits, md.min_p)
            if md.top_k is not None or md.top_p is not None:
                logits = apply_top_k_top_p(logits, md.top_k, md.max_top_k, md.top_p)
            row_max = logits.amax(dim=-1)
            sampled = self._sample(logits, md.generators)
            if greedy_ids is not None:
                sampled = torch.where(md.greedy, greedy_ids, sampled)
        return SamplerOutput(sampled.masked_fill(~row_max.isfinite(), -1),
                             _logprobs(raw_logits, sampled, md))

    def _sample(self, logits: Tensor, generators: dict[int, torch.Generator]) -> Tensor:
        """Exponential race: with q_i ~ Exp(1) independent, argmax_i p_i / q_i is token i with
        probability p_i (q_i / p_i ~ Exp(p_i), and the smallest of independent exponentials is
        i with probability p_i / sum(p)). Unlike torch.multinomial (one generator per call),
        each row's noise is its own fill, so a seeded row's token depends only on its logits and its own generator: the
        same whatever else is in the batch and wherever the row sits."""
        probs = logits.softmax(dim=-1)
        # Exp(1) noise as -log(1 - U), U uniform in [0, 1): the distribution of exponential_(),
        # which on CPU is ~7x slower (72 ms against 11 ms for 64 rows of a 49k vocabulary).
        q = torch.empty_like(probs)
        if len(generators) < q.shape[0]:
            q.uniform_(generator=self.generator)
        for row, gen in generators.items():
            q[row].uniform_(generator=gen)
        q = q.neg_().log1p_().neg_()
        # The noise may be exactly 0; then 0 / 0 = NaN would let a masked token win.
        q.clamp_(min=torch.finfo(q.dtype).tiny)
        return self.argmax(probs.div_(q))


def _logprobs(raw_logits: Tensor, sampled: Tensor, md: SamplingMetadata) -> Optional[Tensor]:
    """vLLM V1's default ("raw_logprobs"): log_softmax of the logits as the model produced them,
    for the rows that asked: the sampled token's logprob and rank, then the batch's max n of top
    logprobs (`SamplerOutput.tolists` cuts each row to its own n). Per row: [its logprob, top-n
    logprobs, its rank, top-n ids], float64, on the device (None: no row asked)."""
    if md.logprobs_rows is None:
        return None
    logprobs = raw_logits[md.logprobs_rows].log_softmax(dim=-1, dtype=torch.float32)
    token_logprob = logprobs.gather(1, sampled[md.logprobs_rows][:, None])
    rank = (logprobs >= token_logprob).sum(dim=-1, keepdim=True)   # ties rank against it
    top_logprobs, top_ids = logprobs.topk(md.max_num_logprobs, dim=-1)
    return torch.cat([t.double() for t in (token_logprob, top_logprobs, rank, top_ids)], dim=1)
