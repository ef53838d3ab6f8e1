"""MegaMoE: a Qwen3-MoE sparse block as one megakernel."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import torch_ops
from ..errors import CuteMKError, DeviceError, DTypeError, ShapeError
from ..regimes import MOE_REGIME_LIMITS, MOE_TILE_DEFAULTS, moe_options, moe_regime_graph
from .base import (
    _check_launch,
    _check_no_bias,
    _check_options,
    _check_profile,
    _check_silu,
    _LiveModule,
    _sm_count,
)

MOE_OPTIONS = tuple(MOE_TILE_DEFAULTS)
""":class:`MegaMoE`'s ``options``: the :class:`cutemk.layers.MoeConfig` tile fields it takes
(switches such as ``router_topk``, sizes such as ``block_m``), over every regime's tiles."""


TOPK_MAX = 32
"""Most experts a token picks (the top-k's picks are one a lane of a warp)."""


def _moe_options(options: dict[str, Any] | None) -> dict[str, Any]:
    return moe_options(options, "MegaMoE options")


class MegaMoE(_LiveModule):
    """A Qwen3-MoE sparse block (router, softmax top-k, gated-SiLU experts, weighted combine)
    as one cutemk megakernel, for x of shape (..., H) with at most ``max_tokens`` rows.

    Weights (buffers): ``w_router`` (E, H), ``w_gate_up`` (E, 2I, H) = per expert cat(gate,
    up), ``w_down`` (E, H, I): transformers 5.x's ``Qwen3MoeExperts`` layout. Routing is on
    logits in the weights' dtype, as Hugging Face's gate Linear computes them; exact ties go to
    the lower expert id. Four regimes (:data:`MOE_REGIME_LIMITS`), each one graph compiled on
    first use: ``slots`` for one or two tokens (the experts on the top-k's ids, no routing
    step), ``gemv`` for T <= 16, ``decode`` for T <= :data:`MOE_DECODE_MAX_TOKENS`, ``prefill``
    above (tiles in :data:`MOE_TILES`). ``options``: :class:`cutemk.layers.MoeConfig` tile
    fields, switches or sizes, over every regime's tiles (:data:`MOE_OPTIONS`; part of the
    module's key): ``{"router_topk": False}`` keeps the top-k phase in the 'slots' regime,
    whose router runs it in its last tile by default where the Hopper tile takes the router
    (16-bit weights, 128 experts, top-k up to 32); ``{"block_m": 64}`` gives every grouped
    GEMM 64-row tiles.
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
        options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        _check_options(max_tokens, backend)
        _check_launch(scheduler, num_sms)
        self.options = _moe_options(options)
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
        if min(e, h, inter) < 1:
            raise ShapeError(
                f"MegaMoE needs at least one expert, hidden and intermediate column, got E={e}, "
                f"H={h}, I={inter}"
            )
        k_max = min(e, TOPK_MAX)  # the top-k picks one expert a lane of a warp
        if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= k_max:
            raise ValueError(f"top_k must be an int in [1, {k_max}], got {top_k!r}")
        if not isinstance(norm_topk_prob, bool):
            raise TypeError(f"norm_topk_prob must be a bool, got {norm_topk_prob!r}")
        _check_profile(profile)
        dtypes = {w.dtype for w in (w_router, w_gate_up, w_down)}
        if len(dtypes) != 1 or w_down.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise DTypeError(f"MoE weights must share one of fp32/bf16/fp16, got {dtypes}")
        if len({w.device for w in (w_router, w_gate_up, w_down)}) != 1:
            raise DeviceError("router and expert weights must be on one device")
        self.hidden, self.intermediate, self.num_experts = int(h), int(inter), int(e)
        self.top_k, self.norm_topk_prob, self.max_tokens = top_k, bool(norm_topk_prob), max_tokens
        self.backend, self.scheduler, self.num_sms = backend, scheduler, num_sms
        # per-task timestamps (``compiled(r).profile_records()``); "slices": per ring slice too
        self.profile = profile if profile == "slices" else bool(profile)
        self.register_buffer("w_router", w_router.detach().contiguous())
        self.register_buffer("w_gate_up", w_gate_up.detach().contiguous())
        self.register_buffer("w_down", w_down.detach().contiguous())
        if self.options:
            self._check_options_in_every_regime()
        self._cutemk_key = (
            f"MegaMoE(h={self.hidden}, i={self.intermediate}, e={self.num_experts}, "
            f"k={top_k}, norm={self.norm_topk_prob}, max={max_tokens}, backend={backend}, "
            f"scheduler={scheduler!r}, sms={num_sms}, profile={self.profile}"
            + (f", options={sorted(self.options.items())}" if self.options else "")
            + ")"
        )
        torch_ops.key_of(self)

    def _check_options_in_every_regime(self) -> None:
        """Options an op refuses in one regime only (a ``block_m`` below the slot layout's
        rows, say) are refused here, naming the regime, not at the first token count that
        reaches it: every regime's graph is built (no kernel is compiled)."""
        backend = self.resolved_backend()
        for regime in self.regimes():
            try:
                self.regime_graph(regime, self.w_down.dtype, backend, self.num_sms)
            except (CuteMKError, ValueError, TypeError) as e:
                limit = MOE_REGIME_LIMITS[regime]
                most = self.max_tokens if limit is None else min(limit, self.max_tokens)
                raise ValueError(
                    f"MegaMoE options {self.options}: the '{regime}' regime "
                    f"(up to {most} tokens) refuses "
                    f"them: {e}"
                ) from e

    @classmethod
    def from_hf(cls, block: nn.Module, max_tokens: int = 4096, **kwargs: Any) -> MegaMoE:
        """Build from transformers' ``Qwen3MoeSparseMoeBlock``: the 5.x layout (``gate.weight``,
        ``experts.gate_up_proj``, ``experts.down_proj``) or 4.x's list of expert MLPs.

        Weights that need no re-layout (the router's, the 5.x layout's experts) are taken as
        they are, not copied: a block's experts are most of a layer's memory. An in-place change
        of one module's weights then shows in the other; ``copy.deepcopy`` the block first where
        the two must be independent."""
        gate = getattr(block, "gate", None)
        experts = getattr(block, "experts", None)
        if not isinstance(getattr(gate, "weight", None), torch.Tensor) or experts is None:
            raise ValueError(f"{type(block).__name__} has no gate.weight / experts")
        config = getattr(block, "config", None)
        # the first set (a 0 is kept, and refused by name, not taken for "not set")
        found = (getattr(gate, "top_k", None), getattr(block, "top_k", None))
        found += (getattr(config, "num_experts_per_tok", None),)
        top_k = next((v for v in found if v is not None), None)
        norm = getattr(gate, "norm_topk_prob", getattr(block, "norm_topk_prob", None))
        if norm is None:
            norm = getattr(config, "norm_topk_prob", None)
        if top_k is None or norm is None:
            raise ValueError(f"{type(block).__name__}: cannot find top_k / norm_topk_prob")
        _check_no_bias(gate, type(block).__name__ + ".gate")
        if isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
            w_gu, w_down = experts.gate_up_proj, experts.down_proj
            _check_silu(experts)
            _check_no_bias(experts, type(block).__name__ + ".experts")
        else:  # one gated MLP module per expert
            if not len(experts):
                raise ValueError(f"{type(block).__name__}.experts is empty")
            for i, mlp in enumerate(experts):
                _check_silu(mlp)
                for name in ("gate_proj", "up_proj", "down_proj"):
                    _check_no_bias(
                        getattr(mlp, name), f"{type(block).__name__}.experts[{i}].{name}"
                    )
            w_gu = torch.stack([torch.cat([m.gate_proj.weight, m.up_proj.weight]) for m in experts])
            w_down = torch.stack([m.down_proj.weight for m in experts])
        # as found: a top_k of 2.7 or a norm_topk_prob of "no" is refused, not cast
        return cls(gate.weight, w_gu, w_down, top_k, norm, max_tokens, **kwargs)

    def compiled(self, regime: str, like: torch.Tensor | None = None) -> Any:
        """The compiled graph of a regime (:data:`MOE_REGIME_LIMITS`) for weights of
        ``like``'s dtype and device (default: this module's weights), compiled on first use,
        then reused for every token count it serves."""

        def build(dtype, device, backend):
            return self.regime_graph(regime, dtype, backend, self.num_sms or _sm_count(device))

        return self._graph(regime, like, build)

    def regime_graph(
        self, regime: str, dtype: torch.dtype, backend: str = "cute", num_sms: int | None = None
    ) -> Any:
        """The graph :meth:`compiled` compiles for ``regime`` (no weights needed), its tiles
        fitted to ``num_sms`` SMs (default: the H200's), with this module's options."""
        return moe_regime_graph(
            self.hidden,
            self.intermediate,
            self.num_experts,
            self.top_k,
            self.norm_topk_prob,
            regime,
            dtype,
            self.max_tokens,
            backend,
            num_sms,
            self.options,
        )

    _weight_names = ("w_router", "w_gate_up", "w_down")
    _op_name = "mega_moe"

    def extra_repr(self) -> str:
        return (
            f"hidden={self.hidden}, intermediate={self.intermediate}, "
            f"experts={self.num_experts}, top_k={self.top_k}, max_tokens={self.max_tokens}"
        )
