"""docs/deploy.md and README.md cannot drift: both carry the configuration table generated from
services/settings.py, every EYRIE_* name they or the compose file mention is a real setting, and every
variable the compose file reads is documented."""

from __future__ import annotations

import importlib.util
import re

import pytest

from services.settings import SETTINGS
from tests.unit.deploy.conftest import COMPOSE_FILE, ROOT

DOC = ROOT / "docs" / "deploy.md"
README = ROOT / "README.md"


def config_table():
    spec = importlib.util.spec_from_file_location("config_table", ROOT / "docker" / "config_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_table_matches_the_settings():
    ct = config_table()
    fields = {name for cls in SETTINGS.values() for name in cls.model_fields}
    docs = ct.documents()
    assert docs == [DOC, README]  # both carry the table
    for path in docs:
        documented = ct.current_table(path.read_text(), path.name)
        assert documented == ct.table(), f"{path.name}'s table is stale: run python docker/config_table.py --write"
        rows = re.findall(r"^\| `EYRIE_(\w+)` \|", documented, flags=re.M)
        assert sorted(r.lower() for r in rows) == sorted(fields)  # one row per field, no more


def test_a_document_without_the_markers_is_refused():
    ct = config_table()
    readme = README.read_text()
    without = readme.replace(ct.START, "").replace(ct.END, "")
    with pytest.raises(ValueError, match="README.md lacks the markers"):
        ct.current_table(without, "README.md")


def test_stale_table_is_detected():
    ct = config_table()
    for path in (DOC, README):
        doc = path.read_text()
        row = next(line for line in doc.splitlines() if line.startswith("| `EYRIE_REDIS_URL`"))
        assert ct.current_table(doc.replace(row + "\n", "")) != ct.table()
    assert ct.main(["--check"]) == 0


# Read from the environment by a kernel module, once per process, not service settings: the peer-GPU copy's
# mode and staging (kernels/page_copy.py PeerSettings), and how its increments wait (shared/handoff/ipc.py).
KERNEL_KNOBS = {"peer_copy", "peer_chunk_mb", "peer_buffers", "peer_wait"}


def test_every_eyrie_name_is_a_setting():
    fields = {name for cls in SETTINGS.values() for name in cls.model_fields} | KERNEL_KNOBS
    for path in (DOC, COMPOSE_FILE, ROOT / "docker" / "entrypoint.sh", README):
        names = set(re.findall(r"\bEYRIE_([A-Z][A-Z0-9_]*)", path.read_text()))
        unknown = sorted(n for n in names if n.lower() not in fields)
        assert not unknown, f"{path.name} mentions EYRIE_{unknown} that services/settings.py does not have"


def test_every_compose_variable_is_documented():
    variables = set(re.findall(r"\$\{(\w+)(?::?[-?][^}]*)?\}", COMPOSE_FILE.read_text()))
    assert {"REDIS_PASSWORD", "MODELS_DIR", "DECODE_GPU", "ROUTER_BIND"} <= variables
    doc = DOC.read_text()
    undocumented = sorted(v for v in variables if f"`{v}`" not in doc)
    assert not undocumented, f"docs/deploy.md does not explain {undocumented}"
