"""On CUDA: a query's attention output is the same bits in a decode step and as a row of a verify step, and so
are an FP8 target's logits (its products are row-invariant: tests/gpu/test_fp8_gpu.py), with no
``EYRIE_ATTN_SPLITS`` or other setting: what makes greedy output with and without a draft head equal.

* the paged kernel at the 8B shape (32 query heads, 8 KV heads, head_dim 128), bf16 and float32: trees of the
  greedy tests' shape (topk 2, 6 nodes), a 16-node binary tree, chains, prefixes around and far past the
  engine's split length (one program per split and one for all of them both run: the batch of decode rows
  launches many programs, the verify step few), page sizes 1 and 16, a sliding window, a causal step;
* an FP8 checkpoint (per-channel and 128 x 128 blocks) of the trained oracle target, bf16 activations: the
  logits of k decode steps and of one verify step over the same k tokens (a chain under its mask, as the
  engine verifies) after a 300-token prefill.

The bf16 oracle's logits are not compared whole: its bf16 GEMMs (cuBLAS) sum a row in another order at one
row than at several, which the kernels here do not control.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from kernels.attention import choose_split_len
from shared.config import EngineConfig
from shared.engine import Engine
from shared.forward_batch import build_forward_batch
from shared.model.factory import quantize_checkpoint
from tests.attention_invariance import Shape, causal_vs_decode, verify_vs_decode

pytestmark = pytest.mark.gpu

SHAPE_8B = Shape(hkv=8, group=4, d=128)
TREE6 = [-1, 0, 0, 1, 2, 3]  # topk 2, steps 3, 6 nodes: the greedy tests' tree shape
TREE16 = [-1] + [(i - 1) // 2 for i in range(1, 16)]
CHAIN = [-1, 0, 1, 2, 3]


def engine_split(max_context: int) -> int:
    return choose_split_len(max_context, SHAPE_8B.hkv, torch.device("cuda"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page_size", [1, 16])
def test_verify_rows_are_decode_steps_at_the_8b_shape(dtype, page_size):
    split = engine_split(8192)
    prefixes = [8000, split - 3, 2 * split, 200, 4095, 17]
    trees = [TREE6, CHAIN, TREE16, TREE6, [-1, 0, 0, 0], TREE16]
    verify_vs_decode(prefixes, trees, page_size, "cuda", dtype, shape=SHAPE_8B, split_len=split, seed=page_size)


@pytest.mark.parametrize("split_len", [64, 256, None])
def test_verify_rows_are_decode_steps_at_any_split_length(split_len):
    """Short splits (many of them: the split launch at every batch), long ones, and the cache's default."""
    verify_vs_decode([1000, 63, 64, 65], [TREE6, TREE16, CHAIN, TREE6], 16, "cuda", torch.bfloat16, shape=SHAPE_8B,
                     split_len=split_len, seed=3)


def test_windowed_verify_rows_are_decode_steps():
    verify_vs_decode([5000, 300], [TREE6, CHAIN], 16, "cuda", torch.bfloat16, window=256, shape=SHAPE_8B,
                     split_len=engine_split(8192), seed=4)


def test_causal_rows_are_decode_steps():
    causal_vs_decode([3000, 64, 9], [5, 12, 8], 16, "cuda", seed=5, dtype=torch.bfloat16, shape=SHAPE_8B,
                     split_len=engine_split(4096))


def _decode_and_verify_logits(engine: Engine, prefix: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of k decode steps after a ``prefix``-token prefill, and of one verify step (a chain under its mask,
    as the engine verifies) over the same k tokens from the same prefix."""
    model, cache = engine.model, engine.cache
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 400, (prefix + k,), generator=gen)
    pos = torch.arange(prefix + k)
    h = cache.open()
    cache.reserve(h, prefix + k)
    with torch.inference_mode():
        model(build_forward_batch(cache, [h.row], [0], [prefix], ids[:prefix], pos[:prefix], pos[:prefix]), cache)
        decode = [model(build_forward_batch(cache, [h.row], [prefix + j], [1], ids[prefix + j:prefix + j + 1],
                                            pos[prefix + j:prefix + j + 1], pos[prefix + j:prefix + j + 1]),
                        cache).logits[0] for j in range(k)]
        chain = torch.ones(k, k, dtype=torch.bool).tril()
        verify = model(build_forward_batch(cache, [h.row], [prefix], [k], ids[prefix:], pos[prefix:], pos[prefix:],
                                           custom_mask=chain.reshape(-1)), cache).logits
    cache.close(h)
    return torch.stack(decode), verify


@pytest.mark.parametrize("kind", ["channel", "block"])
def test_fp8_target_verify_logits_are_decode_step_bits(oracle_model_dir, tmp_path, kind):
    shutil.copytree(oracle_model_dir, tmp_path / "oracle")
    quantize_checkpoint(tmp_path / "oracle" / "target", kind)
    engine = Engine(tmp_path / "oracle" / "target",
                    config=EngineConfig(device="cuda", dtype="bfloat16", page_size=16, cuda_graph=False))
    decode, verify = _decode_and_verify_logits(engine, 300, 6)
    assert torch.equal(decode, verify), (decode - verify).abs().max()
