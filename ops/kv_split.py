"""How decode attention splits each sequence's keys and values over tiles (flash-decoding).

A fixed number of KV ranges per (sequence, KV head), each a share of the sequence's *live*
length, instead of a fixed number of tokens per tile: every tile that exists has about the same
work whatever the lengths, and the tile count follows the batch, not the cache's capacity.

- **Count.** At batch ``B`` with ``Hkv`` KV heads, ``c = target_tiles // (B * Hkv)`` and a
  sequence is split into ``S(B) = min(splits, max(1, c))`` ranges, except that ``c = 2`` gives
  one (``split_count``: with two tiles an SM, two ranges would only cut the same time into two
  waves). One sequence spreads over many SMs; a large batch fills them with one range a
  (sequence, head) and no merge work. ``B`` is bound when a plan is built, so the task grid is ``(B, Hkv *
  S(B))``; the device evaluates the same expression from the live batch.
- **Range.** Tile ``s`` of a sequence of length ``n`` takes tokens ``[s * c, min(n, (s + 1) *
  c))`` with ``c = align * ceil(ceil(n / S) / align)`` (``span``): ranges are whole multiples
  of ``align`` tokens (the Hopper tile's 64-token ring slice), so short sequences have fewer
  than ``S`` tiles and the rest do not exist (data decides, at run time).

The host functions here and their device twins (``device_*``) must agree exactly: the planner,
the interpreter and the kernel decide the same tiles.
"""

from __future__ import annotations

import math

import cutlass
from cutlass import Float32, Int32, cute

from cutemk.device.sync import claim_last
from cutemk.symbolic import IntLike, smax, smin

SPLITS = 16
"""Most ranges a (sequence, KV head) is split into (one sequence: 16 x 8 KV heads = 128 tiles
of the 132 SMs)."""
TARGET_TILES = 264
"""Tiles the count aims for: two per SM of an H200 (a second wave evens out the SMs' rates)."""
ALIGN = 64
"""Tokens a range is a multiple of."""


def split_count(batch: IntLike, kv_heads: int, splits: int, target_tiles: int) -> IntLike:
    """Ranges per (sequence, KV head) at ``batch`` sequences (symbolic where ``batch`` is)."""
    c = target_tiles // (batch * kv_heads)
    is_two = smin(1, smax(0, c - 1)) - smin(1, smax(0, c - 2))  # [c == 2] with min / max
    return smin(splits, smax(1, c - is_two))


def span(length: int, count: int, align: int) -> int:
    """Tokens of one range of a sequence of ``length`` (>= 1) tokens split ``count`` ways."""
    per = -(-length // count)
    return -(-per // align) * align


def ranges_of(length: int, count: int, align: int) -> int:
    """Ranges (tiles) that exist for a sequence of ``length`` tokens (0 for length < 1)."""
    if length < 1:
        return 0
    return -(-length // span(length, count, align))


def check_policy(splits: int, target_tiles: int, align: int, what: str) -> None:
    for name, v in (("splits", splits), ("target_tiles", target_tiles), ("align", align)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{what} {name} must be a positive int, got {v!r}")


@cute.jit
def device_split_count(
    batch: Int32,
    kv_heads: cutlass.Constexpr,
    splits: cutlass.Constexpr,
    target_tiles: cutlass.Constexpr,
) -> Int32:
    c = Int32(target_tiles) // (batch * kv_heads)
    if c == 2:
        c = Int32(1)
    return cute.min(Int32(splits), cute.max(Int32(1), c))


@cute.jit
def device_span(length: Int32, count: Int32, align: cutlass.Constexpr) -> Int32:
    """``span`` for ``length`` >= 0 (0 gives 0)."""
    per = (length + count - 1) // count
    return (per + align - 1) // align * align


@cute.jit
def device_tile_span(
    batch: Int32,
    coord1: Int32,
    length: Int32,
    kv_heads: cutlass.Constexpr,
    splits: cutlass.Constexpr,
    target_tiles: cutlass.Constexpr,
    align: cutlass.Constexpr,
):
    """(KV head, range, first token, end token, ranges of the sequence) of tile ``(b,
    coord1)`` of a sequence of ``length`` tokens (0: a bad length, no range)."""
    count = device_split_count(batch, kv_heads, splits, target_tiles)
    c = device_span(length, count, align)
    s = coord1 % count
    t0 = s * c
    ranges = Int32(0)
    if c > 0:
        ranges = (length + c - 1) // c
    return coord1 // count, s, t0, cute.min(t0 + c, length), ranges


# -- merging the ranges: the last range of a (sequence, KV head) to finish merges them all ----
@cute.jit
def store_range(mOut, mPO, mPML, b, hq, s, dim, head_dim: cutlass.Constexpr, ranges, acc, tot, mm):
    """Range ``s``'s result for (query head ``hq``, ``dim``): the output itself where the
    sequence has one range (or a bad length, none: 0 / 0 is NaN), else its partial."""
    if ranges <= 1:
        mOut[b, hq * head_dim + dim] = (acc / tot).to(mOut.element_type)
    else:
        mPO[b, hq, s, dim] = acc
        if dim == 0:
            mPML[b, hq, s, 0] = mm
            mPML[b, hq, s, 1] = tot


@cute.jit
def claim_merge(
    mCnt,
    b: Int32,
    h: Int32,
    kv_heads: cutlass.Constexpr,
    ranges,
    tid,
    barrier_id: cutlass.Constexpr,
    threads: cutlass.Constexpr,
):
    """After this CTA's partial stores (every thread, then named barrier ``barrier_id`` of the
    ``threads`` calling): count its range in ``merges[b, h]``; True where it was the last one
    (the count then goes back to zero for the next launch). The acq_rel add releases this
    range's partials and acquires the others' for the merge that follows."""
    ptr = mCnt.iterator + (b * kv_heads + h)
    return claim_last(ptr, ranges, tid, barrier_id, threads)


@cute.jit
def merge_ranges(
    mPO,
    mPML,
    mOut,
    b: Int32,
    h: Int32,
    group: cutlass.Constexpr,
    head_dim: cutlass.Constexpr,
    splits: cutlass.Constexpr,
    ranges: Int32,
    tid,
    nthreads: cutlass.Constexpr,
):
    """``out[b]``'s dims of the G query heads of KV head h from the sequence's ``ranges``
    (<= ``splits``) partials, merged in range order (a fixed order: bit-identical runs). A
    thread's loads for one output are issued before their use (the loops over ranges are
    unrolled up to ``splits``); outputs follow one another, ``group * head_dim / nthreads``
    round trips (a merging tile took ~13 us more than its siblings at G = 8, 16 ranges, in a
    B=1 trace on the H200; :func:`merge_ranges_batched`, faster there, is the default where
    the split fits it)."""
    for k in cutlass.range_constexpr(-(-group * head_dim // nthreads)):
        idx = tid + k * nthreads
        if idx < group * head_dim:
            hq = h * group + idx // head_dim
            dim = idx % head_dim
            ms = cute.make_rmem_tensor((splits,), Float32)
            ls = cute.make_rmem_tensor((splits,), Float32)
            os = cute.make_rmem_tensor((splits,), Float32)
            for s in cutlass.range_constexpr(splits):
                ms[s] = Float32(-math.inf)
                ls[s] = Float32(0.0)
                os[s] = Float32(0.0)
                if s < ranges:
                    ms[s] = mPML[b, hq, s, 0]
                    ls[s] = mPML[b, hq, s, 1]
                    os[s] = mPO[b, hq, s, dim]
            mm = ms[0]
            for s in cutlass.range_constexpr(1, splits):
                mm = cute.arch.fmax(mm, ms[s])
            acc = Float32(0.0)
            tot = Float32(0.0)
            for s in cutlass.range_constexpr(splits):
                f = cute.math.exp2(ms[s] - mm, fastmath=True)  # 0 past the ranges
                acc = acc + os[s] * f
                tot = tot + ls[s] * f
            mOut[b, hq * head_dim + dim] = (acc / tot).to(mOut.element_type)


MERGE_CHUNK = 8
"""Ranges whose partials :func:`merge_ranges_batched` has in flight at once (4 registers a
range: 8 keep a decoder layer's kernel at its spills without the merge)."""


def batched_merge_fits(head_dim: int, splits: int) -> bool:
    """Whether :func:`merge_ranges_batched` takes these shapes: ``splits`` a power of two of at
    most a warp (a head's ranges reduce over aligned lanes by shuffles; the caller's threads
    are whole warps), whole 16-byte vectors of a partial row."""
    return 1 <= splits <= 32 and splits & (splits - 1) == 0 and head_dim % 4 == 0


@cute.jit
def merge_ranges_batched(
    mPO,
    mPML,
    mOut,
    b: Int32,
    h: Int32,
    group: cutlass.Constexpr,
    head_dim: cutlass.Constexpr,
    splits: cutlass.Constexpr,
    ranges: Int32,
    tid,
    nthreads: cutlass.Constexpr,
    sF,
    sL,
    sync,
):
    """:func:`merge_ranges` with fewer and wider loads (the same result for finite partials).
    The one-pass merge takes one round trip per ``nthreads`` outputs, each thread loading
    every range's (m, l) again with each output's 4-byte partials (48 loads an output at 16
    ranges); here (1) lane ``(g, s)`` loads range s's (m, l) of query head g once, the G
    heads' maxima reduce over aligned lanes, and each range's factor ``exp2(m - max)`` (0 past
    ``ranges``) and l go to shared memory ``sF`` / ``sL`` (``group * splits`` fp32 each);
    ``sync`` (a barrier of the ``nthreads`` calling); (2) each thread loads four consecutive
    dims of ``MERGE_CHUNK`` ranges at a time as 16-byte vectors (a range past the sequence's
    clamped to its last, its factor 0: a finite partial adds a zero) and sums them in range
    order."""
    gs = group * splits
    for k in cutlass.range_constexpr(-(-gs // nthreads)):
        i = tid + k * nthreads
        g = cute.min(i, gs - 1) // splits
        s = i % splits
        hq = h * group + g
        m = Float32(-math.inf)
        ml = mPML[b, hq, cute.min(s, ranges - 1), 0]
        ll = mPML[b, hq, cute.min(s, ranges - 1), 1]
        lv = Float32(0.0)
        if s < ranges:
            m = ml
            lv = ll
        mm = m
        for j in cutlass.range_constexpr(int(math.log2(splits))):
            mm = cute.arch.fmax(mm, cute.arch.shuffle_sync_bfly(mm, 1 << j))
        if i < gs:
            sF[i] = cute.math.exp2(m - mm, fastmath=True)  # 0 past the ranges
            sL[i] = lv
    sync()
    nv = head_dim // 4  # 16-byte vectors of a partial row (the caller checks head_dim % 4)
    vecs = group * nv
    # part_o is contiguous (B, Hq, splits, D) (live launches keep the allocated strides):
    # strides that are multiples of head_dim make every vector provably 16-byte aligned
    hq_all = mPO.shape[1]
    po = cute.make_tensor(
        mPO.iterator,
        cute.make_layout(
            (mPO.shape[0], hq_all, splits, nv, 4),
            stride=(hq_all * splits * head_dim, splits * head_dim, head_dim, 4, 1),
        ),
    )
    # runtime loops: a chunk of one output vector's partials in flight at a time (vector
    # loads from one base), never more (the registers of a decoder layer's kernel); only the
    # chunks the sequence's ranges reach (a range past them, clamped to its last, adds f = 0)
    chunk = min(splits, MERGE_CHUNK)
    for k in cutlass.range(-(-vecs // nthreads), unroll=1):
        v = tid + k * nthreads
        if v < vecs:
            g = v // nv
            hq = h * group + g
            acc = cute.make_rmem_tensor((4,), Float32)
            acc.fill(0.0)
            for c in cutlass.range((ranges + chunk - 1) // chunk, unroll=1):
                parts = []
                for j in cutlass.range_constexpr(chunk):
                    pv = cute.make_rmem_tensor((4,), Float32)
                    s = cute.min(c * chunk + j, ranges - 1)
                    cute.autovec_copy(po[b, hq, s, v % nv, None], pv)
                    parts.append(pv)
                for j in cutlass.range_constexpr(chunk):
                    f = sF[g * splits + c * chunk + j]
                    for e in cutlass.range_constexpr(4):
                        acc[e] = acc[e] + parts[j][e] * f
            tot = Float32(0.0)
            for s in cutlass.range_constexpr(splits):
                tot = tot + sL[g * splits + s] * sF[g * splits + s]
            for e in cutlass.range_constexpr(4):
                mOut[b, hq * head_dim + (v % nv) * 4 + e] = (acc[e] / tot).to(mOut.element_type)
