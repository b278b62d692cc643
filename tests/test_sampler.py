"""Oracle and statistical tests of nanoserve/sampler.py (CPU, a few seconds).

Each test compares the batched sampler with a straightforward per-row Python reference (float64):
the support of top_k / top_p / min_p, the penalties, the whole filtered distribution (chi-square
on many draws under a fixed seed), seeded reproducibility, min_tokens masking and logprobs.

Run: pytest -x -q tests/test_sampler.py
"""

import math

import pytest
import torch

from nanoserve.cpu import kernels as cpu_kernels
from nanoserve.sampler import Sampler, SamplingMetadata, apply_penalties
from nanoserve.sampling_params import SamplingParams

V = 16  # vocabulary of most tests: small enough that every kept token gets sampled often


def metadata(params, prompts=None, outputs=None, generators=None, eos=None, vocab=V):
    n = len(params)
    return SamplingMetadata.from_requests(
        params, prompts or [[] for _ in range(n)], outputs or [[] for _ in range(n)],
        generators or [None] * n, eos, vocab, "cpu")


def seeded(seed):
    return torch.Generator().manual_seed(seed)


def sample_counts(logits_rows, params, reps, prompts=None, outputs=None, eos=None):
    """Draw `reps` tokens for each (logits row, params) pair in one batch; return the per-pair
    token counts as lists."""
    n = len(params)
    logits = torch.stack(logits_rows).repeat(reps, 1)
    md = metadata(params * reps, (prompts or [[]] * n) * reps, (outputs or [[]] * n) * reps,
                  eos=eos, vocab=logits.shape[1])
    tokens = Sampler(seeded(0))(logits, md).sampled_token_ids.view(reps, n)
    return [torch.bincount(tokens[:, i], minlength=logits.shape[1]).tolist() for i in range(n)]


# ---- the reference: one row at a time, in float64, straight from the definitions ----------------

def reference_probs(row, p: SamplingParams, prompt=(), output=(), eos=None):
    x = [float(v) for v in row]
    if len(output) < p.min_tokens:
        for t in list(p.stop_token_ids) + ([eos] if eos is not None else []):
            x[t] = -math.inf
    x = reference_penalties(x, p, prompt, output)
    if p.temperature == 0:
        best = max(range(len(x)), key=lambda t: x[t])
        return [1.0 if t == best else 0.0 for t in range(len(x))]
    x = [v / p.temperature for v in x]
    probs = softmax(x)
    if p.min_p > 0:
        threshold = p.min_p * max(probs)
        probs = normalise([q if q >= threshold else 0.0 for q in probs])
    if p.top_k > 0:
        kept = sorted(range(len(x)), key=lambda t: -probs[t])[:p.top_k]
        probs = normalise([q if t in kept else 0.0 for t, q in enumerate(probs)])
    if p.top_p < 1:
        probs = normalise([q if t in nucleus(probs, p.top_p) else 0.0
                           for t, q in enumerate(probs)])
    return probs


def reference_penalties(x, p, prompt, output):
    x = list(x)
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x


def softmax(x):
    m = max(x)
    e = [math.exp(v - m) for v in x]
    return normalise(e)


def normalise(q):
    s = sum(q)
    return [v / s for v in q]


def nucleus(probs, top_p):
    """The smallest set of most likely tokens whose mass reaches top_p."""
    kept, mass = set(), 0.0
    for t in sorted(range(len(probs)), key=lambda t: -probs[t]):
        if mass >= top_p:
            break
        kept.add(t)
        mass += probs[t]
    return kept


def assert_matches(counts, probs):
    """Zero-probability tokens never appear, and the counts pass a chi-square test (about five
    standard deviations of the statistic: deterministic here, since the seed is fixed)."""
    n = sum(counts)
    assert all(c == 0 for c, q in zip(counts, probs) if q == 0), (counts, probs)
    cells = [(c, q * n) for c, q in zip(counts, probs) if q > 0]
    if len(cells) == 1:
        return
    chi2 = sum((c - e) ** 2 / e for c, e in cells)
    dof = len(cells) - 1
    assert chi2 < dof + 5 * math.sqrt(2 * dof), (chi2, dof, counts, [e for _, e in cells])


# ---- tests --------------------------------------------------------------------------------------

def test_temperature_zero_is_argmax_alone_and_mixed():
    torch.manual_seed(0)
    logits = torch.randn(6, V)
    md = metadata([SamplingParams(temperature=0.0)] * 6)
    assert md.all_greedy and md.temperature is None and md.top_k is None
    assert torch.equal(Sampler()(logits, md).sampled_token_ids, logits.argmax(-1))

    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_k=3),
             SamplingParams(temperature=0.0, top_p=0.5), SamplingParams(top_p=0.3, min_p=0.1),
             SamplingParams(temperature=0.0, min_p=0.9), SamplingParams(temperature=0.7)]
    greedy = torch.tensor([p.is_greedy for p in mixed])
    for step in range(20):
        out = Sampler()(logits, metadata(mixed)).sampled_token_ids
        assert torch.equal(out[greedy], logits.argmax(-1)[greedy])
    assert out.dtype == torch.int64 and out.shape == (6,)

    # greedy = argmax of the PENALISED logits, also next to sampled rows
    row = torch.tensor([[0.0, 3.0, 2.5] + [0.0] * (V - 3)])
    penalised = SamplingParams(temperature=0.0, presence_penalty=1.0)
    for batch in ([penalised], [penalised, SamplingParams()]):
        md = metadata(batch, outputs=[[1]] * len(batch))
        assert Sampler()(row.repeat(len(batch), 1), md).sampled_token_ids[0].item() == 2


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")
@pytest.mark.parametrize("n", [1, 5, 15, 16, 17, 31, 32, 33, 100, 49152])
def test_argmax_kernel_equals_torch(n):
    """csrc/argmax.c against torch's argmax, float32 and bf16: the first maximum on ties, a NaN
    beats everything (the first NaN wins), +-inf, wherever they sit against the vector width and
    the tail."""
    gen = torch.Generator().manual_seed(n)
    rows = [torch.randn(n, generator=gen), torch.randint(0, 3, (n,), generator=gen).float(),
            torch.full((n,), float("-inf")), torch.zeros(n)]
    for pos in sorted({p for p in (0, 1, n // 2, n - 2, n - 1) if 0 <= p < n}):
        for special in (float("nan"), float("inf"), float("-inf")):
            row = torch.randn(n, generator=gen)
            row[pos] = special
            rows.append(row)
        two_nans = torch.randn(n, generator=gen)
        two_nans[pos], two_nans[-1] = float("nan"), float("nan")
        rows.append(two_nans)
    # bf16 (a bf16 model's logits, read as they are): rounding makes ties of near values too.
    for x in (torch.stack(rows), torch.stack(rows).to(torch.bfloat16)):
        assert torch.equal(cpu_kernels.argmax(x), x.argmax(dim=-1)), x.dtype
        assert torch.equal(cpu_kernels.argmax(x[:1]), x[:1].argmax(dim=-1)), x.dtype


def test_greedy_sampling_leaves_the_logits_as_they_were():
    """The all-greedy path reads the logits without its float32 copy: nothing may write to them."""
    logits = torch.randn(3, V)
    before = logits.clone()
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, min_tokens=2,
                                                                   stop_token_ids=[1]),
                   SamplingParams(temperature=0.0, frequency_penalty=1.0, repetition_penalty=1.5)):
        Sampler()(logits, metadata([params] * 3, outputs=[[1, 2]] * 3))
        assert torch.equal(logits, before), params


def test_all_greedy_batch_draws_no_noise():
    """An all-greedy batch is an argmax only; a greedy row never advances its own generator."""
    g, own = seeded(1), seeded(2)
    before, own_before = g.get_state(), own.get_state()
    logits = torch.randn(2, V)
    Sampler(g)(logits, metadata([SamplingParams(temperature=0.0)] * 2))
    assert torch.equal(g.get_state(), before)
    Sampler(g)(logits, metadata([SamplingParams(temperature=0.0, seed=5), SamplingParams()],
                                generators=[own, None]))
    assert torch.equal(own.get_state(), own_before) and not torch.equal(g.get_state(), before)


@pytest.mark.parametrize("with_top_p_row", [False, True])   # topk path / full-sort path
def test_top_k_never_samples_outside_top_k(with_top_p_row):
    torch.manual_seed(1)
    rows = list(torch.randn(4, V))
    params = [SamplingParams(top_k=k) for k in (1, 3, 5)] + [SamplingParams(top_k=0)]
    if with_top_p_row:
        rows.append(torch.randn(V))
        params.append(SamplingParams(top_p=0.8))
    counts = sample_counts(rows, params, reps=3000)
    for row, p, c in zip(rows, params, counts):
        if p.top_k:
            top = set(row.topk(p.top_k).indices.tolist())
            assert {t for t in range(V) if c[t]} == top   # never outside, and all of it used
        assert_matches(c, reference_probs(row, p))


def test_top_p_never_samples_outside_the_nucleus():
    torch.manual_seed(2)
    rows = list(torch.randn(4, V) * 2)
    params = [SamplingParams(top_p=p, temperature=t) for p, t in
              ((0.1, 1.0), (0.5, 1.0), (0.8, 0.7), (0.95, 1.3))]
    counts = sample_counts(rows, params, reps=3000)
    for row, p, c in zip(rows, params, counts):
        probs = softmax([float(v) / p.temperature for v in row])
        kept = nucleus(probs, p.top_p)
        # the test is only meaningful away from the boundary, where float rounding could decide
        mass_before = sorted(probs, reverse=True)
        assert all(abs(sum(mass_before[:i]) - p.top_p) > 1e-4 for i in range(V + 1))
        assert {t for t in range(V) if c[t]} == kept
        assert_matches(c, reference_probs(row, p))


def test_min_p_never_samples_below_the_threshold():
    torch.manual_seed(3)
    rows = list(torch.randn(3, V) * 2)
    params = [SamplingParams(min_p=m, temperature=t) for m, t in ((0.05, 1.0), (0.3, 1.0),
                                                                   (0.2, 0.5))]
    counts = sample_counts(rows, params, reps=3000)
    for row, p, c in zip(rows, params, counts):
        probs = softmax([float(v) / p.temperature for v in row])
        kept = {t for t in range(V) if probs[t] >= p.min_p * max(probs)}
        assert len(kept) > 1 and {t for t in range(V) if c[t]} == kept
        assert_matches(c, reference_probs(row, p))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_frequencies_match_softmax_of_logits_over_temperature(temperature):
    torch.manual_seed(4)
    row = torch.randn(V)
    p = SamplingParams(temperature=temperature)
    (counts,) = sample_counts([row], [p], reps=20000)
    assert_matches(counts, softmax([float(v) / temperature for v in row]))


def test_penalties_match_per_row_reference():
    torch.manual_seed(5)
    n = 6
    logits = torch.randn(n, V) * 3
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(frequency_penalty=0.7),
              SamplingParams(presence_penalty=-1.5), SamplingParams(),
              SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.4, presence_penalty=2),
              SamplingParams(repetition_penalty=1.7, presence_penalty=0.5)]
    # repeats (counts > 1), tokens in both prompt and output, tokens in only one of them
    prompts = [[1, 2, 2, 3], [1, 4], [], [0, 1, 2], [5, 6, 7, 7], [8, 9]]
    outputs = [[3, 4, 4], [4, 4, 4, 5, 6], [7, 7, 8], [0, 0, 1], [7, 10, 10, 11], [9, 12, 12]]
    got = apply_penalties(logits.clone(), metadata(params, prompts, outputs))
    want = torch.tensor([reference_penalties(logits[i].tolist(), params[i], prompts[i], outputs[i])
                         for i in range(n)])
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, logits)
    assert torch.equal(got[3], logits[3])                     # the row without penalties


def test_everything_at_once_matches_the_reference_distribution():
    """Penalties, min_tokens, temperature, min_p, top_k and top_p together, greedy rows mixed in."""
    torch.manual_seed(6)
    eos = 2
    params = [SamplingParams(temperature=0.8, top_k=6, top_p=0.9, repetition_penalty=1.2,
                             frequency_penalty=0.3, min_tokens=4, stop_token_ids=[5]),
              SamplingParams(temperature=0.0, presence_penalty=1.0),
              SamplingParams(temperature=1.2, min_p=0.05, top_k=8, presence_penalty=0.5),
              SamplingParams(temperature=1.0, top_p=0.7, repetition_penalty=0.9)]
    rows = list(torch.randn(4, V) * 2)
    prompts = [[1, 2, 3, 3], [4, 4, 9], [0, 5, 6], [7, 8, 8, 15]]
    outputs = [[3, 3, 5], [9, 4, 4, 4], [6, 6, 1], [0, 2]]
    counts = sample_counts(rows, params, reps=4000, prompts=prompts, outputs=outputs, eos=eos)
    for i, p in enumerate(params):
        assert_matches(counts[i], reference_probs(rows[i], p, prompts[i], outputs[i], eos))
    assert counts[0][eos] == counts[0][5] == 0


def test_seeded_rows_repeat_regardless_of_batch_and_position():
    torch.manual_seed(7)
    vocab = 1000
    row = torch.randn(vocab) * 0.1                         # nearly flat: many tokens possible
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)

    def run(batch_rows, batch_params, position, steps=6):
        gens = [seeded(q.seed) if q.seed is not None else None for q in batch_params]
        logits = torch.stack(batch_rows)
        md = metadata(batch_params, generators=gens, vocab=vocab)
        return [Sampler()(logits, md).sampled_token_ids[position].item() for _ in range(steps)]

    alone = run([row], [p], 0)
    others = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(top_k=5, seed=9)]
    crowded = run([torch.randn(vocab), torch.randn(vocab), row, torch.randn(vocab)],
                  [others[0], others[1], p, others[2]], position=2)
    assert alone == run([row], [p], 0) == crowded
    assert len(set(alone)) > 1                              # the generator advances each step
    assert alone != run([row], [SamplingParams(temperature=1.0, top_p=0.95, seed=4321)], 0)


def test_unseeded_rows_differ():
    logits = torch.zeros(64, 1000)
    # a seeded row in the batch must not change how the unseeded rows draw their noise
    md = metadata([SamplingParams()] * 63 + [SamplingParams(seed=0)], vocab=1000,
                  generators=[None] * 63 + [seeded(0)])
    first = Sampler()(logits, md).sampled_token_ids
    assert len(set(first[:63].tolist())) > 32
    assert not torch.equal(first, Sampler()(logits, md).sampled_token_ids)


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    eos, stop = 5, 7
    logits = torch.zeros(1, V)
    logits[0, eos], logits[0, stop], logits[0, 3] = 10.0, 9.0, 8.0
    sample = Sampler()

    def greedy(output_len, **kw):
        p = SamplingParams(temperature=0.0, stop_token_ids=[stop], **kw)
        return sample(logits, metadata([p], outputs=[[0] * output_len], eos=eos)).sampled_token_ids

    assert greedy(2, min_tokens=3).item() == 3              # EOS and the stop id are masked
    assert greedy(3, min_tokens=3).item() == eos            # min_tokens reached
    assert greedy(0, ignore_eos=True).item() == eos         # ignore_eos alone masks nothing
    assert greedy(1, min_tokens=3, ignore_eos=True).item() == 3   # vLLM masks EOS regardless
    hot = torch.full((2000, V), 0.0)
    hot[:, eos] = hot[:, stop] = 3.0
    p = SamplingParams(min_tokens=2, stop_token_ids=[stop])
    drawn = sample(hot, metadata([p] * 2000, outputs=[[1]] * 2000, eos=eos)).sampled_token_ids
    assert not ((drawn == eos) | (drawn == stop)).any()


def test_logprobs_are_raw_log_softmax_with_sorted_top_n():
    torch.manual_seed(8)
    logits = torch.randn(5, V) * 2
    params = [SamplingParams(logprobs=3, repetition_penalty=2.0, temperature=0.5),
              SamplingParams(), SamplingParams(logprobs=0, temperature=0.0),
              SamplingParams(logprobs=6, top_k=2, presence_penalty=2.0),
              SamplingParams(logprobs=V, temperature=0.0, frequency_penalty=1.5)]
    outputs = [[0, 1], [], [2], [3, 3], [4, 4, 4]]
    md = metadata(params, outputs=outputs, prompts=[[5, 6]] * 5)
    tokens, logprobs = Sampler()(logits, md).tolists(md)
    raw = logits.double().log_softmax(-1)
    assert logprobs[1] is None
    for i, p in enumerate(params):
        if p.logprobs is None:
            continue
        lp, token = logprobs[i], tokens[i]
        assert lp.logprob == pytest.approx(raw[i, token].item(), abs=1e-5)
        assert lp.rank == 1 + int((raw[i] > raw[i, token]).sum())
        assert len(lp.top) == p.logprobs
        assert [t for t, _ in lp.top] == raw[i].argsort(descending=True)[:p.logprobs].tolist()
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        for t, v in lp.top:
            assert v == pytest.approx(raw[i, t].item(), abs=1e-5)


def test_bad_input_names_the_field():
    p = SamplingParams()
    with pytest.raises(ValueError, match="output_token_ids"):
        SamplingMetadata.from_requests([p], [[]], [], [None], None, V, "cpu")
    with pytest.raises(ValueError, match="eos_token_id"):
        metadata([p], eos=V)
    # Parameter values are Processor's and SamplingParams' to refuse: here, a bug is asserted.
    with pytest.raises(AssertionError, match="stop_token_ids"):
        metadata([SamplingParams(stop_token_ids=[V])])
    with pytest.raises(AssertionError, match="logprobs"):
        metadata([SamplingParams(logprobs=V + 1)])
    with pytest.raises(ValueError, match="generators"):
        metadata([SamplingParams(seed=1)])
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(2, V), metadata([p]))
