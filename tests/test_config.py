"""Config: every validation error names its field; CLI flags come from the fields."""

import argparse
import dataclasses

import pytest

from nanoserve.config import Config
from nanoserve.sampling_params import SamplingParams

BAD_CONFIG = {
    "block_size": 0, "max_num_seqs": -1, "max_num_batched_tokens": 1.5, "max_model_len": 0,
    "num_kv_blocks": 0, "seed": "x", "max_logprobs": -1, "kv_cache_memory_gb": 0.0,
    "gpu_memory_utilization": 1.5, "dtype": "int8", "device": "tpu",
    "scheduling_policy": "lifo", "debug": 3,
}


@pytest.mark.parametrize("field,value", BAD_CONFIG.items())
def test_config_error_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        Config(**{field: value})


def test_no_chunking_needs_budget_for_a_whole_prompt():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Config(enable_chunked_prefill=False, max_model_len=4096, max_num_batched_tokens=2048)


def test_resolve_caps_and_fixes_derived_values():
    resolved = Config().resolve(max_position_embeddings=512, num_kv_blocks=100)
    assert (resolved.max_model_len, resolved.num_kv_blocks) == (512, 100)
    with pytest.raises(ValueError, match="max_model_len"):
        Config(max_model_len=1024).resolve(max_position_embeddings=512, num_kv_blocks=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.block_size = 8


def test_every_field_has_help_and_a_cli_flag():
    parser = argparse.ArgumentParser()
    Config.add_cli_args(parser)
    args = parser.parse_args(["--max-model-len", "128", "--block-size", "8",
                              "--no-enable-prefix-caching", "--kv-cache-memory-gb", "0.5",
                              "--scheduling-policy", "priority"])
    config = Config.from_cli_args(args)
    assert (config.max_model_len, config.block_size, config.enable_prefix_caching,
            config.kv_cache_memory_gb, config.scheduling_policy) == (128, 8, False, 0.5, "priority")
    for f in dataclasses.fields(Config):
        assert f.metadata["help"], f.name
    assert Config.from_cli_args(parser.parse_args([])) == Config()


BAD_PARAMS = {
    "n": 0, "temperature": -0.1, "top_p": 0.0, "top_k": -2, "min_p": 1.5, "seed": 1.5,
    "max_tokens": 0, "min_tokens": -1, "stop": [""], "stop_token_ids": [-1],
    "presence_penalty": 3.0, "frequency_penalty": -2.5, "repetition_penalty": 0.0,
    "logprobs": -1,
}


@pytest.mark.parametrize("field,value", BAD_PARAMS.items())
def test_sampling_params_error_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_normalise():
    p = SamplingParams(stop="###", top_k=-1)
    assert p.stop == ["###"] and p.top_k == 0 and p.stop_token_ids == []
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
