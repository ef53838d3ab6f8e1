"""Hopper (sm_90a) device path of the causal prefill attention tile (``ops.attention_prefill``).

A tile is one (sequence, block of query rows) pair and one KV head: ``QB = 128 / G`` rows of
each of the G query heads, 128 rows in all (tile row ``R`` is head ``R // QB`` at the block's
row ``R % QB``). Its keys and values, positions ``[0, the block's last position]``, stream
through the megakernel's shared-memory ring as the decode tile streams them
(``ops.attention_decode_sm90``: 64-token slices, a slot holding the slice's K rows then its V
rows, each as (64, 64) tiles with the 128-byte swizzle, one TMA box per page and 64-dimension
block); the producer, the box layout and the descriptors are that tile's.

Consumers (two warpgroups, 64 tile rows each), on ``wgmma``: q goes once into the op's staging
buffer (swizzled, K-major); per slice S = q K^T (m64 n64, q and K from shared memory), the
causal mask on the slices that reach past the block's first position, the online softmax on
S's accumulators (a warp's rows are the m16n8 layout, a row on a quad of lanes), P rounded to
16 bits stays in registers as the A operand of o += P V (m64 n(head dim); V from the slot as an
MN-major operand: the slot's token-major rows are exactly that layout). Each warpgroup owns its
rows: no merge, o / l goes from registers to ``out``.

The task word packs the block: ``(index in its sequence) << 12 | sequence`` (the producer finds
it from ``cu_seqlens`` once; the consumers unpack it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass import Boolean, Float32, Int32, cute
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.tensor_utils import LayoutEnum

from cutemk.device.config import (
    CONSUMER_BARRIER,
    MMA_TURN_BARRIER,
    WARP_SIZE,
    WARPGROUP,
    named_arrive,
    named_sync,
)
from cutemk.device.mma import pack2
from cutemk.device.ring import consumer_release, consumer_wait, epi_acquire, plain_wait

from . import attention_decode_sm90 as dsm90
from . import gemm_sm90 as gsm90
from . import varlen

SLICE_TOKENS = 64
"""Keys a step of the default tile (``Sm90PrefillConfig.step``): a ring slot holds their K rows
then their V rows."""
WIDE_STEP = 128
"""Keys a step of the wide tile: a slot holds the step's K rows or its V rows (S is m64 n128;
K's slot is freed as soon as S is in, V's after P V)."""
SWIZZLE_DIMS = dsm90.SWIZZLE_DIMS
CONSUMER_WARPS = dsm90.CONSUMER_WARPS
STORE_THREADS = dsm90.STORE_THREADS
MMA_ROWS = 16
"""Rows of a warp's accumulators."""
WG_ROWS = 64
"""Tile rows of a consumer warpgroup (wgmma's M)."""
CONSUMER_THREADS = CONSUMER_WARPS * WARP_SIZE
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
    step: int = SLICE_TOKENS  # keys a step: SLICE_TOKENS or WIDE_STEP

    @property
    def wide(self) -> bool:
        """A step's K and V in two slots (``WIDE_STEP``), not one."""
        return self.step == WIDE_STEP

    @property
    def slice_tokens(self) -> int:
        """Rows of a slot's 64-dimension blocks (the decode tile's slot layout, which its
        producer fills): the step's keys."""
        return self.step

    @property
    def es(self) -> int:
        return self.dtype.itemsize

    @property
    def rows(self) -> int:
        """Query rows of a block (QB): the G heads' rows make the tile's 128."""
        return WG_ROWS * (CONSUMER_WARPS // 4) // self.group

    @property
    def box_rows(self) -> int:
        return min(self.page, SLICE_TOKENS)

    @property
    def boxes(self) -> int:
        return self.step // self.box_rows

    @property
    def slots_per_step(self) -> int:
        return 2 if self.wide else 1

    @property
    def slices(self) -> int:
        """Most ring slots a tile takes."""
        return self.slots_per_step * -(-self.max_tokens // self.step)

    @property
    def halves(self) -> int:
        return self.head_dim // SWIZZLE_DIMS

    @property
    def v_offset(self) -> int:
        """V's first element in a slot: after K's, or at its start in a slot of its own."""
        return 0 if self.wide else SLICE_TOKENS * self.head_dim

    @property
    def tx_bytes(self) -> int:
        return (3 - self.slots_per_step) * self.step * self.head_dim * self.es

    @property
    def slot_bytes(self) -> int:
        return -(-self.tx_bytes // 1024) * 1024

    @property
    def epi_bytes(self) -> int:
        """q's rows, staged for wgmma (the output goes from registers to global memory)."""
        return WG_ROWS * (CONSUMER_WARPS // 4) * self.head_dim * self.es


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
    return cfg.slots_per_step * ((keys + cfg.step - 1) // cfg.step)


@cute.jit
def load_kv(
    cfg: cutlass.Constexpr, tensors, h: Int32, word: Int32, kt: Int32, idx, bar, ring, slot
):
    """Producer warp: slice ``kt``'s K and V boxes of KV head ``h`` into ring slot ``idx``
    (positions past the block's keys and bad page ids load zeros); in the wide tile slice
    ``kt`` is step ``kt // 2``'s K (even) or V (odd)."""
    b, _, _, _, keys, _ = block_span(cfg, tensors, word)
    if cutlass.const_expr(cfg.wide):
        base = (kt // 2) * cfg.step
        if kt % 2 == 0:
            dsm90.slice_boxes(cfg, tensors, b, h, base, keys, idx, bar, ring, slot, T_TMA, "k")
        else:
            dsm90.slice_boxes(cfg, tensors, b, h, base, keys, idx, bar, ring, slot, T_TMA, "v")
    else:
        dsm90.slice_boxes(cfg, tensors, b, h, kt * SLICE_TOKENS, keys, idx, bar, ring, slot, T_TMA)


def _q_layout(cfg: Sm90PrefillConfig):
    """One consumer warpgroup's 64 query rows in shared memory: K-major (dimensions
    contiguous), 128-byte swizzled (64-dimension blocks of 8-row atoms, rows first)."""
    ab = dsm90._CUTE_DTYPES[cfg.dtype]
    a = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (WG_ROWS, 64, cfg.head_dim), ab, 1)
    return cute.slice_(a, (None, None, 0))


def _slot_views(cfg: Sm90PrefillConfig, ring, stages: int, slot: int):
    """K and V of every ring slot as wgmma B operands: K (slice tokens, head dim) K-major, V
    (head dim, slice tokens) MN-major; both are the decode producer's slot layout (64-dimension
    blocks of (64 tokens, 64) swizzled tiles, one block after the other)."""
    ab = dsm90._CUTE_DTYPES[cfg.dtype]
    d, es, n = cfg.head_dim, cfg.es, cfg.step
    k_one = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (WG_ROWS, n, d), ab, 1)
    v_one = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, (WG_ROWS, d, n), ab, 1)
    k_l = gsm90._staged(k_one, stages, slot, es)
    v_l = gsm90._staged(v_one, stages, slot, es)
    sK = cute.make_tensor(cute.recast_ptr(ring, k_l.inner, dtype=ab), k_l.outer)
    sV = cute.make_tensor(cute.recast_ptr(ring + cfg.v_offset * es, v_l.inner, dtype=ab), v_l.outer)
    return sK, sV


def _tiled_mmas(cfg: Sm90PrefillConfig):
    """S = q K^T (q and K from shared memory) and o += P V (P from registers), one warpgroup
    each: m64 n(step) and m64 n(head dim), k16 steps."""
    ab = dsm90._CUTE_DTYPES[cfg.dtype]
    mma_s = sm90_utils.make_trivial_tiled_mma(
        ab, ab, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, 1, 1), (WG_ROWS, cfg.step)
    )
    mma_o = sm90_utils.make_trivial_tiled_mma(
        ab,
        ab,
        OperandMajorMode.K,
        OperandMajorMode.MN,
        Float32,
        (1, 1, 1),
        (WG_ROWS, cfg.head_dim),
        a_source=warpgroup.OperandSource.RMEM,
    )
    return mma_s, mma_o


@cute.jit
def _load_q(cfg: cutlass.Constexpr, mQ, q_base, h: Int32, first: Int32, rows: Int32, bad, wg, wtid):
    """The warpgroup's 64 rows of q into its shared-memory block (``_q_layout``), 16 bytes a
    thread a step; rows past the block (or of a bad block) are zeros. Tile row R is query head
    ``R // QB`` of the KV head at the block's row ``R % QB``."""
    d, g_n = cfg.head_dim, cfg.group
    hq = g_n * cfg.kv_heads
    chunks = d // 8  # 16-byte chunks of a row
    gQ = cute.make_tensor(
        cute.recast_ptr(mQ.iterator, dtype=Int32),
        cute.make_layout((mQ.shape[0], hq, d // 2), stride=(hq * d // 2, d // 2, 1)),
    )
    sQ = cute.make_tensor(cute.recast_ptr(q_base, dtype=Int32), cute.make_layout(WG_ROWS * d // 2))
    for i in cutlass.range_constexpr(WG_ROWS * chunks // WARPGROUP):
        cid = wtid + i * WARPGROUP
        row = cid // chunks
        ch = cid % chunks
        big = WG_ROWS * wg + row  # the tile's row
        pr = big % cfg.rows
        head = h * g_n + big // cfg.rows
        live = pr < rows and not bad
        # the swizzled place of the chunk: 64-dimension block, row, chunk ^ (row % 8)
        word = ((ch // 8) * WG_ROWS * 64 + row * 64 + ((ch % 8) ^ (row % 8)) * 8) // 2
        for w in cutlass.range_constexpr(4):
            v = Int32(0)
            if live:
                v = gQ[first + pr, head, ch * 4 + w]
            sQ[word + w] = v


@cute.jit
def _zero_v_tail(cfg: cutlass.Constexpr, base, t0: Int32, ctid: Int32):
    """Zero V's rows ``[t0, step)`` of a slot (whole 128-byte rows of each 64-dimension
    block, so the swizzle does not matter): a last page's slots past a sequence's end are not
    the sequence's, and 0 x NaN in P V would be NaN."""
    words = SWIZZLE_DIMS * cfg.es // 4  # 32-bit words of a row of a block
    rows = cfg.step
    v = cute.make_tensor(
        cute.recast_ptr(base + cfg.v_offset * cfg.es, dtype=Int32),
        cute.make_layout(cfg.halves * rows * words),
    )
    total = cfg.halves * (rows - t0) * words
    for i in cutlass.range(ctid, total, CONSUMER_THREADS, unroll=1):
        hf = i // ((rows - t0) * words)
        rest = i % ((rows - t0) * words)
        v[hf * rows * words + t0 * words + rest] = Int32(0)


@cute.jit
def _turn_sync(wg):
    """Wait for warpgroup ``wg``'s turn (``MMA_TURN_BARRIER``)."""
    named_sync(MMA_TURN_BARRIER + wg, CONSUMER_THREADS)


@cute.jit
def _turn_arrive(wg):
    """Hand the turn to warpgroup ``wg``."""
    named_arrive(MMA_TURN_BARRIER + wg, CONSUMER_THREADS)


@cute.jit
def _softmax_step(sc, m, lsum, scale, blocks: cutlass.Constexpr, scale_log2: cutlass.Constexpr):
    """One slice's online-softmax step on S's accumulators ``sc`` ((block, i) view: rows r for
    i = 0, 1 and r + 8 for i = 2, 3, a row's 8 tokens of a block on a quad's 4 lanes), in
    place: ``sc`` (unscaled scores, -inf where masked) becomes P, each row half's running max
    ``m`` (unscaled) and partial sum ``lsum`` advance, and ``scale`` is what o must be
    multiplied by before P V is added. ``exp2(s * scale_log2 - m * scale_log2)``: one FFMA an
    element."""
    for half in cutlass.range_constexpr(2):
        m_new = cute.arch.fmax(m[half], dsm90.quad_row_max((sc,), half, blocks))
        m_use = m_new
        if m_new == Float32(-math.inf):  # no live token yet: keep everything at zero
            m_use = Float32(0.0)
        m_scaled = m_use * scale_log2
        rescale = cute.math.exp2(m[half] * scale_log2 - m_scaled, fastmath=True)
        psum = Float32(0.0)
        for tb in cutlass.range_constexpr(blocks):
            for i in cutlass.range_constexpr(2):
                p = cute.math.exp2(sc[tb, 2 * half + i] * scale_log2 - m_scaled, fastmath=True)
                psum = psum + p
                sc[tb, 2 * half + i] = p
        lsum[half] = lsum[half] * rescale + psum
        scale[half] = rescale
        m[half] = m_new


@cute.jit
def _rescale(o, scale, cols: cutlass.Constexpr):
    """o's rows times their ``scale`` (then 1). Always: skipping it where no row's maximum
    moved (a warp vote) puts o's update under a branch, and ptxas then serializes every wgmma
    of the kernel (C7515)."""
    for j in cutlass.range_constexpr(cols):
        for i in cutlass.range_constexpr(4):
            o[j, i] = o[j, i] * scale[i // 2]
    scale.fill(1.0)


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
    epi,
    ctid: Int32,
    wait=plain_wait,
    epi_free=None,
) -> Int32:
    """Consumer warpgroups: the block's slices ``count ..``, then its rows of ``out``; returns
    the ring count after the tile. A profiled kernel's ``wait`` with ``phases`` (``profile=
    "slices"``: ``cutemk.codegen.profiling.LandedStamps``) gets each slice's phases of the
    first consumer thread, in SM cycles (``PHASE_FIELDS``): the loop top, the wait for the
    turn, the S wgmma, mask and softmax, the wait for the previous P V."""
    mQ, mK, mPT, mOut = tensors[0], tensors[1], tensors[3], tensors[6]
    g_n, d = cfg.group, cfg.head_dim
    kind = _MMA_KIND[cfg.dtype]
    wg = cute.arch.make_warp_uniform(ctid // WARPGROUP)
    wtid = ctid % WARPGROUP
    warp = cute.arch.make_warp_uniform(wtid // WARP_SIZE)  # the warp in its warpgroup
    lane = ctid % WARP_SIZE
    r = lane // 4  # the accumulators' row (and r + 8)
    c = lane % 4  # their column pair
    b, first, rows, p0, keys, bad = block_span(cfg, tensors, word)
    step, per = cfg.step, cfg.slots_per_step
    n = (keys + step - 1) // step
    num_pages = mK.shape[0]
    pid = Int32(0)

    # q: the previous tile's staging (epi) is free once the storer's barrier passes
    epi_acquire(epi_free, STORE_THREADS)
    q_base = epi + wg * (WG_ROWS * d * cfg.es)
    _load_q(cfg, mQ, q_base, h, first, rows, bad, wg, wtid)
    cute.arch.fence_proxy("async.shared", space="cta")  # generic writes -> wgmma reads
    named_sync(CONSUMER_BARRIER, CONSUMER_THREADS)

    mma_s, mma_o = _tiled_mmas(cfg)
    ab = dsm90._CUTE_DTYPES[cfg.dtype]
    q_l = _q_layout(cfg)
    sQ = cute.make_tensor(cute.recast_ptr(q_base, q_l.inner, dtype=ab), q_l.outer)
    sK, sV = _slot_views(cfg, ring, stages, slot)
    thr_s = mma_s.get_slice(wtid)
    thr_o = mma_o.get_slice(wtid)
    tSrQ = mma_s.make_fragment_A(thr_s.partition_A(sQ))
    tSrK = mma_s.make_fragment_B(thr_s.partition_B(sK))
    tOrV = mma_o.make_fragment_B(thr_o.partition_B(sV))
    acc_s = cute.make_rmem_tensor(thr_s.partition_shape_C((WG_ROWS, step)), Float32)
    acc_o = cute.make_rmem_tensor(thr_o.partition_shape_C((WG_ROWS, d)), Float32)
    tOrP = mma_o.make_fragment_A(thr_o.partition_shape_A((WG_ROWS, step)))
    # the m64 accumulators per warp are the m16n8 layout of 8-column blocks: (block, i) views
    blocks = step // 8
    sc = cute.make_tensor(acc_s.iterator, cute.make_layout((blocks, 4), stride=(4, 1)))
    o = cute.make_tensor(acc_o.iterator, cute.make_layout((d // 8, 4), stride=(4, 1)))
    m = cute.make_rmem_tensor((2,), Float32)
    lsum = cute.make_rmem_tensor((2,), Float32)
    m.fill(-math.inf)
    lsum.fill(0.0)
    acc_o.fill(0.0)
    # each value's row: its place in the block (R % QB) and so its position
    rpos = cute.make_rmem_tensor((2,), Int32)
    for half in cutlass.range_constexpr(2):
        big = WG_ROWS * wg + MMA_ROWS * warp + r + 8 * half
        rpos[half] = p0 + big % cfg.rows
    scale = cute.make_rmem_tensor((2,), Float32)  # o's rescale by the last softmax step
    scale.fill(1.0)
    tail = keys % step
    mma_o.set(warpgroup.Field.ACCUMULATE, True)
    phases = getattr(wait, "phases", None)  # a profiled kernel's; stamped with slice regions
    timed = phases is not None and len(getattr(wait, "region", ())) > 0
    c_end = cutlass.Int64(0)  # the last slice's end (cycles)
    if cutlass.const_expr(timed):
        c_end = cute.arch.clock64()

    # Pingpong: a warpgroup issues its tensor-core work (S of step kt, P V of step kt - 1) on
    # its turn, then hands the turn over and runs step kt's softmax while the other's wgmma
    # run. Warpgroup 1 lets 0 go first; each has n + 1 turns; 0 takes 1's last hand-over.
    # A step's ring slots: one (K then V) or, wide, two (K, then V): slots count + per * kt ..
    if wg == 1:
        _turn_arrive(0)
    prev = Int32(0)  # the ring slot of step kt - 1's V
    for kt in cutlass.range(n, unroll=1):
        if pid < 0 or pid >= num_pages:  # the previous step's page ids, read a step ago
            bad = Boolean(True)
        pos = kt * step + lane * cfg.box_rows
        pid = Int32(0)
        if lane < cfg.boxes and pos < keys:  # every warp checks the step's pages itself
            pid = mPT[b, pos // cfg.page]
        if cutlass.const_expr(cfg.wide):
            if kt > 0:  # V of the previous step, issued before this step's K
                prev = consumer_wait(full, count + per * kt - 1, stages, wait)
        idx = consumer_wait(full, count + per * kt, stages, wait)
        if cutlass.const_expr(not cfg.wide):
            if kt == n - 1 and tail != 0:
                _zero_v_tail(cfg, ring + idx * slot, tail, ctid)
                cute.arch.fence_proxy("async.shared", space="cta")
                named_sync(CONSUMER_BARRIER, CONSUMER_THREADS)
        _rescale(o, scale, d // 8)  # P V of step kt - 2 is done: o is in registers
        c_ready = c_end
        if cutlass.const_expr(timed):
            c_ready = cute.arch.clock64()
        _turn_sync(wg)
        c_turn = c_ready
        if cutlass.const_expr(timed):
            c_turn = cute.arch.clock64()
        warpgroup.fence()
        for kb in cutlass.range_constexpr(d // 16):  # S = q K^T
            mma_s.set(warpgroup.Field.ACCUMULATE, kb != 0)
            cute.gemm(mma_s, acc_s, tSrQ[None, None, kb], tSrK[None, None, kb, idx], acc_s)
        warpgroup.commit_group()
        if kt > 0:  # o += P V of the previous slice
            for kb in cutlass.range_constexpr(step // 16):
                cute.gemm(mma_o, acc_o, tOrP[None, None, kb], tOrV[None, None, kb, prev], acc_o)
        warpgroup.commit_group()
        _turn_arrive(1 - wg)
        warpgroup.wait_group(1)  # S is in
        if cutlass.const_expr(cfg.wide):
            consumer_release(empty, count + per * kt, stages, lane)  # K's slot: S has read it
        c_s = c_turn
        if cutlass.const_expr(timed):
            c_s = cute.arch.clock64()
        # the causal mask, only where the slice reaches past the block's first row (the
        # softmax scale is applied inside its exponentials)
        t_lo = kt * step
        if t_lo + step - 1 > p0 or t_lo + step > keys:
            for tb in cutlass.range_constexpr(blocks):
                for i in cutlass.range_constexpr(4):
                    tok = t_lo + tb * 8 + 2 * c + i % 2
                    if tok > rpos[i // 2] or tok >= keys:
                        sc[tb, i] = Float32(-math.inf)
        _softmax_step(sc, m, lsum, scale, blocks, cfg.scale_log2)
        c_soft = c_s
        if cutlass.const_expr(timed):
            c_soft = cute.arch.clock64()
        warpgroup.wait_group(0)  # P V of the previous step has read its slot and P
        if cutlass.const_expr(timed):
            c_pv = cute.arch.clock64()
            deltas = [c_ready - c_end, c_turn - c_ready, c_s - c_turn, c_soft - c_s, c_pv - c_soft]
            phases(count + per * kt, deltas, ctid)
            c_end = c_pv
        if kt > 0:  # the previous step's V (and, not wide, its K)
            consumer_release(empty, count + per * kt - 1, stages, lane)
        # P, rounded to 16 bits: the accumulators' order is the A fragments' order
        for i in cutlass.range_constexpr(cute.size(tOrP)):
            tOrP[i] = acc_s[i].to(ab)
        if cutlass.const_expr(not cfg.wide):
            prev = idx
    # the last step's P V, on a last turn
    if cutlass.const_expr(cfg.wide):
        if n > 0:
            prev = consumer_wait(full, count + per * n - 1, stages, wait)
            if tail != 0:
                _zero_v_tail(cfg, ring + prev * slot, tail, ctid)
                cute.arch.fence_proxy("async.shared", space="cta")
                named_sync(CONSUMER_BARRIER, CONSUMER_THREADS)
    _rescale(o, scale, d // 8)
    _turn_sync(wg)
    warpgroup.fence()
    if n > 0:
        for kb in cutlass.range_constexpr(step // 16):
            cute.gemm(mma_o, acc_o, tOrP[None, None, kb], tOrV[None, None, kb, prev], acc_o)
    warpgroup.commit_group()
    _turn_arrive(1 - wg)
    if wg == 0:
        _turn_sync(0)
    warpgroup.wait_group(0)
    if n > 0:
        consumer_release(empty, count + per * n - 1, stages, lane)

    if pid < 0 or pid >= num_pages:
        bad = Boolean(True)
    bad = cute.arch.vote_any_sync(bad)
    # the rows: o / l, two 16-bit elements a 32-bit store
    hq = g_n * cfg.kv_heads
    gOut = cute.make_tensor(
        cute.recast_ptr(mOut.iterator, dtype=Int32),
        cute.make_layout((mOut.shape[0], hq * d // 2), stride=(hq * d // 2, 1)),
    )
    for half in cutlass.range_constexpr(2):
        big = WG_ROWS * wg + MMA_ROWS * warp + r + 8 * half
        row = big % cfg.rows
        head = h * g_n + big // cfg.rows
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
    return count + per * n
