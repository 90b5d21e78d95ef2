"""Prefix-aware placement end to end (issue 33): real prefill engines with a prefix cache publish their cache
summaries with their heartbeats, and the router sends a prompt whose prefix one of them holds there, where its
engine serves the prefix from its cache (``cached_tokens``), rather than to the instance load and ids alone
would pick."""

from __future__ import annotations

import json
import time

import pytest

from services.decode.server import start_decode
from services.metadata import Registry, connect
from services.prefill.server import start_prefill
from services.router.server import start_router
from services.settings import DecodeSettings, PrefillSettings, RouterSettings
from shared.memory.prefix_digest import PrefixSummary, leading_pages, prompt_digests
from tests.e2e.conftest import InProcessStack

PROMPT = [(i * 37 + 11) % 500 for i in range(33)]  # 8 pages of 4 a cache can serve (the last token is computed)
FOLLOW_UP = PROMPT + [7, 8, 9, 10, 11, 12, 13, 14]


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def held_pages(registry: Registry, instance_id: str, prompt: list[int]) -> int:
    """The leading pages of ``prompt`` the summary ``instance_id`` published holds (0: none published)."""
    raw = registry.summary(instance_id)
    if raw is None:
        return 0
    s = PrefixSummary.from_json(raw)
    return leading_pages(frozenset(s.digests), prompt_digests(prompt, s.page_size, s.successor))


@pytest.fixture
def stack(redis_url, tiny_model_dir):
    url = redis_url.replace("db=0", "db=15")
    connect(url).flushdb()
    base = dict(model=str(tiny_model_dir / "target"), draft=str(tiny_model_dir / "eagle"), redis_url=url,
                heartbeat_s=0.2, page_size=4, chunk_size=8, max_context=96, spec_policy="fixed")
    s = InProcessStack(None, [], [], url)
    try:
        s.prefills.append(start_prefill(PrefillSettings(**base, prefix_cache=True, instance_id="prefill-b")))
        s.decodes.append(start_decode(DecodeSettings(**base)))
        s.router = start_router(RouterSettings(model=base["model"], redis_url=url, placement_timeout_s=5))
        yield s, base
    finally:
        for h in [s.router, *s.prefills, *s.decodes]:
            if h is not None:
                h.stop(0.5)


def test_a_follow_up_goes_where_its_prefix_is_cached(stack):
    s, base = stack
    registry = Registry(connect(s.redis_url))
    _, warm = s.generate(PROMPT, max_new_tokens=4, ignore_eos=True)
    assert warm.usage.cached_tokens == 0
    wait_for(lambda: held_pages(registry, "prefill-b", PROMPT) == 8, "prefill-b's summary to hold the prompt")
    # a second prefill instance, idle and first by id: load and ids alone would pick it for every prompt
    s.prefills.append(start_prefill(PrefillSettings(**base, prefix_cache=True, instance_id="prefill-a")))
    wait_for(lambda: len(registry.instances("prefill")) == 2, "prefill-a to register")
    _, cold = s.generate([3] * 33, max_new_tokens=4, ignore_eos=True)
    tokens, hit = s.generate(FOLLOW_UP, max_new_tokens=4, ignore_eos=True)
    assert len(tokens) == 4 and hit.usage.cached_tokens == 32  # its prefix came from prefill-b's cache
    records = [s.store.get(k.removeprefix("req:")) for k in registry.client.keys("req:*")]
    placed = [(int(r["prompt_tokens"]), json.loads(r["placements"])[-1]) for r in records]
    # the warm-up (prefill-b, alone then) and the cold prompt (prefill-a: nobody holds it) by load and id; the
    # follow-up on prefill-b for its 32 cached tokens
    assert sorted((n, p["prefill"], p.get("prefix_tokens", 0)) for n, p in placed) == [
        (33, "prefill-a", 0), (33, "prefill-b", 0), (len(FOLLOW_UP), "prefill-b", 32)]
    assert cold.usage.cached_tokens == 0
    assert s.wait_clean()


def test_a_follow_up_whose_prefix_its_decode_instance_holds_is_prefilled_there(redis_url, tiny_model_dir):
    """Conditional disaggregation by tokens left to compute: the first prompt (33 tokens, past the router's bound
    of 16) goes through the prefill instance and its hand-off; the decode instance's cache then holds its pages,
    so the follow-up (41 tokens, 9 to compute) is prefilled by the decode instance itself, no hand-off, with the
    32 cached tokens reported and the tokens a single engine gives."""
    from shared.config import EngineConfig
    from shared.engine import Engine
    from shared.sampling import SamplingParams

    url = redis_url.replace("db=0", "db=14")
    connect(url).flushdb()
    base = dict(model=str(tiny_model_dir / "target"), draft=str(tiny_model_dir / "eagle"), redis_url=url,
                heartbeat_s=0.2, page_size=4, chunk_size=8, max_context=96, spec_policy="fixed", prefix_cache=True)
    s = InProcessStack(None, [], [], url)
    try:
        s.prefills.append(start_prefill(PrefillSettings(**base, instance_id="prefill-a")))
        s.decodes.append(start_decode(DecodeSettings(**base, instance_id="decode-a")))
        s.router = start_router(RouterSettings(model=base["model"], redis_url=url, placement_timeout_s=5,
                                               local_prefill_max_tokens=16))
        registry = Registry(connect(url))
        s.generate(PROMPT, max_new_tokens=4, ignore_eos=True)
        wait_for(lambda: held_pages(registry, "decode-a", PROMPT) == 8, "decode-a's summary to hold the prompt")
        tokens, finish = s.generate(FOLLOW_UP, max_new_tokens=6, ignore_eos=True)
        assert finish.usage.cached_tokens == 32
        records = {int(r["prompt_tokens"]): r for r in
                   (s.store.get(k.removeprefix("req:")) for k in registry.client.keys("req:*"))}
        first, follow = records[len(PROMPT)], records[len(FOLLOW_UP)]
        assert first["prefill_instance"] == "prefill-a" and first["decode_instance"] == "decode-a"
        assert follow["prefill_instance"] == follow["decode_instance"] == "decode-a"
        assert json.loads(follow["placements"])[-1]["local_prefill"] is True
        engine = Engine(tiny_model_dir / "target", tiny_model_dir / "eagle",
                        EngineConfig(page_size=4, chunk_size=8, spec_policy="fixed"))
        [alone] = engine.generate([FOLLOW_UP], SamplingParams(max_new_tokens=6, ignore_eos=True))
        assert tokens == alone.token_ids
        assert s.wait_clean()
    finally:
        for h in [s.router, *s.prefills, *s.decodes]:
            if h is not None:
                h.stop(0.5)
