"""Qwen3 layers as cutemk graphs, built once over a symbolic token count.

Weight layouts follow Hugging Face Qwen3: linear weights are (out_features, in_features);
the MLP's gate and up projections are stacked as one (2*I, H) ``w_gate_up`` = cat(gate, up);
MoE expert weights are stacked per expert: ``w_gate_up`` (E, 2*I, H), ``w_down`` (E, H, I).
The plain-torch references below are the ground truth the tests compare against. The MoE
block (:class:`MoeConfig`, :func:`moe_graph`, :func:`moe_block`, :func:`moe_reference`) is in
:mod:`cutemk.moe_layers` and importable from here.

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

# the MoE block lives in its own module; its names stay importable from here
from cutemk.moe_layers import (  # noqa: F401
    ROUTER_BLOCK_N,
    ROUTER_TOPK_MAX_ROWS,
    MoeConfig,
    moe_block,
    moe_graph,
    moe_reference,
)
from cutemk.ops import kv_split
from cutemk.symbolic import Sym, upper
from cutemk.tileop import (
    check_field_types,
    check_positive_fields,
    expect_positive_int,
    expect_positive_sizes,
)

SPLIT_BLOCK_N = 256
"""Columns of a split-K partial tile where the split is given (``linear``; a chosen split
picks its width too): one 256-row weight box a slice (wide boxes stream best)."""


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
    expect_positive_sizes(block_m=block_m, block_n=block_n)
    if split_block_n is not None:  # 0 or negative was replaced by the default, silently
        expect_positive_int(split_block_n, "linear split_block_n")
    for flag, v in (("sumsq", sumsq), ("reduce", reduce), ("fuse_reduce", fuse_reduce)):
        if not isinstance(v, bool):
            raise TypeError(f"linear {flag} must be True or False, got {v!r}")
    if out_norm is not None:
        if sumsq or not reduce:
            raise GraphError(f"linear {name}: out_norm takes neither sumsq nor reduce=False")
        if out_norm_eps is None or not out_norm_eps > 0:
            raise ValueError(f"linear {name}: out_norm needs out_norm_eps > 0")
        if out_norm.spec.dtype != x.spec.dtype:
            raise TypeError(f"linear {name}: out_norm must be {x.spec.dtype}")
        if not ops.out_norm_fits(w.spec.shape[0], x.spec.dtype, epilogue):
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
    if out_norm is not None:  # the reduce node is kept for the norm (no fuse_reduce) if it fits
        if ops.out_norm_fits(n_rows, x.spec.dtype, epilogue, split_k):
            fuse_reduce = False
        else:
            out_norm = None
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
    kw = {
        "epilogue": epilogue,
        "norm_eps": norm_eps,
        "norm_width": norm_width,
        "out_dtype": x.spec.dtype,
    }
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
    expect_positive_sizes(
        hidden=hidden, intermediate=intermediate, block_m=block_m, block_n=block_n
    )
    for flag, v in (("fuse_silu", fuse_silu), ("fuse_reduce", fuse_reduce)):
        if not isinstance(v, bool):  # "no" fused
            raise TypeError(f"mlp_graph {flag} must be True or False, got {v!r}")
    for what, pair in (("down_block", down_block), ("split_k", split_k)):
        if isinstance(pair, tuple) and len(pair) != 2:
            raise ValueError(f"mlp_graph {what} must be a pair, got {pair!r}")
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


# -- plain torch references (fp32) -----------------------------------------------------------
def mlp_reference(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    x, w_gate_up, w_down = x.float(), w_gate_up.float(), w_down.float()
    gate, up = (x @ w_gate_up.T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w_down.T


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
    # finite partials, up to the sign of a zero; the split count a power of two up to 32).
    # None: wherever the Hopper tile takes it (measured faster than the one-pass merge on the
    # H200 at every case of ``benchmarks/attention.py``); False: the one-pass merge
    attention_merge_batched: bool | None = None
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
    # rows a tile), so there is no mlp_norm phase and no hand-over to it; None: off in a graph
    # built from this config directly, on in MegaDecoderLayer's decode regimes
    # (``cutemk.regimes.DECODER_MOE_CONFIG``)
    post_norm_in_reduce: bool | None = None
    # with a MoE block: its combine adds the residual (``moe_block(residual=...)``, the sum and
    # the add rounded once), so a decode or prefill step has no add phase and no hand-over to
    # it; None: as ``post_norm_in_reduce`` (on in MegaDecoderLayer's decode regimes, off in
    # its prefill graph and in a graph built from this config directly)
    moe_residual_in_combine: bool | None = None
    # with a MoE block: the router's last partial tile runs the top-k (``MoeConfig.router_topk``
    # over the tiles MegaDecoderLayer takes from MegaMoE's regimes); None: as those tiles say
    # (on in the 'slots' regime, :data:`cutemk.regimes.MOE_TILES`), True / False: forced
    moe_router_topk: bool | None = None

    def __post_init__(self) -> None:
        check_field_types(self, "DecoderConfig")
        check_positive_fields(self, "DecoderConfig")


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
    expect_positive_sizes(
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
