"""Session fixtures of the speculative-decoding tests (helpers live in spec_helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from spec_helpers import Models, add_feature_path, load_models


@pytest.fixture(scope="session")
def random_models(tiny_model_dir) -> Models:
    """Random drafts: the target accepts almost none of their tokens."""
    return load_models(Path(tiny_model_dir))


@pytest.fixture(scope="session")
def oracle_models(oracle_model_dir) -> Models:
    """Oracle drafts: accepted often, so long accepted runs are exercised; with a feature path added
    (``add_feature_path``) so that their K/V and hidden states depend on the target features too."""
    return add_feature_path(load_models(Path(oracle_model_dir)))


@pytest.fixture(scope="session")
def oracle_models_cuda(oracle_model_dir) -> Models:
    """The same oracle drafts (same feature path) on the GPU, for the ``gpu`` tests."""
    return add_feature_path(load_models(Path(oracle_model_dir), device="cuda"))


@pytest.fixture(autouse=True)
def one_thread():
    """These models are tiny: one intra-op thread is as fast as two and, on a busy 2-core machine,
    much steadier (two spinning threads stall each other). Restored after each test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def pools_back_after_each_test(engine_pools_checked):
    """Every engine a test here builds ends with all its pages and request slots free (tests/conftest.py)."""
    yield
