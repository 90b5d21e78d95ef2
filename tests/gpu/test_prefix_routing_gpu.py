"""On the GPU, CUDA graphs on: prefix-aware placement through the stack (issue 33). Two prefill instances with a
prefix cache, one decode instance, a router: a shared-prefix workload's follow-ups go to the prefill instance
holding their prefix (its summary published by the heartbeat, read from the cache while the device runs steps),
take it from its cache (``cached_tokens`` = the tokens the router matched), and give the greedy output of one
engine without a cache, token for token; every pool comes back. Float32 so that equality is meaningful.

``check_routing`` is device-agnostic (tests/e2e/test_prefix_routing.py covers the CPU path)."""

from __future__ import annotations

import json
import time

import pytest

from services.decode.server import start_decode
from services.metadata import Registry, connect
from services.prefill.server import start_prefill
from services.settings import DecodeSettings, PrefillSettings, RouterSettings
from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.memory.prefix_digest import PrefixSummary, leading_pages, prompt_digests
from shared.sampling import SamplingParams
from tests.e2e.conftest import InProcessStack
from tests.e2e.conftest import redis_url as redis_url  # noqa: F401 (a fixture)

pytestmark = pytest.mark.gpu

PAGE, NEW = 16, 12
PREFIXES = [[100 + (i * 37 + 11 * p) % 300 for i in range(65)] for p in range(2)]  # 4 pages each + 1
FOLLOW_UPS = [prefix + [7 + q, 8, 9, 10 + q] for prefix in PREFIXES for q in range(3)]
SPEC = SpecConfig(topk=2, steps=3, num_draft_tokens=6)


def _engine_settings(model_dir, url: str, device: str, graphs: bool) -> dict:
    return dict(model=str(model_dir / "target"), draft=str(model_dir / "eagle3"), redis_url=url, device=device,
                dtype="float32", heartbeat_s=0.2, page_size=PAGE, chunk_size=32, max_context=128, max_running=8,
                num_pages=96, cuda_graph=graphs, spec_policy="fixed", spec_topk=SPEC.topk, spec_steps=SPEC.steps,
                spec_draft_tokens=SPEC.num_draft_tokens)


def _wait_held(registry: Registry, instance_id: str, prompt: list[int], pages: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        raw = registry.summary(instance_id)
        if raw is not None:
            s = PrefixSummary.from_json(raw)
            if leading_pages(frozenset(s.digests), prompt_digests(prompt, s.page_size, s.successor)) >= pages:
                return
        assert time.monotonic() < deadline, f"{instance_id}'s summary never held {pages} pages of the prompt"
        time.sleep(0.05)


def check_routing(model_dir, url: str, device: str, graphs: bool) -> dict:
    """Warm prefix 0 on prefill-b (alone), prefix 1 on prefill-a (idle, first by id), then every follow-up;
    asserts each follow-up's placement and cached tokens and returns its tokens by prompt (as a tuple)."""
    from services.router.server import start_router

    connect(url).flushdb()
    base = _engine_settings(model_dir, url, device, graphs)
    s = InProcessStack(None, [], [], url)
    registry = Registry(connect(url))
    try:
        s.prefills.append(start_prefill(PrefillSettings(**base, prefix_cache=True, instance_id="prefill-b")))
        s.decodes.append(start_decode(DecodeSettings(**base)))
        s.router = start_router(RouterSettings(model=base["model"], redis_url=url, placement_timeout_s=30))
        s.generate(PREFIXES[0], max_new_tokens=NEW, ignore_eos=True)
        _wait_held(registry, "prefill-b", PREFIXES[0], 4)
        s.prefills.append(start_prefill(PrefillSettings(**base, prefix_cache=True, instance_id="prefill-a")))
        s.generate(PREFIXES[1], max_new_tokens=NEW, ignore_eos=True)  # nobody holds it: the idle a, by id
        _wait_held(registry, "prefill-a", PREFIXES[1], 4)
        out = {}
        for prompt in FOLLOW_UPS:
            tokens, finish = s.generate(prompt, max_new_tokens=NEW, ignore_eos=True, timeout=120)
            out[tuple(prompt)] = (tokens, finish.usage.cached_tokens)
        records = [s.store.get(k.removeprefix("req:")) for k in registry.client.keys("req:*")]
        follow = [json.loads(r["placements"])[-1] for r in records if int(r["prompt_tokens"]) == len(FOLLOW_UPS[0])]
        assert sorted(p["prefill"] for p in follow) == ["prefill-a"] * 3 + ["prefill-b"] * 3, follow
        assert all(p["prefix_tokens"] == 64 for p in follow), follow
        assert all(cached == 64 for _, cached in out.values()), out
        assert s.wait_clean(30)
        return {k: v[0] for k, v in out.items()}
    finally:
        for h in [s.router, *s.prefills, *s.decodes]:
            if h is not None:
                h.stop(0.5)


def test_follow_ups_go_where_their_prefix_is_cached_with_graphs(redis_url, oracle_model_dir):  # noqa: F811
    url = redis_url.replace("db=0", "db=14")
    got = check_routing(oracle_model_dir, url, "cuda", graphs=True)
    engine = Engine(oracle_model_dir / "target", oracle_model_dir / "eagle3",
                    EngineConfig(device="cuda", dtype="float32", page_size=PAGE, chunk_size=32, max_context=128,
                                 spec=SPEC, cuda_graph=True, spec_policy="fixed"))
    want = engine.generate(FOLLOW_UPS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    for prompt, r in zip(FOLLOW_UPS, want):
        assert got[tuple(prompt)] == r.token_ids, prompt
