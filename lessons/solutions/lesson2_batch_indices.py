"""Exercise 2.4 (reference solution): the flat batch's positions, slot_mapping, query_start_loc.

One step's tokens are one flat batch: request r's new tokens are rows
query_start_loc[r]:query_start_loc[r + 1] (a running sum of num_scheduled, from 0). They continue
the request where its cache ends, so the first is at position num_computed[r]. Each token's
slot is its block table's physical block for position // block_size, times block_size, plus
position % block_size.
"""

import torch


def batch_indices(num_scheduled, num_computed, block_tables, block_size):
    query_start_loc = torch.zeros(len(num_scheduled) + 1, dtype=torch.int64)
    query_start_loc[1:] = torch.cumsum(num_scheduled, 0)
    req_of_token = torch.repeat_interleave(torch.arange(len(num_scheduled)), num_scheduled)
    offset_in_request = torch.arange(int(query_start_loc[-1])) - query_start_loc[:-1][req_of_token]
    positions = num_computed[req_of_token] + offset_in_request
    physical = block_tables[req_of_token, positions // block_size].long()
    slot_mapping = physical * block_size + positions % block_size
    return positions.long(), slot_mapping, query_start_loc
