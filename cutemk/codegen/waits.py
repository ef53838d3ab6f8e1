"""Event waits of the megakernel's producer warp, the watchdog's abort record, and the rank
barrier that closes a distributed launch (see ``cutemk.device.sync`` for the ordering rules).

A mixin of :class:`cutemk.codegen.megakernel.Megakernel`: it reads ``self.spec`` and
``self.scope``; ``prog`` / ``dev`` are the views of the packed program and device state.
"""

from __future__ import annotations

import cutlass
from cutlass import Boolean, Int32, Int64, cute

from ..device.config import WARP_SIZE as WARP
from ..device.ring import plain_wait
from ..device.sync import notify_event, wait_event, wait_event_or_abort
from .lower import (
    ABORT,
    BARRIER,
    DBG_EVENT,
    DBG_EXPECTED,
    DBG_KIND,
    DBG_SEEN,
    DBG_SM,
    DBG_TASK,
    KIND_BARRIER_WAIT,
    KIND_EVENT_WAIT,
    KIND_RANK_BARRIER,
    KIND_REMOTE_WAIT,
    PEER_ABORT,
)
from .layout import D, P


class EventWaits:
    @cute.jit
    def _abort(
        self, state, debug, task: Int32, event: Int32, expected: Int32, seen: Int32, kind: Int32
    ):
        old = cute.arch.atomic_cas(
            state.iterator + ABORT, cmp=Int32(0), val=Int32(1), sem="acq_rel", scope="gpu"
        )
        if old == 0:
            debug[DBG_TASK] = task
            debug[DBG_EVENT] = event
            debug[DBG_EXPECTED] = expected
            debug[DBG_SEEN] = seen
            debug[DBG_SM] = cute.arch.smid()
            debug[DBG_KIND] = kind

    def _pipeline_wait(self, dev, timeout_ns: Int64):
        """The mbarrier wait the worker's pipelines use (``cutemk.device.ring``): unbounded, or
        with the watchdog bounded by ``timeout_ns``: it gives up when the launch is aborting
        and aborts it itself on a timeout, so a broken pipeline is an error, not a hang."""
        if not self.spec.watchdog:
            return plain_wait
        state, debug = dev[D["state"]], dev[D["debug"]]
        return lambda bar, parity, code: self._bounded_wait(
            state, debug, timeout_ns, bar, parity, code
        )

    def _abortable_wait(self, dev):
        """An mbarrier wait with no deadline of its own that gives up once the launch is
        aborting (with the watchdog; else unbounded): the storer's wait for a staged tile,
        which may be whole phases of other tasks away. A stuck pipeline is caught by the
        consumers' bounded waits, whose abort ends this one."""
        if not self.spec.watchdog:
            return plain_wait
        state = dev[D["state"]]
        return lambda bar, parity, code: self._wait_until_abort(state, bar, parity)

    @cute.jit
    def _wait_until_abort(self, state, bar, parity):
        done = cute.arch.mbarrier_try_wait(bar, parity)
        while not done:
            if cute.arch.load(state.iterator + ABORT, Int32, sem="relaxed", scope="gpu") != 0:
                done = Boolean(True)
            else:
                done = cute.arch.mbarrier_try_wait(bar, parity)

    @cute.jit
    def _bounded_wait(self, state, debug, timeout_ns: Int64, bar, parity, code: int):
        done = cute.arch.mbarrier_try_wait(bar, parity)
        t0 = cute.arch.globaltimer()
        while not done:
            if cute.arch.load(state.iterator + ABORT, Int32, sem="relaxed", scope="gpu") != 0:
                done = Boolean(True)
            elif cute.arch.globaltimer() - t0 > timeout_ns:
                self._abort(
                    state,
                    debug,
                    Int32(-1),
                    Int32(code),
                    parity,
                    Int32(-1),
                    Int32(KIND_BARRIER_WAIT),
                )
                done = Boolean(True)
            else:
                done = cute.arch.mbarrier_try_wait(bar, parity)

    @cute.jit
    def _wait_all(
        self,
        prog,
        dev,
        t: Int32,
        w_lo: Int32,
        w_hi: Int32,
        epoch: Int32,
        lane: Int32,
        timeout_ns: Int64,
    ) -> Boolean:
        """Warp 0: lane l waits for events w_lo + l, w_lo + l + 32, ... of task t, so a task
        with fan-in k pays one acquire round trip, not k. False if the watchdog fired."""
        wait_ev, wait_target = prog[P["wait_ev"]], prog[P["wait_target"]]
        state, debug, ev_counter = dev[D["state"]], dev[D["debug"]], dev[D["ev_counter"]]
        ok = Boolean(True)
        if cutlass.const_expr(self.spec.watchdog):
            ok = cute.arch.load(state.iterator + ABORT, Int32, sem="relaxed", scope="gpu") == 0
        j = w_lo + lane
        going = ok and j < w_hi
        while going:
            e = wait_ev[j]
            target = wait_target[j] * epoch
            if cutlass.const_expr(self.spec.watchdog):
                timed_out, seen = wait_event_or_abort(
                    ev_counter.iterator + e, target, timeout_ns, state.iterator + ABORT
                )
                if timed_out:
                    self._abort(state, debug, t, e, target, seen, Int32(KIND_EVENT_WAIT))
                    ok = Boolean(False)
            else:
                wait_event(ev_counter.iterator + e, target)
            j = j + WARP
            going = ok and j < w_hi
        return ok

    @cute.jit
    def _wait_remote(
        self,
        prog,
        dev,
        peers,
        ev_off: Int32,
        t: Int32,
        epoch: Int32,
        lane: Int32,
        timeout_ns: Int64,
    ) -> Boolean:
        """Warp 0: wait for task t's events on other ranks. ``peers[r]`` is rank r's device-state
        buffer (symmetric memory mapped into this GPU); its counters start at word ``ev_off``,
        the same on every rank. Acquire loads at system scope, over NVLink."""
        rwait_ptr, rwait_ev = prog[P["rwait_ptr"]], prog[P["rwait_ev"]]
        rwait_rank, rwait_target = prog[P["rwait_rank"]], prog[P["rwait_target"]]
        state, debug = dev[D["state"]], dev[D["debug"]]
        ok = Boolean(True)
        if cutlass.const_expr(self.spec.watchdog):
            ok = cute.arch.load(state.iterator + ABORT, Int32, sem="relaxed", scope="gpu") == 0
        j = rwait_ptr[t] + lane
        hi = rwait_ptr[t + 1]
        going = ok and j < hi
        while going:
            e = rwait_ev[j]
            target = rwait_target[j] * epoch
            addr = peers[rwait_rank[j]] + Int64(ev_off + e) * 4
            ptr = cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=4)
            if cutlass.const_expr(self.spec.watchdog):
                timed_out, seen = wait_event_or_abort(
                    ptr, target, timeout_ns, state.iterator + ABORT, "sys"
                )
                if timed_out:
                    self._abort(state, debug, t, e, target, seen, Int32(KIND_REMOTE_WAIT))
                    ok = Boolean(False)
            else:
                wait_event(ptr, target, "sys")
            j = j + WARP
            going = ok and j < hi
        return ok

    @cute.jit
    def _rank_barrier(self, mDev, dev, mPeers, epoch: Int32, timeout_ns: Int64):
        """Last CTA out, one thread: tell every rank this one has finished launch ``epoch``,
        then wait until all have. No rank starts its next launch (which rewrites buffers the
        others read or write remotely) before every rank is done with this one; and no counter
        is remote-read across a reset, since distributed launches never wrap on the device.

        With the watchdog, a launch that aborted here aborts every rank's (``PEER_ABORT`` in
        their state, before the barrier: their abortable waits stop at once and their host
        reports it), and the barrier gives up after ``timeout_ns`` (a rank that never arrives:
        it aborted before launching, or runs another plan) and records it."""
        world = cute.size(mPeers)
        state_off = mDev[2 * D["state"]]
        own_abort = mDev.iterator + (state_off + ABORT)
        if cutlass.const_expr(self.spec.watchdog):
            if cute.arch.load(own_abort, Int32, sem="relaxed", scope="gpu") != 0:
                for p in range(world):
                    addr = mPeers[p] + Int64(state_off + ABORT) * 4
                    ptr = cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=4)
                    cute.arch.atomic_cas(
                        ptr, cmp=Int32(0), val=Int32(PEER_ABORT), sem="release", scope="sys"
                    )
        for p in range(world):
            addr = mPeers[p] + Int64(state_off + BARRIER) * 4
            ptr = cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=4)
            notify_event(ptr, Int32(1), "sys")
        barrier = mDev.iterator + (state_off + BARRIER)
        if cutlass.const_expr(self.spec.watchdog):
            # an aborted launch does not wait for the others: its graph is broken on every rank
            timed_out, seen = wait_event_or_abort(
                barrier, world * epoch, timeout_ns, own_abort, "sys"
            )
            if timed_out and cute.arch.load(own_abort, Int32, sem="relaxed", scope="gpu") == 0:
                self._abort(
                    dev[D["state"]],
                    dev[D["debug"]],
                    Int32(-1),
                    Int32(BARRIER),
                    world * epoch,
                    seen,
                    Int32(KIND_RANK_BARRIER),
                )
        else:
            wait_event(barrier, world * epoch, "sys")
