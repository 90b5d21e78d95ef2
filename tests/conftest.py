"""Shared fixtures: tiny checkpoints made once per session, CPU/GPU selection, no-leak checks."""

from __future__ import annotations

import os

import pytest
import torch

# Triton kernels run under the interpreter when there is no GPU; set before any kernel is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (GPU-only path; run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random tiny Llama target with EAGLE, EAGLE-3 and multi-layer drafts: OUT/{target,eagle,eagle3,mtp}."""
    from shared.model.factory import make_model

    return make_model("tiny", tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="session")
def oracle_model_dir(tmp_path_factory):
    """A tiny target whose drafts agree with it often (acceptance well above zero)."""
    from shared.model.factory import make_oracle_model

    return make_oracle_model(tmp_path_factory.mktemp("oracle"), seed=0)
