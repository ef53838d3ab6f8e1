"""The megakernel's producer warp (warp 0): task fetch, a ring op's loads around the task's
event waits, and the hand-over of task records to the consumers (see ``megakernel``).

A mixin of :class:`cutemk.codegen.megakernel.Megakernel` (``self.spec``, ``self.w``,
``self.ring_of``, the waits of ``EventWaits`` and the queue of ``DynamicQueue``); ``L`` is the
launch context (``megakernel._Launch``).
"""

from __future__ import annotations

import cutlass
from cutlass import Boolean, Int32, Int64, cute

from ..device.config import WARP_SIZE as WARP
from ..device.ring import producer_acquire, queue_put
from .layout import CTA_SLICES, P, PROF_ARMED, PROF_FETCHED, PROF_READY, PROF_WIDTH
from .lower import (
    QUEUE_CHUNK,
    R_C0,
    R_C1,
    R_LIVE,
    R_NODE,
    R_TASK,
    R_WHI,
    R_WLO,
    R_WORD,
    REC_WIDTH,
)
from .profiling import stamp_issued

CHUNK = QUEUE_CHUNK  # static queue records the producer warp fetches per load
assert CHUNK * REC_WIDTH == WARP  # a word a lane


class ProducerRole:
    # -- producer -----------------------------------------------------------------------------
    @cute.jit
    def _issue(
        self, tensors, k: int, c0, c1, word, j, idx, bar, ring, independent: bool, dependent
    ):
        op = self.spec.ops[k]
        stages, slot = self.w.ring_stages, self.w.slot_bytes
        if cutlass.const_expr(independent):
            op.device_load_independent(tensors[k], c0, c1, word, j, idx, bar, ring, stages, slot)
        if cutlass.const_expr(dependent):
            op.device_load_dependent(tensors[k], c0, c1, word, j, idx, bar, ring, stages, slot)

    @cute.jit
    def _stamp_issued(self, L, mProf, t, count, lane):
        """``profile="slices"``: ring slice ``count`` of task ``t`` is issued now."""
        if cutlass.const_expr(self.spec.profile_slices):
            stamp_issued(mProf, L.slices, count, t, lane)

    @cute.jit
    def _decide(self, tensors, k: int, c0, c1, may: Boolean, word: Int32, n: Int32):
        """A data-dependent ring tile of node ``k``: (exists, task word, slice count), the
        word and count read only where it exists (and ``may``: False after an abort; else
        ``word`` and ``n`` come back as they went in)."""
        op = self.spec.ops[k]
        live = may and op.device_exists(tensors[k], c0, c1)
        if live:
            word = op.device_task_word(tensors[k], c0, c1)
            if cutlass.const_expr(self.dynamic_slices[k]):
                n = op.device_slices(tensors[k], c0, c1, word)
        return live, word, n

    @cute.jit
    def _produce(self, L, rec, lane, qcount: Int32, rcount: Int32):
        """Producer warp: one task (see the module docstring); returns (alive, qcount, rcount)."""
        tensors, prog, dev, peers, ev_off = L.tensors, L.prog, L.dev, L.peers, L.ev_off
        epoch, timeout_ns, bars, sQueue, ring = L.epoch, L.timeout_ns, L.bars, L.sQueue, L.ring
        mProf = L.prof
        w = self.w
        pwait = self._pipeline_wait(dev, timeout_ns)
        t, node, c0, c1 = rec[R_TASK], rec[R_NODE], rec[R_C0], rec[R_C1]
        q_full, q_empty, r_full, r_empty, d_full, d_empty = bars
        if cutlass.const_expr(self.spec.profile):
            if lane == 0:  # taken up: the previous task's slices are all issued
                mProf[t * PROF_WIDTH + PROF_FETCHED] = cute.arch.globaltimer()
        # (1) weights of the first slices, before the events. A tile that exists by data of
        # the launch's inputs only (``TileOp.early_exists``) is decided here, as are its word
        # and slice count; the consumers get the same verdict with the record
        # With ``KernelSpec.early_handover`` a task with no events to wait for (every dynamic
        # one: it was pushed ready) is handed over before any of its loads, which then all go
        # in (5): its consumers wait on the ring's first slot, not on the producer's issue of
        # a ring's worth of slices
        live = Boolean(True)
        word = Int32(0)
        n = Int32(0)
        no_wait = Boolean(False)
        if cutlass.const_expr(self.spec.early_handover and not self.spec.distributed):
            no_wait = Boolean(True)
            if cutlass.const_expr(not self.spec.dynamic):
                no_wait = rec[R_WLO] == rec[R_WHI]
        for k in cutlass.range_constexpr(self.num_nodes):
            r = self.ring_of[k]
            if cutlass.const_expr(r is not None and self.spec.prefetch[k]):
                if node == k:
                    if cutlass.const_expr(self.has_exists[k]):
                        live, word, n = self._decide(tensors, k, c0, c1, live, word, n)
                    if cutlass.const_expr(self.l2_prefetch[k]):
                        # every slice's independent loads into L2 first (no slot needed): the
                        # slots may be held by the tiles before this one for a while. One lane
                        # issues them (a TMA load elects its lane itself, a prefetch does not)
                        if live and not no_wait:
                            with cute.arch.elect_one():
                                for j in cutlass.range(r.slices, unroll=1):
                                    self.spec.ops[k].device_prefetch_l2(
                                        tensors[k],
                                        c0,
                                        c1,
                                        word,
                                        j,
                                        ring,
                                        w.ring_stages,
                                        w.slot_bytes,
                                    )
                    for j in cutlass.range_constexpr(min(r.slices, w.ring_stages)):
                        go = live
                        if cutlass.const_expr(self.spec.early_handover):
                            go = live and not no_wait
                        if cutlass.const_expr(self.dynamic_slices[k]):
                            go = go and j < n
                        if go:
                            idx = producer_acquire(
                                r_full, r_empty, rcount + j, w.ring_stages, r.tx_bytes, pwait
                            )
                            self._stamp_issued(L, mProf, t, rcount + j, lane)
                            self._issue(
                                tensors, k, c0, c1, word, j, idx, r_full + idx, ring, True, False
                            )
        if cutlass.const_expr(self.spec.profile):
            if lane == 0:  # its early loads issued (each waited for a free ring slot)
                mProf[t * PROF_WIDTH + PROF_ARMED] = cute.arch.globaltimer()
        # (2) events
        ok = Boolean(True)
        if cutlass.const_expr(not self.spec.dynamic):
            ok = self._wait_all(prog, dev, t, rec[R_WLO], rec[R_WHI], epoch, lane, timeout_ns)
        if cutlass.const_expr(self.spec.distributed):
            if ok:
                ok = self._wait_remote(prog, dev, peers, ev_off, t, epoch, lane, timeout_ns)
        # every lane acquired its own events: the warp barrier orders them all before the
        # elected lane's loads, and the verdict must be the warp's (the hand-over is warp-wide)
        ok = cute.arch.vote_all_sync(ok)
        cute.arch.sync_warp()
        if cutlass.const_expr(self.spec.profile):
            if lane == 0:  # every event met (a dynamic task: ready when popped)
                mProf[t * PROF_WIDTH + PROF_READY] = cute.arch.globaltimer()
        # a tile that exists by data (read after the acquire, as the consumers will) loads
        # nothing when it does not; after an abort the data may be unsettled: none either
        # the task word is read here once (not by every slice's loads), and so is a slice
        # count that follows the data (``TileOp.device_slices``)
        for k in cutlass.range_constexpr(self.num_nodes):
            r = self.ring_of[k]
            if cutlass.const_expr(
                r is not None and self.has_exists[k] and not self.spec.prefetch[k]
            ):
                if node == k:
                    live, word, n = self._decide(tensors, k, c0, c1, ok, word, n)
        # (3) loads of data produced in this launch (even after an abort: the armed slots must
        # complete, their data is never read)
        if cutlass.const_expr(self.fence_async):
            cute.arch.fence_proxy("async.global")
        for k in cutlass.range_constexpr(self.num_nodes):
            r = self.ring_of[k]
            if cutlass.const_expr(r is not None):
                armed = live
                if cutlass.const_expr(self.spec.early_handover):
                    armed = live and not no_wait
                if node == k and armed:
                    pre = min(r.slices, w.ring_stages)
                    for j in cutlass.range_constexpr(pre):
                        go = Boolean(True)
                        if cutlass.const_expr(self.dynamic_slices[k]):
                            go = j < n
                        if go:
                            if cutlass.const_expr(self.spec.prefetch[k]):  # armed in (1)
                                idx = (rcount + j) % w.ring_stages
                                self._issue(
                                    tensors,
                                    k,
                                    c0,
                                    c1,
                                    word,
                                    j,
                                    idx,
                                    r_full + idx,
                                    ring,
                                    False,
                                    True,
                                )
                            else:
                                idx = producer_acquire(
                                    r_full, r_empty, rcount + j, w.ring_stages, r.tx_bytes, pwait
                                )
                                self._stamp_issued(L, mProf, t, rcount + j, lane)
                                self._issue(
                                    tensors, k, c0, c1, word, j, idx, r_full + idx, ring, True, True
                                )
        # after an abort a tile decided before its events is handed over as not existing
        live_handed = live and ok
        # (4) hand the task over, with the verdict and the word in place of the wait range
        # (the consumers neither wait nor re-read the data that decided them)
        stop = tuple(Int32(-1) for _ in range(REC_WIDTH))
        if ok:
            handed = list(rec)
            flag = Int32(0)
            if live_handed:
                flag = Int32(1)
            handed[R_LIVE] = flag
            handed[R_WORD] = word
            queue_put(
                q_full, q_empty, sQueue, qcount, w.task_slots, REC_WIDTH, tuple(handed), lane, pwait
            )
        else:
            queue_put(q_full, q_empty, sQueue, qcount, w.task_slots, REC_WIDTH, stop, lane, pwait)
        qcount = qcount + 1
        # (5) the remaining slices
        if ok:
            for k in cutlass.range_constexpr(self.num_nodes):
                r = self.ring_of[k]
                if cutlass.const_expr(r is not None):
                    if node == k and live:
                        if cutlass.const_expr(not self.dynamic_slices[k]):
                            n = Int32(r.slices)
                        first = min(r.slices, w.ring_stages)
                        if cutlass.const_expr(self.spec.early_handover):
                            first = Int32(first)
                            if no_wait:
                                first = Int32(0)  # nothing was armed in (1) or issued in (3)
                        for j in cutlass.range(first, n, unroll=1):
                            idx = producer_acquire(
                                r_full, r_empty, rcount + j, w.ring_stages, r.tx_bytes, pwait
                            )
                            self._stamp_issued(L, mProf, t, rcount + j, lane)
                            self._issue(
                                tensors, k, c0, c1, word, j, idx, r_full + idx, ring, True, True
                            )
                        rcount = rcount + n
        return ok, qcount, rcount

    @cute.jit
    def _producer(self, L, lane):
        """Producer warp: every task of this CTA, then a stop record for the consumers."""
        prog, dev, stamp, num_tasks = L.prog, L.dev, L.stamp, L.num_tasks
        timeout_ns, bars, sQueue, sRec = L.timeout_ns, L.bars, L.sQueue, L.sRec
        w = self.w
        pwait = self._pipeline_wait(dev, timeout_ns)
        qcount = Int32(0)
        rcount = Int32(0)
        if cutlass.const_expr(self.spec.dynamic):
            task_rec = prog[P["task_rec"]]
            ticket = Int32(0)
            if lane == 0:
                ticket = self._take_ticket(dev)
            alive = Boolean(True)
            while alive:
                t = Int32(-1)
                if lane == 0:
                    t = self._pop(dev, ticket, num_tasks, stamp, timeout_ns)
                    if t >= 0:  # the next ticket's round trip overlaps this task
                        ticket = self._take_ticket(dev)
                t = cute.arch.shuffle_sync(t, 0)
                alive = t >= 0
                if alive:
                    rec = tuple(task_rec[t * REC_WIDTH + f] for f in range(REC_WIDTH))
                    alive, qcount, rcount = self._produce(L, rec, lane, qcount, rcount)
        else:
            queue_rec = prog[P["queue_rec"]]
            head_word, i, i_end = L.queue_head  # read at launch start (``lower.queue_heads``)
            first = Boolean(True)
            if cutlass.const_expr(not self.spec.queue_head):  # measuring: the old way
                bidx, _, _ = cute.arch.block_idx()
                queue_ptr = prog[P["queue_ptr"]]
                i = queue_ptr[bidx]
                i_end = queue_ptr[bidx + 1]
                first = Boolean(False)
            alive = i < i_end
            while alive:
                # CHUNK records a coalesced load, one word a lane; the first CHUNK were loaded
                # with the queue's range
                if first:
                    sRec[lane] = head_word
                elif i * REC_WIDTH + lane < i_end * REC_WIDTH:
                    sRec[lane] = queue_rec[i * REC_WIDTH + lane]
                first = Boolean(False)
                cute.arch.sync_warp()
                n = cute.min(CHUNK, i_end - i)
                ok = Boolean(True)
                for k in range(n):
                    if ok:
                        rec = tuple(sRec[k * REC_WIDTH + f] for f in range(REC_WIDTH))
                        ok, qcount, rcount = self._produce(L, rec, lane, qcount, rcount)
                cute.arch.sync_warp()
                i = i + CHUNK
                alive = ok and i < i_end
        q_full, q_empty = bars[0], bars[1]
        stop = tuple(Int32(-1) for _ in range(REC_WIDTH))
        queue_put(q_full, q_empty, sQueue, qcount, w.task_slots, REC_WIDTH, stop, lane, pwait)
        if cutlass.const_expr(self.spec.profile):
            if lane == 0:  # the ring slices this CTA issued (its CTA record)
                cta, _, _ = cute.arch.block_idx()
                mProf = L.prof
                mProf[(num_tasks + cta) * PROF_WIDTH + CTA_SLICES] = Int64(rcount)
