"""What the GPU kernel tests share: a freshly seeded generator (its seed printed, to replay a failure)
and an allocator whose free blocks hold NaN (an output the kernel left unwritten shows up)."""

from __future__ import annotations

import time

import torch


def seeded_generator() -> torch.Generator:
    seed = time.time_ns() % (2**31)
    print(f"seed {seed}")  # shown by pytest on failure, to replay the case
    return torch.Generator(device="cuda").manual_seed(seed)


def poison_allocator(nbytes: int = 1 << 30) -> None:
    """Fill free blocks of the caching allocator with NaN so an unwritten buffer shows up."""
    junk = torch.full((nbytes // 4,), float("nan"), device="cuda")
    del junk
