"""Shared fixtures: tiny checkpoints made once per session, CPU/GPU selection, no-leak checks."""

from __future__ import annotations

import contextlib
import gc
import os

import pytest
import torch

# EYRIE_GPU_PER_WORKER=N (bench/gpu_session.sh suite-x2): pytest-xdist worker k sees only GPU k mod N, set before
# CUDA starts (the check below starts it), so the one-GPU tests run N at a time on a machine of N GPUs (the two-GPU
# tests then skip: they run apart).
if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("EYRIE_GPU_PER_WORKER"):
    _worker = int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw"))
    os.environ["CUDA_VISIBLE_DEVICES"] = str(_worker % int(os.environ["EYRIE_GPU_PER_WORKER"]))

# Triton kernels run under the interpreter when there is no GPU; set before any kernel is imported
# (forced: without a GPU the kernel tests have no other way to run).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def row_invariant_interpreter_dot() -> None:
    """Under the interpreter, ``tl.dot`` as a GPU computes it: each output element's sum the same whatever the other
    rows of the tile. Triton's interpreter hands the tile to ``np.matmul``, i.e. to OpenBLAS, whose kernel (chosen by
    the CPU) may sum a row differently by its place in the tile or the tile's row count: on an AVX-512 AMD EPYC
    (2026-12-07) a tree's verify rows differed from the same rows as decode steps by 2e-7..6e-7 with the kernel
    OpenBLAS picked and with Haswell's (``OPENBLAS_CORETYPE``), and not with SkylakeX's, which the earlier CI
    machines had. An MMA's sum over K, like numpy's ``einsum`` without BLAS, does not depend on the other rows,
    so the kernels' row-invariance tests test the kernels, not the BLAS. Integer and FP8 dots are left as they are."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    blas_dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        acc = d.data.dtype
        if not np.issubdtype(acc, np.floating) or any(x.dtype.primitive_bitwidth == 8 for x in (a, b)):
            return blas_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        out = np.einsum("...ik,...kj->...ij", a.data.astype(acc, copy=False), b.data.astype(acc, copy=False),
                        optimize=False)
        return interpreter.TensorHandle(out + d.data, d.dtype.scalar)

    builder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    with contextlib.suppress(ImportError):  # no Triton: the kernel tests skip
        row_invariant_interpreter_dot()


LEFT_RUNNING = "engines_left_running"

# Under pytest-xdist (.ci/run: two workers on a 2-core machine) each worker is a process of its own.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:
    # The processes the tests start (services, `eyrie` commands, spawned ranks and followers) inherit one intra-op
    # thread too, as the workers run (pytest_configure): two spinning OpenMP threads in each of them cost CPU the
    # other worker needed (issue 35: a TP-2 decode stack's three hand-off tests took 31.5 s user, 8.6 s sys with
    # two threads against 20.5 s, 4.5 s with one). A value set outside the suite stays.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# NIXL agents (the nixl transport's stacks, in this process and in the services it starts) pause 100 us between
# progress rounds instead of polling without pause: each idle agent kept a core busy while its stack lived
# (shared.handoff.nixl.PROGRESS_DELAY_ENV). A value set outside the suite stays (0: NIXL's own, no pause).
os.environ.setdefault("EYRIE_NIXL_PROGRESS_DELAY_US", "100")
# The files that take a minute or more on the CI machine, longest first: with `--dist loadfile
# --no-loadscope-reorder` the workers take files in collection order, so these go out first and no long
# file starts last while the other worker sits idle.
LONGEST_FIRST = (
    "tests/unit/spec/test_sampling_lossless.py",  # ~3 min: 18000 sampled requests
    "tests/unit/spec/test_fp8_lossless.py",  # ~2 min: 12000 sampled requests on FP8 targets
    "tests/unit/training/test_gpu_scripts.py",  # ~3 min: the house and adaptive scripts' CPU forms
    "tests/unit/engine/test_tensor_parallel.py",  # ~2 min: two gloo ranks
    "tests/unit/spec/test_penalties_sampled.py",  # ~2 min: chi-square tests with penalties
    "tests/unit/spec/test_spec_policy.py",  # ~2 min: sampled law with the policy switching
    "tests/unit/spec/test_lossless_matrix.py",  # ~2.5 min: 904 engine configurations
    "tests/unit/kernels/test_compile_sm90.py",  # ~1.5 min: ptxas on 20 launches
)  # then tests/e2e (first in collection order anyway: failover, lifecycle, chaos)


def longest_first(item) -> int:
    """The item's place in the hand-out order: its file's index in LONGEST_FIRST, after them all if absent."""
    path = item.nodeid.split("::")[0]  # relative to the repository root (pyproject.toml)
    return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_configure(config):
    if XDIST_WORKER:  # two workers of two spinning intra-op threads each stall one another on two cores
        torch.set_num_threads(1)
    config.addinivalue_line(
        "markers", f"{LEFT_RUNNING}(reason): the test leaves its engines mid-request on purpose, so the "
                   "end-of-test pool check (engine_pools_checked) skips it; rare, and the reason says why")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.eyrie_call_failed = report.failed  # a failed test's leftovers are not a second error
    return report


def pools_complaint(engines: list) -> str | None:
    """What is wrong with the first of ``engines`` whose pages or request slots are not all back in
    their pools (``check_pools_full``), or None when every one is clean."""
    from tests.unit.engine.engine_checks import check_pools_full

    for i, engine in enumerate(engines):
        try:
            check_pools_full(engine)
        except AssertionError as e:
            return (f"engine {i + 1} of {len(engines)} built in this test did not get all its pages and request "
                    f"slots back: {e}")
    return None


@pytest.fixture
def engine_pools_checked(request, monkeypatch):
    """Records every ``Engine`` built during the test (the list is the fixture's value); when the
    test ends, every page and request slot of every cache of each must be back in its pool. Made
    autouse by the engine and spec test directories. A test that leaves engines mid-request on
    purpose says so, and why, with ``@pytest.mark.engines_left_running(reason="...")``."""
    from shared.engine import Engine

    made: list = []
    init = Engine.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(Engine, "__init__", recording_init)
    yield made
    marker = request.node.get_closest_marker(LEFT_RUNNING)
    if marker is not None:
        if not (marker.kwargs.get("reason") or marker.args):
            pytest.fail(f"@pytest.mark.{LEFT_RUNNING} needs a reason")
        return
    if getattr(request.node, "eyrie_call_failed", False):
        return  # the failure is reported already; its leftovers are no news
    complaint = pools_complaint(made)
    if complaint:
        pytest.fail(complaint, pytrace=False)


@pytest.hookimpl(tryfirst=True)  # before -m selects: `pytest tests/gpu tests/unit -m gpu` is the whole GPU suite
def pytest_collection_modifyitems(config, items):
    if XDIST_WORKER:
        items.sort(key=longest_first)  # stable: the rest keep their order
    if torch.cuda.is_available():
        for item in items:  # the kernel tests run their Triton kernels on the GPU when there is one
            if "tests/unit/kernels/" in item.nodeid.replace("\\", "/") or item.nodeid.startswith("unit/kernels/"):
                item.add_marker(pytest.mark.gpu)
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (GPU-only path; run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_unexpected_capture_failure(request, monkeypatch):
    """On a GPU, a CUDA graph capture that fails is contained (its phase runs eagerly, output stays
    right), so a test would pass over it: fail the test instead, naming the phase and the error, unless
    it forces the failure on purpose (``@pytest.mark.capture_failure_expected``)."""
    if not torch.cuda.is_available():
        yield
        return
    from shared import cuda_graphs

    seen: list[str] = []
    contain = cuda_graphs.contain_failure

    def recording(failures, phase, size, error, rng):
        seen.append(f"{phase} at size {size}: {type(error).__name__}: {error}")
        return contain(failures, phase, size, error, rng)

    monkeypatch.setattr(cuda_graphs, "contain_failure", recording)
    yield
    if seen and request.node.get_closest_marker("capture_failure_expected") is None:
        pytest.fail("CUDA graph capture failed (contained, the phase ran eagerly): " + "; ".join(seen),
                    pytrace=False)


# An engine's model runner sits in reference cycles (its CUDA-graph phases hold its bound methods), so its
# weights and KV pools (shared memory for a decode engine's) go only when the cycle collector runs, which large
# tensors do not prompt. A worker running file after file of engines grew past 15 GB and was OOM-killed (the
# 24 GiB CI machine, two workers). After a test, a process over COLLECT_ABOVE resident collects its cycles (a
# worker holds about 2.4 GB of its own: at 2 GiB it collected after every test, ~0.1 s each). It collects again
# only once it has grown COLLECT_EVERY past what the last collection left: memory the allocator keeps after a
# collection does not make every later test collect. A collection's cost grows with the objects a worker holds
# (0.18 s after four spec files); in two of stop 44's stress runs the lossless matrix's 904 tests took 0.9-1.4 s
# each instead of 0.1-0.3 (840 s for the file, against 150), as a worker that stays over the bar would.
COLLECT_ABOVE = 4 << 30
COLLECT_EVERY = 1 << 30
PAGE = os.sysconf("SC_PAGE_SIZE")
_collected_at = [0]  # resident bytes after the last collection


def resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except OSError:  # no /proc: collect after every test
        return COLLECT_ABOVE + _collected_at[0] + COLLECT_EVERY + 1


@pytest.fixture(autouse=True)
def engines_collected():
    yield
    if resident_bytes() > max(COLLECT_ABOVE, _collected_at[0] + COLLECT_EVERY):
        gc.collect()
        _collected_at[0] = resident_bytes()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random tiny Llama target with EAGLE, EAGLE-3 and multi-layer drafts: OUT/{target,eagle,eagle3,mtp}."""
    from shared.model.factory import make_model

    return make_model("tiny", tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="session")
def oracle_model_dir(tmp_path_factory):
    """A tiny target whose drafts agree with it often (acceptance well above zero)."""
    from tests.oracle_model import make_oracle_model

    return make_oracle_model(tmp_path_factory.mktemp("oracle"), seed=0)
