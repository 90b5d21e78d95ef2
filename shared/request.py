"""A request's life in an engine: its tokens, its cache claims and its statistics.

One owner per field. The scheduler (``shared.scheduler``) creates requests, moves them between its
queues, retires them, and alone writes ``stage`` and ``handles``. Tokens, lengths, the draft state and
the end of a request change only through the methods below (``commit``, ``advance``, ``resume_from``,
``receive``, ``end``): every other module reads these fields and never assigns them
(``tests/unit/engine/test_state_owners.py`` holds it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from shared.errors import RequestError as RequestError  # re-exported: its importers predate shared.errors
from shared.grammar import Grammar
from shared.memory.kv_cache import KVHandle
from shared.sampling import SamplingParams
from shared.spec.state import DraftState
from shared.spec.stats import SpecStats
from shared.text import TextStream


class Stage(Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    HANDOFF = "handoff"  # prefill role: prompt done, waiting to be sent to a decode instance
    RECEIVING = "receiving"  # decode role: pages reserved, K/V arriving
    FINISHED = "finished"


@dataclass
class Request:
    """Created by the scheduler; the fields below the parameters are written by their owners only."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_ids: tuple[int, ...] = ()
    seed: int = 0  # every draw hashes it with a position (set at admission; a hand-off carries it)
    resumed: int = 0  # output tokens it arrived with to prefill (a failover resuming after them); fixed
    stage: Stage = Stage.WAITING  # written by the scheduler
    output_ids: list[int] = field(default_factory=list)  # commit
    output_logprobs: list[float] = field(default_factory=list)  # commit: target log p of each output token
    # commit: with params.top_logprobs, each output token's most likely alternatives (token id, log p)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    handles: list[KVHandle] = field(default_factory=list)  # written by the scheduler: one per cache, target first
    # Written by the scheduler: the prefix cache's pages it holds (``CachedPage``s, a chain from the root: the
    # ones it matched at admission, then the ones it inserted), and the prompt tokens it found cached.
    prefix_pages: list = field(default_factory=list)
    cached_tokens: int = 0
    kv_len: int = 0  # advance / resume_from: committed tokens whose target K/V is cached
    finish_reason: str | None = None  # commit (a stop condition) or end
    draft_state: DraftState | None = None  # resume_from: the state the next decode step drafts from
    stats: SpecStats = field(default_factory=SpecStats)
    text: TextStream | None = None  # the output text, with stop strings only (commit feeds it)
    grammar: Grammar | None = None  # with a JSON schema only: the matcher after the output (commit advances it)
    t_arrival: float = field(default_factory=time.perf_counter)
    t_first_token: float | None = None
    t_finish: float | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def prefill_len(self) -> int:
        """Positions its prefill computes: the prompt, and of the output tokens it resumes after all but the
        last, which the first decode step takes as its input (as it takes a sampled first token)."""
        return self.prompt_len + max(self.resumed - 1, 0)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def commit(self, tokens: list[int], logprobs: list[float],
               tops: list[list[tuple[int, float]]] | None = None) -> list[int]:
        """Append sampled tokens up to the first stop condition; returns those appended. ``tops``: each
        token's top log-probabilities (given when the request asked for them)."""
        if tops is None and self.text is None and self.grammar is None and self.t_first_token is not None:
            return self._commit_ids(tokens, logprobs)
        taken = []
        for i, (tok, lp) in enumerate(zip(tokens, logprobs)):
            if self.finish_reason is not None:
                break
            self.output_ids.append(tok)
            self.output_logprobs.append(lp)
            if tops is not None:
                self.output_top_logprobs.append(tops[i])
            taken.append(tok)
            if self.t_first_token is None:
                self.t_first_token = time.perf_counter()
            self.finish_reason = self._stop_string(tok) or self._grammar_done(tok) or self._stop_reason(tok)
        return taken

    def _commit_ids(self, tokens: list[int], logprobs: list[float]) -> list[int]:
        """``commit`` of a request whose stop conditions are its stop and EOS tokens and its length only (no stop
        strings, grammar or top log-probabilities, its first token out): the same tokens and finish reason,
        the run cut in one scan and appended at once (a decode step commits for every request)."""
        if self.finish_reason is not None:
            return []
        room = max(self.params.max_new_tokens - len(self.output_ids), 1)  # the first token always goes in
        n = min(len(tokens), len(logprobs), room)
        stops, eos = self.params.stop_token_ids, () if self.params.ignore_eos else self.eos_ids
        reason = "length" if n == room else None
        for i in range(n):
            if tokens[i] in stops or tokens[i] in eos:
                n, reason = i + 1, "stop"
                break
        taken = list(tokens[:n])
        self.output_ids.extend(taken)
        self.output_logprobs.extend(logprobs[:n])
        self.finish_reason = reason
        return taken

    def advance(self, kv_len: int) -> None:
        """The target K/V of positions [0, kv_len) is cached (a prefill chunk or a decode token ran)."""
        self.kv_len = kv_len

    def resume_from(self, state: DraftState) -> None:
        """The next decode step drafts from ``state``; its committed length is the cached length."""
        self.kv_len = state.committed_len
        self.draft_state = state

    def receive(self, committed_len: int, state: DraftState | None, output_ids: list[int] = (),
                output_logprobs: list[float] = ()) -> None:
        """A hand-off arrived: ``committed_len`` positions of K/V, the output tokens the reservation did not
        name yet (the first token of a hand-off that began with the prefill) and, with a draft, its state
        (whose seed the request's draws go on hashing)."""
        self.output_ids.extend(output_ids)
        self.output_logprobs.extend(output_logprobs)
        if self.text is not None and output_ids:  # the stop-string watch sees every output token, in order
            self.text.push(list(output_ids))
        for tok in output_ids if self.grammar is not None else ():  # so does the grammar
            self.grammar.advance(tok)
        self.advance(committed_len)
        if state is not None:
            self.resume_from(state)
            if state.seed is not None:  # the prefill side's: an unseeded request keeps its random one
                self.seed = state.seed
        self.t_first_token = self.t_first_token or time.perf_counter()

    def end(self, reason: str | None = None) -> None:
        """The request ends now: with ``reason`` (abort, handed_off, error) unless a stop condition
        ended it first."""
        self.finish_reason = self.finish_reason or reason
        self.t_finish = time.perf_counter()

    @property
    def stop_str(self) -> str | None:
        """The stop string that ended the request, if one did."""
        return self.text.matched if self.text is not None else None

    def _stop_string(self, tok: int) -> str | None:
        """``stop`` when ``tok`` completes a stop string in the output text."""
        if self.text is None:
            return None
        self.text.push([tok])
        return "stop" if self.text.matched is not None else None

    def _grammar_done(self, tok: int) -> str | None:
        """``stop`` when the grammar, advanced by ``tok``, has nothing more to match (the JSON value is
        complete); a token the grammar rejects (none is drawn from its mask) ends it too."""
        if self.grammar is None:
            return None
        self.grammar.advance(tok)
        return "stop" if self.grammar.done else None

    def _stop_reason(self, tok: int) -> str | None:
        if tok in self.params.stop_token_ids:
            return "stop"
        if not self.params.ignore_eos and tok in self.eos_ids:
            return "stop"
        if len(self.output_ids) >= self.params.max_new_tokens:
            return "length"
        return None
