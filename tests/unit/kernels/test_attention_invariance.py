"""Paged attention gives a query the same bits in a decode step and as a row of a verify step.

Speculation is lossless only if the target's logits at a verify row equal, bit for bit, those a plain decode
step would compute at that position: greedy output with and without the draft must match. So a query at
position p over keys [0, p] must reduce them in one order whatever the step: split bounds at fixed positions
(``split_len``), one tile shape for decode-like launches, a tree node's ancestors read as the positions they
stand for, and the splits merged in one order (a few programs per block each running every n'th split, one per
split, or one program for all of them).

Runs the kernel under TRITON_INTERPRET=1 on the CPU (conftest sets it) with tiny shapes; every comparison is
``torch.equal``. tests/gpu/test_attention_invariance_gpu.py checks the same on CUDA at the 8B shapes.
"""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DEVICE

from kernels.attention import AttnConfig, paged_attention
from kernels.attention_ref import paged_attention_ref
from tests.attention_invariance import Pool, causal_vs_decode, metadata, verify_vs_decode

TREE = [-1, 0, 0, 1, 2, 3, 3]  # two branches, depth 3
CHAIN = [-1, 0, 1, 2]


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_tree_rows_equal_decode_steps_across_split_bounds(page_size):
    """Prefixes just under, at and past multiples of the split length: a tree's nodes cross a split bound."""
    verify_vs_decode([30, 32, 61, 5], [TREE, CHAIN, TREE, [-1, 0, 0, 0]], page_size, DEVICE, split_len=32,
                     seed=page_size)


@pytest.mark.parametrize("split_len", [32, 64, None])
def test_chain_rows_equal_decode_steps(split_len):
    """A chain (topk 1) under its mask, at several split lengths (None: the one chosen from the cache)."""
    verify_vs_decode([95, 7], [CHAIN, CHAIN], 4, DEVICE, split_len=split_len, seed=3)


def test_bfloat16_rows_equal_decode_steps():
    verify_vs_decode([40, 63], [TREE, CHAIN], 16, DEVICE, torch.bfloat16, split_len=32, seed=4)


def test_one_program_for_every_split_gives_the_split_launch_bits():
    """The serial launch (many programs already: every split in one) and the split launch + combine kernel."""
    pool = Pool(300, 4, torch.float32, 5, DEVICE)
    lens = [150, 33, 97]
    kv = [pool.take(n + 1) for n in lens]
    q = pool.queries(3)
    meta = metadata(kv, [1, 1, 1], lens, DEVICE)
    serial = AttnConfig(block_q=16, block_m=64, block_n=32, num_splits=1, num_warps=4, num_stages=3, split_len=32)
    a = paged_attention(q, pool.k, pool.v, meta, 0.5, backend="triton", config=serial)
    b = paged_attention(q, pool.k, pool.v, meta, 0.5, backend="triton", num_splits=5, split_len=32)
    assert torch.equal(a, b)
    torch.testing.assert_close(a, paged_attention_ref(q, pool.k, pool.v, meta, 0.5), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("programs", [2, 3])
def test_programs_running_every_nth_split_give_the_serial_bits(programs):
    """A split launch with fewer programs per block than splits (each runs splits p, p + n, ...; the combine merges
    the block's range of splits) gives the serial launch's bits."""
    pool = Pool(600, 4, torch.float32, 5, DEVICE)
    lens = [150, 33, 97, 260]
    kv = [pool.take(n + 1) for n in lens]
    q = pool.queries(4)
    meta = metadata(kv, [1, 1, 1, 1], lens, DEVICE)
    serial = AttnConfig(block_q=16, block_m=64, block_n=32, num_splits=1, num_warps=4, num_stages=3, split_len=32)
    strided = AttnConfig(block_q=16, block_m=64, block_n=32, num_splits=programs, num_warps=4, num_stages=3,
                         split_len=32)
    a = paged_attention(q, pool.k, pool.v, meta, 0.5, backend="triton", config=serial)
    b = paged_attention(q, pool.k, pool.v, meta, 0.5, backend="triton", config=strided)
    assert torch.equal(a, b)
    torch.testing.assert_close(b, paged_attention_ref(q, pool.k, pool.v, meta, 0.5), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("programs,tail", [(2, 2), (3, 2), (4, 1), (3, 20)])
def test_a_tail_launch_gives_the_serial_bits(programs, tail):
    """``tail_split`` (``EYRIE_ATTN_TAIL``): each block uses cdiv(its splits, tail) of its programs, one alone
    running every split and writing its rows itself (the combine leaves them): short and long rows together, the
    serial launch's bits."""
    pool = Pool(900, 4, torch.float32, 5, DEVICE)
    lens = [40, 33, 300, 97, 20]
    kv = [pool.take(n + 1) for n in lens]
    q = pool.queries(len(lens))
    meta = metadata(kv, [1] * len(lens), lens, DEVICE)
    base = dict(block_q=16, block_m=64, block_n=32, num_warps=4, num_stages=3, split_len=32)
    a = paged_attention(q, pool.k, pool.v, meta, 0.5, backend="triton", config=AttnConfig(num_splits=1, **base))
    b = paged_attention(q, pool.k, pool.v, meta, 0.5, backend="triton",
                        config=AttnConfig(num_splits=programs, tail_split=tail, **base))
    assert torch.equal(a, b)
    torch.testing.assert_close(b, paged_attention_ref(q, pool.k, pool.v, meta, 0.5), atol=2e-5, rtol=2e-5)


def test_tree_rows_equal_decode_steps_under_a_tail_launch(monkeypatch):
    """With ``EYRIE_ATTN_TAIL`` set, launches that would run each block serially share a long block's splits:
    a verify step's tree rows are still the same bits as decode steps (short and long prefixes together)."""
    from kernels import attention

    monkeypatch.setattr(attention, "TAIL_PROGRAMS", 3)
    monkeypatch.setattr(attention, "TAIL_SPLITS", 2)
    monkeypatch.setattr(attention, "SPLIT_PROGRAMS", 0)  # every launch would be serial: the tail rule takes it
    verify_vs_decode([150, 9, 70], [TREE, CHAIN, TREE], 4, DEVICE, split_len=32)


def test_the_combine_unrolled_or_looped_gives_the_same_bits(monkeypatch):
    """Past ``UNROLLED_SPLITS`` splits the combine kernel loops instead of unrolling (256 unrolled splits, a
    131k-token engine's, took minutes to compile on the H100): the same bits as the unrolled merge."""
    from kernels import attention

    pool = Pool(300, 4, torch.float32, 5, DEVICE)
    lens = [150, 33, 97]
    kv = [pool.take(n + 1) for n in lens]
    q = pool.queries(3)
    meta = metadata(kv, [1, 1, 1], lens, DEVICE)
    unrolled = paged_attention(q, pool.k, pool.v, meta, 0.5, backend="triton", num_splits=5, split_len=32)
    monkeypatch.setattr(attention, "UNROLLED_SPLITS", 2)
    looped = paged_attention(q, pool.k, pool.v, meta, 0.5, backend="triton", num_splits=5, split_len=32)
    assert torch.equal(unrolled, looped)
    torch.testing.assert_close(looped, paged_attention_ref(q, pool.k, pool.v, meta, 0.5), atol=2e-5, rtol=2e-5)


def test_windowed_tree_rows_equal_decode_steps():
    """Sliding window: the block's first key differs between the steps, the rows' bits do not."""
    verify_vs_decode([70, 45], [TREE, CHAIN], 4, DEVICE, window=24, split_len=32, seed=6)


def test_causal_rows_equal_decode_steps():
    """A causal multi-row step (draft extend, a short chunk) in the decode tile shape: each row as a decode."""
    causal_vs_decode([33, 64, 9], [5, 3, 8], 4, DEVICE, seed=7, split_len=32)


def test_split_length_follows_the_cache_not_the_step(monkeypatch):
    """One length per cache: from its longest context, KV heads and the SM count (an H100's 132 here), a power
    of two; short contexts still split (8B shape at 8k: 256 keys, as batch 1 split before), long ones get more
    splits up to MAX_SPLITS, then longer splits."""
    from kernels import attention

    monkeypatch.setattr(attention, "_sms", lambda device: 132)
    cuda = torch.device("cuda")
    assert attention.choose_split_len(8192, 8, cuda) == 256
    assert attention.choose_split_len(1152, 8, cuda) == 64
    assert attention.choose_split_len(131072, 8, cuda) == attention.MAX_SPLIT_KEYS
    assert attention.choose_split_len(1 << 20, 8, cuda) == (1 << 20) // attention.MAX_SPLITS
    assert attention.choose_split_len(8192, 2, cuda) == 64  # a TP rank's share of the KV heads


def test_an_engine_with_a_draft_splits_as_the_same_engine_without(monkeypatch):
    """The target cache of an engine with a draft has more headroom (verify nodes past the context) than the same
    engine's without; the split length comes from the context alone, so both split alike (2110 + 8 headroom would
    cross a power of two that 2110 + 1 does not)."""
    import dataclasses
    from types import SimpleNamespace

    from kernels import attention
    from shared.config import EngineConfig, SpecConfig
    from shared.forward_batch import attention_split_len
    from shared.memory.sizing import make_cache

    monkeypatch.setattr(attention, "_sms", lambda device: 132)
    model = SimpleNamespace(num_key_value_heads=8, head_dim=16)
    plain = EngineConfig(device="cpu", dtype="float32", num_pages=8, max_running=1)
    spec = plain.model_copy(update={"spec": SpecConfig(topk=2, steps=3, num_draft_tokens=7)})
    lens = []
    for cfg in (plain, spec):
        layout = make_cache(model, 1, cfg, 2110).layout
        assert layout.context == 2110 and layout.max_context == 2110 + cfg.headroom
        on_gpu = SimpleNamespace(layout=dataclasses.replace(layout, device=torch.device("cuda")))
        lens.append(attention_split_len(on_gpu))
    assert lens[0] == lens[1] == attention.choose_split_len(2110, 8, torch.device("cuda"))
    assert attention.choose_split_len(2110 + spec.headroom, 8, torch.device("cuda")) != lens[0]
