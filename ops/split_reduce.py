"""The split-K reduce: its arithmetic on one vector of an output row, shared by the reduce
step (``ops.gemm_split_reduce``) and the last partial tile of a split group (``ops.gemm_split``
on the Hopper tile), so both sum the ranges in range order and apply the epilogue in one order
of operations (the same bits); and that last tile's reduce (:func:`reduce_last_tile`).

The vector functions are plain functions of traced values (inlined where a kernel calls them):
``p4`` is the partials viewed as (split, rows, vectors, vec) fp32, a vector is ``vec``
consecutive columns.
"""

from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, cute

from cutemk.device.config import CONSUMER_BARRIER, WARP_SIZE
from cutemk.device.select import warp_topk_softmax
from cutemk.device.sync import claim_last

REDUCE_VEC = 4
"""fp32 partials a thread of the in-tile reduce loads at once (16 bytes)."""
SS_WIDTH = WARP_SIZE * REDUCE_VEC
"""Columns of one sum of squares the in-tile reduce writes: one warp's vectors of a row."""


def load_ranges(p4, splits: int, row, cv, vec: int, up=None) -> tuple[list, list]:
    """Vector ``cv`` of ``row`` from each of the ``splits`` ranges (fp32 registers), and with
    ``up`` (a ``silu_mul`` GEMM: the up half's first vector) vector ``up + cv`` too; every
    load is issued before any use."""
    gates, ups = [], []
    for s in range(splits):
        g = cute.make_rmem_tensor((vec,), Float32)
        cute.autovec_copy(p4[s, row, cv, None], g)
        gates.append(g)
        if up is not None:
            u = cute.make_rmem_tensor((vec,), Float32)
            cute.autovec_copy(p4[s, row, up + cv, None], u)
            ups.append(u)
    return gates, ups


def reduce_vector(gates: list, ups: list, out, vec: int, scale=None, res=None):
    """``out[e]`` = the epilogue of the ranges' sum, rounded once to ``out``'s dtype: the sum
    in range order, times ``scale`` (a folded RMSNorm's row scale) where given, ``silu(gate) *
    up`` where ``ups`` holds the up half (its sum scaled the same), ``+ res[e]`` where a
    residual vector is given. Returns ``out``."""
    for e in range(vec):
        acc = gates[0][e]
        for s in range(1, len(gates)):
            acc = acc + gates[s][e]
        if scale is not None:
            acc = acc * scale
        if ups:
            up = ups[0][e]
            for s in range(1, len(ups)):
                up = up + ups[s][e]
            if scale is not None:
                up = up * scale
            acc = acc / (Float32(1.0) + cute.math.exp(-acc)) * up
        if res is not None:
            acc = acc + res[e].to(Float32)
        out[e] = acc.to(out.element_type)
    return out


def add_squares(out, vec: int, sq):
    """``sq`` plus the squares of ``out``'s values as stored (rounded to its dtype), in order:
    a row's sum of squares for the next GEMM's folded norm."""
    for e in range(vec):
        stored = out[e].to(Float32)
        sq = sq + stored * stored
    return sq


@cute.jit
def reduce_last_tile(
    cfg: cutlass.Constexpr,
    tensors,
    coord0: Int32,
    coord1: Int32,
    ctid,
    nthreads: cutlass.Constexpr,
):
    """A ``gemm_split`` tile's reduce (the Hopper tile, ``ops.gemm_sm90``; ``cfg`` its
    ``Sm90GemmConfig``, ``tensors`` (A, B, [R,] C, part, counts[, SS][, weights, ids])): after
    its partial is
    out, tile (coord0, coord1) counts itself in ``counts[coord0, j]`` (j: its output column
    block; a gate / up pair shares one), and the group's last tile (``claim_last`` on
    the consumers' barrier of ``nthreads`` threads: the acq_rel count releases this
    partial and acquires the others') sums the ``split`` ranges of its rows and columns in range
    order (:func:`reduce_vector`: the reduce step's bits) and applies the epilogue, 4 columns a
    thread, every consumer thread taking (row, 4 columns) vectors in turn; with
    ``reduce_sumsq`` each warp also sums its row's squares (one ``SS_WIDTH`` group) into SS;
    with ``reduce_topk`` (one block of ``SS_WIDTH`` columns: a warp's vectors are a whole
    row, lane l holding columns 4l .. 4l + 3) each warp then runs the row's top-k softmax on
    the values it stored (``cutemk.device.select.warp_topk_softmax``, ``ops.topk_softmax``'s
    arithmetic) into ``weights`` and ``ids``.
    The storer's release after the consumers' barrier publishes C with the task's notify."""
    n_r = int(cfg.reduce == "residual")
    mC, mP, mCnt = tensors[2 + n_r], tensors[3 + n_r], tensors[4 + n_r]
    mSS = tensors[5 + n_r] if cfg.reduce_sumsq else None
    n_ss = int(cfg.reduce_sumsq)
    mW = tensors[5 + n_r + n_ss] if cfg.reduce_topk else None
    mIds = tensors[6 + n_r + n_ss] if cfg.reduce_topk else None
    silu = cfg.reduce == "silu_mul"
    if cutlass.const_expr(cfg.reduce_topk and cfg.bn != SS_WIDTH):
        # the top-k below reads a lane's vector of one row unguarded: one block of 32 vectors
        raise ValueError(f"the reduce's top-k takes one {SS_WIDTH}-column block")
    split = cfg.split
    jj = coord1 // split
    if cutlass.const_expr(silu):  # the up block j + reduce_blocks counts with gate block j
        if jj >= cfg.reduce_blocks:
            jj = jj - cfg.reduce_blocks
    ptr = mCnt.iterator + (coord0 * cfg.reduce_blocks + jj)
    if claim_last(ptr, Int32(cfg.reduce_group), ctid, CONSUMER_BARRIER, nthreads):
        vec = REDUCE_VEC  # N % 4 == 0 is checked
        rows = mC.shape[0]
        cols = mC.shape[1]
        nv = cols // vec
        p_split = cute.assume(mP.stride[0], divby=vec)
        p_row = cute.assume(mP.stride[1], divby=vec)
        p4 = cute.make_tensor(
            mP.iterator,
            cute.make_layout(
                (split, rows, mP.shape[2] // vec, vec), stride=(p_split, p_row, vec, 1)
            ),
        )
        c_row = cute.assume(mC.stride[0], divby=vec)
        c3 = cute.make_tensor(
            mC.iterator, cute.make_layout((rows, nv, vec), stride=(c_row, vec, 1))
        )
        r3 = c3
        if cutlass.const_expr(n_r):
            mR = tensors[2]
            r_row = cute.assume(mR.stride[0], divby=vec)
            r3 = cute.make_tensor(
                mR.iterator, cute.make_layout((rows, nv, vec), stride=(r_row, vec, 1))
            )
        r0 = coord0 * cfg.bm
        tile_v = cfg.bn // vec
        v0 = jj * tile_v
        live = cute.min(rows - r0, Int32(cfg.bm))
        lane = ctid % WARP_SIZE
        # a warp's 32 consecutive q are one row's vectors (tile_v is a multiple of 32 with
        # sums of squares), and every lane of it runs the same trips: its shuffles converge
        for q in range(ctid, live * tile_v, nthreads):
            r = r0 + q // tile_v
            cv = v0 + q % tile_v
            sq = Float32(0.0)
            out = cute.make_rmem_tensor((vec,), mC.element_type)
            if cv < nv:
                gs, us = load_ranges(p4, split, r, cv, vec, nv if silu else None)
                res = None
                if cutlass.const_expr(n_r):
                    res = cute.make_rmem_tensor((vec,), mC.element_type)
                    cute.autovec_copy(r3[r, cv, None], res)
                reduce_vector(gs, us, out, vec, res=res)
                if cutlass.const_expr(cfg.reduce_sumsq):
                    sq = add_squares(out, vec, sq)
                cute.autovec_copy(out, c3[r, cv, None])
            if cutlass.const_expr(cfg.reduce_sumsq):
                tot = cute.arch.warp_reduction_sum(sq)
                first = cv - lane  # the warp's first vector: SS column first // 32
                if lane == 0:
                    if first < nv:
                        mSS[r, first // WARP_SIZE] = tot
            # the warp's row, as stored (rounded): ``sm90_config`` takes the top-k only for one
            # 128-column block (v0 = 0, nv = tile_v = 32: cv is the lane, out always written)
            if cutlass.const_expr(cfg.reduce_topk):
                vals = [out[e].to(Float32) for e in range(vec)]
                ids = [cv * vec + e for e in range(vec)]
                k = cfg.reduce_topk
                w, e = warp_topk_softmax(vals, ids, [True] * vec, k, cfg.reduce_renorm)
                if lane < k:
                    mIds[r, lane] = e.to(mIds.element_type)
                    mW[r, lane] = w.to(mW.element_type)
