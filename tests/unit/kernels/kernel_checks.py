"""What the kernel tests share: the device they run on, the interpreter guard, the no-host-read check."""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on the CPU, the kernel on a GPU

# tests/conftest.py sets TRITON_INTERPRET=1 before any kernel is imported; only a run that sets it to
# something else on a machine without a GPU skips the Triton paths.
needs_interpreter = pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="Triton on the CPU needs TRITON_INTERPRET=1 set before import")


@contextmanager
def no_host_reads(monkeypatch):
    """Inside: any .item() / .tolist() / nonzero / .cpu() fails (a path that must be CUDA-graph capturable)."""

    def refuse(*args, **kwargs):
        raise AssertionError("host read on the kernel path")

    for name in ("item", "tolist", "nonzero", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    try:
        yield
    finally:
        monkeypatch.undo()
