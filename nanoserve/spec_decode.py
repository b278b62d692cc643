"""spec_decode.py: speculative decoding with the n-gram (prompt lookup) proposer.

A decode step reads every weight to make one token per request. Speculation guesses k more
tokens, feeds all k + 1 in one step, and keeps the guesses the model agrees with:

    tokens  ... the cat sat on the mat . the cat       the last 2 tokens were seen before,
    propose             sat on the                     followed by "sat on the": the drafts
    verify  the model's token at each of the 4 positions: [sat, on, a, mat]
    keep    sat on (equal), then a (the model's token where they differ): 3 tokens, 1 step

Three pieces, all torch-free (the scheduler calls the proposer; the runner, the other two):

- `NgramProposer.propose`: the longest recent match of the sequence's last n tokens
  (prompt_lookup_min <= n <= prompt_lookup_max) earlier in the prompt + output; the tokens that
  followed it are the drafts. No match: no drafts, and the step is an ordinary decode.
- `verification_rows`: the sampler's rows, one per verified position. Row j of a request with
  drafts d is sampled as if d[:j] were already its output (penalties and min_tokens see them).
- `accepted_tokens`: the rule. Each row is sampled from the target's own distribution p_j (the
  sampler as ever: temperature, min_p, top_k, top_p; greedy is its argmax); a draft is kept
  while it equals the token sampled at its position, and the first differing sampled token (or,
  all kept, the bonus token of the last row) ends the run. For a point-mass proposal that IS
  rejection sampling: the sample equals draft x with probability p(x) (accept), and given it
  does not, it is distributed as p with x removed, renormalized (the resample). So the output's
  distribution is exactly the target's, and greedy output equals greedy without speculation.

Tests: pytest -q tests/test_spec_decode.py. Lesson: lessons/08-one-step-many-tokens.md
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanoserve.config import SpeculativeConfig
    from nanoserve.request import Request


class NgramProposer:
    """Prompt lookup decoding (vLLM's "ngram" method):

        >>> p = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
        >>> p.propose([5, 6, 7, 8, 9, 5, 6], max_drafts=3)   # [5, 6] was followed by 7 8 9
        [7, 8, 9]
        >>> p.propose([1, 2, 3], max_drafts=3)                # 3 never occurred before
        []
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k, self.min_n, self.max_n = num_speculative_tokens, prompt_lookup_min, prompt_lookup_max

    @classmethod
    def of(cls, spec: "SpeculativeConfig") -> "NgramProposer":
        return cls(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """Up to min(k, max_drafts) tokens that followed the longest earlier match of the last
        n tokens (the most recent one among equally long matches), or [] below min_n."""
        last, end = token_ids[-1], len(token_ids) - 1
        best_len = best_pos = 0
        # Scan back for earlier copies of the last token, and measure each match backwards.
        for j in range(end - 1, -1, -1):
            if token_ids[j] != last:
                continue
            n = 1
            while n < self.max_n and n <= j and token_ids[j - n] == token_ids[end - n]:
                n += 1
            if n > best_len:
                best_len, best_pos = n, j
                if n == self.max_n:
                    break
        if best_len < self.min_n:
            return []
        return token_ids[best_pos + 1:best_pos + 1 + min(self.k, max_drafts)]


def verification_rows(requests: list["Request"], drafts: dict[str, list[int]]
                      ) -> list[tuple["Request", list[int]]]:
    """(request, its output as row j sees it): one row per sampling request, k + 1 for one
    with k drafts: [(A, out), (B, out), (B, out + [d0]), (B, out + [d0, d1])] for B's 2 drafts."""
    rows = []
    for request in requests:
        output = request.output_token_ids
        rows.append((request, output))
        for j, _ in enumerate(drafts.get(request.request_id, ())):
            rows.append((request, output + drafts[request.request_id][:j + 1]))
    return rows


def accepted_tokens(draft_token_ids: list[int], target_token_ids: list[int]) -> list[int]:
    """The tokens a request gains: its drafts while each equals the target's token at its
    position, then the target's token where they first differ (or the bonus token).

        >>> accepted_tokens([7, 8, 9], [7, 8, 4, 2])    # 2 drafts kept, then the target's 4
        [7, 8, 4]
    """
    n = 0
    while n < len(draft_token_ids) and draft_token_ids[n] == target_token_ids[n]:
        n += 1
    return target_token_ids[:n + 1]


def sampled_per_request(requests: list["Request"], drafts: dict[str, list[int]],
                        row_tokens: list[int]) -> dict[str, list[int]]:
    """{request id: the tokens it gains}: `accepted_tokens` over the k + 1 rows of
    `verification_rows` of a request with k drafts (one row, one token, for one without)."""
    sampled, row = {}, 0
    for request in requests:
        mine = drafts.get(request.request_id, [])
        sampled[request.request_id] = accepted_tokens(mine, row_tokens[row:row + len(mine) + 1])
        row += len(mine) + 1
    return sampled
