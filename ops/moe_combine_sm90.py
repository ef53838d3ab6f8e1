"""The MoE combine inside the down projection's Hopper GEMM tile (``ops.moe_slot_gemm`` with
``fused_combine``, the slot layout): each pick's row times its weight to fp32 partials, the
pick that completes a token's count sums its k rows in pick order into ``y``. Device functions
of ``ops.gemm_sm90``'s consumers; the barrier and thread counts come from there."""

from __future__ import annotations

import math

import cutlass
from cutlass import Float32, Int32, cute

from cutemk.device.ring import epi_acquire
from cutemk.device.config import CONSUMER_BARRIER
from cutemk.device.sync import claim_last


@cute.jit
def pick_weight(cfg: cutlass.Constexpr, tensors, coord0: Int32, word: Int32) -> Float32:
    """The combine weight of tile ``coord0``'s pick, NaN where its id names no expert."""
    k = cfg.combine_k
    t = coord0 // k
    wt = tensors[3][t, coord0 - t * k].to(Float32)
    if word < 0 or word >= tensors[1].shape[0]:
        wt = Float32(math.nan)
    return wt


@cute.jit
def combine_in_tile(
    cfg: cutlass.Constexpr,
    tensors,
    acc,
    tCcC,
    coord0: Int32,
    coord1: Int32,
    pick_w: Float32,
    ctid: Int32,
    epi_free,
    consumer_threads: cutlass.Constexpr,
    store_threads: cutlass.Constexpr,
):
    """The MoE combine in the down projection's tile (slot layout): tile ``coord0`` is pick
    ``j`` of token ``t`` (``coord0 = t * k + j``, its row is row t of the tile). Its row times
    the pick's weight goes from registers to ``part[t, j]`` (fp32); the consumers meet, thread 0
    counts the pick in ``counts[t, coord1]`` (an acq_rel add: it releases this row and acquires
    the other picks'), and the pick that brings the count to k puts it back to zero and writes
    ``y[t]``'s columns as the k rows summed in pick order (a fixed order: bit-identical runs),
    plus the residual's (``cfg.residual``: the op's tensor 4) before the one rounding.
    The storer's release after the consumers' barrier publishes ``y`` with the task's notify.
    The staging buffer is taken and given back as every ring tile does (it is not written).
    ``consumer_threads``: the consumers' barrier count (``CONSUMER_BARRIER``); ``store_threads``:
    the staging buffer's barrier count (consumers and storer)."""
    epi_acquire(epi_free, store_threads)
    k = cfg.combine_k
    o = 4 + int(cfg.residual)  # the outputs follow the residual (T, N) where there is one
    mY, mPart, mCnt = tensors[o], tensors[o + 1], tensors[o + 2]
    t = coord0 // k
    j = coord0 - t * k
    c0 = coord1 * cfg.bn
    cols = mY.shape[1]
    for i in cutlass.range(cute.size(acc), unroll_full=True):
        r, c = tCcC[i]
        if r == t and c0 + c < cols:
            mPart[t, j, c0 + c] = acc[i] * pick_w
    ptr = mCnt.iterator + (t * mCnt.shape[1] + coord1)
    if claim_last(ptr, Int32(k), ctid, CONSUMER_BARRIER, consumer_threads):
        vec = 4  # fp32 partials a thread loads at once (16 bytes; H % 4 == 0 is checked)
        p_tok = cute.assume(mPart.stride[0], divby=vec)
        p_pick = cute.assume(mPart.stride[1], divby=vec)
        p4 = cute.make_tensor(
            mPart.iterator,
            cute.make_layout((mPart.shape[0], k, cols // vec, vec), stride=(p_tok, p_pick, vec, 1)),
        )
        y_row = cute.assume(mY.stride[0], divby=vec)
        y4 = cute.make_tensor(
            mY.iterator,
            cute.make_layout((mY.shape[0], cols // vec, vec), stride=(y_row, vec, 1)),
        )
        r4 = y4
        if cutlass.const_expr(cfg.residual):
            mR = tensors[4]
            r_row = cute.assume(mR.stride[0], divby=vec)
            r4 = cute.make_tensor(
                mR.iterator,
                cute.make_layout((mR.shape[0], cols // vec, vec), stride=(r_row, vec, 1)),
            )
        for cv in range(ctid, cfg.bn // vec, consumer_threads):
            w = c0 // vec + cv
            if w < cols // vec:
                rows = []
                for jj in cutlass.range_constexpr(k):
                    v = cute.make_rmem_tensor((vec,), Float32)
                    cute.autovec_copy(p4[t, jj, w, None], v)
                    rows.append(v)
                res = cute.make_rmem_tensor((vec,), mY.element_type)
                if cutlass.const_expr(cfg.residual):
                    cute.autovec_copy(r4[t, w, None], res)
                out = cute.make_rmem_tensor((vec,), mY.element_type)
                for e in cutlass.range_constexpr(vec):
                    s = rows[0][e]
                    for jj in cutlass.range_constexpr(1, k):
                        s = s + rows[jj][e]
                    if cutlass.const_expr(cfg.residual):
                        s = s + res[e].to(Float32)
                    out[e] = s.to(mY.element_type)
                cute.autovec_copy(out, y4[t, w, None])
