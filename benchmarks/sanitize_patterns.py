"""The megakernel's two shared-memory hand-overs in kernels of a few lines each: a target for
``compute-sanitizer --tool racecheck``, to tell its reports on the megakernel apart from races.

Each pattern is one CTA of 64 threads (warp 0 and warp 1), looping ``ROUNDS`` times over one
shared-memory buffer, and checks what it read (a wrong value counts in ``bad``):

- ``named``: warp 1 writes the buffer, ``bar.arrive`` on named barrier 1; warp 0 ``bar.sync``
  on it, reads. Then the other way round on barrier 2 (warp 0 arrives after reading, warp 1
  syncs before writing again). The megakernel's consumers handed a staged tile's record to
  the storer warp this way (``EPI_FULL_BARRIER``) until they synced on it too.
- ``named_sync``: the same with ``bar.sync`` on both sides (each side waits): how the
  consumers hand the record over (``EPI_FULL_BARRIER``), but in the ``.aligned`` form the
  megakernel no longer uses (``synccheck`` reports it; see ``device.config.named_sync``).
- ``mbarrier``: warp 0 lane 0 writes, arrives on an mbarrier ("full"); every lane of warp 1
  waits on it, reads, ``bar.warp.sync``, and lane 0 arrives on a second one ("empty") that
  warp 0 waits on before it writes again. The megakernel's task queue worked so until every
  reader released its slot itself.
- ``mbarrier_all``: the same with every lane of warp 1 arriving on "empty" (it expects 32
  arrivals): the task queue now (``cutemk.device.ring.queue_put`` / ``queue_get``).
- ``epi``: the staged tile's hand-over as the megakernel does it (with aligned barriers, as
  all the 64-thread patterns; ``worker`` has the megakernel's unaligned ones): warp 1 (the consumers)
  waits on the "empty" mbarrier, writes, ``bar.sync`` on barrier 1; warp 0 (the storer) arrives
  on "empty" with every lane once at the start and after each read, which follows its own
  ``bar.sync`` on barrier 1.
- ``epi_late``: the same with warp 1 sleeping ~20 us before its first write, so warp 0 waits
  long at its first barrier (in the MoE kernel the consumers run SIMT tasks before their first
  ring tile, and racecheck reports the first hand-over there).
- ``named_skew``: ``named_sync`` where the writer also passes ``SKEW`` barriers of its own
  (``bar.sync 3, 32``) before each write, as the megakernel's SIMT group (the first consumer
  warpgroup) passes its own barrier in SIMT bodies the other warps never run. Every racecheck
  report on the MoE kernels pairs a write by that warpgroup with a read by another warp across
  a barrier both took part in.
- ``mbarrier_skew``: ``mbarrier_all`` with the same barriers of the writer's own.
- ``join``: no hand-over; warp 0 passes ``SKEW`` barriers of its own, then both warps meet at
  a whole-CTA ``bar.sync 0``, as the megakernel's roles meet before its close (a target for
  ``--tool synccheck``).

The ``worker*`` patterns are the megakernel's CTA in miniature (384 threads, ``WORKER_CTAS``
CTAs): warp 0 hands task ids to the consumers through a one-slot mbarrier queue; the two
consumer warpgroups run every other task as a SIMT task on the first warpgroup only (its
shared scratch, its own barrier 1 of 128 threads) and the others as "ring tiles": both meet on
barrier 5 (256), consumer thread 0 writes the tile's record, all meet the storer warp (warp 2)
on barrier 3 (288), the storer reads the record and frees the staging area on an mbarrier. This
is the record hand-over the megakernel had until its staged mbarrier. ``worker``: unaligned
named barriers; ``worker_aligned``: ``bar.sync``; ``worker_nosimt``: ring tiles only;
``worker_nreg``: with the worker's ``setmaxnreg`` split; ``worker_one``: one CTA;
``worker_no5``: ring tiles without the consumers' barrier 5 before the record's write. On an
H100 racecheck reports the record (thread 0 writes, the storer reads) in all of these but
``worker_no5``: a barrier of the consumers alone right before the write, then barrier 3 of the
consumers and the storer, is what it does not follow; SIMT tasks, register split, barrier form
and CTA count do not matter. Ring tiles with the record on an mbarrier every consumer thread
arrives on (the megakernel's ``KernelSpec.epi_mbarrier``), 0 reports: ``worker_mbar``;
``worker_verdict`` adds ``claim_last``'s old verdict (thread 0 writes a word, barrier 5, every
consumer reads), ``worker_red`` the verdict through ``barrier.cta.red.or``
(``device.config.named_sync_or``, as ``claim_last`` now), ``worker_wide`` a write by the first
warpgroup read by the second across barrier 2 (a wide SIMT body's staging): 0 reports each
here, though in the MoE kernel racecheck reported the verdict word and the wide bodies'
staged slot rows, both since removed.

PTX orders both: a ``bar.arrive`` synchronizes with the ``bar.sync`` that completes the same
barrier phase, an ``mbarrier.arrive`` (release) with the ``mbarrier.try_wait`` (acquire) that
observes its phase, and ``bar.warp.sync`` orders the lanes of a warp. A racecheck hazard on a
pattern here is a report about the tool's model, not a race.

Run: compute-sanitizer --tool racecheck python benchmarks/sanitize_patterns.py [PATTERN ...]
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import torch  # noqa: E402
from cutlass import Boolean, Int32, cute  # noqa: E402
from cutlass.cute.runtime import from_dlpack  # noqa: E402
from cutlass.experimental import primitives as prims  # noqa: E402

from cutemk.device.config import named_sync, named_sync_or  # noqa: E402
from cutemk.device.ring import init_barriers  # noqa: E402

PATTERNS = (
    "named",
    "named_sync",
    "mbarrier",
    "mbarrier_all",
    "epi",
    "epi_late",
    "named_skew",
    "mbarrier_skew",
    "join",
)
WORKER_PATTERNS = (
    "worker",
    "worker_aligned",
    "worker_nosimt",
    "worker_nreg",
    "worker_one",
    "worker_no5",
    "worker_mbar",
    "worker_verdict",
    "worker_red",
    "worker_wide",
)
WORKER_CTAS = 8
ROUNDS = 64
WORDS = 32  # one word a lane
SKEW = 3  # barriers of its own the writer passes before each write (the ``*_skew`` patterns)


def _thread_ids():
    """In a kernel being traced: the thread's index, its warp (warp-uniform) and its lane."""
    tidx, _, _ = cute.arch.thread_idx()
    return tidx, cute.arch.make_warp_uniform(tidx // 32), tidx % 32


class Pattern:
    def __init__(self, name: str) -> None:
        assert name in PATTERNS, name
        self.name = name

    @cute.kernel
    def kernel(self, mBad: cute.Tensor):
        tidx, warp, lane = _thread_ids()
        smem = cutlass.memory.SmemAllocator()
        buf = smem.allocate_tensor(Int32, cute.make_layout(WORDS), byte_alignment=16)
        bars = smem.allocate_tensor(cutlass.Int64, cute.make_layout(2), byte_alignment=8)
        full, empty = bars.iterator, bars.iterator + 1
        every_lane = cutlass.const_expr(
            self.name in ("mbarrier_all", "mbarrier_skew", "epi", "epi_late")
        )
        skew = cutlass.const_expr(self.name.endswith("_skew"))
        if tidx == 0:
            init_barriers(full, 1, 1)
            init_barriers(empty, 1, 32 if every_lane else 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        bad = Int32(0)
        if cutlass.const_expr(self.name == "join"):
            if warp == 0:
                for _ in cutlass.range_constexpr(SKEW):
                    cute.arch.barrier(barrier_id=3, number_of_threads=32)
            cute.arch.sync_threads()
        elif cutlass.const_expr(self.name in ("epi", "epi_late")):
            if warp == 1:  # consumers: wait until the buffer is free, write, hand over
                if cutlass.const_expr(self.name == "epi_late"):
                    for _ in cutlass.range(20, unroll=1):
                        prims.nanosleep(1000)
                for r in cutlass.range(ROUNDS, unroll=1):
                    cute.arch.mbarrier_wait(empty, r & 1)
                    buf[lane] = r * WORDS + lane
                    cute.arch.barrier(barrier_id=1, number_of_threads=64)
            else:  # storer: free at the start, then read each round and free again
                cute.arch.mbarrier_arrive(empty)
                for r in cutlass.range(ROUNDS, unroll=1):
                    cute.arch.barrier(barrier_id=1, number_of_threads=64)
                    if buf[lane] != r * WORDS + lane:
                        bad = bad + 1
                    cute.arch.mbarrier_arrive(empty)
        elif cutlass.const_expr(self.name in ("mbarrier", "mbarrier_all", "mbarrier_skew")):
            if warp == 0:
                for r in cutlass.range(ROUNDS, unroll=1):
                    cute.arch.mbarrier_wait(empty, (r & 1) ^ 1)
                    if cutlass.const_expr(skew):
                        for _ in cutlass.range_constexpr(SKEW):
                            cute.arch.barrier(barrier_id=3, number_of_threads=32)
                    if lane == 0:
                        for j in cutlass.range_constexpr(WORDS):
                            buf[j] = r * WORDS + j
                        cute.arch.mbarrier_arrive(full)
                    cute.arch.sync_warp()
            else:
                for r in cutlass.range(ROUNDS, unroll=1):
                    cute.arch.mbarrier_wait(full, r & 1)
                    if buf[lane] != r * WORDS + lane:
                        bad = bad + 1
                    if cutlass.const_expr(every_lane):
                        cute.arch.mbarrier_arrive(empty)
                    else:
                        cute.arch.sync_warp()
                        if lane == 0:
                            cute.arch.mbarrier_arrive(empty)
        else:
            sync = cutlass.const_expr(self.name in ("named_sync", "named_skew"))
            if warp == 1:  # writes, then hands the buffer over on barrier 1
                for r in cutlass.range(ROUNDS, unroll=1):
                    if r > 0:
                        cute.arch.barrier(barrier_id=2, number_of_threads=64)
                    if cutlass.const_expr(skew):
                        for _ in cutlass.range_constexpr(SKEW):
                            cute.arch.barrier(barrier_id=3, number_of_threads=32)
                    buf[lane] = r * WORDS + lane
                    if cutlass.const_expr(sync):
                        cute.arch.barrier(barrier_id=1, number_of_threads=64)
                    else:
                        cute.arch.barrier_arrive(barrier_id=1, number_of_threads=64)
            else:  # reads, then hands it back on barrier 2
                for r in cutlass.range(ROUNDS, unroll=1):
                    cute.arch.barrier(barrier_id=1, number_of_threads=64)
                    if buf[lane] != r * WORDS + lane:
                        bad = bad + 1
                    if r + 1 < ROUNDS:
                        if cutlass.const_expr(sync):
                            cute.arch.barrier(barrier_id=2, number_of_threads=64)
                        else:
                            cute.arch.barrier_arrive(barrier_id=2, number_of_threads=64)
        if bad != 0:
            cute.arch.atomic_add(mBad.iterator, bad, sem="relaxed", scope="gpu")

    @cute.jit
    def launch(self, mBad: cute.Tensor):
        self.kernel(mBad).launch(grid=(1, 1, 1), block=(64, 1, 1))


Pattern.kernel.set_name_prefix("cutemk_pattern", remove_cutlass_symbol=True)
Pattern.launch.set_name_prefix("cutemk_pattern_launch", remove_cutlass_symbol=True)


class Worker:
    """The ``worker*`` patterns (see the module's docstring)."""

    def __init__(self, name: str) -> None:
        assert name in WORKER_PATTERNS, name
        self.name = name

    def _sync(self, barrier_id: int, threads: int) -> None:
        if self.name == "worker_aligned":
            cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
        else:
            named_sync(barrier_id, threads)

    @cute.kernel
    def kernel(self, mBad: cute.Tensor):
        tidx, warp, lane = _thread_ids()
        smem = cutlass.memory.SmemAllocator()
        rec = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)
        slot = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)
        scratch = smem.allocate_tensor(Int32, cute.make_layout(128), byte_alignment=16)
        bars = smem.allocate_tensor(cutlass.Int64, cute.make_layout(4), byte_alignment=8)
        q_full, q_empty, epi_free = bars.iterator, bars.iterator + 1, bars.iterator + 2
        rec_full = bars.iterator + 3
        name = self.name
        simt = cutlass.const_expr(name in ("worker", "worker_aligned", "worker_nreg", "worker_one"))
        nreg = cutlass.const_expr(name == "worker_nreg")
        # the record handed to the storer on an mbarrier every consumer thread arrives on
        mbar = cutlass.const_expr(
            name in ("worker_mbar", "worker_verdict", "worker_red", "worker_wide")
        )
        meet = cutlass.const_expr(name != "worker_no5")  # the consumers meet before the write
        if tidx == 0:
            init_barriers(q_full, 1, 1)
            init_barriers(q_empty, 1, 256)  # every consumer thread frees the slot
            init_barriers(epi_free, 1, 32)  # every storer lane frees the staging area
            init_barriers(rec_full, 1, 256)  # every consumer thread: staged
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        bad = Int32(0)
        if warp < 4:
            if cutlass.const_expr(nreg):
                cute.arch.setmaxregister_decrease(40)
            if warp == 0:  # the producer: ROUNDS task ids, then -1
                for r in cutlass.range(ROUNDS + 1, unroll=1):
                    cute.arch.mbarrier_wait(q_empty, (r & 1) ^ 1)
                    if lane == 0:
                        v = Int32(r)
                        if r >= ROUNDS:
                            v = Int32(-1)
                        slot[0] = v
                        cute.arch.mbarrier_arrive(q_full)
                    cute.arch.sync_warp()
            if warp == 2:  # the storer: each staged record, in order, until -1
                cute.arch.mbarrier_arrive(epi_free)
                last = Int32(-1)
                alive = Boolean(True)
                rcount = Int32(0)
                while alive:
                    if cutlass.const_expr(mbar):
                        cute.arch.mbarrier_wait(rec_full, rcount & 1)
                        rcount = rcount + 1
                    else:
                        self._sync(3, 288)
                    v = rec[0]
                    alive = v >= 0
                    if alive:
                        if v <= last:
                            bad = bad + 1
                        last = v
                        cute.arch.mbarrier_arrive(epi_free)
        else:
            if cutlass.const_expr(nreg):
                cute.arch.setmaxregister_increase(232)
            ctid = tidx - 128
            qcount = Int32(0)
            ecount = Int32(0)
            alive = Boolean(True)
            while alive:
                cute.arch.mbarrier_wait(q_full, qcount & 1)
                t = slot[0]
                cute.arch.mbarrier_arrive(q_empty)
                qcount = qcount + 1
                alive = t >= 0
                if alive:
                    if simt and t % 2 == 0:  # a SIMT task: the first warpgroup alone
                        if ctid < 128:
                            scratch[ctid] = t * 128 + ctid
                            self._sync(1, 128)
                            n = (ctid + 1) % 128
                            if scratch[n] != t * 128 + n:
                                bad = bad + 1
                            self._sync(1, 128)
                    else:  # a ring tile: staged, its record handed to the storer
                        if cutlass.const_expr(name == "worker_verdict"):
                            # claim_last's verdict: thread 0 decides, every thread reads
                            self._sync(5, 256)
                            if ctid == 0:
                                scratch[0] = t % 3
                            self._sync(5, 256)
                            if scratch[0] != t % 3:
                                bad = bad + 1
                        if cutlass.const_expr(name == "worker_red"):
                            # the same verdict from the barrier itself, no shared word
                            verdict = named_sync_or(5, 256, (ctid == 0) & (t % 3 == 0))
                            if verdict != (t % 3 == 0):
                                bad = bad + 1
                        if cutlass.const_expr(name == "worker_wide"):
                            # moe_permute's rows: the first warpgroup writes, the second reads
                            self._sync(2, 256)
                            if ctid < 128:
                                scratch[ctid] = t * 128 + ctid
                            self._sync(2, 256)
                            if ctid >= 128:
                                if scratch[ctid - 128] != t * 128 + ctid - 128:
                                    bad = bad + 1
                        cute.arch.mbarrier_wait(epi_free, ecount & 1)
                        if cutlass.const_expr(meet):
                            self._sync(5, 256)
                        if ctid == 0:
                            rec[0] = t
                        if cutlass.const_expr(mbar):
                            cute.arch.mbarrier_arrive(rec_full)
                        else:
                            self._sync(3, 288)
                        ecount = ecount + 1
            cute.arch.mbarrier_wait(epi_free, ecount & 1)  # stop the storer
            if ctid == 0:
                rec[0] = Int32(-1)
            if cutlass.const_expr(mbar):
                cute.arch.mbarrier_arrive(rec_full)
            else:
                self._sync(3, 288)
        cute.arch.sync_threads()
        if bad != 0:
            cute.arch.atomic_add(mBad.iterator, bad, sem="relaxed", scope="gpu")

    @cute.jit
    def launch(self, mBad: cute.Tensor):
        ctas = 1 if self.name == "worker_one" else WORKER_CTAS
        self.kernel(mBad).launch(grid=(ctas, 1, 1), block=(384, 1, 1))


Worker.kernel.set_name_prefix("cutemk_worker_pattern", remove_cutlass_symbol=True)
Worker.launch.set_name_prefix("cutemk_worker_pattern_launch", remove_cutlass_symbol=True)


def compile_pattern(name: str, options: str = ""):
    """The compiled launch of pattern ``name`` (no GPU needed), called with an int32 tensor;
    ``options`` go to ``cute.compile`` (e.g. ``--keep-ptx --dump-dir=DIR``)."""
    fake = cute.runtime.make_fake_compact_tensor(Int32, (1,))
    pattern = Worker(name) if name in WORKER_PATTERNS else Pattern(name)
    return cute.compile(pattern.launch, fake, options=options)


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or [*PATTERNS, *WORKER_PATTERNS]
    failed = 0
    for name in names:
        bad = torch.zeros(1, dtype=torch.int32, device="cuda")
        compile_pattern(name)(from_dlpack(bad))
        torch.cuda.synchronize()
        print(f"pattern {name}: {ROUNDS} rounds, {int(bad.item())} wrong reads")
        failed += int(bad.item() != 0)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
