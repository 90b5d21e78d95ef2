"""On a GPU: a tensor-parallel rank's share read from the checkpoint (``load_target_shard``) lands on the GPU equal,
bit for bit, to the target loaded whole on the host and split there (``shard_target``, what an engine under TP
did before), and the GPU never holds more than the share and one tensor's slice (tests/unit/engine/
test_tensor_parallel_load.py is the same on the CPU). The ranks run in this process on ``cuda:0``: loading needs
no collective."""

from __future__ import annotations

import gc

import pytest
import torch

from shared.model.loader import load_target
from shared.model.shard_loader import load_target_shard
from shared.parallel import shard_target
from tests.unit.engine.test_tensor_parallel_load import (
    FAMILIES,
    assert_same_split,
    fake_group,
    split_state,
    write_family,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
GPU = torch.device("cuda:0")


@pytest.mark.parametrize("name", ["llama", "llama_biases", "qwen3", "gemma"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_rank_loads_onto_the_gpu_what_shard_target_keeps(tmp_path, name, dtype):
    assert name in FAMILIES
    path = write_family(tmp_path, name, torch.bfloat16 if name == "gemma" else torch.float32)
    for rank in range(2):
        tp = fake_group(rank, 2)
        want = shard_target(load_target(path, dtype, "cpu"), tp, GPU)
        gc.collect()  # the whole model moved to the GPU to be split: freed now, not in the middle of the load
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(GPU)
        torch.cuda.reset_peak_memory_stats(GPU)
        got = load_target_shard(path, tp, dtype, GPU)
        torch.cuda.synchronize()
        tensors = split_state(got)
        assert all(t.device == GPU for t in tensors.values())
        assert_same_split(got, want, tp)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors.values()}
        share = sum(-(-n // 512) * 512 for n in storages.values())  # the caching allocator's 512-byte blocks
        assert torch.cuda.memory_allocated(GPU) - before <= share  # nothing kept beside the share
        largest = max(t.nbytes for t in tensors.values())
        assert torch.cuda.max_memory_allocated(GPU) - before <= share + 2 * largest
        del got, want
