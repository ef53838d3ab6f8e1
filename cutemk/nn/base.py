"""What the drop-in modules share: the compiled graphs kept per module key, the keyed module
base (regimes, backend, pickling), and the checks of an input and of an activation."""

from __future__ import annotations

import operator
import weakref
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import torch_ops
from ..errors import CuteMKError, DeviceError, DTypeError, LayoutError, ShapeError
from ..regimes import regime_of, regime_starts
from ..tileop import expect_positive_int

_SILU_NAMES = ("silu", "swish")


class _Compiled(dict):
    """(backend, regime, dtype, device) -> compiled graph, of one module key (a dict that can
    be weakly referenced)."""


_COMPILED_BY_KEY: weakref.WeakValueDictionary[str, _Compiled] = weakref.WeakValueDictionary()
"""A module key's compiled graphs (see ``_KeyedModule._compiled``), by the custom op's key
(``torch_ops.op_key``: a profiled module's kernels are others). Held by the key's live modules:
kernels, plans and their device state go with the last of them."""


class _KeyedModule(nn.Module):
    """A module whose megakernel runs through a ``cutemk`` custom op keyed by its launch
    configuration (``_cutemk_key``, see :func:`cutemk.torch_ops.key_of`), with ``backend``
    and weights ``w_down``; those with regimes name their limits in ``regime_limits``."""

    regime_limits: dict[str, int | None] = {}

    @property
    def _compiled(self) -> dict[tuple, Any]:
        """The compiled graphs of every module with this one's key: a call dispatches through
        the custom op to any live module of the key (``torch_ops``), so they share kernels and
        plans (a compiled graph holds no weights: they come with each call), and warming one
        warms them all."""
        key = torch_ops.op_key(self)
        held = self.__dict__.get("_compiled_held")
        if held is None or held[0] != key:  # first use, or the key changed (profile set)
            graphs = _COMPILED_BY_KEY.get(key)
            if graphs is None:
                graphs = _COMPILED_BY_KEY[key] = _Compiled()
            held = self.__dict__["_compiled_held"] = (key, graphs)
        return held[1]

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("scheduler", "num_sms"):
            if "_launch_cfg" in self.__dict__:  # set again after construction: checked too
                d = self.__dict__
                _check_launch(
                    value if name == "scheduler" else d.get("scheduler", "static"),
                    value if name == "num_sms" else d.get("num_sms"),
                )
            super().__setattr__(name, value)
            d = self.__dict__
            d["_launch_cfg"] = (repr(d.get("scheduler")), d.get("num_sms"))
            return
        super().__setattr__(name, value)

    def __getstate__(self) -> dict:
        state = dict(super().__getstate__())
        state.pop("_compiled_held", None)  # compiled kernels are the process's, not the module's
        state.pop("_fast", None)  # nor are the launches it remembers
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        torch_ops.key_of(self)  # a copy or a reloaded module can serve its key

    def _apply(self, fn, *args, **kwargs):
        # moved or cast weights: the launches remembered with the old ones (and the old
        # tensors they hold) go
        self.__dict__.pop("_fast", None)
        return super()._apply(fn, *args, **kwargs)

    _op_rows_name = "max_tokens"  # the name of the module's most rows (``max_tokens``)

    def _leaf_weights(self) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def _check_op_args(self, x2: Any, weights: Any, live: bool = False) -> None:
        """The arguments of the module's custom op called directly (or traced: fake tensors),
        past :meth:`forward`'s checks: 2-D rows of H (``max_tokens`` of them for the live op, at
        most that many otherwise) and as many weights as the module has, of their shapes,
        all in the rows' dtype (the op's key names the module's sizes, not its dtype: the
        weights passed are the ones that run). A traced row count (a symbol) is not
        compared."""
        own = self._leaf_weights()
        who = type(self).__name__
        if (
            not isinstance(weights, (list, tuple))
            or len(weights) != len(own)
            or any(
                not isinstance(w, torch.Tensor) or w.shape != o.shape for w, o in zip(weights, own)
            )
        ):
            raise LayoutError(
                f"{who}: the op takes its {len(own)} weights (shapes "
                f"{[tuple(o.shape) for o in own]}), got {weights!r:.120}"
            )
        rows = x2.shape[0] if isinstance(x2, torch.Tensor) and x2.dim() == 2 else None
        if (
            rows is None
            or x2.shape[1] != self.hidden
            or (
                rows != self.max_tokens
                if live
                else isinstance(rows, int) and rows > self.max_tokens
            )
            or any(w.dtype != x2.dtype for w in weights)
        ):
            want = f"({self.max_tokens}, {self.hidden})" if live else f"(T, {self.hidden})"
            most = "" if live else f" with T <= {self._op_rows_name}={self.max_tokens}"
            raise LayoutError(
                f"{who}: the op takes x of shape {want}{most} in its weights' dtype, got "
                f"{getattr(x2, 'shape', x2)!r} in {getattr(x2, 'dtype', None)}"
            )

    def _graph(self, regime: str, like: torch.Tensor | None, build) -> Any:
        """The compiled graph of ``regime`` for weights like ``like`` (default: the module's
        ``w_down``), shared by the modules of this key: ``build(dtype, device, backend)``
        makes the graph on first use, then it serves every token count of the regime."""
        like = self.w_down if like is None else like
        backend = self.resolved_backend(like)
        # the scheduler and SM count as they are now (set after construction, they compile
        # graphs of their own rather than reuse those of the values the module was built with)
        key = (backend, regime, like.dtype, like.device, self.__dict__.get("_launch_cfg"))
        fn = self._compiled.get(key)
        if fn is None:  # only a regime of this module is ever kept
            if regime not in self.regimes():
                raise ValueError(f"regime must be one of {self.regimes()}, got {regime!r}")
            g = build(like.dtype, like.device, backend)
            fn = self._compiled[key] = _compile(self, g, backend)
        return fn

    def regime(self, tokens: int) -> str:
        """The regime whose graph runs ``tokens`` rows."""
        expect_positive_int(tokens, "tokens")
        return regime_of(self.regime_limits, tokens)

    def regimes(self) -> tuple[str, ...]:
        """The regimes this module can run: those starting below ``max_tokens``."""
        return tuple(r for r, _ in self.regime_starts())

    def regime_starts(self) -> list[tuple[str, int]]:
        """(regime, its smallest token count) of each regime this module runs."""
        return regime_starts(self.regime_limits, self.max_tokens)

    def resolved_backend(self, like: torch.Tensor | None = None) -> str:
        """The backend for weights like ``like`` (default: this module's)."""
        if self.backend is not None:
            return self.backend
        # a CUDA tensor means CUDA is available (no ``torch.cuda.is_available()`` per call)
        return "cute" if (self.w_down if like is None else like).is_cuda else "interpret"


FAST_PATH = True
"""The drop-in row modules' eager fast path (see ``_LiveModule.forward``); benchmarks turn it
off to time the full path in the same process."""

_compiling = torch.compiler.is_compiling


def _same_generation(graph_ref: Any, generation: int) -> bool:
    graph = graph_ref()
    return graph is not None and graph._generation == generation


class _LiveModule(_KeyedModule):
    """A keyed module over (tokens, H) rows (``MegaMLP``, ``MegaMoE``): its graphs take the
    rows then the weights named by ``_weight_names``, launch through the custom op
    ``torch.ops.cutemk.<_op_name>`` when traced, and can take the token count as device data
    (every op ``TileOp.token_local``): :meth:`forward`, its eager fast path, and
    :meth:`forward_live` with its kin."""

    _weight_names: tuple[str, ...] = ()
    _op_name = ""

    def _leaf_weights(self) -> tuple[torch.Tensor, ...]:
        """The weights a regime's graph takes after the activation rows, in its leaf order."""
        return tuple(getattr(self, n) for n in self._weight_names)

    # -- forward ----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, num_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """(..., H) -> (..., H). Inference only: runs under no_grad (no autograd graph).

        ``num_tokens`` (an int32 CUDA tensor of one element): the token count as device data,
        for one CUDA-graph capture that replays at every count (:meth:`forward_live`)."""
        if num_tokens is not None:
            return self.forward_live(x, num_tokens)
        # (not while torch.compile traces: the remembered launch is host state it cannot trace)
        fast = self.__dict__.get("_fast") if FAST_PATH and not _compiling() else None
        hit = fast.get(x.shape) if fast is not None and type(x) is torch.Tensor else None
        if hit is not None:  # rows of a shape an earlier eager call launched (see below)
            run, current, weights, dtype, device, laid_out, buffers_of = hit
            if (
                x.dtype is dtype
                and x.get_device() == device
                and not x.requires_grad
                and laid_out(x)
                and current()
                and all(map(operator.is_, buffers_of(self._buffers), weights))
                and torch_ops.direct(x)
            ):
                return run((_aligned(x), *weights))
        x2 = _token_rows(self, x)
        if x2 is None:
            return x.detach().new_empty(x.shape)
        weights = self._leaf_weights()
        if torch_ops.direct(x2):
            y = self._launch(x2, *weights)
            if (
                FAST_PATH
                and x2 is x
                and y.dim() == 2
                and x.stride() == (x.shape[1], 1)  # what the fast path takes (see above)
                and not self.__dict__.get("profile")
            ):
                self._remember(x, weights)
        else:
            key = torch_ops.key_of(self)
            y = getattr(torch.ops.cutemk, self._op_name)(x2, *weights, key)
        return y if x.dim() == 2 else y.reshape(x.shape)

    def _remember(self, x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> None:
        """Keep the launch of ``x``'s rows: the next eager call with rows of this shape skips
        the checks above it (they hold for any x of this shape, dtype, device and layout, with
        these weights), the regime lookup, no_grad (the kernel call records no autograd
        graph) and the graph's per-call checks of the leaves (``CuteGraph.runner``)."""
        fast = self.__dict__.get("_fast")
        if fast is None or len(fast) >= 64:
            fast = self.__dict__["_fast"] = {}
        graph = self.compiled(self.regime(x.shape[0]), like=weights[-1])
        runner = getattr(graph, "runner", None)  # the interpreter has none
        run = runner(_aligned(x), *weights) if runner else None
        if run is None:
            run, current = (lambda args, g=graph: g(*args)), (lambda: True)
        else:  # a runner of replaced plans (CuteGraph.load_plan) is dropped
            current = partial(_same_generation, weakref.ref(graph), run.generation)
        # row-major with size-1 dims too (TMA strides): for more than one row, contiguity
        laid_out = torch.Tensor.is_contiguous
        if x.shape[0] == 1:
            laid_out = partial(_row_major, (x.shape[1], 1))
        names = self._weight_names
        buffers_of = operator.itemgetter(*names) if len(names) > 1 else _one_of(names[0])
        fast[x.shape] = (run, current, weights, x.dtype, x.get_device(), laid_out, buffers_of)

    def __setattr__(self, name: str, value: Any) -> None:
        # the launches remembered were chosen with these: another value forgets them (the
        # fast path compares neither per call)
        if name in ("backend", "scheduler", "num_sms", "profile"):
            self.__dict__.pop("_fast", None)
        super().__setattr__(name, value)

    def _launch(self, x2: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        """The megakernel call behind the module's custom op (real tensors): rows ``x2``
        (tokens, H), the weights in ``_weight_names`` order."""
        with torch.no_grad():
            fn = self.compiled(self.regime(x2.shape[0]), like=weights[-1])
            return fn(_aligned(x2), *weights)

    def forward_live(
        self, x: torch.Tensor, num_tokens: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The module on the first ``num_tokens`` rows of ``x`` ((max_tokens, H) or (..., H)
        with max_tokens rows), the count read on the GPU: no host work depends on it, so a
        CUDA graph captured once replays at every count up to ``max_tokens``. Launches every
        regime's kernel (:meth:`CuteGraph.live <cutemk.runtime.CuteGraph.live>`); the one
        whose range holds the count runs its plan, the others exit at once. Rows of the result
        at and past the count are not defined. A count outside [0, max_tokens] runs nothing
        and is raised by :meth:`check_live`. ``out``: a (max_tokens, H) tensor to write
        into. On the interpreter (the CPU reference) the count is read on the host and checked
        at once."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"{type(self).__name__} input must be a torch.Tensor, got {type(x).__name__}"
            )
        x2 = x.reshape(-1, x.shape[-1]) if x.dim() not in (0, 2) else x
        if x.dim() == 0 or x.shape[-1] != self.hidden or x2.shape[0] != self.max_tokens:
            raise LayoutError(
                f"forward_live takes x with max_tokens={self.max_tokens} rows of "
                f"{self.hidden}, got {tuple(x.shape)}"
            )
        if x.dtype != self.w_down.dtype:
            raise DTypeError(
                f"{type(self).__name__} input has dtype {x.dtype} but its weights are "
                f"{self.w_down.dtype}"
            )
        weights = self._leaf_weights()
        if torch_ops.direct(x2):
            y = self._live_rows(x2, num_tokens, weights, out)
        elif out is not None:
            raise CuteMKError("forward_live(out=...) cannot be traced (torch.compile): drop out")
        else:  # traced (torch.compile): an opaque op, its fake output the rows' shape
            key = torch_ops.key_of(self)
            y = torch.ops.cutemk.mega_live(x2, num_tokens, list(weights), key)
        return y if x.dim() == 2 else y.reshape(x.shape)

    def _live_rows(
        self,
        x2: torch.Tensor,
        num_tokens: torch.Tensor,
        weights: tuple[torch.Tensor, ...] | list[torch.Tensor],
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`forward_live` on (max_tokens, H) rows with these weights (the call behind
        ``torch.ops.cutemk.mega_live``, real tensors)."""
        if self.resolved_backend(weights[-1]) != "cute":
            return self._live_rows_reference(x2, num_tokens, weights, out)
        graphs = self.live_graphs(like=weights[-1])
        y = torch.empty_like(x2) if out is None else out
        with torch.no_grad():
            for rows, live in graphs:
                live(x2[:rows], *weights, num_tokens=num_tokens, out=(y[:rows],))
        return y

    def live_plan_count(self, n: int) -> int:
        """The token count whose plan a live launch at count ``n`` (>= 1) runs: the smallest
        count at or above ``n`` that the regime of ``n`` plans (:func:`cutemk.live.live_counts`);
        its rows past ``n`` are computed too, from whatever ``x`` holds there (an MoE block
        routes those tokens nowhere)."""
        from ..live import live_counts

        if not isinstance(n, int) or not 1 <= n <= self.max_tokens:
            raise ValueError(f"n must be an int in [1, {self.max_tokens}], got {n!r}")
        regime = self.regime(n)
        first = dict(self.regime_starts())[regime]
        rows = min(self.regime_limits[regime] or self.max_tokens, self.max_tokens)
        return next(c for c in live_counts(first, rows) if c >= n)

    def _live_rows_reference(self, x2, num_tokens, weights, out):
        """:meth:`_live_rows` on the interpreter: the count read on the host, the plan the
        device would pick (:meth:`live_plan_count`) run with its tokens past the count
        absent."""
        check_live_reference_args(x2, num_tokens, out)
        n = int(num_tokens.reshape(()))
        if not 0 <= n <= self.max_tokens:
            raise CuteMKError(
                f"{type(self).__name__}: forward_live got a token count of {n}, outside "
                f"[0, {self.max_tokens}]"
            )
        y = torch.empty_like(x2) if out is None else out
        if n:
            c = self.live_plan_count(n)
            # the plan's tokens past the live count are absent (the MoE block routes them
            # nowhere, ``TileOp.live_rows_inputs``): NaN rows, which route nowhere here too
            xc = x2[:c].clone()
            xc[n:] = float("nan")
            y[:c] = self._launch(xc, *weights)
        return y

    def live_graphs(
        self, build: bool = True, like: torch.Tensor | None = None
    ) -> list[tuple[int, Any]]:
        """(rows, :class:`~cutemk.live.LiveGraph`) of each regime, for :meth:`forward_live`
        with weights like ``like`` (default: this module's): built on first use (compiling
        the live kernels, planning every count); with ``build=False`` only those built so
        far."""
        if self.resolved_backend() != "cute":
            raise CuteMKError("a live token count needs the cute backend (a CUDA GPU)")
        out = []
        for regime, first in self.regime_starts():
            rows = min(self.regime_limits[regime] or self.max_tokens, self.max_tokens)
            graph = self.compiled(regime, like=like)
            if build:
                out.append((rows, graph.live(first=first, limit=self.max_tokens)))
            elif (live := graph.live_built(first=first, limit=self.max_tokens)) is not None:
                out.append((rows, live))
        return out

    def check_live(self) -> None:
        """Raise CuteMKError if a :meth:`forward_live` since the last check got a count outside
        [0, max_tokens] (it ran nothing); waits for the launches."""
        if self.resolved_backend() != "cute":
            return  # the interpreter checks each count when it reads it
        tallies = [live.take_errors() for _, live in self.live_graphs(build=False)]
        bad, last = max(tallies, default=(0, 0))  # every regime's kernel saw the same counts
        if bad:
            raise CuteMKError(
                f"{type(self).__name__}: {bad} forward_live call(s) got a token count outside "
                f"[0, {self.max_tokens}] (the last: {last}) and computed nothing"
            )


def check_live_reference_args(x2: torch.Tensor, num_tokens: Any, out: Any) -> None:
    """A live call's count and ``out`` on the interpreter, checked as the GPU path checks them
    (``cutemk.live``): the count an int32 tensor of one element beside the rows, ``out`` a
    contiguous tensor of the rows' shape, dtype and device, the rows contiguous."""
    if not (
        isinstance(num_tokens, torch.Tensor)
        and num_tokens.dtype == torch.int32
        and num_tokens.numel() == 1
    ):
        raise TypeError("num_tokens must be an int32 tensor of one element (the live count)")
    if num_tokens.device != x2.device:
        raise DeviceError(f"num_tokens is on {num_tokens.device}, the rows on {x2.device}")
    if not x2.is_contiguous():
        raise LayoutError(
            f"forward_live takes contiguous rows, got strides {x2.stride()} for shape "
            f"{tuple(x2.shape)}"
        )
    if out is not None and not (
        isinstance(out, torch.Tensor)
        and out.shape == x2.shape
        and out.dtype == x2.dtype
        and out.device == x2.device
        and out.is_contiguous()
    ):
        got = (
            (out.dtype, tuple(out.shape), str(out.device)) if isinstance(out, torch.Tensor) else out
        )
        raise LayoutError(
            f"out must be a contiguous {x2.dtype} tensor of shape {tuple(x2.shape)} on "
            f"{x2.device}, got {got}"
        )


def _check_options(max_tokens: Any, backend: Any) -> None:
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    if backend not in (None, "cute", "interpret"):
        raise ValueError(f"backend must be None, 'cute' or 'interpret', got {backend!r}")


def _check_launch(scheduler: Any, num_sms: Any) -> None:
    """A module's scheduler (a registered name or a Scheduler) and SM count (None or a
    positive int), checked when it is built rather than at its first call."""
    from ..scheduling import resolve_scheduler

    resolve_scheduler(scheduler)
    if num_sms is not None and (
        not isinstance(num_sms, int) or isinstance(num_sms, bool) or num_sms < 1
    ):
        raise ValueError(f"num_sms must be None or a positive int, got {num_sms!r}")


def _check_profile(profile: Any) -> None:
    if profile not in (False, True, "slices"):
        raise ValueError(f"profile must be False, True or 'slices', got {profile!r}")


def _check_no_bias(module: Any, who: str) -> None:
    """The blocks compute bias-free projections: a module (a Linear, or an experts module
    whose tensors end in ``bias``) that has a bias is refused, never dropped."""
    for name, value in vars(module).get("_parameters", {}).items():
        if value is not None and (name == "bias" or name.endswith("_bias")):
            raise ValueError(f"{who}.{name}: a bias, which cutemk's blocks do not compute")
    bias = getattr(module, "bias", None)
    if isinstance(bias, torch.Tensor):
        raise ValueError(f"{who}.bias: a bias, which cutemk's blocks do not compute")


def _sm_count(device: torch.device) -> int:
    """The SMs a kernel on ``device`` runs on (the H200's 132 off the GPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    from ..costmodel import H200

    return H200.num_sms


def _compile(module: nn.Module, g: Any, backend: str) -> Any:
    """``g`` compiled with the module's scheduler, SM count and profiling choice (``profile``
    True or ``"slices"``, see ``Graph.compile``)."""
    options: dict[str, Any] = {"scheduler": module.scheduler}
    profile = getattr(module, "profile", False)
    if profile and backend != "cute":
        raise CuteMKError(
            f"{type(module).__name__}(profile=...) records the GPU kernel's tasks: it needs the "
            f"'cute' backend, this call runs on {backend!r}"
        )
    if profile:
        options["profile"] = profile if profile == "slices" else True
    if module.num_sms is not None:
        options["num_sms"] = module.num_sms
    return g.compile(backend, **options)


def _token_rows(module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """``x`` (..., H) as contiguous (tokens, H) rows for ``module`` (a MegaMLP or
    MegaMoE: ``hidden``, ``max_tokens``, weights ``w_down``), or None when it has no tokens;
    a clear error for a wrong type, shape, dtype, device or too many tokens."""
    name = type(module).__name__
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} input must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.shape[-1] != module.hidden:
        raise ShapeError(
            f"{name} input must have shape (..., {module.hidden}), got {tuple(x.shape)}"
        )
    w = module.w_down
    if x.dtype != w.dtype:
        raise DTypeError(
            f"{name} input has dtype {x.dtype} but its weights are {w.dtype}; cast the input or "
            "the module (.to(dtype))"
        )
    xd = x.get_device()  # an index: cheaper than comparing devices (-1 off CUDA)
    if xd != w.get_device() or (xd < 0 and x.device != w.device):
        raise DeviceError(f"{name} input is on {x.device} but its weights are on {w.device}")
    tokens = x.numel() // module.hidden
    if tokens == 0:
        return None
    if tokens > module.max_tokens:
        raise ShapeError(
            f"{name} got {tokens} tokens (input shape {tuple(x.shape)}), more than "
            f"max_tokens={module.max_tokens}; build it with a larger max_tokens or split the batch"
        )
    if x.dim() == 2 and not x.requires_grad and x.is_contiguous():
        return x  # already rows (the common case: no view to make per call)
    return x.detach().reshape(tokens, module.hidden).contiguous()


def _row_major(stride: tuple[int, int], x: torch.Tensor) -> bool:
    return x.stride() == stride


def _one_of(name: str):
    return lambda buffers: (buffers[name],)


def _aligned(x2: torch.Tensor) -> torch.Tensor:
    """``x2``, copied where its rows are not 16-byte aligned (the GPU kernel's loads need it)."""
    return x2.clone() if x2.data_ptr() % 16 else x2


def _check_silu(mlp: nn.Module) -> None:
    """The module's activation must be SiLU. ``act_fn`` is what HF's forward calls, so it
    decides; it is recognised by type, else by its values on a probe (HF ships its own
    ``SiLUActivation`` class); without ``act_fn``, the config's ``hidden_act`` decides."""
    act = getattr(mlp, "act_fn", None)
    if act is None:
        hidden_act = getattr(getattr(mlp, "config", None), "hidden_act", None)
        if hidden_act in _SILU_NAMES:
            return
        raise ValueError(
            f"{type(mlp).__name__} has no act_fn and its config.hidden_act is {hidden_act!r}; "
            f"MegaMLP computes SiLU (hidden_act in {_SILU_NAMES})"
        )
    if act is F.silu or isinstance(act, nn.SiLU):
        return
    probe = torch.linspace(-8.0, 8.0, 65)
    try:
        with torch.no_grad():
            ok = torch.allclose(act(probe), F.silu(probe), rtol=1e-5, atol=1e-6)
    except Exception:  # an activation that cannot run on a CPU probe is not recognised
        ok = False
    if not ok:
        raise ValueError(
            f"{type(mlp).__name__}.act_fn is {act!r}, not SiLU; MegaMLP computes "
            "down(silu(gate) * up) only"
        )
