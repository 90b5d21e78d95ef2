"""On the GPU: extend attention equals the paged torch reference at real shapes.

Llama-3-8B attention heads (32 query / 8 kv, head dim 128). Eight requests of mixed lengths up to
2048 tokens, with and without a cached prefix, page sizes 1 and 16 in shuffled order, both load
paths (tensor descriptors on sm90+, plain pointer loads), float32, and CUDA-graph replay. Fresh
random inputs on every run (seeded from the clock, printed on failure); NaN-filled destinations,
NaN in every cache slot no request owns (the sink page included) and in the padding rows of
q / k_new / v_new that belong to no request. Compared by relative norm error.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from bench.bench_extend import shape_configs
from kernels.attention_ref import AttentionMetadata, paged_attention_ref
from kernels.extend_attention import LONG_CONFIG, ExtendConfig, choose_extend_config, extend_attention, tma_supported

pytestmark = pytest.mark.gpu

HQ, HKV, D = 32, 8, 128
PAD = 5  # rows of q / k_new / v_new past the last request (CUDA-graph padding)
Q_LENS = [2048, 1, 777, 128, 1000, 64, 1537, 300]
PREFIX = [0, 3000, 0, 129, 2048, 0, 16, 1000]


@pytest.fixture
def gen():
    seed = time.time_ns() % (2**31)
    print(f"seed {seed}")  # shown by pytest on failure, to replay the case
    return torch.Generator(device="cuda").manual_seed(seed)


def extend_case(gen, q_lens, prefix, page_size, dtype):
    """Caches with pages in shuffled order (unowned slots NaN), q, metadata, and this step's k_new / v_new
    copied from the cache rows of each request's last q_len slots, plus PAD NaN rows past the end."""
    kv_lens = [p + n for p, n in zip(prefix, q_lens)]
    pages_per = [-(-n // page_size) for n in kv_lens]
    order = torch.randperm(sum(pages_per), device="cuda", generator=gen) + 1
    idx, new, used = [], [], 0
    for n, pp, p in zip(kv_lens, pages_per, prefix):
        pos = torch.arange(n, device="cuda")
        slots = order[used:used + pp][pos // page_size] * page_size + pos % page_size
        idx.append(slots)
        new.append(slots[p:])
        used += pp
    kv_indices, new_slots = torch.cat(idx), torch.cat(new)
    num_slots = (sum(pages_per) + 1) * page_size
    k = torch.full((num_slots, HKV, D), float("nan"), dtype=dtype, device="cuda")
    v = torch.full_like(k, float("nan"))
    k[kv_indices] = torch.randn(kv_indices.numel(), HKV, D, device="cuda", generator=gen).to(dtype)
    v[kv_indices] = torch.randn(kv_indices.numel(), HKV, D, device="cuda", generator=gen).to(dtype)
    pad_kv = torch.full((PAD, HKV, D), float("nan"), dtype=dtype, device="cuda")
    k_new, v_new = torch.cat([k[new_slots], pad_kv]), torch.cat([v[new_slots], pad_kv])
    q = torch.randn(sum(q_lens) + PAD, HQ, D, device="cuda", generator=gen).to(dtype)
    q[sum(q_lens):] = float("nan")
    meta = AttentionMetadata(qo_indptr=torch.tensor([0] + q_lens, device="cuda").cumsum(0),
                             kv_indptr=torch.tensor([0] + kv_lens, device="cuda").cumsum(0),
                             kv_indices=kv_indices, prefix_lens=torch.tensor(prefix, device="cuda"),
                             max_q_len=max(q_lens), max_kv_len=max(kv_lens))
    return q, k_new, v_new, k, v, meta


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def run_and_check(q, k_new, v_new, k, v, meta, **kw):
    n = sum(Q_LENS)
    scale = D ** -0.5
    ref = paged_attention_ref(q, k, v, meta, scale)[:n]
    junk = torch.full((1 << 28,), float("nan"), device="cuda")  # poison the allocator's free blocks
    del junk
    out = torch.full_like(q, float("nan"))
    extend_attention(q, k_new, v_new, k, v, meta, scale, out=out, **kw)
    assert not out[:n].isnan().any()
    assert out[n:].isnan().all()  # rows of no request are never written
    err = rel_err(out[:n], ref)
    assert err < 1e-2, err
    return out


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_extend_matches_reference(gen, page_size, dtype):
    """The default launch (tensor descriptors on sm90+)."""
    run_and_check(*extend_case(gen, Q_LENS, PREFIX, page_size, dtype))


@pytest.mark.parametrize("variant", ["pointer", "block_n64", "float32", "long", "pack2", "pack4", "pack2_pointer"])
def test_extend_launch_variants_match_reference(gen, variant):
    """Launches other than the default: pointer loads for this step's K/V, 64-key tiles, float32, the
    long-chunk configuration, GQA packing (2 and 4 heads per program; key tiles wider than the block)."""
    dtype = torch.float32 if variant == "float32" else torch.bfloat16
    q, k_new, v_new, k, v, meta = extend_case(gen, Q_LENS, PREFIX, 16, dtype)
    tma = tma_supported(q, k_new, v_new)
    cfg = None
    if variant == "pointer":
        cfg = ExtendConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, tma=False)
    elif variant == "block_n64":
        cfg = ExtendConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, tma=tma)
    elif variant == "long":
        cfg = LONG_CONFIG if tma else None
    elif variant == "pack2":
        cfg = ExtendConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, tma=tma, pack=2)
    elif variant == "pack4":
        cfg = ExtendConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, tma=tma, pack=4)
    elif variant == "pack2_pointer":
        cfg = ExtendConfig(block_m=128, block_n=64, num_warps=8, num_stages=2, tma=False, pack=2)
    run_and_check(q, k_new, v_new, k, v, meta, config=cfg)


@pytest.mark.parametrize("cfg", shape_configs(), ids=lambda c: f"m{c.block_m}n{c.block_n}w{c.num_warps}"
                         f"s{c.num_stages}p{c.pack}{'hm' if c.head_major else ''}"
                         f"{'rm' if c.request_major else ''}")
def test_every_tuning_candidate_matches_reference(gen, cfg):
    """Whatever ``bench_extend --tune-shapes --write-table`` may put in the tuned table is correct."""
    q, k_new, v_new, k, v, meta = extend_case(gen, Q_LENS, PREFIX, 16, torch.bfloat16)
    if not tma_supported(q, k_new, v_new):  # before sm90: the same tiles through pointer loads
        cfg = dataclasses.replace(cfg, tma=False)
    run_and_check(q, k_new, v_new, k, v, meta, config=cfg)


def test_a_tuned_table_row_is_what_the_kernel_launches(gen, tmp_path, monkeypatch):
    """A table naming this device: ``choose_extend_config`` returns its row and the launch is correct."""
    import json

    q, k_new, v_new, k, v, meta = extend_case(gen, Q_LENS, PREFIX, 16, torch.bfloat16)
    tma = tma_supported(q, k_new, v_new)
    row = ExtendConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, tma=tma, pack=2)
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"devices": {torch.cuda.get_device_name(): {
        "bf16_d128_g4": [{"min_max_q_len": 128, "min_tokens": 0, "config": row.__dict__}]}}}))
    monkeypatch.setenv("EYRIE_EXTEND_CONFIGS", str(path))
    assert choose_extend_config(q, max(Q_LENS), tma, HQ // HKV) == row
    run_and_check(q, k_new, v_new, k, v, meta)


def test_extend_under_cuda_graph_replay(gen):
    """Captured once, replayed on new inputs written into the same buffers: equals the eager result."""
    q, k_new, v_new, k, v, meta = extend_case(gen, Q_LENS, PREFIX, 16, torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    scale = D ** -0.5

    def call():
        extend_attention(q, k_new, v_new, k, v, meta, scale, out=out)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    n = sum(Q_LENS)
    q[:n].copy_(torch.randn(n, HQ, D, device="cuda", generator=gen).to(q.dtype))
    graph.replay()
    torch.cuda.synchronize()
    ref = paged_attention_ref(q, k, v, meta, scale)[:n]
    assert rel_err(out[:n], ref) < 1e-2


def test_engine_prefill_through_the_extend_kernel_equals_paged_and_cpu(oracle_model_dir, monkeypatch):
    """Long prompts (one chunk of >= EXTEND_MIN_Q tokens, and chunks of 96 after a prefix) prefill
    through the extend kernel; greedy output equals the paged kernel's and the CPU reference's."""
    import shared.model.layers as layers
    from shared.config import EngineConfig
    from shared.engine import Engine
    from shared.sampling import SamplingParams

    prompts = [list(range(3, 200)), [7, 9] * 70, list(range(100, 180))]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)

    def run(device, chunk, min_q):
        monkeypatch.setattr(layers, "EXTEND_MIN_Q", min_q)
        engine = Engine(oracle_model_dir / "target", None,
                        EngineConfig(device=device, dtype="float32", page_size=16, chunk_size=chunk,
                                     cuda_graph=False))
        out = [r.token_ids for r in engine.generate(prompts, params)]
        assert engine.is_idle_and_clean()
        return out

    cpu = run("cpu", None, 64)
    for chunk in (None, 96):
        assert run("cuda", chunk, 64) == run("cuda", chunk, 10**9) == cpu
