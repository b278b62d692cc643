"""Exercise 8.3: the n-gram proposer (lesson 08-one-step-many-tokens.md).

Goal: `propose(token_ids, k, min_n, max_n)` returns the draft tokens for a sequence: find the
longest n (min_n <= n <= max_n) for which the last n tokens occurred earlier in the sequence;
among the earlier occurrences of that n-gram take the most recent one (nanoserve's tie-break;
vLLM's proposer takes the earliest, an equally valid choice, but the check wants nanoserve's);
return the (up to) k tokens that followed it. No earlier occurrence of even the last min_n
tokens: return [].

Example, k 3, min_n 1, max_n 3: [8, 9, 1, 2, 3, 9, 4, 8, 9] ends with [8, 9], which occurred at
the start, followed by [1, 2, 3] (the more recent [9] at position 5 is a shorter match).

Interface: `token_ids` is a list of ints (prompt + output so far); return a list of ints. The
check compares your drafts with nanoserve's (nanoserve/spec_decode.py:NgramProposer) on
a thousand random sequences of up to 160 tokens over small vocabularies, where matches of every
length occur, with n-grams up to 10 tokens.
Check: `nanoserve exercise check 8.3`.
"""


def propose(token_ids, k, min_n, max_n):
    raise NotImplementedError(
        "implement propose in lessons/exercises/lesson8_ngram_proposer.py: the k tokens that "
        "followed the longest, then most recent, earlier match of the sequence's last tokens")
