"""Engine-test fixtures: each prompt's greedy output computed alone, the reference of batching tests."""

from __future__ import annotations

import pytest
import torch
from engine_checks import GREEDY, PROMPTS, check_pools_full

from shared.config import EngineConfig
from shared.engine import Engine


@pytest.fixture(scope="session")
def solo_reference(tiny_model_dir):
    """Each of ``PROMPTS`` alone, whole-prompt prefill, page size 1: 8 greedy tokens, EOS ignored."""
    engine = Engine(tiny_model_dir / "target", config=EngineConfig(chunk_size=None, page_size=1))
    out = [engine.generate([p], GREEDY)[0] for p in PROMPTS]
    check_pools_full(engine)
    return out


@pytest.fixture(autouse=True)
def pools_back_after_each_test(engine_pools_checked):
    """Every engine a test here builds ends with all its pages and request slots free (tests/conftest.py)."""
    yield


@pytest.fixture
def one_thread():
    """A tiny model: one intra-op thread is as fast as two and steadier on a busy machine (two xdist workers share
    two cores); the test files that want it for every test name it in ``pytestmark``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
