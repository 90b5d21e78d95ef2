"""services/mps.py: when a private MPS daemon is started, what environment reaches the services, and that it
is stopped and cleaned up. A stand-in control binary (a shell script) records how it was called."""

import os
import stat

import pytest

from services.mps import start_mps, want_mps


def fake_control(tmp_path, rc: int = 0):
    """A control binary that logs its arguments, its stdin and its pipe directory to calls.log."""
    log = tmp_path / "calls.log"
    path = tmp_path / "nvidia-cuda-mps-control"
    path.write_text(f"#!/bin/sh\necho \"args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY\" >> {log}\n"
                    f"if [ -z \"$1\" ]; then cat >> {log}; fi\necho oops >&2\nexit {rc}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path), log


def test_want_mps_only_on_cuda_when_asked_and_available(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    control, _ = fake_control(tmp_path)
    assert want_mps("auto", "cuda", control) == control
    assert want_mps("on", "cuda:0", control) == control
    assert want_mps("off", "cuda", control) is None
    assert want_mps("auto", "cpu", control) is None
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert want_mps("auto", "cuda") is None  # no binary: the services take turns, nothing fails
    with pytest.raises(ValueError, match="mps: on, but nvidia-cuda-mps-control is not on the PATH"):
        want_mps("on", "cuda")
    with pytest.raises(ValueError, match="mps: one of auto, on, off"):
        want_mps("sometimes", "cuda")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/tmp/someone-elses")
    assert want_mps("auto", "cuda", control) is None  # a daemon the user runs: use it, start none


def test_start_and_stop_a_private_daemon(tmp_path):
    control, log = fake_control(tmp_path)
    daemon = start_mps(control)
    env = daemon.env
    assert env["CUDA_MPS_PIPE_DIRECTORY"].startswith(str(daemon.root)) and os.path.isdir(env["CUDA_MPS_PIPE_DIRECTORY"])
    assert os.path.isdir(env["CUDA_MPS_LOG_DIRECTORY"])
    assert f"args=-d pipe={env['CUDA_MPS_PIPE_DIRECTORY']}" in log.read_text()
    daemon.stop()
    calls = log.read_text()
    assert f"args= pipe={env['CUDA_MPS_PIPE_DIRECTORY']}" in calls and "quit" in calls  # quit, on its own pipe
    assert not daemon.root.exists()


def test_a_daemon_that_does_not_start_is_named_and_leaves_nothing(tmp_path):
    control, _ = fake_control(tmp_path, rc=3)
    before = set(os.listdir(os.environ.get("TMPDIR", "/tmp")))
    with pytest.raises(RuntimeError, match="exited with status 3: oops"):
        start_mps(control)
    after = {p for p in set(os.listdir(os.environ.get("TMPDIR", "/tmp"))) - before if p.startswith("eyrie-mps-")}
    assert not after
