"""Hopper (sm_90a) device path of the decode attention tile: the paged KV cache streams through
the megakernel's shared-memory ring by TMA; the consumer warps do the split's online softmax.

Decode attention reads every key and value once and does ~4 FLOPs per element per query head,
so it is bound by how many bytes are in flight, not by arithmetic. The portable tile (loads from
registers, a few KB in flight per SM) reaches ~15% of HBM bandwidth; here the producer warp
keeps the ring's slots full (tens of KB per SM, across task boundaries) and the consumers only
read shared memory.

- **Slices.** A tile (b, h, s) takes range s of sequence b (``ops.kv_split``: a multiple of
  ``C`` tokens), ``C`` tokens a ring slot (``C`` = 64, or 32 for one-token pages); how many
  slices a tile streams follows the sequence's live length (``slices_of``), so producer and
  consumers agree on it from the length the producer read. A slot holds the slice's K rows
  then its V rows, ``(C, D)`` each, row-major, as TMA lands them: one box of
  ``R = min(page, C)`` rows per page (a page's rows are strided by the KV heads in the cache;
  the box gathers one head's).
- **Host** (``tma_args``): one descriptor each for K and V over the cache viewed as
  ``(page_size, D, Hkv, pages)`` (the page is a coordinate, like a grouped GEMM's expert).
- **Producer warp** (``load_kv``): lane r reads the page id of box r from the page table and
  the warp issues the boxes. Positions past the sequence and bad page ids get the page
  coordinate ``pages``: the copy engine fills those boxes with zeros and reads no memory. The
  cache is launch input except each sequence's last position (a ``kv_append`` of the launch
  writes it): where the lengths and pages are launch inputs too, the producer decides the
  tile and issues its slices before the task's events (``TileOp.early_exists``), all but the
  slice holding the last position, which follows the events.
- **Consumers** (``compute``, 8 warps; the sequence length comes with the task record, as the
  producer read it): warp w owns rows ``[w * C/8, (w + 1) * C/8)`` of every slice. Scores: 8
  lanes a row, each with D/8 dimensions of the G query heads' q in registers (loaded from global
  memory as the tile starts; 16-byte shared loads of K, chunk order rotated per lane so a
  quarter-warp hits 8 distinct bank groups), reduced by 3 shuffles. Online softmax per warp (max
  by 2 shuffles), the warp's probabilities through 1 KB of shared memory, then P·V with a lane
  holding D/32 dimensions of o for every head. After the last slice the 8 warps' (m, l, o) merge
  through shared memory and the consumers write the output (the sequence's only range) or
  ``part_o`` / ``part_ml`` and count the range in (``ops.kv_split.claim_merge``); the last range
  merges them all. The storer warp has nothing to store and only publishes the tile.
- Bad data: a page id outside the cache anywhere in the tile's valid range makes the tile's
  output NaN (the merge then makes the sequence NaN), as the reference does. Warp 0 reads
  each slice's page ids as the slice starts and checks them one slice later (the load's
  latency hides behind the slice).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass
import torch
from cutlass import BFloat16, Boolean, Float16, Float32, Int32, cute
from cutlass.cute.nvgpu import cpasync

from cutemk.device.config import (
    CONSUMER_BARRIER,
    EPI_EMPTY_BARRIER,
    WARP_SIZE,
    WARPGROUP,
)
from cutemk.device.ring import consumer_release, consumer_wait, plain_wait

from . import kv_split as kvs

CONSUMER_THREADS = 2 * WARPGROUP
CONSUMER_WARPS = CONSUMER_THREADS // WARP_SIZE
STORE_THREADS = CONSUMER_THREADS + WARP_SIZE
ROW_LANES = 8
"""Lanes that share one K row's dot products (each holds D/8 dimensions)."""
ROWS_AT_ONCE = WARP_SIZE // ROW_LANES
MAX_Q_REGS = 128
"""fp32 q values a consumer lane keeps (G * D / 8)."""

_CUTE_DTYPES = {torch.bfloat16: BFloat16, torch.float16: Float16}

# the op's tensors: (q, k_cache, v_cache, page_table, seq_lens) + outputs from T_OUT (out,
# part_o, part_ml, merges) + ``tma_args`` from T_TMA
T_OUT = 5
T_TMA = 9


@dataclass(frozen=True)
class Sm90DecodeConfig:
    group: int  # G: query heads per KV head
    head_dim: int
    page: int  # tokens a page
    kv_heads: int
    splits: int  # the split policy (``ops.kv_split``)
    target_tiles: int
    align: int
    max_tokens: int
    scale_log2: float  # softmax scale * log2(e)
    dtype: torch.dtype

    @property
    def es(self) -> int:
        return self.dtype.itemsize

    @property
    def slice_tokens(self) -> int:
        """Tokens a ring slot: 64 (a 32 KB slot at D = 128), 128 where the ranges are aligned
        to it (the per-slice waits and reductions spread over twice the rows), 32 for
        one-token pages (a box a token)."""
        if self.page == 1:
            return 32
        return 128 if self.align % 128 == 0 and self.head_dim <= 128 else 64

    @property
    def box_rows(self) -> int:
        return min(self.page, self.slice_tokens)

    @property
    def boxes(self) -> int:
        return self.slice_tokens // self.box_rows

    @property
    def slices(self) -> int:
        """Most slices a tile streams (a sequence at the page table's capacity in one range)."""
        return -(-self.max_tokens // self.slice_tokens)

    @property
    def rows_per_warp(self) -> int:
        return self.slice_tokens // CONSUMER_WARPS

    @property
    def passes(self) -> int:
        return self.rows_per_warp // ROWS_AT_ONCE

    @property
    def chunks(self) -> int:
        """16-byte chunks of a lane's part of a K row."""
        return self.head_dim // ROW_LANES * self.es // 16

    @property
    def parts_per_128b(self) -> int:
        return max(1, 128 // (self.head_dim // ROW_LANES * self.es))

    @property
    def pv_dims(self) -> int:
        return self.head_dim // WARP_SIZE

    @property
    def tx_bytes(self) -> int:
        """A slot: the slice's K rows, then its V rows."""
        return 2 * self.slice_tokens * self.head_dim * self.es

    @property
    def slot_bytes(self) -> int:
        return -(-self.tx_bytes // 1024) * 1024

    # epilogue buffer: probabilities (warps, rows, G), (m, l) (warps, G, 2), poison flags
    # (warps,), partial outputs (warps, G, D); fp32
    @property
    def off_ml(self) -> int:
        return CONSUMER_WARPS * self.rows_per_warp * self.group

    @property
    def off_flag(self) -> int:
        return self.off_ml + CONSUMER_WARPS * self.group * 2

    @property
    def off_o(self) -> int:
        return -(-(self.off_flag + CONSUMER_WARPS) // 4) * 4

    @property
    def off_last(self) -> int:
        """One word: whether this tile merges the sequence's ranges."""
        return self.off_o + CONSUMER_WARPS * self.group * self.head_dim

    @property
    def epi_bytes(self) -> int:
        words = self.off_last + 1
        return -(-4 * words // 1024) * 1024


def sm90_decode_config(
    dtype,
    group: int,
    head_dim: int,
    page: int,
    kv_heads: int,
    splits: int,
    target_tiles: int,
    align: int,
    max_tokens: int,
    scale,
) -> Sm90DecodeConfig | None:
    """The Hopper tile's config, or None where its shapes do not fit it (the portable tile
    runs): a 16-bit cache, head dim a multiple of 64 up to 256, a power-of-two page of at most
    256 tokens, ranges aligned to the slice, G * D / 8 q values a lane."""
    if dtype not in _CUTE_DTYPES or head_dim % 64 or head_dim > 256:
        return None
    if page < 1 or page & (page - 1) or page > 256:
        return None
    if group * head_dim // ROW_LANES > MAX_Q_REGS:
        return None
    cfg = Sm90DecodeConfig(
        group,
        head_dim,
        page,
        kv_heads,
        splits,
        target_tiles,
        align,
        max_tokens,
        scale * math.log2(math.e),
        dtype,
    )
    if align % cfg.slice_tokens or cfg.boxes > WARP_SIZE:
        return None
    return cfg


def _page_view(m: cute.Tensor) -> cute.Tensor:
    """(pages, page_size, Hkv, D) -> (page_size, D, Hkv, pages): one head's rows of a page."""
    return cute.make_tensor(
        m.iterator,
        cute.make_layout(
            (m.shape[1], m.shape[3], m.shape[2], m.shape[0]),
            stride=(m.stride[1], m.stride[3], m.stride[2], m.stride[0]),
        ),
    )


def _box_layout(cfg: Sm90DecodeConfig):
    return cute.make_layout((cfg.box_rows, cfg.head_dim), stride=(cfg.head_dim, 1))


def tma_args(cfg: Sm90DecodeConfig, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor) -> tuple:
    """Host side (inside the launch): ``(atom_k, tma_k, atom_v, tma_v)``."""
    load = cpasync.CopyBulkTensorTileG2SOp()
    tile = (cfg.box_rows, cfg.head_dim)
    atom_k, tma_k = cpasync.make_tiled_tma_atom(load, _page_view(mK), _box_layout(cfg), tile)
    atom_v, tma_v = cpasync.make_tiled_tma_atom(load, _page_view(mV), _box_layout(cfg), tile)
    return atom_k, tma_k, atom_v, tma_v


@cute.jit
def tile_span(cfg: cutlass.Constexpr, batch: Int32, coord1: Int32, length: Int32):
    """(KV head, range, first token, end token) of a tile (``ops.kv_split``)."""
    return kvs.device_tile_span(
        batch, coord1, length, cfg.kv_heads, cfg.splits, cfg.target_tiles, cfg.align
    )


@cute.jit
def slices_of(cfg: cutlass.Constexpr, t0: Int32, t1: Int32) -> Int32:
    """Ring slices of tokens [t0, t1): the producer's count (``device_slices``) and the
    consumers' are this one formula."""
    return (t1 - t0 + cfg.slice_tokens - 1) // cfg.slice_tokens


def _slot_ptr(cfg: Sm90DecodeConfig, ring, idx: Int32, slot: int):
    """Typed pointer to ring slot ``idx`` (1024-byte aligned)."""
    ab = _CUTE_DTYPES[cfg.dtype]
    return cute.recast_ptr(ring + idx * slot, dtype=ab).align(1024)


@cute.jit
def load_kv(
    cfg: cutlass.Constexpr,
    tensors,
    coord0: Int32,
    coord1: Int32,
    word: Int32,
    kt: Int32,
    idx,
    bar,
    ring,
    slot: cutlass.Constexpr,
    dependent: cutlass.Constexpr,
):
    """Producer warp: slice ``kt``'s K and V boxes into ring slot ``idx``; ``word`` is the
    sequence length, read once per task. The cache is launch input (``dependent`` False: it
    may be loaded before the task's events) except the slice that holds the sequence's last
    position, which a ``kv_append`` of this launch may write: that slice comes with
    ``dependent`` True. ``tensors``: the op's inputs and outputs + ``tma_args``."""
    h, _, t0, _, _ = tile_span(cfg, tensors[4].shape[0], coord1, word)
    base = t0 + kt * cfg.slice_tokens
    last = base + cfg.slice_tokens >= word  # the slice holds position word - 1
    go = not last
    if cutlass.const_expr(dependent):
        go = last
    if go:
        _slice_boxes(cfg, tensors, coord0, h, base, word, idx, bar, ring, slot)


@cute.jit
def _slice_boxes(cfg: cutlass.Constexpr, tensors, coord0, h, base, word, idx, bar, ring, slot):
    """Lane r reads box r's page id; the warp issues the slice's K and V boxes."""
    mK, mPT = tensors[1], tensors[3]
    atom_k, tma_k, atom_v, tma_v = (tensors[T_TMA + i] for i in range(4))
    lane = cute.arch.lane_idx()
    num_pages = mK.shape[0]
    pos = base + lane * cfg.box_rows
    pg = num_pages  # out of bounds: a zero-filled box, no memory read
    if lane < cfg.boxes and pos < word:
        pg = mPT[coord0, pos // cfg.page]
        if pg < 0 or pg >= num_pages:
            pg = num_pages
    ptr = _slot_ptr(cfg, ring, idx, slot)
    rows = cute.make_layout(
        (cfg.box_rows, cfg.head_dim, cfg.boxes),
        stride=(cfg.head_dim, 1, cfg.box_rows * cfg.head_dim),
    )
    sK = cute.make_tensor(ptr, rows)
    sV = cute.make_tensor(ptr + cfg.slice_tokens * cfg.head_dim, rows)
    _copy_boxes(cfg, atom_k, tma_k, atom_v, tma_v, sK, sV, h, pg, base, bar)


@cute.jit
def _copy_boxes(cfg: cutlass.Constexpr, atom_k, tma_k, atom_v, tma_v, sK, sV, h, pg, base, bar):
    """The slice's K and V boxes (lane r holds box r's page, ``pages`` where it reads none)."""
    blk = (base % cfg.page) // cfg.box_rows  # box index inside its page
    for r in cutlass.range_constexpr(cfg.boxes):
        p_r = cute.arch.shuffle_sync(pg, r)
        if cutlass.const_expr(cfg.boxes > 1):
            blk = ((base + r * cfg.box_rows) % cfg.page) // cfg.box_rows
        _copy_box(cfg, atom_k, tma_k, sK, h, p_r, blk, r, bar)
        _copy_box(cfg, atom_v, tma_v, sV, h, p_r, blk, r, bar)


@cute.jit
def _copy_box(cfg: cutlass.Constexpr, atom, tma, s, h: Int32, page: Int32, blk, r: int, bar):
    """TMA rows ``[blk * R, (blk + 1) * R)`` of KV head ``h`` of ``page`` into box ``r``."""
    g = cute.local_tile(tma[None, None, h, page], (cfg.box_rows, cfg.head_dim), (blk, 0))
    ts, tg = cpasync.tma_partition(
        atom,
        0,
        cute.make_layout(1),
        cute.group_modes(s[None, None, r], 0, 2),
        cute.group_modes(g, 0, 2),
    )
    cute.copy(atom, tg, ts, tma_bar_ptr=bar)


@cute.jit
def compute(
    cfg: cutlass.Constexpr,
    tensors,
    coord0: Int32,
    coord1: Int32,
    word: Int32,
    full,
    empty,
    count: Int32,
    ring,
    stages: cutlass.Constexpr,
    slot: cutlass.Constexpr,
    epi_ptr,
    ctid: Int32,
    wait=plain_wait,
) -> Int32:
    """Consumer warps: the tile's slices ``count ..``, then ``part_o`` / ``part_ml`` written;
    returns the ring count after the tile."""
    mK, mPT, mLen = tensors[1], tensors[3], tensors[4]
    mOut, mPO, mPML, mCnt = (tensors[T_OUT + i] for i in range(4))
    g_n, d, rw = cfg.group, cfg.head_dim, cfg.rows_per_warp
    nch, pv = cfg.chunks, cfg.pv_dims
    ab = _CUTE_DTYPES[cfg.dtype]
    warp = cute.arch.make_warp_uniform(ctid // WARP_SIZE)
    lane = ctid % WARP_SIZE
    grp = lane // ROW_LANES
    part = lane % ROW_LANES
    rot = part // cfg.parts_per_128b
    b = coord0
    # the sequence's length, clamped to the page table (the producer read it)
    h, s, t0, t1, ranges = tile_span(cfg, mLen.shape[0], coord1, word)
    n = slices_of(cfg, t0, t1)
    num_pages = mK.shape[0]
    # a bad page id poisons the tile: thread r < boxes reads box r's id as a slice starts
    # and checks it as the next one starts (the load's latency hides behind the slice)
    pid = Int32(0)
    bad = Boolean(False)

    # q of this lane's dimensions (its chunks in rotated order), in log2 units, from global
    # memory (16-byte loads: q is row-major, its rows 16-byte aligned); the producer acquired
    # its events before handing the task over. Its latency overlaps the first slice's wait.
    mQ = tensors[0]
    gQ = cute.make_tensor(
        mQ.iterator,
        cute.make_layout(
            (mQ.shape[0], g_n * cfg.kv_heads, d // 8, 8),
            stride=(g_n * cfg.kv_heads * d, d, 8, 1),
        ),
    )
    q = cute.make_rmem_tensor((g_n, nch * 8), Float32)
    for g in cutlass.range_constexpr(g_n):
        for c in cutlass.range_constexpr(nch):
            qv = cute.make_rmem_tensor((8,), ab)
            cute.autovec_copy(gQ[b, h * g_n + g, part * nch + (c + rot) % nch, None], qv)
            for e in cutlass.range_constexpr(8):
                q[g, c * 8 + e] = qv[e].to(Float32) * cfg.scale_log2

    m = cute.make_rmem_tensor((g_n,), Float32)
    lsum = cute.make_rmem_tensor((g_n,), Float32)  # this lane's row group's share of l
    o = cute.make_rmem_tensor((g_n, pv), Float32)
    m.fill(-math.inf)
    lsum.fill(0.0)
    o.fill(0.0)

    epi = cute.recast_ptr(epi_ptr, dtype=Float32)
    sP = cute.make_tensor(
        epi, cute.make_layout((CONSUMER_WARPS, rw, g_n), stride=(rw * g_n, g_n, 1))
    )
    sML = cute.make_tensor(
        epi + cfg.off_ml, cute.make_layout((CONSUMER_WARPS, g_n, 2), stride=(g_n * 2, 2, 1))
    )
    sFlag = cute.make_tensor(epi + cfg.off_flag, cute.make_layout(CONSUMER_WARPS))
    sO = cute.make_tensor(
        epi + cfg.off_o, cute.make_layout((CONSUMER_WARPS, g_n, d), stride=(g_n * d, d, 1))
    )
    # the previous ring tile's store has read the staging buffer
    cute.arch.barrier(barrier_id=EPI_EMPTY_BARRIER, number_of_threads=STORE_THREADS)

    for kt in cutlass.range(n, unroll=1):
        if pid < 0 or pid >= num_pages:
            bad = Boolean(True)
        pos = t0 + kt * cfg.slice_tokens + ctid * cfg.box_rows
        pid = Int32(0)
        if ctid < cfg.boxes and pos < t1:
            pid = mPT[b, pos // cfg.page]
        idx = consumer_wait(full, count + kt, stages, wait)
        ptr = _slot_ptr(cfg, ring, idx, slot)
        sK = cute.make_tensor(
            ptr, cute.make_layout((cfg.slice_tokens, d // 8, 8), stride=(d, 8, 1))
        )
        sV = cute.make_tensor(
            ptr + cfg.slice_tokens * d,
            cute.make_layout((cfg.slice_tokens, WARP_SIZE, pv), stride=(d, pv, 1)),
        )
        sc = cute.make_rmem_tensor((cfg.passes, g_n), Float32)
        for ps in cutlass.range_constexpr(cfg.passes):
            row = warp * rw + ps * ROWS_AT_ONCE + grp
            acc = cute.make_rmem_tensor((g_n,), Float32)
            acc.fill(0.0)
            for c in cutlass.range_constexpr(nch):
                kv = cute.make_rmem_tensor((8,), ab)
                cute.autovec_copy(sK[row, part * nch + (c + rot) % nch, None], kv)
                for e in cutlass.range_constexpr(8):
                    kf = kv[e].to(Float32)
                    for g in cutlass.range_constexpr(g_n):
                        acc[g] = acc[g] + q[g, c * 8 + e] * kf
            live = t0 + kt * cfg.slice_tokens + row < t1
            for g in cutlass.range_constexpr(g_n):
                a = acc[g]
                for sh in cutlass.range_constexpr(3):
                    a = a + cute.arch.shuffle_sync_bfly(a, 1 << sh)
                if not live:
                    a = Float32(-math.inf)
                sc[ps, g] = a
        for g in cutlass.range_constexpr(g_n):
            mx = sc[0, g]
            for ps in cutlass.range_constexpr(1, cfg.passes):
                mx = cute.arch.fmax(mx, sc[ps, g])
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, 8))
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, 16))
            m_new = cute.arch.fmax(m[g], mx)
            m_use = m_new
            if m_new == Float32(-math.inf):  # no live row yet: keep everything at zero
                m_use = Float32(0.0)
            rescale = cute.math.exp2(m[g] - m_use, fastmath=True)
            psum = Float32(0.0)
            for ps in cutlass.range_constexpr(cfg.passes):
                p = cute.math.exp2(sc[ps, g] - m_use, fastmath=True)
                psum = psum + p
                sc[ps, g] = p
            lsum[g] = lsum[g] * rescale + psum
            for i in cutlass.range_constexpr(pv):
                o[g, i] = o[g, i] * rescale
            m[g] = m_new
        if part == 0:
            for ps in cutlass.range_constexpr(cfg.passes):
                for g in cutlass.range_constexpr(g_n):
                    sP[warp, ps * ROWS_AT_ONCE + grp, g] = sc[ps, g]
        cute.arch.sync_warp()
        for j in cutlass.range_constexpr(rw):
            vv = cute.make_rmem_tensor((pv,), ab)
            cute.autovec_copy(sV[warp * rw + j, lane, None], vv)
            pj = cute.make_rmem_tensor((g_n,), Float32)
            cute.autovec_copy(sP[warp, j, None], pj)
            for i in cutlass.range_constexpr(pv):
                vf = vv[i].to(Float32)
                for g in cutlass.range_constexpr(g_n):
                    o[g, i] = o[g, i] + pj[g] * vf
        cute.arch.sync_warp()  # every lane is done with the slot and with sP
        consumer_release(empty, count + kt, stages, lane)

    # merge the warps
    if pid < 0 or pid >= num_pages:
        bad = Boolean(True)
    bad = cute.arch.vote_any_sync(bad)
    for g in cutlass.range_constexpr(g_n):
        tot = lsum[g]
        tot = tot + cute.arch.shuffle_sync_bfly(tot, 8)
        tot = tot + cute.arch.shuffle_sync_bfly(tot, 16)
        if lane == 0:
            sML[warp, g, 0] = m[g]
            sML[warp, g, 1] = tot
        for i in cutlass.range_constexpr(pv):
            sO[warp, g, lane * pv + i] = o[g, i]
    if lane == 0:
        flag = Float32(0.0)
        if bad:
            flag = Float32(1.0)
        sFlag[warp] = flag
    _consumer_sync()
    for idx2 in range(ctid, g_n * d, CONSUMER_THREADS):
        g = idx2 // d
        dim = idx2 % d
        poisoned = Float32(0.0)
        mm = sML[0, g, 0]
        for w in cutlass.range_constexpr(CONSUMER_WARPS):
            poisoned = cute.arch.fmax(poisoned, sFlag[w])
            mm = cute.arch.fmax(mm, sML[w, g, 0])
        acc = Float32(0.0)
        tot = Float32(0.0)
        for w in cutlass.range_constexpr(CONSUMER_WARPS):
            f = Float32(0.0)
            if sML[w, g, 1] > Float32(0.0):  # a warp with no live row has m = -inf
                f = cute.math.exp2(sML[w, g, 0] - mm, fastmath=True)
            acc = acc + sO[w, g, dim] * f
            tot = tot + sML[w, g, 1] * f
        if poisoned > Float32(0.0):
            acc = Float32(math.nan)
        kvs.store_range(mOut, mPO, mPML, b, h * g_n + g, s, dim, d, ranges, acc, tot, mm)
    if ranges > 1:
        sLast = cute.make_tensor(
            cute.recast_ptr(epi + cfg.off_last, dtype=Int32), cute.make_layout(1)
        )
        if kvs.claim_merge(mCnt, b, h, cfg.kv_heads, ranges, ctid, _consumer_sync, sLast):
            kvs.merge_ranges(
                mPO, mPML, mOut, b, h, g_n, d, cfg.splits, ranges, ctid, CONSUMER_THREADS
            )
    return count + n


@cute.jit
def _consumer_sync():
    cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=CONSUMER_THREADS)
