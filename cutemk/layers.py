"""Qwen3 layers as cutemk graphs, built once over a symbolic token count.

Weight layouts follow Hugging Face Qwen3: linear weights are (out_features, in_features);
the MLP's gate and up projections are stacked as one (2*I, H) ``w_gate_up`` = cat(gate, up);
MoE expert weights are stacked per expert: ``w_gate_up`` (E, 2*I, H), ``w_down`` (E, H, I).
The plain-torch references below are the ground truth the tests compare against.

This module sits above the core: it imports concrete ops, and no core module imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cutemk import ops
from cutemk.costmodel import H200
from cutemk.device.config import NUM_WARPS
from cutemk.errors import GraphError, ShapeError
from cutemk.graph import Graph
from cutemk.ops import kv_split
from cutemk.symbolic import Sym, upper
from cutemk.tileop import expect_positive_int


@dataclass(frozen=True)
class MoeConfig:
    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool = True
    block_m: int = 16  # grouped row tile (64 or 128 for the Hopper grouped GEMM)
    block_n: int = 32  # columns of the gate/up tile (gate and up each)
    down_block_n: int | None = None  # columns of the down tile (default: block_n)
    # expert columns of a router tile (default: all of them up to ROUTER_BLOCK_N; a tile of
    # 512 experts' logits would need 128 KB of output staging)
    router_block_n: int | None = None
    # dtype of the router logits: fp32, or None for the model's dtype (what Hugging Face's gate
    # Linear yields, so a module built from it routes on the same numbers)
    router_dtype: torch.dtype | None = torch.float32
    # tokens per routing tile: None routes in one task (ops.moe_route), an int spreads the
    # routing over many SMs (ops.moe_route_count / _layout / _place), for large token counts
    route_chunk: int | None = None
    # tokens per combine tile (512 columns each): a few, so small token counts spread over SMs
    combine_block_m: int = 4
    # K ranges of the router GEMM (1: whole rows): split, its fp32 partials go straight to the
    # top-k, which sums them (no reduce phase), so a few tokens' router weight streams over
    # this many times as many SMs
    router_split: int = 1
    # the grouped GEMMs on the slot layout of the top-k's ids (``ops.moe_slot_gemm``): no
    # route and no permute step between the top-k and the expert weights, but an expert is
    # streamed once per (token, pick), so only for a token or two a step (at most block_m)
    slots: bool = False
    # with ``slots``: the combine fused into the down projection's tiles (the last pick of a
    # token's column block sums the k weighted rows; no combine step). Hopper tile only
    fused_combine: bool = False
    # with ``router_split`` > 1: the router's last partial tile of a row block sums the ranges
    # and runs the top-k itself (``ops.gemm_split(topk=k)``: no top-k phase, no hand-over),
    # where the Hopper tile runs it, the experts fill one 128-wide block and the graph has at
    # most ``ROUTER_TOPK_MAX_ROWS`` tokens; else the top-k phase (to measure; off)
    router_topk: bool = False


def _positive(**sizes: int) -> None:
    """Layer sizes are positive ints; the error names the argument (not an op deep inside)."""
    for name, v in sizes.items():
        expect_positive_int(v, name)


SPLIT_BLOCK_N = 256
"""Columns of a split-K partial tile where the split is given (``linear``; a chosen split
picks its width too): one 256-row weight box a slice (wide boxes stream best)."""

ROUTER_BLOCK_N = 64
"""Default expert columns of a router GEMM tile (``MoeConfig.router_block_n``)."""


def fold_norm(w: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """``w diag(norm_weight)`` in ``w``'s dtype (the product taken in fp32, rounded once): the
    weight of a projection that reads ``rmsnorm(x) * norm_weight``, to be applied to the
    weightless norm (``linear(..., norm_eps=)``)."""
    if norm_weight.shape != (w.shape[-1],):
        raise ValueError(
            f"norm weight {tuple(norm_weight.shape)} does not match w {tuple(w.shape)}"
        )
    return (w.float() * norm_weight.float()).to(w.dtype)


def fold_decoder_norms(w: dict[str, torch.Tensor], moe: bool = False) -> dict[str, torch.Tensor]:
    """A decoder layer's weights (``input_norm``, ``post_norm`` and the projections, as
    :func:`decoder_layer_graph` takes them unfolded) for the graph with
    ``DecoderConfig.fold_norms``: the input norm folded into ``w_qkv`` and, for a dense MLP,
    the post-attention norm into ``w_gate_up`` (a MoE layer keeps ``post_norm``: its router
    reads the normalised rows)."""
    out = dict(w)
    out["w_qkv"] = fold_norm(out["w_qkv"], out.pop("input_norm"))
    if not moe:
        out["w_gate_up"] = fold_norm(out["w_gate_up"], out.pop("post_norm"))
    return out


def linear(
    g: Graph,
    x,
    w,
    r=None,
    *,
    block_m: int,
    block_n: int,
    epilogue: str | None = None,
    split_k: int | None = 1,
    split_block_n: int | None = None,
    norm_eps: float | None = None,
    norm_sumsq=None,
    sumsq: bool = False,
    reduce: bool = True,
    fuse_reduce: bool = False,
    l2_prefetch: bool = False,
    out_norm=None,
    out_norm_eps: float | None = None,
    name: str | None = None,
):
    """``x @ w^T`` with an optional epilogue (``silu_mul`` on a stacked [W_gate; W_up], or a
    residual ``r``) as one GEMM node, or split along K (``ops.gemm_splitk``): a partial GEMM
    node of ``(block_m, split_block_n)`` tiles named ``name``, then a reduce node
    ``{name}_sum`` applying the epilogue. ``split_k`` None picks the split and (where
    ``split_block_n`` is None) the partial tile width from the sizes (:func:`ops.choose_split`)
    where x has at most ``block_m`` rows (decode); 1 never splits. ``split_block_n`` defaults to
    ``SPLIT_BLOCK_N`` where the split is given.

    ``norm_eps``: ``rmsnorm(x) @ w^T`` for an RMSNorm whose weight is folded into ``w``
    (:func:`fold_norm`). Split, the reduce scales each row by x's inverse RMS (no norm phase);
    otherwise a weightless ``rmsnorm`` node ``{name}_norm`` precedes the GEMM. With
    ``norm_sumsq`` (the ``ss`` another split ``linear`` returned for x) a split reduce takes
    x's row norms from those sums of squares instead of reading x's rows.

    Returns the output value; with ``sumsq``, ``(y, ss)``: ``ss`` the rows' sums of squares of
    y in column blocks where the projection is split (None where it is not), for the folded
    norm of a projection that reads y. ``reduce`` False: where the projection is split, the
    partials (split_k, m, n) fp32 come back instead, the reduce (and a folded norm's row
    scale by ``x``) left to the op that reads them (``ops.qk_norm_rope``); check with
    :func:`is_partial`.

    ``fuse_reduce``: where the projection is split and needs no norm, the last partial tile
    of each output block reduces it (``ops.gemm_split``: no reduce node, no hop; with
    ``sumsq`` it writes the sums of squares too) if the Hopper tile runs it (sm_90a, 16-bit
    operands; with ``silu_mul`` the gate half a whole number of partial tiles); else the
    reduce node as above.

    ``l2_prefetch``: the GEMM tiles prefetch their weight slices into L2 before their events
    (``ops.GemmTile.l2_prefetch``).

    ``out_norm`` (an RMSNorm weight value g (N,), with ``out_norm_eps``): returns ``(y, normed)``,
    ``normed`` = RMSNorm(y) * g written by the split's reduce node (whole rows a tile: no norm
    phase of its own; ``ops.out_norm_fits``), or None where there is no reduce node or it
    cannot take the norm (the caller then adds the norm). Where it can, the reduce node is kept
    for it (no ``fuse_reduce``)."""
    pair = sumsq or out_norm is not None  # (y, ss) or (y, normed) comes back
    if out_norm is not None:
        if sumsq or not reduce:
            raise GraphError(f"linear {name}: out_norm takes neither sumsq nor reduce=False")
        if out_norm_eps is None or not out_norm_eps > 0:
            raise ValueError(f"linear {name}: out_norm needs out_norm_eps > 0")
        if out_norm.spec.dtype != x.spec.dtype:
            raise TypeError(f"linear {name}: out_norm must be {x.spec.dtype}")
        if ops.out_norm_fits(w.spec.shape[0], x.spec.dtype, epilogue):
            fuse_reduce = False
        else:
            out_norm = None  # the caller's norm phase: (y, None)
    if r is not None and epilogue is None:
        epilogue = "residual"
    m_max = upper(x.spec.shape[0])
    n_rows, k = w.spec.shape
    if split_k is None:
        split_k = 1
        if m_max <= block_m and isinstance(k, int) and isinstance(n_rows, int):
            if split_block_n is not None:
                widths = (split_block_n,)
            else:
                widths = ops.SPLIT_WIDTHS
            # the unsplit candidate: tiles as wide as fill the waves best; with a folded norm only
            # where the GEMM's epilogue can apply it (x's sums of squares given, a 16-bit GEMM:
            # the Hopper tile), else it would need a phase of its own. A graph of one row keeps
            # the given width and no folded norm: measured, its weight stream runs faster split
            # along K over every SM (Qwen3-8B MLP: 80.5-82 us against 86.6 unsplit)
            fused = 2 if epilogue == "silu_mul" else 1  # the fused tile: gate and up rows
            unsplit = None
            if m_max == 1:
                unsplit = fused * block_n if norm_eps is None else None
            elif norm_eps is None or _norm_in_epilogue(x, norm_sumsq):
                row_tiles = -(-m_max // block_m)
                block_n = ops.wave_fit_width(n_rows // fused, row_tiles, H200.num_sms)
                unsplit = fused * block_n
            split_k, split_block_n = ops.choose_split(
                m_max, n_rows, k, block_m, unsplit, widths, x.spec.dtype.itemsize
            )
    split_block_n = split_block_n or SPLIT_BLOCK_N
    expect_positive_int(split_k, "linear split_k")
    res = () if r is None else (r,)
    norm = {}
    if norm_eps is not None and split_k == 1:
        if _norm_in_epilogue(x, norm_sumsq):  # each row scaled in the GEMM's epilogue
            res = (*res, norm_sumsq)
            norm = {"norm_width": k, "norm_eps": norm_eps}
        else:
            norm_name = None if name is None else f"{name}_norm"
            x = g.call(ops.rmsnorm, x, eps=norm_eps, block_m=NUM_WARPS, name=norm_name)
        norm_eps = None
    if split_k == 1:
        y = g.call(
            ops.gemm,
            x,
            w,
            *res,
            block_m=block_m,
            block_n=block_n,
            epilogue=epilogue,
            l2_prefetch=l2_prefetch,
            name=name,
            **norm,
        )
        return (y, None) if pair else y
    if fuse_reduce and reduce and norm_eps is None:
        fused = _fused_split(
            x, w, res, split_k, epilogue, block_m, split_block_n, sumsq, l2_prefetch
        )
        if fused is not None:
            out = g.call(fused, x, w, *res, name=name)
            if pair:
                return (out[0], out[3] if sumsq else None)
            return out[0]
    part = g.call(
        ops.gemm_partial,
        x,
        w,
        split_k=split_k,
        block_m=block_m,
        block_n=split_block_n,
        l2_prefetch=l2_prefetch,
        name=name,
    )
    if not reduce:
        if r is not None or epilogue is not None or sumsq or norm_sumsq is not None:
            raise GraphError(f"linear {name}: without its reduce, no epilogue nor sums")
        return part
    reduce_name = None if name is None else f"{name}_sum"
    norm, norm_width = (), None
    if norm_eps is not None:
        norm = (x,) if norm_sumsq is None else (norm_sumsq,)
        norm_width = None if norm_sumsq is None else k
    args = (part, *norm, *res)
    kw = dict(epilogue=epilogue, norm_eps=norm_eps, norm_width=norm_width, out_dtype=x.spec.dtype)
    if out_norm is not None:  # whole rows a tile, a row at a time (see ops.gemm_split_reduce)
        kw.update(block_m=1, out_norm=out_norm.spec, out_norm_eps=out_norm_eps)
        op = ops.gemm_split_reduce(*(v.spec for v in args), **kw)
        return tuple(g.call(op, *args, out_norm, name=reduce_name))
    y = g.call(ops.gemm_split_reduce, *args, **kw, sumsq=sumsq, name=reduce_name)
    if pair and not sumsq:
        return y, None
    return y


def _fused_split(x, w, res, split_k, epilogue, block_m, block_n, sumsq=False, l2_prefetch=False):
    """The ``ops.gemm_split`` op of a split projection, or None where it does not apply (its
    shape checks, or no Hopper tile for it)."""
    try:
        op = ops.gemm_split(
            x.spec,
            w.spec,
            *[v.spec for v in res],
            split_k=split_k,
            epilogue=epilogue,
            block_m=block_m,
            block_n=block_n,
            sumsq=sumsq,
            l2_prefetch=l2_prefetch,
        )
    except (ShapeError, ValueError, TypeError):
        return None
    return op if op.sm90() is not None else None


def is_partial(v) -> bool:
    """Whether ``v`` is a split projection's partials (``linear(..., reduce=False)``)."""
    return v.producer is not None and v.producer.op.name == "gemm_partial"


def _norm_in_epilogue(x, norm_sumsq) -> bool:
    """Whether an unsplit GEMM of ``x`` can apply a folded norm in its epilogue: x's sums of
    squares exist and the GEMM runs on the Hopper tile (16-bit operands)."""
    return norm_sumsq is not None and x.spec.dtype in (torch.bfloat16, torch.float16)


def mlp_graph(
    tokens: Sym,
    hidden: int,
    intermediate: int,
    dtype: torch.dtype = torch.float32,
    block_m: int = 16,
    block_n: int = 32,
    fuse_silu: bool = False,
    down_block: tuple[int, int] | None = None,
    split_k: int | None | tuple[int | None, int | None] = 1,
    fuse_reduce: bool = False,
) -> Graph:
    """Qwen3 MLP: down(silu(x @ W_gate^T) * (x @ W_up^T)). Leaves: x, w_gate_up, w_down.

    ``down_block`` = (block_m, block_n) of the down projection (default: the gate/up blocks):
    the fused gate/up tile holds two accumulators, so it is half as wide as the down tile can
    be at the same register budget. ``split_k`` (see :func:`linear`; None: chosen per GEMM)
    splits the GEMMs along K, for decode sizes: one value for both, or a pair (gate/up,
    down); ``fuse_reduce``: a split GEMM's last partial tiles reduce it (see :func:`linear`)."""
    _positive(hidden=hidden, intermediate=intermediate, block_m=block_m, block_n=block_n)
    g = Graph("qwen3_mlp")
    x = g.input("x", (tokens, hidden), dtype)
    w_gu = g.weight("w_gate_up", (2 * intermediate, hidden), dtype)
    w_down = g.weight("w_down", (hidden, intermediate), dtype)
    dm, dn = down_block or (block_m, block_n)
    gu_split, down_split = split_k if isinstance(split_k, tuple) else (split_k, split_k)
    if (gu_split, down_split) != (1, 1):
        tiles = {"block_m": block_m, "block_n": block_n, "split_k": gu_split}
        fuse = {"fuse_reduce": fuse_reduce}
        act = linear(g, x, w_gu, epilogue="silu_mul", name="gate_up", **tiles, **fuse)
        y = linear(g, act, w_down, block_m=dm, block_n=dn, split_k=down_split, name="down", **fuse)
        g.output(y, "y")
        return g
    if fuse_silu:
        act = g.call(ops.gemm, x, w_gu, block_m=block_m, block_n=block_n, epilogue="silu_mul")
    else:
        h = g.call(ops.gemm, x, w_gu, block_m=block_m, block_n=block_n)
        act = g.call(ops.silu_mul, h, block_m=block_m)
    y = g.call(ops.gemm, act, w_down, block_m=dm, block_n=dn)
    g.output(y, "y")
    return g


def moe_graph(tokens: Sym, cfg: MoeConfig, dtype: torch.dtype = torch.float32) -> Graph:
    """Qwen3-MoE sparse block: gate GEMM -> softmax/top-k -> route -> permute (token rows into
    the grouped layout) -> grouped GEMM gate_up with the fused SiLU*mul -> grouped GEMM down ->
    combine. Leaves: x, w_router, w_gate_up, w_down."""
    _positive(
        hidden=cfg.hidden,
        intermediate=cfg.intermediate,
        num_experts=cfg.num_experts,
        top_k=cfg.top_k,
        block_m=cfg.block_m,
        block_n=cfg.block_n,
        router_split=cfg.router_split,
    )
    if cfg.top_k > cfg.num_experts:
        raise ValueError(f"top_k={cfg.top_k} exceeds num_experts={cfg.num_experts}")
    g = Graph("qwen3_moe")
    x = g.input("x", (tokens, cfg.hidden), dtype)
    g.output(moe_block(g, x, tokens, cfg, dtype), "y")
    return g


def moe_block(g: Graph, x, tokens: Sym, cfg: MoeConfig, dtype: torch.dtype, residual=None):
    """The sparse MoE block of :func:`moe_graph` on value ``x`` (tokens, H) of graph ``g``
    (its weights w_router, w_gate_up, w_down added as leaves); returns its output value, plus
    ``residual`` (a value (tokens, H)) where given: the combine adds it (no add phase)."""
    res = () if residual is None else (residual,)
    e, h, i = cfg.num_experts, cfg.hidden, cfg.intermediate
    w_router = g.weight("w_router", (e, h), dtype)
    w_gu = g.weight("w_gate_up", (e, 2 * i, h), dtype)
    w_down = g.weight("w_down", (e, h, i), dtype)
    router_n = cfg.router_block_n or min(e, ROUTER_BLOCK_N)
    logits_dtype = cfg.router_dtype or dtype
    topk_args = {}
    fused = _router_with_topk(x, w_router, cfg, logits_dtype)
    if fused is not None:
        _, _, _, weights, ids = g.call(fused, x, w_router, name="router")
    elif cfg.router_split == 1:
        logits = g.call(
            ops.gemm,
            x,
            w_router,
            block_m=cfg.block_m,
            block_n=router_n,
            out_dtype=logits_dtype,
            name="router",
        )
    else:  # fp32 partials, summed (and rounded to the logits' dtype) by the top-k
        logits = g.call(
            ops.gemm_partial,
            x,
            w_router,
            split_k=cfg.router_split,
            block_m=cfg.block_m,
            block_n=router_n,
            name="router",
        )
        topk_args = {"logits_dtype": None if logits_dtype == torch.float32 else logits_dtype}
    # a warp per token and a few tokens a tile: one token's picks are a ~2 us chain of shuffles,
    # so tokens go to many SMs rather than one after another through a warp
    if fused is None:
        weights, ids = g.call(
            ops.topk_softmax,
            logits,
            k=cfg.top_k,
            renormalize=cfg.norm_topk_prob,
            block_m=4,
            **topk_args,
        )
    if cfg.slots:
        return _slot_experts(g, x, tokens, cfg, weights, ids, w_gu, w_down, res)
    if cfg.route_chunk is None:
        tile_info, row_token, slot_row, _ = g.call(
            ops.moe_route, ids, num_experts=e, block_m=cfg.block_m
        )
    else:
        counts = g.call(ops.moe_route_count, ids, num_experts=e, chunk=cfg.route_chunk)
        tile_info, _, chunk_base = g.call(
            ops.moe_route_layout,
            counts,
            num_experts=e,
            block_m=cfg.block_m,
            tokens=tokens,
            top_k=cfg.top_k,
        )
        row_token, slot_row = g.call(
            ops.moe_route_place,
            ids,
            chunk_base,
            tile_info,
            num_experts=e,
            block_m=cfg.block_m,
            chunk=cfg.route_chunk,
        )
    # token rows into the grouped layout, so both grouped GEMMs read whole tiles (TMA)
    xp = g.call(ops.moe_permute, x, tile_info, row_token, block_m=cfg.block_m)
    act = g.call(
        ops.moe_grouped_gemm,
        xp,
        w_gu,
        tile_info,
        block_m=cfg.block_m,
        block_n=cfg.block_n,
        epilogue="silu_mul",
        expert_rows=upper(tokens),
        name="experts_gate_up",
    )
    down = g.call(
        ops.moe_grouped_gemm,
        act,
        w_down,
        tile_info,
        block_m=cfg.block_m,
        block_n=cfg.down_block_n or cfg.block_n,
        expert_rows=upper(tokens),
        name="experts_down",
    )
    # a few tokens a tile: the gather is latency bound, so spread it over many SMs
    return g.call(
        ops.moe_combine, down, weights, slot_row, *res, block_m=cfg.combine_block_m, block_n=512
    )


ROUTER_TOPK_MAX_ROWS = 2
"""Most tokens a graph whose router runs the top-k in its last tile may have (the 'slots'
regime's): that tile picks for every row of its plan, where the top-k phase treats the rows
past a live token count as absent (``TileOp.live_rows_inputs``); with one or two tokens a
live count is always its plan's, beyond that the tokens between them would be routed (and
their experts streamed) for nothing."""


def _router_with_topk(x, w_router, cfg: MoeConfig, logits_dtype: torch.dtype):
    """The router op whose last partial tile of a row block also runs the top-k
    (``ops.gemm_split(topk=...)``, ``MoeConfig.router_topk``), or None where it does not apply
    (the switch off, an unsplit router, experts that are not one 128-wide block, a GEMM the
    Hopper tile does not run, or more than ``ROUTER_TOPK_MAX_ROWS`` tokens)."""
    if not cfg.router_topk or cfg.router_split < 2:
        return None
    if upper(x.spec.shape[0]) > ROUTER_TOPK_MAX_ROWS:
        return None
    try:
        op = ops.gemm_split(
            x.spec,
            w_router.spec,
            split_k=cfg.router_split,
            block_m=cfg.block_m,
            block_n=cfg.num_experts,
            out_dtype=logits_dtype,
            topk=cfg.top_k,
            topk_renormalize=cfg.norm_topk_prob,
        )
    except (ShapeError, ValueError, TypeError):
        return None
    return op if op.sm90() is not None else None


def _slot_experts(g: Graph, x, tokens: Sym, cfg: MoeConfig, weights, ids, w_gu, w_down, res=()):
    """The experts and the combine of :func:`moe_block` on the slot layout (``cfg.slots``),
    ``res`` the residual added by the combine (or nothing)."""
    act = g.call(
        ops.moe_slot_gemm,
        x,
        w_gu,
        ids,
        slot_input="tokens",
        block_m=cfg.block_m,
        block_n=cfg.block_n,
        epilogue="silu_mul",
        name="experts_gate_up",
    )
    down_n = cfg.down_block_n or cfg.block_n
    if cfg.fused_combine:
        y, _, _ = g.call(
            ops.moe_slot_gemm,
            act,
            w_down,
            ids,
            weights,
            *res,
            slot_input="slots",
            block_m=cfg.block_m,
            block_n=down_n,
            name="experts_down",
        )
        return y
    down = g.call(
        ops.moe_slot_gemm,
        act,
        w_down,
        ids,
        slot_input="slots",
        block_m=cfg.block_m,
        block_n=down_n,
        name="experts_down",
    )
    return g.call(
        ops.moe_combine,
        down,
        weights,
        ids,
        *res,
        block_m=cfg.combine_block_m,
        block_n=512,
        slot_block_m=cfg.block_m,
        num_experts=cfg.num_experts,
    )


# -- plain torch references (fp32) -----------------------------------------------------------
def mlp_reference(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    x, w_gate_up, w_down = x.float(), w_gate_up.float(), w_down.float()
    gate, up = (x @ w_gate_up.T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w_down.T


def moe_reference(
    x: torch.Tensor,
    w_router: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool = True,
    router_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Token-by-expert loop as in HF Qwen3MoeSparseMoeBlock, in fp32; ``router_dtype`` rounds
    the router logits to that dtype first (as a bf16 router Linear does)."""
    logits = x.float() @ w_router.float().T
    if router_dtype is not None:  # logits rounded as a model-dtype router Linear returns them
        logits = logits.to(router_dtype).float()
    x, w_router, w_gate_up, w_down = (t.float() for t in (x, w_router, w_gate_up, w_down))
    probs = torch.softmax(logits, dim=-1)
    # ties go to the lower expert id (a stable sort; torch.topk's CPU kernel does not promise it)
    w, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    w, ids = w[:, :top_k], ids[:, :top_k]
    if norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    y = torch.zeros_like(x)
    for e in range(w_router.shape[0]):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        gate, up = (x[tok] @ w_gate_up[e].T).chunk(2, dim=-1)
        y.index_add_(0, tok, ((F.silu(gate) * up) @ w_down[e].T) * w[tok, slot, None])
    return y


@dataclass(frozen=True)
class DecoderConfig:
    """A Qwen3 decoder layer (dense MLP) and its paged KV cache, for decode steps."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    page_size: int = 16
    max_pages: int = 256  # pages a sequence may hold: its longest context is their tokens
    max_positions: int = 40960  # rows of the rotary table
    eps: float = 1e-6
    block_m: int = 16  # row tile of the GEMMs and norms
    block_n: int = 32
    # decode attention's split policy (``ops.kv_split``): at most this many KV ranges a
    # (sequence, KV head), each a multiple of ``attention_align`` tokens
    attention_splits: int = kv_split.SPLITS
    attention_align: int = kv_split.ALIGN
    # decode attention's last range merges the ranges in two steps (the factors once per
    # range through shared memory, then a chunk of partials at once; the same result for
    # finite partials, up to the sign of a zero; the split count a power of two up to 32):
    # off until timed against the one-pass merge on the GPU
    attention_merge_batched: bool = False
    # K ranges of the projections (see ``linear``): None picks them per GEMM, 1 never splits
    split_k: int | None = None
    # the RMSNorm weights are folded into the projections after them (``fold_norm``): the
    # graph has no input_norm leaf, w_qkv is fold_norm(w_qkv, input_norm), and (dense MLP)
    # no post_norm leaf, w_gate_up is fold_norm(w_gate_up, post_norm); split projections then
    # apply the norm in their reduce tiles, with no norm phase of their own
    fold_norms: bool = False
    # decode: the q/k norm and rotary phase also sums the split QKV projection's partials
    # and appends k and v to the cache (no reduce phase, no ``kv_append``: two phases and
    # their hand-overs fewer). It pays at small batches only (measured on the H200: -6 us at
    # B=1, +15 us at B=16), so None (off in a graph built from this config directly) lets
    # MegaDecoderLayer decide per regime (``cutemk.regimes.DECODER_REGIME_CONFIG``)
    fused_qkv_tail: bool | None = None
    # decode: qk_norm_rope (on the summed QKV projection) also appends k and v to the cache,
    # so the step has no ``kv_append`` phase and attention waits on one hand-over fewer
    # (implied by ``fused_qkv_tail``)
    fused_append: bool = False
    # the split reduces of o_proj (+ residual, with folded norms the sums of squares the
    # MLP's norm takes) and of the down projection (+ residual) in their last partial tiles
    # (``linear(fuse_reduce=True)``: no reduce phase where the Hopper tile runs it)
    fused_reduce: bool = False
    # decode: the output projection's tiles prefetch all their weight slices into L2 before
    # their events (``linear(l2_prefetch=True)``), while attention leaves HBM mostly idle at a
    # few sequences; the slices the ring then loads come from L2 (to measure; off by default;
    # prefill graphs ignore it)
    o_proj_l2_prefetch: bool = False
    # a decode step whose post-attention norm is not folded (the MoE block): the split o_proj's
    # reduce node also writes the norm of the rows it stores (``linear(out_norm=...)``: whole
    # rows a tile), so there is no mlp_norm phase and no hand-over to it (to measure; off)
    post_norm_in_reduce: bool = False
    # with a MoE block: its combine adds the residual (``moe_block(residual=...)``, the sum and
    # the add rounded once), so a decode or prefill step has no add phase and no hand-over to
    # it (to measure; off)
    moe_residual_in_combine: bool = False
    # with a MoE block: the router's last partial tile runs the top-k (``MoeConfig.router_topk``
    # over the tiles MegaDecoderLayer takes from MegaMoE's regimes; to measure; off)
    moe_router_topk: bool = False


def decoder_layer_graph(
    batch: Sym, cfg: DecoderConfig, dtype: torch.dtype = torch.float32, moe: MoeConfig | None = None
) -> Graph:
    """One decode step of a Qwen3 decoder layer as one graph: RMSNorm -> fused QKV GEMM ->
    per-head q/k norm + rotary -> KV append (in place) -> split-KV paged attention -> output
    projection + residual -> RMSNorm -> gated-SiLU MLP + residual. One token per sequence.

    Leaves: x (B, H), positions (B,), k_cache / v_cache (pages, page_size, Hkv, D),
    page_table (B, max_pages), seq_lens (B,) (counting the new token), then the weights:
    input_norm (H,), w_qkv ((Hq + 2 Hkv) D, H) = cat(q_proj, k_proj, v_proj), q_norm (D,),
    k_norm (D,), cos_sin (max_positions, D) (``ops.rope_table``), w_o (H, Hq D),
    post_norm (H,), w_gate_up (2I, H) = cat(gate, up), w_down (H, I). With ``moe`` (a
    Qwen3-MoE layer) the MLP is the sparse MoE block of :func:`moe_block` plus a residual add,
    its weights w_router (E, H), w_gate_up (E, 2I, H), w_down (E, H, I). With
    ``cfg.fold_norms`` the norm weights are folded into the projections (see
    :class:`DecoderConfig`)."""
    return _decoder_layer(
        Graph("qwen3_decoder_layer_decode"), batch, batch, cfg, dtype, moe, prefill=False
    )


def decoder_prefill_graph(
    tokens: Sym,
    batch: Sym,
    cfg: DecoderConfig,
    dtype: torch.dtype = torch.float32,
    moe: MoeConfig | None = None,
) -> Graph:
    """One prefill step of a Qwen3 decoder layer as one graph: :func:`decoder_layer_graph`'s
    layer over the new tokens of ``batch`` sequences side by side (variable lengths, each after
    a cached prefix or none), the append writing every new token's keys and values
    (``ops.kv_append_varlen``) and causal attention over the pages (``ops.attention_prefill``).

    Leaves: x (T, H), positions (T,) (each token's position in its sequence), k_cache /
    v_cache, page_table (B, max_pages), seq_lens (B,) (counting the new tokens), cu_seqlens
    (B + 1,) (sequence b's rows of x are ``[cu_seqlens[b], cu_seqlens[b + 1])``), then the
    weights as :func:`decoder_layer_graph`'s."""
    return _decoder_layer(
        Graph("qwen3_decoder_layer_prefill"), tokens, batch, cfg, dtype, moe, prefill=True
    )


def _decoder_layer(
    g: Graph,
    tokens: Sym,
    batch: Sym,
    cfg: DecoderConfig,
    dtype: torch.dtype,
    moe: MoeConfig | None,
    prefill: bool,
) -> Graph:
    _positive(
        hidden=cfg.hidden,
        intermediate=cfg.intermediate,
        heads=cfg.heads,
        kv_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        page_size=cfg.page_size,
        max_pages=cfg.max_pages,
    )
    h, d, hq, hkv = cfg.hidden, cfg.head_dim, cfg.heads, cfg.kv_heads
    x = g.input("x", (tokens, h), dtype)
    positions = g.input("positions", (tokens,), torch.int32)
    pages = Sym("pages", min=1, max=1 << 24)
    k_cache = g.input("k_cache", (pages, cfg.page_size, hkv, d), dtype)
    v_cache = g.input("v_cache", (pages, cfg.page_size, hkv, d), dtype)
    page_table = g.input("page_table", (batch, cfg.max_pages), torch.int32)
    seq_lens = g.input("seq_lens", (batch,), torch.int32)
    cu_seqlens = g.input("cu_seqlens", (batch + 1,), torch.int32) if prefill else None
    fold_mlp = cfg.fold_norms and moe is None
    input_norm = None if cfg.fold_norms else g.weight("input_norm", (h,), dtype)
    w_qkv = g.weight("w_qkv", ((hq + 2 * hkv) * d, h), dtype)
    q_norm = g.weight("q_norm", (d,), dtype)
    k_norm = g.weight("k_norm", (d,), dtype)
    cos_sin = g.weight("cos_sin", (cfg.max_positions, d), torch.float32)
    w_o = g.weight("w_o", (h, hq * d), dtype)
    post_norm = None if fold_mlp else g.weight("post_norm", (h,), dtype)
    tiles = {"block_m": cfg.block_m, "block_n": cfg.block_n, "split_k": cfg.split_k}
    # a norm tile is a row per SIMT warp: the rows spread over SMs, each a memory round trip
    norm_rows = NUM_WARPS
    # a decode step's qk_norm_rope may append k and v to the cache itself (``fused_append``:
    # no kv_append phase) and also sum the split projection's partials, the folded norm's row
    # scale too (``fused_qkv_tail``: one phase where there were three)
    fuse = bool(cfg.fused_qkv_tail) and not prefill
    append = (fuse or cfg.fused_append) and not prefill
    a_qkv, norm_eps = x, cfg.eps
    if not cfg.fold_norms:
        a_qkv = g.call(ops.rmsnorm, x, input_norm, eps=cfg.eps, block_m=norm_rows, name="attn_norm")
        norm_eps = None
    qkv = linear(g, a_qkv, w_qkv, **tiles, norm_eps=norm_eps, reduce=not fuse, name="qkv_proj")
    rope = {"heads": hq, "kv_heads": hkv, "eps": cfg.eps}
    if append:
        norm_x = ()
        if fuse:
            # a tile's items are serial on a warp, each ~2 round trips, and it holds its SM
            # ahead of the attention tiles queued there: the fewest tokens a tile that keeps
            # the tiles on at most half the SMs (Qwen3-8B, 12 head blocks: 1 token a tile up
            # to 5 sequences, 2 up to 8, 4 up to 16). Measured at B=8 on the H200: 48 tiles of
            # 2 tokens 176.9 us a step, 96 tiles of 1 token 190.1
            heads_blocks = -(-(hq + 2 * hkv) // ops.QkNormRopeTile.head_block)
            rope["block_m"] = next(
                (
                    bm
                    for bm in (1, 2)
                    if -(-upper(tokens) // bm) * heads_blocks <= H200.num_sms // 2
                ),
                4,
            )
            if is_partial(qkv) and norm_eps is not None:
                norm_x = (x,)
        q, k2, v2 = g.call(
            ops.qk_norm_rope,
            qkv,
            q_norm,
            k_norm,
            cos_sin,
            positions,
            *norm_x,
            k_cache,
            v_cache,
            page_table,
            seq_lens,
            **rope,
            norm_eps=norm_eps if norm_x else None,
            out_dtype=dtype,
        )
    else:
        q, k, v = g.call(ops.qk_norm_rope, qkv, q_norm, k_norm, cos_sin, positions, **rope)
    if prefill:
        k2, v2 = g.call(
            ops.kv_append_varlen, k, v, k_cache, v_cache, page_table, seq_lens, cu_seqlens
        )
        o = g.call(ops.attention_prefill, q, k2, v2, page_table, seq_lens, cu_seqlens)
    else:
        if not append:
            k2, v2 = g.call(ops.kv_append, k, v, k_cache, v_cache, page_table, seq_lens)
        o = g.call(
            ops.attention_decode,
            q,
            k2,
            v2,
            page_table,
            seq_lens,
            splits=cfg.attention_splits,
            align=cfg.attention_align,
            merge_batched=cfg.attention_merge_batched,
        )[0]
    # + residual; folded, its split reduce also hands the MLP's norm h1's sums of squares
    fuse_reduce = cfg.fused_reduce and not prefill
    # the MLP's norm of h1 written by o_proj's reduce node, where it has one
    out_norm = {}
    if cfg.post_norm_in_reduce and not fold_mlp and not prefill:
        out_norm = {"out_norm": post_norm, "out_norm_eps": cfg.eps}
    o_proj = linear(
        g,
        o,
        w_o,
        x,
        **tiles,
        sumsq=fold_mlp,
        fuse_reduce=fuse_reduce,
        l2_prefetch=cfg.o_proj_l2_prefetch and not prefill,
        **out_norm,
        name="o_proj",
    )
    h1, h1_ss, normed = o_proj, None, None
    if fold_mlp:
        h1, h1_ss = o_proj
    elif out_norm:
        h1, normed = o_proj
    if moe is None:
        w_gu = g.weight("w_gate_up", (2 * cfg.intermediate, h), dtype)
        w_down = g.weight("w_down", (h, cfg.intermediate), dtype)
    # folded: the gate/up reduce normalises h1's rows; otherwise a norm phase of its own
    # (unless o_proj's reduce wrote it)
    h2, norm_eps = h1, cfg.eps
    if not fold_mlp:
        h2 = normed
        if h2 is None:
            h2 = g.call(ops.rmsnorm, h1, post_norm, eps=cfg.eps, block_m=norm_rows, name="mlp_norm")
        norm_eps = None
    if moe is not None:
        if cfg.moe_residual_in_combine:
            y = moe_block(g, h2, tokens, moe, dtype, residual=h1)
        else:
            y = g.call(ops.add, moe_block(g, h2, tokens, moe, dtype), h1, name="residual")
    else:
        act = linear(
            g,
            h2,
            w_gu,
            **tiles,
            norm_eps=norm_eps,
            norm_sumsq=h1_ss,
            epilogue="silu_mul",
            name="gate_up",
        )
        # + residual
        y = linear(g, act, w_down, h1, **tiles, fuse_reduce=fuse_reduce, name="down")
    g.output(y, "y")
    return g
