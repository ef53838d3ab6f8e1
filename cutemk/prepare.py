"""Warm-up: compile what a module or a compiled graph runs, and plan token counts, before
serving (``cutemk.warmup``).

A drop-in module (``cutemk.nn.MegaMLP`` / ``MegaMoE`` / ``MegaDecoderLayer``) compiles one
kernel per regime on the first call that needs it, and every new token count is planned on its
first call. A server
would rather pay both at start: :func:`warmup` runs one launch at the smallest token count of
each regime (which compiles its kernel and plans that count) and plans the token counts it is
given, with a progress bar where ``tqdm`` is installed, and reports what it did.
"""

from __future__ import annotations

import operator
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from .errors import ShapeError
from .tileop import expect_positive_int


@dataclass
class WarmupReport:
    """What :func:`warmup` did: one ``(step, seconds)`` row per launch or plan."""

    steps: list[tuple[str, float]] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return sum(s for _, s in self.steps)

    def summary(self) -> str:
        lines = [f"warm-up: {len(self.steps)} steps, {self.seconds:.2f} s"]
        slow = sorted(self.steps, key=lambda r: -r[1])[:5]
        lines += [f"  {name}: {s * 1e3:.1f} ms" for name, s in slow]
        return "\n".join(lines)


def _progress(total: int, enabled: bool | None):
    if enabled is False:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    if enabled is None and not sys.stderr.isatty():
        return None
    return tqdm(total=total, desc="cutemk warm-up", unit="step")


def warmup(
    obj: Any,
    tokens: Iterable[int] = (),
    progress: bool | None = None,
    parallel: bool = True,
    live: bool = False,
    pages: int | None = None,
) -> WarmupReport:
    """Prepare ``obj`` for serving.

    ``obj``: a ``MegaMLP`` / ``MegaMoE`` / ``MegaDecoderLayer`` (every regime's kernel is
    compiled by one launch at its smallest token count, on zeros; a decoder layer's on its
    ``warm_inputs``), a graph compiled with one symbolic dim (nothing to launch), or a list of
    these. ``tokens``: token counts to plan now, an int or ints (each at most the module's or
    graph's max).
    ``progress``: a tqdm bar (None: when stderr is a terminal). ``parallel``: first compile
    every kernel not yet compiled or cached, in worker processes at once, into the on-disk
    cache (``cutemk.kernels.compile_many``), so the launches load them. ``live``: also
    prepare the modules' one-capture path (``MegaMLP`` / ``MegaMoE.forward_live``): its
    kernels compiled (in parallel with the others) and every count it serves planned; for a
    ``MegaDecoderLayer`` (``forward_live``, planned per cache size) give ``pages``, its
    caches' page count (its first live launch then loads the kernels: make it before a
    capture)."""
    objs = list(obj) if isinstance(obj, (list, tuple)) else [obj]
    tokens = _counts(tokens)
    for name, value in (("progress", progress), ("parallel", parallel), ("live", live)):
        # a switch is a bool ("no" would be true); progress may be None (a terminal decides)
        if not isinstance(value, bool) and not (name == "progress" and value is None):
            raise TypeError(f"warmup {name} must be a bool, got {value!r}")
    if pages is not None:
        expect_positive_int(pages, "warmup pages")
        # (it used to be ignored silently elsewhere)
        if not live or not any(hasattr(o, "decode_regime_starts") for o in objs):
            raise ValueError(
                "warmup pages= is the page count of a MegaDecoderLayer's caches, for its "
                "live path: give it with live=True and a decoder layer"
            )
    for o in objs:  # before any work
        if isinstance(o, type):
            raise TypeError(
                f"warmup takes a cutemk.nn module or a compiled graph, got the class "
                f"{o.__name__} (build the module first)"
            )
        if live and pages is None and hasattr(o, "decode_regime_starts"):
            raise ValueError(
                "warmup(live=True) of a MegaDecoderLayer needs pages= (its caches' page "
                "count: its live graphs are planned per cache size)"
            )
        top = getattr(o, "max_tokens", None)
        for t in tokens:
            if top is not None and not 1 <= t <= top:
                raise ShapeError(f"warmup token count {t} is outside [1, {top}]")
    report = WarmupReport()
    if parallel:
        from .kernels import compile_many

        specs = [spec for o in objs for spec in _kernel_specs(o)]
        if live:
            specs += [spec for o in objs for spec in _live_specs(o)]
        t0 = time.perf_counter()
        n = compile_many(specs)
        if n:
            report.steps.append((f"compile {n} kernels in parallel", time.perf_counter() - t0))
    for o in objs:
        report.steps += _warm_one(o, tokens, progress).steps
        if live and hasattr(o, "decode_regime_starts") and o.resolved_backend() == "cute":
            t0 = time.perf_counter()
            graphs = o.live_graphs(pages)
            counts = sum(len(live_graph.counts) for _, _, live_graph in graphs)
            report.steps.append(
                (
                    f"live: {len(graphs)} kernels compiled, {counts} batches planned",
                    time.perf_counter() - t0,
                )
            )
        elif live and hasattr(o, "live_graphs") and o.resolved_backend() == "cute":
            t0 = time.perf_counter()
            graphs = o.live_graphs()
            counts = sum(len(g.counts) for _, g in graphs)
            # one launch at count 0 (nothing to compute): every kernel's first call, which
            # loads its module, happens here rather than inside a capture
            w = o.w_down
            with torch.no_grad():
                o.forward_live(
                    torch.zeros(o.max_tokens, o.hidden, dtype=w.dtype, device=w.device),
                    torch.zeros(1, dtype=torch.int32, device=w.device),
                )
            torch.cuda.synchronize(w.device)
            report.steps.append(
                (
                    f"live: {len(graphs)} kernels loaded, {counts} counts planned",
                    time.perf_counter() - t0,
                )
            )
    return report


def _counts(tokens: Any) -> list[int]:
    """warmup's ``tokens`` as ints: one count or an iterable of them, each an int, a numpy
    int or an integer tensor's element (2.7, a float tensor's 2.5 or True is not a count), at
    least 1."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.reshape(-1).tolist()  # a 0-d tensor is one count
    elif isinstance(tokens, (str, bytes)) or not (
        hasattr(tokens, "__iter__") or hasattr(type(tokens), "__index__")
    ):
        raise TypeError(f"warmup tokens must be an int or ints, got {tokens!r}")
    elif not hasattr(tokens, "__iter__"):
        tokens = (tokens,)  # one count (an int, a numpy int)
    tokens = list(tokens)
    try:
        if any(isinstance(t, bool) for t in tokens):
            raise TypeError
        counts = [operator.index(t) for t in tokens]
    except TypeError:
        counts = []
    if len(counts) != len(tokens) or any(c < 1 for c in counts):
        raise ValueError(f"warmup tokens must be positive ints, got {tokens}")
    return counts


def _live_specs(obj: Any) -> list:
    """The specs of ``obj``'s live kernels (a module with ``live_graphs``, on the GPU)."""
    if not hasattr(obj, "live_graphs") or obj.resolved_backend() != "cute":
        return []
    from .live import live_spec

    if hasattr(obj, "decode_regime_starts"):  # a decoder layer: the caches' pages fixed
        graphs = [obj.compiled(regime) for regime, _ in obj.decode_regime_starts()]
        return [live_spec(g, ("pages",)) for g in graphs if getattr(g, "spec", None) is not None]
    graphs = [obj.compiled(regime) for regime, _ in obj.regime_starts()]
    return [live_spec(g) for g in graphs if getattr(g, "spec", None) is not None]


def _kernel_specs(obj: Any) -> list:
    """The kernel specs of what ``obj`` (a module with regimes, or a compiled graph) launches;
    none for the interpreter."""
    if hasattr(obj, "regimes") and hasattr(obj, "compiled"):
        graphs = [obj.compiled(regime) for regime in obj.regimes()]
    else:
        graphs = [obj]
    return [g.spec for g in graphs if getattr(g, "spec", None) is not None]


def _warm_one(obj: Any, tokens: Iterable[int], progress: bool | None) -> WarmupReport:
    tokens = list(tokens)
    bad = [t for t in tokens if isinstance(t, bool) or not hasattr(type(t), "__index__")]
    if bad or any(int(t) < 1 for t in tokens):  # an int or numpy int; 2.7 is not a count
        raise ValueError(f"warmup tokens must be positive ints, got {bad or tokens}")
    tokens = [int(t) for t in tokens]
    if hasattr(obj, "regime_starts") and hasattr(obj, "compiled"):
        return _warm_module(obj, tokens, progress)
    if hasattr(obj, "plan") and hasattr(obj, "graph"):
        return _warm_graph(obj, tokens, progress)
    raise TypeError(
        f"warmup takes a cutemk.nn module or a compiled graph, got {type(obj).__name__}"
    )


def _warm_module(module: Any, tokens: list[int], progress: bool | None) -> WarmupReport:
    if tokens and hasattr(module, "warm_inputs"):
        raise ValueError(
            f"{type(module).__name__}: its plans are keyed by the KV cache's page count as well "
            "as the batch, so warm-up plans none; warm it with tokens=() (its first step at a "
            "new batch plans in milliseconds)"
        )
    for t in tokens:
        if not 1 <= t <= module.max_tokens:
            raise ShapeError(f"warmup token count {t} is outside [1, {module.max_tokens}]")
    starts = module.regime_starts()
    # regimes not chosen by a token count (MegaDecoderLayer's prefill steps): a step of
    # their own inputs
    others = [r for r in module.regimes() if r not in {r for r, _ in starts}]
    report = WarmupReport()
    bar = _progress(len(starts) + len(others) + len(tokens), progress)
    w = module.w_down
    with torch.no_grad():
        for regime, t in starts:
            t0 = time.perf_counter()
            before = _kernel_counts()
            if hasattr(module, "warm_inputs"):  # a step of the module's own kind of input
                module(*module.warm_inputs(t))
            else:
                module(torch.zeros(t, module.hidden, dtype=w.dtype, device=w.device))
            if w.is_cuda:
                torch.cuda.synchronize(w.device)
            how = _kernel_step(before, _kernel_counts())
            report.steps.append((f"{regime}: {how}launch at T={t}", time.perf_counter() - t0))
            if bar is not None:
                bar.update(1)
        for regime in others:
            t0 = time.perf_counter()
            before = _kernel_counts()
            module.warm_step(regime)
            if w.is_cuda:
                torch.cuda.synchronize(w.device)
            how = _kernel_step(before, _kernel_counts())
            report.steps.append((f"{regime}: {how}launch", time.perf_counter() - t0))
            if bar is not None:
                bar.update(1)
        for t in tokens:
            t0 = time.perf_counter()
            module.compiled(module.regime(t)).plan({"T": t})
            report.steps.append((f"plan T={t}", time.perf_counter() - t0))
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return report


def _kernel_counts() -> tuple[int, int]:
    """(kernels compiled, kernels loaded from the on-disk cache) by this process so far."""
    kernels = sys.modules.get("cutemk.kernels")  # not imported: no kernel was made
    return (kernels.compile_count, kernels.cache_loads) if kernels else (0, 0)


def _kernel_step(before: tuple[int, int], after: tuple[int, int]) -> str:
    """How a step got its kernel: loaded from the on-disk cache, else compiled (or, for the
    interpreter, its graph built)."""
    if after[1] > before[1] and after[0] == before[0]:
        return "load cached kernel + "
    return "compile + "


def _warm_graph(compiled: Any, tokens: list[int], progress: bool | None) -> WarmupReport:
    syms = compiled.graph.syms()
    if tokens and len(syms) != 1:
        raise ValueError(
            f"warmup plans token counts of graphs with one symbolic dim; {compiled.graph.name} "
            f"has {sorted(syms)}"
        )
    report = WarmupReport()
    if not tokens:
        return report
    ((name, s),) = syms.items()
    lo, hi = s.bounds()
    for t in tokens:  # every count checked before any is planned
        if not lo <= t <= hi:
            raise ShapeError(f"warmup: {name}={t} is outside [{lo}, {hi}]")
    bar = _progress(len(tokens), progress)
    for t in tokens:
        t0 = time.perf_counter()
        compiled.plan({name: t})
        report.steps.append((f"plan {name}={t}", time.perf_counter() - t0))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return report
