"""The peer-GPU copy modes (``kernels.page_copy.copy_pages_peer``) write pools bit for bit as the reference does:
the staged pipeline whatever its chunk size (chunks ending inside runs, more chunks than buffers, one page per
chunk), the runs modes, pull, push; push's destination passed by address equals the kernel's pointer path (the
interpreter on the CPU). The two-GPU runs are tests/gpu/test_peer_handoff_gpu.py and test_peer_push_gpu.py."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DEVICE

from kernels import page_copy
from kernels.page_copy import PEER_MODES, PeerSettings, copy_pages, copy_pages_peer, copy_pages_ref, staged_chunks

PS = 4
LAYOUTS = {
    "scattered": ([1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 3, 7, 1, 12, 5, 2, 10, 4]),
    "runs-both-sides": ([1, 2, 3, 4, 5, 6, 7, 8, 9], [6, 7, 8, 9, 10, 1, 2, 3, 12]),  # runs of 5, 3, 1
    "runs-src-only": ([1, 2, 3, 4, 5, 6], [11, 9, 7, 5, 3, 1]),
    "one-run": ([2, 3, 4, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8, 9]),
}


def pools(layers: int = 3, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(2, layers, 10 * PS, 2, 8, generator=g).to(torch.bfloat16)
    dst = torch.randn(2, layers, 13 * PS, 2, 8, generator=g).to(torch.bfloat16)  # other slots: other strides
    return src, dst


def check(mode: str, layout: str, chunk_bytes: int | None = None) -> None:
    src, dst = pools()
    want = dst.clone()
    src_pages, dst_pages = LAYOUTS[layout]
    copy_pages_ref(want, src, src_pages, dst_pages, PS)
    copy_pages_peer(dst, src, src_pages, dst_pages, PS, mode, chunk_bytes)
    assert torch.equal(dst.view(torch.int16), want.view(torch.int16)), (mode, layout, chunk_bytes)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("chunk_pages", [1, 2, 3, 4, 100], ids=lambda n: f"{n}-pages-per-chunk")
@pytest.mark.parametrize("buffers", [1, 2, 3])
def test_the_staged_pipeline_writes_the_reference_pools_bit_for_bit(layout, chunk_pages, buffers, monkeypatch):
    monkeypatch.setattr(page_copy.PEER, "buffers", buffers)
    per_page = 2 * 3 * PS * 2 * 8 * 2  # every plane of one page, bytes
    check("staged", layout, chunk_pages * per_page + per_page // 2)  # a chunk's bytes need not divide into pages


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("mode", [m for m in PEER_MODES if m != "staged"])
def test_every_other_mode_writes_the_reference_pools_bit_for_bit(mode, layout):
    check(mode, layout)


def test_staged_chunks_cover_every_page_once_each_within_its_bytes():
    for n, per_page, chunk in [(256, 2 << 20, 16 << 20), (7, 10, 25), (5, 100, 10), (1, 1, 1), (9, 3, 27)]:
        chunks = staged_chunks(n, per_page, chunk)
        assert [p for lo, hi in chunks for p in range(lo, hi)] == list(range(n))
        assert all(hi > lo and ((hi - lo) * per_page <= chunk or hi - lo == 1) for lo, hi in chunks)
        assert len(chunks) == -(-n // max(1, min(n, chunk // per_page)))


@pytest.mark.parametrize("src_pages, dst_pages", [LAYOUTS["scattered"], LAYOUTS["runs-both-sides"]])
def test_the_kernel_with_the_destination_by_address_equals_the_reference(src_pages, dst_pages):
    src, dst = (p.to(DEVICE) for p in pools(seed=3))
    want = dst.clone()
    copy_pages_ref(want, src, src_pages, dst_pages, PS)
    copy_pages(dst, src, src_pages, dst_pages, PS, backend="triton", raw_dst=True)
    assert torch.equal(dst.view(torch.int16), want.view(torch.int16))


def test_the_mode_comes_from_the_environment_and_a_wrong_one_is_refused_naming_the_modes(monkeypatch):
    monkeypatch.setenv("EYRIE_PEER_COPY", "runs")
    monkeypatch.setenv("EYRIE_PEER_CHUNK_MB", "8")
    settings = PeerSettings()
    assert (settings.mode, settings.chunk_bytes) == ("runs", 8 << 20)
    monkeypatch.delenv("EYRIE_PEER_COPY")
    assert PeerSettings().mode == "pull"  # the measured winner (docs/benchmarks.md)
    monkeypatch.setenv("EYRIE_PEER_CHUNK_MB", "lots")
    with pytest.raises(ValueError, match="EYRIE_PEER_CHUNK_MB must be a whole number >= 1, got 'lots'"):
        PeerSettings()
    monkeypatch.setenv("EYRIE_PEER_CHUNK_MB", "64")
    monkeypatch.setenv("EYRIE_PEER_BUFFERS", "0")
    with pytest.raises(ValueError, match="EYRIE_PEER_BUFFERS must be a whole number >= 1, got '0'"):
        PeerSettings()
    src, dst = pools()
    with pytest.raises(ValueError, match="push, runs"):
        copy_pages_peer(dst, src, [1], [1], PS, "sideways")
    with pytest.raises(ValueError, match="2 source pages, 1 destination"):
        copy_pages_peer(dst, src, [1, 2], [1], PS, "staged")


@pytest.mark.parametrize("chunk_pages", [1, 2, 4, 9])
def test_the_staged_modes_uploaded_page_ids_copy_each_chunk_as_the_reference_does(chunk_pages):
    """The staged mode's CUDA path uploads a request's page ids once (``chunk_ids``) and launches each chunk's
    gather and scatter on its slice: on the interpreter, gathering then scattering chunk by chunk through those
    slices gives the reference pools."""
    from kernels.page_copy import chunk_ids

    src, dst = (p.to(DEVICE) for p in pools(seed=4))
    want = dst.clone()
    src_pages, dst_pages = LAYOUTS["scattered"]
    copy_pages_ref(want, src, src_pages, dst_pages, PS)
    chunks = staged_chunks(len(src_pages), 1, chunk_pages)
    local = [p for lo, hi in chunks for p in range(hi - lo)]
    gathers = chunk_ids(src_pages, local, chunks, src.device)
    scatters = chunk_ids(local, dst_pages, chunks, dst.device)
    for lo, hi in chunks:
        buf = torch.zeros((*src.shape[:2], (hi - lo) * PS, *src.shape[3:]), dtype=src.dtype, device=src.device)
        copy_pages(buf, src, src_pages[lo:hi], local[lo:hi], PS, backend="triton", ids=gathers[2 * lo:2 * hi])
        copy_pages(dst, buf, local[lo:hi], dst_pages[lo:hi], PS, backend="triton", ids=scatters[2 * lo:2 * hi])
    assert torch.equal(dst.view(torch.int16), want.view(torch.int16))
