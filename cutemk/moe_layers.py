"""The Qwen3-MoE sparse block as a cutemk graph (router, softmax top-k, routing, grouped
gated-SiLU experts, weighted combine) and its plain-torch reference. Expert weights are stacked
per expert as Hugging Face's 5.x layout: ``w_router`` (E, H), ``w_gate_up`` (E, 2*I, H) =
cat(gate, up) per expert, ``w_down`` (E, H, I). :mod:`cutemk.layers` re-exports all of it and
builds the decoder layer's MoE variant on :func:`moe_block`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cutemk import ops
from cutemk.arch import pin_arch
from cutemk.errors import ShapeError
from cutemk.graph import Graph
from cutemk.symbolic import Sym, upper
from cutemk.tileop import check_field_types, check_positive_fields, expect_positive_sizes


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
    # most ``ROUTER_TOPK_MAX_ROWS`` tokens; else the top-k phase (MegaMoE's 'slots' tiles: on)
    router_topk: bool = False

    def __post_init__(self) -> None:
        check_field_types(self, "MoeConfig")
        check_positive_fields(self, "MoeConfig")


ROUTER_BLOCK_N = 64
"""Default expert columns of a router GEMM tile (``MoeConfig.router_block_n``)."""


def moe_graph(tokens: Sym, cfg: MoeConfig, dtype: torch.dtype = torch.float32) -> Graph:
    """Qwen3-MoE sparse block: gate GEMM -> softmax/top-k -> route -> permute (token rows into
    the grouped layout) -> grouped GEMM gate_up with the fused SiLU*mul -> grouped GEMM down ->
    combine. Leaves: x, w_router, w_gate_up, w_down."""
    expect_positive_sizes(
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
    # so tokens go to many SMs rather than one after another through a warp; past a wave of
    # 4-row tiles, a row for each of the tile's 8 warps (half the tiles, the same chain each)
    if fused is None:
        weights, ids = g.call(
            ops.topk_softmax,
            logits,
            k=cfg.top_k,
            renormalize=cfg.norm_topk_prob,
            block_m=4 if upper(x.spec.shape[0]) <= TOPK_WIDE_FROM else 8,
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


TOPK_WIDE_FROM = 512
"""A block of more tokens than this (the prefill regime's) takes the top-k 8 rows a tile, one
for each warp of its body, where smaller ones take 4 (more tiles, on more SMs)."""

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


def _fused_combine_down(cfg: MoeConfig, act, w_down, ids, weights, res, down_n: int):
    """The slot layout's down projection with the combine in its tiles (``cfg.fused_combine``),
    or None, so the combine stays a step of its own: the switch off or shapes the op refuses
    (whether a kernel's tile takes them is the backend's call: :func:`fused_combine_has_tile`)."""
    if not cfg.fused_combine:
        return None
    try:
        op = ops.moe_slot_gemm(
            act.spec,
            w_down.spec,
            ids.spec,
            weights.spec,
            *(r.spec for r in res),
            slot_input="slots",
            block_m=cfg.block_m,
            block_n=down_n,
        )
    except (ShapeError, ValueError):
        return None
    return op


def fused_combine_has_tile(g: Graph) -> bool:
    """Whether a graph's fused combine (the 'slots' down projection summing the picks, node
    ``experts_down``), if it has one, has a device tile for the target: only the Hopper tile
    runs it, so a kernel for sm_90a needs that tile to take its shapes. A backend-aware
    caller rebuilds the graph with the combine step where this is False."""
    for n in g.nodes:
        if n.name == "experts_down" and getattr(n.op, "combine", None) is not None:
            return pin_arch() == "sm_90a" and n.op.sm90() is not None
    return True


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
    fused = _fused_combine_down(cfg, act, w_down, ids, weights, res, down_n)
    if fused is not None:
        y, _, _ = g.call(fused, act, w_down, ids, weights, *res, name="experts_down")
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
