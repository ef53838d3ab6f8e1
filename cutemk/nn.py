"""torch.nn drop-ins backed by cutemk graphs.

:class:`MegaMLP` replaces a Hugging Face gated-SiLU MLP (``Qwen3MLP``, ``LlamaMLP``,
``MistralMLP``: ``down_proj(silu(gate_proj(x)) * up_proj(x))`` with bias-free ``nn.Linear``
layers) by the fused MLP graph of :func:`cutemk.layers.mlp_graph`: one megakernel launch in
which each down-projection tile waits only for the gate/up tiles it reads.

:class:`MegaMoE` replaces a Qwen3-MoE sparse block and :class:`MegaDecoderLayer` a Qwen3
decoder layer's decode step. Each module keeps a few *regimes* (token-count ranges, one graph
each, compiled lazily on first use); which graph a regime compiles is :mod:`cutemk.regimes`'.

Inference only: the megakernel has no backward, so :meth:`MegaMLP.forward` runs under
``torch.no_grad`` and its output never requires grad.

This module sits above the core (it imports :mod:`cutemk.layers`, which imports ops); ``import
cutemk`` reaches it lazily as ``cutemk.nn``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import torch_ops
from .errors import CuteMKError, DeviceError, DTypeError, LayoutError, ShapeError
from .regimes import (  # noqa: F401 (the regime tables are this module's API too)
    DECODE_GATE_UP_WIDTHS,
    DECODE_MAX_TOKENS,
    DECODER_REGIME_LIMITS,
    GEMV_MAX_BATCH,
    MLP_SPLIT_K,
    MLP_TILES,
    MOE_DECODE_MAX_TOKENS,
    MOE_REGIME_LIMITS,
    MOE_TILES,
    REGIME_LIMITS,
    REGIMES,
    Tiles,
    mlp_regime_graph,
    mlp_tiles,
    moe_regime_graph,
    regime_of,
    regime_starts,
    wave_fit_width,
)
from .symbolic import sym
from .tileop import expect_positive_int

_SILU_NAMES = ("silu", "swish")


class _Compiled(dict):
    """(backend, regime, dtype, device) -> compiled graph, of one module key (a dict that can
    be weakly referenced)."""


FAST_PATH = True
"""MegaMLP's eager fast path (see ``MegaMLP.forward``); benchmarks turn it off to time the full
path in the same process."""

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

    def regime(self, tokens: int) -> str:
        """The regime whose graph runs ``tokens`` rows."""
        return regime_of(self.regime_limits, tokens)

    def regimes(self) -> tuple[str, ...]:
        """The regimes this module can run: those starting below ``max_tokens``."""
        held = self.__dict__.get("_regimes_held")  # (max_tokens, regimes): asked every call
        if held is None or held[0] != self.max_tokens:
            held = (self.max_tokens, tuple(r for r, _ in self.regime_starts()))
            self.__dict__["_regimes_held"] = held
        return held[1]

    def regime_starts(self) -> list[tuple[str, int]]:
        """(regime, its smallest token count) of each regime this module runs."""
        return regime_starts(self.regime_limits, self.max_tokens)

    def resolved_backend(self, like: torch.Tensor | None = None) -> str:
        """The backend for weights like ``like`` (default: this module's)."""
        if self.backend is not None:
            return self.backend
        # a CUDA tensor means CUDA is available (no ``torch.cuda.is_available()`` per call)
        return "cute" if (self.w_down if like is None else like).is_cuda else "interpret"


class MegaMLP(_KeyedModule):
    """``down(silu(x @ W_gate^T) * (x @ W_up^T))`` as a cutemk megakernel, for x of shape
    (..., H) with at most ``max_tokens`` rows once flattened.

    Weights are kept as buffers (not parameters: nothing trains them): ``w_gate_up`` (2I, H) =
    cat(gate, up), the layout the fused gate/up GEMM reads, and ``w_down`` (H, I). ``.to()``
    moves or casts them; the graphs for a new device or dtype compile on the next call.

    ``backend`` None picks 'cute' when the weights are on a CUDA device at call time, else
    'interpret' (the CPU reference). ``scheduler`` and ``num_sms`` go to ``Graph.compile``.
    """

    regime_limits = REGIME_LIMITS

    def __init__(
        self,
        w_gate: torch.Tensor,
        w_up: torch.Tensor,
        w_down: torch.Tensor,
        max_tokens: int = 8192,
        backend: str | None = None,
        scheduler: Any = "static",
        num_sms: int | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        if backend not in (None, "cute", "interpret"):
            raise ValueError(f"backend must be None, 'cute' or 'interpret', got {backend!r}")
        _check_weights(w_gate, w_up, w_down)
        inter, hidden = w_gate.shape
        self.hidden, self.intermediate, self.max_tokens = int(hidden), int(inter), max_tokens
        self.backend, self.scheduler, self.num_sms = backend, scheduler, num_sms
        w_gate_up = torch.cat([w_gate.detach(), w_up.detach()]).contiguous()
        self.register_buffer("w_gate_up", w_gate_up)
        self.register_buffer("w_down", w_down.detach().contiguous())
        # the custom op's key: everything but the weights that decides the kernels it runs
        self._cutemk_key = (
            f"MegaMLP(h={self.hidden}, i={self.intermediate}, max={max_tokens}, "
            f"backend={backend}, scheduler={scheduler!r}, sms={num_sms})"
        )
        torch_ops.key_of(self)

    @classmethod
    def from_hf(
        cls,
        mlp: nn.Module,
        max_tokens: int = 8192,
        backend: str | None = None,
        scheduler: Any = "static",
        num_sms: int | None = None,
    ) -> MegaMLP:
        """Build from a Hugging Face gated MLP (gate_proj/up_proj/down_proj, SiLU, no biases).
        Raises ValueError naming what does not fit instead of computing something else."""
        layers = {}
        for name in ("gate_proj", "up_proj", "down_proj"):
            lin = getattr(mlp, name, None)
            if not isinstance(getattr(lin, "weight", None), torch.Tensor):
                raise ValueError(f"{type(mlp).__name__} has no {name} layer with a weight tensor")
            if getattr(lin, "bias", None) is not None:
                raise ValueError(
                    f"{type(mlp).__name__}.{name} has a bias; MegaMLP computes bias-free "
                    "projections (e.g. LLaMA with mlp_bias=True is not supported)"
                )
            layers[name] = lin.weight
        _check_silu(mlp)
        return cls(
            layers["gate_proj"],
            layers["up_proj"],
            layers["down_proj"],
            max_tokens=max_tokens,
            backend=backend,
            scheduler=scheduler,
            num_sms=num_sms,
        )

    # -- graphs -----------------------------------------------------------------------------
    def compiled(self, regime: str, like: torch.Tensor | None = None) -> Any:
        """The compiled graph of a regime for weights of ``like``'s dtype and device (default:
        this module's weights), compiled on first use, then cached: every token count of the
        regime reuses it."""
        if regime not in self.regimes():
            raise ValueError(f"regime must be one of {self.regimes()}, got {regime!r}")
        like = self.w_down if like is None else like
        backend = self.resolved_backend(like)
        key = (backend, regime, like.dtype, like.device)
        fn = self._compiled.get(key)
        if fn is None:
            sms = self.num_sms or _sm_count(like.device)
            g = mlp_regime_graph(
                self.hidden, self.intermediate, regime, like.dtype, self.max_tokens, backend, sms
            )
            fn = self._compiled[key] = _compile(self, g, backend)
        return fn

    # -- forward ----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, num_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """(..., H) -> (..., H). Inference only: runs under no_grad (no autograd graph).

        ``num_tokens`` (an int32 CUDA tensor of one element): the token count as device data,
        for one CUDA-graph capture that replays at every count (:meth:`forward_live`)."""
        if num_tokens is not None:
            return self.forward_live(x, num_tokens)
        fast = self.__dict__.get("_fast") if FAST_PATH else None
        hit = fast.get(x.shape) if fast is not None and type(x) is torch.Tensor else None
        if hit is not None:  # rows of a shape an earlier eager call launched (see below)
            graph, w_gate_up, w_down, dtype, device, config = hit
            if (
                x.dtype is dtype
                and x.get_device() == device
                and not x.requires_grad
                and x.is_contiguous()
                and w_gate_up is self._buffers["w_gate_up"]
                and w_down is self._buffers["w_down"]
                and config == (self.backend, self.scheduler, self.num_sms)
                and not self.__dict__.get("profile")
                and torch_ops.direct(x)
            ):
                return graph(_aligned(x), w_gate_up, w_down)
        x2 = _token_rows(self, x)
        if x2 is None:
            return x.detach().new_empty(x.shape)
        if torch_ops.direct(x2):
            y = self._launch(x2, self.w_gate_up, self.w_down)
            if FAST_PATH and x2 is x and y.dim() == 2 and not self.__dict__.get("profile"):
                # the next eager call with these rows skips the checks above it (they hold for
                # any x of this shape, dtype, device and layout, with these weights), the
                # regime lookup and no_grad (the kernel call records no autograd graph)
                if fast is None or len(fast) >= 64:
                    fast = self.__dict__["_fast"] = {}
                graph = self.compiled(self.regime(x.shape[0]), like=self.w_down)
                fast[x.shape] = (
                    graph,
                    self.w_gate_up,
                    self.w_down,
                    x.dtype,
                    x.get_device(),
                    (self.backend, self.scheduler, self.num_sms),
                )
        else:
            key = torch_ops.key_of(self)
            y = torch.ops.cutemk.mega_mlp(x2, self.w_gate_up, self.w_down, key)
        return y if x.dim() == 2 else y.reshape(x.shape)

    def forward_live(
        self, x: torch.Tensor, num_tokens: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The MLP of the first ``num_tokens`` rows of ``x`` ((max_tokens, H) or (..., H)
        with max_tokens rows), the count read on the GPU: no host work depends on it, so a
        CUDA graph captured once replays at every count up to ``max_tokens``. Launches every
        regime's kernel (:meth:`CuteGraph.live <cutemk.runtime.CuteGraph.live>`); the one
        whose range holds the count runs its plan, the others exit at once. Rows of the result
        at and past the count are not defined. A count outside [0, max_tokens] runs nothing
        and is raised by :meth:`check_live`. ``out``: a (max_tokens, H) tensor to write
        into. On the interpreter (the CPU reference) the count is read on the host and checked
        at once."""
        x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
        if x.shape[-1] != self.hidden or x2.shape[0] != self.max_tokens:
            raise LayoutError(
                f"forward_live takes x with max_tokens={self.max_tokens} rows of "
                f"{self.hidden}, got {tuple(x.shape)}"
            )
        if self.resolved_backend() != "cute":
            return self._forward_live_reference(x, x2, num_tokens, out)
        graphs = self.live_graphs()
        y = torch.empty_like(x2) if out is None else out
        with torch.no_grad():
            for rows, live in graphs:
                live(x2[:rows], self.w_gate_up, self.w_down, num_tokens=num_tokens, out=(y[:rows],))
        return y if x.dim() == 2 else y.reshape(x.shape)

    def _forward_live_reference(self, x, x2, num_tokens, out):
        """:meth:`forward_live` on the interpreter: the count read on the host."""
        if not (
            isinstance(num_tokens, torch.Tensor)
            and num_tokens.dtype == torch.int32
            and num_tokens.numel() == 1
        ):
            raise TypeError(
                "num_tokens must be an int32 tensor of one element (the live token count)"
            )
        n = int(num_tokens.reshape(()))
        if not 0 <= n <= self.max_tokens:
            raise CuteMKError(
                f"MegaMLP: forward_live got a token count of {n}, outside [0, {self.max_tokens}]"
            )
        y = torch.empty_like(x2) if out is None else out
        if n:
            y[:n] = self.forward(x2[:n])
        return y if x.dim() == 2 else y.reshape(x.shape)

    def live_graphs(self, build: bool = True) -> list[tuple[int, Any]]:
        """(rows, :class:`~cutemk.live.LiveGraph`) of each regime, for :meth:`forward_live`:
        built on first use (compiling the live kernels, planning every count); with
        ``build=False`` only those built so far."""
        if self.resolved_backend() != "cute":
            raise CuteMKError("a live token count needs the cute backend (a CUDA GPU)")
        out = []
        for regime, first in self.regime_starts():
            rows = min(self.regime_limits[regime] or self.max_tokens, self.max_tokens)
            graph = self.compiled(regime)
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
                f"MegaMLP: {bad} forward_live call(s) got a token count outside "
                f"[0, {self.max_tokens}] (the last: {last}) and computed nothing"
            )

    def _launch(self, x2: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor):
        """The megakernel call behind ``torch.ops.cutemk.mega_mlp`` (real tensors)."""
        with torch.no_grad():
            fn = self.compiled(self.regime(x2.shape[0]), like=w_down)
            return fn(_aligned(x2), w_gate_up, w_down)

    def extra_repr(self) -> str:
        return (
            f"hidden={self.hidden}, intermediate={self.intermediate}, "
            f"max_tokens={self.max_tokens}, backend={self.backend or 'auto'}, "
            f"scheduler={getattr(self.scheduler, 'name', self.scheduler)}"
        )


def _sm_count(device: torch.device) -> int:
    """The SMs a kernel on ``device`` runs on (the H200's 132 off the GPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    from .costmodel import H200

    return H200.num_sms


def _compile(module: nn.Module, g: Any, backend: str) -> Any:
    """``g`` compiled with the module's scheduler, SM count and profiling choice."""
    options: dict[str, Any] = {"scheduler": module.scheduler}
    if getattr(module, "profile", False):
        options["profile"] = True
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


def _aligned(x2: torch.Tensor) -> torch.Tensor:
    """``x2``, copied where its rows are not 16-byte aligned (the GPU kernel's loads need it)."""
    return x2.clone() if x2.data_ptr() % 16 else x2


def _check_weights(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> None:
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            got = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
            raise ShapeError(f"{name} must be a 2-D tensor, got {got}")
    inter, hidden = w_gate.shape
    if tuple(w_up.shape) != (inter, hidden):
        raise ShapeError(
            f"w_up must match w_gate's (I, H) = {(inter, hidden)}, got {tuple(w_up.shape)}"
        )
    if tuple(w_down.shape) != (hidden, inter):
        raise ShapeError(f"w_down must be (H, I) = {(hidden, inter)}, got {tuple(w_down.shape)}")
    dtypes = {w.dtype for w in (w_gate, w_up, w_down)}
    if len(dtypes) != 1:
        raise DTypeError(f"gate, up and down weights must share one dtype, got {dtypes}")
    if w_gate.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise DTypeError(f"MegaMLP weights must be fp32, bf16 or fp16, got {w_gate.dtype}")
    devices = {w.device for w in (w_gate, w_up, w_down)}
    if len(devices) != 1:
        raise DeviceError(f"gate, up and down weights must be on one device, got {devices}")


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


class MegaMoE(_KeyedModule):
    """A Qwen3-MoE sparse block (router, softmax top-k, gated-SiLU experts, weighted combine)
    as one cutemk megakernel, for x of shape (..., H) with at most ``max_tokens`` rows.

    Weights (buffers): ``w_router`` (E, H), ``w_gate_up`` (E, 2I, H) = per expert cat(gate,
    up), ``w_down`` (E, H, I): transformers 5.x's ``Qwen3MoeExperts`` layout. Routing is on
    logits in the weights' dtype, as Hugging Face's gate Linear computes them; exact ties go to
    the lower expert id. Three regimes (:data:`MOE_REGIME_LIMITS`), each one graph compiled on
    first use: ``gemv`` for T <= 16, ``decode`` for T <= :data:`MOE_DECODE_MAX_TOKENS`,
    ``prefill`` above (tiles in :data:`MOE_TILES`).
    Inference only (no backward).
    """

    regime_limits = MOE_REGIME_LIMITS

    def __init__(
        self,
        w_router: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        top_k: int,
        norm_topk_prob: bool = True,
        max_tokens: int = 4096,
        backend: str | None = None,
        scheduler: Any = "static",
        num_sms: int | None = None,
        profile: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        if backend not in (None, "cute", "interpret"):
            raise ValueError(f"backend must be None, 'cute' or 'interpret', got {backend!r}")
        for name, w, nd in (("w_router", w_router, 2), ("w_gate_up", w_gate_up, 3)):
            if not isinstance(w, torch.Tensor) or w.dim() != nd:
                raise ShapeError(f"{name} must be a {nd}-D tensor")
        e, h = w_router.shape
        if w_gate_up.shape[0] != e or w_gate_up.shape[2] != h or w_gate_up.shape[1] % 2:
            raise ShapeError(
                f"w_gate_up must be (E, 2I, H) with E={e}, H={h}, got {tuple(w_gate_up.shape)}"
            )
        inter = w_gate_up.shape[1] // 2
        if not isinstance(w_down, torch.Tensor) or tuple(w_down.shape) != (e, h, inter):
            got = tuple(w_down.shape) if isinstance(w_down, torch.Tensor) else type(w_down)
            raise ShapeError(f"w_down must be (E, H, I) = {(e, h, inter)}, got {got}")
        if not isinstance(top_k, int) or not 1 <= top_k <= e:
            raise ValueError(f"top_k must be an int in [1, {e}], got {top_k!r}")
        dtypes = {w.dtype for w in (w_router, w_gate_up, w_down)}
        if len(dtypes) != 1 or w_down.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise DTypeError(f"MoE weights must share one of fp32/bf16/fp16, got {dtypes}")
        if len({w.device for w in (w_router, w_gate_up, w_down)}) != 1:
            raise DeviceError("router and expert weights must be on one device")
        self.hidden, self.intermediate, self.num_experts = int(h), int(inter), int(e)
        self.top_k, self.norm_topk_prob, self.max_tokens = top_k, bool(norm_topk_prob), max_tokens
        self.backend, self.scheduler, self.num_sms = backend, scheduler, num_sms
        self.profile = bool(profile)  # per-task timestamps (``compiled(r).profile_records()``)
        self.register_buffer("w_router", w_router.detach().contiguous())
        self.register_buffer("w_gate_up", w_gate_up.detach().contiguous())
        self.register_buffer("w_down", w_down.detach().contiguous())
        self._cutemk_key = (
            f"MegaMoE(h={self.hidden}, i={self.intermediate}, e={self.num_experts}, "
            f"k={top_k}, norm={self.norm_topk_prob}, max={max_tokens}, backend={backend}, "
            f"scheduler={scheduler!r}, sms={num_sms}, profile={self.profile})"
        )
        torch_ops.key_of(self)

    @classmethod
    def from_hf(cls, block: nn.Module, max_tokens: int = 4096, **kwargs: Any) -> MegaMoE:
        """Build from transformers' ``Qwen3MoeSparseMoeBlock``: the 5.x layout (``gate.weight``,
        ``experts.gate_up_proj``, ``experts.down_proj``) or 4.x's list of expert MLPs."""
        gate = getattr(block, "gate", None)
        experts = getattr(block, "experts", None)
        if not isinstance(getattr(gate, "weight", None), torch.Tensor) or experts is None:
            raise ValueError(f"{type(block).__name__} has no gate.weight / experts")
        config = getattr(block, "config", None)
        top_k = getattr(gate, "top_k", None) or getattr(block, "top_k", None)
        top_k = top_k or getattr(config, "num_experts_per_tok", None)
        norm = getattr(gate, "norm_topk_prob", getattr(block, "norm_topk_prob", None))
        if norm is None:
            norm = getattr(config, "norm_topk_prob", None)
        if top_k is None or norm is None:
            raise ValueError(f"{type(block).__name__}: cannot find top_k / norm_topk_prob")
        if isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
            w_gu, w_down = experts.gate_up_proj, experts.down_proj
            _check_silu(experts)
        else:  # one gated MLP module per expert
            for mlp in experts:
                _check_silu(mlp)
            w_gu = torch.stack([torch.cat([m.gate_proj.weight, m.up_proj.weight]) for m in experts])
            w_down = torch.stack([m.down_proj.weight for m in experts])
        return cls(gate.weight, w_gu, w_down, int(top_k), bool(norm), max_tokens, **kwargs)

    def compiled(self, regime: str, like: torch.Tensor | None = None) -> Any:
        """The compiled graph of a regime (:data:`MOE_REGIME_LIMITS`) for weights of
        ``like``'s dtype and device (default: this module's weights), compiled on first use,
        then reused for every token count it serves."""
        if regime not in MOE_REGIME_LIMITS:
            raise ValueError(f"regime must be one of {tuple(MOE_REGIME_LIMITS)}, got {regime!r}")
        like = self.w_down if like is None else like
        backend = self.resolved_backend(like)
        key = (backend, regime, like.dtype, like.device)
        fn = self._compiled.get(key)
        if fn is None:
            g = moe_regime_graph(
                self.hidden,
                self.intermediate,
                self.num_experts,
                self.top_k,
                self.norm_topk_prob,
                regime,
                like.dtype,
                self.max_tokens,
                backend,
            )
            fn = self._compiled[key] = _compile(self, g, backend)
        return fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (..., H). Inference only: runs under no_grad."""
        x2 = _token_rows(self, x)
        if x2 is None:
            return x.detach().new_empty(x.shape)
        if torch_ops.direct(x2):
            y = self._launch(x2, self.w_router, self.w_gate_up, self.w_down)
        else:
            key = torch_ops.key_of(self)
            y = torch.ops.cutemk.mega_moe(x2, self.w_router, self.w_gate_up, self.w_down, key)
        return y if x.dim() == 2 else y.reshape(x.shape)

    def _launch(self, x2, w_router, w_gate_up, w_down):
        """The megakernel call behind ``torch.ops.cutemk.mega_moe`` (real tensors)."""
        with torch.no_grad():
            fn = self.compiled(self.regime(x2.shape[0]), like=w_down)
            return fn(_aligned(x2), w_router, w_gate_up, w_down)

    def extra_repr(self) -> str:
        return (
            f"hidden={self.hidden}, intermediate={self.intermediate}, "
            f"experts={self.num_experts}, top_k={self.top_k}, max_tokens={self.max_tokens}"
        )


class MegaDecoderLayer(_KeyedModule):
    """Decode steps of a Qwen3 decoder layer (dense MLP) as one megakernel
    (:func:`cutemk.layers.decoder_layer_graph`), over a paged KV cache the caller owns.

    ``forward(x, positions, k_cache, v_cache, page_table, seq_lens)``: ``x`` (B, H) one new
    token per sequence, ``positions`` (B,) int32 its position, caches (pages, page_size, Hkv, D)
    (the new keys and values are written into them, in place), ``page_table`` (B, max_pages)
    int32, ``seq_lens`` (B,) int32 counting the new token; returns the layer's output (B, H).
    Built from transformers' ``Qwen3DecoderLayer`` or ``Qwen3MoeDecoderLayer`` (``moe``: its
    sparse block's :class:`cutemk.layers.MoeConfig`) by :meth:`from_hf`. Inference only.
    Two regimes (:data:`DECODER_REGIME_LIMITS`), one graph each, compiled on first use.
    """

    regime_limits = DECODER_REGIME_LIMITS

    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        cfg: Any,
        moe: Any = None,
        max_batch: int = 64,
        backend: str | None = None,
        scheduler: Any = "static",
        num_sms: int | None = None,
    ) -> None:
        super().__init__()
        expect_positive_int(max_batch, "max_batch")
        if backend not in (None, "cute", "interpret"):
            raise ValueError(f"backend must be None, 'cute' or 'interpret', got {backend!r}")
        self.cfg, self.moe, self.max_batch = cfg, moe, max_batch
        self.backend, self.scheduler, self.num_sms = backend, scheduler, num_sms
        self._names = list(weights)
        for name, w in weights.items():
            self.register_buffer(name, w.detach().contiguous())
        self._cutemk_key = (
            f"MegaDecoderLayer({cfg!r}, moe={moe!r}, weights={self._names}, max={max_batch}, "
            f"backend={backend}, scheduler={scheduler!r}, sms={num_sms})"
        )
        torch_ops.key_of(self)

    @classmethod
    def from_hf(
        cls,
        layer: nn.Module,
        page_size: int = 16,
        max_pages: int = 256,
        max_positions: int | None = None,
        rope_theta: float | None = None,
        tiles: tuple[int, int] = (64, 64),
        **kwargs: Any,
    ) -> MegaDecoderLayer:
        """From transformers' ``Qwen3DecoderLayer`` / ``Qwen3MoeDecoderLayer`` (its weights
        copied; its rotary settings from its attention's config: the default rope,
        ``rope_theta``)."""
        from .layers import DecoderConfig, MoeConfig, fold_decoder_norms
        from .ops import rope_table

        a, m = layer.self_attn, layer.mlp
        conf = a.config
        head_dim = a.head_dim
        params = getattr(conf, "rope_parameters", None) or getattr(conf, "rope_scaling", None)
        params = params or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in (None, "default"):
            raise ValueError(f"MegaDecoderLayer: rope type {rope_type!r} is not supported yet")
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if getattr(a, name).bias is not None:
                raise ValueError(f"MegaDecoderLayer: {name} has a bias, not supported yet")
        if getattr(a, "sliding_window", None):
            raise ValueError("MegaDecoderLayer: sliding-window attention is not supported yet")
        theta = rope_theta
        if theta is None:
            theta = params.get("rope_theta", getattr(conf, "rope_theta", 10000.0))
        max_pos = max_positions or conf.max_position_embeddings
        sparse = hasattr(m, "experts")
        moe = None
        if sparse:  # the sparse block's weights as MegaMoE reads them (5.x or 4.x layout)
            block = MegaMoE.from_hf(m, max_tokens=kwargs.get("max_batch", 64), backend="interpret")
            moe = MoeConfig(
                block.hidden,
                block.intermediate,
                block.num_experts,
                block.top_k,
                block.norm_topk_prob,
                block_m=tiles[0],
                block_n=tiles[1],
                router_dtype=None,
            )
        cfg = DecoderConfig(
            hidden=conf.hidden_size,
            intermediate=moe.intermediate if sparse else m.gate_proj.weight.shape[0],
            heads=conf.num_attention_heads,
            kv_heads=conf.num_key_value_heads,
            head_dim=head_dim,
            page_size=page_size,
            max_pages=max_pages,
            max_positions=max_pos,
            eps=layer.input_layernorm.variance_epsilon,
            block_m=tiles[0],
            block_n=tiles[1],
            fold_norms=True,
        )
        w = {
            "input_norm": layer.input_layernorm.weight,
            "w_qkv": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
            "q_norm": a.q_norm.weight,
            "k_norm": a.k_norm.weight,
            "cos_sin": rope_table(max_pos, head_dim, float(theta)).to(a.q_proj.weight.device),
            "w_o": a.o_proj.weight,
            "post_norm": layer.post_attention_layernorm.weight,
        }
        if sparse:
            w.update(w_router=block.w_router, w_gate_up=block.w_gate_up, w_down=block.w_down)
        else:
            w.update(
                w_gate_up=torch.cat([m.gate_proj.weight, m.up_proj.weight]),
                w_down=m.down_proj.weight,
            )
        return cls(fold_decoder_norms(w, moe=sparse), cfg, moe=moe, **kwargs)

    @property
    def max_tokens(self) -> int:
        """One new token a sequence: the most tokens a step takes is ``max_batch``."""
        return self.max_batch

    @property
    def hidden(self) -> int:
        return self.cfg.hidden

    def compiled(self, regime: str, like: torch.Tensor | None = None) -> Any:
        """The compiled graph of a regime (:data:`DECODER_REGIME_LIMITS`) for weights like
        ``like`` (default: this module's ``w_down``), compiled on first use: one graph up to
        ``GEMV_MAX_BATCH`` sequences, one for the rest (a graph's weight loads are sized for
        its largest batch, and a box of mostly absent rows costs the copy engine nearly a full
        one)."""
        if regime not in self.regimes():
            raise ValueError(f"regime must be one of {self.regimes()}, got {regime!r}")
        like = self.w_down if like is None else like
        backend = self.resolved_backend(like)
        key = (backend, regime, like.dtype, like.device)
        fn = self._compiled.get(key)
        if fn is None:
            from .layers import decoder_layer_graph

            limit = self.regime_limits[regime]
            limit = self.max_batch if limit is None else min(self.max_batch, limit)
            g = decoder_layer_graph(sym("B", max=limit), self.cfg, like.dtype, self.moe)
            fn = self._compiled[key] = _compile(self, g, backend)
        return fn

    def warm_inputs(self, batch: int) -> tuple[torch.Tensor, ...]:
        """A decode step of ``batch`` sequences for :func:`cutemk.warmup`: one token each, at
        position 0 of its own one-page cache (zeros, on the weights' device and dtype)."""
        cfg, w = self.cfg, self.w_down
        kw = {"device": w.device}
        cache = (batch, cfg.page_size, cfg.kv_heads, cfg.head_dim)
        table = torch.arange(batch, dtype=torch.int32, **kw)[:, None].repeat(1, cfg.max_pages)
        return (
            torch.zeros(batch, cfg.hidden, dtype=w.dtype, **kw),
            torch.zeros(batch, dtype=torch.int32, **kw),
            torch.zeros(cache, dtype=w.dtype, **kw),
            torch.zeros(cache, dtype=w.dtype, **kw),
            table,
            torch.ones(batch, dtype=torch.int32, **kw),
        )

    def forward(self, x, positions, k_cache, v_cache, page_table, seq_lens) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.cfg.hidden:
            raise ShapeError(f"x must be (B, {self.cfg.hidden}), got {tuple(x.shape)}")
        if x.shape[0] > self.max_batch:
            raise ShapeError(f"batch {x.shape[0]} is more than max_batch={self.max_batch}")
        weights = [getattr(self, n) for n in self._names]
        x = x.detach()
        if torch_ops.direct(x):
            return self._launch(x, positions, k_cache, v_cache, page_table, seq_lens, weights)
        key = torch_ops.key_of(self)
        return torch.ops.cutemk.mega_decoder_layer(
            x, positions, k_cache, v_cache, page_table, seq_lens, weights, key
        )

    def _launch(self, x, positions, k_cache, v_cache, page_table, seq_lens, weights):
        """The megakernel call behind ``torch.ops.cutemk.mega_decoder_layer``."""
        named = dict(zip(self._names, weights))
        with torch.no_grad():
            return self.compiled(self.regime(x.shape[0]), like=named["w_down"])(
                x=x,
                positions=positions,
                k_cache=k_cache,
                v_cache=v_cache,
                page_table=page_table,
                seq_lens=seq_lens,
                **named,
            )
