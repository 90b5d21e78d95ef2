"""Code health: no dead code in the packages (``vulture`` at 80% confidence reports nothing)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_vulture_finds_no_dead_code():
    run = subprocess.run([sys.executable, "-m", "vulture", "shared", "services", "kernels", "--min-confidence", "80"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.stdout == "" and run.returncode == 0, run.stdout + run.stderr
