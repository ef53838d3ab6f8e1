"""The megakernel: one persistent, warp-specialized ``@cute.kernel`` that runs a graph's tasks.

One CTA per SM, shaped by :class:`~cutemk.device.config.WorkerShape`:

- **Producer** (warp 0; the other warps of its warpgroup give their registers up): fetches
  tasks (static: this CTA's queue, streamed as fixed-width records, the first few with the
  queue's range from a row read at launch start beside the epoch, ``lower.QHEAD_WIDTH``;
  dynamic: a ticket into the on-GPU ready ring, ``cutemk.codegen.dynamic``), and for each
  task, in order:
  (1) a ring op's loads of operands no node of the graph writes (weights) into free ring slots,
  *before* the task's events are met; (2) the event waits (``cutemk.codegen.waits``; a popped
  dynamic task is ready by construction); (3) ``fence.proxy.async`` and the loads of operands
  produced in this launch for those slots; (4) the task record into the task queue, carrying
  in place of its wait range whether a data-dependent ring tile exists and its task word (the
  consumers take both from the record instead of reading the data again); (5) the
  tile's remaining slices, as ring slots free up. Then it moves on to the next task, so task
  i+1's loads are in flight while the consumers compute task i.
- **Consumers** (the other warpgroups): take records from the task queue; a ring op's tile is
  computed by every consumer thread (``TileOp.device_compute``: wgmma, epilogue, TMA store;
  or, for decode attention, shared-memory SIMT math and direct stores); a
  SIMT op's body runs on the first consumer warpgroup (the SIMT group) with its own named
  barrier. A ring op's output is staged in shared memory for
- the **storer** (warp 2 of the producer warpgroup), which TMA-stores it, waits for the writes
  and publishes the tile (static: release adds; dynamic: completes its events) while the
  consumers already compute their next tile. A SIMT tile is published by consumer warp 0
  (static: release adds) or, dynamic, handed to
- the **completer** (dynamic mode, warp 1 of the producer warpgroup), which completes its events
  and pushes the consumers they made ready, while the consumers already run their next task.

The ring's and the task queue's states are running counts held by each role across tasks
(``cutemk.device.ring``). The graph structure is compile-time; the task list, events and queues
of one token count are runtime int32 arrays (``cutemk.codegen.lower``), so one compiled kernel
serves every token count.

- Epochs: ``epoch = state[EPOCH] + 1`` per launch; the last CTA to exit stores it and resets the
  per-launch queue counters, so no host reset is needed between launches or graph replays.
- Watchdog (compile-time flag): waits give up after ``timeout_ns``; the first CTA to give up
  records (task, event, expected, seen, SM) in ``debug`` and raises ``state[ABORT]``; producers
  stop at their next task (still completing the ring slots they armed) and send the consumers
  a stop record. The host turns that into an error naming the event. Distributed, the last CTA
  of an aborted launch raises every peer's ``state[ABORT]`` too (``PEER_ABORT``), and the rank
  barrier that closes a launch gives up after ``timeout_ns`` (a rank that never arrives).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
from cutlass import Boolean, Int32, Int64, cute
from cutlass.cute.nvgpu import cpasync

from ..device.config import (
    NUM_THREADS,
    SIMT_WIDE_THREADS,
    STORER_WARP,
    WARP_SIZE as WARP,
    WARPGROUP,
    WorkerShape,
)
from ..device.ring import init_barriers
from ..envvars import env_int
from ..errors import GraphError
from ..tileop import TileOp
from .dynamic import DynamicQueue
from .layout import (
    D,
    DEVICE_STATE,
    LH,
    LIVE_ROW,
    LR,
    P,
    PROF_WIDTH,
    PROGRAM,
    live_row_width,
)
from .lower import (
    DONE,
    EPOCH,
    EXITED,
    HEAD,
    QHEAD_BEGIN,
    QHEAD_END,
    QHEAD_WIDTH,
    REC_WIDTH,
    TAIL,
    first_offset,
)
from .consumers import ConsumerRoles
from .profiling import slice_region
from .producer import ProducerRole
from .waits import EventWaits

__all__ = ["DEVICE_STATE", "PROF_WIDTH", "PROGRAM", "KernelSpec", "Megakernel", "worker_shape"]

SMEM_ALIGN = 1024  # 128-byte swizzled TMA tiles need 1024-byte aligned shared memory
SMEM_LIMIT = 232448  # Hopper: shared memory one CTA may use
SMEM_RESERVED = env_int("CUTEMK_SMEM_RESERVED", 4096, minimum=1024, multiple=1024)
"""Bytes kept for the kernel's own state and barriers before the 1024-aligned ring
(:func:`own_smem_bytes`: 720 B at 16 ring slots, so 1024 is exact; the DSL's count for the MoE
prefill kernel is then 232,448 B with a sixth 32 KB slot, its limit to the byte).
``CUTEMK_SMEM_RESERVED`` overrides it for a tuning run on a GPU; 4096 until one has run
the kernels with 1024 (an op that writes past its declared shared memory would now fault
where 3 KB of slack hid it)."""
MAX_RING_STAGES = 16


def own_smem_bytes(task_slots: int, ring_stages: int) -> int:
    """The kernel's own shared memory ahead of the ring, as :meth:`Megakernel.kernel`
    allocates it (16-byte aligned pieces): control words, the record staging, the task queue,
    the done queue, the staged record (Int32s) and the mbarriers (their count as the kernel's,
    with the staging buffer's release and staged barriers)."""
    words = (4, WARP, task_slots * REC_WIDTH, task_slots, REC_WIDTH)
    bars = 4 * task_slots + 2 * max(ring_stages, 1) + 2
    return sum(-(-4 * n // 16) * 16 for n in words) + -(-8 * bars // 16) * 16


def worker_shape(ops: tuple[TileOp, ...]) -> WorkerShape:
    """The CTA shape and shared-memory plan for a kernel running ``ops``; raises GraphError
    naming the ops when they cannot fit one SM's shared memory."""
    rings = [op.ring_tile() for op in ops if op.ring_tile() is not None]
    simt = [op for op in ops if op.ring_tile() is None]
    scratch = max([16] + [int(op.device_smem_bytes()) for op in simt])
    if scratch + SMEM_RESERVED > SMEM_LIMIT:
        worst = max(simt, key=lambda op: int(op.device_smem_bytes()))
        raise GraphError(
            f"{worst.name} needs {worst.device_smem_bytes()} B of shared memory per tile; with "
            f"the kernel's own {SMEM_RESERVED} B that passes the {SMEM_LIMIT} B an SM has"
        )
    scratch = -(-scratch // SMEM_ALIGN) * SMEM_ALIGN
    slot = max([r.slot_bytes for r in rings], default=0)
    # the staging buffer exists whenever the ring does (the storer's barriers pair per tile)
    epi = max([SMEM_ALIGN] + [r.epi_bytes for r in rings]) if rings else 0
    stages = 0
    if rings:
        free = SMEM_LIMIT - SMEM_RESERVED - epi - scratch
        cap = env_int("CUTEMK_RING_STAGES", MAX_RING_STAGES, minimum=0)  # tuning sweeps
        stages = min(cap, MAX_RING_STAGES, free // slot)
        if cap < 2:
            raise GraphError(f"CUTEMK_RING_STAGES={cap}: the ring needs at least 2 slots")
        if stages < 2:
            ring_ops = [op for op in ops if op.ring_tile() is not None]
            wide = max(ring_ops, key=lambda op: op.ring_tile().slot_bytes)
            staging = max(ring_ops, key=lambda op: op.ring_tile().epi_bytes)
            fat = max(simt, key=lambda op: int(op.device_smem_bytes()), default=None)
            scratch_of = f" ({fat.name})" if fat is not None else ""
            raise GraphError(
                f"megakernel shared memory: fewer than 2 ring slots fit in {SMEM_LIMIT} B: "
                f"{wide.name} needs ring slots of {slot} B, {staging.name} {epi} B of output "
                f"staging, and the SIMT ops {scratch} B of scratch{scratch_of}; use narrower "
                "tiles (block_n, router_block_n) or fewer tokens per routing tile"
            )
    shape = WorkerShape(ring_stages=stages, slot_bytes=slot, epi_bytes=epi, scratch_bytes=scratch)
    shape.check()
    own = own_smem_bytes(shape.task_slots, shape.ring_stages)
    assert -(-own // SMEM_ALIGN) * SMEM_ALIGN <= SMEM_RESERVED, (own, SMEM_RESERVED)
    return shape


def tma_atoms(extras: tuple) -> list:
    """The TMA copy atoms among the nodes' launch-time extras (``TileOp.host_args``): one a
    descriptor parameter of the kernel (an atom an op passes twice arrives as two)."""
    return [
        x
        for node_extras in extras
        for x in node_extras
        if isinstance(x, cute.CopyAtom) and isinstance(x.op, cpasync.TmaCopyOp)
    ]


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
    prefetch: tuple[bool, ...] = ()  # per node: its independent loads may precede its waits
    worker: WorkerShape = WorkerShape()
    # one capture for every token count: (graph tensor, dim, extent) of each dim that depends
    # on the token count, bound in the kernel to the extent's value at the plan the live count
    # picks (its row of the live-count table, ``layout.LIVE_ROW`` then one word per extent;
    # the kernel's last two tensors are that table and the count); None: plans from the host
    live: tuple[tuple[int, int, int], ...] | None = None
    # a cooperative launch starts every CTA at once or none (two persistent kernels on two
    # streams can then never each hold part of the GPU waiting for the rest); off
    # (``CUTEMK_COOPERATIVE=0``) only to measure what the guarantee costs a launch
    cooperative: bool = True
    # a task with no events to wait for (static: an empty wait list; every dynamic task) is
    # handed to the consumers before its loads, so they wait on its first slot, not on the
    # producer's issue of a ring's worth of slices (decode attention B=1: -3.6 us, see
    # benchmarks/NOTES.md); off (``CUTEMK_EARLY_HANDOVER=0``) only to measure it; a
    # distributed kernel ignores it
    early_handover: bool = True
    # the staging buffer's hand-overs by mbarriers instead of named barriers: its release
    # (storer -> consumers) and the staged tile's record (consumers -> storer). racecheck
    # follows neither named-barrier form here (an arrive -> sync; a sync of the consumers
    # and the storer right after one of the consumers alone: ``sanitize_patterns.py
    # worker``), and follows these (benchmarks/NOTES.md); off (``CUTEMK_EPI_MBARRIER=0``)
    # only to measure it
    epi_mbarrier: bool = True
    # with ``profile``: each ring slice's issue and landing too (``codegen.profiling``)
    profile_slices: bool = False
    # static: a CTA's queue range and first records read at launch start from its row of
    # ``queue_head`` beside the epoch (``lower.QHEAD_WIDTH``); off (``CUTEMK_QUEUE_HEAD=0``)
    # only to measure it: then through the header, ``queue_ptr`` and ``queue_rec``
    queue_head: bool = True
    # a live kernel launched with programmatic dependent launch: the regime kernels of one
    # live call follow each other on the stream and all but one exit at once, so each one's
    # launch may overlap the end of the kernel before it; it waits for that kernel
    # (``griddepcontrol.wait``, its memory flushed) before it reads the count, and lets the
    # next one launch at once. Opt-in (``CUTEMK_LIVE_PDL=1``): measured slower than the plain
    # launch on the H200 (an exiting kernel's CTAs wait for the SMs all the same)
    live_pdl: bool = False

    def describe(self) -> dict:
        """The spec as JSON-able data (the kernel stage of ``CUTEMK_DUMP``)."""
        return {
            "ops": [{"name": op.name, "config": repr(op)} for op in self.ops],
            "node_tensors": [list(t) for t in self.node_tensors],
            "values": [list(v) for v in self.values],
            "dynamic": self.dynamic,
            "watchdog": self.watchdog,
            "profile": self.profile,
            "arch": self.arch,
            "distributed": self.distributed,
            "prefetch": list(self.prefetch),
            "worker": dataclasses.asdict(self.worker),
            "live": None if self.live is None else [list(p) for p in self.live],
            "cooperative": self.cooperative,
            "early_handover": self.early_handover,
            "epi_mbarrier": self.epi_mbarrier,
            "profile_slices": self.profile_slices,
            "queue_head": self.queue_head,
            "live_pdl": self.live_pdl,
        }


@dataclass
class _Launch:
    """What the roles of one launch read: the kernel's arguments, the program and state views,
    the pipelines' mbarriers and the shared-memory buffers. Plain Python holding traced values
    that are fixed for the launch (loop-carried state stays in the roles' own variables)."""

    tensors: tuple  # per node: its tensors and host-built extras
    prog: tuple  # views of the packed program (``layout.PROGRAM``)
    dev: tuple  # views of the packed device state (``layout.DEVICE_STATE``)
    prof: object  # profile records
    peers: object  # distributed: peer table of device-state buffers
    ev_off: object  # word offset of the event counters in the device state
    epoch: object
    stamp: object  # dynamic ring slot stamp: epoch * num_tasks
    num_tasks: object
    num_init: object
    timeout_ns: object
    bars: tuple  # (queue full, queue empty, ring full, ring empty, done full, done empty)
    sQueue: object  # task records, producer -> consumers
    sRec: object  # static queue records fetched by the producer
    sDone: object  # finished task ids, consumers -> completer
    sEpiRec: object  # the staged tile's record, consumers -> storer
    ring: object
    epi: object
    scratch: object
    epi_bar: object = None  # the staging buffer's release mbarrier (``KernelSpec.epi_mbarrier``)
    epi_full: object = None  # its staged record's hand-over mbarrier (consumers -> storer)
    # static, the producer warp: this lane's word of its CTA's ``queue_head`` row (of the
    # queue's first records), the queue's begin and end in ``queue_rec`` (zeros elsewhere)
    queue_head: tuple = ()
    # ``profile_slices``: this CTA's slice region of the profile buffer (first word, capacity)
    slices: tuple = ()
    sCtl: object = None  # a few control words (profile: consumer thread 0's current ring task)


class Megakernel(EventWaits, DynamicQueue, ProducerRole, ConsumerRoles):
    def __init__(self, spec: KernelSpec) -> None:
        self.spec = spec
        self.w = spec.worker
        self.num_nodes = len(spec.ops)
        self.ring_of = tuple(op.ring_tile() for op in spec.ops)
        # ring ops whose tiles prefetch their slices into L2 before their events (static
        # slice counts only)
        self.l2_prefetch = tuple(
            r is not None and op.prefetches_l2 and not op.dynamic_slices
            for op, r in zip(spec.ops, self.ring_of)
        )
        self.has_exists = tuple(op.exists_on_device for op in spec.ops)
        self.dynamic_slices = tuple(
            r is not None and op.dynamic_slices for r, op in zip(self.ring_of, spec.ops)
        )
        for k, op in enumerate(spec.ops):
            # a ring tile that might not exist is decided after its events (the producer and
            # the consumers read the same settled data): nothing of it may be loaded before
            # (unless the op decides it from launch inputs alone: ``TileOp.early_exists``)
            assert not (
                self.ring_of[k] and op.exists_on_device and spec.prefetch[k] and not op.early_exists
            ), op.name
            # a slice count read from launch data is read with the existence verdict
            assert not self.dynamic_slices[k] or op.exists_on_device, op.name
            # a SIMT body runs on the SIMT group or on both consumer warpgroups
            assert self.ring_of[k] or op.simt_threads in (NUM_THREADS, SIMT_WIDE_THREADS), (
                op.name,
                op.simt_threads,
            )
        # some tile reads global memory through the async proxy (TMA): every task's stores
        # are fenced into it before they are notified
        self.fence_async = any(op.reads_async_proxy() for op in spec.ops)
        # events other GPUs read are released at system scope
        self.scope = "sys" if spec.distributed else "gpu"

    # -- helpers (inlined) --------------------------------------------------------------------
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
        w = self.w
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        sCtl = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)
        sRec = smem.allocate_tensor(Int32, cute.make_layout(WARP), byte_alignment=16)
        sQueue = smem.allocate_tensor(
            Int32, cute.make_layout(w.task_slots * REC_WIDTH), byte_alignment=16
        )
        sDone = smem.allocate_tensor(Int32, cute.make_layout(w.task_slots), byte_alignment=16)
        sEpiRec = smem.allocate_tensor(Int32, cute.make_layout(REC_WIDTH), byte_alignment=16)
        n_bars = 4 * w.task_slots + 2 * max(w.ring_stages, 1)
        epi_mbar = self.spec.epi_mbarrier and w.ring_stages > 0
        if cutlass.const_expr(epi_mbar):
            n_bars += 2  # the staging buffer's release and its staged record's hand-over
        bar_mem = smem.allocate_tensor(Int64, cute.make_layout(n_bars), byte_alignment=8)
        q_full = bar_mem.iterator
        q_empty = q_full + w.task_slots
        r_full = q_empty + w.task_slots
        r_empty = r_full + max(w.ring_stages, 1)
        d_full = r_empty + max(w.ring_stages, 1)
        d_empty = d_full + w.task_slots
        ring = None
        epi = None
        if cutlass.const_expr(w.ring_stages > 0):
            ring = smem.allocate_array(cutlass.Uint8, w.ring_bytes, byte_alignment=SMEM_ALIGN)
            epi = smem.allocate_array(cutlass.Uint8, w.epi_bytes, byte_alignment=SMEM_ALIGN)
        scratch = smem.allocate_array(cutlass.Uint8, w.scratch_bytes, byte_alignment=SMEM_ALIGN)
        if tidx == 0:
            init_barriers(q_full, w.task_slots, 1)
            init_barriers(q_empty, w.task_slots, w.queue_readers)
            init_barriers(d_full, w.task_slots, 1)
            init_barriers(d_empty, w.task_slots, WARP)  # the completer warp reads
            if cutlass.const_expr(w.ring_stages > 0):
                init_barriers(r_full, w.ring_stages, 1)
                init_barriers(r_empty, w.ring_stages, w.consumer_warps)
            if cutlass.const_expr(epi_mbar):
                init_barriers(d_empty + w.task_slots, 1, WARP)  # every storer lane releases
                init_barriers(d_empty + w.task_slots + 1, 1, w.consumer_threads)  # staged
        cute.arch.mbarrier_init_fence()
        bars = (q_full, q_empty, r_full, r_empty, d_full, d_empty)
        epi_bar = d_empty + w.task_slots if epi_mbar else None
        shared = (sCtl, sRec, sQueue, sDone, sEpiRec, bars, ring, epi, scratch, epi_bar)
        args = (mProf, mPeers, timeout_ns, shared)
        if cutlass.const_expr(self.spec.live is None):
            self._run(graph_tensors, extras, mProg, mDev, num_tasks, num_init, max_epoch, *args)
        else:
            # one capture for every token count: the live count (device data) picks this
            # launch's plan from the table; the token-dependent dims of the graph's tensors
            # (passed at their maxima) are bound to their values at that plan's count (or to
            # the live count, ``_bind_tokens``)
            nv = len(graph_tensors)
            table, count = graph_tensors[nv - 2], graph_tensors[nv - 1]
            if cutlass.const_expr(self.spec.live_pdl):
                # launched before the kernel ahead of it finished: nothing is read before it
                # has (the count may be its output); then the next kernel may launch
                cute.arch.griddepcontrol_wait()
                cute.arch.griddepcontrol_launch_dependents()
            # the count and the header's words in one round trip (independent loads, issued
            # before any branch): a count another regime's kernel serves is told apart by
            # them alone; the count's own copy of its plan's row is the next round trip
            live = count[0]
            first = table[LH["first"]]
            top = table[LH["max"]]
            limit = table[LH["limit"]]
            count_rows = table[LH["count_rows"]]
            bad = Boolean(live < 0)
            if live > limit:
                bad = Boolean(True)
            if bad:
                if bidx == 0:
                    if tidx == 0:
                        cute.arch.atomic_add(
                            table.iterator + LH["bad"], Int32(1), sem="relaxed", scope="gpu"
                        )
                        table[LH["last_bad"]] = live
            mine = Boolean(live >= first)
            if live > top:
                mine = Boolean(False)
            if mine:
                row = count_rows + live_row_width(self.spec.live) * (live - first)
                bound = tuple(
                    self._bind_tokens(graph_tensors[i], i, table, row, live) for i in range(nv - 2)
                )
                self._run(
                    bound,
                    extras,
                    cute.make_tensor(
                        mProg.iterator + table[row + LR["prog_off"]],
                        cute.make_layout(table[row + LR["prog_len"]]),
                    ),
                    cute.make_tensor(
                        mDev.iterator + table[row + LR["dev_off"]],
                        cute.make_layout(table[row + LR["dev_len"]]),
                    ),
                    table[row + LR["num_tasks"]],
                    table[row + LR["num_init"]],
                    table[row + LR["max_epoch"]],
                    *args,
                )

    def _bind_tokens(self, t, i: int, table, row, live):
        """``t`` (graph tensor ``i``) with each token-dependent dim (``KernelSpec.live``) set to
        its extent in the plan's ``row`` of the live table, or to the ``live`` count itself
        (extent -1: ``TileOp.live_rows_inputs``); strides stay those of the tensor passed
        (allocated at the maxima)."""
        extent = {d: j for k, d, j in self.spec.live if k == i}
        if not extent:
            return t
        shape = tuple(
            (live if extent[d] < 0 else table[row + len(LIVE_ROW) + extent[d]])
            if d in extent
            else t.shape[d]
            for d in range(cute.rank(t))
        )
        return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=t.stride))

    @cute.jit
    def _run(
        self,
        graph_tensors: tuple,
        extras: tuple,
        mProg: cute.Tensor,
        mDev: cute.Tensor,
        num_tasks: Int32,
        num_init: Int32,
        max_epoch: Int32,
        mProf: cute.Tensor,
        mPeers: cute.Tensor,
        timeout_ns: Int64,
        shared: tuple,
    ):
        """One launch of the plan in ``mProg`` / ``mDev``: the roles, then the close."""
        w = self.w
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        sCtl, sRec, sQueue, sDone, sEpiRec, bars, ring, epi, scratch, epi_bar = shared
        cta_rec = None  # profile: this CTA's record, after the tasks' records
        slices = ()
        if cutlass.const_expr(self.spec.profile_slices):
            slices = slice_region(mProf, num_tasks, bidx, gdim)
        if cutlass.const_expr(self.spec.profile):
            cta_rec = num_tasks * PROF_WIDTH + bidx * PROF_WIDTH
            if tidx == 0:  # SM, entry, roles done, exit (ns)
                mProf[cta_rec] = Int64(cute.arch.smid())
                mProf[cta_rec + 1] = cute.arch.globaltimer()
        # per node: its tensors (inputs + outputs) and its host-built extras; "tensors" below
        tensors = tuple(
            self._node_args(graph_tensors, k) + extras[k] for k in range(self.num_nodes)
        )
        # every TMA descriptor of the launch fetched now, by the producer warp, so that no
        # node's first box waits for its descriptor's round trip (from HBM after a flushed L2)
        if tidx < WARP:
            for atom in tma_atoms(extras):
                cpasync.prefetch_descriptor(atom)
        # read first and at fixed offsets, so all in one round trip (the views below need
        # their buffer's header first): the epoch, and (static) this CTA's row of queue_head,
        # its queue's range and first records (a word a producer lane)
        head_word, q_begin, q_end = Int32(0), Int32(0), Int32(0)
        if cutlass.const_expr(self.spec.queue_head and not self.spec.dynamic):
            if tidx < WARP:  # the producer warp's (the other warps never read them)
                row = first_offset(len(PROGRAM)) + bidx * QHEAD_WIDTH
                head_word = mProg[row + tidx]
                q_begin = mProg[row + QHEAD_BEGIN]
                q_end = mProg[row + QHEAD_END]
        # (the dynamic kernel reads its epoch through the view: a fixed-offset read there cost
        # its register allocation 4 bytes more of spills, and it has no queue head to overlap)
        fixed_epoch = self.spec.queue_head and not self.spec.dynamic
        if cutlass.const_expr(fixed_epoch):
            epoch = mDev[first_offset(len(DEVICE_STATE)) + EPOCH] + 1  # state[EPOCH]
        prog = self._views(mProg, len(PROGRAM))
        dev = self._views(mDev, len(DEVICE_STATE))
        state = dev[D["state"]]
        if cutlass.const_expr(not fixed_epoch):  # (static: measuring, the old way)
            epoch = state[EPOCH] + 1
        ev_off = mDev[2 * D["ev_counter"]]  # header: word offset of the counters
        stamp = epoch * num_tasks
        if cutlass.const_expr(self.spec.dynamic):
            # tasks that wait on nothing fill ring slots [0, num_init) directly: every thread of
            # the grid stores a few, no atomics (later pushes go after them)
            init_tasks, rq = prog[P["init_tasks"]], dev[D["ring"]]
            for j in range(bidx * w.threads + tidx, num_init, gdim * w.threads):
                cute.arch.store(rq.iterator + j, stamp + init_tasks[j], sem="relaxed", scope="gpu")
        cute.arch.sync_threads()

        L = _Launch(
            tensors=tensors,
            prog=prog,
            dev=dev,
            prof=mProf,
            peers=mPeers,
            ev_off=ev_off,
            epoch=epoch,
            stamp=stamp,
            num_tasks=num_tasks,
            num_init=num_init,
            timeout_ns=timeout_ns,
            bars=bars,
            sQueue=sQueue,
            sRec=sRec,
            sDone=sDone,
            sEpiRec=sEpiRec,
            ring=ring,
            epi=epi,
            scratch=scratch,
            epi_bar=epi_bar,
            epi_full=None if epi_bar is None else epi_bar + 1,
            queue_head=(head_word, q_begin, q_end),
            slices=slices,
            sCtl=sCtl,
        )
        warp = cute.arch.make_warp_uniform(tidx // WARP)
        if warp < WARPGROUP // WARP:
            cute.arch.setmaxregister_decrease(w.producer_regs)
            if warp == 0:
                self._producer(L, tidx)
            if cutlass.const_expr(w.ring_stages > 0):
                if warp == STORER_WARP:
                    self._storer(L, tidx % WARP)
            if cutlass.const_expr(self.spec.dynamic):
                if warp == 1:
                    self._completer(L, tidx - WARP)
        else:
            cute.arch.setmaxregister_increase(w.consumer_regs)
            self._consumer(L, tidx - WARPGROUP)

        # last CTA out closes the launch: next epoch, queue counters back to zero; once the
        # counter targets (count * epoch, epoch * num_tasks) would pass int32, it zeroes every
        # counter and restarts at epoch 0 (on the device: CUDA-graph replays never see the host)
        cute.arch.sync_threads()
        if cutlass.const_expr(self.spec.profile):
            if tidx == 0:
                mProf[cta_rec + 2] = cute.arch.globaltimer()
        if tidx == 0:
            old = cute.arch.atomic_add(
                state.iterator + EXITED, Int32(1), sem="acq_rel", scope="gpu"
            )
            sCtl[2] = Int32(1) if old == gdim - 1 else Int32(0)
        cute.arch.sync_threads()
        if sCtl[2] != 0:
            if cutlass.const_expr(self.spec.distributed):
                if tidx == 0:
                    self._rank_barrier(mDev, dev, mPeers, epoch, timeout_ns)
            wrap = epoch >= max_epoch
            if wrap:
                for k in cutlass.range_constexpr(2, len(DEVICE_STATE)):  # past state, debug
                    arr = dev[k]
                    for j in range(tidx, cute.size(arr), w.threads):
                        arr[j] = Int32(0)
            cute.arch.sync_threads()
            if tidx == 0:
                state[HEAD] = 0
                state[TAIL] = 0
                state[DONE] = 0
                state[EXITED] = 0
                state[EPOCH] = Int32(0) if wrap else epoch
        if cutlass.const_expr(self.spec.profile):
            if tidx == 0:
                mProf[cta_rec + 3] = cute.arch.globaltimer()

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
        # launch makes a grid that cannot be co-resident fail at launch instead of hanging;
        # min_blocks_per_mp=1 caps registers at entry, which setmaxnreg needs to take effect
        extras = self._host_args(tensors)
        self.kernel(
            tensors, extras, mProg, mDev, mProf, mPeers, num_tasks, num_init, max_epoch, timeout_ns
        ).launch(
            grid=(grid, 1, 1),
            block=(self.w.threads, 1, 1),
            stream=stream,
            cooperative=self.spec.cooperative,
            min_blocks_per_mp=1,
            use_pdl=self.spec.live_pdl,
        )


# CuTe DSL prefixes generated symbols with "cutlass_"; name the kernel after cutemk instead.
Megakernel.kernel.set_name_prefix("cutemk_megakernel", remove_cutlass_symbol=True)
Megakernel.launch.set_name_prefix("cutemk_megakernel_launch", remove_cutlass_symbol=True)
