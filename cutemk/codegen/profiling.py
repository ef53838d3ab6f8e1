"""Stamps of a profiled megakernel taken inside the ring pipeline: when a ring tile's first slice
was found landed (``profile=True``), and (``profile="slices"``) when the producer issued each
ring slice and when the consumers found it landed, to tell a slow weight stream's cause (slices
late to land: the loads; slices issued late: the slots, i.e. the consumers).

The profile buffer (int64) holds a record per task, then one per CTA (``layout.PROF_WIDTH``
words each), then with slices a region per CTA of ``capacity`` slice records of
``SLICE_WIDTH`` words: (issued ns, landed ns, task, phases), indexed by the CTA's ring count
(its slices since the launch began, ``cutemk.device.ring``). The capacity is what the region's
size leaves a CTA, so the kernel needs no argument for it; a slice past it is not stamped, and
the CTA's record counts the slices it issued (``layout.CTA_SLICES``), so the host knows.

``phases`` (0 unless the op stamps it): where a tile that computes slice by slice spent one
slice's time on its first consumer thread, in SM cycles, ``PHASE_FIELDS`` of ``PHASE_BITS``
each (saturated). The prefill attention tile (``ops.attention_prefill_sm90``) stamps them:
its loop top (the slot's wait, o's rescale), the wait for its turn on the tensor cores, its S
wgmma, the mask and softmax, and the wait for the previous slice's P V.
"""

from __future__ import annotations

from typing import Any, Sequence

import cutlass
import numpy as np
from cutlass import Int32, cute

from ..device.config import WARPGROUP
from .layout import PROF_LANDED, PROF_WIDTH, SLICE_WIDTH
from .lower import R_NODE, REC_WIDTH

PHASE_FIELDS = ("top", "turn_wait", "s_wgmma", "softmax", "pv_wait")
"""The fields of a slice's ``phases`` word, lowest bits first (see the module doc)."""
PHASE_BITS = 12
PHASE_MAX = (1 << PHASE_BITS) - 1


def slice_capacity(ring_slices: Sequence[int], queue_ptr, queue_rec, num_tasks_by_node) -> int:
    """Slice records a CTA's region holds: the most ring slices one CTA's static queue can
    take (``queue_ptr`` / ``queue_rec`` of the lowered plan; a tile counts its op's most
    slices); without static queues (dynamic) twice a CTA's share of every ring task's plus
    the most one task takes (an SM that pops more than that loses the rest's stamps)."""
    slices = np.asarray(ring_slices, dtype=np.int64)
    grid = len(queue_ptr) - 1
    if int(queue_ptr[-1]) == 0:
        counts = np.asarray(num_tasks_by_node, dtype=np.int64)
        total = int(np.dot(slices, counts))
        most = int(slices[counts > 0].max(initial=0))
        return max(min(total, 2 * -(-total // grid) + most), 1)
    nodes = np.asarray(queue_rec).reshape(-1, REC_WIDTH)[: int(queue_ptr[-1]), R_NODE]
    upto = np.concatenate(([0], np.cumsum(slices[nodes])))  # slices before each position
    sums = upto[queue_ptr[1:]] - upto[queue_ptr[:-1]]
    return max(int(sums.max(initial=0)), 1)


def profile_words(num_tasks: int, grid: int, capacity: int | None) -> int:
    """int64 words of the profile buffer: the task and CTA records, and with ``capacity`` the
    CTAs' slice regions."""
    words = record_words(num_tasks, grid)
    if capacity is not None:
        words += grid * capacity * SLICE_WIDTH
    return words


def record_words(num_tasks: int, grid: int) -> int:
    """int64 words of the task and CTA records (what the host reads back of a profile)."""
    return (max(num_tasks, 1) + grid) * PROF_WIDTH


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
    thread, when a ring tile's first slice was found landed (its task record), and with a
    slice region (``profile="slices"``) every slice's landing
    (``cutemk.device.ring.consumer_wait`` calls :meth:`landed` after the slot's full barrier).
    The first consumer thread names its current tile in ``sCtl`` (:meth:`begin`): words 0 and
    1, the task and its first ring count, written and read by that thread alone."""

    def __init__(self, wait: Any, mProf: cute.Tensor, sCtl: cute.Tensor, region) -> None:
        self.wait = wait
        self.prof = mProf
        self.ctl = sCtl
        self.region = region

    def __call__(self, bar, parity, code: int) -> None:
        self.wait(bar, parity, code)

    @staticmethod
    @cute.jit
    def begin(sCtl: cute.Tensor, task: Int32, first: Int32, ctid: Int32):
        """The first consumer thread, before a ring tile's compute: the tile's task and ring
        count."""
        if ctid == 0:
            sCtl[0] = task
            sCtl[1] = first

    @cute.jit
    def phases(self, count: Int32, deltas, ctid: Int32):
        """Consumer thread ``ctid`` 0: slice ``count``'s ``phases`` word from ``deltas`` (one
        Int64 cycle count per ``PHASE_FIELDS`` entry). Nothing without a slice region."""
        if cutlass.const_expr(len(self.region) > 0):
            mProf = self.prof
            base, capacity = self.region
            word = pack_phases(deltas)
            if ctid == 0 and count < capacity:
                mProf[base + count * SLICE_WIDTH + 3] = word

    @cute.jit
    def landed(self, count: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        mProf, sCtl = self.prof, self.ctl
        if tidx == WARPGROUP:  # the first consumer thread
            now = cute.arch.globaltimer()
            if count == sCtl[1]:
                mProf[sCtl[0] * PROF_WIDTH + PROF_LANDED] = now
            if cutlass.const_expr(len(self.region) > 0):
                base, capacity = self.region
                if count < capacity:
                    mProf[base + count * SLICE_WIDTH + 1] = now


@cute.jit
def pack_phases(deltas) -> cutlass.Int64:
    """``deltas`` (Int64 cycle counts, ``PHASE_FIELDS`` order) into one word, each clamped to
    [0, ``PHASE_MAX``]."""
    word = cutlass.Int64(0)
    for i in cutlass.range_constexpr(len(deltas)):
        v = deltas[i]
        if v < cutlass.Int64(0):
            v = cutlass.Int64(0)
        if v > cutlass.Int64(PHASE_MAX):
            v = cutlass.Int64(PHASE_MAX)
        word = word | (v << (PHASE_BITS * i))
    return word


def unpack_phases(word: int) -> dict[str, int]:
    """A ``phases`` word as ``{field: cycles}`` (``PHASE_MAX``: that many or more)."""
    return {n: (int(word) >> (PHASE_BITS * i)) & PHASE_MAX for i, n in enumerate(PHASE_FIELDS)}


def slice_records(raw: np.ndarray, grid: int, num_tasks: int) -> list[list[tuple[int, ...]]]:
    """Per CTA, its stamped slices in ring order: (count, task, issued ns, landed ns, phases);
    a slice not issued (past the launch's last, or past the region's capacity) is left out, a
    stamp not made is 0."""
    records = record_words(num_tasks, grid)
    flat = np.asarray(raw).reshape(-1)
    capacity = (flat.size - records) // (grid * SLICE_WIDTH)
    region = flat[records : records + grid * capacity * SLICE_WIDTH].reshape(
        grid, capacity, SLICE_WIDTH
    )
    out = []
    for cta in range(grid):
        rows = region[cta]
        issued = np.flatnonzero(rows[:, 0])
        out.append(
            [
                (int(c), int(rows[c, 2]), int(rows[c, 0]), int(rows[c, 1]), int(rows[c, 3]))
                for c in issued
            ]
        )
    return out
