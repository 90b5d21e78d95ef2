"""The same-host transport's pieces: pools mapped by another process, page runs, and the negotiation."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from proto.eyrie.v1 import eyrie_pb2 as pb
from shared.handoff import TransferError, negotiate
from shared.handoff.ipc import export_pools, host_id, open_pools
from shared.memory import kv_cache
from shared.memory.kv_cache import allocate_pool


def test_another_process_writes_into_an_exported_cpu_pool():
    pool = allocate_pool((2, 3, 16, 2, 4), torch.float32, torch.device("cpu"), shareable=True)
    blob = export_pools([pool])
    code = ("import sys; from shared.handoff.ipc import open_pools; "
            "p = open_pools(sys.stdin.buffer.read())[0]; p[:, :, 4:8] = 7.0")
    subprocess.run([sys.executable, "-c", code], input=blob, check=True, timeout=60)
    assert bool((pool[:, :, 4:8] == 7).all()) and float(pool.sum()) == 7.0 * 2 * 3 * 4 * 2 * 4


def test_a_pool_not_in_shared_memory_is_not_exported():
    assert export_pools([torch.zeros(2, 1, 4, 1, 2)]) == b""


def test_the_same_process_gets_its_own_pool_back():
    pool = allocate_pool((2, 1, 8, 1, 2), torch.float16, torch.device("cpu"), shareable=True)
    assert open_pools(export_pools([pool]))[0] is pool


def reply(host: str, transports=("ipc", "grpc-stream"), pools=b"") -> pb.HandshakeResponse:
    if pools == b"" and "ipc" in transports:
        pools = export_pools([allocate_pool((2, 1, 4, 1, 2), torch.float32, torch.device("cpu"), True)])
    return pb.HandshakeResponse(instance_id="d", host_id=host, transports=list(transports), pools=pools)


CPU = torch.device("cpu")


def test_the_same_host_negotiates_ipc_and_another_host_the_stream():
    assert negotiate("auto", reply(host_id()), CPU)[0] == "ipc"
    name, why = negotiate("auto", reply("elsewhere/boot"), CPU)
    assert name == "grpc-stream" and "another host" in why
    assert negotiate("auto", reply(host_id(), transports=("grpc-stream",)), CPU)[0] == "grpc-stream"
    assert negotiate("auto", pb.HandshakeResponse(instance_id="old"), CPU)[0] == "grpc-stream"  # offers nothing


def test_a_forced_transport_wins_or_fails_naming_why():
    assert negotiate("grpc-stream", reply(host_id()), CPU) == ("grpc-stream", "forced")
    with pytest.raises(TransferError, match="another host"):
        negotiate("ipc", reply("elsewhere/boot"), CPU)
    with pytest.raises(TransferError, match="not one of"):
        negotiate("rdma", reply(host_id()), CPU)  # (nixl is one since issue 28)
    with pytest.raises(TransferError, match="does not offer nixl"):
        negotiate("nixl", reply(host_id()), CPU)


def test_a_pool_share_the_shared_memory_manager_missed_is_tried_again(monkeypatch):
    """torch's shared-memory manager (a daemon) can miss its deadline on a loaded host: the share is tried again
    for up to ``SHARE_WAIT_S``; any other failure, or the manager still missing after it, is raised."""
    share, calls = torch.UntypedStorage._share_filename_cpu_, []

    def flaky(self, *a, fail=1, **kw):
        calls.append(1)
        if len(calls) <= fail:
            raise RuntimeError("Shared memory manager connection has timed out")
        return share(self, *a, **kw)

    monkeypatch.setattr(torch.UntypedStorage, "_share_filename_cpu_", flaky)
    pool = allocate_pool((2, 1, 8, 1, 2), torch.float32, torch.device("cpu"), shareable=True)
    assert len(calls) == 2 and pool.is_shared() and not pool.any()
    calls.clear()
    monkeypatch.setattr(torch.UntypedStorage, "_share_filename_cpu_", lambda self, *a, **kw: flaky(self, fail=9))
    pool = allocate_pool((2, 1, 8, 1, 2), torch.float32, torch.device("cpu"), shareable=True)
    assert len(calls) == 10 and pool.is_shared()  # asked again as long as the manager times out, within its wait
    calls.clear()
    monkeypatch.setattr(kv_cache, "SHARE_WAIT_S", 0.0)  # past the wait: the manager's timeout is raised
    with pytest.raises(RuntimeError, match="Shared memory manager"):
        allocate_pool((2, 1, 8, 1, 2), torch.float32, torch.device("cpu"), shareable=True)
    assert len(calls) == 1

    def broken(self, *a, **kw):
        raise RuntimeError("something else")

    monkeypatch.setattr(torch.UntypedStorage, "_share_filename_cpu_", broken)
    with pytest.raises(RuntimeError, match="something else"):
        allocate_pool((2, 1, 8, 1, 2), torch.float32, torch.device("cpu"), shareable=True)
