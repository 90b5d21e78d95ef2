"""Prefix-aware placement (issue 33): a prompt goes where its leading pages are cached, within a bound on
imbalance.

An instance with a prefix cache publishes, with its heartbeat, the chained digests of its most recently used
cached pages (``shared/memory/prefix_digest.py``; ``instance:{id}:prefix`` in Redis, its version in the
instance's entry). The router reads a summary once per version, computes the prompt's page digests under the
instance's page size and successor rule (with a draft a page counts only when the token after it is in the
prompt), and counts the leading pages the instance holds (``PrefixIndex.matches``). ``LoadLedger.choose_prefix``
then picks, among the instances whose load is within ``prefix_balance_tokens`` of the least loaded one's, the
one with the least load less the prompt tokens it holds: a long match outweighs a little more load, never more
than the bound. With no summary published (no instance caches prefixes) the choice is the least loaded one, as
without this module.

The summaries route only: one that is stale, missing (Redis lost it, the instance restarted) or unreadable
costs a miss, never an output token; the instance's engine looks its cache up itself, token by token.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

from services.metadata import InstanceInfo, Registry
from services.router.records import REDIS_DOWN
from shared.memory.prefix_digest import PrefixSummary, iter_prompt_digests, leading_pages


class PromptDigests:
    """A prompt's page digests under one page size and successor rule (``iter_prompt_digests``), kept as far as
    they were read, for every instance that uses the rule (a match that stops at the first page costs one)."""

    def __init__(self, tokens: Sequence[int], page_size: int, successor: bool):
        self._next = iter_prompt_digests(tokens, page_size, successor)
        self._done: list[bytes] = []

    def __iter__(self) -> Iterator[bytes]:
        yield from self._done
        for digest in self._next:  # the next page's, read for the first time
            self._done.append(digest)
            yield digest


class PrefixIndex:
    """The instances' published prefix cache summaries as this router last read them: each read from Redis once
    per version (the instance's registry entry names it) and kept as a set of digests. Thread-safe (placements
    run on the router's I/O threads)."""

    def __init__(self, registry: Registry):
        self.registry = registry
        self._lock = threading.Lock()
        # instance id -> (its role, the version read, the summary, its digests as a set)
        self._held: dict[str, tuple[str, int, PrefixSummary, frozenset[bytes]]] = {}

    def summary(self, inst: InstanceInfo) -> tuple[PrefixSummary, frozenset[bytes]] | None:
        """``inst``'s summary and its digests, or None (it publishes none, or it cannot be read now)."""
        if inst.prefix_version is None:
            return None
        with self._lock:
            kept = self._held.get(inst.instance_id)
        if kept is not None and kept[1] == inst.prefix_version:
            return kept[2], kept[3]
        try:
            raw = self.registry.summary(inst.instance_id)
        except REDIS_DOWN:
            raw = None
        summary = None
        if raw is not None:
            try:
                summary = PrefixSummary.from_json(raw)
            except ValueError:
                summary = None  # an instance of another build: no prefix preference for it
        if summary is None:  # keep what was read before: a stale summary costs a miss at worst
            return None if kept is None else (kept[2], kept[3])
        held = frozenset(summary.digests)
        with self._lock:
            self._held[inst.instance_id] = (inst.role, inst.prefix_version, summary, held)
        return summary, held

    def held(self, live: list[InstanceInfo]) -> bool:
        """True when ``matches`` needs no Redis read for ``live``: every summary they publish was read at the
        version they name."""
        with self._lock:
            return all(i.prefix_version is None or
                       (kept := self._held.get(i.instance_id)) is not None and kept[1] == i.prefix_version
                       for i in live)

    def matches(self, role: str, live: list[InstanceInfo], tokens: Sequence[int]) -> dict[str, int]:
        """Per instance of ``live`` (all of ``role``) that publishes a summary, the leading prompt tokens of
        ``tokens`` it holds cached (whole pages); {} when none publishes one. Forgets the summaries of
        instances of ``role`` no longer live."""
        ids = {i.instance_id for i in live}
        with self._lock:
            for gone in [k for k, v in self._held.items() if v[0] == role and k not in ids]:
                del self._held[gone]
        digests: dict[tuple[int, bool], PromptDigests] = {}
        out = {}
        for inst in live:
            got = self.summary(inst)
            if got is None:
                continue
            summary, held = got
            rule = (summary.page_size, summary.successor)
            if rule not in digests:
                digests[rule] = PromptDigests(tokens, *rule)
            out[inst.instance_id] = leading_pages(held, digests[rule]) * summary.page_size
        return out
