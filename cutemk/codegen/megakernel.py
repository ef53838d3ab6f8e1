"""The megakernel: one persistent ``@cute.kernel`` that runs a whole graph's tasks.

Each CTA loops: fetch a task -> (static mode) wait on its events -> dispatch on the task's node
to that op's ``device_tile`` -> notify. The graph structure (which ops, which tensors each reads)
is compile-time; the task list, events and queues of one token count are runtime int32 arrays
(``cutemk.codegen.lower``), so one compiled kernel serves every token count.

Protocol (see ``cutemk.device.sync`` for the memory-ordering rules):

- Static: CTA g runs ``queue_tasks[queue_ptr[g]:queue_ptr[g+1]]`` in order; before a task one
  thread acquires each event the task waits on (counter >= count * epoch), ``bar.sync``, the CTA
  runs the tile, ``bar.sync``, one thread release-adds 1 to each event the task notifies.
- Dynamic: a ring of task ids (``ring_task``; ``ring_epoch[slot] == epoch`` marks a slot filled
  in this launch). CTAs push the tasks that wait on nothing, then pop: take a ticket (atomic on
  HEAD) and spin until that slot is filled, or until DONE says every task has finished. After a
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

from ..device.config import NUM_THREADS
from ..device.sync import notify_event, wait_event, wait_event_or_timeout
from ..tileop import TileOp
from .lower import (ABORT, DBG_EVENT, DBG_EXPECTED, DBG_KIND, DBG_SEEN, DBG_SM, DBG_TASK, DONE,
                    EPOCH, EXITED, HEAD, KIND_EVENT_WAIT, KIND_QUEUE_IDLE, REC_WIDTH, TAIL)

SMEM_ALIGN = 128
WORK_CAP = 64  # skipped-task work list of the dynamic pusher; beyond it, tasks are pushed as is
PROGRAM = ("task_rec", "wait_ptr", "wait_ev", "notify_ptr", "notify_ev", "ev_count", "queue_ptr",
           "queue_tasks", "cons_ptr", "cons_task", "task_nwait", "init_tasks")
DEVICE_STATE = ("state", "debug", "ev_counter", "task_pending", "ring_task", "ring_epoch", "prof")
PROF_WIDTH = 4  # per task: SM, start ns, end ns, node (int64)


@dataclass(frozen=True)
class KernelSpec:
    """Everything the kernel's code depends on: the compile-cache key."""

    ops: tuple[TileOp, ...]  # per graph node
    node_tensors: tuple[tuple[int, ...], ...]  # per node: indices into the graph tensor tuple
    dynamic: bool
    watchdog: bool
    profile: bool
    arch: str

    @property
    def scratch_bytes(self) -> int:
        need = [int(op.device_smem_bytes()) for op in self.ops]
        return max([16] + need)


class Megakernel:
    def __init__(self, spec: KernelSpec) -> None:
        self.spec = spec
        self.num_nodes = len(spec.ops)
        self.has_exists = tuple(hasattr(op, "device_exists") for op in spec.ops)

    # -- device helpers (inlined) -------------------------------------------------------------
    def _node_args(self, tensors, k: int):
        return tuple(tensors[i] for i in self.spec.node_tensors[k])

    @cute.jit
    def _exists(self, tensors, node: Int32, c0: Int32, c1: Int32) -> Boolean:
        ok = Boolean(True)
        for k in cutlass.range_constexpr(self.num_nodes):
            if cutlass.const_expr(self.has_exists[k]):
                if node == k:
                    ok = self.spec.ops[k].device_exists(self._node_args(tensors, k), c0, c1)
        return ok

    @cute.jit
    def _dispatch(self, tensors, node: Int32, c0: Int32, c1: Int32, tidx: Int32, scratch):
        for k in cutlass.range_constexpr(self.num_nodes):
            if node == k:
                self.spec.ops[k].device_tile(self._node_args(tensors, k), c0, c1, tidx, scratch)

    @cute.jit
    def _abort(self, state, debug, task: Int32, event: Int32, expected: Int32, seen: Int32,
               kind: Int32):
        old = cute.arch.atomic_cas(state.iterator + ABORT, cmp=Int32(0), val=Int32(1),
                                   sem="acq_rel", scope="gpu")
        if old == 0:
            debug[DBG_TASK] = task
            debug[DBG_EVENT] = event
            debug[DBG_EXPECTED] = expected
            debug[DBG_SEEN] = seen
            debug[DBG_SM] = cute.arch.smid()
            debug[DBG_KIND] = kind

    @cute.jit
    def _wait_all(self, prog, dev, t: Int32, epoch: Int32, timeout_ns: Int64) -> Boolean:
        """One thread: wait for every event task t waits on. False if the watchdog fired."""
        _, wait_ptr, wait_ev, _, _, ev_count = prog[0], prog[1], prog[2], prog[3], prog[4], prog[5]
        state, debug, ev_counter = dev[0], dev[1], dev[2]
        ok = Boolean(True)
        if cutlass.const_expr(self.spec.watchdog):
            ok = cute.arch.load(state.iterator + ABORT, Int32, sem="relaxed", scope="gpu") == 0
        j = wait_ptr[t]
        j_end = wait_ptr[t + 1]
        going = ok and j < j_end
        while going:
            e = wait_ev[j]
            target = ev_count[e] * epoch
            if cutlass.const_expr(self.spec.watchdog):
                timed_out, seen = wait_event_or_timeout(ev_counter.iterator + e, target, timeout_ns)
                if timed_out:
                    self._abort(state, debug, t, e, target, seen, Int32(KIND_EVENT_WAIT))
                    ok = Boolean(False)
            else:
                wait_event(ev_counter.iterator + e, target)
            j = j + 1
            going = ok and j < j_end
        return ok

    @cute.jit
    def _push(self, dev, t: Int32, epoch: Int32):
        state, ring_task, ring_epoch = dev[0], dev[4], dev[5]
        slot = cute.arch.atomic_add(state.iterator + TAIL, Int32(1), sem="relaxed", scope="gpu")
        ring_task[slot] = t
        cute.arch.store(ring_epoch.iterator + slot, epoch, sem="release", scope="gpu")

    @cute.jit
    def _complete_dynamic(self, tensors, prog, dev, t: Int32, epoch: Int32, sWork):
        """One thread: notify for task t, push consumers made ready, complete skipped ones."""
        task_rec, notify_ptr, notify_ev, ev_count = prog[0], prog[3], prog[4], prog[5]
        cons_ptr, cons_task, task_nwait = prog[8], prog[9], prog[10]
        state, ev_counter, task_pending = dev[0], dev[2], dev[3]
        sWork[0] = t
        n = Int32(1)
        while n > 0:
            n = n - 1
            u = sWork[n]
            for j in range(notify_ptr[u], notify_ptr[u + 1]):
                e = notify_ev[j]
                old = cute.arch.atomic_add(ev_counter.iterator + e, Int32(1), sem="acq_rel",
                                           scope="gpu")
                if old + 1 == ev_count[e] * epoch:
                    for i in range(cons_ptr[e], cons_ptr[e + 1]):
                        c = cons_task[i]
                        p = cute.arch.atomic_add(task_pending.iterator + c, Int32(1),
                                                 sem="acq_rel", scope="gpu")
                        if p + 1 == task_nwait[c] * epoch:
                            node = task_rec[c * REC_WIDTH]
                            c0 = task_rec[c * REC_WIDTH + 1]
                            c1 = task_rec[c * REC_WIDTH + 2]
                            if self._exists(tensors, node, c0, c1) or n >= WORK_CAP:
                                self._push(dev, c, epoch)
                            else:
                                sWork[n] = c
                                n = n + 1
            cute.arch.atomic_add(state.iterator + DONE, Int32(1), sem="release", scope="gpu")

    @cute.jit
    def _run_task(self, tensors, prog, dev, t: Int32, epoch: Int32, tidx: Int32,
                  timeout_ns: Int64, sCtl, sWork, scratch) -> Boolean:
        """Run task t with the whole CTA; returns False when the watchdog stopped the launch."""
        task_rec, notify_ptr, notify_ev = prog[0], prog[3], prog[4]
        ev_counter, prof = dev[2], dev[6]
        if tidx == 0:
            ok = Boolean(True)
            if cutlass.const_expr(not self.spec.dynamic):
                ok = self._wait_all(prog, dev, t, epoch, timeout_ns)
            sCtl[0] = Int32(1) if ok else Int32(0)
        cute.arch.sync_threads()
        alive = sCtl[0] != 0
        if alive:
            node = task_rec[t * REC_WIDTH]
            c0 = task_rec[t * REC_WIDTH + 1]
            c1 = task_rec[t * REC_WIDTH + 2]
            start = Int64(0)
            if cutlass.const_expr(self.spec.profile):
                start = cute.arch.globaltimer()
            if self._exists(tensors, node, c0, c1):
                self._dispatch(tensors, node, c0, c1, tidx, scratch)
            cute.arch.sync_threads()
            if tidx == 0:
                if cutlass.const_expr(self.spec.profile):
                    base = t * PROF_WIDTH
                    prof[base] = Int64(cute.arch.smid())
                    prof[base + 1] = start
                    prof[base + 2] = cute.arch.globaltimer()
                    prof[base + 3] = Int64(node)
                if cutlass.const_expr(self.spec.dynamic):
                    self._complete_dynamic(tensors, prog, dev, t, epoch, sWork)
                else:
                    for j in range(notify_ptr[t], notify_ptr[t + 1]):
                        notify_event(ev_counter.iterator + notify_ev[j], Int32(1))
        return alive

    @cute.jit
    def _pop(self, dev, num_tasks: Int32, epoch: Int32, timeout_ns: Int64) -> Int32:
        """One thread: the next ready task, or -1 once every task of the launch is done."""
        state, debug, ring_task, ring_epoch = dev[0], dev[1], dev[4], dev[5]
        task = Int32(-1)
        ticket = cute.arch.atomic_add(state.iterator + HEAD, Int32(1), sem="relaxed", scope="gpu")
        if ticket < num_tasks:
            spinning = Boolean(True)
            backoff = Int32(32)
            t0 = Int64(0)
            if cutlass.const_expr(self.spec.watchdog):
                t0 = cute.arch.globaltimer()
            while spinning:
                filled = cute.arch.load(ring_epoch.iterator + ticket, Int32, sem="acquire",
                                        scope="gpu")
                if filled == epoch:
                    task = ring_task[ticket]
                    spinning = Boolean(False)
                else:
                    done = cute.arch.load(state.iterator + DONE, Int32, sem="acquire",
                                          scope="gpu")
                    if done >= num_tasks:
                        spinning = Boolean(False)
                    else:
                        prims.nanosleep(backoff)
                        if backoff < 1024:
                            backoff = backoff * 2
                        if cutlass.const_expr(self.spec.watchdog):
                            if cute.arch.load(state.iterator + ABORT, Int32, sem="relaxed",
                                              scope="gpu") != 0:
                                spinning = Boolean(False)
                            elif cute.arch.globaltimer() - t0 > timeout_ns:
                                self._abort(state, debug, Int32(-1), Int32(-1), num_tasks, done,
                                            Int32(KIND_QUEUE_IDLE))
                                spinning = Boolean(False)
        return task

    # -- the kernel ---------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, tensors: tuple, prog: tuple, dev: tuple, num_tasks: Int32, num_init: Int32,
               timeout_ns: Int64):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        smem = cutlass.memory.SmemAllocator()
        sCtl = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)
        sWork = smem.allocate_tensor(Int32, cute.make_layout(WORK_CAP), byte_alignment=16)
        scratch = smem.allocate_array(cutlass.Uint8, self.spec.scratch_bytes,
                                      byte_alignment=SMEM_ALIGN)
        queue_ptr, queue_tasks, init_tasks = prog[6], prog[7], prog[11]
        state = dev[0]
        epoch = state[EPOCH] + 1

        if cutlass.const_expr(self.spec.dynamic):
            if tidx == 0:
                for j in range(bidx, num_init, gdim):
                    self._push(dev, init_tasks[j], epoch)
            alive = Boolean(True)
            while alive:
                if tidx == 0:
                    sCtl[1] = self._pop(dev, num_tasks, epoch, timeout_ns)
                cute.arch.sync_threads()
                t = sCtl[1]
                alive = t >= 0
                if alive:
                    alive = self._run_task(tensors, prog, dev, t, epoch, tidx, timeout_ns, sCtl,
                                           sWork, scratch)
        else:
            i = queue_ptr[bidx]
            i_end = queue_ptr[bidx + 1]
            alive = i < i_end
            while alive:
                ok = self._run_task(tensors, prog, dev, queue_tasks[i], epoch, tidx, timeout_ns,
                                    sCtl, sWork, scratch)
                i = i + 1
                alive = ok and i < i_end

        # last CTA out closes the launch: next epoch, queue counters back to zero
        cute.arch.sync_threads()
        if tidx == 0:
            old = cute.arch.atomic_add(state.iterator + EXITED, Int32(1), sem="acq_rel",
                                       scope="gpu")
            if old == gdim - 1:
                state[HEAD] = 0
                state[TAIL] = 0
                state[DONE] = 0
                state[EXITED] = 0
                state[EPOCH] = epoch

    @cute.jit
    def launch(self, tensors: tuple, prog: tuple, dev: tuple, num_tasks: Int32, num_init: Int32,
               timeout_ns: Int64, grid: Int32, stream: cuda.CUstream):
        # shared memory is sized by the DSL from the kernel's SmemAllocator requests; cooperative
        # launch makes a grid that cannot be co-resident fail at launch instead of hanging
        self.kernel(tensors, prog, dev, num_tasks, num_init, timeout_ns).launch(
            grid=(grid, 1, 1), block=(NUM_THREADS, 1, 1), stream=stream, cooperative=True)


# CuTe DSL prefixes generated symbols with "cutlass_"; name the kernel after cutemk instead.
Megakernel.kernel.set_name_prefix("cutemk_megakernel", remove_cutlass_symbol=True)
Megakernel.launch.set_name_prefix("cutemk_megakernel_launch", remove_cutlass_symbol=True)
