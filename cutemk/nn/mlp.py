"""MegaMLP: a Hugging Face gated-SiLU MLP as one megakernel, with the token count as host or
device data."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import torch_ops
from ..errors import DeviceError, DTypeError, ShapeError
from ..regimes import REGIME_LIMITS, mlp_regime_graph
from .base import _check_launch, _check_options, _check_silu, _LiveModule, _sm_count


class MegaMLP(_LiveModule):
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
        _check_options(max_tokens, backend)
        _check_launch(scheduler, num_sms)
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
        Raises ValueError naming what does not fit instead of computing something else.

        gate and up are copied (stacked into one buffer); down_proj's weight is taken as it is
        (no copy), so an in-place change of one module's down weight shows in the other; pass
        ``mlp`` through ``copy.deepcopy`` first where the two must be independent."""
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

        def build(dtype, device, backend):
            sms = self.num_sms or _sm_count(device)
            return mlp_regime_graph(
                self.hidden, self.intermediate, regime, dtype, self.max_tokens, backend, sms
            )

        return self._graph(regime, like, build)

    _weight_names = ("w_gate_up", "w_down")
    _op_name = "mega_mlp"

    def extra_repr(self) -> str:
        return (
            f"hidden={self.hidden}, intermediate={self.intermediate}, "
            f"max_tokens={self.max_tokens}, backend={self.backend or 'auto'}, "
            f"scheduler={getattr(self.scheduler, 'name', self.scheduler)}"
        )


def _check_weights(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> None:
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            got = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
            raise ShapeError(f"{name} must be a 2-D tensor, got {got}")
    inter, hidden = w_gate.shape
    if min(inter, hidden) < 1:
        raise ShapeError(
            f"MegaMLP needs H and I of at least 1, got w_gate of shape {(inter, hidden)}"
        )
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
