"""On a GPU: ``dtype="auto"`` (the default) loads a bf16 checkpoint as bfloat16, not float32. The tiny trained pair
widened to Llama-3.1-8B's shape (``bench/house/widen_tiny.py``, written in bf16; set EYRIE_WIDE_PAIR=DIR to reuse
one, e.g. /tmp/wide) loads with its weights, draft head and KV pools in bfloat16, half the bytes float32 took,
and generates what an explicit bfloat16 engine does; a float16 checkpoint stays float16 and a float32 one becomes
bfloat16. tests/unit/engine/test_dtype_auto.py checks the resolver and the CPU's float32."""

from __future__ import annotations

import gc
import json

import pytest
import torch

from services.engine_service import engine_facts
from shared.config import EngineConfig, SpecConfig, checkpoint_dtype
from shared.engine import Engine
from shared.model.factory import make_model
from shared.sampling import SamplingParams

pytestmark = pytest.mark.gpu

SPEC = SpecConfig(topk=1, steps=3, num_draft_tokens=4)
PROMPTS = [list(range(3, 60)), [7, 9] * 20, [100 + (i * 37) % 1900 for i in range(90)]]
TINY_PROMPTS = [[5, 17, 33, 2, 9], list(range(40, 77))]  # within the tiny model's 512 ids
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


def config(**kw) -> EngineConfig:
    """Small fixed pools (no sizing to the GPU's memory, no profile run): the weights are what is measured."""
    return EngineConfig(**{"device": "cuda", "page_size": 16, "num_pages": 512, "max_running": 4,
                           "max_context": 1024, "chunk_size": 256, "spec": SPEC, "spec_policy": "fixed", **kw})


def free_gpu() -> None:
    """The memory of the engines the test dropped, back to the device before the next one loads."""
    gc.collect()
    torch.cuda.empty_cache()


def test_auto_loads_the_bf16_wide_target_as_bfloat16(wide_pair):
    target, draft = wide_pair / "target", wide_pair / "eagle3"
    assert checkpoint_dtype(target) == "bfloat16", json.loads((target / "config.json").read_text()).get("torch_dtype")
    engine = Engine(target, draft, config())
    assert engine.config.dtype == "bfloat16" and engine_facts(engine)["dtype"] == "bfloat16"
    assert engine.handoff_schema().dtype == "bfloat16"
    params = list(engine.model.parameters())
    assert {p.dtype for p in params} == {torch.bfloat16}
    assert {p.dtype for p in engine.runner.head.parameters() if p.is_floating_point()} == {torch.bfloat16}
    assert all(c.k[0].dtype == torch.bfloat16 and c.v[0].dtype == torch.bfloat16 for c in engine.runner.caches)
    # The fused projections (qkv_weight, gate_up_weight) are plain tensors beside the parameters
    tensors = params + [t for m in engine.model.modules() for t in (getattr(m, "qkv_weight", None),
                                                                     getattr(m, "gate_up_weight", None))
                        if t is not None]
    assert {t.dtype for t in tensors} == {torch.bfloat16}
    weights = sum(t.numel() * t.element_size() for t in tensors)
    numel = sum(t.numel() for t in tensors)
    assert weights == 2 * numel and numel > 7e9, (weights, numel)  # ~16 GB of an 8B shape, not fp32's ~32
    print(json.dumps({"dtype": engine.config.dtype, "weights_gib": round(weights / 2**30, 2),
                      "allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 2)}))
    auto = [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]
    assert engine.is_idle_and_clean()
    del engine, params, tensors
    free_gpu()
    explicit = Engine(target, draft, config(dtype="bfloat16"))
    assert auto == [r.token_ids for r in explicit.generate(PROMPTS, GREEDY)]
    assert explicit.is_idle_and_clean()
    del explicit
    free_gpu()


@pytest.mark.parametrize("stored, want", [("float16", torch.float16), ("float32", torch.bfloat16)])
def test_auto_keeps_a_float16_checkpoint_and_halves_a_float32_one(tmp_path, stored, want):
    root = make_model("tiny", tmp_path)  # written in float32
    cfg_path = root / "target" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("torch_dtype", None)
    cfg_path.write_text(json.dumps({**cfg, "dtype": stored}))  # as transformers 5 writes it
    engine = Engine(root / "target", root / "eagle3", config(max_context=256))
    assert engine.config.dtype == str(want).removeprefix("torch.")
    assert {p.dtype for p in engine.model.parameters()} == {want}
    assert all(c.k[0].dtype == want for c in engine.runner.caches)
    prefill = Engine(root / "target", root / "eagle3", config(max_context=256, dtype=engine.config.dtype),
                     role="prefill")
    engine.handoff_schema().check(prefill.handoff_schema())  # auto and the dtype it resolved to agree
    assert [len(r.token_ids) for r in engine.generate(TINY_PROMPTS, GREEDY)] == [GREEDY.max_new_tokens] * 2
    assert engine.is_idle_and_clean() and prefill.is_idle_and_clean()
    del engine, prefill
    free_gpu()
