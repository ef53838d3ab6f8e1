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

from ..regimes import (  # noqa: F401 (the regime tables are this module's API too)
    DECODE_GATE_UP_WIDTHS,
    DECODE_MAX_TOKENS,
    DECODER_MOE_REGIME_LIMITS,
    DECODER_REGIME_CONFIG,
    DECODER_REGIME_LIMITS,
    FUSED_TAIL_MAX_BATCH,
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
from .base import _token_rows  # noqa: F401 (the host-overhead profile times it)
from .decoder import MegaDecoderLayer
from .mlp import MegaMLP
from .moe import MegaMoE

__all__ = ["MegaDecoderLayer", "MegaMLP", "MegaMoE"]
