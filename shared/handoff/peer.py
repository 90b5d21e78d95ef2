"""Peer-GPU hand-offs: a prefill process on one GPU writing into the decode pools on another GPU of the host.

The decode pools are mapped into the prefill process by CUDA IPC on the decode GPU (``shared.handoff.ipc``).
A kernel on the prefill GPU may touch that memory only once peer access from the prefill GPU to the decode
GPU is enabled in this process (without it Triton refuses the pointer: "Pointer argument ... cannot be
accessed from Triton (cpu tensor?)", issue 28). ``ready`` enables it (torch enables peer access inside a copy
between two devices, ``cudaDeviceEnablePeerAccess``) and then proves the write for real: the copy the
hand-off will make (``kernels.page_copy.copy_pages_peer``, the mode ``EYRIE_PEER_COPY`` names, default pull)
from a scratch pool here into a scratch pool on the peer, read back. The first mode that works is the one used;
when none does, the reason is returned and the negotiation falls back to the gRPC stream.
"""

from __future__ import annotations

import threading

import torch

from kernels import page_copy

_READY: dict[tuple[int, int], str | None] = {}  # (this GPU, peer GPU) -> None once proven, else why not
_LOCK = threading.Lock()
PROBE_PAGE = 4  # the probe's page size (tokens)


def ready(src: torch.device, dst: torch.device) -> str | None:
    """Make ``src``'s copies into ``dst``'s memory work (peer access, a mode that proves itself); None when they
    do, else why not. Once per pair of GPUs in this process."""
    key = (src.index or 0, dst.index or 0)
    with _LOCK:
        if key not in _READY:
            _READY[key] = _make_ready(torch.device("cuda", key[0]), torch.device("cuda", key[1]))
        return _READY[key]


def _make_ready(src: torch.device, dst: torch.device) -> str | None:
    if not torch.cuda.can_device_access_peer(src.index, dst.index):
        return f"{src} cannot access {dst} as a peer (no NVLink or PCIe peer-to-peer between them)"
    try:
        enable_peer_access(src, dst)
    except Exception as e:  # a driver refusing it (e.g. too many peers)
        return f"enabling peer access from {src} to {dst} failed: {e}"
    if page_copy.PEER.mode not in page_copy.PEER_MODES:
        return f"EYRIE_PEER_COPY={page_copy.PEER.mode!r} is not a peer copy mode ({', '.join(page_copy.PEER_MODES)})"
    failures = []
    # The configured mode, then the others that never store from the source GPU into the peer's IPC mapping:
    # push and runs-strided do, and on two H200s those stores faulted (an illegal address that spoils the
    # process's CUDA context, which no probe into scratch memory shows): they run only when named.
    order = [m for m in page_copy.PEER_MODES if m not in (page_copy.PEER.mode, "push", "runs-strided")]
    for mode in dict.fromkeys([page_copy.PEER.mode, *order]):
        why = probe(src, dst, mode)
        if why is None:
            page_copy.PEER.mode = mode
            return None
        failures.append(f"{mode}: {why}")
    return f"no peer copy from {src} to {dst} works ({'; '.join(failures)})"


def enable_peer_access(src: torch.device, dst: torch.device) -> None:
    """Peer access both ways between ``src`` and ``dst`` in this process: torch enables it (once per pair) for a
    copy between the two devices."""
    a, b = torch.zeros(1, device=src), torch.zeros(1, device=dst)
    b.copy_(a)
    a.copy_(b)
    torch.cuda.synchronize(src)
    torch.cuda.synchronize(dst)


def probe(src: torch.device, dst: torch.device, mode: str) -> str | None:
    """Copy a small pool's pages from ``src`` into one on ``dst`` the way ``mode`` does, on a stream of ``src``
    as the hand-off does; None when every byte arrived where it should, else what went wrong."""
    shape = (2, 2, 3 * PROBE_PAGE, 2, 8)
    try:
        here = torch.arange(torch.Size(shape).numel(), dtype=torch.float32, device=src).view(shape).to(torch.bfloat16)
        there = torch.zeros(shape, dtype=torch.bfloat16, device=dst)
        torch.cuda.synchronize(src)  # made on the default streams: the copy's stream does not wait for those
        torch.cuda.synchronize(dst)
        stream = torch.cuda.Stream(src)
        with torch.cuda.stream(stream):
            page_copy.copy_pages_peer(there, here, [0, 2], [2, 0], PROBE_PAGE, mode)
        stream.synchronize()
        got, want = there.cpu(), here.cpu()
        ps = PROBE_PAGE
        ok = (torch.equal(got[:, :, 2 * ps:], want[:, :, :ps]) and torch.equal(got[:, :, :ps], want[:, :, 2 * ps:])
              and not got[:, :, ps:2 * ps].any())
        return None if ok else "the probe's pages arrived wrong"
    except Exception as e:  # Triton refusing the pointer, a CUDA error
        return f"{type(e).__name__}: {e}"


__all__ = ["enable_peer_access", "probe", "ready"]
