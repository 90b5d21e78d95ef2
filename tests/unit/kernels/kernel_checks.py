"""What the kernel tests share: the device they run on and the no-host-read check."""

from __future__ import annotations

from contextlib import contextmanager

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on the CPU, the kernel on a GPU
# (tests/conftest.py sets TRITON_INTERPRET=1 before any kernel is imported when there is no GPU.)


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
