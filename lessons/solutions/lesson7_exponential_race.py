"""Exercise 7.4 (reference solution): sampling by an exponential race.

With q_i ~ Exp(1) independent, argmax_i p_i / q_i is token i with probability p_i: q_i / p_i is
exponential with rate p_i, and the smallest of independent exponentials is i with probability
p_i / sum(p). So one argmax over noise replaces a sampling call, and a row with its own
generator draws its noise from it alone: its token cannot depend on the other rows. Exp(1) noise
is -log(1 - U) for U uniform in [0, 1); a zero would make 0 / 0 for a masked token, so clamp it.
"""

import torch

from nanoserve.sampler import Sampler


class ExponentialRaceSampler(Sampler):
    def _sample(self, logits, generators):
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs).uniform_(generator=self.generator)
        for row, generator in generators.items():
            noise[row].uniform_(generator=generator)
        noise = (-torch.log1p(-noise)).clamp(min=torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1)
