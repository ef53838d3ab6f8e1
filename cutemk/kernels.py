"""The megakernel of a graph: its compile-cache key, its compilation (with fake arguments, no GPU
needed), and the process's and the disk's caches of compiled kernels.

One megakernel is compiled per :class:`~cutemk.codegen.megakernel.KernelSpec` (graph structure,
dtypes, scheduler mode, flags, arch); a new token count never compiles a new one. A compiled
kernel is kept for the process and written to :func:`kernel_cache_dir`, from which the next
process loads it instead of compiling.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import warnings
from pathlib import Path
from collections.abc import Collection
from typing import Any

from .arch import target_arch
from .codegen.megakernel import KernelSpec, Megakernel, worker_shape
from .comm import is_distributed, symmetric_values
from .envvars import env_int, env_switch
from .errors import GraphError
from .graph import Graph
from .plan import dump_file
from .scheduling import SchedulingMode, resolve_scheduler
from .symbolic import Sym
from .tileop import TileOp

_COMPILED: dict[KernelSpec, Any] = {}
_LOCK = threading.Lock()
compile_count = 0
"""Megakernels compiled by this process (tests assert it stays flat across token counts)."""


def _loads_before_events(node) -> bool:
    """Whether a ring op's independent loads may precede its events: no node writes its
    ``independent_inputs`` (or the op vouches for what they write), and what the tile loads
    is not decided by data the launch computes."""
    op = node.op
    if not op.independent_inputs:
        return False
    if op.exists_on_device and not (
        op.early_exists and all(node.args[a].producer is None for a in op.data_inputs)
    ):
        return False
    producers = {
        a: node.args[a].producer.op
        for a in op.independent_inputs
        if node.args[a].producer is not None
    }
    return not producers or op.independent_loads_allowed(producers)


def live_dims(
    graph: Graph, tokens: str, fixed: Collection[str] = ()
) -> tuple[tuple[tuple[int, int, int], ...], tuple]:
    """What a kernel that takes the token count as device data binds per launch: ``(pairs,
    extents)``, ``extents`` the distinct token-dependent dims of ``graph``'s values (the token
    dim ``tokens`` itself first, then expressions of it such as ``T * top_k``) and ``pairs``
    (value index, dim, index into ``extents``) of every dim that is one of them. Each plan of
    the live table carries every extent's value at its own count (``live.pack_live``). A
    value only ops with it in ``TileOp.live_rows_inputs`` read has its token dim bound to the
    live count itself: index -1.

    ``fixed``: other symbolic dims, bound once for all of a live graph's plans (e.g. a KV
    cache's page count); the dims of them alone are passed as the tensors have them.

    Raises GraphError where the graph cannot run so: an op whose tokens are not independent
    (``TileOp.token_local``), a value updated in place by an op that does not confine its
    updates to live tokens (``TileOp.live_updates``), or a dim with another symbol."""
    bad = [n.op.name for n in graph.nodes if not n.op.token_local]
    if bad:
        raise GraphError(
            f"{graph.name}: one capture for every token count needs ops whose tokens are "
            f"independent (a token's outputs depend on its own rows only); "
            f"{sorted(set(bad))} are not"
        )
    updated = [
        v.name
        for v in graph.values
        if v.alias_of is not None and not (v.producer is not None and v.producer.op.live_updates)
    ]
    if updated:
        raise GraphError(
            f"{graph.name}: a live token count does not support inputs updated in place ({updated})"
            " by ops that may write for tokens past the live count"
        )
    # values every reader of which treats the rows past its bound extent as absent
    # (``TileOp.live_rows_inputs``): bound to the live count itself (extent index -1)
    readers: dict[int, list[bool]] = {}
    for n in graph.nodes:
        for a in n.op.inputs:
            readers.setdefault(id(n.args[a]), []).append(a in n.op.live_rows_inputs)
    at_live = {
        id(v)
        for v in graph.values
        if v.kind in ("intermediate", "input")
        and v not in graph.outputs
        and all(readers.get(id(v), [False]))
    }
    # an in-place update is safe only where what steers it is bound to the live count
    for v in graph.values:
        if v.alias_of is None or v.producer is None:
            continue
        node = v.producer
        loose = [a for a in node.op.live_rows_inputs if id(node.args[a]) not in at_live]
        if loose:
            raise GraphError(
                f"{graph.name}: {node.op.name} updates {v.alias_of.name} in place for the rows "
                f"of {loose}, which another op reads without treating rows past the live count "
                "as absent: they would stay bound to the plan's count"
            )
    pairs, extents = [], []
    for i, v in enumerate(graph.values):
        for d, e in enumerate(v.shape):
            if isinstance(e, int):
                continue
            names = {s.name for s in e.syms()}
            if names and names <= set(fixed):
                continue  # bound once for the live graph: the tensor's own extent
            other = sorted(names - {tokens} - set(fixed))
            if other or not names:
                raise GraphError(
                    f"{graph.name}: {v.name} has the dim {e}; one capture for every token "
                    f"count needs every symbolic dim to depend on {tokens} and the fixed dims "
                    f"{sorted(fixed)} alone"
                )
            if id(v) in at_live and isinstance(e, Sym):
                pairs.append((i, d, -1))
                continue
            if e not in extents:
                extents.append(e)
            pairs.append((i, d, extents.index(e)))
    syms = [e for e in extents if isinstance(e, Sym)]
    if not syms:
        raise GraphError(f"{graph.name}: no value has the token dim {tokens}")
    # the token dim itself first (the plan's count, as the table row's ``tokens`` word)
    order = [extents.index(syms[0])] + [j for j, e in enumerate(extents) if e is not syms[0]]
    remap = {old: new for new, old in enumerate(order)}
    remap[-1] = -1
    extents = [extents[j] for j in order]
    return tuple((i, d, remap[j]) for i, d, j in pairs), tuple(extents)


def _syms(d: Any) -> frozenset:
    return frozenset() if isinstance(d, int) else d.syms()


def live_pdl() -> bool:
    """Whether live kernels built now launch with programmatic dependent launch
    (``CUTEMK_LIVE_PDL=1``; see ``KernelSpec.live_pdl``). Read when a live graph is built or
    looked up, so a switch flipped between calls gets (and keeps) live graphs of its own."""
    return env_switch("CUTEMK_LIVE_PDL", False)


MAX_TIMEOUT_S = 24 * 3600.0
"""The watchdog's longest deadline (its nanoseconds stay far inside the kernel's Int64)."""


def check_launch_options(watchdog, timeout_s, poison_outputs) -> None:
    """The cute backend's switches are bools and the watchdog's deadline a positive, finite
    number of seconds: a string "no" is not False, and a deadline of 0 or less would abort
    every launch at its first wait."""
    for name, v in (("watchdog", watchdog), ("poison_outputs", poison_outputs)):
        if not isinstance(v, bool):
            raise TypeError(f"{name} must be True or False, got {v!r}")
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool):
        raise TypeError(f"timeout_s must be a number of seconds, got {timeout_s!r}")
    if not 0 < timeout_s <= MAX_TIMEOUT_S:  # NaN fails here too
        raise ValueError(f"timeout_s must be in (0, {MAX_TIMEOUT_S:.0f}] seconds, got {timeout_s}")


def kernel_spec(
    graph: Graph,
    dynamic: bool,
    watchdog: bool = False,
    profile: bool | str = False,
    live: str | None = None,
) -> KernelSpec:
    """The compile-cache key of ``graph``'s megakernel. ``profile``: False, True (per-task
    and per-CTA stamps) or ``"slices"`` (each ring slice's too). ``live``: the name of the
    token dim when the kernel takes the token count as device data (``CuteGraph.live``)."""
    if not (profile is False or profile is True or profile == "slices"):
        raise ValueError(f"profile must be False, True or 'slices', got {profile!r}")
    index = {id(v): i for i, v in enumerate(graph.values)}
    # peer tables of the symmetric values follow the graph values in the kernel's tensor tuple
    symmetric = symmetric_values(graph)
    table = {name: len(graph.values) + k for k, name in enumerate(symmetric)}

    def peer_table(n, a):
        v = n.args.get(a) or n.results[a]
        return table[v.name]

    node_tensors = tuple(
        tuple(index[id(n.args[a])] for a in n.op.inputs)
        + tuple(index[id(n.results[o])] for o in n.op.outputs)
        + tuple(peer_table(n, a) for a in n.op.peer_values)
        for n in graph.nodes
    )
    for n in graph.nodes:
        if n.op.ring_tile() is None and type(n.op).device_tile is TileOp.device_tile:
            raise NotImplementedError(f"op {n.op.name} has no device function yet")
    ops_ = tuple(n.op for n in graph.nodes)
    prefetch = tuple(_loads_before_events(n) for n in graph.nodes)
    values = tuple((str(v.dtype), len(v.shape)) for v in graph.values)
    values += (("torch.int64", 1),) * len(symmetric)
    live_pairs = None  # (value, dim, extent) of each token-dependent dim: ``live_dims``
    if live is not None:
        if symmetric or is_distributed(graph):
            raise GraphError(f"{graph.name}: a distributed graph cannot take a live token count")
        others = {s.name for v in graph.values for d in v.shape for s in _syms(d)} - {live}
        live_pairs = live_dims(graph, live, others)[0]
        values += (("torch.int32", 1), ("torch.int32", 1))  # the plan table, the live count
    spec = KernelSpec(
        ops_,
        node_tensors,
        values,
        bool(dynamic),
        bool(watchdog),
        bool(profile),
        target_arch(),
        is_distributed(graph),
        prefetch,
        worker_shape(ops_),
        live_pairs,
        env_switch("CUTEMK_COOPERATIVE", True),
        env_switch("CUTEMK_EARLY_HANDOVER", True),
        env_switch("CUTEMK_EPI_MBARRIER", True),
        profile == "slices",
        env_switch("CUTEMK_QUEUE_HEAD", True),
        live is not None and live_pdl(),
    )
    dump_file(f"{graph.name}.{'dynamic' if dynamic else 'static'}.kernel", spec.describe)
    return spec


def compile_offline(
    graph: Graph,
    scheduler: Any = "static",
    watchdog: bool = False,
    profile: bool | str = False,
    options: str = "",
    live: str | None = None,
):
    """Compile ``graph``'s megakernel as the runtime does, no GPU needed (CI compile checks).

    ``options`` goes to ``cute.compile`` (``"--keep-ptx"`` fills the result's ``__ptx__``);
    ``live``: the token dim, for the kernel that takes the token count as device data.
    """
    graph.validate()
    dynamic = resolve_scheduler(scheduler).mode is SchedulingMode.DYNAMIC
    return _compile_now(kernel_spec(graph, dynamic, watchdog, profile, live), options)


cache_loads = 0
"""Megakernels this process loaded from the on-disk kernel cache instead of compiling."""


def _compile(spec: KernelSpec):
    """The process's kernel for ``spec`` as a TVM-FFI function (called positionally with torch
    tensors and ints): from this process's cache, else from the on-disk kernel cache
    (:func:`kernel_cache_dir`), else compiled now and written there."""
    global compile_count, cache_loads
    with _LOCK:
        fn = _COMPILED.get(spec)
        if fn is None:
            path = _cache_path(spec)
            fn = _load_cached(path) if path is not None else None
            if fn is None:
                compiled = _compile_now(spec)
                compile_count += 1
                if path is not None:
                    _store_cached(compiled, path)
                # the function without the DSL's keyword-argument wrapper (a microsecond a call)
                fn = getattr(compiled, "_tvm_ffi_function", None) or compiled
            else:
                cache_loads += 1
            _COMPILED[spec] = fn
    return fn


def compile_many(specs: Any, workers: int | None = None, timeout_s: float = 900.0) -> int:
    """Compile the kernels of ``specs`` that are neither in this process nor in the on-disk
    cache, in parallel worker processes that write them to the cache (a later launch loads
    them); returns how many were compiled so. Compiling is mostly single-threaded host work
    (tracing, MLIR, ptxas) and the kernels are independent, so a server warming several
    regimes and layers waits for the slowest compile instead of the sum. Without a disk
    cache, or with fewer than two kernels to compile, nothing happens here (the launches
    compile as before). A worker that fails or passes ``timeout_s`` is stopped and leaves its
    kernel to be compiled at launch. ``workers`` defaults to the CPUs this process may use,
    less one, at most 8 (each worker imports torch and CuTe DSL: ~1 GB)."""
    import pickle
    import subprocess
    import tempfile
    import time

    todo = []
    for spec in dict.fromkeys(specs):
        if spec in _COMPILED:
            continue
        path = _cache_path(spec)
        if path is not None and not path.is_file():
            todo.append(spec)
    # more than the cache keeps would evict what the first workers wrote
    todo = todo[: cache_max_kernels()]
    if len(todo) < 2:
        return 0
    try:
        payloads = [pickle.dumps(spec) for spec in todo]
    except Exception as e:  # noqa: BLE001 (an op that does not pickle: compile at launch)
        warnings.warn(f"cutemk: kernels not compiled in parallel ({e})", stacklevel=2)
        return 0
    if workers is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        workers = min(8, max(1, (cpus or 2) - 1))
    workers = max(1, min(workers, len(todo)))
    env = dict(os.environ)  # the workers import what this process imports
    env["PYTHONPATH"] = os.pathsep.join(
        [p for p in sys.path if p] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    code = "from cutemk.kernels import _compile_worker as w; w()"
    done = 0
    for start in range(0, len(todo), workers):
        batch = list(zip(todo[start : start + workers], payloads[start : start + workers]))
        procs, logs = [], []
        try:
            for spec, payload in batch:
                # stderr to a file: a pipe nobody reads yet could fill and stall the worker
                log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in finally)
                logs.append(log)
                proc = subprocess.Popen(
                    [sys.executable, "-c", code],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                    env=env,
                )
                procs.append(proc)
                try:
                    proc.stdin.write(payload)
                    proc.stdin.close()
                except OSError:  # it died already: its log says why
                    pass
            deadline = time.monotonic() + timeout_s
            for (spec, _), proc, log in zip(batch, procs, logs):
                why = ""
                try:
                    rc = proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                    rc, why = -1, f"no result in {timeout_s:.0f} s"
                    path = _cache_path(spec)  # what it was writing (``_store_cached``'s name)
                    for tmp in path.parent.glob(f"{path.name}.{proc.pid}.*.tmp"):
                        tmp.unlink(missing_ok=True)
                if rc == 0 and _cache_path(spec).is_file():
                    done += 1
                    continue
                log.seek(0)
                why = why or log.read().decode(errors="replace").strip()[-500:]
                warnings.warn(
                    f"cutemk: a compile worker failed ({why}); the kernel compiles at its "
                    "first launch instead",
                    stacklevel=2,
                )
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            for log in logs:
                log.close()
    return done


def _compile_worker() -> None:
    """A :func:`compile_many` worker: compiles the pickled spec on stdin into the disk cache."""
    import pickle

    spec = pickle.loads(sys.stdin.buffer.read())
    _store_cached(_compile_now(spec), _cache_path(spec))


_LOADED_MODULES: list[Any] = []  # the loaded kernels' modules: they must outlive the functions
_SOURCE_DIGEST: str | None = None


def kernel_cache_dir() -> Path | None:
    """Where compiled megakernels are kept between processes: ``CUTEMK_CACHE_DIR`` (empty: no
    cache), else ``cutemk_kernels`` under CuTe DSL's cache directory (``cutemk.arch`` points it
    at ``~/.cache/cutemk/cute_dsl`` unless ``CUTE_DSL_CACHE_DIR`` is set). It keeps the
    ``CUTEMK_CACHE_MAX_KERNELS`` (default 256) most recently used kernels."""
    d = os.environ.get("CUTEMK_CACHE_DIR")
    if d is None:
        base = os.environ.get("CUTE_DSL_CACHE_DIR")
        if not base:
            return None
        d = os.path.join(base, "cutemk_kernels")
    return Path(d) if d else None


_SOURCE_ROOTS: tuple[Path, ...] = ()


def _source_digest() -> str:
    """A digest of the code a kernel is generated from (cutemk, its ops and schedulers), of the
    compiler and of the host platform: a kernel on disk from other code is never loaded."""
    global _SOURCE_DIGEST, _SOURCE_ROOTS
    if _SOURCE_DIGEST is None:
        import platform

        import cutlass
        import tvm_ffi

        from . import ops, schedulers

        h = hashlib.sha256(
            f"{cutlass.__version__} {tvm_ffi.__version__} {platform.machine()}".encode()
        )
        roots = (Path(__file__).parent, Path(ops.__file__).parent, Path(schedulers.__file__).parent)
        for pkg in roots:
            for f in sorted(pkg.rglob("*.py")):
                h.update(str(f.relative_to(pkg)).encode())
                h.update(f.read_bytes())
        _SOURCE_ROOTS = tuple(r.resolve() for r in roots)
        _SOURCE_DIGEST = h.hexdigest()
    return _SOURCE_DIGEST


def _outside_sources(spec: KernelSpec) -> str | None:
    """The source of every module outside cutemk that defines a class of ``spec``'s ops (a
    user's own op and its bases), for the cache key: editing such an op makes a new key. None
    where a class has no source file (defined interactively): such kernels are not cached."""
    _source_digest()
    files: dict[Path, None] = {}
    for op in spec.ops:
        for cls in type(op).__mro__:
            if cls is object:
                continue
            module = sys.modules.get(cls.__module__)
            path = getattr(module, "__file__", None)
            if path is None:
                return None
            path = Path(path).resolve()
            if not any(path.is_relative_to(root) for root in _SOURCE_ROOTS):
                files[path] = None
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(str(path).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _cache_path(spec: KernelSpec) -> Path | None:
    """The cache file of ``spec``'s kernel, or None where there is no cache or the spec has no
    stable text (an op whose repr shows an object address, or whose class has no source)."""
    d = kernel_cache_dir()
    text = repr(spec)
    if d is None or " at 0x" in text:
        return None
    outside = _outside_sources(spec)
    if outside is None:
        return None
    key = hashlib.sha256(f"{_source_digest()}\n{outside}\n{text}".encode()).hexdigest()[:32]
    return d / f"megakernel-{key}.o"


_EXPORT_NAME = "cutemk_megakernel_launch"


def _load_cached(path: Path):
    """The kernel stored at ``path`` (a TVM-FFI function), or None if there is none or it does
    not load (it is then compiled again and overwritten)."""
    if not path.is_file():
        return None
    try:
        from cutlass.runtime import load_module

        module = load_module(str(path), enable_tvm_ffi=True)
        fn = module[_EXPORT_NAME]
    except Exception as e:  # noqa: BLE001 (a damaged or foreign file: compile instead)
        warnings.warn(f"cutemk: ignoring the cached kernel {path} ({e})", stacklevel=3)
        return None
    _LOADED_MODULES.append(module)
    try:
        os.utime(path)  # recently used: the last to be evicted
    except OSError:
        pass
    return fn


def cache_max_kernels() -> int:
    """Kernels the disk cache keeps (``CUTEMK_CACHE_MAX_KERNELS``, default 256)."""
    return env_int("CUTEMK_CACHE_MAX_KERNELS", 256, minimum=1)


def _store_cached(fn: Any, path: Path) -> None:
    """Write ``fn``'s host code and cubin to ``path`` (atomically: a reader never sees half a
    file). A cache that cannot be written costs the next process a compile, nothing else."""
    keep = cache_max_kernels()  # a bad setting is an error, not a failed write
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # a name the eviction's pattern does not match while it is being written
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        fn.export_to_c(str(tmp), function_name=_EXPORT_NAME)
        os.replace(tmp, path)
        _evict(path.parent, keep)
    except Exception as e:  # noqa: BLE001
        warnings.warn(f"cutemk: could not write the kernel cache {path} ({e})", stacklevel=3)


def _evict(d: Path, keep: int) -> None:
    """Keep the ``keep`` most recently used kernels in ``d`` (a load marks a file used): every
    change to cutemk's source makes new keys, so the directory would otherwise only grow."""
    used = []
    for f in d.glob("megakernel-*.o"):
        try:
            used.append((f.stat().st_mtime, f))
        except FileNotFoundError:  # another process evicted it meanwhile
            pass
    for _, f in sorted(used, reverse=True)[max(keep, 1) :]:
        f.unlink(missing_ok=True)


_CUTE_DTYPES = {
    "torch.float32": "Float32",
    "torch.bfloat16": "BFloat16",
    "torch.float16": "Float16",
    "torch.int32": "Int32",
    "torch.int64": "Int64",
}


def _compile_now(spec: KernelSpec, options: str = ""):
    """Compile the megakernel of ``spec`` from fake arguments (no data, no GPU), with TVM-FFI's
    calling convention: the result takes torch tensors and Python ints, checks each tensor's
    dtype, rank, innermost stride, alignment and device in C, and launches on the caller's
    current torch stream. Every extent and outer stride is dynamic, so one kernel serves every
    token count."""
    import cutlass
    from cutlass import Int32, Int64, cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    def fake(dtype: str, ndim: int):
        shape = tuple(cute.sym_int() for _ in range(ndim))
        stride = tuple(cute.sym_int(64) for _ in range(ndim - 1)) + (1,)
        element = getattr(cutlass, _CUTE_DTYPES[dtype])
        return make_fake_tensor(element, shape, stride, assumed_align=16)

    return cute.compile(
        Megakernel(spec).launch,
        tuple(fake(dtype, ndim) for dtype, ndim in spec.values),
        fake("torch.int32", 1),
        fake("torch.int32", 1),
        fake("torch.int64", 1),
        fake("torch.int64", 1),
        Int32(1),
        Int32(1),
        Int32(1),
        Int64(1),
        Int32(132),
        make_fake_stream(use_tvm_ffi_env_stream=True),
        options=f"--enable-tvm-ffi {options}".strip(),
    )
