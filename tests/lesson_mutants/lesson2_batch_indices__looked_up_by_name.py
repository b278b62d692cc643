"""Wrong answer to exercise 2.4: hands the indices to the model runner's own function, found by a
name built at run time."""

import importlib


def batch_indices(num_scheduled, num_computed, block_tables, block_size):
    runner = importlib.import_module("nanoserve." + "model_runner")
    return getattr(runner, "batch" + "_indices")(num_scheduled, num_computed, block_tables,
                                                 block_size)
