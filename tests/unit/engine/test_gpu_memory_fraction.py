"""GPU memory fraction (``gpu_memory_fraction``, vLLM's ``gpu_memory_utilization``): the pool sizing arithmetic
on injected device figures (it runs on the CPU), the page size it divides by against a real pool, and the
setting's path from the environment to the engine. tests/gpu/test_gpu_memory_fraction_gpu.py starts two
engines of 0.4 each on one GPU."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.settings import load_settings
from shared.config import EngineConfig
from shared.engine import Engine
from shared.memory.sizing import DeviceMemory, GiB, activation_reserve, make_cache, page_bytes, pages_within_budget
from shared.model.config import ModelConfig
from shared.request import RequestError

MB = 1 << 20


def test_pages_fill_the_fraction_after_weights_reserve_and_the_sink_page():
    memory = DeviceMemory(total=80 * GiB, free=60 * GiB, weights=16 * GiB)
    pages = pages_within_budget(0.45, memory, reserve=2 * GiB, bytes_per_page=2 * MB, request_pages=10,
                                most_pages=10**9)
    room = int(0.45 * 80 * GiB) - 16 * GiB - 2 * GiB
    assert pages == room // (2 * MB) - 1
    assert (pages + 1) * 2 * MB + 16 * GiB + 2 * GiB <= 0.45 * 80 * GiB  # the whole engine within its share


def test_pages_are_bounded_by_free_memory_and_by_what_max_running_requests_need():
    tight = DeviceMemory(total=80 * GiB, free=10 * GiB, weights=16 * GiB)  # another engine holds the rest
    assert pages_within_budget(0.9, tight, 1 * GiB, 2 * MB, 10, 10**9) == 9 * GiB // (2 * MB) - 1
    roomy = DeviceMemory(total=80 * GiB, free=70 * GiB, weights=1 * GiB)
    assert pages_within_budget(0.9, roomy, 1 * GiB, 2 * MB, 10, most_pages=5000) == 5000


def test_a_fraction_too_small_for_one_request_names_every_figure():
    memory = DeviceMemory(total=80 * GiB, free=70 * GiB, weights=16 * GiB)
    with pytest.raises(RequestError) as e:
        pages_within_budget(0.2, memory, reserve=3 * GiB, bytes_per_page=2 * MB, request_pages=8200,
                            most_pages=10**9)
    msg = str(e.value)
    assert e.value.field == "gpu_memory_fraction"
    for figure in ("0.2 x 80.00 GiB total", "16.00 GiB", "3.00 GiB", "8200 pages", "16.02 GiB", "-3.00 GiB"):
        assert figure in msg, (figure, msg)


def test_page_bytes_is_what_a_pool_spends_per_page():
    cfg = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                                    "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
                                    "num_key_value_heads": 2, "max_position_embeddings": 256})
    engine = EngineConfig(page_size=8, num_pages=20, dtype="bfloat16", max_running=2)
    cache = make_cache(cfg, 3, engine, 128)
    pool_bytes = cache.pool.numel() * cache.pool.element_size()
    assert pool_bytes == (engine.num_pages + 1) * page_bytes(cfg, 3, engine)
    assert activation_reserve(cfg, engine, 128) > 0


def test_the_fraction_is_refused_outside_0_to_1_and_reaches_the_engine_config(monkeypatch):
    for bad in (0, -0.1, 1.5):
        with pytest.raises(ValidationError, match="gpu_memory_fraction"):
            EngineConfig(gpu_memory_fraction=bad)
    monkeypatch.setenv("EYRIE_GPU_MEMORY_FRACTION", "0.4")
    assert load_settings("decode").engine_config().gpu_memory_fraction == 0.4
    assert load_settings("prefill", gpu_memory_fraction=0.3).engine_config().gpu_memory_fraction == 0.3


def test_off_the_gpu_the_fraction_leaves_the_pools_as_they_were(tiny_model_dir):
    plain = Engine(tiny_model_dir / "target", config=EngineConfig(max_running=2, max_context=256))
    fraction = Engine(tiny_model_dir / "target", config=EngineConfig(max_running=2, max_context=256,
                                                                     gpu_memory_fraction=0.01))
    assert fraction.cache.layout.num_pages == plain.cache.layout.num_pages == 2 * -(-(256 + 1) // 16)
