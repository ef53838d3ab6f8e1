"""The megakernel: one persistent ``@cute.kernel`` that runs a whole graph's tasks.

Each CTA loops: fetch a task -> (static mode) wait on its events -> dispatch on the task's node
to that op's ``device_tile`` -> notify. The graph structure (which ops, which tensors each reads)
is compile-time; the task list, events and queues of one token count are runtime int32 arrays
(``cutemk.codegen.lower``), so one compiled kernel serves every token count.

The program arrays arrive packed in one int32 buffer and the device state in another (one kernel
argument each: arguments cost host time at every launch); views are rebuilt from their headers.

Protocol (see ``cutemk.device.sync`` for the memory-ordering rules):

- Static: CTA g runs the records ``queue_rec[queue_ptr[g]:queue_ptr[g+1]]`` in order; before a task one
  thread acquires each event the task waits on (counter >= count * epoch), ``bar.sync``, the CTA
  runs the tile, ``bar.sync``, one thread release-adds 1 to each event the task notifies.
- Dynamic: a ring of task ids (slot value ``epoch * num_tasks + task``, so one acquire load says
  both that the slot is filled in this launch and what it holds). CTAs push the tasks that wait
  on nothing, then pop: take a ticket (atomic on HEAD; the next one is taken while the current
  task runs) and spin until that slot is filled, or until DONE says every task has finished. After a
  task, one thread acq_rel-adds to each notified event; the thread that completes an event adds
  to each consumer's pending count, and the one that completes a consumer's last event pushes it.
  A consumer whose data says it does not exist is never pushed: the pusher completes its notifies
  itself (a small shared-memory work list), so only existing tiles reach the queue.
- Epochs: ``epoch = state[EPOCH] + 1`` per launch; the last CTA to exit stores it and resets the
  per-launch queue counters, so no host reset is needed between launches or graph replays.
- Watchdog (compile-time flag): waits give up after ``timeout_ns``; the first CTA to give up
  records (task, event, expected, seen, SM) in ``debug`` and raises ``state[ABORT]``; every CTA
  stops at its next task. The host turns that into an error naming the event.
"""

from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
from cutlass import Boolean, Int32, Int64, cute
from cutlass.experimental import primitives as prims

from ..device.config import NUM_THREADS, WARP_SIZE as WARP
from ..device.sync import notify_event, wait_event, wait_event_or_abort
from ..tileop import TileOp
from .lower import (
    ABORT,
    BARRIER,
    DBG_EVENT,
    DBG_EXPECTED,
    DBG_KIND,
    DBG_SEEN,
    DBG_SM,
    DBG_TASK,
    DONE,
    EPOCH,
    EXITED,
    HEAD,
    KIND_EVENT_WAIT,
    KIND_QUEUE_IDLE,
    KIND_REMOTE_WAIT,
    R_C0,
    R_C1,
    R_NHI,
    R_NLO,
    R_NODE,
    R_TASK,
    R_WHI,
    R_WLO,
    REC_WIDTH,
    TAIL,
)

SMEM_ALIGN = 1024  # 128-byte swizzled TMA tiles need 1024-byte aligned shared memory
WORK_CAP = 64  # skipped-task work list of the dynamic pusher; beyond it, tasks are pushed as is
CHUNK = NUM_THREADS // REC_WIDTH  # static queue records fetched per coalesced load
PROGRAM = (
    "task_rec",
    "wait_ev",
    "wait_target",
    "notify_ev",
    "ev_count",
    "queue_ptr",
    "queue_rec",
    "cons_ptr",
    "cons_task",
    "task_nwait",
    "init_tasks",
    "rwait_ptr",
    "rwait_ev",
    "rwait_rank",
    "rwait_target",
)
DEVICE_STATE = ("state", "debug", "ev_counter", "task_pending", "ring")
P = {name: i for i, name in enumerate(PROGRAM)}
D = {name: i for i, name in enumerate(DEVICE_STATE)}
PROF_WIDTH = 4  # per task: SM, start ns, end ns, node (int64)


@dataclass(frozen=True)
class KernelSpec:
    """Everything the kernel's code depends on: the compile-cache key."""

    ops: tuple[TileOp, ...]  # per graph node
    node_tensors: tuple[tuple[int, ...], ...]  # per node: indices into the graph tensor tuple
    values: tuple[tuple[str, int], ...]  # (dtype, rank) of every graph tensor, in tuple order
    dynamic: bool
    watchdog: bool
    profile: bool
    arch: str
    distributed: bool = False  # cross-rank waits, sys-scope notifies, a barrier per launch

    @property
    def scratch_bytes(self) -> int:
        need = [int(op.device_smem_bytes()) for op in self.ops]
        return max([16] + need)


class Megakernel:
    def __init__(self, spec: KernelSpec) -> None:
        self.spec = spec
        self.num_nodes = len(spec.ops)
        self.has_exists = tuple(hasattr(op, "device_exists") for op in spec.ops)
        # some tile reads global memory through the async proxy (TMA): every task's stores
        # are fenced into it before they are notified
        self.fence_async = any(op.reads_async_proxy() for op in spec.ops)
        # events other GPUs read are released at system scope
        self.scope = "sys" if spec.distributed else "gpu"

    # -- device helpers (inlined) -------------------------------------------------------------
    def _rec(self, sRec, k):
        """The k-th record in shared memory, as a tuple of values."""
        return tuple(sRec[k * REC_WIDTH + f] for f in range(REC_WIDTH))

    def _views(self, buf, n: int):
        """Views of the arrays packed in ``buf`` behind its (offset, size) header."""
        return tuple(
            cute.make_tensor(buf.iterator + buf[2 * k], cute.make_layout(buf[2 * k + 1]))
            for k in range(n)
        )

    def _node_args(self, tensors, k: int):
        return tuple(tensors[i] for i in self.spec.node_tensors[k])

    def _host_args(self, tensors) -> tuple:
        """Per node: the op's launch-time extras (``TileOp.host_args``, e.g. TMA descriptors)."""
        return tuple(
            op.host_args(self._node_args(tensors, k)) for k, op in enumerate(self.spec.ops)
        )

    @cute.jit
    def _exists(self, tensors, node: Int32, c0: Int32, c1: Int32) -> Boolean:
        ok = Boolean(True)
        for k in cutlass.range_constexpr(self.num_nodes):
            if cutlass.const_expr(self.has_exists[k]):
                if node == k:
                    ok = self.spec.ops[k].device_exists(tensors[k], c0, c1)
        return ok

    @cute.jit
    def _dispatch(self, tensors, node: Int32, c0: Int32, c1: Int32, tidx: Int32, scratch):
        for k in cutlass.range_constexpr(self.num_nodes):
            if node == k:
                self.spec.ops[k].device_tile(tensors[k], c0, c1, tidx, scratch)

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
        tensors,
        prog,
        dev,
        t: Int32,
        epoch: Int32,
        stamp: Int32,
        num_init: Int32,
        lane: Int32,
        sWork,
    ):
        """Warp 0: notify for task t, push the consumers made ready, complete skipped ones.

        Lane 0 adds to each notified event; when it completes the event, the 32 lanes take its
        consumers 32 at a time (pending-count atomics, existence checks and pushes in parallel:
        a fan-out of k costs k/32 round trips, not k). ``bar.warp.sync`` orders lane 0's
        acquire before the other lanes' reads and release stores. Ready consumers whose data
        says they do not exist go on a work list (lane 0 appends, in lane order) and are
        completed the same way, never queued.
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
        if lane == 0:
            sWork[0] = t
        n = Int32(1)  # work-list length, the same in every lane
        while n > 0:
            cute.arch.sync_warp()
            u = sWork[n - 1]
            n = n - 1
            for j in range(task_rec[u * REC_WIDTH + R_NLO], task_rec[u * REC_WIDTH + R_NHI]):
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
                        skip = Int32(-1)
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
                                node = task_rec[c * REC_WIDTH + R_NODE]
                                c0 = task_rec[c * REC_WIDTH + R_C0]
                                c1 = task_rec[c * REC_WIDTH + R_C1]
                                if self._exists(tensors, node, c0, c1):
                                    self._push(dev, c, stamp, num_init)
                                else:
                                    skip = c
                        # rare: gather the skipped consumers into the work list, in lane order
                        if cute.arch.vote_any_sync(skip >= 0):
                            for src in cutlass.range_constexpr(WARP):
                                v = cute.arch.shuffle_sync(skip, src)
                                if v >= 0:
                                    if n < WORK_CAP:
                                        if lane == 0:
                                            sWork[n] = v
                                        n = n + 1
                                    elif lane == 0:  # list full: queue it, the popper skips it
                                        self._push(dev, v, stamp, num_init)
                            cute.arch.sync_warp()
            if lane == 0:
                # relaxed: DONE guards no data (it only tells idle CTAs to stop polling; a task
                # is counted after it was popped, so DONE == num_tasks implies every pushed slot
                # was taken), and a release here would stall the lane on every task
                cute.arch.atomic_add(state.iterator + DONE, Int32(1), sem="relaxed", scope="gpu")

    @cute.jit
    def _run_task(
        self,
        tensors,
        prog,
        dev,
        mProf,
        peers,
        ev_off: Int32,
        rec,
        epoch: Int32,
        stamp: Int32,
        num_init: Int32,
        tidx: Int32,
        timeout_ns: Int64,
        sCtl,
        sWork,
        scratch,
    ) -> Boolean:
        """Run one task with the whole CTA; returns False when the watchdog stopped the launch.

        ``rec`` is the task's record (``REC_WIDTH`` values); every thread reads it into registers
        before the first barrier, so the caller may overwrite its storage after the task.
        """
        t, node, c0, c1 = rec[R_TASK], rec[R_NODE], rec[R_C0], rec[R_C1]
        w_lo, w_hi, n_lo, n_hi = rec[R_WLO], rec[R_WHI], rec[R_NLO], rec[R_NHI]
        notify_ev, ev_counter, prof = prog[P["notify_ev"]], dev[D["ev_counter"]], mProf
        # a popped (dynamic) task is ready by construction, except for its waits on other ranks
        alive = Boolean(True)
        if cutlass.const_expr(not self.spec.dynamic or self.spec.distributed):
            if tidx < WARP:
                if tidx == 0:
                    sCtl[0] = Int32(1)
                cute.arch.sync_warp()
                ok = Boolean(True)
                if cutlass.const_expr(not self.spec.dynamic):
                    ok = self._wait_all(prog, dev, t, w_lo, w_hi, epoch, tidx, timeout_ns)
                if cutlass.const_expr(self.spec.distributed):
                    if ok:
                        ok = self._wait_remote(prog, dev, peers, ev_off, t, epoch, tidx, timeout_ns)
                if not ok:
                    sCtl[0] = Int32(0)  # only ever lowered: no lane order needed
            cute.arch.sync_threads()
            alive = sCtl[0] != 0
        if alive:
            start = Int64(0)
            if cutlass.const_expr(self.spec.profile):
                start = cute.arch.globaltimer()
            if self._exists(tensors, node, c0, c1):
                self._dispatch(tensors, node, c0, c1, tidx, scratch)
                if cutlass.const_expr(self.fence_async):
                    cute.arch.fence_proxy("async.global")
            cute.arch.sync_threads()
            if tidx == 0:
                if cutlass.const_expr(self.spec.profile):
                    base = t * PROF_WIDTH
                    prof[base] = Int64(cute.arch.smid())
                    prof[base + 1] = start
                    prof[base + 2] = cute.arch.globaltimer()
                    prof[base + 3] = Int64(node)
                if cutlass.const_expr(not self.spec.dynamic):
                    for j in range(n_lo, n_hi):
                        notify_event(ev_counter.iterator + notify_ev[j], Int32(1), self.scope)
            if cutlass.const_expr(self.spec.dynamic):
                if tidx < WARP:
                    self._complete_dynamic(
                        tensors, prog, dev, t, epoch, stamp, num_init, tidx, sWork
                    )
        return alive

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

    # -- the kernel ---------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        graph_tensors: tuple,
        extras: tuple,
        mProg: cute.Tensor,
        mDev: cute.Tensor,
        mProf: cute.Tensor,
        mPeers: cute.Tensor,
        num_tasks: Int32,
        num_init: Int32,
        max_epoch: Int32,
        timeout_ns: Int64,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        # per node: its tensors (inputs + outputs) and its host-built extras; "tensors" below
        tensors = tuple(
            self._node_args(graph_tensors, k) + extras[k] for k in range(self.num_nodes)
        )
        smem = cutlass.memory.SmemAllocator()
        sCtl = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)
        sWork = smem.allocate_tensor(Int32, cute.make_layout(WORK_CAP), byte_alignment=16)
        sRec = smem.allocate_tensor(Int32, cute.make_layout(NUM_THREADS), byte_alignment=16)
        scratch = smem.allocate_array(
            cutlass.Uint8, self.spec.scratch_bytes, byte_alignment=SMEM_ALIGN
        )
        prog = self._views(mProg, len(PROGRAM))
        dev = self._views(mDev, len(DEVICE_STATE))
        task_rec, queue_ptr, queue_rec = (
            prog[P["task_rec"]],
            prog[P["queue_ptr"]],
            prog[P["queue_rec"]],
        )
        init_tasks = prog[P["init_tasks"]]
        state = dev[D["state"]]
        ev_off = mDev[2 * D["ev_counter"]]  # header: word offset of the counters
        epoch = state[EPOCH] + 1
        stamp = epoch * num_tasks

        if cutlass.const_expr(self.spec.dynamic):
            # tasks that wait on nothing fill ring slots [0, num_init) directly: every thread of
            # the grid stores a few, no atomics (later pushes go after them)
            ring = dev[D["ring"]]
            for j in range(bidx * NUM_THREADS + tidx, num_init, gdim * NUM_THREADS):
                cute.arch.store(
                    ring.iterator + j, stamp + init_tasks[j], sem="relaxed", scope="gpu"
                )
            ticket = Int32(0)
            if tidx == 0:
                ticket = self._take_ticket(dev)
            alive = Boolean(True)
            while alive:
                if tidx == 0:
                    t = self._pop(dev, ticket, num_tasks, stamp, timeout_ns)
                    # take the next ticket now: its round trip overlaps this task
                    if t >= 0:
                        ticket = self._take_ticket(dev)
                    sCtl[1] = t
                cute.arch.sync_threads()
                t = sCtl[1]
                alive = t >= 0
                if alive:
                    if tidx < REC_WIDTH:  # the popped task's record, one word a thread
                        sRec[tidx] = task_rec[t * REC_WIDTH + tidx]
                    cute.arch.sync_threads()
                    alive = self._run_task(
                        tensors,
                        prog,
                        dev,
                        mProf,
                        mPeers,
                        ev_off,
                        self._rec(sRec, 0),
                        epoch,
                        stamp,
                        num_init,
                        tidx,
                        timeout_ns,
                        sCtl,
                        sWork,
                        scratch,
                    )
        else:
            # stream this CTA's queue CHUNK records at a time: one coalesced word per thread
            i = queue_ptr[bidx]
            i_end = queue_ptr[bidx + 1]
            alive = i < i_end
            while alive:
                if i * REC_WIDTH + tidx < i_end * REC_WIDTH:
                    sRec[tidx] = queue_rec[i * REC_WIDTH + tidx]
                cute.arch.sync_threads()
                n = cute.min(CHUNK, i_end - i)
                ok = Boolean(True)
                for k in range(n):
                    if ok:
                        ok = self._run_task(
                            tensors,
                            prog,
                            dev,
                            mProf,
                            mPeers,
                            ev_off,
                            self._rec(sRec, k),
                            epoch,
                            stamp,
                            num_init,
                            tidx,
                            timeout_ns,
                            sCtl,
                            sWork,
                            scratch,
                        )
                i = i + CHUNK
                alive = ok and i < i_end

        # last CTA out closes the launch: next epoch, queue counters back to zero; once the
        # counter targets (count * epoch, epoch * num_tasks) would pass int32, it zeroes every
        # counter and restarts at epoch 0 (on the device: CUDA-graph replays never see the host)
        cute.arch.sync_threads()
        if tidx == 0:
            old = cute.arch.atomic_add(
                state.iterator + EXITED, Int32(1), sem="acq_rel", scope="gpu"
            )
            sCtl[2] = Int32(1) if old == gdim - 1 else Int32(0)
        cute.arch.sync_threads()
        if sCtl[2] != 0:
            if cutlass.const_expr(self.spec.distributed):
                if tidx == 0:
                    self._rank_barrier(mDev, mPeers, epoch)
            wrap = epoch >= max_epoch
            if wrap:
                for k in cutlass.range_constexpr(2, len(DEVICE_STATE)):  # past state, debug
                    arr = dev[k]
                    for j in range(tidx, cute.size(arr), NUM_THREADS):
                        arr[j] = Int32(0)
            cute.arch.sync_threads()
            if tidx == 0:
                state[HEAD] = 0
                state[TAIL] = 0
                state[DONE] = 0
                state[EXITED] = 0
                state[EPOCH] = Int32(0) if wrap else epoch

    @cute.jit
    def _rank_barrier(self, mDev, mPeers, epoch: Int32):
        """Last CTA out, one thread: tell every rank this one has finished launch ``epoch``,
        then wait until all have. No rank starts its next launch (which rewrites buffers the
        others read or write remotely) before every rank is done with this one; and no counter
        is remote-read across a reset, since distributed launches never wrap on the device."""
        world = cute.size(mPeers)
        state_off = mDev[2 * D["state"]]
        for p in range(world):
            addr = mPeers[p] + Int64(state_off + BARRIER) * 4
            ptr = cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=4)
            notify_event(ptr, Int32(1), "sys")
        wait_event(mDev.iterator + (state_off + BARRIER), world * epoch, "sys")

    @cute.jit
    def launch(
        self,
        tensors: tuple,
        mProg: cute.Tensor,
        mDev: cute.Tensor,
        mProf: cute.Tensor,
        mPeers: cute.Tensor,
        num_tasks: Int32,
        num_init: Int32,
        max_epoch: Int32,
        timeout_ns: Int64,
        grid: Int32,
        stream: cuda.CUstream,
    ):
        # shared memory is sized by the DSL from the kernel's SmemAllocator requests; cooperative
        # launch makes a grid that cannot be co-resident fail at launch instead of hanging
        extras = self._host_args(tensors)
        self.kernel(
            tensors, extras, mProg, mDev, mProf, mPeers, num_tasks, num_init, max_epoch, timeout_ns
        ).launch(grid=(grid, 1, 1), block=(NUM_THREADS, 1, 1), stream=stream, cooperative=True)


# CuTe DSL prefixes generated symbols with "cutlass_"; name the kernel after cutemk instead.
Megakernel.kernel.set_name_prefix("cutemk_megakernel", remove_cutlass_symbol=True)
Megakernel.launch.set_name_prefix("cutemk_megakernel_launch", remove_cutlass_symbol=True)
