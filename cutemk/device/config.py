"""Compile-time facts shared by every device function of the megakernel.

The megakernel's CTA is warp-specialized (see :class:`WorkerShape`): one producer warpgroup
(task fetch, event waits, TMA loads) and consumer warpgroups (wgmma, SIMT tile bodies,
epilogues). A SIMT tile body (``TileOp.device_tile``) runs on one group of ``NUM_THREADS``
threads, the *SIMT group*, and synchronises with :func:`simt_sync` (a named barrier of exactly
those threads), never with a whole-CTA barrier: the producer warps do not take part. The op
test harness (``cutemk.device.harness``) runs the same bodies on CTAs of ``NUM_THREADS``. A
*wide* body (``TileOp.simt_threads`` = ``SIMT_WIDE_THREADS``) runs on both consumer warpgroups
and syncs with ``simt_sync(SIMT_WIDE_THREADS)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from cutlass import Boolean, Int32, cute
from cutlass._mlir.dialects import nvvm
from cutlass.cutlass_dsl import dsl_user_op

NUM_THREADS: int = 128
"""Threads of the SIMT group (one warpgroup): the thread count every ``device_tile`` sees."""

WARP_SIZE: int = 32
NUM_WARPS: int = NUM_THREADS // WARP_SIZE
WARPGROUP: int = 128

SIMT_WIDE_THREADS: int = 2 * WARPGROUP
"""Threads of a *wide* SIMT body (``TileOp.simt_threads``): both consumer warpgroups, for
latency-bound copies and gathers that want twice the loads in flight an SM without more
registers a thread."""

# Named barrier ids (0 is the whole CTA, used only at kernel entry and exit).
SIMT_BARRIER = 1
"""The SIMT group's barrier (``NUM_THREADS`` threads)."""
SIMT_WIDE_BARRIER = 2
"""A wide SIMT body's barrier (``SIMT_WIDE_THREADS`` threads)."""
EPI_FULL_BARRIER = 3
"""Consumers -> storer warp: a tile's output is staged in shared memory (sync on both sides)."""
EPI_EMPTY_BARRIER = 4
"""Storer warp -> consumers: the staging buffer has been read by the TMA store."""
CONSUMER_BARRIER = 5
"""Every consumer thread (both consumer warpgroups), inside a ring op's compute."""
MMA_TURN_BARRIER = 6
"""Consumer warpgroup ``w``'s turn to issue its tensor-core work is barrier ``6 + w`` (both
consumer warpgroups: one syncs, the other arrives), so the two alternate on the tensor cores
while the other runs its SIMT part (the prefill attention tile's softmax)."""
CONSUMER_STOP_BARRIER = 8
"""Every consumer thread, once a task record with the watchdog: their one verdict on leaving
(``barrier.cta.red.or`` of each thread's view of the abort flag), so no warp stays in a task's
named barriers while another has left for the kernel's closing barrier."""
STORER_WARP = 2
"""Warp of the producer warpgroup that stores ring tiles and publishes them."""

REGISTER_FILE = 65536
"""32-bit registers per SM (Hopper)."""


@dsl_user_op
def named_sync(barrier_id: int, threads: int, *, loc=None, ip=None) -> None:
    """Named barrier ``barrier_id`` of ``threads`` threads, waiting: ``barrier.cta.sync`` without
    ``.aligned``. Every named barrier of the megakernel goes through here (or
    :func:`named_arrive`): its participants are warps of different roles, or the same warps
    coming from different code (a SIMT body on one warpgroup, the worker's loop on another), and
    the ``.aligned`` form (``bar.sync``) requires every participant to execute the same
    instruction; ``compute-sanitizer --tool synccheck`` reports the aligned form there as
    "divergent thread(s) in block" (``benchmarks/sanitize_patterns.py named_sync``)."""
    nvvm.barrier_cta_sync(
        Int32(barrier_id).ir_value(loc=loc, ip=ip),
        thread_count=Int32(threads).ir_value(loc=loc, ip=ip),
        aligned=False,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def named_sync_or(barrier_id: int, threads: int, pred, *, loc=None, ip=None) -> Boolean:
    """:func:`named_sync` that also ORs ``pred`` over its participants (``barrier.cta.red.or``,
    not ``.aligned``): every thread gets True if any passed True. Hands one thread's decision
    to the others through the barrier itself, with no shared-memory word to write and read.
    Every participant must reach it from the same call site: ptxas 13 emits the same code for
    the unaligned and the ``.aligned`` form of ``barrier.red`` (unlike ``barrier.sync``), so it
    is not a hand-over between roles that run different code."""
    p = Boolean(pred).ir_value(loc=loc, ip=ip)
    r = nvvm.barrier_cta_red(
        p,
        Int32(barrier_id).ir_value(loc=loc, ip=ip),
        nvvm.BarrierReduxKind.OR,
        thread_count=Int32(threads).ir_value(loc=loc, ip=ip),
        aligned=False,
        loc=loc,
        ip=ip,
    )
    return Boolean(r)


def named_arrive(barrier_id: int, threads: int) -> None:
    """Arrive on named barrier ``barrier_id`` of ``threads`` threads without waiting
    (``barrier.cta.arrive``, not ``.aligned``: see :func:`named_sync`)."""
    cute.arch.barrier_arrive(barrier_id=barrier_id, number_of_threads=threads, aligned=False)


def simt_sync(threads: int = NUM_THREADS) -> None:
    """Barrier of a SIMT body's threads (``TileOp.simt_threads``: the SIMT group, or both
    consumer warpgroups for a wide body): what ``sync_threads`` was for a tile body."""
    if threads == NUM_THREADS:
        named_sync(SIMT_BARRIER, NUM_THREADS)
    else:
        assert threads == SIMT_WIDE_THREADS, threads
        named_sync(SIMT_WIDE_BARRIER, SIMT_WIDE_THREADS)


@dataclass(frozen=True)
class WorkerShape:
    """Shape of the megakernel's CTA: warpgroup 0 produces, the others consume.

    ``producer_regs`` / ``consumer_regs`` are the per-thread register counts each role moves to
    with ``setmaxnreg`` (the producer gives registers up so the consumers' accumulators fit).
    ``ring_stages`` shared-memory slots of ``slot_bytes`` each carry TMA loads across tasks;
    ``epi_bytes`` stage a tile's output for its TMA store; ``scratch_bytes`` belong to SIMT
    bodies; ``task_slots`` task records are in flight from the producer to the consumers.
    Every barrier's arrive count is derived here and checked by :meth:`check`.
    """

    consumer_warpgroups: int = 2
    producer_regs: int = 40
    consumer_regs: int = 232
    ring_stages: int = 0
    slot_bytes: int = 0
    epi_bytes: int = 0
    scratch_bytes: int = 16
    task_slots: int = 4

    @property
    def threads(self) -> int:
        return WARPGROUP * (1 + self.consumer_warpgroups)

    @property
    def consumer_threads(self) -> int:
        return WARPGROUP * self.consumer_warpgroups

    @property
    def store_threads(self) -> int:
        """Threads of the epilogue barriers: every consumer and the storer warp."""
        return self.consumer_threads + WARP_SIZE

    @property
    def consumer_warps(self) -> int:
        """Arrivals that free a ring slot: one elected lane per consumer warp."""
        return self.consumer_threads // WARP_SIZE

    @property
    def queue_readers(self) -> int:
        """Arrivals that free a task slot: every consumer thread (``ring.queue_get``)."""
        return self.consumer_threads

    @property
    def ring_bytes(self) -> int:
        return self.ring_stages * self.slot_bytes

    def check(self) -> None:
        """Host-side invariants; a violation here would be a hang or a bad launch on the GPU."""
        # the ring ops' consumer barriers and the wide SIMT bodies' (``SIMT_WIDE_THREADS``)
        # count exactly two consumer warpgroups
        assert self.consumer_warpgroups == 2, "the worker has two consumer warpgroups"
        assert NUM_THREADS == WARPGROUP, "the SIMT group is one consumer warpgroup"
        regs = WARPGROUP * self.producer_regs + self.consumer_threads * self.consumer_regs
        assert regs <= REGISTER_FILE, f"setmaxnreg split needs {regs} > {REGISTER_FILE} registers"
        assert self.producer_regs % 8 == 0 and self.consumer_regs % 8 == 0  # setmaxnreg unit
        assert 24 <= self.producer_regs <= 256 and 24 <= self.consumer_regs <= 256
        assert self.ring_stages == 0 or (self.ring_stages >= 2 and self.slot_bytes % 1024 == 0)
        assert self.epi_bytes % 1024 == 0 and self.task_slots >= 2
