"""The model ``eyrie up`` and ``eyrie generate`` serve when no ``--model`` is given.

The tiny trained pair when it is there: ``models/tiny-pair/{target,eagle3}`` in the repository (written
by ``bench/house/gpu_tiny_pair.sh``; ``models/tiny-pair/README.md`` says how), or the directory that
``EYRIE_TINY_PAIR`` names. Without it, a random tiny model made on the spot, as before.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DIR = Path(__file__).resolve().parents[2] / "models" / "tiny-pair"
ENV = "EYRIE_TINY_PAIR"


@dataclass(frozen=True)
class Pair:
    target: Path  # checkpoint directory with the tokenizer
    eagle3: Path  # its EAGLE-3 head


def trained_tiny_pair() -> Pair | None:
    """The trained pair if both of its checkpoints are present, else None."""
    root = Path(os.environ.get(ENV) or DEFAULT_DIR)
    pair = Pair(root / "target", root / "eagle3")
    complete = all((d / "config.json").exists() and (d / "model.safetensors").exists()
                   for d in (pair.target, pair.eagle3))
    return pair if complete else None


def default_pair() -> Pair:
    """The trained pair, or a random tiny target and EAGLE-3 head written to a new temporary directory."""
    pair = trained_tiny_pair()
    if pair is not None:
        return pair
    from shared.model.factory import make_model

    out = make_model("tiny", Path(tempfile.mkdtemp(prefix="eyrie-tiny-")))
    return Pair(out / "target", out / "eagle3")
