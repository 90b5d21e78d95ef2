"""The NIXL transport: the prefill side writes a request's pages straight into the decode pools through NIXL
(the KV-transfer library under vLLM's NixlConnector, SGLang, TensorRT-LLM and Dynamo), over whichever UCX
transports UCX's own configuration allows (``UCX_TLS``: ``cuda_ipc``/``nvlink`` on one host, ``rc`` or ``tcp``
across hosts; on a CPU-only machine ``tcp`` between DRAM regions).

Both sides register their whole pools once (``NixlAgent``): the decode instance exports its agent's metadata
and its pools' addresses in its handshake reply (``HandshakeResponse.nixl``), the prefill side adds it as a
remote agent and, for each increment of a hand-off, posts one WRITE of a batch of descriptors: one per (K/V,
layer) plane per run of pages contiguous on both sides, then waits for it (on CUDA after the step's event that
wrote the pages). The decode side reserves in place, as for ipc, and the draft state and the first token follow
in one ``in_place`` message over ``Decode.Transfer``; the lease and the page guard are the ipc transport's.

Optional: ``pip install 'eyrie-serve[nixl]'`` (``nixl-cu13``, UCX bundled); without it nothing here is offered.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import uuid
from dataclasses import dataclass

import torch

from kernels.page_copy import page_runs
from shared.handoff.ipc import WRITE_MARGIN_S, Written
from shared.handoff.wire import PageSource, TransferError, TransportFailed

POLL_S = 0.0005  # between checks of a posted transfer (UCX progresses it inside each check)
# Microseconds the agent's progress thread sleeps between rounds (NIXL's ``pthrDelay``; its Python API fixes 0: the
# thread polls without pause, a core per idle agent). 0, the default, leaves NIXL's own; the test suite sets 100
# (tests/conftest.py: two agents of an idle stack took 1.4 CPU cores, with 100 us about 0.02 each).
PROGRESS_DELAY_ENV = "EYRIE_NIXL_PROGRESS_DELAY_US"
_AGENT_CONFIG_LOCK = threading.Lock()


def nixl_api():
    """The NIXL Python module (``nixl_agent``, ``nixl_agent_config``), or None when it is not installed."""
    for name in ("nixl_cu13._api", "nixl_cu12._api", "nixl._api"):
        try:
            return __import__(name, fromlist=["nixl_agent"])
        except ImportError:
            continue
    return None


def mem_type(t: torch.Tensor) -> tuple[str, int]:
    return ("VRAM", t.device.index or 0) if t.device.type == "cuda" else ("DRAM", 0)


@dataclass(frozen=True)
class RemotePool:
    addr: int
    plane_bytes: int  # bytes between one (K/V, layer) plane and the next
    page_bytes: int  # bytes of one page of one plane
    mem: str
    dev: int


def make_agent(api, name: str, progress_delay_us: int = 0):
    """A NIXL agent with the UCX backend whose progress thread sleeps ``progress_delay_us`` between rounds (0: NIXL's
    default, no pause). ``nixl_agent`` sets ``pthrDelay`` to 0 on the config it makes; for the agent's creation its
    module's config class is one whose ``pthrDelay`` keeps the delay asked for."""
    config = api.nixl_agent_config(backends=["UCX"])
    if progress_delay_us <= 0:
        return api.nixl_agent(name, config)
    bind = api.nixlBind
    base = bind.nixlAgentConfig
    field = base.__dict__["pthrDelay"]  # the C++ field's property

    class Delayed(base):
        pthrDelay = property(field.__get__, lambda self, _value: field.__set__(self, progress_delay_us))

    with _AGENT_CONFIG_LOCK:
        bind.nixlAgentConfig = Delayed
        try:
            return api.nixl_agent(name, config)
        finally:
            bind.nixlAgentConfig = base


class NixlAgent:
    """One NIXL agent of this process, its pools registered once; calls into it are serialised. ``close`` ends it:
    its UCX backend runs progress threads that poll without pause (NIXL's Python API sets no progress delay), so an
    agent left behind by a stopped service keeps a core busy for the life of the process."""

    live = 0  # agents made and not yet closed, in this process

    def __init__(self, role: str):
        api = nixl_api()
        if api is None:
            raise TransferError("NIXL is not installed (pip install 'eyrie-serve[nixl]')")
        self.name = f"{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.agent = make_agent(api, self.name, int(os.environ.get(PROGRESS_DELAY_ENV) or 0))
        self._registered: dict[tuple[int, int], tuple[torch.Tensor, object]] = {}  # (address, bytes) -> the pool
        # (kept alive) and its registration
        self._remote: dict[bytes, str] = {}  # a remote agent's metadata -> its name here
        self.lock = threading.Lock()
        NixlAgent.live += 1

    def close(self) -> None:
        """Forget the remote agents, deregister the pools and drop the agent (its destructor joins the UCX
        threads). Idempotent; a write after it fails with TransportFailed."""
        with self.lock:
            agent, self.agent = self.agent, None
            if agent is None:
                return
            NixlAgent.live -= 1
            # A remote already gone has nothing to forget; what fails to deregister, the agent's destructor releases.
            for name in self._remote.values():
                with contextlib.suppress(Exception):
                    agent.remove_remote_agent(name)
            for _pool, registration in self._registered.values():
                with contextlib.suppress(Exception):
                    agent.deregister_memory(registration)
            self._remote.clear()
            self._registered.clear()
        del agent

    def register(self, pools: list[torch.Tensor]) -> None:
        for pool in pools:
            key = (pool.data_ptr(), pool.numel() * pool.element_size())
            with self.lock:
                if key in self._registered:
                    continue
                if self.agent is None:
                    raise TransportFailed("the NIXL agent is closed")
                mem, dev = mem_type(pool)
                self._registered[key] = (pool, self.agent.register_memory([(key[0], key[1], dev, "")], mem))

    def export(self, pools: list[torch.Tensor]) -> bytes:
        """This agent's metadata and ``pools``' layout: what a writer needs (the decode side's handshake)."""
        self.register(pools)
        described = []
        for pool in pools:
            mem, dev = mem_type(pool)
            size = pool.element_size()
            described.append({"addr": pool.data_ptr(), "plane_bytes": pool.stride(1) * size,
                              "page_bytes_per_slot": pool.stride(2) * size, "mem": mem, "dev": dev})
        with self.lock:
            meta = self.agent.get_agent_metadata()
        return json.dumps({"agent": self.name, "metadata": meta.hex(), "pools": described}).encode()

    def remote(self, blob: bytes, page_size: int) -> tuple[str, list[RemotePool]]:
        """The remote agent named by ``blob`` (added once) and its pools."""
        info = json.loads(blob)
        meta = bytes.fromhex(info["metadata"])
        with self.lock:
            name = self._remote.get(meta)
            if name is None:
                name = self.agent.add_remote_agent(meta)
                name = name.decode() if isinstance(name, bytes) else name
                self._remote[meta] = name
        return name, [RemotePool(p["addr"], p["plane_bytes"], p["page_bytes_per_slot"] * page_size, p["mem"],
                                 p["dev"]) for p in info["pools"]]

    def write(self, remote: str, local: list[tuple[int, int, int]], remote_descs: list[tuple[int, int, int]],
              local_mem: str, remote_mem: str, deadline: float) -> None:
        """One WRITE of the descriptor batch, waited for; TransportFailed when NIXL refuses or fails it."""
        with self.lock:
            agent = self.agent  # held to the end of this write (a close while it runs leaves it to this call)
            if agent is None:
                raise TransportFailed("the NIXL agent is closed")
            try:
                src = agent.get_xfer_descs(local, local_mem)
                dst = agent.get_xfer_descs(remote_descs, remote_mem)
                handle = agent.initialize_xfer("WRITE", src, dst, remote)
                state = agent.transfer(handle)
            except Exception as e:  # nixlBackendError, nixlNotAllowedError: nothing was acknowledged
                raise TransportFailed(f"NIXL refused the write: {type(e).__name__}: {e}") from e
        try:
            while state in ("PROC", "PENDING"):
                if time.monotonic() > deadline:
                    raise TransferError("the decode side's write deadline passed during a NIXL write")
                time.sleep(POLL_S)
                with self.lock:
                    state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransportFailed(f"a NIXL write ended {state}")
        finally:
            with self.lock:
                agent.release_xfer_handle(handle)


def agents_of(servicers) -> list[NixlAgent]:
    """The NIXL agents that services hold now (a decode servicer's, a prefill servicer's nixl transport's)."""
    found = [getattr(s, "nixl_agent", None) for s in servicers]
    found += [getattr(t, "_agent", None) for s in servicers for t in getattr(s, "transports", {}).values()]
    return [a for a in found if a is not None]


def write_pages(agent: NixlAgent, source: PageSource, remote_blob: bytes, dest_page_ids: list[list[int]],
                deadline: float) -> Written:
    """As ``shared.handoff.ipc.write_in_place``, through NIXL: each increment's new pages, in one WRITE."""
    if len(dest_page_ids) != len(source.caches):
        raise TransferError(f"{len(source.caches)} caches here, {len(dest_page_ids)} page lists on the decode side")
    agent.register([c.pool for c in source.caches])
    remote, pools = agent.remote(remote_blob, source.caches[0].page_size)
    if len(pools) != len(source.caches):
        raise TransferError(f"{len(source.caches)} caches here, {len(pools)} pools on the decode side")
    written, sent, last = 0, source.first_unsent(), None
    for inc in source.increments():
        if time.monotonic() > deadline - WRITE_MARGIN_S:
            raise TransferError("the decode side's write deadline passed before the pages were written")
        if inc.written is not None:
            inc.written.synchronize()  # the step that wrote these pages is done
        elif source.caches[0].pool.device.type == "cuda":
            torch.cuda.synchronize(source.caches[0].pool.device)
        with source.guard.access():
            written += _write_increment(agent, remote, pools, source, dest_page_ids, inc, sent, deadline)
        sent, last = source.first_unsent(inc.done), inc.last
    return Written(written, last)


def _write_increment(agent, remote, pools, source, dest_page_ids, inc, sent, deadline) -> int:
    """One WRITE with every (plane, run) of pages [sent[c], inc.done[c]) of every cache; its bytes."""
    local, far, written = [], [], 0
    mems = set()
    for cache, pool, src, dst, lo, hi in zip(source.caches, pools, inc.page_ids, dest_page_ids, sent, inc.done):
        if hi > len(dst) or (inc.last is not None and hi != len(dst)):
            raise TransferError(f"{hi} pages to send, {len(dst)} reserved")
        size = cache.pool.element_size()
        plane, page = cache.pool.stride(1) * size, cache.pool.stride(2) * size * cache.page_size
        mem, dev = mem_type(cache.pool)
        mems.add((mem, pool.mem))
        for s, d, n in page_runs(src[lo:hi], dst[lo:hi]):
            for p in range(cache.pool.shape[0] * cache.pool.shape[1]):
                local.append((cache.pool.data_ptr() + p * plane + s * page, n * page, dev))
                far.append((pool.addr + p * pool.plane_bytes + d * pool.page_bytes, n * pool.page_bytes, pool.dev))
                written += n * page
    if local:
        if len(mems) != 1:
            raise TransferError(f"the caches' memory kinds differ ({sorted(mems)}): one NIXL write takes one kind")
        local_mem, remote_mem = mems.pop()
        agent.write(remote, local, far, local_mem, remote_mem, deadline)
    return written


__all__ = ["NixlAgent", "nixl_api", "write_pages"]
