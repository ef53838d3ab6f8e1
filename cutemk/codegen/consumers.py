"""The megakernel's consumer warpgroups and the producer warpgroup's storer and completer
warps (see ``megakernel``): run tiles, stage ring tiles for the storer, publish tiles.

A mixin of :class:`cutemk.codegen.megakernel.Megakernel`; ``L`` is the launch context
(``megakernel._Launch``).
"""

from __future__ import annotations

import cutlass
from cutlass import Boolean, Int32, Int64, cute

from ..device.config import (
    CONSUMER_STOP_BARRIER,
    EPI_EMPTY_BARRIER,
    EPI_FULL_BARRIER,
    NUM_THREADS,
    SIMT_WIDE_THREADS,
    named_arrive,
    named_sync,
    named_sync_or,
    simt_sync,
)
from ..device.config import (
    WARP_SIZE as WARP,
)
from ..device.ring import epi_acquire, queue_get, queue_put
from ..device.sync import notify_event
from .layout import (
    PROF_END,
    PROF_SM_NODE,
    PROF_STAGED,
    PROF_START,
    PROF_WIDTH,
    D,
    P,
)
from .lower import ABORT, R_C0, R_C1, R_LIVE, R_NHI, R_NLO, R_NODE, R_TASK, R_WORD, REC_WIDTH
from .profiling import LandedStamps


class ConsumerRoles:
    # -- consumers ----------------------------------------------------------------------------
    @cute.jit
    def _consumer(self, L, ctid):
        """Consumer warpgroups: run the tasks the producer hands over until a stop record.
        Dynamic mode: consumer warp 0 hands each finished task to the completer warp."""
        tensors, prog, dev, mProf = L.tensors, L.prog, L.dev, L.prof
        bars, sQueue, sDone, sEpiRec = L.bars, L.sQueue, L.sDone, L.sEpiRec
        ring, epi, scratch, timeout_ns = L.ring, L.epi, L.scratch, L.timeout_ns
        w = self.w
        pwait = self._pipeline_wait(dev, timeout_ns)
        ring_wait = pwait  # the ring ops' waits: profiled, they stamp the slices' landing
        if cutlass.const_expr(self.spec.profile):
            ring_wait = LandedStamps(pwait, mProf, L.sCtl, L.slices)
        state = dev[D["state"]]
        q_full, q_empty, r_full, r_empty, d_full, d_empty = bars
        lane = ctid % WARP
        qcount = Int32(0)
        rcount = Int32(0)
        dcount = Int32(0)
        ecount = Int32(0)  # ring tiles staged so far (the staging buffer's release phase)
        alive = Boolean(True)
        while alive:
            rec = queue_get(q_full, q_empty, sQueue, qcount, w.task_slots, REC_WIDTH, pwait)
            qcount = qcount + 1
            t, node, c0, c1 = rec[R_TASK], rec[R_NODE], rec[R_C0], rec[R_C1]
            alive = t >= 0
            if cutlass.const_expr(self.spec.watchdog):  # a gave-up wait may have read a stale slot
                # one verdict for every consumer thread: a warp that saw the abort flag raised
                # and left while another ran the task would leave that one waiting in the
                # task's named barriers (and itself at the closing barrier) for ever
                seen = cute.arch.load(state.iterator + ABORT, Int32, sem="relaxed", scope="gpu")
                if named_sync_or(CONSUMER_STOP_BARRIER, w.consumer_threads, seen != 0):
                    alive = Boolean(False)
            if alive:
                start = Int64(0)
                if cutlass.const_expr(self.spec.profile):
                    start = cute.arch.globaltimer()
                is_ring = Boolean(False)
                for k in cutlass.range_constexpr(self.num_nodes):
                    if cutlass.const_expr(self.ring_of[k] is not None):
                        live = node == k
                        if cutlass.const_expr(self.has_exists[k]):
                            live = live and rec[R_LIVE] != 0  # the producer's verdict
                        if live:
                            is_ring = Boolean(True)
                            if cutlass.const_expr(self.spec.profile):
                                LandedStamps.begin(L.sCtl, t, rcount, ctid)
                            rcount = self.spec.ops[k].device_compute(
                                tensors[k],
                                c0,
                                c1,
                                rec[R_WORD],
                                r_full,
                                r_empty,
                                rcount,
                                ring,
                                w.ring_stages,
                                w.slot_bytes,
                                epi,
                                ctid,
                                ring_wait,
                                self._epi_free(L, ecount, pwait),
                            )
                if is_ring:  # the storer warp stores, notifies and profiles the tile
                    if ctid == 0:
                        for f in cutlass.range_constexpr(REC_WIDTH):
                            sEpiRec[f] = rec[f]
                        if cutlass.const_expr(self.spec.profile):
                            mProf[t * PROF_WIDTH + PROF_START] = start
                    self._epi_staged(L)
                    ecount = ecount + 1
                else:  # a SIMT tile, or a ring tile that does not exist (nothing to store)
                    wide = Boolean(False)  # a wide body's task: the SIMT group runs it below
                    for k in cutlass.range_constexpr(self.num_nodes):
                        if cutlass.const_expr(self._simt(k, SIMT_WIDE_THREADS)):
                            if node == k:
                                wide = Boolean(True)
                    if ctid < NUM_THREADS and not wide:  # the SIMT group
                        if self._exists(tensors, node, c0, c1):
                            for k in cutlass.range_constexpr(self.num_nodes):
                                if cutlass.const_expr(self._simt(k, NUM_THREADS)):
                                    if node == k:
                                        self.spec.ops[k].device_tile(
                                            tensors[k], c0, c1, ctid, scratch
                                        )
                            if cutlass.const_expr(self.fence_async):
                                cute.arch.fence_proxy("async.global")
                        simt_sync()
                    # a wide body (``TileOp.simt_threads``): both consumer warpgroups;
                    # consumer warp 0 publishes after its closing barrier.
                    # The second warpgroup skips the SIMT group's tiles and may be tasks ahead:
                    # a body with scratch meets the first one before writing it (the first may
                    # still be in an earlier SIMT body using the same scratch)
                    for k in cutlass.range_constexpr(self.num_nodes):
                        if cutlass.const_expr(self._simt(k, SIMT_WIDE_THREADS)):
                            if node == k:
                                if cutlass.const_expr(self.spec.ops[k].device_smem_bytes() > 0):
                                    simt_sync(SIMT_WIDE_THREADS)
                                if self._exists(tensors, node, c0, c1):
                                    self.spec.ops[k].device_tile(tensors[k], c0, c1, ctid, scratch)
                                    if cutlass.const_expr(self.fence_async):
                                        cute.arch.fence_proxy("async.global")
                                simt_sync(SIMT_WIDE_THREADS)
                    if ctid < WARP:  # consumer warp 0 publishes a SIMT tile
                        if ctid == 0:
                            self._publish_static(prog, dev, mProf, rec, start)
                        if cutlass.const_expr(self.spec.dynamic):
                            queue_put(
                                d_full, d_empty, sDone, dcount, w.task_slots, 1, (t,), lane, pwait
                            )
                            dcount = dcount + 1
        if cutlass.const_expr(self.spec.dynamic):
            if ctid < WARP:
                queue_put(
                    d_full, d_empty, sDone, dcount, w.task_slots, 1, (Int32(-1),), lane, pwait
                )
        if cutlass.const_expr(w.ring_stages > 0):
            # stop the storer, once it has taken the last tile (or its initial arrive, if none):
            # before that, the stop record would overwrite a record the storer has not read
            epi_acquire(self._epi_free(L, ecount, pwait), w.store_threads)
            if ctid == 0:
                sEpiRec[R_TASK] = Int32(-1)
            self._epi_staged(L)

    def _simt(self, k: int, threads: int) -> bool:
        """Whether node ``k`` is a SIMT op whose body runs on ``threads`` threads."""
        return self.ring_of[k] is None and self.spec.ops[k].simt_threads == threads

    @cute.jit
    def _publish_static(self, prog, dev, mProf, rec, start: Int64):
        """One thread, after the task's output is complete: its profile record and (static
        mode) the release adds to the events it notifies."""
        t = rec[R_TASK]
        if cutlass.const_expr(self.spec.profile):
            base = t * PROF_WIDTH
            sm_node = (Int64(rec[R_NODE]) << 32) | Int64(cute.arch.smid())
            mProf[base + PROF_SM_NODE] = sm_node
            if start != 0:
                mProf[base + PROF_START] = start
            mProf[base + PROF_END] = cute.arch.globaltimer()
        if cutlass.const_expr(not self.spec.dynamic):
            notify_ev, ev_counter = prog[P["notify_ev"]], dev[D["ev_counter"]]
            for j in range(rec[R_NLO], rec[R_NHI]):
                notify_event(ev_counter.iterator + notify_ev[j], Int32(1), self.scope)

    @staticmethod
    def _epi_free(L, ecount, pwait):
        """What ``epi_acquire`` waits on: None (the named barrier), or the release mbarrier
        at the phase of ``ecount`` staged tiles (``KernelSpec.epi_mbarrier``)."""
        return None if L.epi_bar is None else (L.epi_bar, ecount, pwait)

    @cute.jit
    def _epi_staged(self, L):
        """Every consumer thread, its part of a ring tile staged (and fenced for the TMA store)
        and, on thread 0, the tile's record in ``sEpiRec``: hand both to the storer. An arrive
        on the staged mbarrier where the kernel has one (``KernelSpec.epi_mbarrier``: the
        consumers go on at once, the storer waits), else a sync on ``EPI_FULL_BARRIER`` with
        the storer (which the profile's staged stamp follows)."""
        if cutlass.const_expr(L.epi_full is not None):
            cute.arch.mbarrier_arrive(L.epi_full)
        else:
            named_sync(EPI_FULL_BARRIER, self.w.store_threads)

    @cute.jit
    def _epi_release(self, L):
        """Storer warp: the staging buffer (and the staged record) is read; the consumers may
        write the next tile's. Every lane arrives on the release mbarrier where the kernel
        has one (``KernelSpec.epi_mbarrier``), else the warp arrives on the named barrier."""
        if cutlass.const_expr(L.epi_bar is not None):
            cute.arch.mbarrier_arrive(L.epi_bar)
        else:
            named_arrive(EPI_EMPTY_BARRIER, self.w.store_threads)

    @cute.jit
    def _storer(self, L, lane):
        """Producer warpgroup's storer warp: for each ring tile the consumers staged, issue its
        TMA store, free the staging buffer once it is read, wait for the writes, then notify
        (static) or complete the task (dynamic), while the consumers run their next tile."""
        tensors, prog, dev, mProf, epoch = L.tensors, L.prog, L.dev, L.prof, L.epoch
        stamp, num_init, sEpiRec, epi = L.stamp, L.num_init, L.sEpiRec, L.epi
        w = self.w
        staged_wait = self._abortable_wait(dev)
        # the staging buffer starts free
        self._epi_release(L)
        scount = Int32(0)  # staged tiles taken (and the stop): the staged mbarrier's phase
        alive = Boolean(True)
        while alive:
            if cutlass.const_expr(L.epi_full is not None):
                staged_wait(L.epi_full, scount & 1, 0)
                scount = scount + 1
            else:
                named_sync(EPI_FULL_BARRIER, w.store_threads)
            rec = tuple(sEpiRec[f] for f in range(REC_WIDTH))
            t, node, c0, c1 = rec[R_TASK], rec[R_NODE], rec[R_C0], rec[R_C1]
            alive = t >= 0
            if cutlass.const_expr(self.spec.watchdog and L.epi_full is not None):
                # a gave-up wait read a stale record: nothing more is stored (the consumers'
                # arrives never block, so the storer may leave first); one verdict for the
                # warp, as its lanes load the abort word each on its own
                state = dev[D["state"]]
                aborted = Boolean(
                    cute.arch.load(state.iterator + ABORT, Int32, sem="relaxed", scope="gpu") != 0
                )
                if cute.arch.vote_any_sync(aborted):
                    alive = Boolean(False)
            if alive:
                if cutlass.const_expr(self.spec.profile):
                    if lane == 0:  # every consumer thread has staged its part
                        mProf[t * PROF_WIDTH + PROF_STAGED] = cute.arch.globaltimer()
                for k in cutlass.range_constexpr(self.num_nodes):
                    if cutlass.const_expr(self.ring_of[k] is not None):
                        if node == k:
                            self.spec.ops[k].device_store(tensors[k], c0, c1, epi)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
                self._epi_release(L)
                cute.arch.cp_async_bulk_wait_group(0)
                # the store's async-proxy writes before the generic release that notifies them
                cute.arch.fence_proxy("async.global")
                cute.arch.sync_warp()
                if lane == 0:
                    self._publish_static(prog, dev, mProf, rec, Int64(0))
                if cutlass.const_expr(self.spec.dynamic):
                    self._complete_dynamic(prog, dev, t, epoch, stamp, num_init, lane)

    @cute.jit
    def _completer(self, L, lane):
        """Dynamic mode, producer warpgroup's warp 1: complete each task the consumers finished
        (events, ready consumers pushed), so the consumers go straight to their next task."""
        prog, dev, epoch, stamp = L.prog, L.dev, L.epoch, L.stamp
        num_init, bars, sDone, timeout_ns = L.num_init, L.bars, L.sDone, L.timeout_ns
        w = self.w
        pwait = self._pipeline_wait(dev, timeout_ns)
        _, _, _, _, d_full, d_empty = bars
        dcount = Int32(0)
        alive = Boolean(True)
        while alive:
            rec = queue_get(d_full, d_empty, sDone, dcount, w.task_slots, 1, pwait)
            dcount = dcount + 1
            alive = rec[0] >= 0
            if alive:
                self._complete_dynamic(prog, dev, rec[0], epoch, stamp, num_init, lane)
