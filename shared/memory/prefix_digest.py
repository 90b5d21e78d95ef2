"""What an instance's prefix cache holds, as the router sees it: chained page digests (issue 33, prefix-aware
placement).

**The digest.** A cached page is keyed in the engine (``shared/memory/prefix_cache.py``) by its parent page, its
tokens and, with a draft, the token after it (the successor). Its digest follows the same chain: the first 8
bytes of blake2b over the parent's digest (8 zero bytes for a prompt's first page), the successor (-1 without a
draft) and the page's token ids, each a signed 64-bit integer. The engine computes a page's digest once, when
the page is cached; the router computes a prompt's from its token ids (``prompt_digests``), so both sides agree
without sharing anything but the page size and whether the successor is part of the key.

**The summary.** An instance publishes the digests of its most recently used cached pages (at most a bound:
the registry entry stays small), with its page size, the successor rule and a version that changes whenever
the cache gains or loses a page (``PrefixSummary``). The router counts, per instance, the leading pages of a
prompt the summary holds. A digest routes only: a stale summary or a collision costs a miss (the instance
computes what it lacks), never an output token (the engine's own lookup compares tokens, not digests).
"""

from __future__ import annotations

import base64
import hashlib
import json
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

DIGEST_BYTES = 8
ROOT = bytes(DIGEST_BYTES)  # a prompt's first page's parent


def page_digest(parent: bytes, page: Sequence[int], successor: int) -> bytes:
    """The digest of a page of ``page`` tokens under ``parent`` (a digest, or ``ROOT``), followed by
    ``successor`` (-1 when the key has none)."""
    data = array("q", (successor, *page)).tobytes()
    return hashlib.blake2b(parent + data, digest_size=DIGEST_BYTES).digest()


def iter_prompt_digests(tokens: Sequence[int], page_size: int, successor: bool) -> Iterator[bytes]:
    """The digests of the pages of ``tokens`` a cache could serve, one at a time (a match that stops early
    computes no more): the full pages before the prompt's last token (it is always computed), so with the
    successor rule the token after each page is known."""
    parent = ROOT
    for i in range((len(tokens) - 1) // page_size):
        succ = tokens[(i + 1) * page_size] if successor else -1
        parent = page_digest(parent, tokens[i * page_size:(i + 1) * page_size], succ)
        yield parent


def prompt_digests(tokens: Sequence[int], page_size: int, successor: bool) -> list[bytes]:
    """Every digest ``iter_prompt_digests`` gives."""
    return list(iter_prompt_digests(tokens, page_size, successor))


@dataclass(frozen=True)
class PrefixSummary:
    """An instance's published cache summary: the digests of (at most a bound of) its cached pages, most
    recently used first, with the page size and successor rule they were computed under."""

    version: int  # changes whenever the cache gains or loses a page
    page_size: int
    successor: bool
    digests: tuple[bytes, ...]

    def to_json(self) -> str:
        packed = base64.b64encode(b"".join(self.digests)).decode("ascii")
        return json.dumps({"version": self.version, "page_size": self.page_size, "successor": self.successor,
                           "digests": packed})

    @classmethod
    def from_json(cls, raw: str) -> PrefixSummary:
        """The summary ``raw`` (``to_json``'s), or ValueError naming what is wrong with it."""
        try:
            d = json.loads(raw)
            packed = base64.b64decode(d["digests"], validate=True)
            version, page_size, successor = int(d["version"]), int(d["page_size"]), bool(d["successor"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"a malformed prefix summary: {e}") from None
        if page_size < 1 or len(packed) % DIGEST_BYTES:
            raise ValueError(f"a malformed prefix summary: page size {page_size}, {len(packed)} digest bytes")
        digests = tuple(packed[i:i + DIGEST_BYTES] for i in range(0, len(packed), DIGEST_BYTES))
        return cls(version, page_size, successor, digests)


def leading_pages(held: frozenset[bytes] | set[bytes], digests: Iterable[bytes]) -> int:
    """How many of a prompt's leading page ``digests`` are in ``held`` (the run stops at the first miss)."""
    n = 0
    for d in digests:
        if d not in held:
            break
        n += 1
    return n
