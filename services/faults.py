"""Fault injection for tests: an engine loop held at a state, so a test acts (a kill -9, a stop) at that state
on any machine, however loaded, instead of after a time that a slow machine may overrun.

Off unless ``EYRIE_TEST_HOLD_FILE`` names a gate file. While that file exists, the loop stops stepping as soon
as one of its live requests is at the state ``EYRIE_TEST_HOLD_AT`` names, ``<stage>:<output tokens>`` (default
``decoding:2``: decoding, at least two tokens out, not finished, so it has tokens left to generate). It then
publishes the tokens it holds, writes ``<gate>.held`` (JSON: each such request's id and output tokens) and,
calls still served, steps again once the gate file is gone. A test arms the gate, waits for ``.held``, acts,
and removes the gate (a restarted process is not held).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from shared.request import Stage

HOLD_FILE_ENV, HOLD_AT_ENV = "EYRIE_TEST_HOLD_FILE", "EYRIE_TEST_HOLD_AT"


class HoldGate:
    def __init__(self, gate: str, at: str = "decoding:2"):
        stage, _, tokens = at.partition(":")
        self.gate, self.held_file = Path(gate), Path(gate + ".held")
        self.stage, self.min_tokens = Stage(stage), int(tokens or 0)
        self.holding = False

    @classmethod
    def from_env(cls) -> HoldGate | None:
        gate = os.environ.get(HOLD_FILE_ENV)
        return cls(gate, os.environ.get(HOLD_AT_ENV) or "decoding:2") if gate else None

    def holds(self, engine) -> bool:
        """Whether the loop must not step now (the gate is armed and a request is, or was, at the state)."""
        if not self.gate.exists():
            self.holding = False
            return False
        if self.holding:
            return True
        at = {r.rid: len(r.output_ids) for r in engine.live_requests()
              if r.stage == self.stage and len(r.output_ids) >= self.min_tokens and r.finish_reason is None}
        if at:
            self.holding = True
            tmp = self.held_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(at))
            tmp.replace(self.held_file)  # whole or absent: the test never reads half a file
        return self.holding
