"""Hopper (sm_90a) device path of the decode attention tile: the paged KV cache streams through
the megakernel's shared-memory ring by TMA; the consumer warps do the split's online softmax.

Decode attention reads every key and value once and does ~4 FLOPs per element per query head,
so it is bound by how many bytes are in flight, not by arithmetic. The portable tile (loads from
registers, a few KB in flight per SM) reaches ~15% of HBM bandwidth; here the producer warp
keeps the ring's slots full (tens of KB per SM, across task boundaries) and the consumers only
read shared memory.

- **Slices.** A tile (b, h, s) takes range s of sequence b (``ops.kv_split``: a multiple of
  ``C`` tokens), ``C`` tokens a ring slot (``C`` = 64, 128 where the ranges align to it); how
  many slices a tile streams follows the sequence's live length (``slices_of``), so producer
  and consumers agree on it from the length the producer read. A slot holds the slice's K rows
  then its V rows, each as D/64 tiles of (C, 64) with the 128-byte swizzle (chunk j of row t
  at chunk ``j ^ (t % 8)``), as TMA lands them: per page one box of ``R = min(page, C)`` rows
  a 64-dimension block (a page's rows are strided by the KV heads in the cache; the box
  gathers one head's).
- **Host** (``tma_args``): one descriptor each for K and V over the cache viewed as
  ``(page_size, D, Hkv, pages)`` (the page is a coordinate, like a grouped GEMM's expert).
- **Producer warp** (``load_kv``): the warp reads the page ids of the 32-page block holding
  the slice in one load (the next slices' reads of the block hit L1) and issues the boxes. Positions past the sequence and bad page ids get the page
  coordinate ``pages``: the copy engine fills those boxes with zeros and reads no memory. The
  cache is launch input except each sequence's last position (a ``kv_append`` of the launch
  writes it): where the lengths and pages are launch inputs too, the producer decides the
  tile and issues its slices before the task's events (``TileOp.early_exists``), all but the
  slice holding the last position, which follows the events.
- **Consumers** (``compute``, 8 warps; the sequence length comes with the task record, as the
  producer read it): warp w owns tokens ``[w * C/8, (w + 1) * C/8)`` of every slice, in blocks
  of 8, on the tensor cores (``mma.sync``, :mod:`cutemk.device.mma`): the G query heads of the
  KV head are the rows (up to 16), so scores S = q K^T are m16n8k16 products with q's A
  fragments in registers (loaded once from global memory) and K's B fragments by 32-bit shared
  loads (the swizzle puts a block's 8 tokens on distinct banks). The online softmax runs on
  S's accumulators (a row's 8 tokens over a quad of lanes: 2 shuffles for the max), and P,
  rounded to 16 bits, is already the A fragment of o += P V (m16n8k8; V's B fragments by
  `ldmatrix.trans`, conflict-free by the same swizzle). After the last slice the 8 warps'
  (m, l, o) merge through shared memory and the consumers write the output (the sequence's
  only range) or ``part_o`` / ``part_ml`` and count the range in
  (``ops.kv_split.claim_merge``); the last range merges them all. The storer warp has nothing
  to store and only publishes the tile. Pages under 8 tokens (a box below one swizzle atom)
  and other shapes the config refuses run the portable tile.
- Bad data: a page id outside the cache anywhere in the tile's valid range makes the tile's
  output NaN (the merge then makes the sequence NaN), as the reference does. The consumer
  warps take turns: warp ``kt % 8`` reads slice kt's page ids as the slice starts and checks
  them at its next turn (or after the last slice), so no slice waits on a page-table load
  (checked one slice later, every slice waited: a slice's work is shorter than the load).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass import BFloat16, Boolean, Float16, Float32, Int32, cute
from cutlass.cute.nvgpu import cpasync
from cutlass.tensor_utils import LayoutEnum

from cutemk.device.config import (
    CONSUMER_BARRIER,
    WARP_SIZE,
    WARPGROUP,
    named_sync,
)
from cutemk.device.mma import ldmatrix_x4, mma_1688, mma_16816, pack2
from cutemk.device.ring import consumer_release, consumer_wait, epi_acquire, plain_wait

from . import kv_split as kvs

CONSUMER_THREADS = 2 * WARPGROUP
CONSUMER_WARPS = CONSUMER_THREADS // WARP_SIZE
STORE_THREADS = CONSUMER_THREADS + WARP_SIZE
SWIZZLE_DIMS = 64
"""Dimensions of one 128-byte swizzled row block (16-bit elements)."""
MMA_ROWS = 16
"""Query heads of a KV head the mma's rows hold (G <= 16)."""
MAX_O_REGS = 64
"""fp32 accumulators of o a consumer lane keeps: D / 8 column blocks x 2 (G <= 8) or 4."""

_CUTE_DTYPES = {torch.bfloat16: BFloat16, torch.float16: Float16}
_MMA_KIND = {torch.bfloat16: "bf16", torch.float16: "f16"}

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
    # the last range merges in two steps (``ops.kv_split.merge_ranges_batched``; the op's
    # default where the split fits it: 4-7 us faster than ``merge_ranges`` at B=1 on the H200)
    merge_batched: bool = False

    @property
    def es(self) -> int:
        return self.dtype.itemsize

    @property
    def slice_tokens(self) -> int:
        """Tokens a ring slot: 64 (a 32 KB slot at D = 128), 128 where the ranges are aligned
        to it (the per-slice waits and reductions spread over twice the rows)."""
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
        """Tokens of a slice each consumer warp takes: 8 (one mma column block) or 16."""
        return self.slice_tokens // CONSUMER_WARPS

    @property
    def halves(self) -> int:
        """64-dimension column blocks of a row: one 128-byte swizzled box each."""
        return self.head_dim // SWIZZLE_DIMS

    @property
    def v_offset(self) -> int:
        """Elements from a slot's start to its V rows."""
        return self.slice_tokens * self.head_dim

    @property
    def tx_bytes(self) -> int:
        """A slot: the slice's K rows, then its V rows."""
        return 2 * self.slice_tokens * self.head_dim * self.es

    @property
    def slot_bytes(self) -> int:
        return -(-self.tx_bytes // 1024) * 1024

    # epilogue buffer, fp32: (m, l) (warps, G, 2), poison flags (warps,), partial outputs
    # (warps, G, D)
    @property
    def off_ml(self) -> int:
        return 0

    @property
    def off_flag(self) -> int:
        return self.off_ml + CONSUMER_WARPS * self.group * 2

    @property
    def off_o(self) -> int:
        return -(-(self.off_flag + CONSUMER_WARPS) // 4) * 4

    @property
    def epi_bytes(self) -> int:
        words = self.off_o + CONSUMER_WARPS * self.group * self.head_dim
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
    merge_batched: bool = False,
) -> Sm90DecodeConfig | None:
    """The Hopper tile's config, or None where its shapes do not fit it (the portable tile
    runs): a 16-bit cache, head dim a multiple of 64 up to 256, a power-of-two page of 8 to 256
    tokens (a TMA box of at least one 8-row swizzle atom), ranges aligned to the slice, at most
    16 query heads a KV head and o's accumulators within a lane's registers."""
    if dtype not in _CUTE_DTYPES or head_dim % SWIZZLE_DIMS or head_dim > 256:
        return None
    if page < 8 or page & (page - 1) or page > 256:
        return None
    if group > MMA_ROWS or head_dim // 8 * (2 if group <= 8 else 4) > MAX_O_REGS:
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
        merge_batched,  # shapes checked by the op (``kv_split.batched_merge_fits``)
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
    """One box in shared memory: ``box_rows`` rows of 64 dimensions, 128-byte swizzled (16-byte
    chunk ``j`` of row ``t`` at chunk ``j ^ (t % 8)``; the consumers' loads assume it)."""
    ab = _CUTE_DTYPES[cfg.dtype]
    tile = (cfg.box_rows, 8, SWIZZLE_DIMS)
    lay = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile, ab, 1)
    return cute.slice_(lay, (None, None, 0))


def tma_args(cfg: Sm90DecodeConfig, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor) -> tuple:
    """Host side (inside the launch): ``(atom_k, tma_k, atom_v, tma_v)``."""
    load = cpasync.CopyBulkTensorTileG2SOp()
    box = _box_layout(cfg)
    tile = (cfg.box_rows, SWIZZLE_DIMS)
    atom_k, tma_k = cpasync.make_tiled_tma_atom(load, _page_view(mK), box, tile)
    atom_v, tma_v = cpasync.make_tiled_tma_atom(load, _page_view(mV), box, tile)
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
    h, _, t0, _, _ = tile_span(cfg, tensors[0].shape[0], coord1, word)  # q's batch: the grid's
    base = t0 + kt * cfg.slice_tokens
    last = base + cfg.slice_tokens >= word  # the slice holds position word - 1
    go = not last
    if cutlass.const_expr(dependent):
        go = last
    if go:
        slice_boxes(cfg, tensors, coord0, h, base, word, idx, bar, ring, slot, T_TMA)


@cute.jit
def slice_boxes(
    cfg: cutlass.Constexpr,
    tensors,
    coord0,
    h,
    base,
    word,
    idx,
    bar,
    ring,
    slot,
    tma_at: cutlass.Constexpr,
    parts: cutlass.Constexpr = "kv",
):
    """The warp reads the page ids of the 32-page block holding the slice, lane l page
    ``block + l`` (one coalesced load: the slices after this one read the same ids from L1
    instead of waiting a page-table round trip each), and issues the slice's K and V boxes
    (tokens ``[base, base + slice)`` of sequence ``coord0``, those at or past ``word`` zeros).
    A slice's pages never cross a block: slices are aligned to their size, a power-of-two
    number of pages of at most 32. ``tensors``: K at 1, the page table at 3, the four TMA
    arguments from ``tma_at`` (the prefill tile, ``ops.attention_prefill_sm90``, streams its
    slices with this too). ``parts``: ``"kv"`` the slot takes K then V (at ``cfg.v_offset``),
    ``"k"`` / ``"v"`` only that one, from the slot's start."""
    mK, mPT = tensors[1], tensors[3]
    atom_k, tma_k, atom_v, tma_v = (tensors[tma_at + i] for i in range(4))
    lane = cute.arch.lane_idx()
    num_pages = mK.shape[0]
    first = base // cfg.page
    block = first - first % WARP_SIZE
    pg = num_pages  # out of bounds: a zero-filled box, no memory read
    # a page holding a position before ``word`` (clamped to the page table: in its row)
    if (block + lane) * cfg.page < word:
        pg = mPT[coord0, block + lane]
        if pg < 0 or pg >= num_pages:
            pg = num_pages
    slot_ptr = ring + idx * slot
    blk = (base % cfg.page) // cfg.box_rows  # box index inside its page
    for r in cutlass.range_constexpr(cfg.boxes):
        pos = base + r * cfg.box_rows
        p_r = cute.arch.shuffle_sync(pg, pos // cfg.page - block)
        if pos >= word:  # a box past the sequence (its page may hold earlier positions)
            p_r = num_pages
        if cutlass.const_expr(cfg.boxes > 1):
            blk = ((base + r * cfg.box_rows) % cfg.page) // cfg.box_rows
        for hf in cutlass.range(
            cfg.halves, unroll=1
        ):  # unrolled, the producer's 40 registers spill
            off = elem_offset(cfg, hf, r * cfg.box_rows) * cfg.es
            if cutlass.const_expr(parts != "v"):
                _copy_box(cfg, atom_k, tma_k, slot_ptr + off, h, p_r, blk, hf, bar)
            if cutlass.const_expr(parts == "kv"):
                v_off = cfg.v_offset * cfg.es + off
                _copy_box(cfg, atom_v, tma_v, slot_ptr + v_off, h, p_r, blk, hf, bar)
            if cutlass.const_expr(parts == "v"):
                _copy_box(cfg, atom_v, tma_v, slot_ptr + off, h, p_r, blk, hf, bar)


def elem_offset(cfg: Sm90DecodeConfig, half: int, row: int) -> int:
    """Element offset of row ``row``'s ``half``-th 64-dimension block in a slot's K (or V)
    rows: the blocks are (slice tokens, 64) swizzled tiles, one after the other."""
    return half * cfg.slice_tokens * SWIZZLE_DIMS + row * SWIZZLE_DIMS


@cute.jit
def _copy_box(cfg: cutlass.Constexpr, atom, tma, dst, h: Int32, page: Int32, blk, half: int, bar):
    """TMA rows ``[blk * R, (blk + 1) * R)``, dimensions ``[64 half, 64 (half + 1))`` of KV head
    ``h`` of ``page`` to ``dst`` (a byte pointer into the ring, 1024-byte aligned)."""
    box = _box_layout(cfg)
    s = cute.make_tensor(cute.recast_ptr(dst, box.inner, dtype=_CUTE_DTYPES[cfg.dtype]), box.outer)
    g = cute.local_tile(tma[None, None, h, page], (cfg.box_rows, SWIZZLE_DIMS), (blk, half))
    ts, tg = cpasync.tma_partition(
        atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2)
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
    epi_free=None,
) -> Int32:
    """Consumer warps: the tile's slices ``count ..``, then ``part_o`` / ``part_ml`` written;
    returns the ring count after the tile."""
    mK, mPT = tensors[1], tensors[3]
    mOut, mPO, mPML, mCnt = (tensors[T_OUT + i] for i in range(4))
    g_n, d, rw = cfg.group, cfg.head_dim, cfg.rows_per_warp
    kind = _MMA_KIND[cfg.dtype]
    two = g_n > 8  # the mma's rows 8..15 hold query heads too
    warp = cute.arch.make_warp_uniform(ctid // WARP_SIZE)
    lane = ctid % WARP_SIZE
    r = lane // 4  # the mma fragments' row (query head) and K's token within an 8-block
    c = lane % 4
    b = coord0
    # the sequence's length, clamped to the page table (the producer read it)
    h, s, t0, t1, ranges = tile_span(cfg, tensors[0].shape[0], coord1, word)  # the grid's batch
    n = slices_of(cfg, t0, t1)
    num_pages = mK.shape[0]
    # a bad page id poisons the tile: the warps take turns, warp kt % 8's lane r < boxes
    # reading box r's id of slice kt as the slice starts and checking it at the warp's next
    # turn, 8 slices later, or after the last slice (one slice's work hid too little of a
    # page-table load: the check at the next slice waited for it, every slice)
    pid = Int32(0)
    bad = Boolean(False)

    # q as the A fragments of the scores' mma (rows: query heads, k: dimensions), two 16-bit
    # elements a register, from global memory (the producer acquired its events before handing
    # the task over; the latency overlaps the first slice's wait). Rows past G hold zeros.
    mQ = tensors[0]
    hq = g_n * cfg.kv_heads
    gQ = cute.make_tensor(
        cute.recast_ptr(mQ.iterator, dtype=Int32),
        cute.make_layout((mQ.shape[0], hq, d // 2), stride=(hq * d // 2, d // 2, 1)),
    )
    qa = cute.make_rmem_tensor((d // 16, 4), Int32)
    for ks in cutlass.range_constexpr(d // 16):
        for j in cutlass.range_constexpr(4):
            row = r + 8 * (j % 2)
            qv = Int32(0)
            if cutlass.const_expr(j % 2 == 0 or two):
                qv = gQ[b, h * g_n + cute.min(row, g_n - 1), ks * 8 + 4 * (j // 2) + c]
                if row >= g_n:
                    qv = Int32(0)
            qa[ks, j] = qv

    # online softmax state of this lane's rows r (and r + 8): its columns' share of l
    m = cute.make_rmem_tensor((2,), Float32)
    lsum = cute.make_rmem_tensor((2,), Float32)
    o = cute.make_rmem_tensor((d // 8, 4), Float32)  # o's column block j: the mma's D layout
    m.fill(-math.inf)
    lsum.fill(0.0)
    o.fill(0.0)

    epi = cute.recast_ptr(epi_ptr, dtype=Float32)
    sML = cute.make_tensor(
        epi + cfg.off_ml, cute.make_layout((CONSUMER_WARPS, g_n, 2), stride=(g_n * 2, 2, 1))
    )
    sFlag = cute.make_tensor(epi + cfg.off_flag, cute.make_layout(CONSUMER_WARPS))
    sO = cute.make_tensor(
        epi + cfg.off_o, cute.make_layout((CONSUMER_WARPS, g_n, d), stride=(g_n * d, d, 1))
    )
    # the previous ring tile's store has read the staging buffer
    epi_acquire(epi_free, STORE_THREADS)

    blocks = rw // 8  # 8-token column blocks of the scores a warp takes per slice
    zero = Float32(0.0)
    for kt in cutlass.range(n, unroll=1):
        if warp == kt % CONSUMER_WARPS:  # warp-uniform
            if pid < 0 or pid >= num_pages:
                bad = Boolean(True)
            pos = t0 + kt * cfg.slice_tokens + lane * cfg.box_rows
            pid = Int32(0)
            if lane < cfg.boxes and pos < t1:
                pid = mPT[b, pos // cfg.page]
        idx = consumer_wait(full, count + kt, stages, wait)
        base = ring + idx * slot
        # scores: S (heads x 8 tokens) = q K^T a block, K's B fragments by ldmatrix (matrix
        # rows: the block's 8 tokens, 16 bytes of dimensions each; the swizzle puts them on
        # distinct banks)
        sc = cute.make_rmem_tensor((blocks, 4), Float32)
        for tb in cutlass.range_constexpr(blocks):
            row0 = warp * rw + tb * 8  # a multiple of 8: token row0 + t sits in swizzle row t
            row_k = base + (row0 + lane % 8) * SWIZZLE_DIMS * cfg.es
            acc = cute.make_rmem_tensor((4,), Float32)
            acc.fill(0.0)
            for kq in cutlass.range_constexpr(d // 32):
                off = elem_offset(cfg, kq // 2, 0) * cfg.es
                chunk = (kq % 2) * 4 + lane // 8
                kb = ldmatrix_x4(row_k + off + ((chunk ^ (lane % 8)) * 16))
                for k2 in cutlass.range_constexpr(2):
                    ks = 2 * kq + k2
                    a_ = (qa[ks, 0], qa[ks, 1], qa[ks, 2], qa[ks, 3])
                    c_ = (acc[0], acc[1], acc[2] if two else zero, acc[3] if two else zero)
                    d_ = mma_16816(kind, a_, (kb[2 * k2], kb[2 * k2 + 1]), c_)
                    for i in cutlass.range_constexpr(4):
                        acc[i] = d_[i]
            for i in cutlass.range_constexpr(4):
                tok = t0 + kt * cfg.slice_tokens + row0 + 2 * c + i % 2
                sv = acc[i] * cfg.scale_log2
                if tok >= t1:
                    sv = Float32(-math.inf)
                sc[tb, i] = sv
        # online softmax of rows r (i = 0, 1) and r + 8 (i = 2, 3): the quad's 4 lanes hold a
        # row's 8 tokens of a block
        online_softmax(sc, m, lsum, o, blocks, 2 if two else 1, d // 8)
        # o += P V: P (heads x 8 tokens) is the scores' D layout, packed: the A fragment; V's
        # B fragment (tokens 2c, 2c + 1 of dimension r of a column block) by ldmatrix.trans
        for tb in cutlass.range_constexpr(blocks):
            row0 = warp * rw + tb * 8
            # this lane's V tokens are tok2, tok2 + 1: those at or past the range's end are
            # zeroed (a last page's slots past the sequence are not its own: garbage, maybe
            # NaN, and 0 * NaN is NaN in the mma)
            tok2 = t0 + kt * cfg.slice_tokens + row0 + 2 * c
            vmask = Int32(-1)
            if tok2 + 1 >= t1:
                vmask = Int32(0xFFFF)
            if tok2 >= t1:
                vmask = Int32(0)
            pa0 = pack2(kind, sc[tb, 0], sc[tb, 1])
            pa1 = Int32(0)
            if cutlass.const_expr(two):
                pa1 = pack2(kind, sc[tb, 2], sc[tb, 3])
            row_v = base + (cfg.v_offset + (row0 + lane % 8) * SWIZZLE_DIMS) * cfg.es
            for jq in cutlass.range_constexpr(d // 32):
                off = elem_offset(cfg, jq // 2, 0) * cfg.es
                chunk = (jq % 2) * 4 + lane // 8
                vb = ldmatrix_x4(row_v + off + ((chunk ^ (lane % 8)) * 16), trans=True)
                for m4 in cutlass.range_constexpr(4):
                    j = 4 * jq + m4
                    c_ = (o[j, 0], o[j, 1], o[j, 2] if two else zero, o[j, 3] if two else zero)
                    d_ = mma_1688(kind, (pa0, pa1), (vb[m4] & vmask,), c_)
                    for i in cutlass.range_constexpr(4 if two else 2):
                        o[j, i] = d_[i]
        cute.arch.sync_warp()  # every lane is done with the slot
        consumer_release(empty, count + kt, stages, lane)

    # merge the warps (each warp's last page ids checked after its rows are out)
    for half in cutlass.range_constexpr(2 if two else 1):
        row = r + 8 * half
        tot = lsum[half]
        tot = tot + cute.arch.shuffle_sync_bfly(tot, 1)
        tot = tot + cute.arch.shuffle_sync_bfly(tot, 2)
        if row < g_n:
            if c == 0:
                sML[warp, row, 0] = m[half]
                sML[warp, row, 1] = tot
            for j in cutlass.range_constexpr(d // 8):
                for i in cutlass.range_constexpr(2):
                    sO[warp, row, j * 8 + 2 * c + i] = o[j, 2 * half + i]
    if pid < 0 or pid >= num_pages:
        bad = Boolean(True)
    bad = cute.arch.vote_any_sync(bad)
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
        if kvs.claim_merge(
            mCnt, b, h, cfg.kv_heads, ranges, ctid, CONSUMER_BARRIER, CONSUMER_THREADS
        ):
            if cutlass.const_expr(cfg.merge_batched):
                # the per-range factors in the partial outputs' buffer: every consumer has
                # read it (claim_merge's barrier)
                gs = g_n * cfg.splits
                sF = cute.make_tensor(epi + cfg.off_o, cute.make_layout(gs))
                sL = cute.make_tensor(epi + cfg.off_o + gs, cute.make_layout(gs))
                kvs.merge_ranges_batched(
                    mPO,
                    mPML,
                    mOut,
                    b,
                    h,
                    g_n,
                    d,
                    cfg.splits,
                    ranges,
                    ctid,
                    CONSUMER_THREADS,
                    sF,
                    sL,
                    _consumer_sync,
                )
            else:
                kvs.merge_ranges(
                    mPO, mPML, mOut, b, h, g_n, d, cfg.splits, ranges, ctid, CONSUMER_THREADS
                )
    return count + n


@cute.jit
def _consumer_sync():
    named_sync(CONSUMER_BARRIER, CONSUMER_THREADS)


@cute.jit
def quad_row_max(scs, half: cutlass.Constexpr, blocks: cutlass.Constexpr) -> Float32:
    """The largest score of rows ``r + 8 half`` over the m16n8 accumulator views ``scs`` (a
    tuple of (block, i) views: a row's 8 tokens of a block on a quad's 4 lanes), reduced over
    the quad."""
    mx = scs[0][0, 2 * half]
    for sc in scs:
        for tb in cutlass.range_constexpr(blocks):
            for i in cutlass.range_constexpr(2):
                mx = cute.arch.fmax(mx, sc[tb, 2 * half + i])
    mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, 1))
    return cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, 2))


@cute.jit
def online_softmax(
    sc, m, lsum, o, blocks: cutlass.Constexpr, halves: cutlass.Constexpr, cols: cutlass.Constexpr
):
    """One slice's step of the online softmax on the m16n8 accumulators ``sc`` (``blocks`` x
    4: rows r (i = 0, 1) and r + 8 (i = 2, 3), a row's 8 tokens of a block on the quad's 4
    lanes), in place: ``sc`` becomes P, the running max ``m`` and sum ``lsum`` of each half
    (``halves``: 1 where the rows r + 8 hold nothing) advance and ``o``'s ``cols`` column
    blocks are rescaled. Shared by the decode tile and the prefill tile."""
    for half in cutlass.range_constexpr(halves):
        m_new = cute.arch.fmax(m[half], quad_row_max((sc,), half, blocks))
        m_use = m_new
        if m_new == Float32(-math.inf):  # no live token yet: keep everything at zero
            m_use = Float32(0.0)
        rescale = cute.math.exp2(m[half] - m_use, fastmath=True)
        psum = Float32(0.0)
        for tb in cutlass.range_constexpr(blocks):
            for i in cutlass.range_constexpr(2):
                p = cute.math.exp2(sc[tb, 2 * half + i] - m_use, fastmath=True)
                psum = psum + p
                sc[tb, 2 * half + i] = p
        lsum[half] = lsum[half] * rescale + psum
        for j in cutlass.range_constexpr(cols):
            for i in cutlass.range_constexpr(2):
                o[j, 2 * half + i] = o[j, 2 * half + i] * rescale
        m[half] = m_new
