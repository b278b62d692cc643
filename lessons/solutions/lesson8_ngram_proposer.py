"""Exercise 8.3 (reference solution): the n-gram proposer.

Try the longest n-gram first: for n from max_n down to min_n, scan the earlier positions from
the most recent backwards; the first window equal to the last n tokens wins, and the tokens
after it are the drafts. (nanoserve's NgramProposer does the same in one backward scan, by
measuring each earlier copy of the last token's match length.)
"""


def propose(token_ids, k, min_n, max_n):
    end = len(token_ids)
    for n in range(max_n, min_n - 1, -1):
        suffix = token_ids[end - n:]
        if n >= end:
            continue
        for start in range(end - n - 1, -1, -1):
            if token_ids[start:start + n] == suffix:
                return token_ids[start + n:start + n + k]
    return []
