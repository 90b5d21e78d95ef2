"""On the GPU: the FP8 products (shared/model/fp8.py) at the 8B shapes, and FP8 checkpoints served with and
without a draft head.

* up to 1024 rows (every decode and verify step), ``kernels/fp8_gemv.py`` equals the dequantized product
  (weight-only: the activations as they are), per-channel and 128 x 128 blocks, with the CUDA graph
  capturing it, and a row's output is the same bits at any row count from 1 (an FP8 target's bf16 LM head too);
* ``torch._scaled_mm`` (more rows: long prefill chunks) of the dynamically quantized activations equals the
  same product computed from the quantized activations in float32 (per-channel: row-wise scales; blocks: the
  block-wise product, or the dequantized weight where this torch has none, which the test prints);
* an FP8 checkpoint of each format loads on the GPU, and greedy output is the same with and without its
  EAGLE-3 head, eager and under CUDA graphs: the oracle target quantized, in bf16 (its logits have margins, as
  the bf16 lossless tests' targets do: tests/gpu/test_training_gpu.py), and a random one in float32 (random
  bf16 logits tie within bf16's rounding, where one row's and 2+ rows' summation orders may pick differently,
  as for bf16 weights: tests/gpu/test_graphs_gpu.py runs float32 for that reason).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from kernels.fp8_gemv import MAX_ROWS, fp8_linear_ref
from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.model import fp8
from shared.model.factory import make_model, quantize_checkpoint
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
@pytest.mark.parametrize("rows", [1, 4, 16, 17, 300])
def test_decode_and_verify_rows_run_the_fp8_gemv_kernel(kind, rows):
    gen = seeded_generator()
    for n, k in SHAPES:
        w = fp8_weight(n, k, kind, gen)
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        got = fp8.linear(x, w)
        want = fp8_linear_ref(x.float(), w, w.fp8_scale, w.fp8_block)
        assert got.dtype == torch.bfloat16 and rel(got, want) < 1e-2, (n, k)
        if rows > 1:  # the same bits for a row whatever the other rows (a verify step's vs a decode step's)
            assert torch.equal(fp8.linear(x[: rows // 2 + 1], w), got[: rows // 2 + 1]), (n, k)


@pytest.mark.parametrize("kind", ["channel", "block"])
def test_one_row_is_the_same_bits_as_in_a_verify_step(kind):
    """A batch-1 decode step's row and the same row among a verify step's: every projection shape, and an FP8
    target's bf16 LM head (marked by ``fp8.prepare``), at 1, 2, 7, 16, 21 and 300 rows."""
    gen = seeded_generator()
    head = torch.randn(128256, 4096, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    head.same_rows = True
    for w, k in [(fp8_weight(n, k, kind, gen), k) for n, k in SHAPES] + [(head, 4096)]:
        x = torch.randn(300, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        every = fp8.linear(x, w)
        for rows in (1, 2, 7, 16, 21):
            assert torch.equal(fp8.linear(x[:rows], w), every[:rows]), (tuple(w.shape), rows)
        assert torch.equal(fp8.linear(x[150:151], w), every[150:151]), tuple(w.shape)


@pytest.mark.parametrize("kind", ["channel", "block"])
@pytest.mark.parametrize("rows", [17, 64, 300])
def test_scaled_mm_runs_on_the_quantized_activations(kind, rows):
    gen = seeded_generator()
    block_ok = kind == "block" and fp8.block_scaled_mm_ok(torch.device("cuda"), 128, 128)
    print(f"{kind}: block-wise torch._scaled_mm {'available' if block_ok else 'not used'}")
    for n, k in SHAPES:
        w = fp8_weight(n, k, kind, gen)
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        got = fp8.scaled_mm_linear(x, w, None)  # fp8.linear's product above MAX_ROWS
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


def test_more_rows_than_the_kernel_takes_run_scaled_mm(monkeypatch):
    calls = []
    monkeypatch.setattr(fp8, "scaled_mm_linear", lambda x, w, b: calls.append(x.shape[0]) or x[:, :1])
    gen = seeded_generator()
    w = fp8_weight(256, 256, "channel", gen)
    for rows in (1, 16, MAX_ROWS, MAX_ROWS + 1):
        fp8.linear(torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16, generator=gen), w)
    assert calls == [MAX_ROWS + 1]


def _greedy_with_and_without_head(model_dir, dtype: str, graphs: bool):
    cfg = EngineConfig(device="cuda", dtype=dtype, page_size=16, cuda_graph=graphs)
    plain = Engine(model_dir / "target", config=cfg)
    assert all(w.is_cuda and w.dtype == fp8.FP8 for w in fp8.fp8_weights_of(plain.model))
    spec = Engine(model_dir / "target", draft=model_dir / "eagle3",
                  config=cfg.model_copy(update={"spec": SpecConfig(topk=2, steps=3, num_draft_tokens=6),
                                                "spec_policy": "fixed"}))  # verify steps asserted below
    prompts = [[5, 6, 7, 8], list(range(20, 60)), [300, 2, 2, 9]]
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    with_head = [r.token_ids for r in spec.generate(prompts, params)]
    assert with_head == [r.token_ids for r in plain.generate(prompts, params)]
    assert spec.spec_stats.totals.verify_steps > 0
    return spec.spec_stats.totals.accept_length


@pytest.mark.parametrize("kind", ["channel", "block"])
@pytest.mark.parametrize("graphs", [False, True])
def test_fp8_checkpoint_greedy_is_the_same_with_and_without_its_head(oracle_model_dir, tmp_path, kind, graphs):
    shutil.copytree(oracle_model_dir, tmp_path / "oracle")
    quantize_checkpoint(tmp_path / "oracle" / "target", kind)
    accept = _greedy_with_and_without_head(tmp_path / "oracle", "bfloat16", graphs)
    assert accept > 1.3  # drafts accepted: verify's rows decided tokens


@pytest.mark.parametrize("kind", ["channel", "block"])
def test_random_fp8_checkpoint_in_float32_is_the_same_with_and_without_its_head(tmp_path, kind):
    make_model("tiny", tmp_path, fp8=kind)
    _greedy_with_and_without_head(tmp_path, "float32", True)
