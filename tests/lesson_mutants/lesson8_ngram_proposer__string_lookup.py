"""Wrong answer to exercise 8.3: hands the search to nanoserve's NgramProposer, found by names
built at run time (a scan of the file's names does not see it)."""

import importlib


def propose(token_ids, k, min_n, max_n):
    module = importlib.import_module("nanoserve." + "spec_decode")
    proposer = getattr(module, "Ngram" + "Proposer")(k, min_n, max_n)
    return proposer.propose(token_ids, k)
