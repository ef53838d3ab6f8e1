"""The CuTe DSL backend on the host: per-token-count buffers, launch, diagnosis.

A graph's megakernel comes from :mod:`cutemk.kernels` (compiled once per graph structure, kept
for the process and on disk); a new token count only builds a new plan and its int32 program
arrays (cached per bound dims), never a new kernel. The kernel-building names are re-exported
here (``runtime.compile_offline``, ``runtime.kernel_spec``, ``runtime.compile_count``, ...).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .arch import target_arch
from .binding import LeavesApart, bind, env_key, fresh_, poison_
from .codegen.lower import (
    ABORT,
    DEBUG_SIZE,
    EPOCH,
    MAX_EPOCH_COUNT,
    STATE_SIZE,
    LoweredPlan,
    lower,
    pack_int32,
)
from .codegen.megakernel import DEVICE_STATE, PROGRAM
from .codegen.profiling import profile_words, slice_capacity
from .comm import Communicator, different_plans_error, plan_digest, symmetric_values
from .diagnose import diagnose_abort as _diagnose
from .errors import CuteMKError, DeadlockError, DeviceError, GraphError, LayoutError
from .graph import Graph
from .kernels import (  # noqa: F401 (re-exported: the backend's compile entry points)
    _COMPILED,
    _cache_path,
    _compile,
    _outside_sources,
    check_launch_options,
    compile_offline,
    kernel_cache_dir,
    kernel_spec,
    live_pdl,
)
from .plan import Plan, check_env, dump_stage, instantiate, no_gc
from .profiles import ProfileReaders
from .scheduling import SchedulingMode, check_static_schedule, resolve_scheduler
from .symbolic import free_syms, upper


def _off_graph(fn, *args):
    """Run ``fn`` (which allocates and fills the persistent device state of a plan) on a
    thread of its own, on a stream of its own, and wait for it there.

    The state outlives the call: it must not come from a CUDA-graph memory pool, and filling
    it must not be recorded into a graph being captured. ``torch.compile(mode=
    "reduce-overhead")`` routes the calling thread's allocations to its pool while it warms up
    and captures; another thread allocates from the ordinary pool, and a capture in
    thread-local mode does not see that thread's copies."""
    device = torch.cuda.current_device()
    box: dict[str, Any] = {}

    def work():
        try:
            torch.cuda.set_device(device)
            with torch.cuda.stream(torch.cuda.Stream(device)), no_gc():
                box["out"] = fn(*args)
                torch.cuda.current_stream().synchronize()
        except BaseException as e:  # re-raised on the caller's thread
            box["err"] = e

    t = threading.Thread(target=work, name="cutemk-build")
    t.start()
    t.join()
    if "err" in box:
        raise box["err"]
    return box["out"]


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@dataclass
class _Buffers:
    """Device state of one plan (one token count): program, counters, intermediates."""

    plan: Plan
    lowered: LoweredPlan
    kernel_args: tuple  # after the value tensors: program, state, profile, peers, task counts
    torch_dev: dict[str, torch.Tensor]  # the same buffers (and views of the state) for the host
    intermediates: dict[str, torch.Tensor]
    max_epoch: int  # the kernel wraps its counters to epoch 0 after this many launches
    launches: int = 0  # distributed: counted on the host (counters never wrap on the device)
    captured: bool = False  # a CUDA graph captured a launch of this state


class _Call:
    """What a call with given leaf shapes launches: its plan's buffers, the kernel's tensor list
    with the per-call slots (leaves, new outputs) left empty, and what each leaf must look like
    for a later call to reuse it without binding again."""

    __slots__ = (
        "buffers",
        "checks",
        "device",
        "leaf_slots",
        "outputs",
        "run",
        "template",
        "apart",
    )

    @classmethod
    def build(cls, g: CuteGraph, b: _Buffers, leaves: tuple) -> _Call:
        c = cls()
        c.buffers = b
        c.device = leaves[0].device
        leaf_index = {v.name: i for i, v in enumerate(g.graph.leaves)}
        position = {v.name: k for k, v in enumerate(g.graph.values)}
        c.template = [None] * len(g.graph.values)
        c.leaf_slots = []
        for k, v in enumerate(g.graph.values):
            if v.name in leaf_index:
                c.leaf_slots.append((k, leaf_index[v.name]))
            elif v.alias_of is not None:
                c.leaf_slots.append((k, leaf_index[v.alias_of.name]))
            elif v.name in b.intermediates:
                c.template[k] = b.intermediates[v.name]
        c.template += [g._peer_tables[name] for name in g.symmetric]
        c.outputs = [
            (position[v.name], None, None, leaf_index[v.alias_of.name])
            if v.alias_of is not None
            else (position[v.name], tuple(b.plan.shapes[v.name]), v.dtype, None)
            for v in g.graph.outputs
        ]
        # dtype, row-major strides (what bind's canonical view has), device index
        c.checks = tuple((t.dtype, t.stride(), t.get_device()) for t in leaves)
        c.apart = LeavesApart(g.graph, leaves)  # a later call's in-place leaves overlap none
        c.run = None  # the launch alone, made after the first launch (see CuteGraph._runner)
        return c

    def matches(self, args: tuple) -> bool:
        """``args`` (same shapes as this call's leaves) can launch as this call did (an
        argument that is no tensor raises AttributeError)."""
        if len(args) != len(self.checks):
            return False
        ptrs = []  # the leaves' addresses (for the in-place leaves' overlap check)
        for t, (dtype, stride, dev) in zip(args, self.checks):
            p = t.data_ptr()
            if (
                t.dtype != dtype
                or t.stride() != stride
                or t.get_device() != dev
                or t.requires_grad
                or p % 16
            ):
                return False
            ptrs.append(p)
        return self.apart(tuple(ptrs))  # an in-place leaf sharing memory: bind names it


class CuteGraph(ProfileReaders):
    """A graph compiled to one persistent CuTe DSL kernel. Call it like a function of the graph
    leaves (CUDA tensors); returns the graph outputs."""

    def __init__(
        self,
        graph: Graph,
        num_sms: int | None = None,
        scheduler: Any = "static",
        watchdog: bool = False,
        timeout_s: float = 1.0,
        profile: bool | str = False,
        poison_outputs: bool = False,
        group: Any = None,
    ) -> None:
        if not torch.cuda.is_available():
            raise DeviceError("the cute backend needs a CUDA GPU; use backend='interpret'")
        check_launch_options(watchdog, timeout_s, poison_outputs)
        self.graph = graph
        self.arch = target_arch()
        dev_sms = torch.cuda.get_device_properties(0).multi_processor_count
        if num_sms is not None and (not isinstance(num_sms, int) or isinstance(num_sms, bool)):
            raise TypeError(f"num_sms must be an int, got {num_sms!r}")
        self.num_sms = dev_sms if num_sms is None else num_sms
        if not 1 <= self.num_sms <= dev_sms:
            raise ValueError(
                f"num_sms must be in [1, {dev_sms}] (one persistent CTA per SM), got {num_sms}"
            )
        self.scheduler = resolve_scheduler(scheduler)
        self.dynamic = self.scheduler.mode is SchedulingMode.DYNAMIC
        self.timeout_ns = int(timeout_s * 1e9)
        self.poison_outputs = poison_outputs
        self.spec = kernel_spec(graph, self.dynamic, watchdog, profile)
        self.symmetric = symmetric_values(graph)
        self.comm = Communicator.from_group(group) if self.spec.distributed else Communicator()
        for node in graph.nodes:
            w = getattr(node.op, "world", None)
            if node.op.peer_values and w != self.comm.world:
                raise CuteMKError(
                    f"{node.name} was built for {w} ranks but this process group has "
                    f"{self.comm.world}"
                )
        for name in self.symmetric:
            if any(v.name == name for v in graph.outputs):
                raise CuteMKError(
                    f"{name} is reached by other ranks, so it lives in symmetric memory and "
                    "cannot be a graph output (copy it out with another op)"
                )
        self._peer_tables: dict[str, Any] = {}
        self._broken = ""  # set when a distributed launch aborted: the ranks' epochs disagree
        self._buffers: dict[tuple, _Buffers] = {}
        self._retired: list[_Buffers] = []  # replaced by load_plan; a captured graph reads them
        self._scratch_bufs: dict[str, torch.Tensor] = {}
        self._calls: dict[tuple, _Call] = {}  # by the leaves' shapes: see __call__
        self._live: dict[tuple, Any] = {}  # see live()
        self._leaf_names = tuple(v.name for v in graph.leaves)
        self._fn = None
        self._generation = 0  # load_plan's count: a kept runner of an older plan binds again
        self._stream = -1  # the raw CUDA stream of the last launch (see _follow_stream)
        self._state_device: int | None = None  # the GPU its plans' state lives on
        self._stream_obj: torch.cuda.Stream | None = None
        self.last_env: dict[str, int] | None = None

    # -- plans and buffers ----------------------------------------------------------------------
    def plan(self, env: dict[str, int]) -> Plan:
        return self._bufs(env).plan

    def _bufs(self, env: dict[str, int], index: int | None = None) -> _Buffers:
        """The state of the plan for ``env``, built on GPU ``index`` if it is new (default: the
        graph's GPU, else the current one)."""
        key = env_key(env)
        b = self._buffers.get(key)
        if b is None:
            b = self._build_buffers(instantiate(self.graph, env), index)
            self._buffers[key] = b
        return b

    def _used_by_caller(self, b: _Buffers) -> _Buffers:
        """Mark state built on another stream as used by the caller's stream, so freeing it
        (when this object goes) waits for the launches that read it."""
        streams = {torch.cuda.current_stream()}
        if self._stream_obj is not None:  # the stream launches run on
            streams.add(self._stream_obj)
        for stream in streams:
            for t in [*b.torch_dev.values(), *self._scratch_bufs.values()]:
                t.record_stream(stream)
        return b

    def load_plan(self, plan: Plan) -> None:
        """Install ``plan`` (e.g. one a tool or test edited) for its bound dims. State it
        replaces that a CUDA graph captured stays allocated as long as this object: the graph
        may still replay launches that read it."""
        if not isinstance(plan, Plan):
            raise TypeError(f"load_plan takes a Plan, got {type(plan).__name__}")
        if plan.graph is not self.graph:
            raise GraphError(
                f"load_plan got a plan of graph {plan.graph.name!r}, not of this one "
                f"({self.graph.name!r}): its tasks are another kernel's"
            )
        check_env(self.graph, plan.env)  # its dims within the graph's bounds (the buffers' sizes)
        key = env_key(plan.env)
        old = self._buffers.get(key)
        if old is not None and old.captured:
            self._retired.append(old)
        self._buffers[key] = self._build_buffers(plan)
        self._calls.clear()  # they hold the plans they were bound to
        self._generation += 1

    def _build_buffers(self, plan: Plan, index: int | None = None) -> _Buffers:
        """``plan``'s state, on GPU ``index`` (default: the graph's GPU, else the current one):
        one graph's state lives on one GPU (:meth:`_check_state_device`)."""
        if index is None:
            index = self._state_device
        if index is None:
            index = torch.cuda.current_device()
        self._check_state_device(index, "a new plan would be built")
        with torch.cuda.device(index):
            if self.spec.distributed:  # collective setup: stays on the caller's thread
                with no_gc():  # schedule and lowering allocate per task (see plan.no_gc)
                    b = self._build_buffers_now(plan)
            else:
                b = self._used_by_caller(_off_graph(self._build_buffers_now, plan))
        self._state_device = index
        return b

    def _plan_arrays(self, plan: Plan):
        """``plan``'s static schedule (checked), its lowering, and the kernel's two int32
        buffers: the packed program and the zeroed device state with its (offset, size)
        spans."""
        sched = None
        if not self.dynamic:
            sched = self.scheduler.build(plan, self.num_sms)
            check_static_schedule(plan, sched, self.num_sms)
            dump_stage(
                plan, "schedule", lambda: {"queues": [[int(t) for t in q] for q in sched.queues]}
            )
        low = lower(plan, sched, self.num_sms)
        arrays = low.program_arrays()
        dump_stage(plan, "lowered", arrays)
        prog_np, _ = pack_int32([arrays[k] for k in PROGRAM])
        n = max(plan.num_tasks, 1)
        sizes = {
            "state": STATE_SIZE,
            "debug": DEBUG_SIZE,
            "ev_counter": max(plan.num_events, 1),
            "task_pending": n,
            "ring": n,
        }
        dev_np, spans = pack_int32([np.zeros(sizes[k], dtype=np.int32) for k in DEVICE_STATE])
        return low, prog_np, dev_np, spans

    def _check_state_device(self, index: int, what: str) -> None:
        """One graph's state (programs, counters, intermediates) lives on one GPU, the one its
        first plan or intermediate was made on: leaves, a plan or an intermediate on another
        GPU would hand the kernel pointers of two devices."""
        if self._state_device is not None and index != self._state_device:
            raise DeviceError(
                f"{self.graph.name}: {what} on cuda:{index} but the graph's state lives on "
                f"cuda:{self._state_device}; compile the graph once per GPU"
            )

    def _build_buffers_now(self, plan: Plan) -> _Buffers:
        if self.spec.distributed:
            plan.check_distributed(self.dynamic)
            self._check_same_plan_everywhere(plan)
        low, prog_np, dev_np, spans = self._plan_arrays(plan)
        prog = torch.from_numpy(prog_np).cuda()
        if self.spec.distributed:  # other ranks poll these counters: symmetric memory
            devbuf, ptrs = self.comm.symmetric_empty(dev_np.size, torch.int32)
            devbuf.zero_()
            devbuf[: dev_np.size].copy_(torch.from_numpy(dev_np))
            torch.cuda.synchronize()
            self.comm.barrier()  # no rank polls a peer's counters before they are zeroed
        else:
            devbuf = torch.from_numpy(dev_np).cuda()
            ptrs = [devbuf.data_ptr()]
        peers = torch.tensor(ptrs, dtype=torch.int64, device="cuda")
        views = {k: devbuf[o : o + size] for k, (o, size) in zip(DEVICE_STATE, spans)}
        views["debug"].fill_(-1)
        words = 4  # profile: a record per task, one per CTA, (slices) the CTAs' slice regions
        if self.spec.profile:
            capacity = None
            if self.spec.profile_slices:
                rings = [op.ring_tile() for op in self.spec.ops]
                capacity = slice_capacity(
                    [0 if r is None else r.slices for r in rings],
                    low.queue_ptr,
                    low.queue_rec,
                    [len(plan.node_tasks[k]) for k in range(len(rings))],
                )
            words = profile_words(plan.num_tasks, self.num_sms, capacity)
        prof = torch.zeros(words, dtype=torch.int64, device="cuda")
        inter = {}
        for v in self.graph.values:
            # an input updated in place is the caller's tensor, bound at each call
            if v.kind == "intermediate" and v not in self.graph.outputs and v.alias_of is None:
                shape = plan.shapes[v.name]
                numel = int(np.prod(shape))
                inter[v.name] = self._scratch(v)[:numel].view(shape)
        max_epoch = low.max_launches()
        return _Buffers(
            plan,
            low,
            (prog, devbuf, prof, peers, plan.num_tasks, low.num_init),
            {**views, "prog": prog, "devbuf": devbuf, "prof": prof, "peers": peers},
            inter,
            max_epoch,
        )

    def _check_same_plan_everywhere(self, plan: Plan) -> None:
        """Every rank must run the same plan (:func:`cutemk.comm.plan_digest`): checked when a
        plan is built and before each distributed launch. Collective."""
        if not self.comm.same_on_all_ranks(plan_digest(plan)):
            raise CuteMKError(different_plans_error(self.comm.rank, plan.env))

    def scratch_bytes(self) -> int:
        """Device memory the graph's intermediates take, sized at every dim's maximum."""
        return scratch_bytes(self.graph)

    def _check_scratch_fits(self) -> None:
        need = self.scratch_bytes()
        free, _ = torch.cuda.mem_get_info()
        if need > free:
            raise CuteMKError(
                f"{self.graph.name}: its intermediates need {need / 2**30:.2f} GiB at the dims' "
                f"maxima ({_max_dims(self.graph)}), but {free / 2**30:.2f} GiB are free on the "
                "GPU; declare smaller maxima"
            )

    def _scratch(self, v) -> torch.Tensor:
        """One buffer per intermediate, sized for the dims' maxima and shared by every token
        count (a launch at a new count takes a view): memory stays flat however many counts
        are served. Launches are stream-ordered, so one graph serves one stream at a time."""
        buf = self._scratch_bufs.get(v.name)
        if buf is None:
            index = torch.cuda.current_device()
            self._check_state_device(index, "an intermediate would be allocated")
            self._state_device = index
            if not self._scratch_bufs:
                self._check_scratch_fits()
            numel = max(int(np.prod([upper(d) for d in v.shape])), 1)
            if v.name in self.symmetric:  # reached by other ranks: symmetric memory
                buf, ptrs = self.comm.symmetric_empty(numel, v.dtype)
                self._peer_tables[v.name] = self.comm.peer_table(ptrs)
                fresh_(buf, v)
                torch.cuda.synchronize()
                self.comm.barrier()  # no peer writes into it before the poison has landed
            else:
                buf = fresh_(torch.empty(numel, dtype=v.dtype, device="cuda"), v)
            self._scratch_bufs[v.name] = buf
        return buf

    def live(
        self,
        first: int | None = None,
        counts: Any = None,
        limit: int | None = None,
        fixed: dict[str, int] | None = None,
    ):
        """The graph taking its token count as device data, for one CUDA-graph capture that
        replays at every count (:class:`~cutemk.live.LiveGraph`; kept: a second call with the
        same arguments returns the same object). ``first``: the smallest count it serves
        (below it the kernel runs nothing: another kernel serves those); ``counts``: the
        counts to plan (default :func:`~cutemk.live.live_counts`); ``limit``: counts above it
        are errors (default: the graph's maximum; a caller whose kernels split the counts
        between them gives its own); ``fixed``: the graph's other symbolic dims, bound once
        for every count (e.g. ``{"pages": k_cache.shape[0]}``)."""
        from .live import LiveGraph

        key = self._live_key(first, counts, limit, fixed)
        lg = self._live.get(key)
        if lg is None:
            if torch.cuda.is_current_stream_capturing():
                raise CuteMKError(
                    f"{self.graph.name}: the live graph compiles its kernel and plans every "
                    "count when first built, which cannot happen inside a CUDA-graph capture; "
                    "call it once before capturing (or cutemk.warmup(module, live=True))"
                )
            lg = self._live[key] = LiveGraph(self, first, counts, limit, fixed)
        return lg

    def live_built(
        self,
        first: int | None = None,
        counts: Any = None,
        limit: int | None = None,
        fixed: dict[str, int] | None = None,
    ):
        """The :meth:`live` graph of these arguments if one was built, else None."""
        return self._live.get(self._live_key(first, counts, limit, fixed))

    @staticmethod
    def _live_key(first, counts, limit, fixed) -> tuple:
        fixed_key = tuple(sorted((fixed or {}).items()))
        # the PDL switch makes another kernel: each setting keeps its own live graph
        return (first, None if counts is None else tuple(counts), limit, fixed_key, live_pdl())

    # -- launching --------------------------------------------------------------------------------
    def __call__(self, *args: torch.Tensor, **kwargs: torch.Tensor):
        """Launch on the leaves (positional in declaration order, or by name).

        The first call with given leaf shapes binds them in full (:func:`~cutemk.binding.bind`:
        every check with its message) and keeps what it worked out, keyed by the shapes; a
        later call with the same shapes only verifies dtype, strides, device, alignment and
        autograd of each tensor against it (anything else takes the full path again, which
        raises the error or binds anew). The compiled kernel takes torch tensors directly
        (TVM-FFI), so a call converts nothing in Python."""
        call = None
        if kwargs and not args and len(kwargs) == len(self._leaf_names):
            try:  # every leaf by name: the same call in declaration order
                args, kwargs = tuple(kwargs[n] for n in self._leaf_names), {}
            except KeyError:  # a wrong name: the full path says which
                pass
        if not kwargs:
            try:
                call = self._calls.get(tuple(t.shape for t in args))
                if call is not None and not call.matches(args):
                    call = None
            except AttributeError:  # not a tensor: the full path names the argument
                call = None
            if call is not None and call.run is not None and not self.poison_outputs:
                return call.run(args)
        if call is None:
            call, args = self._bind_call(args, kwargs)
        return self._run(call, args)

    def runner(self, *leaves: torch.Tensor) -> Any:
        """The launch of a call on leaves like these (same shapes, dtypes, strides and device,
        16-byte aligned, no autograd), as a function of the leaves that checks none of that:
        for a caller that knows its leaves match (e.g. a module whose weights are its own and
        whose activations it checked). It does only what every launch needs: the outputs'
        allocation, the tensor list, the TVM-FFI call (constant tensors converted once). None
        where a launch needs more (watchdog, profile, poisoned outputs, distributed graphs,
        empty plans) or no call like this one has launched yet; it falls back to a full call
        after :meth:`load_plan`."""
        call = self._calls.get(tuple(t.shape for t in leaves))
        if call is None or not call.matches(leaves):
            return None
        return call.run

    def _runner(self, call: _Call, leaves: tuple) -> Any:
        """``call``'s launch alone (see :meth:`runner`), or None where it would need more;
        ``leaves``: those of a launch it made."""
        b = call.buffers
        if (
            self.spec.watchdog
            or self.spec.profile
            or self.spec.distributed
            or self.poison_outputs
            or not b.plan.num_tasks
            or self._fn is None
        ):
            return None
        import tvm_ffi

        def ffi(a):  # converted once; the per-call leaves and outputs stay torch tensors, so
            # TVM-FFI still takes the launch stream from the caller's current torch stream
            return tvm_ffi.from_dlpack(a) if isinstance(a, torch.Tensor) else a

        fn, gen, env, timeout, sms = (
            self._fn,
            self._generation,
            b.plan.env,
            self.timeout_ns,
            self.num_sms,
        )
        kargs = tuple(ffi(a) for a in b.kernel_args)
        template = [ffi(t) for t in call.template]
        slots = tuple(call.leaf_slots)
        # a fresh output as empty_like a leaf of its shape and dtype (leaves are row-major)
        # costs less host time than torch.empty
        like = {(tuple(t.shape), t.dtype): i for i, t in reversed(list(enumerate(leaves)))}
        outs = []
        for pos, shape, dtype, leaf in call.outputs:
            if leaf is not None:  # an input updated in place: the caller's tensor
                outs.append((pos, None, leaf))
            else:
                outs.append((pos, (shape, dtype), like.get((shape, dtype))))
        outs = tuple(outs)
        capturing = torch._C._cuda_isCurrentStreamCapturing
        current_stream = torch._C._cuda_getCurrentRawStream
        empty, empty_like, device = torch.empty, torch.empty_like, call.device
        row_major = torch.contiguous_format
        index = _index(device)
        graph_ref = weakref.ref(self)  # the graph keeps its calls, their runners: no cycle

        def run(args: tuple):
            graph = graph_ref()
            if graph is None:
                raise CuteMKError("the compiled graph of this runner is gone")
            if graph._generation != gen or graph.poison_outputs:
                # load_plan replaced the plans, or outputs are to be poisoned: a call (which
                # binds again, or poisons; its own runner is current)
                return graph(*args)
            cap = capturing()
            if cap:
                b.captured = True
            stream = current_stream(index)
            if stream != graph._stream:
                graph._follow_stream(stream, cap, index)
            tensors = template.copy()
            for pos, i in slots:
                tensors[pos] = args[i]
            results = []
            for pos, fresh, i in outs:
                if fresh is None:
                    results.append(args[i])
                    continue
                t = (
                    empty_like(args[i], memory_format=row_major)
                    if i is not None
                    else empty(fresh[0], dtype=fresh[1], device=device)
                )
                tensors[pos] = t
                results.append(t)
            graph.last_env = env
            fn(tensors, *kargs, b.max_epoch, timeout, sms)
            return results[0] if len(results) == 1 else tuple(results)

        run.generation = gen
        return run

    def _bind_call(self, args: tuple, kwargs: dict) -> tuple[_Call, tuple]:
        """Full binding of one call: the leaves in declaration order (canonical views) and the
        launch they make, kept for later calls with the same shapes."""
        env, leaves = bind(self.graph, args, kwargs, device_type="cuda")
        if self.spec.distributed:
            env.update(self.comm.env())
        for name, t in leaves.items():
            if t.data_ptr() % 16:
                raise LayoutError(
                    f"{name} must be 16-byte aligned (data_ptr % 16 = "
                    f"{t.data_ptr() % 16}); pass a contiguous, non-offset tensor"
                )
        leaf_list = tuple(leaves.values())
        # the plans' state is built on the leaves' GPU (and must already live there)
        index = _index(leaf_list[0].device) if leaf_list else torch.cuda.current_device()
        self._check_state_device(index, "the leaves are")
        b = self._bufs(env, index)
        call = _Call.build(self, b, leaf_list)
        if len(self._calls) >= 256:
            self._calls.clear()
        self._calls[tuple(t.shape for t in leaf_list)] = call
        return call, leaf_list

    def _run(self, call: _Call, leaves: tuple):
        if torch._C._cuda_isCurrentStreamCapturing():  # what torch.cuda's wrapper asks
            if self.spec.watchdog:
                raise CuteMKError(
                    "watchdog=True reads the kernel's state back after every launch, "
                    "so it cannot be captured in a CUDA graph; compile without it"
                )
            if self.spec.distributed:
                raise CuteMKError(
                    "a distributed megakernel cannot be captured in a CUDA graph yet: other "
                    "ranks read its event counters, so they never wrap on the device, and the "
                    "host resets them (collectively) only between launches it sees"
                )
            call.buffers.captured = True
        if self._broken:
            raise CuteMKError(self._broken)
        b = call.buffers
        self.last_env = b.plan.env
        tensors = list(call.template)
        for pos, i in call.leaf_slots:
            tensors[pos] = leaves[i]
        outs = []
        for pos, shape, dtype, leaf in call.outputs:
            if leaf is not None:  # an input updated in place: the caller's tensor
                outs.append(leaves[leaf])
                continue
            t = torch.empty(shape, dtype=dtype, device=call.device)
            if self.poison_outputs:
                poison_(t)
            tensors[pos] = t
            outs.append(t)
        if b.plan.num_tasks:
            self._launch(b, tensors, call.device)
            if self.spec.watchdog:
                self._check(b)
            if call.run is None:
                call.run = self._runner(call, leaves)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _launch(self, b: _Buffers, tensors: list, device: torch.device) -> None:
        if self._fn is None:
            self._fn = _compile(self.spec)
        if self.spec.distributed:
            # at every launch, not only when a plan is built: ranks calling plans they built
            # earlier, for different dims, would wait on each other's events by ids of
            # different plans (a hang, or counts met by the wrong notifies). It costs a
            # collective and a host sync a launch, and a rank that fails on the host before
            # it gets here leaves the others in the collective until the process group's
            # timeout (with the watchdog, the kernel's rank barrier would have said so sooner)
            self._check_same_plan_everywhere(b.plan)
            self._count_launch(b)
        # the stream is the caller's current torch stream (TVM-FFI's environment stream, set
        # from the first torch tensor argument)
        index = _index(device)
        stream = torch._C._cuda_getCurrentRawStream(index)
        if stream != self._stream:
            self._follow_stream(stream, torch.cuda.is_current_stream_capturing(), index)
        if self.spec.profile:  # after the stream's wait: the last launch may still write it
            b.torch_dev["prof"].zero_()  # skipped tasks keep no earlier launch's times
        epochs = MAX_EPOCH_COUNT if self.spec.distributed else b.max_epoch
        self._fn(tensors, *b.kernel_args, epochs, self.timeout_ns, self.num_sms)

    def _follow_stream(self, stream: int, capturing: bool, index: int) -> None:
        """Order a launch on another stream than the last one after the work queued on that
        one: every launch of a graph shares its counters and intermediates (sized for the
        maxima, reused by every token count), so two launches must never overlap. Cheap in
        the common case (one stream: an int compared). A launch being captured is neither
        ordered after eager work (a capture cannot wait on it) nor remembered: a CUDA graph's
        replays are ordered by its caller, like any other work on their stream. On the first
        launch and on each change, the graph's device state is recorded on the new stream,
        so freeing it (``load_plan``, the graph dropped) waits for the launches there too
        (state built later is recorded on it when built); a caller alternating streams pays
        that recording (a call per tensor of every plan) at each change."""
        if capturing:
            return
        last = self._stream_obj
        self._stream, self._stream_obj = stream, torch.cuda.current_stream(index)
        if last is not None:
            self._stream_obj.wait_stream(last)
        for t in self._device_state():
            t.record_stream(self._stream_obj)

    def _device_state(self) -> list[torch.Tensor]:
        """Every device tensor the graph's launches read or write but its callers' (plans,
        scratch, peer tables, live graphs' tables)."""
        out = [t for b in self._buffers.values() for t in b.torch_dev.values()]
        out += [*self._scratch_bufs.values(), *self._peer_tables.values()]
        for lg in self._live.values():
            out += [lg.table, lg.prog, lg.dev, lg.prof, lg.peers]
        return out

    def _count_launch(self, b: _Buffers) -> None:
        """Distributed counters are read by other ranks, so the kernel never wraps them; before
        a target would pass int32 every rank resets its counters here, between barriers (all
        ranks launch the same sequence, so they all arrive at the same launch)."""
        b.launches += 1
        if b.launches <= b.max_epoch:
            return
        if torch.cuda.is_current_stream_capturing():
            raise CuteMKError(
                f"{b.max_epoch} launches of this plan: its event counters must be reset, which "
                "cannot happen inside CUDA-graph capture; capture a fresh graph"
            )
        torch.cuda.synchronize()
        self.comm.barrier()
        self._reset(b)
        torch.cuda.synchronize()
        self.comm.barrier()
        b.launches = 1

    def _reset(self, b: _Buffers) -> None:
        devbuf, state = b.torch_dev["devbuf"], b.torch_dev["state"]
        devbuf[state.storage_offset() - devbuf.storage_offset() :].zero_()
        b.torch_dev["debug"].fill_(-1)

    def _check(self, b: _Buffers) -> None:
        state = b.torch_dev["state"].cpu()
        if int(state[ABORT]) == 0:
            return
        dbg = b.torch_dev["debug"].cpu().tolist()
        counters = b.torch_dev["ev_counter"].cpu().numpy()
        epoch = int(state[EPOCH])  # the last CTA out stored the failed launch's epoch
        msg = _diagnose(b.plan, dbg, counters, epoch, int(state[ABORT]))
        if self.spec.distributed:
            # the other ranks' counters are at other epochs now: resetting this rank alone
            # would let its waits pass on stale peer counts
            self._broken = f"this distributed graph aborted an earlier launch ({msg}); rebuild it"
        else:
            self._reset(b)
            # an op's own counters (``TileOp.zeroed_outputs``) may hold the aborted launch's
            # counts: the next launch must start them at zero
            for v in self.graph.values:
                if v.name in self._scratch_bufs and v.is_own_counter:
                    self._scratch_bufs[v.name].zero_()
        raise DeadlockError(msg)


def scratch_bytes(graph: Graph) -> int:
    """Bytes of the intermediates of ``graph`` at every dim's maximum (what the cute backend
    allocates once and shares across token counts)."""
    total = 0
    outputs = {id(v) for v in graph.outputs}
    for v in graph.values:
        # outputs are allocated per call; an input updated in place is the caller's memory
        if v.kind == "intermediate" and id(v) not in outputs and v.alias_of is None:
            numel = max(int(np.prod([upper(d) for d in v.shape], dtype=object)), 1)
            total += numel * v.dtype.itemsize
    return total


def _max_dims(graph: Graph) -> str:
    syms = {s.name: s.max for v in graph.values for d in v.shape for s in free_syms(d)}
    return ", ".join(f"{k} <= {m}" for k, m in sorted(syms.items()))


def __getattr__(name: str) -> Any:
    """``compile_count`` and ``cache_loads`` live in :mod:`cutemk.kernels`, which updates them;
    read here they are its current values."""
    if name in ("compile_count", "cache_loads"):
        from . import kernels

        return getattr(kernels, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
