"""The generated Python beside proto/eyrie/v1/*.proto is current: regenerating gives the same files."""

import subprocess
import sys
from pathlib import Path

from proto.generate import ROOT


def test_regenerating_gives_the_committed_files(tmp_path):
    # protoc runs in a process of its own: grpc_tools' compiler carries its own protobuf and abseil, and a library
    # loaded after it into the same process (NIXL's bindings) aborts at import.
    done = subprocess.run([sys.executable, "-m", "proto.generate", str(tmp_path)], cwd=ROOT.parent, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    written = [Path(line) for line in done.stdout.splitlines()]
    assert written, "protoc wrote nothing"
    for fresh in written:
        committed = ROOT / fresh.relative_to(tmp_path)
        assert committed.exists(), f"{committed} is not committed"
        assert fresh.read_text() == committed.read_text(), f"{committed} is stale: run python -m proto.generate"


def test_services_and_health_names():
    from proto.eyrie.v1 import eyrie_pb2

    services = eyrie_pb2.DESCRIPTOR.services_by_name
    assert {"Generation", "Prefill", "Decode"} <= set(services)
    assert eyrie_pb2.DESCRIPTOR.package == "eyrie.v1"
    assert [m.name for m in services["Generation"].methods] == ["Generate", "Abort", "GetModelInfo"]
    assert Path(eyrie_pb2.__file__).parent == ROOT / "eyrie" / "v1"
