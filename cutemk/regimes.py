"""Which graph a drop-in module (``cutemk.nn``) compiles for a token count: its *regimes*.

One compiled graph serves every token count up to its declared maximum, but one tile shape does
not suit every token count: at decode sizes a layer is a weight stream that must reach all 132
SMs (split along K where the tiles are too few), while small tiles waste bandwidth on re-reads
of the weights at prefill sizes. So a module keeps a few regimes, each one graph compiled
lazily on first use. The MLP's: ``gemv1`` for one token, ``gemv`` for T <= 16, ``decode`` for
T <= 128 and ``prefill`` above, tile shapes in :data:`MLP_TILES` (read through :func:`mlp_tiles`) and K splits in
:data:`MLP_SPLIT_K`; the MoE block's in :data:`MOE_REGIME_LIMITS` / :data:`MOE_TILES`; the
decoder layer's in :data:`DECODER_REGIME_LIMITS`. These tables are the places to tune them, and
:func:`mlp_regime_graph` / :func:`moe_regime_graph` build a regime's graph without weights (for
tools such as ``benchmarks/host_path.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .arch import pin_arch
from .costmodel import H200
from .envvars import env_choice
from .graph import Graph
from .layers import MoeConfig, mlp_graph, moe_graph
from .moe_layers import fused_combine_has_tile
from .ops import DECODE_GATE_UP_WIDTHS, wave_fit_width  # noqa: F401 (re-exported)
from .ops.gemm_splitk import SLICE as SPLIT_SLICE
from .symbolic import sym
from .tileop import check_field_value, expect_positive_int

DECODE_MAX_TOKENS = 128
"""Largest token count the decode regimes serve; larger ones go to the prefill graph."""

REGIME_LIMITS: dict[str, int | None] = {
    "gemv1": 1,
    "gemv": 16,
    "decode": DECODE_MAX_TOKENS,
    "prefill": None,
}
"""Regimes in order with the most tokens each serves. 'gemv' is 'decode' compiled for at most
16 rows: its A loads are 16 rows, not 64 (out-of-bounds rows still cost the copy engine).
'gemv1' is one row, whose gate/up streams faster split along K (``cutemk.layers.linear``)
while 2-16 rows run it unsplit in one wave of tiles."""

Tiles = tuple[tuple[int, int], tuple[int, int]]

MLP_TILES: dict[tuple[str, str], Tiles] = {
    # (backend, regime): ((block_m, block_n) of the fused gate/up GEMM, the same of the down
    # GEMM). The fused gate/up tile holds two accumulators, so at one register budget it is half
    # as wide as the down tile. Measured on the H200 (benchmarks/gemm_sweep.py, mlp.py): at
    # decode sizes each SM's weight stream runs faster with wide B boxes than with many tiles
    # (64x32 reached 1.5 TB/s, 64x256 3.4 TB/s), so decode uses 64-row tiles about 128 to 256
    # weight rows wide; prefill uses 128-row tiles, which read each weight tile once per 128
    # tokens.
    ("cute", "gemv1"): ((64, 128), (64, 64)),
    ("cute", "gemv"): ((64, 128), (64, 64)),
    ("cute", "decode"): ((128, 64), (128, 256)),
    ("cute", "prefill"): ((128, 128), (128, 256)),
    # The interpreter runs torch references on the CPU: small tiles exercise many events
    # (and races, deadlocks) at test sizes; speed does not matter there.
    ("interpret", "gemv1"): ((16, 32), (16, 32)),
    ("interpret", "gemv"): ((16, 32), (16, 32)),
    ("interpret", "decode"): ((16, 32), (16, 32)),
    ("interpret", "prefill"): ((16, 32), (16, 32)),
}

MLP_SPLIT_K: dict[tuple[str, str], int | None | tuple[int | None, int | None]] = {
    ("cute", "gemv1"): None,
    ("cute", "gemv"): None,
    ("cute", "decode"): (1, None),
}
"""(backend, regime) -> ``split_k`` of the MLP's GEMMs (``cutemk.layers.mlp_graph``; None:
chosen per GEMM from the sizes); 1 where absent. At up to 16 tokens the MLP is a weight stream,
and K ranges spread it over every SM (``ops.gemm_splitk``). Up to 128 tokens it still is: one
128-row tile reads each weight column once (64-row tiles read it twice at 128 tokens), gate/up
in 64-column tiles (Qwen3-8B: 192 of them, ~1.5 waves), down split along K (its 4096 columns
make too few 128-row tiles to fill 132 SMs; the split's partial tiles are 256 columns wide,
``cutemk.layers.SPLIT_BLOCK_N``, so the down tile width in :data:`MLP_TILES` applies unsplit)."""

MLP_FUSED_REDUCE: dict[tuple[str, str], bool] = {
    ("cute", "gemv1"): False,
    ("cute", "gemv"): False,
}
"""(backend, regime) -> whether the MLP's split GEMMs reduce in their last partial tiles
(``ops.gemm_split``: no reduce step, no hop) instead of a reduce step; regimes absent here
always keep the step (at 128 tokens one SM would sum 128 x 128 x split partials that the
step spreads over every SM). Off: measured on the H200 (Qwen3-8B, 50 timed runs, one
process) it is level with the step (T=1 81.1 vs 81.3 us, T=16 86.1 vs 85.7): at decode sizes
the MLP streams its weights at ~4.1 TB/s across the hops already, the next tiles' weights
loading before their events. ``CUTEMK_SPLIT_REDUCE`` (read when a graph is built): ``tiles``
turns it on for the regimes listed here, ``step`` off (:func:`split_reduce_in_tiles`)."""

GEMV_MAX_BATCH = REGIME_LIMITS["gemv"]
"""MegaDecoderLayer: batches up to this run a graph compiled for it (its 'gemv' regime)."""

REGIMES = tuple(REGIME_LIMITS)


def mlp_tiles(regime: str, backend: str = "cute") -> Tiles:
    """``((block_m, block_n) of gate/up, (block_m, block_n) of down)`` for a regime
    ('decode' | 'prefill')."""
    try:
        return MLP_TILES[(backend, regime)]
    except KeyError:
        raise ValueError(
            f"no MLP tiles for backend={backend!r}, regime={regime!r}; known: {sorted(MLP_TILES)}"
        ) from None


MOE_DECODE_MAX_TOKENS = 512
"""Largest token count :class:`MegaMoE`'s decode graphs serve (64-row grouped tiles); larger
ones go to its prefill graph (128-row tiles)."""

MOE_REGIME_LIMITS: dict[str, int | None] = {
    "slots": 2,
    "gemv": 16,
    "decode": MOE_DECODE_MAX_TOKENS,
    "prefill": None,
}
"""MegaMoE's regimes in order with the most tokens each serves. An expert holds at most T rows,
so 'gemv' (decode compiled for T <= 16) loads 16-row A boxes instead of 64. 'slots' (one or two
tokens) runs the experts on the top-k's ids directly (``MoeConfig.slots``: no route and no
permute step before the expert weights stream; an expert two tokens pick streams twice)."""

MOE_TILES: dict[tuple[str, str], dict[str, int]] = {
    # (backend, regime): MoeConfig tile fields. Decode: 64-row tiles (an expert holds a few
    # tokens), narrow gate/up tiles so the touched experts' weights spread over all SMs, the
    # router's 128 expert columns over 8 SMs and its K over 8 ranges (16 in 'slots'; 64 SMs, a
    # few slices each, where one range was a 32-slice latency chain; ``moe_regime_graph``
    # halves the split until it divides the hidden size into whole slices). Prefill: 128-row
    # tiles, wider
    # columns, the routing spread over SMs in chunks of 64 tokens (one task routes 32K slots
    # in ~100 us).
    ("cute", "slots"): dict(
        block_m=64,
        block_n=None,  # fitted to the SMs (``moe_tiles``; 64 where the sizes are not given)
        down_block_n=128,
        router_block_n=16,
        # 16 K ranges: the Qwen3-30B-A3B router (one 128-expert block, for the top-k) is 16
        # tiles of 32 KB (H200, ``moe.py --tokens 1 2 --ab router_split=16 router_split=32``,
        # us: 8 ranges T=1 42.4 / T=2 64.8, 16 ranges 39.5 / 61.4, 32 ranges 39.5 / 61.1)
        router_split=16,
        slots=True,
        fused_combine=True,
        # the router's last partial tile runs the top-k: no top-k phase (H200, Qwen3-30B-A3B
        # block: 42.1 -> 39.7 us at T=1, 63.3 -> 61.6 at T=2; ``moe.py --ab router_topk=off``)
        router_topk=True,
    ),
    ("cute", "gemv"): dict(
        block_m=64, block_n=64, down_block_n=128, router_block_n=16, router_split=8
    ),
    ("cute", "decode"): dict(
        block_m=64, block_n=64, down_block_n=128, router_block_n=16, router_split=8
    ),
    ("cute", "prefill"): dict(
        block_m=128,
        block_n=64,
        down_block_n=128,
        router_block_n=32,
        route_chunk=64,
        combine_block_m=16,
    ),
    ("interpret", "slots"): dict(block_m=16, block_n=32, slots=True, fused_combine=True),
    ("interpret", "gemv"): dict(block_m=16, block_n=32),
    ("interpret", "decode"): dict(block_m=16, block_n=32),
    ("interpret", "prefill"): dict(block_m=16, block_n=32),
}

FUSED_TAIL_MAX_BATCH = 8
"""MegaDecoderLayer: batches up to this run the graph whose q/k/v tail is one phase."""

DECODER_REGIME_LIMITS: dict[str, int | None] = {
    "gemv_tail": FUSED_TAIL_MAX_BATCH,
    "gemv": GEMV_MAX_BATCH,
    "batch": None,
}
""":class:`MegaDecoderLayer`'s regimes in order with the most sequences each serves: the same
tiles up to ``GEMV_MAX_BATCH`` sequences, with the decode step's q/k/v tail as one phase
(:data:`DECODER_REGIME_CONFIG`) up to ``FUSED_TAIL_MAX_BATCH``."""

DECODER_REGIME_CONFIG: dict[str, dict[str, bool]] = {
    "gemv_tail": {"fused_qkv_tail": True},
    "slots": {"fused_qkv_tail": True},
}
"""Regime -> the :class:`cutemk.layers.DecoderConfig` switches its graph sets where the
module's config leaves them None (a value the caller set is kept; None elsewhere is off). The
fused q/k/v tail (the split QKV projection's reduce, ``qk_norm_rope`` and the KV append in one
phase) measured on the H200 (Qwen3-8B, KV 4096, one process, three rounds of rotated order,
``benchmarks/decoder_layer.py --batch 1 4 8 16 --ab fused_append fused_qkv_tail --rounds
3``), three phases / fused tail / qk_norm_rope appending only, us: B=1 148.2 / 142.4 / 146.1,
B=4 168.6 / 162.3 / 166.5, B=8 180.6 / 176.9 / 179.8, B=16 204.6 / 219.8 / 207.9. At 16
sequences the fused tile's longer items delay the attention tiles queued behind them, so the
batches past 8 keep three phases in a graph of their own. A MoE layer's 'slots' regime (one or
two sequences) takes the fused tail too; its 'gemv' regime (3 to 16) keeps three phases."""

DECODER_MOE_CONFIG: dict[str, bool] = {
    "post_norm_in_reduce": True,
    "moe_residual_in_combine": True,
}
"""The :class:`cutemk.layers.DecoderConfig` switches a layer with a MoE block sets in every
decode regime where the module's config leaves them None: o_proj's split reduce writes the
block's normalised rows (no mlp_norm phase) and the combine adds the residual (no add phase).
Measured on the H200 (Qwen3-30B-A3B layer, KV 4096, one process, ``benchmarks/decoder_layer.py
--moe --batch 1 16 64 --quick --ab post_norm_in_reduce+moe_residual_in_combine``), us, off / on:
B=1 98.3 / 90.9, B=16 396.2 / 369.3, B=64 621.8 / 587.3. The prefill graph keeps them off
(not measured there)."""

DECODER_FUSED_REDUCE: dict[tuple[str, str], bool] = {
    ("cute", "gemv_tail"): False,
    ("cute", "gemv"): False,
}
""":class:`MegaDecoderLayer`'s (backend, regime) -> whether its split o_proj (+ residual, the
MLP norm's sums of squares) and down projection (+ residual) reduce in their last partial
tiles (``DecoderConfig.fused_reduce``). Off: measured level with the reduce steps on the H200
(Qwen3-8B, KV 4096, one process, two rounds, us: B=1 143.2 with it / 143.8 without, B=16
207.8 / 207.9; the down projection's alone, separate processes: B=1 148.5 / 149.2, B=16
207.3 / 206.7). ``CUTEMK_SPLIT_REDUCE=tiles`` turns it on (see :func:`split_reduce_in_tiles`)."""

DECODER_MOE_REGIME_LIMITS: dict[str, int | None] = {
    "slots": MOE_REGIME_LIMITS["slots"],
    "gemv": GEMV_MAX_BATCH,
    "batch": None,
}
"""The same for a layer with a sparse MoE block: its first regime runs the block on MegaMoE's
'slots' tiles (the experts on the top-k's ids, no routing step)."""


def regime_starts(limits: dict[str, int | None], max_tokens: int) -> list[tuple[str, int]]:
    """(regime, its smallest token count) of the regimes of ``limits`` (in order, the most
    tokens each serves) that a module of ``max_tokens`` runs."""
    out, lower = [], 0
    for name, limit in limits.items():
        if lower < max_tokens:
            out.append((name, lower + 1))
        lower = limit if limit is not None else lower
    return out


def regime_of(limits: dict[str, int | None], tokens: int) -> str:
    """The first regime of ``limits`` (in order, the most tokens each serves) that takes
    ``tokens``."""
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ValueError(f"a regime serves a positive int of tokens, got {tokens!r}")
    for name, limit in limits.items():
        if limit is None or tokens <= limit:
            return name
    raise ValueError(f"{tokens} tokens are past every regime's limit ({dict(limits)})")


def _regime_limit(limits: dict, regime: str, layer: str) -> int | None:
    """The most tokens ``regime`` serves, or a ValueError naming the regimes there are."""
    if not isinstance(regime, str) or regime not in limits:
        raise ValueError(f"no {layer} regime {regime!r}; known: {list(limits)}")
    return limits[regime]


def mlp_regime_graph(
    hidden: int,
    intermediate: int,
    regime: str,
    dtype: torch.dtype,
    max_tokens: int,
    backend: str = "cute",
    num_sms: int = 132,
) -> Graph:
    """The graph :class:`MegaMLP` compiles for ``regime`` (tiles from :data:`MLP_TILES`,
    splits from :data:`MLP_SPLIT_K`, the decode gate/up width from :func:`wave_fit_width`
    over ``num_sms``), for at most ``max_tokens`` tokens; no weights needed."""
    limit = _regime_limit(REGIME_LIMITS, regime, "MLP")
    expect_positive_int(num_sms, "num_sms")
    limit = max_tokens if limit is None else min(max_tokens, limit)
    (block_m, block_n), down = mlp_tiles(regime, backend)
    split_k = MLP_SPLIT_K.get((backend, regime), 1)
    gate_up_split = split_k[0] if isinstance(split_k, tuple) else split_k
    if backend == "cute" and regime == "decode" and gate_up_split == 1:
        block_n = wave_fit_width(intermediate, -(-limit // block_m), num_sms)
    fuse = split_reduce_in_tiles(MLP_FUSED_REDUCE.get((backend, regime)))
    return mlp_graph(
        sym("T", max=limit),
        hidden,
        intermediate,
        dtype,
        block_m,
        block_n,
        fuse_silu=True,
        down_block=down,
        split_k=split_k,
        fuse_reduce=fuse,
    )


def split_reduce_in_tiles(default: bool | None) -> bool:
    """Whether a regime whose table entry is ``default`` (None: not listed, never) reduces its
    split GEMMs in their tiles: ``CUTEMK_SPLIT_REDUCE=tiles`` / ``step`` override a listed
    entry, for A/B timing. :func:`cutemk.layers.linear` still keeps the reduce step for a GEMM
    the Hopper tile does not run."""
    if default is None:
        return False
    mode = env_choice("CUTEMK_SPLIT_REDUCE", ("tiles", "step"))
    return default if mode is None else mode == "tiles"


MOE_TILE_DEFAULTS: dict = {
    f.name: f.default
    for f in dataclasses.fields(MoeConfig)
    if f.name
    not in ("hidden", "intermediate", "num_experts", "top_k", "norm_topk_prob", "router_dtype")
}
"""The tile fields of :class:`MoeConfig` (all but the block's sizes and its router's dtype)
and their defaults: :func:`moe_tiles` gives every one, so a config built on another's keeps
none of its tiles."""

OPTION_SIZE_MAX = {"block_m": 256, "block_n": 256, "down_block_n": 256, "router_block_n": 256}
"""Largest GEMM tile sizes the options take: no wgmma tile is wider, and the SIMT tile of a
larger one would take minutes to compile."""


def moe_options(options: dict[str, Any] | None, who: str = "options") -> dict[str, Any]:
    """``options`` checked: known tile fields (:data:`MOE_TILE_DEFAULTS`), a bool for a switch, a
    positive int (or None where the field takes it) for a size. A field given either way
    overrides the regime's tiles (:data:`cutemk.regimes.MOE_TILES`), so it is kept (and is
    part of the module's key) even where it repeats them; they pass through ``moe_tiles``' rules,
    and shapes an op refuses are refused when its regime's graph is built."""
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"{who} must be a dict of tile fields, got {type(options).__name__}")
    options = dict(options or {})
    for name, value in options.items():
        if name not in MOE_TILE_DEFAULTS:
            raise ValueError(f"{who}: unknown {name!r}; known: {list(MOE_TILE_DEFAULTS)}")
        check_field_value(MoeConfig, name, value, who)  # the field's type
        if value is None or isinstance(value, bool):
            continue
        if value < 1:
            raise ValueError(f"{who}: {name} must be positive, got {value}")
        if value > OPTION_SIZE_MAX.get(name, value):
            raise ValueError(f"{who}: {name} must be at most {OPTION_SIZE_MAX[name]}, got {value}")
    return options


SLOT_GATE_UP_WIDTHS = (48, 64, 96, 128)
"""Gate/up tile widths the 'slots' regime picks from (:func:`moe_tiles`): one token's top-k
experts are ``top_k * intermediate / width`` tiles, so Qwen3-30B-A3B's 8 x 768 columns are 96
tiles of 64 (36 of 132 SMs idle while the weights stream) or 128 of 48."""


def moe_tiles(
    regime: str,
    hidden: int,
    backend: str = "cute",
    dtype: torch.dtype | None = None,
    *,
    intermediate: int | None = None,
    top_k: int | None = None,
    num_sms: int | None = None,
    overrides: dict | None = None,
) -> dict:
    """Every tile field of :class:`MoeConfig` for a regime's block of ``hidden`` columns:
    :data:`MOE_TILES`' entry over the fields' defaults, the router's K split halved until it
    divides the hidden size into whole slices. The combine stays a step of its own
    (``fused_combine`` off) where the kernel would not run the Hopper tile (``dtype`` not
    bf16 / fp16, or another arch than sm_90a): only that tile has the fused combine. A gate/up
    width of None in the table is fitted: given the block's ``intermediate`` size and
    ``top_k``, the one of :data:`SLOT_GATE_UP_WIDTHS` that fits one token's tiles best in waves
    over ``num_sms`` (default: the H200's 132; :func:`wave_fit_width`); 64 without them. One
    token, not two: at two, 48 columns (256 tiles, two waves) stream as many columns an SM as
    96 (128 tiles, one wave). ``overrides`` (``MegaMoE``'s options) go over the table's entry
    before those rules, so they are held to them too."""
    if (backend, regime) not in MOE_TILES:
        raise ValueError(
            f"no MoE tiles for backend={backend!r}, regime={regime!r}; known: {sorted(MOE_TILES)}"
        )
    if num_sms is not None:
        expect_positive_int(num_sms, "num_sms")
    overrides = moe_options(overrides, "moe_tiles overrides")
    tiles = {**MOE_TILE_DEFAULTS, **MOE_TILES[(backend, regime)], **overrides}
    if tiles["block_n"] is None:
        tiles["block_n"] = 64
        if intermediate and top_k:
            sms = num_sms or H200.num_sms
            tiles["block_n"] = wave_fit_width(intermediate, top_k, sms, SLOT_GATE_UP_WIDTHS)
    split = tiles.get("router_split", 1)
    while split > 1 and hidden % (split * SPLIT_SLICE):  # whole k-slices a range
        split //= 2
    tiles["router_split"] = split
    if tiles.get("fused_combine") and backend == "cute":
        half = dtype in (torch.bfloat16, torch.float16)
        tiles["fused_combine"] = half and pin_arch() == "sm_90a"
    return tiles


def moe_regime_graph(
    hidden: int,
    intermediate: int,
    num_experts: int,
    top_k: int,
    norm_topk_prob: bool,
    regime: str,
    dtype: torch.dtype,
    max_tokens: int,
    backend: str = "cute",
    num_sms: int | None = None,
    options: dict | None = None,
) -> Graph:
    """The graph :class:`MegaMoE` compiles for ``regime`` (tiles from :func:`moe_tiles` for
    ``num_sms`` SMs, routing on logits in ``dtype``, ``options``: :class:`MoeConfig` fields
    over them), for at most ``max_tokens`` tokens; no weights needed."""
    limit = _regime_limit(MOE_REGIME_LIMITS, regime, "MoE")
    if num_sms is not None:
        expect_positive_int(num_sms, "num_sms")
    limit = max_tokens if limit is None else min(max_tokens, limit)
    sizes = {"intermediate": intermediate, "top_k": top_k, "num_sms": num_sms}
    tiles = moe_tiles(regime, hidden, backend, dtype, overrides=options, **sizes)
    cfg = MoeConfig(
        hidden,
        intermediate,
        num_experts,
        top_k,
        norm_topk_prob,
        router_dtype=None,
        **tiles,
    )
    g = moe_graph(sym("T", max=limit), cfg, dtype)
    if backend == "cute" and cfg.fused_combine and not fused_combine_has_tile(g):
        # shapes the fused combine's only (Hopper) tile does not take: the combine step
        g = moe_graph(sym("T", max=limit), dataclasses.replace(cfg, fused_combine=False), dtype)
    return g
