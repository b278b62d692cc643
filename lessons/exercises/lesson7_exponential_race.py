"""Exercise 7.4: the sampler's exponential race (lesson 07-sampling-and-config.md).

After temperature, min_p, top-k and top-p, each sampled row of the batch holds the logits to
draw its next token from. Goal: draw one token per row, token i with probability softmax(row)_i,
in one batched computation without torch.multinomial, such that a row with a generator of its
own (a request with a `seed`) gets a token that depends on its logits and its generator only:
not on the other rows, nor on where it sits in the batch. Lesson 7 names the trick; the
argument for why it is exact is part of the exercise.

Interface (nanoserve/sampler.py, Sampler):
    _sample(self, logits, generators) -> token ids, int64 [num_rows]
        logits      [num_rows, vocab] float32; masked tokens are -inf
        generators  dict, row -> torch.Generator (the seeded rows); every other row draws
                    from self.generator
Use torch.Generator-aware random functions (`tensor.uniform_(generator=...)`); for the argmax,
`.argmax(dim=-1)`.

The check draws thousands of tokens, in one call and over many calls (the engine calls you once a
step: every call draws fresh noise), and compares the frequencies with the softmax; moves two
seeded rows around a batch for many calls (a request's generator goes on from step to step);
then runs the real engine with your sampler: a seeded request must give the same tokens alone
and in a mixed batch, greedy rows HF's tokens.
Check: `nanoserve exercise check 7.4`.
"""

import torch  # noqa: F401

from nanoserve.sampler import Sampler


class ExponentialRaceSampler(Sampler):
    def _sample(self, logits, generators):
        raise NotImplementedError(
            "implement ExponentialRaceSampler._sample in lessons/exercises/"
            "lesson7_exponential_race.py: one token per row, drawn from its softmax")
