"""The dynamic scheduler's on-GPU ready queue: tickets, pops, pushes and event completion.

A ring of task ids (slot value ``epoch * num_tasks + task``, so one acquire load says both that
the slot is filled in this launch and what it holds). CTAs push the tasks that wait on nothing,
then pop: take a ticket (atomic on HEAD; the next one is taken while the current task runs) and
spin until that slot is filled, or until DONE says every task has finished. After a task, one
warp acq_rel-adds to each notified event; the lane that completes an event adds to each
consumer's pending count, and the one that completes a consumer's last event pushes it. A
consumer whose data says it does not exist is pushed all the same; the worker that pops it
skips its body (``exists``) and completes it.

A mixin of :class:`cutemk.codegen.megakernel.Megakernel` (``self.spec``, ``self._abort``).
"""

from __future__ import annotations

import cutlass
from cutlass import Boolean, Int32, Int64, cute
from cutlass.experimental import primitives as prims

from ..device.config import WARP_SIZE as WARP
from .lower import (
    ABORT,
    DONE,
    HEAD,
    KIND_QUEUE_IDLE,
    R_NHI,
    R_NLO,
    REC_WIDTH,
    TAIL,
)
from .layout import D, P


class DynamicQueue:
    @cute.jit
    def _push(self, dev, t: Int32, stamp: Int32, num_init: Int32):
        """Publish task t: ring slots hold ``stamp + t`` with ``stamp = epoch * num_tasks``, so
        one acquire load tells a popper both that the slot is filled in this launch and what
        it holds (values of earlier launches are below the stamp)."""
        state, ring = dev[D["state"]], dev[D["ring"]]
        slot = num_init + cute.arch.atomic_add(
            state.iterator + TAIL, Int32(1), sem="relaxed", scope="gpu"
        )
        cute.arch.store(ring.iterator + slot, stamp + t, sem="release", scope="gpu")

    @cute.jit
    def _complete_dynamic(
        self,
        prog,
        dev,
        t: Int32,
        epoch: Int32,
        stamp: Int32,
        num_init: Int32,
        lane: Int32,
    ):
        """Warp 0: notify for task t and push the consumers made ready.

        Lane 0 adds to each notified event; when it completes the event, the 32 lanes take its
        consumers 32 at a time (pending-count atomics and pushes in parallel: a fan-out of k
        costs k/32 round trips, not k). ``bar.warp.sync`` orders lane 0's acquire before the
        other lanes' reads and release stores. A ready consumer whose data says it does not
        exist is pushed all the same: the SM that pops it skips its body and completes it, so
        the skipped part of a data-dependent graph is retired by every SM in parallel (retiring
        it here, one task after another on one warp, took milliseconds for an MoE layer whose
        routing leaves a thousand grouped tiles empty).
        """
        task_rec, notify_ev, ev_count = (
            prog[P["task_rec"]],
            prog[P["notify_ev"]],
            prog[P["ev_count"]],
        )
        cons_ptr, cons_task, task_nwait = (
            prog[P["cons_ptr"]],
            prog[P["cons_task"]],
            prog[P["task_nwait"]],
        )
        state, ev_counter, task_pending = (
            dev[D["state"]],
            dev[D["ev_counter"]],
            dev[D["task_pending"]],
        )
        for j in range(task_rec[t * REC_WIDTH + R_NLO], task_rec[t * REC_WIDTH + R_NHI]):
            e = notify_ev[j]
            done = Int32(0)
            if lane == 0:
                old = cute.arch.atomic_add(
                    ev_counter.iterator + e, Int32(1), sem="acq_rel", scope=self.scope
                )
                if old + 1 == ev_count[e] * epoch:
                    done = Int32(1)
            done = cute.arch.shuffle_sync(done, 0)
            cute.arch.sync_warp()
            if done != 0:
                lo = cons_ptr[e]
                hi = cons_ptr[e + 1]
                for base in range(lo, hi, WARP):
                    i = base + lane
                    if i < hi:
                        c = cons_task[i]
                        ready = c < 0  # -(c+1): waits on this event alone, ready now
                        if ready:
                            c = -c - 1
                        else:
                            p = cute.arch.atomic_add(
                                task_pending.iterator + c, Int32(1), sem="acq_rel", scope="gpu"
                            )
                            ready = p + 1 == task_nwait[c] * epoch
                        if ready:
                            self._push(dev, c, stamp, num_init)
        if lane == 0:
            # relaxed: DONE guards no data (it only tells idle CTAs to stop polling; a task is
            # counted after it was popped, so DONE == num_tasks implies every pushed slot was
            # taken), and a release here would stall the lane on every task
            cute.arch.atomic_add(state.iterator + DONE, Int32(1), sem="relaxed", scope="gpu")

    @cute.jit
    def _take_ticket(self, dev) -> Int32:
        return cute.arch.atomic_add(
            dev[D["state"]].iterator + HEAD, Int32(1), sem="relaxed", scope="gpu"
        )

    @cute.jit
    def _pop(self, dev, ticket: Int32, num_tasks: Int32, stamp: Int32, timeout_ns: Int64) -> Int32:
        """One thread: the task in ring slot ``ticket``, or -1 once every task is done."""
        state, debug, ring = dev[D["state"]], dev[D["debug"]], dev[D["ring"]]
        task = Int32(-1)
        if ticket < num_tasks:
            spinning = Boolean(True)
            backoff = Int32(32)
            t0 = Int64(0)
            if cutlass.const_expr(self.spec.watchdog):
                t0 = cute.arch.globaltimer()
            while spinning:
                v = cute.arch.load(ring.iterator + ticket, Int32, sem="acquire", scope="gpu")
                if v >= stamp:
                    task = v - stamp
                    spinning = Boolean(False)
                else:
                    done = cute.arch.load(state.iterator + DONE, Int32, sem="acquire", scope="gpu")
                    if done >= num_tasks:
                        spinning = Boolean(False)
                    else:
                        prims.nanosleep(backoff)
                        if backoff < 256:  # a ready queue is polled tighter than an event
                            backoff = backoff * 2
                        if cutlass.const_expr(self.spec.watchdog):
                            if (
                                cute.arch.load(
                                    state.iterator + ABORT, Int32, sem="relaxed", scope="gpu"
                                )
                                != 0
                            ):
                                spinning = Boolean(False)
                            elif cute.arch.globaltimer() - t0 > timeout_ns:
                                self._abort(
                                    state,
                                    debug,
                                    Int32(-1),
                                    Int32(-1),
                                    num_tasks,
                                    done,
                                    Int32(KIND_QUEUE_IDLE),
                                )
                                spinning = Boolean(False)
        return task
