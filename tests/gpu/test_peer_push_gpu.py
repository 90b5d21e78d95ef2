"""On two GPUs: the peer copies whose kernel runs on the source GPU storing into pools another process holds on
the other GPU, reached through their CUDA IPC mapping and peer access (push: ours; runs-strided: torch's copy
kernel), write every page, and only those. In a file
of its own, run in its own pytest process (bench/gpu_session.sh peer): a store the driver does not map is an
illegal address that spoils the process's CUDA context, which must not take the other peer tests with it."""

from __future__ import annotations

import pytest
import torch

from kernels import page_copy
from shared.handoff import PageSource
from shared.handoff.ipc import write_in_place
from tests.gpu.test_peer_handoff_gpu import PS, filled, peer_pools  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]


@pytest.mark.parametrize("mode", ["runs-strided", "push"])
def test_a_store_from_the_source_gpu_writes_every_page_and_only_those_into_another_process_pools(
        peer_pools, monkeypatch, mode):  # noqa: F811
    from shared.handoff.peer import ready

    assert ready(torch.device("cuda:0"), torch.device("cuda:1")) is None
    pools, read = peer_pools
    for p in pools:
        p.zero_()
    srcs = [filled(3, 1), filled(1, 2)]
    monkeypatch.setattr(page_copy.PEER, "mode", mode)
    monkeypatch.setattr(page_copy.PEER, "push_refused", "")
    src_pages, dst_pages = [3, 4, 5, 9, 1, 2, 20, 7], [8, 2, 3, 4, 17, 11, 12, 1]
    write_in_place(PageSource("r", srcs, [src_pages, src_pages], b""), pools, [dst_pages, dst_pages], deadline=1e18)
    assert page_copy.PEER.mode == mode, page_copy.PEER.push_refused
    for got, src in zip(read(), srcs):
        want = torch.zeros_like(got)
        for s, d in zip(src_pages, dst_pages):
            want[:, :, d * PS:(d + 1) * PS] = src.pool[:, :, s * PS:(s + 1) * PS].cpu()
        assert torch.equal(got, want)
