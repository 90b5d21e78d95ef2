"""On the GPU: a phase's graphs at every batch size write one shared output buffer, replays equal eager runs at
every size in any order, and the outputs' memory is one set at the largest bucket, not one per batch size."""

import pytest
import torch

from shared.cuda_graphs import GraphPool, PhaseGraphs, default_buckets

pytestmark = pytest.mark.gpu

V, N = 32000, 4  # a vocabulary-wide output of N rows per request, as a verify phase's logits


def test_every_batch_size_replays_as_eager_into_one_buffer_and_keeps_one_set_of_outputs():
    torch.manual_seed(0)
    weight = torch.randn(V, 64, device="cuda", dtype=torch.bfloat16)

    def verify(x: torch.Tensor):  # [bs, N, 64] -> logits [bs, N, V], a per-row argmax
        logits = (x @ weight.T).float()
        return logits, logits.argmax(-1)

    graphs = PhaseGraphs("verify", verify, True, max_bs=64, pool=GraphPool())
    sizes = default_buckets(64)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for bs in sizes:  # capture every bucket
        graphs(torch.zeros(bs, N, 64, device="cuda", dtype=torch.bfloat16))
    held = torch.cuda.memory_allocated() - before
    one_set = max(sizes) * N * V * 4
    per_size = sum(sizes) * N * V * 4
    assert graphs.captured_sizes == sizes
    assert held < one_set + per_size // 4, (held, one_set, per_size)  # one buffer, not a set per batch size
    buffers = {g[2][0].data_ptr() for g in graphs._graphs.values()}
    assert len(buffers) == 1
    for bs in reversed(sizes):  # largest first, then smaller ones over what it wrote
        x = torch.randn(bs, N, 64, device="cuda", dtype=torch.bfloat16)
        logits, top = graphs(x)
        want_logits, want_top = verify(x)
        assert logits.shape == (bs, N, V)
        assert torch.equal(logits, want_logits) and torch.equal(top, want_top)
