"""The generated Python beside proto/eyrie/v1/*.proto is current: regenerating gives the same files."""

from pathlib import Path

from proto.generate import ROOT, generate


def test_regenerating_gives_the_committed_files(tmp_path):
    written = generate(tmp_path)
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
