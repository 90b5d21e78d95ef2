"""Fixtures of the training tests: a small corpus of the standard library's sources, one thread."""

from __future__ import annotations

import contextlib
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

# Three small modules of the standard library (about 8 kB): enough windows for a few hundred steps,
# few enough that regenerating them with the tiny target takes seconds.
CORPUS_FILES = ("bisect.py", "colorsys.py", "keyword.py")


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in CORPUS_FILES:
        shutil.copy(stdlib / name, out / name)
    return out


@contextlib.contextmanager
def one_thread_only():
    """Tiny models on a shared 2-core machine: one intra-op thread is much steadier (two spinning
    threads stall each other). Restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def one_thread():
    with one_thread_only():
        yield


@pytest.fixture(scope="module")
def one_thread_module():
    """The same for module-scoped fixtures (set up before the autouse one)."""
    with one_thread_only():
        yield
