"""``RowsCache``: each request's penalty rows kept on the device across steps equal the rows built from its
whole prompt and output (``logits_rows``) at every step: after admission with an output (a hand-off, a
failover), after each step's commits, at the rows a draft launched ahead places them, with padding rows
neutral, and in a slot a retired request left behind (the scheduler releases it: ``RowsCache.release``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shared.logits_process import LogitsRows, RowsCache, logits_rows
from shared.request import Request
from shared.sampling import SamplingParams

V = 40
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def request(rid: str, prompt: list[int], output: list[int] = (), **params) -> Request:
    req = Request(rid, list(prompt), SamplingParams(max_new_tokens=50, **params), eos_ids=(0,))
    req.output_ids.extend(output)
    return req


def fresh(reqs: list[Request], total: int, device: str = "cpu") -> LogitsRows:
    return logits_rows([r.prompt_ids for r in reqs], [r.output_ids for r in reqs], [r.params for r in reqs],
                       [r.eos_ids for r in reqs], V, total, device)


def assert_rows_equal(got: LogitsRows, want: LogitsRows) -> None:
    for f in dataclasses.fields(LogitsRows):
        a, b = getattr(got, f.name), getattr(want, f.name)
        assert (a is None) == (b is None), f.name
        assert a is None or torch.equal(a, b), f.name


PARAMS = [dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, min_tokens=4,
               stop_token_ids=(3,), logit_bias=((5, 1.0),)),
          dict(repetition_penalty=1.0, frequency_penalty=0.7, allowed_token_ids=(1, 2, 7, 9), min_p=0.1,
               temperature=0.8),
          dict()]  # no feature: rides along with neutral rows


@pytest.mark.parametrize("device", DEVICES)
def test_rows_follow_each_steps_commits(device):
    cache = RowsCache()
    reqs = [request("a", [1, 2, 2], **PARAMS[0]), request("b", [4], [9, 9, 1], **PARAMS[1]),
            request("c", [6, 7], [7], **PARAMS[2])]
    for step in range(4):
        assert_rows_equal(cache.rows(reqs, V, 4, device), fresh(reqs, 4, device))
        for i, r in enumerate(reqs):  # repeats and new tokens, several a step
            r.output_ids.extend([(step * 3 + i) % V, 9, (step + i) % 5][: 1 + (step + i) % 3])
    assert_rows_equal(cache.rows(reqs, V, 3, device), fresh(reqs, 3, device))


@pytest.mark.parametrize("device", DEVICES)
def test_rows_placed_by_index_with_neutral_padding(device):
    cache = RowsCache()
    reqs = [request(str(i), [i, i + 1], [i + 2] * i, **p) for i, p in enumerate(PARAMS)]
    cache.rows(reqs, V, 3, device)
    reqs[0].output_ids.extend([5, 5, 3])
    index = torch.tensor([4, 0, 2], device=device)
    got = cache.rows(reqs, V, 6, device, index)
    want = fresh(reqs, 3, device)
    for f in dataclasses.fields(LogitsRows):
        if (t := getattr(want, f.name)) is not None:
            placed = t.new_zeros((6, *t.shape[1:])).index_copy_(0, index, t)
            assert torch.equal(getattr(got, f.name), placed), f.name


def test_retired_requests_free_their_slots_for_new_ones():
    cache = RowsCache()
    reqs = [request(str(i), [1, i], [2, 2, i], **PARAMS[0]) for i in range(5)]
    cache.rows(reqs, V, 5, "cpu")
    slots = {cache.entries[id(r)].slot for r in reqs}
    for r in reqs[:3]:
        r.end("abort")
        cache.release(r)  # what the scheduler's retire does
    later = [request("x", [8], [8, 8, 8, 8], **PARAMS[1]), request("y", [3], **PARAMS[0])]
    batch = reqs[3:] + later
    assert_rows_equal(cache.rows(batch, V, 4, "cpu"), fresh(batch, 4))  # no count left from the old rows
    assert {cache.entries[id(r)].slot for r in later} <= slots  # reused
    assert len(cache.entries) == 4
    for r in batch:
        cache.release(r)
    cache.rows([request("z", [1], repetition_penalty=1.3)], V, 1, "cpu")
    assert len(cache.entries) == 1  # the released requests' slots went back


def test_batch_without_features_builds_nothing():
    cache = RowsCache()
    assert cache.rows([request("a", [1, 2], [3])], V, 2, "cpu") is None
    assert cache.pool is None and not cache.entries
