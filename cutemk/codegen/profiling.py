"""Per-slice stamps of a profiled megakernel (``profile="slices"``): when the producer issued
each ring slice and when the consumers found it landed, to tell a slow weight stream's cause
(slices late to land: the loads; slices issued late: the slots, i.e. the consumers).

The profile buffer (int64) holds a record per task, then one per CTA (``layout.PROF_WIDTH``
words each), then a region per CTA of ``capacity`` slice records of ``SLICE_WIDTH`` words:
(issued ns, landed ns, task, 0), indexed by the CTA's ring count (its slices since the launch
began, ``cutemk.device.ring``). The capacity is what the region's size leaves a CTA, so the
kernel needs no argument for it; a slice past it is not stamped.
"""

from __future__ import annotations

from typing import Any, Sequence

import cutlass
import numpy as np
from cutlass import Int32, cute

from ..device.config import WARPGROUP
from .layout import PROF_WIDTH, SLICE_WIDTH
from .lower import R_NODE, REC_WIDTH


def slice_capacity(ring_slices: Sequence[int], queue_ptr, queue_rec, num_tasks_by_node) -> int:
    """Slice records a CTA's region holds: the most ring slices one CTA's static queue can
    take (``queue_ptr`` / ``queue_rec`` of the lowered plan; a tile counts its op's most
    slices), or without static queues (dynamic) every ring task's (``num_tasks_by_node``)."""
    slices = np.asarray(ring_slices, dtype=np.int64)
    if int(queue_ptr[-1]) == 0:
        return max(int(np.dot(slices, np.asarray(num_tasks_by_node, dtype=np.int64))), 1)
    nodes = np.asarray(queue_rec).reshape(-1, REC_WIDTH)[: int(queue_ptr[-1]), R_NODE]
    upto = np.concatenate(([0], np.cumsum(slices[nodes])))  # slices before each position
    sums = upto[queue_ptr[1:]] - upto[queue_ptr[:-1]]
    return max(int(sums.max(initial=0)), 1)


def profile_words(num_tasks: int, grid: int, capacity: int | None) -> int:
    """int64 words of the profile buffer: the task and CTA records, and with ``capacity`` the
    CTAs' slice regions."""
    words = (max(num_tasks, 1) + grid) * PROF_WIDTH
    if capacity is not None:
        words += grid * capacity * SLICE_WIDTH
    return words


@cute.jit
def slice_region(mProf: cute.Tensor, num_tasks: Int32, bidx: Int32, grid: Int32):
    """(first word of this CTA's slice region, its capacity in slice records)."""
    records = (cute.max(num_tasks, Int32(1)) + grid) * PROF_WIDTH
    capacity = (cute.size(mProf) - records) // (grid * SLICE_WIDTH)
    return records + bidx * capacity * SLICE_WIDTH, capacity


@cute.jit
def stamp_issued(mProf: cute.Tensor, region, count: Int32, task: Int32, lane: Int32):
    """Producer lane 0: ring slice ``count`` of task ``task`` is being issued (its slot free
    and armed)."""
    base, capacity = region
    if lane == 0 and count < capacity:
        at = base + count * SLICE_WIDTH
        mProf[at] = cute.arch.globaltimer()
        mProf[at + 2] = cutlass.Int64(task)


class LandedStamps:
    """The consumers' pipeline wait (``wait``) that also stamps, from the first consumer
    thread, when each ring slice was found landed (``cutemk.device.ring.consumer_wait`` calls
    :meth:`landed` after the slot's full barrier)."""

    def __init__(self, wait: Any, mProf: cute.Tensor, region) -> None:
        self.wait = wait
        self.prof = mProf
        self.region = region

    def __call__(self, bar, parity, code: int) -> None:
        self.wait(bar, parity, code)

    @cute.jit
    def landed(self, count: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        base, capacity = self.region
        mProf = self.prof
        if tidx == WARPGROUP and count < capacity:  # the first consumer thread
            mProf[base + count * SLICE_WIDTH + 1] = cute.arch.globaltimer()


def slice_records(raw: np.ndarray, grid: int, num_tasks: int) -> list[list[tuple[int, ...]]]:
    """Per CTA, its stamped slices in ring order: (count, task, issued ns, landed ns); a slice
    not issued (past the launch's last) is left out, a stamp not made is 0."""
    records = (max(num_tasks, 1) + grid) * PROF_WIDTH
    flat = np.asarray(raw).reshape(-1)
    capacity = (flat.size - records) // (grid * SLICE_WIDTH)
    region = flat[records : records + grid * capacity * SLICE_WIDTH].reshape(
        grid, capacity, SLICE_WIDTH
    )
    out = []
    for cta in range(grid):
        rows = region[cta]
        issued = np.flatnonzero(rows[:, 0])
        out.append([(int(c), int(rows[c, 2]), int(rows[c, 0]), int(rows[c, 1])) for c in issued])
    return out
