"""The hand-off schema: what a request's hand-off carries, which both sides must agree on exactly.

A prefill instance and a decode instance exchange their schemas before any page moves (Decode.Handshake,
and again in Decode.Reserve). Every field decides how the bytes are read: the page size and dtype
give the layout of a page, the per-cache shapes how many layers / heads / widths travel, and the
speculative config and draft widths what the draft state means. A difference in any of them is refused
with a message naming both sides' values: SGLang #17212 let a prefill without speculation feed a decode
with speculation, and the answers were silently wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from proto.eyrie.v1 import eyrie_pb2 as pb
from shared.handoff.wire import kv_page_bytes
from shared.spec.state import SCHEMA_VERSION


class SchemaMismatch(ValueError):
    """The two sides of a hand-off disagree; the message names every differing field and both values."""


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __str__(self) -> str:
        return f"{self.num_layers} layers x {self.num_kv_heads} kv heads x {self.head_dim} head dim"


@dataclass(frozen=True)
class HandoffSchema:
    version: int
    page_size: int
    dtype: str
    caches: tuple[CacheShape, ...]  # target first, then each draft cache
    draft_kind: str  # "" (no draft) | eagle | eagle3 | mtp
    topk: int  # the speculative config (0 without a draft)
    steps: int
    num_draft_tokens: int
    draft_hidden_width: int  # the width of DraftState.hidden (the draft's recurrent width), 0 without a draft
    vocab_size: int

    @classmethod
    def build(cls, caches: list, page_size: int, dtype: str, vocab_size: int, draft_kind: str = "", tree=None,
              draft_hidden_width: int = 0) -> HandoffSchema:
        """The schema of an engine's hand-offs: ``caches`` are its caches' ``CacheLayout`` (target first),
        ``tree`` its ``SpecConfig`` (None without a draft)."""
        return cls(version=SCHEMA_VERSION, page_size=page_size, dtype=dtype,
                   caches=tuple(CacheShape(c.num_layers, c.num_kv_heads, c.head_dim) for c in caches),
                   draft_kind=draft_kind, topk=tree.topk if tree else 0, steps=tree.steps if tree else 0,
                   num_draft_tokens=tree.num_draft_tokens if tree else 0, draft_hidden_width=draft_hidden_width,
                   vocab_size=vocab_size)

    def page_bytes(self) -> list[int]:
        """Per cache (target first), K + V bytes of one page of one layer."""
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return [kv_page_bytes(self.page_size, c.num_kv_heads, c.head_dim, itemsize) for c in self.caches]

    # ---- the wire ----------------------------------------------------------------------------
    def to_pb(self) -> pb.HandoffSchema:
        return pb.HandoffSchema(
            version=self.version, page_size=self.page_size, dtype=self.dtype,
            caches=[pb.CacheShape(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim)
                    for c in self.caches],
            spec=pb.SpecConfig(draft_kind=self.draft_kind, topk=self.topk, steps=self.steps,
                               num_draft_tokens=self.num_draft_tokens),
            draft_hidden_width=self.draft_hidden_width, vocab_size=self.vocab_size)

    @classmethod
    def from_pb(cls, msg: pb.HandoffSchema) -> HandoffSchema:
        return cls(version=msg.version, page_size=msg.page_size, dtype=msg.dtype,
                   caches=tuple(CacheShape(c.num_layers, c.num_kv_heads, c.head_dim) for c in msg.caches),
                   draft_kind=msg.spec.draft_kind, topk=msg.spec.topk, steps=msg.spec.steps,
                   num_draft_tokens=msg.spec.num_draft_tokens, draft_hidden_width=msg.draft_hidden_width,
                   vocab_size=msg.vocab_size)

    # ---- agreement ---------------------------------------------------------------------------
    @property
    def spec_description(self) -> str:
        if not self.draft_kind:
            return "none (no speculative decoding)"
        return f"{self.draft_kind} (topk={self.topk}, steps={self.steps}, num_draft_tokens={self.num_draft_tokens})"

    def differences(self, other: HandoffSchema, me: str = "decode", them: str = "prefill") -> list[str]:
        """One line per differing field: ``field: <me> has X, <them> has Y``."""
        diffs = []

        def differ(name: str, a, b) -> None:
            if a != b:
                diffs.append(f"{name}: {me} has {a}, {them} has {b}")

        differ("version", self.version, other.version)
        differ("speculative config", self.spec_description, other.spec_description)
        differ("page_size", self.page_size, other.page_size)
        differ("dtype", self.dtype, other.dtype)
        differ("number of KV caches (target + draft)", len(self.caches), len(other.caches))
        for i, (a, b) in enumerate(zip(self.caches, other.caches)):
            name = "target cache" if i == 0 else f"draft cache {i - 1}"
            for field in ("num_layers", "num_kv_heads", "head_dim"):
                differ(f"{name} {field}", getattr(a, field), getattr(b, field))
        differ("draft_hidden_width", self.draft_hidden_width, other.draft_hidden_width)
        differ("vocab_size", self.vocab_size, other.vocab_size)
        return diffs

    def check(self, other: HandoffSchema, me: str = "decode", them: str = "prefill") -> None:
        """Raise SchemaMismatch naming every differing field with both sides' values."""
        diffs = self.differences(other, me, them)
        if diffs:
            raise SchemaMismatch("hand-off schema mismatch: " + "; ".join(diffs))
