"""CUDA MPS for the prefill and decode services when they share one GPU.

Two processes on one GPU without MPS take turns on the whole device (time slices): a prompt's prefill waits
behind the decode service's steps and the other way round. Measured on an H100 at 32 concurrent streams
(8B shape, ``bench/profile_ttft.sh``, both in one call): time-sliced 2442 output tok/s and TTFT p50 0.195 s;
under one MPS server (which runs both processes' kernels side by side on the SMs) 1849 tok/s and 0.093 s. A
trade, not a gain, so ``eyrie up --mps on`` (or ``auto``: when ``nvidia-cuda-mps-control`` is on the PATH and
no MPS daemon is already named by ``CUDA_MPS_PIPE_DIRECTORY``) starts a private MPS control daemon for its
services and stops it with them; the default is off.

Private: its pipe and log directories are a temporary directory of this run, passed to the services through
``CUDA_MPS_PIPE_DIRECTORY`` / ``CUDA_MPS_LOG_DIRECTORY``; processes outside the stack never connect to it. The
device's settings (compute mode, MIG) are left as they are.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"
MODES = ("auto", "on", "off")


@dataclass
class MpsDaemon:
    """A running MPS control daemon of ours; ``env`` connects a process to it."""

    root: Path  # the pipe and log directories' parent (removed by ``stop``)
    control: str  # the control binary

    @property
    def env(self) -> dict[str, str]:
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.root / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(self.root / "log")}

    def stop(self) -> None:
        """Ask the daemon to quit (its server ends once no client is left), then remove its directories."""
        try:
            subprocess.run([self.control], input=b"quit\n", env={**os.environ, **self.env}, timeout=30,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        except (OSError, subprocess.TimeoutExpired):
            pass
        shutil.rmtree(self.root, ignore_errors=True)


def want_mps(mode: str, device: str, control: str | None = None) -> str | None:
    """The control binary to start a daemon with, or None (with ``mode`` off, a CPU device, a daemon already
    named by the environment, or ``auto`` without the binary); ``on`` without the binary is an error."""
    if mode not in MODES:
        raise ValueError(f"mps: one of {', '.join(MODES)}, got {mode!r}")
    if mode == "off" or not str(device).startswith("cuda") or os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
        return None
    control = control or shutil.which(CONTROL)
    if control is None and mode == "on":
        raise ValueError(f"mps: on, but {CONTROL} is not on the PATH (install the NVIDIA driver's utilities, "
                         "or give --mps off)")
    return control


def start_mps(control: str) -> MpsDaemon:
    """Start a private MPS control daemon (``-d`` daemonizes at once); RuntimeError naming why it did not."""
    daemon = MpsDaemon(Path(tempfile.mkdtemp(prefix="eyrie-mps-")), control)
    for sub in ("pipe", "log"):
        (daemon.root / sub).mkdir()
    try:
        proc = subprocess.run([control, "-d"], env={**os.environ, **daemon.env}, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        shutil.rmtree(daemon.root, ignore_errors=True)
        raise RuntimeError(f"mps: {control} -d did not start: {e}") from None
    if proc.returncode != 0:
        shutil.rmtree(daemon.root, ignore_errors=True)
        raise RuntimeError(f"mps: {control} -d exited with status {proc.returncode}: "
                           f"{(proc.stderr or proc.stdout).decode(errors='replace').strip()[:300]}")
    return daemon
