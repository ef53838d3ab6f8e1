"""Hopper (sm_90a) device path of the causal prefill attention tile (``ops.attention_prefill``).

A tile is one (sequence, block of query rows) pair and one KV head: ``QB = 16 * 8 / G`` rows of
the G query heads. Its keys and values, positions ``[0, the block's last position]``, stream
through the megakernel's shared-memory ring as the decode tile streams them
(``ops.attention_decode_sm90``: 64-token slices, a slot holding the slice's K rows then its V
rows, each as (64, 64) tiles with the 128-byte swizzle, one TMA box per page and 64-dimension
block); the producer, the box layout and the descriptors are that tile's.

Consumers (8 warps): warp w takes query head ``w % G`` of the KV head and rows
``16 (w // G) ..`` of the block, every token of every slice, on the tensor cores
(``mma.sync``, :mod:`cutemk.device.mma`): scores S = q K^T as m16n8k16 products (the warp's 16
query rows; q's A fragments in registers, loaded once from global memory; K's B fragments by
``ldmatrix``), the online softmax on S's accumulators with the causal mask on the slices that
cross the rows' positions, P rounded to 16 bits as the A fragment of o += P V (m16n8k8, V by
``ldmatrix.trans``). Each warp owns its rows: no merge, the rows go from registers to ``out``.

The task word packs the block: ``(index in its sequence) << 12 | sequence`` (the producer finds
it from ``cu_seqlens`` once; the consumers unpack it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass
import torch
from cutlass import Boolean, Float32, Int32, cute

from cutemk.device.config import EPI_EMPTY_BARRIER, WARP_SIZE
from cutemk.device.mma import ldmatrix_x4, mma_1688, mma_16816, pack2
from cutemk.device.ring import consumer_release, consumer_wait, plain_wait

from . import attention_decode_sm90 as dsm90
from . import varlen

SLICE_TOKENS = 64
PART = 32
"""Tokens of a slice whose scores a warp holds at once."""
SWIZZLE_DIMS = dsm90.SWIZZLE_DIMS
CONSUMER_WARPS = dsm90.CONSUMER_WARPS
STORE_THREADS = dsm90.STORE_THREADS
MMA_ROWS = 16
SEQ_BITS = 12
T_TMA = 7
"""Index of the first TMA argument in the op's tensors: after (q, k_cache, v_cache, page_table,
seq_lens, cu_seqlens) and the output."""

_MMA_KIND = {torch.bfloat16: "bf16", torch.float16: "f16"}


@dataclass(frozen=True)
class Sm90PrefillConfig:
    group: int  # G: query heads per KV head
    head_dim: int
    page: int  # tokens a page
    kv_heads: int
    max_tokens: int  # the longest sequence the page table holds
    scale_log2: float  # softmax scale * log2(e)
    dtype: torch.dtype

    # the decode tile's slot layout (its producer fills these slots)
    slice_tokens = SLICE_TOKENS

    @property
    def es(self) -> int:
        return self.dtype.itemsize

    @property
    def rows(self) -> int:
        """Query rows of a block: 16 a warp, the G heads' warps side by side."""
        return MMA_ROWS * CONSUMER_WARPS // self.group

    @property
    def box_rows(self) -> int:
        return min(self.page, SLICE_TOKENS)

    @property
    def boxes(self) -> int:
        return SLICE_TOKENS // self.box_rows

    @property
    def slices(self) -> int:
        return -(-self.max_tokens // SLICE_TOKENS)

    @property
    def halves(self) -> int:
        return self.head_dim // SWIZZLE_DIMS

    @property
    def v_offset(self) -> int:
        return SLICE_TOKENS * self.head_dim

    @property
    def tx_bytes(self) -> int:
        return 2 * SLICE_TOKENS * self.head_dim * self.es

    @property
    def slot_bytes(self) -> int:
        return -(-self.tx_bytes // 1024) * 1024

    @property
    def epi_bytes(self) -> int:
        return 0  # the rows go from registers to global memory


def tma_args(cfg: Sm90PrefillConfig, mK: cute.Tensor, mV: cute.Tensor) -> tuple:
    """Host side (inside the launch): ``(atom_k, tma_k, atom_v, tma_v)``, the decode tile's."""
    return dsm90.tma_args(cfg, None, mK, mV)


@cute.jit
def pack_word(b: Int32, k: Int32) -> Int32:
    return (k << SEQ_BITS) | b


@cute.jit
def unpack_word(word: Int32):
    return word & ((1 << SEQ_BITS) - 1), word >> SEQ_BITS


@cute.jit
def find_block(cfg: cutlass.Constexpr, tensors, j: Int32):
    """(sequence, index in it) of block ``j`` (``ops.varlen``: a sequence's last block, the one
    with the most keys, first); (-1, 0) past the last block."""
    mQ, mLen, mCu = tensors[0], tensors[4], tensors[5]
    return varlen.device_find_block(mQ.shape[0], mLen.shape[0], mCu, cfg.rows, True, j)


@cute.jit
def block_span(cfg: cutlass.Constexpr, tensors, word: Int32):
    """(sequence, first q row, its rows, position of its first row, keys the block reads,
    bad): a block of inconsistent lengths reads nothing and writes NaN."""
    mQ, mLen, mCu = tensors[0], tensors[4], tensors[5]
    b, k = unpack_word(word)
    lo, hi = mCu[b], mCu[b + 1]
    n = hi - lo
    length = mLen[b]
    bad = Boolean(False)
    if n < 0 or lo < 0:
        bad = Boolean(True)
    if hi > mQ.shape[0] or length < n:
        bad = Boolean(True)
    if length > cfg.max_tokens:
        bad = Boolean(True)
    # a bad sequence's NaN rows too lie within q's
    first, rows = varlen.device_block_rows(mQ.shape[0], mCu, cfg.rows, b, k)
    p0 = length - n + k * cfg.rows
    keys = p0 + rows
    if bad:
        keys = Int32(0)
    return b, first, rows, p0, keys, bad


@cute.jit
def slices_of_block(cfg: cutlass.Constexpr, tensors, word: Int32) -> Int32:
    """Ring slices of a block: the producer's count and the consumers' are this formula."""
    keys = block_span(cfg, tensors, word)[4]
    return (keys + SLICE_TOKENS - 1) // SLICE_TOKENS


@cute.jit
def load_kv(
    cfg: cutlass.Constexpr, tensors, h: Int32, word: Int32, kt: Int32, idx, bar, ring, slot
):
    """Producer warp: slice ``kt``'s K and V boxes of KV head ``h`` into ring slot ``idx``
    (positions past the block's keys and bad page ids load zeros)."""
    b, _, _, _, keys, _ = block_span(cfg, tensors, word)
    dsm90.slice_boxes(cfg, tensors, b, h, kt * SLICE_TOKENS, keys, idx, bar, ring, slot, T_TMA)


@cute.jit
def compute(
    cfg: cutlass.Constexpr,
    tensors,
    h: Int32,
    word: Int32,
    full,
    empty,
    count: Int32,
    ring,
    stages: cutlass.Constexpr,
    slot: cutlass.Constexpr,
    ctid: Int32,
    wait=plain_wait,
) -> Int32:
    """Consumer warps: the block's slices ``count ..``, then its rows of ``out``; returns the
    ring count after the tile."""
    mQ, mK, mPT, mOut = tensors[0], tensors[1], tensors[3], tensors[6]
    g_n, d = cfg.group, cfg.head_dim
    kind = _MMA_KIND[cfg.dtype]
    warp = cute.arch.make_warp_uniform(ctid // WARP_SIZE)
    lane = ctid % WARP_SIZE
    r = lane // 4  # the fragments' row (and K's token within an 8-block)
    c = lane % 4
    head = h * g_n + warp % g_n
    b, first, rows, p0, keys, bad = block_span(cfg, tensors, word)
    n = (keys + SLICE_TOKENS - 1) // SLICE_TOKENS
    mine = (warp // g_n) * MMA_ROWS  # the warp's first row in the block
    num_pages = mK.shape[0]
    pid = Int32(0)

    # q as the A fragments of the scores' mma (rows: the warp's 16 query rows of its head;
    # k: dimensions), two 16-bit elements a register; rows past the block hold zeros
    hq = g_n * cfg.kv_heads
    gQ = cute.make_tensor(
        cute.recast_ptr(mQ.iterator, dtype=Int32),
        cute.make_layout((mQ.shape[0], hq, d // 2), stride=(hq * d // 2, d // 2, 1)),
    )
    qa = cute.make_rmem_tensor((d // 16, 4), Int32)
    for ks in cutlass.range_constexpr(d // 16):
        for j in cutlass.range_constexpr(4):
            row = mine + r + 8 * (j % 2)
            qv = Int32(0)
            if row < rows and not bad:
                qv = gQ[first + row, head, ks * 8 + 4 * (j // 2) + c]
            qa[ks, j] = qv

    m = cute.make_rmem_tensor((2,), Float32)
    lsum = cute.make_rmem_tensor((2,), Float32)
    o = cute.make_rmem_tensor((d // 8, 4), Float32)  # o's column block j: the mma's D layout
    m.fill(-math.inf)
    lsum.fill(0.0)
    o.fill(0.0)
    # one arrive a ring tile on the storer's barrier, as every ring tile does (nothing staged)
    cute.arch.barrier(barrier_id=EPI_EMPTY_BARRIER, number_of_threads=STORE_THREADS)

    blocks = PART // 8  # 8-token column blocks of a part
    for kt in cutlass.range(n, unroll=1):
        if pid < 0 or pid >= num_pages:  # the previous slice's page ids, read a slice ago
            bad = Boolean(True)
        pos = kt * SLICE_TOKENS + lane * cfg.box_rows
        pid = Int32(0)
        if lane < cfg.boxes and pos < keys:  # every warp checks the slice's pages itself
            pid = mPT[b, pos // cfg.page]
        idx = consumer_wait(full, count + kt, stages, wait)
        base = ring + idx * slot
        # the slice in parts of PART tokens (the scores of a part in registers: fewer of them
        # live at once, so the consumer's body fits the kernel's 168 registers)
        for part in cutlass.range_constexpr(SLICE_TOKENS // PART):
            sc = cute.make_rmem_tensor((blocks, 4), Float32)
            for tb in cutlass.range_constexpr(blocks):
                t8 = part * PART + tb * 8  # the block's first token in the slice
                row_k = base + (t8 + lane % 8) * SWIZZLE_DIMS * cfg.es
                acc = cute.make_rmem_tensor((4,), Float32)
                acc.fill(0.0)
                for kq in cutlass.range_constexpr(d // 32):
                    off = dsm90.elem_offset(cfg, kq // 2, 0) * cfg.es
                    chunk = (kq % 2) * 4 + lane // 8
                    kb = ldmatrix_x4(row_k + off + ((chunk ^ (lane % 8)) * 16))
                    for k2 in cutlass.range_constexpr(2):
                        ks = 2 * kq + k2
                        a_ = (qa[ks, 0], qa[ks, 1], qa[ks, 2], qa[ks, 3])
                        c_ = (acc[0], acc[1], acc[2], acc[3])
                        d_ = mma_16816(kind, a_, (kb[2 * k2], kb[2 * k2 + 1]), c_)
                        for i in cutlass.range_constexpr(4):
                            acc[i] = d_[i]
                for i in cutlass.range_constexpr(4):
                    tok = kt * SLICE_TOKENS + t8 + 2 * c + i % 2
                    at = p0 + mine + r + 8 * (i // 2)  # the row's position
                    sv = acc[i] * cfg.scale_log2
                    if tok > at or tok >= keys:
                        sv = Float32(-math.inf)
                    sc[tb, i] = sv
            # online softmax of rows r (i = 0, 1) and r + 8 (i = 2, 3): a row's 8 tokens of
            # a block on the quad's 4 lanes
            dsm90.online_softmax(sc, m, lsum, o, blocks, 2, d // 8)
            # o += P V: P (16 rows x 8 tokens) is the scores' D layout, packed: the A
            # fragment; V's B fragments by ldmatrix.trans
            for tb in cutlass.range_constexpr(blocks):
                t8 = part * PART + tb * 8
                # this lane's V tokens are tok2, tok2 + 1 (of dimension r): those past the keys
                # are zeroed (a page's slots past the sequence's end are not the sequence's:
                # garbage, maybe NaN, and 0 * NaN is NaN in the mma)
                tok2 = kt * SLICE_TOKENS + t8 + 2 * c
                vmask = Int32(-1)
                if tok2 + 1 >= keys:
                    vmask = Int32(0xFFFF)
                if tok2 >= keys:
                    vmask = Int32(0)
                pa0 = pack2(kind, sc[tb, 0], sc[tb, 1])
                pa1 = pack2(kind, sc[tb, 2], sc[tb, 3])
                row_v = base + (cfg.v_offset + (t8 + lane % 8) * SWIZZLE_DIMS) * cfg.es
                for jq in cutlass.range_constexpr(d // 32):
                    off = dsm90.elem_offset(cfg, jq // 2, 0) * cfg.es
                    chunk = (jq % 2) * 4 + lane // 8
                    vb = ldmatrix_x4(row_v + off + ((chunk ^ (lane % 8)) * 16), trans=True)
                    for m4 in cutlass.range_constexpr(4):
                        j = 4 * jq + m4
                        c_ = (o[j, 0], o[j, 1], o[j, 2], o[j, 3])
                        d_ = mma_1688(kind, (pa0, pa1), (vb[m4] & vmask,), c_)
                        for i in cutlass.range_constexpr(4):
                            o[j, i] = d_[i]
        cute.arch.sync_warp()  # every lane is done with the slot
        consumer_release(empty, count + kt, stages, lane)

    if pid < 0 or pid >= num_pages:
        bad = Boolean(True)
    bad = cute.arch.vote_any_sync(bad)
    # the rows: o / l, two 16-bit elements a 32-bit store
    gOut = cute.make_tensor(
        cute.recast_ptr(mOut.iterator, dtype=Int32),
        cute.make_layout((mOut.shape[0], hq * d // 2), stride=(hq * d // 2, 1)),
    )
    for half in cutlass.range_constexpr(2):
        row = mine + r + 8 * half
        tot = lsum[half]
        tot = tot + cute.arch.shuffle_sync_bfly(tot, 1)
        tot = tot + cute.arch.shuffle_sync_bfly(tot, 2)
        inv = Float32(math.nan)
        if tot > Float32(0.0) and not bad:
            inv = Float32(1.0) / tot
        if row < rows:
            out_row = first + row
            if out_row >= 0 and out_row < mOut.shape[0]:
                for j in cutlass.range_constexpr(d // 8):
                    v = pack2(kind, o[j, 2 * half] * inv, o[j, 2 * half + 1] * inv)
                    gOut[out_row, (head * d + j * 8 + 2 * c) // 2] = v
    return count + n
