"""On the GPU: sliding-window attention (Mistral's 4096, and a short window) in the real kernels.

Mistral-7B heads (32 query / 8 kv, head dim 128), bf16 and float32: the extend kernel (every
configuration the device picks, descriptors and pointers) and the paged kernel (chunked prefill,
decode with key splits, tree verify with positions) equal the torch reference past the window; and a
windowed Mistral checkpoint decodes on CUDA (the extend kernel for chunks of 64+ tokens, the paged
kernel otherwise, with and without an EAGLE draft) the same greedy tokens as on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from kernels.attention import paged_attention
from kernels.attention_ref import AttentionMetadata, paged_attention_ref
from kernels.extend_attention import choose_extend_config, extend_attention, tma_supported
from kernels.spec_kernels import ancestor_mask

pytestmark = pytest.mark.gpu

HQ, HKV, D = 32, 8, 128


def paged_case(q_lens, prefix, extra, dtype, page_size=16, masks=None, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    kv_lens = [p + e for p, e in zip(prefix, extra)]
    pages_per = [-(-n // page_size) for n in kv_lens]
    order = (torch.randperm(sum(pages_per), device="cuda", generator=g) + 1).tolist()
    kv_indices, used = [], 0
    for n, pp in zip(kv_lens, pages_per):
        pages = order[used:used + pp]
        used += pp
        kv_indices += [pages[i // page_size] * page_size + i % page_size for i in range(n)]
    slots = (sum(pages_per) + 2) * page_size
    k = torch.randn(slots, HKV, D, device="cuda", generator=g).to(dtype)
    v = torch.randn(slots, HKV, D, device="cuda", generator=g).to(dtype)
    q = torch.randn(sum(q_lens), HQ, D, device="cuda", generator=g).to(dtype)
    cum = lambda xs: torch.tensor([0, *torch.tensor(xs).cumsum(0).tolist()], device="cuda")  # noqa: E731
    meta = AttentionMetadata(qo_indptr=cum(q_lens), kv_indptr=cum(kv_lens),
                             kv_indices=torch.tensor(kv_indices, device="cuda"),
                             prefix_lens=torch.tensor(prefix, device="cuda"))
    if masks is not None:
        meta.custom_mask = torch.cat([m.reshape(-1) for m in masks]).cuda()
        meta.mask_indptr = cum([m.numel() for m in masks])
    return q, k, v, meta


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [4096, 100])
def test_extend_kernel_past_the_window(dtype, window):
    q_lens, prefix = [5000, 300, 1, 1200], [0, 4500, 6000, 100]
    q, k, v, meta = paged_case(q_lens, prefix, q_lens, dtype, seed=window)
    new = torch.cat([meta.kv_indices[int(meta.kv_indptr[b]) + p:int(meta.kv_indptr[b + 1])]
                     for b, p in enumerate(prefix)])
    ref = paged_attention_ref(q, k, v, meta, D ** -0.5, window)
    for tma in {tma_supported(q, k[new], v[new]), False}:
        cfg = choose_extend_config(q, max(q_lens), tma, HQ // HKV)
        out = extend_attention(q, k[new], v[new], k, v, meta, D ** -0.5, window, config=cfg)
        assert rel_err(out, ref) < (1e-2 if dtype == torch.bfloat16 else 1e-3), (tma, cfg)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_paged_kernel_decode_and_prefill_past_the_window(dtype, num_splits):
    q_lens, prefix = [1, 1, 1, 200], [5000, 30, 9000, 4000]
    q, k, v, meta = paged_case(q_lens, prefix, q_lens, dtype, seed=3)
    ref = paged_attention_ref(q, k, v, meta, D ** -0.5, 4096)
    out = paged_attention(q, k, v, meta, D ** -0.5, 4096, num_splits=num_splits)
    assert rel_err(out, ref) < (1e-2 if dtype == torch.bfloat16 else 1e-3)


def test_paged_kernel_tree_verify_past_the_window():
    parents = [-1, 0, 0, 1, 1, 2, 3, 4]
    depth = torch.tensor([0, 1, 1, 2, 2, 2, 3, 3], device="cuda")
    mask = ancestor_mask(torch.tensor([parents]), len(parents))[0]
    prefix = [5000, 64, 4200]
    q, k, v, meta = paged_case([8] * 3, prefix, [8] * 3, torch.bfloat16, masks=[mask] * 3, seed=5)
    pos = torch.cat([p + depth for p in prefix])
    ref = paged_attention_ref(q, k, v, meta, D ** -0.5, 4096, pos)
    out = paged_attention(q, k, v, meta, D ** -0.5, 4096, pos)
    assert rel_err(out, ref) < 1e-2


def test_windowed_mistral_decodes_on_cuda_as_on_the_cpu(tmp_path):
    from shared.config import EngineConfig, SpecConfig
    from shared.engine import Engine
    from shared.sampling import SamplingParams
    from tests.oracle_model import make_oracle_model

    root = make_oracle_model(tmp_path, architecture="MistralForCausalLM", sliding_window=24)
    prompts = [list(range(3, 200)), [7, 8, 9], [100 + (i * 37) % 300 for i in range(90)]]
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    cpu = Engine(root / "target", config=EngineConfig(chunk_size=128)).generate(prompts, params)
    want = [r.token_ids for r in cpu]
    for draft in (None, root / "eagle"):
        spec = SpecConfig(topk=2, steps=3, num_draft_tokens=6) if draft else None
        gpu = Engine(root / "target", draft, EngineConfig(device="cuda", dtype="float32", chunk_size=128,
                                                          spec=spec))
        assert [r.token_ids for r in gpu.generate(prompts, params)] == want, draft
