"""Two engines on one GPU (a prefill and a decode service at 0.45 each, started together): every memory figure
an engine sizes its pools by or checks its peak against is its own. NVML's figure is the process's entry in the
device's process list (a fake NVML library, two processes listed, through the same ctypes calls as the
driver's), the weights are the allocator's segments (fake allocator readings), the other engine's memory changes
neither the page count nor the peak check as long as it keeps to its share, and the pools leave
``POOL_MARGIN`` of the share unassigned for what the profile run does not measure. The GPU path:
tests/gpu/test_memory_promise_gpu.py."""

from __future__ import annotations

import ctypes

import pytest
import torch

from shared.memory import sizing
from shared.memory.nvml import NVML_ERROR_INSUFFICIENT_SIZE, NVML_SUCCESS, outside_torch, process_used_bytes
from shared.memory.sizing import (
    FOOTPRINT_SLACK,
    POOL_MARGIN,
    DeviceMemory,
    Footprint,
    GiB,
    check_footprint,
    pages_within_budget,
)
from shared.request import RequestError

MB = 1 << 20
BUS = "00000000:19:00.0"
PREFILL_PID, DECODE_PID = 4100, 4200


class FakeNvml:
    """The two NVML calls ``process_used_bytes`` makes, answering for one device: ``processes`` (pid, bytes);
    ``late``: a process that starts between the count query and the fill."""

    def __init__(self, processes: list[tuple[int, int]], late: tuple[int, int] | None = None):
        self.processes, self.late, self.bus_ids = list(processes), late, []

    def nvmlDeviceGetHandleByPciBusId_v2(self, bus: bytes, handle) -> int:  # noqa: N802 (NVML's name)
        self.bus_ids.append(bus.decode())
        return NVML_SUCCESS if bus.decode() == BUS else 13  # NVML_ERROR_NOT_FOUND

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle, count, infos) -> int:  # noqa: N802
        count = count._obj  # ctypes.byref(c_uint)
        if infos is None:
            count.value = len(self.processes)
            if self.late is not None:
                self.processes.append(self.late)
            return NVML_ERROR_INSUFFICIENT_SIZE if self.processes else NVML_SUCCESS
        if count.value < len(self.processes):
            count.value = len(self.processes)
            return NVML_ERROR_INSUFFICIENT_SIZE
        for i, (pid, used) in enumerate(self.processes):
            infos[i].pid, infos[i].usedGpuMemory = pid, used
        count.value = len(self.processes)
        return NVML_SUCCESS


def test_nvml_gives_each_process_its_own_entry_never_the_devices_used_memory():
    nvml = FakeNvml([(PREFILL_PID, 36 * GiB), (DECODE_PID, 21 * GiB)])
    assert process_used_bytes(None, lib=nvml, bus_id=BUS, pid=DECODE_PID) == 21 * GiB
    assert process_used_bytes(None, lib=nvml, bus_id=BUS, pid=PREFILL_PID) == 36 * GiB
    assert process_used_bytes(None, lib=nvml, bus_id=BUS, pid=7) is None  # not listed: unmeasured, not 57 GiB
    assert process_used_bytes(None, lib=nvml, bus_id="00000000:1A:00.0", pid=DECODE_PID) is None  # no such device
    late = FakeNvml([(PREFILL_PID, 36 * GiB)], late=(DECODE_PID, 2 * GiB))  # the decode's context appears meanwhile
    assert process_used_bytes(None, lib=late, bus_id=BUS, pid=DECODE_PID) == 2 * GiB
    assert process_used_bytes(None, lib=FakeNvml([]), bus_id=BUS, pid=DECODE_PID) is None


def test_the_memory_outside_pytorch_is_the_processs_figure_less_its_allocators():
    nvml = FakeNvml([(PREFILL_PID, 36 * GiB), (DECODE_PID, 21 * GiB)])
    used = process_used_bytes(None, lib=nvml, bus_id=BUS, pid=DECODE_PID)
    assert outside_torch(used, 20 * GiB + 512 * MB) == 512 * MB
    assert outside_torch(used, 22 * GiB) == 0  # a reading taken as the allocator grew: never negative
    assert outside_torch(None, 20 * GiB) is None


def test_a_decodes_peak_check_counts_its_own_memory_while_the_prefill_holds_its_whole_share():
    total, torch_reserved = 80 * GiB, 34 * GiB
    nvml = FakeNvml([(PREFILL_PID, int(0.45 * total)), (DECODE_PID, torch_reserved + 700 * MB)])
    used = process_used_bytes(None, lib=nvml, bus_id=BUS, pid=DECODE_PID)
    own = Footprint(torch_peak=torch_reserved, non_torch=outside_torch(used, torch_reserved), device_total=total,
                    fraction=0.45)
    check_footprint(own)  # 34.68 GiB within 0.45 x 80 GiB = 36 GiB
    assert own.non_torch == 700 * MB
    device_used = sum(b for _, b in nvml.processes)  # what a whole-device figure would have charged it
    whole = Footprint(torch_peak=torch_reserved, non_torch=outside_torch(device_used, torch_reserved),
                      device_total=total, fraction=0.45)
    with pytest.raises(RequestError, match="gpu_memory_fraction"):
        check_footprint(whole)


def test_the_pages_do_not_depend_on_whether_the_other_engine_has_taken_its_share_yet():
    """The decode sizes its pools while the prefill has loaded nothing, or holds all of its 0.45: the same
    pages, its own share bounds them; only an engine past its share (less free than this one's pools need)
    lowers them."""
    total, weights, reserve = 80 * GiB, 17 * GiB, 3 * GiB
    alone = DeviceMemory(total=total, free=total - weights, weights=weights)
    beside = DeviceMemory(total=total, free=total - weights - int(0.45 * total), weights=weights)
    sizes = [pages_within_budget(0.45, m, reserve, 2 * MB, 520, 10**9, margin=POOL_MARGIN) for m in (alone, beside)]
    assert sizes[0] == sizes[1]
    greedy = DeviceMemory(total=total, free=total - weights - int(0.6 * total), weights=weights)  # past its share
    assert pages_within_budget(0.45, greedy, reserve, 2 * MB, 520, 10**9, margin=POOL_MARGIN) < sizes[0]


def test_the_pools_leave_the_margin_of_the_share_unassigned():
    memory = DeviceMemory(total=80 * GiB, free=70 * GiB, weights=17 * GiB)
    full = pages_within_budget(0.45, memory, 3 * GiB, 2 * MB, 520, 10**9)
    kept = pages_within_budget(0.45, memory, 3 * GiB, 2 * MB, 520, 10**9, margin=POOL_MARGIN)
    margin = int(POOL_MARGIN * 0.45 * 80 * GiB)
    assert kept == (int(0.45 * 80 * GiB) - 17 * GiB - 3 * GiB - margin) // (2 * MB) - 1
    assert full - kept >= margin // (2 * MB)
    planned = 17 * GiB + 3 * GiB + (kept + 1) * 2 * MB
    assert planned <= (1 - POOL_MARGIN) * 0.45 * 80 * GiB
    # What the profile did not measure (graph outputs, graph objects, kernels loaded later), up to the margin,
    # stays within the check; the margin is wider than the check's slack, so the slack is never what saves it.
    check_footprint(Footprint(torch_peak=planned + margin, non_torch=0, device_total=80 * GiB, fraction=0.45))
    assert POOL_MARGIN > FOOTPRINT_SLACK - 1
    with pytest.raises(RequestError) as e:
        pages_within_budget(0.25, memory, 3 * GiB, 2 * MB, 520, 10**9, margin=POOL_MARGIN)
    assert "a margin of 0.60 GiB (3% of the share)" in str(e.value) and "\n" not in str(e.value)


def test_the_weights_are_the_allocators_segments_read_after_its_cache_is_released(monkeypatch):
    """``device_memory``: the weights are what the allocator reserves once its free cached blocks are released
    (the segments' rounding counts in the peak check; a loader's cached temporaries do not stay)."""
    state = {"reserved": 18 * GiB + 900 * MB, "cached": 900 * MB, "emptied": 0}

    def empty_cache():
        state["reserved"] -= state["cached"]
        state["cached"], state["emptied"] = 0, state["emptied"] + 1

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (40 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: state["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 17 * GiB)  # 1 GiB less: the rounding
    memory = sizing.device_memory(torch.device("cuda:0"), reserved_before=2 * MB)
    assert state["emptied"] == 1
    assert memory == DeviceMemory(total=80 * GiB, free=40 * GiB, weights=18 * GiB - 2 * MB)


def test_nvml_struct_is_the_drivers_process_info_layout():
    from shared.memory.nvml import _ProcessInfo

    # nvmlProcessInfo_t: pid (uint), usedGpuMemory (ulonglong), gpuInstanceId, computeInstanceId (uint)
    assert ctypes.sizeof(_ProcessInfo) == 24 and _ProcessInfo.usedGpuMemory.offset == 8
