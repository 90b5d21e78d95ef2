"""Weight loading tells what it did: one ``weights_loaded`` event per checkpoint with its timing and size,
and no progress bar when stderr is not a terminal; an unreadable weights file is one line naming it."""

from __future__ import annotations

import logging

import pytest

from shared.model.config import CheckpointError
from shared.model.drafts import load_draft
from shared.model.loader import load_target, read_state_dict


def loaded_events(caplog) -> list[dict]:
    return [r.fields for r in caplog.records if getattr(r, "event", None) == "weights_loaded"]


def test_weights_loaded_event_per_checkpoint_with_seconds(tiny_model_dir, caplog, capsys):
    caplog.set_level(logging.INFO, logger="eyrie.weights")
    target = load_target(tiny_model_dir / "target")
    load_draft(tiny_model_dir / "eagle3", target)
    events = loaded_events(caplog)
    assert [e["kind"] for e in events] == ["target", "draft (eagle3)"]
    assert [e["path"] for e in events] == [str(tiny_model_dir / "target"), str(tiny_model_dir / "eagle3")]
    weights = sum(p.numel() * p.element_size() for p in target.parameters())
    assert events[0]["bytes"] == weights and events[0]["tensors"] == len(list(target.parameters()))
    assert all(0 <= e["seconds"] < 60 for e in events)
    assert capsys.readouterr().err == ""  # captured stderr is no terminal: no progress bar


def test_a_corrupt_weights_file_is_a_checkpoint_error_naming_it(tmp_path, tiny_model_dir):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="model.safetensors: cannot read the weights"):
        read_state_dict(bad)
