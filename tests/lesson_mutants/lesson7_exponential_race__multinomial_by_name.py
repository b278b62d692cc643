"""Wrong answer to exercise 7.4: draws with torch.multinomial, found by a name built at run time
(a scan of the file's names does not see it); the exercise is the race, without it."""

import torch

from nanoserve.sampler import Sampler


class ExponentialRaceSampler(Sampler):
    def _sample(self, logits, generators):
        probs = logits.softmax(dim=-1)
        draw = getattr(torch, "multi" + "nomial")
        tokens = draw(probs, 1, generator=self.generator)[:, 0]
        for row, generator in generators.items():
            tokens[row] = draw(probs[row], 1, generator=generator)[0]
        return tokens
