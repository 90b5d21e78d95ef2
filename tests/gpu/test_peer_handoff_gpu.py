"""On two GPUs: the ipc hand-off into a peer GPU's pools (issue 28: the Triton copy launched on the prefill GPU
with a pointer into the decode GPU's pools was refused, every request failed and nothing fell back).

- each peer copy mode (staged: gather, peer memcpy, scatter, pipelined in chunks; pull: the kernel on the
  destination GPU reading over the link; runs: a peer memcpy per run and plane) writes every page, and only
  those, into pools another process holds on the other GPU (push and runs-strided, a kernel on the source GPU
  storing over the link: test_peer_push_gpu.py, in its own process);
- the negotiation proves a copy before it chooses ipc for a peer GPU, and falls back to grpc-stream naming why
  when no mode works;
- the services, prefill on cuda:0 and decode on cuda:1 with the transport left to ``auto``, choose ipc and give
  the single-process engine's tokens.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from kernels import page_copy
from shared.handoff import PageSource
from shared.handoff.ipc import export_pools, open_pools, write_in_place
from shared.memory.kv_cache import CacheLayout, KVCache

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

PS, PAGES = 16, 24


def cache(layers: int, device: str, shareable: bool = False) -> KVCache:
    return KVCache(CacheLayout(num_layers=layers, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                               device=torch.device(device), page_size=PS, num_pages=PAGES, max_reqs=1,
                               max_context=PAGES * PS, shareable=shareable))


def filled(layers: int, seed: int) -> KVCache:
    c = cache(layers, "cuda:0")
    g = torch.Generator().manual_seed(seed)
    c.pool.copy_(torch.randn(c.pool.shape, generator=g).to(torch.bfloat16))
    return c


def _hold(conn) -> None:
    """The decode-like process: two pools on cuda:1 (target 3 layers, draft 1), exported; on request, the pools'
    bytes back to the parent (host memory)."""
    pools = [cache(3, "cuda:1", True), cache(1, "cuda:1", True)]
    conn.send(export_pools([c.pool for c in pools]))
    while conn.recv() != "done":
        torch.cuda.synchronize("cuda:1")
        conn.send([c.pool.cpu() for c in pools])


@pytest.fixture(scope="module")
def peer_pools():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_hold, args=(child,), daemon=True)
    proc.start()
    assert parent.poll(120), "the pool-holding process exported nothing within 120 s"
    pools = open_pools(parent.recv())

    def read() -> list[torch.Tensor]:
        parent.send("read")
        return parent.recv()

    yield pools, read
    parent.send("done")
    proc.join(30)


@pytest.mark.parametrize("mode, staging_pages", [("staged", None), ("staged", 5), ("pull", None), ("runs", None)])
def test_each_peer_mode_writes_every_page_and_only_those_into_another_process_pools(peer_pools, monkeypatch, mode,
                                                                                     staging_pages):
    from shared.handoff.peer import ready

    assert ready(torch.device("cuda:0"), torch.device("cuda:1")) is None
    pools, read = peer_pools
    for p in pools:
        p.zero_()
    srcs = [filled(3, 1), filled(1, 2)]
    monkeypatch.setattr(page_copy.PEER, "mode", mode)
    monkeypatch.setattr(page_copy.PEER, "push_refused", "")
    if staging_pages:  # several pieces through the staging buffers
        per_page = srcs[0].pool[:, :, :PS].numel() * 2
        monkeypatch.setattr(page_copy.PEER, "chunk_bytes", staging_pages * per_page)
    src_pages, dst_pages = [3, 4, 5, 9, 1, 2, 20, 7], [8, 2, 3, 4, 17, 11, 12, 1]  # runs on neither, some on both
    written = write_in_place(PageSource("r", srcs, [src_pages, src_pages], b""), pools, [dst_pages, dst_pages],
                             deadline=1e18)
    assert written.bytes == sum(s.pool[:, :, :PS].numel() * 2 * len(src_pages) for s in srcs)
    # A push refused at launch on the IPC-mapped pools turns staged, saying why (bench_handoff --peer reports it).
    assert page_copy.PEER.mode == mode or (mode == "push" and page_copy.PEER.push_refused), page_copy.PEER
    for got, src in zip(read(), srcs):
        want = torch.zeros_like(got)
        for s, d in zip(src_pages, dst_pages):
            want[:, :, d * PS:(d + 1) * PS] = src.pool[:, :, s * PS:(s + 1) * PS].cpu()
        assert torch.equal(got, want), mode


def test_the_negotiation_proves_a_peer_copy_or_falls_back_naming_why(peer_pools, monkeypatch):
    from proto.eyrie.v1 import eyrie_pb2 as pb
    from shared.handoff import negotiate, peer
    from shared.handoff.ipc import host_id

    pools = export_pools([cache(1, "cuda:1", True).pool])
    reply = pb.HandshakeResponse(instance_id="d", host_id=host_id(), transports=["ipc", "grpc-stream"], pools=pools)
    monkeypatch.setattr(peer, "_READY", {})
    assert negotiate("auto", reply, torch.device("cuda:0"))[0] == "ipc"
    assert peer._READY[(0, 1)] is None
    monkeypatch.setattr(peer, "_READY", {})
    monkeypatch.setattr(peer, "probe", lambda src, dst, mode: f"{mode} refused")
    name, why = negotiate("auto", reply, torch.device("cuda:0"))
    assert name == "grpc-stream" and "push refused" in why and "staged refused" in why


def test_services_on_two_gpus_choose_ipc_and_equal_the_engine(oracle_model_dir):
    import grpc

    from proto.eyrie.v1 import eyrie_pb2 as pb
    from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc
    from services.decode.server import start_decode
    from services.metadata import EmbeddedRedis
    from services.prefill.server import start_prefill
    from services.settings import DecodeSettings, PrefillSettings
    from shared.handoff import sampling_to_pb
    from tests.unit.handoff.handoff_helpers import GREEDY, PROMPTS, engine_config, load_models, make_engine

    def config(device, graphs):
        return engine_config("eagle3", 4, 16, max_context=512, device=device, cuda_graph=graphs)

    m0, m1 = load_models(oracle_model_dir, device="cuda:0"), load_models(oracle_model_dir, device="cuda:1")
    want = make_engine(m0, "eagle3", config("cuda:0", True)).generate(PROMPTS, GREEDY)
    redis = EmbeddedRedis()
    url = redis.start()
    prefill = start_prefill(PrefillSettings(redis_url=url), make_engine(m0, "eagle3", config("cuda:0", False),
                                                                        role="prefill"))
    decode = start_decode(DecodeSettings(redis_url=url), make_engine(m1, "eagle3", config("cuda:1", True),
                                                                     role="decode"))
    try:
        pstub = pb_grpc.PrefillStub(grpc.insecure_channel(prefill.grpc_address))
        dstub = pb_grpc.DecodeStub(grpc.insecure_channel(decode.grpc_address))
        for i, (prompt, w) in enumerate(zip(PROMPTS, want)):
            events = list(pstub.Prefill(pb.PrefillRequest(request_id=f"p{i}", prompt_ids=prompt,
                                                          sampling=sampling_to_pb(GREEDY),
                                                          decode_address=decode.grpc_address), timeout=60))
            tokens = [events[0].first_token.token_id]
            for msg in dstub.Stream(pb.StreamRequest(request_id=f"p{i}"), timeout=60):
                tokens += msg.token_ids
            assert tokens == w.token_ids
        servicer = prefill.extra["servicer"]
        assert servicer._chosen[decode.grpc_address] == "ipc" and not servicer._unusable
        for h in (prefill, decode):
            assert h.engine_loop.call(lambda e: e.is_idle_and_clean()).result(10)
    finally:
        prefill.stop(0.5)
        decode.stop(0.5)
        redis.stop()
