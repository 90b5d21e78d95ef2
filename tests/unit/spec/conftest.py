"""Session fixtures of the speculative-decoding tests (helpers live in spec_helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from spec_helpers import Models, load_models


@pytest.fixture(scope="session")
def random_models(tiny_model_dir) -> Models:
    """Random drafts: the target accepts almost none of their tokens."""
    return load_models(Path(tiny_model_dir))


@pytest.fixture(scope="session")
def oracle_models(oracle_model_dir) -> Models:
    """Oracle drafts: accepted often (accept length 2-3.5), so long accepted runs are exercised."""
    return load_models(Path(oracle_model_dir))
