"""The llguidance adapter (shared/grammar.py): schema checks, per-node tree masks from each node's own
grammar state, rollback to the committed state, packing, and the request's end at a complete value."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from shared.grammar import GrammarCompiler, check_schema, grammar_masks, mask_words, unpack_masks
from shared.model.default_pair import DEFAULT_DIR
from shared.model.tokenizer import Tokenizer
from shared.request import Request
from shared.sampling import SamplingParams

TOKENIZER_DIR = DEFAULT_DIR / "target"  # the tiny pair's byte-level BPE (2048 ids), in the repository
SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                      "n": {"type": "integer", "minimum": 0, "maximum": 99}},
                     "required": ["name", "n"], "additionalProperties": False})


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(TOKENIZER_DIR)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, 2048, (1,))


def allowed(packed: np.ndarray) -> set[int]:
    return set(np.nonzero(unpack_masks(torch.from_numpy(packed), 2048).numpy())[0].tolist())


@pytest.mark.parametrize("schema,problem", [
    ("{not json", "not valid JSON"), ("[1, 2]", "must be a JSON object"),
    ('{"type": "objekt"}', "objekt"), ('{"$ref": "#/nowhere"}', "nowhere")])
def test_a_bad_schema_is_refused_naming_the_problem(schema, problem):
    with pytest.raises(ValueError, match=problem):
        check_schema(schema)
    with pytest.raises(ValueError, match=problem):
        SamplingParams(json_schema=schema)


def test_unpack_matches_llguidance_bit_order():
    packed = np.array([[0b1011, -1, 0, -(1 << 31)]], dtype=np.int32)  # the last: bit 31 only
    got = unpack_masks(torch.from_numpy(packed), 120)[0]
    want = np.unpackbits(packed.view(np.uint8), bitorder="little")[:120].astype(bool)
    assert got.tolist() == want.tolist()
    assert got[:4].tolist() == [True, True, False, True] and got[64:96].sum() == 0 and got[96:].tolist() == [False] * 24


def test_each_tree_node_gets_the_mask_of_its_own_prefix(compiler, tokenizer):
    """A tree of two JSON continuations sharing a prefix (nodes interleaved as a draft creates them),
    a node the grammar rejects and its child: every reachable node's mask is that of a fresh matcher fed
    the committed tokens and the node's path; the matcher ends in the committed state."""
    committed = tokenizer.encode('{"name": "')
    a, b = tokenizer.encode('ab", "n'), tokenizer.encode('x", "n')
    assert len(a) >= 3 and len(b) >= 3
    bad = tokenizer.encode("\n")[0]  # a raw newline: never inside a JSON string
    # Node 0 is the root (the last committed token); then level by level, as the draft creates them.
    tokens = [committed[-1], a[0], b[0], bad, a[1], b[1], 5, a[2], b[2]]
    parents = [-1, 0, 0, 0, 1, 2, 3, 4, 5]
    g = compiler.compile(SCHEMA)
    for t in committed:
        assert g.advance(t)
    before = g.mask()
    masks = g.node_masks(tokens, parents)
    assert np.array_equal(g.mask(), before)  # rolled back to the committed state
    for node in range(len(tokens)):
        path, m = [], node
        while m > 0:
            path.insert(0, tokens[m])
            m = parents[m]
        if node in (3, 6):  # rejected by its parent's mask, and its child: never reached, all allowed
            assert bad not in allowed(masks[0]) and np.all(masks[node] == -1)
            continue
        fresh = compiler.compile(SCHEMA)
        assert all(fresh.advance(t) for t in committed + path)
        assert np.array_equal(masks[node], fresh.mask()), node
    assert allowed(masks[7]) != allowed(masks[0])  # the string closed on that path: the masks differ


def test_grammar_masks_pad_with_all_allowed_rows(compiler, tokenizer):
    g = compiler.compile(SCHEMA)
    out = grammar_masks([None, g], None, None, 2048, 3, "cpu")
    assert out.shape == (3, 1, mask_words(2048))
    assert torch.all(out[0] == -1) and torch.all(out[2] == -1)
    assert allowed(out[1, 0].numpy()) == {tokenizer.encode("{")[0]}  # an object starts with '{'


def test_a_request_ends_when_its_value_is_complete(compiler, tokenizer):
    params = SamplingParams(json_schema=SCHEMA, max_new_tokens=40)
    req = Request(rid="r", prompt_ids=[3], params=params, grammar=compiler.compile(SCHEMA))
    ids = tokenizer.encode('{"name": "ab", "n": 7}')
    taken = req.commit(ids + [5, 6], [0.0] * (len(ids) + 2))
    assert taken == ids and req.finish_reason == "stop"  # nothing after the closing brace
    assert json.loads(tokenizer.decode(req.output_ids)) == {"name": "ab", "n": 7}


def test_a_cached_schema_gives_independent_matchers(compiler, tokenizer):
    first = compiler.compile(SCHEMA)
    start = first.mask()
    assert first.advance(tokenizer.encode("{")[0])
    second = compiler.compile(SCHEMA)  # from the cache: in the initial state, whatever the first did
    assert np.array_equal(second.mask(), start) and not np.array_equal(first.mask(), start)
