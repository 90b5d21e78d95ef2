"""On the GPU: the FP8 products (shared/model/fp8.py) at the 8B shapes, and FP8 checkpoints served with and
without a draft head.

* up to 16 rows, ``kernels/fp8_gemv.py`` equals the dequantized product (weight-only: the activations as they
  are), per-channel and 128 x 128 blocks, with the CUDA graph capturing it;
* more rows, ``torch._scaled_mm`` of the dynamically quantized activations equals the same product computed
  from the quantized activations in float32 (per-channel: row-wise scales; blocks: the block-wise product, or
  the dequantized weight where this torch has none, which the test prints);
* an FP8 checkpoint of each format loads on the GPU, and greedy output is the same with and without its
  EAGLE-3 head, eager and under CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_gemv import fp8_linear_ref
from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.model import fp8
from shared.model.factory import make_model
from shared.sampling import SamplingParams
from tests.gpu.gpu_checks import seeded_generator

pytestmark = pytest.mark.gpu

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down of the 8B


def fp8_weight(n: int, k: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    q, scale = fp8.quantize(w, kind, (128, 128))
    return fp8.mark(q, scale, (1, k) if kind == "channel" else (128, 128))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("kind", ["channel", "block"])
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_few_rows_run_the_fp8_gemv_kernel(kind, rows):
    gen = seeded_generator()
    for n, k in SHAPES:
        w = fp8_weight(n, k, kind, gen)
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        got = fp8.linear(x, w)
        want = fp8_linear_ref(x.float(), w, w.fp8_scale, w.fp8_block)
        assert got.dtype == torch.bfloat16 and rel(got, want) < 1e-2, (n, k)


@pytest.mark.parametrize("kind", ["channel", "block"])
@pytest.mark.parametrize("rows", [17, 64, 300])
def test_many_rows_run_scaled_mm_on_the_quantized_activations(kind, rows):
    gen = seeded_generator()
    block_ok = kind == "block" and fp8.block_scaled_mm_ok(torch.device("cuda"), 128, 128)
    print(f"{kind}: block-wise torch._scaled_mm {'available' if block_ok else 'not used'}")
    for n, k in SHAPES:
        w = fp8_weight(n, k, kind, gen)
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        got = fp8.linear(x, w)
        group = k if kind == "channel" else 128
        xq, sx = fp8.quantize_activations(x, group)
        x_dq = (xq.float() * sx.repeat_interleave(group, 1)[:, :k])
        w8a8 = x_dq @ fp8.dequantize(w).t()
        weight_only = x.float() @ fp8.dequantize(w).t()
        assert got.shape == (rows, n)
        if kind == "channel" or block_ok:
            assert rel(got, w8a8) < 1e-2, (n, k)
        else:  # the dequantized weight: the activations are not quantized
            assert rel(got, weight_only) < 1e-2, (n, k)
        assert rel(got, weight_only) < 6e-2  # and either is near the unquantized-activation product


def test_the_kernel_replays_under_a_cuda_graph():
    gen = seeded_generator()
    w = fp8_weight(4096, 4096, "block", gen)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    fp8.linear(x, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8.linear(x, w)
    x.copy_(torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16, generator=gen))
    graph.replay()
    assert rel(out, fp8_linear_ref(x.float(), w, w.fp8_scale, w.fp8_block)) < 1e-2


@pytest.mark.parametrize("kind", ["channel", "block"])
@pytest.mark.parametrize("graphs", [False, True])
def test_fp8_checkpoint_greedy_is_the_same_with_and_without_its_head(tmp_path, kind, graphs):
    make_model("tiny", tmp_path, fp8=kind)
    cfg = EngineConfig(device="cuda", dtype="bfloat16", page_size=16, cuda_graph=graphs)
    plain = Engine(tmp_path / "target", config=cfg)
    assert all(w.is_cuda and w.dtype == fp8.FP8 for w in fp8.fp8_weights_of(plain.model))
    spec = Engine(tmp_path / "target", draft=tmp_path / "eagle3",
                  config=cfg.model_copy(update={"spec": SpecConfig(topk=2, steps=3, num_draft_tokens=6)}))
    prompts = [[5, 6, 7, 8], list(range(20, 60)), [300, 2, 2, 9]]
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    assert [r.token_ids for r in spec.generate(prompts, params)] == \
        [r.token_ids for r in plain.generate(prompts, params)]
    assert spec.spec_stats.totals.verify_steps > 0
