"""Fixtures for tests/vllm: ONE vLLM import per run and real vLLM config objects.

vLLM is imported here, at module level, so every test module in this folder shares the
one import (it takes several seconds). Everything runs offline: the model is a folder
holding only a tiny ``config.json`` (a 2-layer llama), read with ``skip_tokenizer_init``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

# Before the vLLM import: never reach for the Hugging Face hub, never start usage stats.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import pytest
import vllm.config as vllm_config_mod
from vllm_metaserver_harness import MetaServer

TINY_LLAMA: Mapping[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder holding only a 2-layer llama ``config.json``."""
    path = tmp_path_factory.mktemp("tiny-llama")
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return path


@pytest.fixture(scope="session")
def model_config(tiny_model_dir: Path) -> Iterator[vllm_config_mod.ModelConfig]:
    """A real ModelConfig for the tiny model (offline, no tokenizer)."""
    yield vllm_config_mod.ModelConfig(
        model=str(tiny_model_dir),
        skip_tokenizer_init=True,
        max_model_len=1024,
        dtype="float32",
    )


VllmConfigFactory = Callable[..., vllm_config_mod.VllmConfig]


@pytest.fixture
def make_vllm_config(model_config: vllm_config_mod.ModelConfig) -> VllmConfigFactory:
    """Build a real VllmConfig around the tiny model.

    ``kv_transfer`` is the ``--kv-transfer-config`` JSON object. It is attached after
    construction when ``attach_after`` is set: VllmConfig's own checks resolve the
    connector class, which only tests that register one can satisfy.
    """

    def make(
        kv_transfer: Mapping[str, Any] | None = None,
        *,
        tp: int = 1,
        dp: int = 1,
        dp_rank: int = 0,
        additional_config: Mapping[str, Any] | None = None,
        block_size: int = 16,
        attach_after: bool = True,
        max_num_batched_tokens: int = 1024,
    ) -> vllm_config_mod.VllmConfig:
        ktc = vllm_config_mod.KVTransferConfig(**kv_transfer) if kv_transfer else None
        config = vllm_config_mod.VllmConfig(
            model_config=model_config,
            device_config=vllm_config_mod.DeviceConfig(device="cpu"),
            cache_config=vllm_config_mod.CacheConfig(block_size=block_size),
            scheduler_config=vllm_config_mod.SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=16,
                max_model_len=1024,
                is_encoder_decoder=False,
            ),
            parallel_config=vllm_config_mod.ParallelConfig(
                tensor_parallel_size=tp, data_parallel_size=dp, data_parallel_rank=dp_rank
            ),
            kv_transfer_config=None if attach_after else ktc,
            additional_config=dict(additional_config or {}),
        )
        if attach_after:
            config.kv_transfer_config = ktc
        return config

    return make


@pytest.fixture
def server() -> Iterator[MetaServer]:
    """A real aiohttp metaserver on 127.0.0.1, closed after the test."""
    srv = MetaServer()
    yield srv
    srv.close()
