"""bench/serving_stack.py: a service that exits while starting fails the caller with its log's last lines (the
reason it gave), not only the log's path, which may not outlive the run (a GPU run's tmp dir)."""

from __future__ import annotations

import os
import time

import pytest

from bench.serving_stack import LOG_TAIL_WIDTH, ROOT, ServiceProcess, log_tail


def test_a_service_that_exits_while_starting_raises_with_its_logs_last_lines(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    missing = tmp_path / "no-model"
    p = ServiceProcess("decode", ["--model", str(missing), "--redis-url", "redis://127.0.0.1:9/0", "--grpc-port",
                                  "0", "--http-port", "0"], env, tmp_path, name="decode-2")
    try:
        with pytest.raises(RuntimeError) as e:
            p.ready(time.monotonic() + 300)
    finally:
        code = p.stop()
    text = str(e.value)
    assert code == 2 and "decode-2 exited with status 2 while starting" in text, text
    assert f"eyrie: error: model: {missing} is not a checkpoint directory" in text, text


def test_the_tail_is_the_last_lines_each_cut_to_a_width(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)) + "y" * (LOG_TAIL_WIDTH + 50) + "\n")
    tail = log_tail(log, 3).splitlines()
    assert tail[:2] == ["line 98", "line 99"] and tail[2] == "y" * LOG_TAIL_WIDTH + " ..."
    assert log_tail(tmp_path / "absent.log").startswith("(log unreadable")
    (tmp_path / "empty.log").write_bytes(b"")
    assert log_tail(tmp_path / "empty.log") == "(log empty)"
