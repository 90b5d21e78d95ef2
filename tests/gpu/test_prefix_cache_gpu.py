"""On the GPU, CUDA graphs and drafting ahead on: the prefix cache on gives the cache off's output and
acceptance, token for token (issue 33), for every draft kind at page sizes 1 (the device table's permuting
compaction) and 16; the cached pages are really taken (cached tokens > 0) and every pool comes back."""

import pytest

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.sampling import SamplingParams

pytestmark = pytest.mark.gpu

BASE = [100 + (i * 37) % 300 for i in range(45)]
WARM = [BASE, BASE[:37] + [11, 12, 13, 14, 15, 16], BASE[:32] + [21, 22, 23, 24, 25, 26, 27, 28, 29]]
PARAMS = [SamplingParams(max_new_tokens=24, ignore_eos=True),
          SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.8, seed=7)]


def _run(model_dir, kind, page_size, cached):
    spec = SpecConfig(topk=2, steps=3, num_draft_tokens=6)
    cfg = EngineConfig(device="cuda", dtype="float32", page_size=page_size, chunk_size=16, spec=spec, cuda_graph=True,
                       prefix_cache=cached, spec_policy="fixed")  # the steps compared: not timed choices
    engine = Engine(model_dir / "target", model_dir / kind, cfg)
    out = []
    for params in PARAMS:
        out += engine.generate([BASE], params) + engine.generate(WARM, params)
        assert engine.is_idle_and_clean()
    return out


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp"])
def test_prefix_cache_on_equals_off_with_graphs(oracle_model_dir, kind, page_size):
    off = _run(oracle_model_dir, kind, page_size, False)
    on = _run(oracle_model_dir, kind, page_size, True)
    for i, (a, b) in enumerate(zip(on, off, strict=True)):
        assert a.token_ids == b.token_ids, f"request {i}"
        assert (a.spec_stats["verify_steps"], a.spec_stats["accepted_drafts"]) == \
            (b.spec_stats["verify_steps"], b.spec_stats["accepted_drafts"]), f"request {i}"
    assert sum(r.cached_tokens for r in on) > 0 and all(r.cached_tokens == 0 for r in off)
