"""The benchmark convention, in one place.

Every ``benchmarks/<name>.py`` times each implementation in the same process with
:func:`time_us` (warm-up, then the median of many CUDA-event-timed runs, each from a cold
L2), collects rows with
:class:`Results` and ends with :meth:`Results.finish`, which prints a table and writes
``benchmarks/results/<name>.json``::

    {"gpu": ..., "versions": {...}, "commit": ..., "meta": {...},
     "rows": [{"case": ..., "impl": ..., "median_us": ..., ...}, ...]}

:func:`bar_chart` draws a small PNG of the median times beside the JSON (when matplotlib is
installed: it is an optional dependency, ``pip install -e '.[plot]'``).

Floors use the H200 rates measured on the benchmark machine (``cutemk.costmodel.H200``):
bytes / 4.3 TB/s and FLOPs / 790 TFLOP/s.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .costmodel import H200
from .envvars import env_choice

RESULTS_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def floor_us(flops: float = 0.0, nbytes: float = 0.0) -> float:
    """Roofline floor in microseconds at the measured H200 rates."""
    return 1e6 * max(flops / H200.tensor_flops, nbytes / H200.mem_bw)


_L2_FLUSH_BYTES = 256 << 20  # > 5x the H200's 50 MB L2
_l2_scratch: dict[int, torch.Tensor] = {}  # per device


def time_impl(fn: Callable[[], Any], eager: bool, warmup: int, rep: int) -> float:
    """:func:`time_us` of an implementation: replayed from a CUDA graph after a cold-L2 flush,
    or (``eager``) called back to back as it is, its host time included."""
    return time_us(fn if eager else graphed(fn), warmup=warmup, rep=rep, cold_l2=not eager)


def time_rounds(
    impls: dict[str, Callable[[], Any]], eager: set[str], warmup: int, rep: int, rounds: int
) -> dict[str, list[float]]:
    """:func:`time_impl` of every implementation in ``rounds`` rounds, the order rotated by
    one each round (each captured once), so a drift of the machine (clocks, another tenant)
    or a place in the order does not fall on one of them: {name: [median of each round]}."""
    calls = {n: (fn if n in eager else graphed(fn)) for n, fn in impls.items()}
    names = list(impls)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            out[n].append(time_us(calls[n], warmup=warmup, rep=rep, cold_l2=n not in eager))
    return out


def add_trace_argument(parser: Any, what: str) -> None:
    """``--trace [slices]``: ``what`` of a profiled launch (``profile=True``); with ``slices``
    also each ring slice's issue and landing (``profile="slices"``)."""
    parser.add_argument(
        "--trace",
        nargs="?",
        const=True,
        choices=["slices"],
        help=f"{what} of a profiled launch; 'slices': each ring slice's issue and landing too",
    )


def parse_variants(specs: list[str]) -> dict[str, dict[str, str]]:
    """``NAME:VAR=VALUE[,VAR=VALUE...]`` -> {NAME: {VAR: VALUE}}: the environment a variant of
    an implementation is compiled under (an A/B of a compile-time switch in one process)."""
    out = {}
    for spec in specs:
        name, sep, assigns = spec.partition(":")
        pairs = [a.partition("=") for a in assigns.split(",") if a]
        if not sep or not name or not pairs or any(not k or not eq for k, eq, _ in pairs):
            raise ValueError(f"variant {spec!r}: expected NAME:VAR=VALUE[,VAR=VALUE...]")
        out[name] = {k: v for k, _, v in pairs}
    return out


def with_env(env: dict[str, str], fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` called with ``env`` set in ``os.environ`` (restored after): a module that compiles
    its kernel lazily compiles it under ``env``. Under a CUDA graph the Python runs only at
    capture, so the replays time the variant's kernel alone."""

    def call():
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return fn()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    return call


def flush_l2() -> None:
    """Evict the L2 cache by reading a 256 MB scratch buffer. A read leaves clean lines, as a
    model's previous layer streaming its weights does (a memset, ``triton.testing.do_bench``'s
    flush, leaves ~50 MB of dirty lines whose write-back lands in the timed call). Before a
    timed call it also gives the host ~60 us of GPU work to run ahead of, so the call's events
    time the GPU, not the host's launch of it."""
    dev = torch.cuda.current_device()
    buf = _l2_scratch.get(dev)
    if buf is None:
        buf = _l2_scratch[dev] = torch.ones(_L2_FLUSH_BYTES // 8, dtype=torch.int64, device=dev)
    buf.sum()


def time_us(fn: Callable[[], Any], warmup: int = 10, rep: int = 100, cold_l2: bool = True) -> float:
    """Median microseconds of ``fn()``: CUDA events on a GPU, a wall clock on the CPU.

    On a GPU each timed call starts with a cold L2 (``cold_l2``, :func:`flush_l2` before its
    start event): a layer in a model finds its weights and KV cache in HBM, not left in L2 by
    its previous call, and the flush keeps calls shorter than the host's launch time from
    timing the host. Eager calls, whose host time is the point, are timed with
    ``cold_l2=False``: back to back, so the host's launch work stays in the measurement."""
    for _ in range(warmup):
        fn()
    samples = []
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
        for s, e in zip(starts, ends):
            if cold_l2:
                flush_l2()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        samples = [1e3 * s.elapsed_time(e) for s, e in zip(starts, ends)]
    else:
        for _ in range(rep):
            t0 = time.perf_counter()
            fn()
            samples.append(1e6 * (time.perf_counter() - t0))
    return statistics.median(samples)


def host_us(fn: Callable[[], Any], calls: int = 1000, chunk: int = 100) -> float:
    """Host microseconds a call of ``fn`` (eager: what the CPU spends issuing it): chunks of
    back-to-back calls, timed on the host, with a sync between chunks outside the timed part.
    Chunks stay short because a launch queue that fills up (an eager launch the GPU takes
    longer to run than the host to issue) makes the loop wait for the GPU and time it instead."""
    for _ in range(10):
        fn()
    rounds = max(calls // chunk, 1)
    total = 0.0
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(chunk):
            fn()
        total += time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e6 * total / (rounds * chunk)


def host_us_queued(fn: Callable[[], Any], calls: int = 100, rounds: int = 5) -> float:
    """Host microseconds a call of ``fn`` while the GPU is busy: ``calls`` calls queue behind
    a ~50 ms sleep kernel, so the host never waits for the GPU to run them (unless a launch
    itself blocks, which this then shows); the median over ``rounds``."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # ~50 ms of GPU clock cycles
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls)
        torch.cuda.synchronize()
    return 1e6 * statistics.median(samples)


def small_mlp(seed: int = 0, tokens: int = 8, max_tokens: int = 64) -> tuple[Any, torch.Tensor]:
    """``(MegaMLP, x)``: the small bf16 MLP (H=256, I=512, at most 64 tokens) and input of
    ``tokens`` rows whose eager call the host-path benchmarks time: its kernel is tiny, so a
    call is the host's cost. Another ``max_tokens`` makes a module that shares no compiled
    kernel with the default one."""
    from .nn import MegaMLP

    gen = torch.Generator(device="cuda").manual_seed(seed)
    h, i = 256, 512

    def rnd(*shape):
        return (torch.randn(*shape, device="cuda", generator=gen) / shape[-1] ** 0.5).bfloat16()

    mlp = MegaMLP(rnd(i, h), rnd(i, h), rnd(h, i), max_tokens=max_tokens)
    return mlp, torch.randn(tokens, h, device="cuda", generator=gen).bfloat16()


def graphed(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` captured in a CUDA graph (after a warm-up call on a side stream, which also
    compiles and autotunes outside the capture); returns the replay. Replays carry no host
    overhead, so they time what the GPU does."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def profile_launch(
    res: Results, label: str, run: Callable[[], Any], graph: Any, warmup: int, rep: int
) -> list[dict[str, Any]]:
    """Trace one launch of a profiled graph: ``run`` (a call of a module compiled with
    ``profile=True`` or ``"slices"``) a few times, then, after a cold-L2 flush as before every
    timed call (:func:`time_us`), the launch whose ``graph``'s per-node trace and launch
    summary (``cutemk.trace.launch_summary``; with slices, ``slice_summary``) go into ``res``
    under ``label``, with the profiled launch timed from CUDA-graph replays (profiling adds its
    timestamp stores, a few a task, a slice's two with slices, and the profile buffer's reset,
    which the slice regions make larger). Returns the task records."""
    from .trace import launch_summary

    for _ in range(3):
        run()
    # the traced launch starts from the L2 the timed ones see: a warm one hides the round
    # trips to HBM of each step's first reads (~10 us of a decode layer's or MoE block's chain);
    # CUTEMK_TRACE_L2=warm traces right after another launch instead (what the cold L2 costs)
    warm = env_choice("CUTEMK_TRACE_L2", ("cold", "warm")) == "warm"
    if not warm:
        flush_l2()
    run()
    torch.cuda.synchronize()
    records = graph.profile_records()
    res.add_trace(label, records)
    if getattr(getattr(graph, "spec", None), "profile_slices", False):
        res.add_slices(label, graph.profile_slices())
    summary = launch_summary(records, graph.profile_ctas(), graph.num_sms)
    summary["l2"] = "warm" if warm else "cold"
    summary["graph_us"] = round(time_us(graphed(run), warmup=warmup, rep=rep), 2)
    try:  # a diagnosis: never fails the benchmark it is part of
        summary.update(_launch_gaps(run, graph))
    except Exception as e:  # noqa: BLE001
        summary["launch_gaps_error"] = f"{type(e).__name__}: {e}"
    res.meta.setdefault("trace", {})[f"{label} launch"] = summary
    print(f"    launch: {summary}")
    return records


_STAMP: list = []


def _stamp_kernel():
    """A Triton kernel writing ``%globaltimer`` to ``ptr[i]`` (made once; None without
    Triton)."""
    if not _STAMP:
        try:
            import triton
            import triton.language as tl
        except ImportError:
            _STAMP.append(None)
            return None

        @triton.jit
        def stamp(ptr, i):
            t = tl.inline_asm_elementwise(
                "mov.u64 $0, %globaltimer;",
                "=l,l",
                [tl.load(ptr + i)],
                dtype=tl.int64,
                is_pure=False,
                pack=1,
            )
            tl.store(ptr + i, t)

        _STAMP.append(stamp)
    return _STAMP[0]


def _launch_gaps(run: Callable[[], Any], graph: Any) -> dict[str, float]:
    """Replayed in one CUDA graph after a cold-L2 flush: a kernel stamping ``%globaltimer``,
    the profiled launch, another stamp. From the stamps and the launch's CTA records (same
    clock): from the first stamp to the first CTA's entry (the launch of a kernel behind
    another in a graph, incl. its shared-memory configuration) and from the last CTA's exit
    to the second stamp. Empty where Triton (which writes the stamp kernel) is missing."""
    stamp = _stamp_kernel()
    if stamp is None:
        return {}
    stamps = torch.zeros(2, dtype=torch.int64, device="cuda")

    def stamped():
        stamp[(1,)](stamps, 0)
        run()
        stamp[(1,)](stamps, 1)

    replay = graphed(stamped)
    gaps: dict[str, list[float]] = {"stamp_to_first_entry_us": [], "last_exit_to_stamp_us": []}
    for _ in range(5):
        flush_l2()
        replay()
        torch.cuda.synchronize()
        ctas = graph.profile_ctas()
        t0, t1 = (int(v) for v in stamps.tolist())
        gaps["stamp_to_first_entry_us"].append((min(c["entry_ns"] for c in ctas) - t0) / 1e3)
        gaps["last_exit_to_stamp_us"].append((t1 - max(c["exit_ns"] for c in ctas)) / 1e3)
    return {k: round(sorted(v)[len(v) // 2], 2) for k, v in gaps.items()}


def plan_stages(graph: Any, env: dict[str, int], num_sms: int = H200.num_sms) -> dict[str, Any]:
    """Host milliseconds of each stage a first call at new bindings ``env`` pays before its
    launch (no GPU needed): ``instantiate`` (tasks and events), ``schedule`` (the static
    schedule and its deadlock check), ``lower_static`` / ``lower_dynamic`` (the kernel's
    arrays for either scheduler); with the plan's ``tasks`` and ``events``."""
    from .codegen.lower import lower
    from .plan import instantiate, no_gc
    from .scheduling import check_static_schedule, resolve_scheduler

    ms = {}
    t0 = time.perf_counter()
    plan = instantiate(graph, env)
    ms["instantiate"] = time.perf_counter() - t0
    with no_gc():
        t0 = time.perf_counter()
        sched = resolve_scheduler("static").build(plan, num_sms)
        check_static_schedule(plan, sched, num_sms)
        ms["schedule"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        lower(plan, sched, num_sms).program_arrays()
        ms["lower_static"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        lower(plan, None, num_sms).program_arrays()
        ms["lower_dynamic"] = time.perf_counter() - t0
    out: dict[str, Any] = {k: 1e3 * v for k, v in ms.items()}
    out["tasks"] = plan.num_tasks
    out["events"] = plan.num_events
    return out


def environment() -> dict[str, Any]:
    """GPU name and library versions for the results header."""
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    try:
        import cutlass

        versions["nvidia-cutlass-dsl"] = getattr(cutlass, "__version__", "unknown")
    except ImportError:  # pragma: no cover - cutlass is a hard dependency
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    commit = os.environ.get("CUTEMK_COMMIT", "")
    try:
        commit = (
            commit
            or subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                cwd=Path(__file__).parent,
                check=True,
            ).stdout.strip()
        )
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    timing = (
        "median of CUDA-event-timed calls, the L2 flushed before each except eager rows "
        "(cutemk.bench.time_us)"
        if torch.cuda.is_available()
        else "median of wall-clock-timed calls (no GPU)"
    )
    return {"gpu": gpu, "versions": versions, "commit": commit, "timing": timing}


@dataclass
class Results:
    name: str
    meta: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)

    def add(self, case: str, impl: str, median_us: float, **extra: Any) -> dict[str, Any]:
        row = {"case": case, "impl": impl, "median_us": round(float(median_us), 3), **extra}
        self.rows.append(row)
        return row

    def add_timed(
        self,
        case: str,
        impl: str,
        median_us: float,
        floor_us: float,
        flops: float | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        """A timed row with its floor: TFLOP/s (given ``flops``), ``floor_us`` and the share
        of it achieved (``of_floor``), then ``extra``."""
        rate = {} if flops is None else {"tflops": round(flops / median_us / 1e6, 1)}
        return self.add(
            case,
            impl,
            median_us,
            **rate,
            floor_us=round(floor_us, 2),
            of_floor=round(floor_us / median_us, 3),
            **extra,
        )

    def add_trace(self, label: str, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A profiled launch's per-node summary (``cutemk.trace.node_summary``) into the JSON's
        ``trace`` under ``label``, and printed."""
        from .trace import node_summary

        title = "per-node trace (us since the first task)"
        return self._add_summary("trace", label, node_summary(records), title)

    def add_slices(self, label: str, tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A ``profile="slices"`` launch's per-node slice summary (``cutemk.trace.
        slice_summary``) into the JSON's ``slices`` under ``label``, and printed."""
        from .trace import slice_summary

        return self._add_summary("slices", label, slice_summary(tasks), "per-node ring slices (us)")

    def _add_summary(self, key: str, label: str, summary: list, title: str) -> list:
        self.meta.setdefault(key, {})[label] = summary
        print(f"{label}: {title}")
        for row in summary:
            print("   ", row)
        return summary

    def add_ratios(self, baseline: str, key: str = "median_us") -> None:
        """Add ``speedup_vs_<baseline>`` (baseline time / this time) to rows of the same case."""
        base = {r["case"]: r[key] for r in self.rows if r["impl"] == baseline}
        for r in self.rows:
            if r["case"] in base and r[key]:
                r[f"speedup_vs_{baseline}"] = round(base[r["case"]] / r[key], 3)

    def table(self) -> str:
        cols: list[str] = []
        for r in self.rows:
            cols += [k for k in r if k not in cols]
        cells = [[_fmt(r.get(c, "")) for c in cols] for r in self.rows]
        width = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(cols, width))]
        lines += ["  ".join(v.ljust(w) for v, w in zip(row, width)) for row in cells]
        return "\n".join(lines)

    def finish(self, out_dir: Path | None = None, chart: bool = False) -> Path:
        """Print the table, write ``<name>.json`` and, with ``chart``, the PNG beside it
        (:func:`bar_chart`, where matplotlib is installed)."""
        out_dir = Path(out_dir) if out_dir else RESULTS_DIR
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{self.name}.json"
        doc = {**environment(), "meta": self.meta, "rows": self.rows}
        path.write_text(json.dumps(doc, indent=2) + "\n")
        print(self.table())
        print(f"wrote {path}")
        if chart:
            png = bar_chart(self, path.with_suffix(".png"))
            if png:
                print(f"wrote {png}")
        return path


def bar_chart(
    res: Results, path: Path | str | None = None, key: str = "median_us", log: bool = True
) -> Path | None:
    """Grouped bars of ``key`` per case (groups) and impl (bars, and the rows' ``floor_us`` as
    a bar named floor), saved as a small PNG; the default path is the JSON's with ``.png``.
    Returns None where matplotlib is missing, so a benchmark never fails for want of a chart. Log scale by default: cases span decode
    (microseconds) to prefill (milliseconds)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    path = Path(path) if path else RESULTS_DIR / f"{res.name}.png"
    cases = list(dict.fromkeys(r["case"] for r in res.rows))
    impls = list(dict.fromkeys(r["impl"] for r in res.rows))
    value = {(r["case"], r["impl"]): r.get(key) for r in res.rows}
    floors = {r["case"]: r["floor_us"] for r in res.rows if r.get("floor_us")}
    if key == "median_us" and floors:  # the floor as a bar of its own, beside the impls
        impls.append("floor")
        value.update({(c, "floor"): f for c, f in floors.items()})
    width = 0.8 / max(1, len(impls))
    fig, ax = plt.subplots(figsize=(8, 4), dpi=80)
    for j, impl in enumerate(impls):
        xs = [i + (j - (len(impls) - 1) / 2) * width for i, c in enumerate(cases)]
        ys = [value.get((c, impl)) or 0.0 for c in cases]
        ax.bar(xs, ys, width, label=impl)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(cases, rotation=30, ha="right", fontsize="x-small")
    ax.set_ylabel(key)
    if log:
        ax.set_yscale("log")
    ax.set_title(res.name)
    ax.legend(fontsize="x-small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1e4 else f"{v:.4g}"
    return str(v)
