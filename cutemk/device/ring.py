"""mbarrier pipelines of the warp-specialized megakernel, with state that outlives a task.

Two pipelines connect the producer warp to the consumer warps:

- the **ring**: ``stages`` shared-memory slots that TMA fills (full barrier: one arrive plus
  the slot's transaction bytes) and the consumers free (empty barrier: one arrive per
  consumer warp);
- the **task queue**: task records handed from the producer (full: one arrive, by the lane
  that wrote the record) to the consumers (empty: one arrive per consumer thread).

Each side's state is a running count of the slots it has used since the launch began:
slot ``count % stages``, parity ``(count // stages) & 1``. One Int32 per side carries across
tasks (a tile may take any number of slices), so task i+1's loads are issued while task i
computes. The producer waits for the opposite parity on the empty barrier (a fresh barrier
counts as having completed the phase before 0, so the first lap never blocks).

mbarrier arrive / wait are release / acquire at CTA scope: what the producer did before an
arrive (event acquires included) is visible to a consumer after its wait.

Every wait goes through ``wait(bar, parity, code)`` (default: an unbounded ``mbarrier_wait``);
the megakernel's watchdog passes a bounded wait instead, which gives up and aborts the launch
(``code`` names the pipeline and side in the error: one of the ``WAIT_*`` values below).
"""

from __future__ import annotations

import cutlass
from cutlass import Int32, cute

from .config import EPI_EMPTY_BARRIER, named_sync

WAIT_RING_FULL, WAIT_RING_EMPTY, WAIT_QUEUE_FULL, WAIT_QUEUE_EMPTY = 1, 2, 3, 4
WAIT_EPI_EMPTY = 5
WAIT_NAMES = {
    WAIT_RING_FULL: "consumers waited for a ring slot's loads",
    WAIT_RING_EMPTY: "the producer waited for a ring slot to be freed",
    WAIT_QUEUE_FULL: "consumers waited for a task record",
    WAIT_QUEUE_EMPTY: "the producer waited for a task slot to be freed",
    WAIT_EPI_EMPTY: "consumers waited for the staging buffer's release by the storer",
}


def plain_wait(bar, parity, code: int) -> None:
    cute.arch.mbarrier_wait(bar, parity)


@cute.jit
def init_barriers(bars, n: int, count: int):
    """One thread: ``n`` mbarriers at ``bars`` expecting ``count`` arrivals each."""
    for i in cutlass.range_constexpr(n):
        cute.arch.mbarrier_init(bars + i, count)


@cute.jit
def producer_acquire(
    full, empty, count: Int32, stages: int, tx_bytes: int, wait=plain_wait
) -> Int32:
    """A whole warp: wait until slot ``count`` is free, arm its full barrier for ``tx_bytes``
    (one elected lane), and return the slot index."""
    idx = count % stages
    wait(empty + idx, ((count // stages) & 1) ^ 1, WAIT_RING_EMPTY)
    with cute.arch.elect_one():
        cute.arch.mbarrier_arrive_and_expect_tx(full + idx, tx_bytes)
    return idx


@cute.jit
def consumer_wait(full, count: Int32, stages: int, wait=plain_wait) -> Int32:
    """Wait until slot ``count`` is filled; returns the slot index. A ``wait`` with a
    ``landed(count)`` (a profiled kernel's, ``cutemk.codegen.profiling.LandedStamps``) is told
    of the slice after the wait."""
    idx = count % stages
    wait(full + idx, (count // stages) & 1, WAIT_RING_FULL)
    landed = getattr(wait, "landed", None)
    if cutlass.const_expr(landed is not None):
        landed(count)
    return idx


@cute.jit
def consumer_release(empty, count: Int32, stages: int, lane: Int32):
    """Each consumer warp, after every lane is done with slot ``count``: one arrive."""
    if lane == 0:
        cute.arch.mbarrier_arrive(empty + count % stages)


@cute.jit
def epi_acquire(epi_free, threads: int):
    """Consumers, before their first write of the staging buffer in a ring tile: the previous
    ring tile's store has read it. ``epi_free`` None: the named barrier ``EPI_EMPTY_BARRIER``
    of ``threads`` (the storer arrives on it); else ``(bar, count, wait)``: the storer's
    release mbarrier (every storer lane arrives once a tile, and once at the start), waited
    at the phase of ``count``, the ring tiles these consumers staged before this one
    (``KernelSpec.epi_mbarrier``: a hand-over ``compute-sanitizer --tool racecheck``
    follows, where it does not follow a named barrier's arrive -> sync)."""
    if cutlass.const_expr(epi_free is None):
        named_sync(EPI_EMPTY_BARRIER, threads)
    else:
        bar, count, wait = epi_free
        wait(bar, count & 1, WAIT_EPI_EMPTY)


@cute.jit
def queue_put(
    full, empty, sQueue, count: Int32, slots: int, width: int, rec, lane: Int32, wait=plain_wait
):
    """Producer warp: write record ``rec`` (``width`` Int32 values) into queue slot ``count``."""
    idx = count % slots
    wait(empty + idx, ((count // slots) & 1) ^ 1, WAIT_QUEUE_EMPTY)
    if lane == 0:
        for f in cutlass.range_constexpr(width):
            sQueue[idx * width + f] = rec[f]
        cute.arch.mbarrier_arrive(full + idx)
    cute.arch.sync_warp()


@cute.jit
def queue_get(full, empty, sQueue, count: Int32, slots: int, width: int, wait=plain_wait):
    """Every reading thread: the record in queue slot ``count`` (a tuple of Int32); each reader
    releases the slot itself (the empty barrier counts every reading thread), so each read is
    ordered before the producer's next write by that thread's own arrive (release). One arrive
    a warp after ``bar.warp.sync`` is ordered as well, but ptxas drops the warp barrier of a
    converged warp and ``compute-sanitizer --tool racecheck`` then reports every slot reuse
    (``benchmarks/sanitize_patterns.py``)."""
    idx = count % slots
    wait(full + idx, (count // slots) & 1, WAIT_QUEUE_FULL)
    rec = tuple(sQueue[idx * width + f] for f in range(width))
    cute.arch.mbarrier_arrive(empty + idx)
    return rec
