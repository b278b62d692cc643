"""Wrong answer to exercise 7.4: hands the draw to nanoserve's own sampler through super()."""

from nanoserve.sampler import Sampler


class ExponentialRaceSampler(Sampler):
    def _sample(self, logits, generators):
        return super()._sample(logits, generators)
