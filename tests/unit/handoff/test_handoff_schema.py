"""The hand-off schema: built from real engines, equal for equal configurations, and every difference
refused with a message naming both sides' values (SGLang #17212: a prefill without speculation feeding
a decode with speculation must be refused, not silently wrong)."""

from __future__ import annotations

import dataclasses

import pytest
from handoff_helpers import engine_config, load_models, make_engine

from shared.config import SpecConfig
from shared.engine import Engine
from shared.handoff import SCHEMA_VERSION, CacheShape, HandoffSchema, SchemaMismatch


@pytest.fixture(scope="module")
def models(oracle_model_dir):
    return load_models(oracle_model_dir)


def schema(models, draft, **config) -> HandoffSchema:
    topk = config.pop("topk", 1)
    return make_engine(models, draft, engine_config(draft, topk, **config)).handoff_schema()


def mismatch(decode: HandoffSchema, prefill: HandoffSchema) -> str:
    with pytest.raises(SchemaMismatch) as err:
        decode.check(prefill)
    return str(err.value)


def test_schema_from_an_engine_describes_what_travels(models):
    s = schema(models, "mtp", topk=4, page_size=16)
    target = models.target.config
    mtp = models.drafts["mtp"]
    assert s.version == SCHEMA_VERSION and s.page_size == 16 and s.dtype == "float32"
    assert s.caches[0] == CacheShape(target.num_hidden_layers, target.num_key_value_heads, target.head_dim)
    assert len(s.caches) == 1 + 3  # the multi-layer draft: one cache per step
    assert (s.draft_kind, s.topk, s.steps, s.num_draft_tokens) == ("mtp", 4, 3, 8)
    assert s.draft_hidden_width == mtp.hidden_width and s.vocab_size == target.vocab_size
    assert HandoffSchema.from_pb(s.to_pb()) == s
    s.check(schema(models, "mtp", topk=4, page_size=16))  # the same configuration agrees


def test_prefill_without_speculation_is_refused_by_a_speculative_decode(models):
    words = mismatch(schema(models, "eagle"), schema(models, None))
    assert "speculative config: decode has eagle (topk=1, steps=3, num_draft_tokens=4), prefill has none" in words
    assert "number of KV caches (target + draft): decode has 2, prefill has 1" in words
    assert "draft_hidden_width: decode has" in words and "prefill has 0" in words
    assert "prefill has eagle" in mismatch(schema(models, None), schema(models, "eagle"))  # and the other way


@pytest.mark.parametrize("decode, prefill, words", [
    (dict(draft="eagle", topk=4), dict(draft="eagle", topk=1),
     "speculative config: decode has eagle (topk=4, steps=3, num_draft_tokens=8), prefill has eagle (topk=1, steps=3, "
     "num_draft_tokens=4)"),
    (dict(draft="eagle", page_size=16), dict(draft="eagle", page_size=1), "page_size: decode has 16, prefill has 1"),
    (dict(draft="eagle3"), dict(draft="eagle"), "speculative config: decode has eagle3"),
    (dict(draft="mtp"), dict(draft="eagle"), "number of KV caches (target + draft): decode has 4, prefill has 2"),
])
def test_engine_configurations_that_differ_are_refused_naming_both_sides(models, decode, prefill, words):
    assert words in mismatch(schema(models, **decode), schema(models, **prefill))


def test_dtype_and_steps_differences_are_refused(models, oracle_model_dir):
    bf16 = Engine(oracle_model_dir / "target", config=engine_config(None, dtype="bfloat16"), role="decode")
    assert "dtype: decode has bfloat16, prefill has float32" in mismatch(bf16.handoff_schema(),
                                                                        schema(models, None))
    five = make_engine(models, "eagle", engine_config("eagle").model_copy(update={"spec": SpecConfig(steps=5,
                                                                                   num_draft_tokens=6)}))
    assert "steps=5" in mismatch(five.handoff_schema(), schema(models, "eagle"))


TARGET, DRAFT = CacheShape(2, 2, 16), CacheShape(1, 2, 16)


@pytest.mark.parametrize("change, words", [
    (dict(draft_hidden_width=192), "draft_hidden_width: decode has 64, prefill has 192"),
    (dict(caches=(CacheShape(3, 2, 16), DRAFT)), "target cache num_layers: decode has 2, prefill has 3"),
    (dict(caches=(TARGET, CacheShape(1, 4, 16))), "draft cache 0 num_kv_heads: decode has 2, prefill has 4"),
    (dict(caches=(TARGET, CacheShape(1, 2, 32))), "draft cache 0 head_dim: decode has 16, prefill has 32"),
    (dict(vocab_size=1000), "vocab_size: decode has 512, prefill has 1000"),
    (dict(version=SCHEMA_VERSION + 1), f"version: decode has {SCHEMA_VERSION}, prefill has {SCHEMA_VERSION + 1}"),
])
def test_widths_layer_counts_and_versions_that_differ_are_refused(change, words):
    mine = HandoffSchema(version=SCHEMA_VERSION, page_size=16, dtype="float32",
                         caches=(TARGET, DRAFT), draft_kind="eagle", topk=1, steps=3,
                         num_draft_tokens=4, draft_hidden_width=64, vocab_size=512)
    theirs = dataclasses.replace(mine, **change)
    assert words in mismatch(mine, theirs)
    assert len(mine.differences(theirs)) == 1  # only the changed field is named
