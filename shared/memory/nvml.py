"""This process's memory on a GPU as the driver counts it (NVML through ctypes: no Python package needed).

PyTorch's allocator counts only its own blocks; the CUDA context, cuBLAS handles and workspaces and Triton's
modules are outside it. NVML's per-process figure includes them. None wherever it cannot be read (no driver
library, a container whose process ids differ from the host's, a driver that does not report it)."""

from __future__ import annotations

import ctypes
import os

NVML_SUCCESS, NVML_ERROR_INSUFFICIENT_SIZE = 0, 7
NOT_AVAILABLE = (1 << 64) - 1  # NVML_VALUE_NOT_AVAILABLE for usedGpuMemory


class _ProcessInfo(ctypes.Structure):  # nvmlProcessInfo_t (v2), what the _v3 queries fill
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong), ("gpuInstanceId", ctypes.c_uint),
                ("computeInstanceId", ctypes.c_uint)]


_LIB: list = []  # the loaded, initialised library (once)


def _nvml():
    if not _LIB:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2() != NVML_SUCCESS:
            raise OSError("nvmlInit failed")
        _LIB.append(lib)
    return _LIB[0]


def pci_bus_id(device) -> str:
    """The device's PCI address as NVML names it (domain:bus:device.function)."""
    import torch

    p = torch.cuda.get_device_properties(device)
    return f"{p.pci_domain_id:08X}:{p.pci_bus_id:02X}:{p.pci_device_id:02X}.0"


def process_used_bytes(device, lib=None, bus_id: str | None = None, pid: int | None = None) -> int | None:
    """This process's memory on ``device`` (a CUDA device) by NVML, or None when it cannot be read: its own
    entry in the device's list of compute processes, never the device's used memory (another engine's memory
    on a shared GPU is not this one's). ``lib``, ``bus_id``, ``pid``: the NVML library, the device's PCI
    address and the process id (default: the driver's library, ``device``'s address, this process)."""
    try:
        lib = lib or _nvml()
        handle = ctypes.c_void_p()
        bus = (bus_id or pci_bus_id(device)).encode()
        if lib.nvmlDeviceGetHandleByPciBusId_v2(bus, ctypes.byref(handle)) != NVML_SUCCESS:
            return None
        query = lib.nvmlDeviceGetComputeRunningProcesses_v3
        count = ctypes.c_uint(0)
        if query(handle, ctypes.byref(count), None) not in (NVML_SUCCESS, NVML_ERROR_INSUFFICIENT_SIZE):
            return None
        count = ctypes.c_uint(count.value + 8)  # processes may start between the two calls
        infos = (_ProcessInfo * count.value)()
        if query(handle, ctypes.byref(count), infos) != NVML_SUCCESS:
            return None
    except (OSError, AttributeError, RuntimeError, ValueError):
        return None
    return own_usage(list(infos)[:count.value], os.getpid() if pid is None else pid)


def own_usage(infos, pid: int) -> int | None:
    """The memory NVML lists for ``pid`` among ``infos`` (None when absent or not reported)."""
    used = [i.usedGpuMemory for i in infos if i.pid == pid]
    return None if not used or used[0] == NOT_AVAILABLE else int(used[0])


def outside_torch(used: int | None, torch_reserved: int) -> int | None:
    """The process's memory outside PyTorch's allocator (CUDA context, cuBLAS, Triton modules, graph objects):
    its NVML figure ``used`` less what the allocator holds; None when NVML could not be read."""
    return None if used is None else max(0, used - torch_reserved)
