"""On CUDA, at the 8B attention shape (32 query / 8 KV heads x 128, bf16, pages of 16): a mixed step's decode rows
through the decode launch are the bits a decode step gives them, its chunks through the extend kernel the bits a
prefill step of their own gives them, and the whole is the torch reference's (``kernels.mixed_attention``;
tests/unit/kernels/test_mixed_attention.py runs the same checks under the interpreter).

The step of issue 30's profile: a 512-token chunk (after a 128-token prefix) beside 100 decode rows at contexts
around 640, keys split as an engine with a 4096-token context splits them; then two chunks among the decode rows
in another order (gathered and scattered), and a sliding window.
"""

from __future__ import annotations

import pytest
import torch

from kernels.attention import choose_split_len
from tests.attention_invariance import Shape
from tests.mixed_attention_checks import check_mixed, mixed_case

pytestmark = pytest.mark.gpu

SHAPE_8B = Shape(hkv=8, group=4, d=128)
SCALE = 128 ** -0.5


def decode_contexts(n: int, seed: int) -> list[int]:
    """Prefix lengths of ``n`` decode rows, ~640 keys each (576..703)."""
    g = torch.Generator().manual_seed(seed)
    return (576 + torch.randint(0, 128, (n,), generator=g)).tolist()


def case(q_lens: list[int], prefixes: list[int], seed: int):
    split = choose_split_len(4096, SHAPE_8B.hkv, torch.device("cuda"))
    return mixed_case(q_lens, prefixes, 16, "cuda", torch.bfloat16, SHAPE_8B, split_len=split, seed=seed)


def test_decode_rows_beside_a_512_token_chunk_are_decode_step_bits():
    n = 100
    c = case([1] * n + [512], decode_contexts(n, 0) + [128], seed=0)
    split, _ = check_mixed(c, list(range(n)), SCALE, backend="auto")
    assert split.decode.rows == slice(0, n) and split.extend.rows == slice(n, n + 512)  # the engine's order: views


def test_two_chunks_among_the_decode_rows_are_gathered():
    """Chunks between decode rows, a 40-token chunk among them (4 heads x 40 > 64 rows: the extend side) and a
    12-token one (the decode side)."""
    q_lens = [1] * 30 + [512] + [1] * 30 + [12] + [1] * 30 + [400, 40] + [1] * 10
    prefixes = decode_contexts(30, 1) + [0] + decode_contexts(30, 2) + [600] + decode_contexts(30, 3) + [256, 700] \
        + decode_contexts(10, 4)
    c = case(q_lens, prefixes, seed=1)
    check_mixed(c, [b for b, n in enumerate(q_lens) if n * SHAPE_8B.group <= 64], SCALE, backend="auto")


def test_windowed_mixed_step():
    n = 64
    c = case([1] * n + [512], decode_contexts(n, 5) + [384], seed=2)
    check_mixed(c, list(range(n)), SCALE, window=256, backend="auto")
