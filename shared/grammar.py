"""Structured output: a request's JSON schema as a token mask, through llguidance.

``check_schema`` turns ``response_format``'s JSON object or JSON schema into the grammar text once and
says what is wrong with a bad one (the router and ``SamplingParams`` call it: INVALID_ARGUMENT / 400
naming the problem). ``GrammarCompiler`` (one per engine) wraps the engine's tokenizer for llguidance and
compiles a request's schema into a ``Grammar``, the request's matcher: it advances by committed tokens
only (``Request.commit``) and, when the matcher has nothing left to match, ends the request (``stop``).

Under speculation each tree node needs the mask of its own grammar state (the committed tokens plus the
node's ancestors below the root, and the node). ``Grammar.node_masks`` walks the tree in node order
(parents come first) on a copy of the request's matcher, consuming each node's path and rolling back to
the common prefix of the next one; a node whose token its parent's mask rejects is not pruned from the tree,
verification rejects it (its probability under the masked target is 0) and its own mask is never read.

Masks are packed 32 tokens to an int32 word (llguidance's layout), built on the host, unpacked on the
device by ``unpack_masks`` and applied in ``shared.logits_process`` like ``allowed_token_ids``. The cost:
one host-side mask per tree node and request with a grammar per step (llguidance's mask computation is
tens of microseconds for a JSON schema), plus a [B, N, V/32] int32 copy to the device.
"""

from __future__ import annotations

import json
from functools import cached_property

import numpy as np
import torch
from llguidance import LLMatcher, LLTokenizer

from shared.model.tokenizer import Tokenizer

ANY_JSON_OBJECT = '{"type": "object"}'  # response_format {"type": "json_object"}
# One layout per value: no free whitespace (a model cannot spend its tokens on blank lines), Python's
# json.dumps separators. A schema's own "x-guidance" options override these.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def check_schema(schema: str) -> str:
    """The llguidance grammar of JSON schema text; ValueError naming the problem when it is no schema."""
    try:
        parsed = json.loads(schema)
    except json.JSONDecodeError as e:
        raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise ValueError("the JSON schema must be a JSON object")
    try:
        grammar = LLMatcher.grammar_from_json_schema(parsed, defaults=JSON_LAYOUT)
    except ValueError as e:
        raise ValueError(f"the JSON schema is not usable: {e}") from None
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"the JSON schema is not supported: {messages[0]}")
    return grammar


def mask_words(vocab: int) -> int:
    """int32 words of one packed mask over ``vocab`` tokens."""
    return (vocab + 31) // 32


def unpack_masks(packed: torch.Tensor, vocab: int) -> torch.Tensor:
    """[..., W] int32 packed masks -> [..., vocab] bool allowed tokens (bit t % 32 of word t // 32)."""
    bits = torch.arange(32, dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(-1) >> bits) & 1).bool().flatten(-2)[..., :vocab]


class GrammarCompiler:
    """One engine's tokenizer as llguidance sees it (built on first use: it costs a few ms to 1 s)."""

    CACHED = 64  # schemas whose compiled matcher is kept (clients tend to send the same few)

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's: may exceed the tokenizer's (those ids never match)
        self.eos_ids = eos_ids
        self._compiled: dict[str, LLMatcher] = {}  # schema text -> a matcher in its initial state, never advanced

    @cached_property
    def ll_tokenizer(self) -> LLTokenizer:
        return LLTokenizer(self.tokenizer.to_json(), n_vocab=self.vocab_size, eos_token=list(self.eos_ids) or None)

    def compile(self, schema: str) -> Grammar:
        """A fresh matcher of ``schema`` (checked by ``check_schema``); ValueError when it cannot be built.
        A schema seen lately is copied (microseconds) rather than compiled again (milliseconds)."""
        initial = self._compiled.get(schema)
        if initial is None:
            initial = LLMatcher(self.ll_tokenizer, check_schema(schema), log_level=0)
            if initial.is_error():
                raise ValueError(f"the JSON schema is not supported: {initial.get_error()}")
            if len(self._compiled) >= self.CACHED:
                del self._compiled[next(iter(self._compiled))]  # the oldest
            self._compiled[schema] = initial
        return Grammar(initial.deep_copy(), self.vocab_size)


class Grammar:
    """A request's matcher: in the state after its committed output tokens, between calls."""

    def __init__(self, matcher: LLMatcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size

    def advance(self, token: int) -> bool:
        """Consume a committed token; False when the grammar rejects it (the matcher is then in error)."""
        return self.matcher.consume_token(token)

    @property
    def done(self) -> bool:
        """Nothing more to match (the schema's value is complete, or the matcher failed)."""
        return self.matcher.is_stopped()

    def mask(self) -> np.ndarray:
        """[W] int32 packed mask of the tokens allowed next."""
        # llguidance may pad its mask by a word: keep the vocabulary's
        out = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.int32)[:mask_words(self.vocab_size)].copy()
        return out if out.any() else np.full_like(out, -1)  # nothing allowed (a failed matcher): leave be

    def node_masks(self, tokens: list[int], parents: list[int]) -> np.ndarray:
        """[N, W] int32 packed masks of a draft tree's nodes (node 0, the root, is the last committed
        token: its mask is the committed state's). A node its parent's mask rejects gets an all-allowed
        mask (verification never reaches it), as do its descendants. The walk runs on a copy: the request's
        matcher moves only by committed tokens (``advance``)."""
        walker = Grammar(self.matcher.deep_copy(), self.vocab_size)
        n = len(tokens)
        out = np.full((n, mask_words(self.vocab_size)), -1, dtype=np.int32)
        paths: list[list[int] | None] = [[]]  # per node: its ancestors below the root and itself (None: rejected)
        path: list[int] = []  # the nodes the matcher has consumed, root to leaf
        for node in range(n):
            if node > 0:
                parent = parents[node]
                word, bit = divmod(tokens[node], 32)
                allowed = paths[parent] is not None and (int(out[parent, word]) >> bit) & 1
                paths.append(paths[parent] + [node] if allowed else None)
                if not allowed:
                    continue
            path = walker._move(path, paths[node], tokens)
            out[node] = walker.mask()
        return out

    def _move(self, path: list[int], want: list[int], tokens: list[int]) -> list[int]:
        """From the state after tree nodes ``path`` to the state after ``want``: roll back to their
        common prefix, consume the rest."""
        keep = 0
        while keep < min(len(path), len(want)) and path[keep] == want[keep]:
            keep += 1
        self.matcher.rollback(len(path) - keep)
        for m in want[keep:]:
            if not self.matcher.consume_token(tokens[m]):
                raise RuntimeError(f"llguidance refused token {tokens[m]} that its mask allowed")
        return want


def grammar_masks(grammars: list[Grammar | None], tokens: list[list[int]] | None, parents: list[list[int]] | None,
                  vocab: int, rows: int, device: torch.device | str) -> torch.Tensor:
    """[rows, N, W] int32 packed masks on the device: per request its tree's nodes (``tokens``,
    ``parents`` [B][N]; None: one node, the committed state), all-allowed for requests without a
    grammar and padding rows."""
    n = len(tokens[0]) if tokens else 1
    host = np.full((rows, n, mask_words(vocab)), -1, dtype=np.int32)
    for b, g in enumerate(grammars):
        if g is not None:
            host[b] = g.mask()[None] if tokens is None else g.node_masks(tokens[b], parents[b])
    return torch.from_numpy(host).to(device)
