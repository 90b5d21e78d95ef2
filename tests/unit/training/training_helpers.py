"""Helpers of the training tests: every position's logits from the engine's own forward."""

from __future__ import annotations

from tests.unit.engine.engine_checks import eyrie_logits as engine_logits  # noqa: F401 (re-exported)


