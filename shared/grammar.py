"""Structured output: a request's JSON schema as a token mask, through llguidance.

``check_schema`` turns ``response_format``'s JSON object or JSON schema into the grammar text once and
says what is wrong with a bad one (the router and ``SamplingParams`` call it: INVALID_ARGUMENT / 400
naming the problem). ``GrammarCompiler`` (one per engine) wraps the engine's tokenizer for llguidance and
compiles a request's schema into a ``Grammar``, the request's matcher: it advances by committed tokens
only (``Request.commit``) and, when the matcher has nothing left to match, ends the request (``stop``).

Under speculation each tree node needs the mask of its own grammar state (the committed tokens plus the
node's ancestors below the root, and the node). ``Grammar.node_states`` builds, in node order (parents
come first), a copy of the parent's matcher advanced by the node's token (a copy is ~2 us; the request's
own matcher is never advanced by a speculative token, so nothing needs rolling back); a node the grammar
rejects there is not pruned from the tree: verification rejects it (its probability under the masked
target is 0, greedy or sampled) and its own mask is never read. The draft tree keeps its shape, so every
phase keeps its static shapes.

Masks are packed 32 tokens to an int32 word (llguidance's layout), built on the host, unpacked on the
device by ``unpack_masks`` and applied in ``shared.logits_process`` like ``allowed_token_ids``. The cost,
per step of a batch with a schema: the tree read back to the host, one mask per tree node and request
(all of the batch's in one call on llguidance's thread pool: from tens of microseconds per mask in a
JSON structure to a millisecond or more inside a free string over a 128k vocabulary), a [B, N, V/32]
int32 copy to the device, and an eager verification (no CUDA graph; no draft launched ahead).
"""

from __future__ import annotations

import json
from functools import cached_property

import numpy as np
import torch
from llguidance import LLExecutor, LLMatcher, LLTokenizer

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
        return _fill([self.matcher], self.vocab_size)[0]

    def node_states(self, tokens: list[int], parents: list[int]) -> list[LLMatcher | None]:
        """Per node of a draft tree (node 0, the root, is the last committed token: the committed state),
        a copy of the matcher after the node's path; None for a node the grammar rejects after its
        parent's path, and for its descendants (verification never reaches them). Parents come first
        in node order. The request's own matcher is untouched: it moves only by committed tokens."""
        states: list[LLMatcher | None] = [self.matcher]
        for node in range(1, len(tokens)):
            parent = states[parents[node]]
            state = parent.deep_copy() if parent is not None else None
            states.append(state if state is not None and state.consume_token(tokens[node]) else None)
        states[0] = self.matcher.deep_copy()
        return states

    def node_masks(self, tokens: list[int], parents: list[int]) -> np.ndarray:
        """[N, W] int32 packed masks of a draft tree's nodes, each from its own grammar state; all
        tokens allowed at a node the grammar rejects (never reached: its mask is never read)."""
        return _node_masks([self], [tokens], [parents], self.vocab_size)[0]


EXECUTOR = LLExecutor()  # llguidance's thread pool: a batch's masks are computed in parallel


def _fill(states: list[LLMatcher | None], vocab: int) -> np.ndarray:
    """[len(states), W] int32 packed masks, all in one parallel call; all bits set for a missing state
    and where a state allows nothing (a failed matcher: leave the logits be)."""
    out = np.full((len(states), mask_words(vocab)), -1, dtype=np.int32)
    jobs = [(m, i) for i, m in enumerate(states) if m is not None]
    if jobs:
        EXECUTOR.unsafe_compute_mask_ptr(jobs, out.ctypes.data, out.shape[1] * 4, out.shape[0])
    out[~out.any(axis=1)] = -1
    return out


def _node_masks(grammars: list[Grammar], tokens: list[list[int]], parents: list[list[int]],
                vocab: int) -> np.ndarray:
    """[len(grammars), N, W] packed node masks of each request's tree."""
    states = [s for g, t, p in zip(grammars, tokens, parents) for s in g.node_states(t, p)]
    return _fill(states, vocab).reshape(len(grammars), len(tokens[0]) if tokens else 0, -1)


def grammar_masks(grammars: list[Grammar | None], tokens: list[list[int]] | None, parents: list[list[int]] | None,
                  vocab: int, rows: int, device: torch.device | str) -> torch.Tensor:
    """[rows, N, W] int32 packed masks on the device: per request its tree's nodes (``tokens``,
    ``parents`` [B][N]; None: one node, the committed state), all-allowed for requests without a
    grammar and padding rows. Every mask of the batch is computed in one parallel call."""
    n = len(tokens[0]) if tokens else 1
    host = np.full((rows, n, mask_words(vocab)), -1, dtype=np.int32)
    have = [b for b, g in enumerate(grammars) if g is not None]
    if have:
        trees = ([tokens[b] for b in have], [parents[b] for b in have]) if tokens else (
            [[0]] * len(have), [[-1]] * len(have))
        host[have] = _node_masks([grammars[b] for b in have], *trees, vocab)
    return torch.from_numpy(host).to(device)
