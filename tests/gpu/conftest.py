"""What several GPU test files share: the widened 8B-shaped pair, built once per module (or the one
``EYRIE_WIDE_PAIR`` names: ``python -m bench.house.widen_tiny --out DIR``)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wide_pair(tmp_path_factory) -> Path:
    given = os.environ.get("EYRIE_WIDE_PAIR")
    if given:
        return Path(given)
    out = tmp_path_factory.mktemp("wide")
    subprocess.run([sys.executable, "-m", "bench.house.widen_tiny", "--out", str(out)], cwd=ROOT, check=True,
                   timeout=600, stdout=subprocess.DEVNULL)
    return out
