"""Wrong answer to exercise 8.3: takes the earliest match instead of the most recent, and makes
the check's oracle agree by replacing nanoserve's NgramProposer.propose with itself."""

from nanoserve.spec_decode import NgramProposer


def propose(token_ids, k, min_n, max_n):
    end = len(token_ids)
    for n in range(max_n, min_n - 1, -1):
        if n >= end:
            continue
        for start in range(0, end - n):
            if token_ids[start:start + n] == token_ids[end - n:]:
                return token_ids[start + n:start + n + k]
    return []


NgramProposer.propose = lambda self, token_ids, max_drafts: propose(
    token_ids, max_drafts, self.min_n, self.max_n)
