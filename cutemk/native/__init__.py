"""The static scheduler's whole-graph passes in C (``sched.c``), for plans of many thousand tasks.

Built on first use with the system C compiler (``$CC``, else ``cc``/``gcc``) into
``~/.cache/cutemk/native`` (or ``$CUTEMK_CACHE_DIR/native``), named by a hash of the source and
the machine, and loaded with ctypes. Where no compiler works, or ``CUTEMK_NATIVE=0``, :func:`lib` is None and
the callers keep their Python passes, which give the same results (``tests/test_native.py``).
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..envvars import env_switch

_SOURCE = Path(__file__).with_name("sched.c")
_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_TRIED = False

_I32P = np.ctypeslib.ndpointer(dtype=np.int32, flags="C_CONTIGUOUS")
_F64P = np.ctypeslib.ndpointer(dtype=np.float64, flags="C_CONTIGUOUS")


def _build_dir() -> Path:
    d = os.environ.get("CUTEMK_CACHE_DIR")
    if d == "":  # caches off: a directory of this process's own
        return Path(tempfile.mkdtemp(prefix="cutemk-native-"))
    return (Path(d) if d else Path.home() / ".cache" / "cutemk") / "native"


def _compile(path: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (set CC)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.{threading.get_ident()}.so")
    cmd = [cc, "-O2", "-std=c99", "-shared", "-fPIC", "-ffp-contract=off", str(_SOURCE)]
    out = subprocess.run(
        [*cmd, "-o", str(tmp)], capture_output=True, text=True, timeout=120, check=False
    )
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()[-500:]}")
    os.replace(tmp, path)


def lib() -> ctypes.CDLL | None:
    """The compiled library, built on first use; None where it cannot be (warned once)."""
    global _LIB, _TRIED
    if _TRIED:
        return _LIB
    with _LOCK:  # another thread asking meanwhile waits for this build
        if _TRIED:
            return _LIB
        try:
            _LIB = _load() if env_switch("CUTEMK_NATIVE", True) else None
        finally:
            _TRIED = True
    return _LIB


def _load() -> ctypes.CDLL | None:
    try:
        key = _SOURCE.read_bytes() + f"{sys.platform} {platform.machine()}".encode()
        digest = hashlib.sha256(key).hexdigest()[:16]
        d = _build_dir()
        path = d / f"sched-{digest}.so"
        try:
            if not path.is_file():
                _compile(path)
            return _bind(ctypes.CDLL(str(path)))
        finally:
            if os.environ.get("CUTEMK_CACHE_DIR") == "":  # this process's own: loaded, gone
                shutil.rmtree(d, ignore_errors=True)
    except Exception as e:  # noqa: BLE001 (any failure: the Python passes serve)
        warnings.warn(
            f"cutemk: the C scheduler passes are unavailable ({e}); planning large graphs "
            "for the static scheduler is slower",
            stacklevel=3,
        )
        return None


def _bind(so: ctypes.CDLL) -> ctypes.CDLL:
    i32 = ctypes.c_int32
    graph = [i32, i32, _I32P, _I32P, _I32P, _I32P]
    so.cutemk_upward_rank.argtypes = [*graph, _F64P, _F64P]
    so.cutemk_upward_rank.restype = i32
    so.cutemk_check_order.argtypes = [*graph, _I32P]
    so.cutemk_check_order.restype = i32
    so.cutemk_list_schedule.argtypes = [
        *graph,
        _F64P,
        _I32P,
        i32,
        ctypes.c_double,
        i32,
        _I32P,
        _I32P,
    ]
    so.cutemk_list_schedule.restype = i32
    i64p = np.ctypeslib.ndpointer(dtype=np.int64, flags="C_CONTIGUOUS")
    so.cutemk_cell_sources.argtypes = [i32, i64p, _I32P, i32, i64p, _I32P, _I32P, ctypes.c_int64]
    so.cutemk_cell_sources.restype = ctypes.c_int64
    return so


def cell_sources(shape: Sequence[int], grid: np.ndarray, ranges: np.ndarray) -> list[tuple]:
    """Per box of cells (``ranges``: boxes x dims x [lo, hi)), the sorted writer ids the
    tiling's ``grid`` (cells row-major, -1: no writer) holds in it."""
    ranges = np.ascontiguousarray(ranges, dtype=np.int64)
    n = len(ranges)
    sizes = np.clip(ranges[:, :, 1] - ranges[:, :, 0], 0, None).prod(axis=1)
    cap = max(int(sizes.sum()), 1)
    ptr = np.zeros(n + 1, dtype=np.int32)
    out = np.empty(cap, dtype=np.int32)
    got = lib().cutemk_cell_sources(
        len(shape), np.asarray(shape, dtype=np.int64), grid, n, ranges, ptr, out, cap
    )
    if got < 0:
        raise RuntimeError("cutemk_cell_sources: bad ranges")
    flat, at = out[:got].tolist(), ptr.tolist()
    return [tuple(flat[at[i] : at[i + 1]]) for i in range(n)]


def csr(lists: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Per-task lists as (ptr, idx) int32 arrays."""
    n = len(lists)
    ptr = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(np.fromiter(map(len, lists), dtype=np.int32, count=n), out=ptr[1:])
    idx = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int32, count=int(ptr[-1]))
    return ptr, idx


class PlanArrays:
    """A plan's waits and notifies as CSR arrays, with its event count and task costs.
    ``valid``: every event id in range and one cost a task (the C passes index by them
    unchecked; a plan that fails this, e.g. one edited by hand, takes the Python passes, which
    raise)."""

    def __init__(self, waits, notifies, num_events: int, cost) -> None:
        self.n = len(waits)
        self.e = int(num_events)
        self.wait_ptr, self.wait_idx = csr(waits)
        self.ntf_ptr, self.ntf_idx = csr(notifies)
        self.cost = np.asarray(cost, dtype=np.float64)
        self.valid = (
            len(notifies) == self.n
            and self.cost.shape == (self.n,)
            and all(
                not len(a) or (int(a.min()) >= 0 and int(a.max()) < self.e)
                for a in (self.wait_idx, self.ntf_idx)
            )
        )

    def _graph(self) -> tuple:
        return (self.n, self.e, self.wait_ptr, self.wait_idx, self.ntf_ptr, self.ntf_idx)

    def upward_rank(self) -> list[float] | None:
        """Each task's upward rank, or None if the graph has a cycle."""
        rank = np.zeros(self.n, dtype=np.float64)
        got = lib().cutemk_upward_rank(*self._graph(), self.cost, rank)
        if got == -1 and self.n:
            raise MemoryError("cutemk_upward_rank")
        return rank.tolist() if got == self.n else None

    def list_schedule(
        self, by_prio: Sequence[int], num_sms: int, hop: float, idle_ties: bool = False
    ) -> np.ndarray:
        """Each task's SM and the order tasks were placed in: ``(sm_of, placed)``;
        ``idle_ties``: see ``StaticScheduler.ties``."""
        sm_of = np.full(self.n, -1, dtype=np.int32)
        placed = np.zeros(self.n, dtype=np.int32)
        order = np.ascontiguousarray(by_prio, dtype=np.int32)
        args = (self.cost, order, int(num_sms), float(hop), int(idle_ties), sm_of, placed)
        rc = lib().cutemk_list_schedule(*self._graph(), *args)
        if rc:
            raise RuntimeError("the C list scheduler could not place every task")
        return sm_of, placed

    def orders_all(self, queue_next: np.ndarray) -> bool:
        """Whether dependencies and queue order together are acyclic (the static check)."""
        got = lib().cutemk_check_order(*self._graph(), np.ascontiguousarray(queue_next, np.int32))
        if got == -1 and self.n:
            raise MemoryError("cutemk_check_order")
        return got == self.n
