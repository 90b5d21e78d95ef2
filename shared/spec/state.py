"""The per-request draft state: everything decode needs to resume a request straight into draft().

It is the one copy of this state (SGLang keeps five; most of its PD + EAGLE bugs were mismatches
between them) and it is what the prefill service sends to the decode service.
"""

from __future__ import annotations

import io
import json
import struct
from dataclasses import dataclass

import torch

# The hand-off's version, sent in every draft state and compared at the handshake
# (shared/handoff/schema.py): bump when the wire format (shared/handoff/wire.py) or this layout changes.
SCHEMA_VERSION = 4  # 2: chunks checksummed with CRC32C, not zlib's CRC32; 3: no generator state (every draw
# is a function of the seed and a position); 4: a hand-off may come over several parallel streams (KVChunk.streams)


@dataclass
class DraftState:
    bonus_token: int  # next token (sampled by the target), not yet in the target KV cache
    committed_len: int  # L: tokens whose target (and draft) K/V is cached, positions [0, L)
    hidden: torch.Tensor  # [draft hidden_width] the draft's last recurrent hidden state
    topk_p: torch.Tensor  # [topk] float32 draft probabilities of the first tree level
    topk_ids: torch.Tensor  # [topk] int64 their target token ids
    seed: int | None = None  # the request's seed: with committed_len, all its draws' state

    def to_bytes(self) -> bytes:
        header = {"version": SCHEMA_VERSION, "bonus_token": self.bonus_token,
                  "committed_len": self.committed_len, "seed": self.seed}
        buf = io.BytesIO()
        tensors = {"hidden": self.hidden.detach().cpu(), "topk_p": self.topk_p.detach().cpu(),
                   "topk_ids": self.topk_ids.detach().cpu()}
        torch.save(tensors, buf)
        head = json.dumps(header).encode()
        return struct.pack("<I", len(head)) + head + buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes, device: torch.device | str = "cpu") -> DraftState:
        (n,) = struct.unpack("<I", data[:4])
        header = json.loads(data[4:4 + n])
        if header.get("version") != SCHEMA_VERSION:
            raise ValueError(f"draft state schema version {header.get('version')} != {SCHEMA_VERSION}")
        tensors = torch.load(io.BytesIO(data[4 + n:]), map_location="cpu", weights_only=True)
        return cls(
            bonus_token=header["bonus_token"], committed_len=header["committed_len"],
            hidden=tensors["hidden"].to(device), topk_p=tensors["topk_p"].to(device),
            topk_ids=tensors["topk_ids"].to(device), seed=header.get("seed"),
        )
