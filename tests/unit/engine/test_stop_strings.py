"""Stop strings: matched on the detokenized output, across token boundaries and inside a multi-token
speculative commit; the engine stops at the token that completes one (its pages go back), the text is
cut before it (or after it with ``include_stop_str_in_output``), nothing past it is ever released, and
only text that could still begin a stop string is held back.

The engine cases run the oracle pair (drafts accepted often, so a verify commits several tokens) and
compare with the target alone; the expected cut is computed from the uncut greedy output's text.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.model.loader import load_target
from shared.model.tokenizer import Tokenizer
from shared.request import RequestError
from shared.sampling import SamplingParams
from shared.text import StopStrings, TextStream, first_stop, partial_stop_len

PROMPT = "def fibonacci(n):"
N = 24


# ---- the text side -------------------------------------------------------------------------------
def test_a_stop_string_split_over_deltas_is_found_and_nothing_after_it_is_released():
    s = StopStrings(("STOP",))
    assert s.feed("abc ST") == "abc "  # "ST" could begin STOP: held
    assert s.feed("O") == ""
    assert s.feed("Pxyz") == "" and s.matched == "STOP"
    assert s.feed("more") == "" and s.feed("", final=True) == ""


def test_held_text_that_does_not_complete_a_stop_string_is_released():
    s = StopStrings(("STOP",))
    assert s.feed("a ST") == "a "
    assert s.feed("ART ") == "START "  # the prefix went on differently: released at once
    assert s.feed("S") == ""
    assert s.feed("", final=True) == "S" and s.matched is None


def test_the_stop_string_ending_first_wins_and_include_keeps_it():
    assert first_stop("xxabcdyy", ("cdy", "abcd", "bc")) == (3, "bc")
    assert first_stop("xxabcdyy", ("cd", "abcd")) == (2, "abcd")  # same end: the longer one
    assert first_stop("xx", ("y",)) is None
    s = StopStrings(("cd",), include=True)
    assert s.feed("abcdef") == "abcd" and s.matched == "cd"


def test_only_a_possible_start_of_a_stop_string_is_held_back():
    assert partial_stop_len("hello wor", ("world", "low")) == 3
    assert partial_stop_len("hello", ("xyz",)) == 0
    assert partial_stop_len("aab", ("aabx", "bq")) == 3


# ---- the engine ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def oracle(oracle_model_dir):
    root = Path(oracle_model_dir)
    tok = Tokenizer(root / "target")
    target = Engine(root / "target", config=EngineConfig(page_size=1, max_context=160))
    ref = target.generate([PROMPT], SamplingParams(max_new_tokens=N, ignore_eos=True))[0]
    return root, tok, ref


def spec_engine(root: Path, page_size: int = 16) -> Engine:
    return Engine(root / "target", root / "eagle3",
                  EngineConfig(page_size=page_size, max_context=160, chunk_size=4, spec_policy="fixed",
                               spec=SpecConfig(topk=2, steps=3, num_draft_tokens=6)))


def char_ends(tok: Tokenizer, ids: list[int]) -> list[int]:
    """For each token, the length of the text up to and including it."""
    return [len(tok.decode(ids[:i + 1])) for i in range(len(ids))]


def expected(tok: Tokenizer, ids: list[int], stop: str, include: bool = False) -> tuple[list[int], str]:
    """What a request with ``stop`` must give: tokens up to the one completing the first occurrence,
    the text cut before it (after it with ``include``)."""
    text = tok.decode(ids)
    at = text.find(stop)
    assert at >= 0
    last = next(i for i, e in enumerate(char_ends(tok, ids)) if e >= at + len(stop))
    return ids[:last + 1], text[:at + len(stop) if include else at]


def stop_inside_a_run(tok: Tokenizer, ids: list[int], runs: list[list[int]]) -> str:
    """A stop string that spans two tokens and is completed by a token that is not the last one of its
    verify step's run (so the step committed tokens past it): the tokens' text around a boundary."""
    ends = char_ends(tok, ids)
    text = tok.decode(ids)
    pos = 0
    for run in runs:
        for j in range(pos + 1, pos + len(run) - 1):  # not the run's last token
            if ends[j - 1] > 0 and ends[j] > ends[j - 1] and ends[j - 1] > (ends[j - 2] if j >= 2 else 0):
                stop = text[ends[j - 1] - 1:ends[j]]
                if text.find(stop) + len(stop) == ends[j] and stop.strip() and "\ufffd" not in stop:
                    return stop
        pos += len(run)
    raise AssertionError(f"no multi-token run in {runs}")


@pytest.mark.parametrize("page_size", [1, 16])
def test_speculative_stop_inside_an_accepted_run_equals_target_only(oracle, page_size):
    root, tok, ref = oracle
    engine = spec_engine(root, page_size)
    req = engine.add_request(PROMPT, SamplingParams(max_new_tokens=N, ignore_eos=True))
    runs = []
    while engine.scheduler.has_work():
        runs += [toks for r, toks in engine.step() if r is req and toks]
    assert sum(runs, []) == ref.token_ids  # lossless without the stop string
    stop = stop_inside_a_run(tok, ref.token_ids, runs[1:])  # runs[0]: the prefill's one token
    want_ids, want_text = expected(tok, ref.token_ids, stop)
    for eng in (engine, Engine(root / "target", config=EngineConfig(page_size=page_size, max_context=160))):
        got = eng.generate([PROMPT], SamplingParams(max_new_tokens=N, ignore_eos=True, stop=("\x00", stop)))[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_str) == (want_ids, want_text, "stop", stop)
        assert eng.is_idle_and_clean()
    assert len(want_ids) < N


def test_include_stop_str_in_output_keeps_it(oracle):
    root, tok, ref = oracle
    stop = "re o"
    want_ids, want_text = expected(tok, ref.token_ids, stop, include=True)
    got = spec_engine(root).generate([PROMPT], SamplingParams(max_new_tokens=N, ignore_eos=True, stop=(stop,),
                                                             include_stop_str_in_output=True))[0]
    assert (got.token_ids, got.text, got.stop_str) == (want_ids, want_text, stop)
    assert got.text.endswith(stop)


def test_a_stop_string_in_the_prompt_or_never_completed_does_not_stop(oracle):
    root, tok, ref = oracle
    text = tok.decode(ref.token_ids)
    in_prompt = "fibonacci"
    assert in_prompt not in text
    started = text[4:8] + "\x01"  # its beginning appears in the output: held back, then released
    got = spec_engine(root).generate([PROMPT], SamplingParams(max_new_tokens=N, ignore_eos=True,
                                                             stop=(in_prompt, started)))[0]
    assert (got.token_ids, got.text, got.finish_reason, got.stop_str) == (ref.token_ids, text, "length", None)


def test_text_stream_releases_the_same_text_token_by_token_or_in_runs(oracle):
    _, tok, ref = oracle
    text = tok.decode(ref.token_ids)
    stop = "ou"
    one = TextStream(tok, (stop,))
    by_token = "".join(one.push([t]) for t in ref.token_ids) + one.push([], final=True)
    runs = TextStream(tok, (stop,))
    by_runs = "".join(runs.push(ref.token_ids[i:i + 5]) for i in range(0, N, 5)) + runs.push([], final=True)
    assert by_token == by_runs == text[:text.find(stop)] and one.matched == runs.matched == stop


def test_stop_strings_need_a_tokenizer(oracle):
    root, _, _ = oracle
    engine = Engine(load_target(root / "target"), config=EngineConfig(max_context=160))  # no tokenizer
    with pytest.raises(RequestError) as err:
        engine.add_request([5, 6, 7], SamplingParams(stop=("x",)))
    assert err.value.field == "stop"
