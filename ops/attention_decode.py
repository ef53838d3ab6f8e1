"""Decode attention over a paged KV cache, split along the sequence (flash-decoding).

One query token per sequence (decode), grouped-query attention (``Hq = G * Hkv``), keys and
values in pages: ``k_cache`` / ``v_cache`` (num_pages, page_size, Hkv, D), ``page_table``
(B, max_pages) int32 naming sequence b's pages in order, ``seq_lens`` (B,) int32 (data: which
tiles exist is decided at run time).

Tile (b, h * S + s) takes the G query heads of KV head h over range s of sequence b
(``ops.kv_split``: S(B) ranges a sequence, each a share of its live length, a multiple of
``align`` tokens; ranges past the sequence do not exist). Outputs:

- ``out`` (B, Hq * D) in q's dtype, the heads side by side as the output projection reads
  them. A sequence's only range writes its heads' output itself. Otherwise each range stores
  per head the running max ``m`` (log2 units), the sum ``l`` of exp2(score - m) and the
  unnormalised output ``o`` in ``part_o`` (B, Hq, splits, D) / ``part_ml`` (B, Hq, splits, 2),
  fp32, and counts itself in ``merges`` (B, Hkv) with an atomic add; the range that brings
  the count to the sequence's number of ranges merges them all (in range order: bit-identical
  runs) and puts the count back to zero. No merge phase, no merge tiles: readers of ``out``
  wait for every range of their heads.

Bad data never leaves a buffer: a length outside [1, the page table's capacity] makes that
sequence's output NaN (range 0 exists for it, reads nothing and writes NaN), and a page id
outside the cache makes the heads that meet it NaN (the load goes to page 0); the references
do the same.

Decode attention reads every key and value once and does 4 FLOPs per element, so it is bound
by memory, not by the tensor cores: the tile runs on the SIMT group. Each warp walks its own
tokens of the split with the G heads' online softmax in registers (a lane holds D/32
dimensions of each head's q and o), loading ``UNROLL`` tokens' K and V rows at once; the four
warps' partial results are merged through shared memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import cutlass
import torch
from cutlass import Boolean, Float32, Int32, cute

from cutemk.arch import target_arch
from cutemk.costmodel import H200, tile_time_us
from cutemk.device.config import NUM_THREADS, SIMT_BARRIER, simt_sync
from cutemk.device.config import WARP_SIZE as WARP
from cutemk.errors import ShapeError
from cutemk.symbolic import evaluate
from cutemk.tileop import (
    FLOAT_DTYPES,
    RingTile,
    TensorSpec,
    TileOp,
    expect_dtype,
    expect_ndim,
    expect_same_dim,
    full_box,
    register_op,
)

from . import attention_decode_sm90 as dsm90
from . import kv_split as kvs

WARPS = NUM_THREADS // WARP
UNROLL = 4
"""Tokens whose K and V rows a warp loads at once."""
LOG2E = math.log2(math.e)


def _checked_config(q: TensorSpec, k_cache: TensorSpec, v_cache: TensorSpec) -> tuple[int, int]:
    """(G, D) of a valid q / cache pair."""
    expect_ndim(q, 3, "attention q")
    expect_ndim(k_cache, 4, "attention k_cache")
    expect_ndim(v_cache, 4, "attention v_cache")
    expect_dtype(q, FLOAT_DTYPES, "attention q")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dtype != q.dtype:
            raise TypeError(f"attention {name} must have q's dtype {q.dtype}, got {c.dtype}")
    for i in range(4):
        expect_same_dim(k_cache.shape[i], v_cache.shape[i], f"attention k/v cache dim {i}")
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    if not all(isinstance(v, int) for v in (hq, d, hkv, k_cache.shape[1])):
        raise ShapeError("attention: heads, head dim and page size must be static ints")
    expect_same_dim(k_cache.shape[3], d, "attention: head dim of q vs the cache")
    if hq % hkv:
        raise ShapeError(f"attention: {hq} query heads is not a multiple of {hkv} KV heads")
    if d % WARP or d > 8 * WARP:
        raise ShapeError(f"attention: head dim {d} must be a multiple of 32, at most 256")
    return hq // hkv, d


@register_op
@dataclass(frozen=True)
class AttentionDecodeTile(TileOp):
    q: TensorSpec  # (B, Hq, D)
    k_cache: TensorSpec  # (pages, page_size, Hkv, D)
    v_cache: TensorSpec  # (pages, page_size, Hkv, D)
    page_table: TensorSpec  # (B, max_pages) int32
    seq_lens: TensorSpec  # (B,) int32
    splits: int = kvs.SPLITS  # most ranges a (sequence, KV head): see ``ops.kv_split``
    target_tiles: int = kvs.TARGET_TILES
    align: int = kvs.ALIGN  # tokens a range is a multiple of
    scale: float | None = None  # softmax scale (default 1/sqrt(D))
    # the Hopper tile's last range merges in two steps (``Sm90DecodeConfig.merge_batched``):
    # None takes it wherever that tile runs and the split fits it (faster on the H200 at every
    # measured batch), False keeps the one-pass merge, True refuses shapes it does not take
    merge_batched: bool | None = None

    name: ClassVar[str] = "attention_decode"
    token_local: ClassVar[bool] = True
    # a sequence past the lengths' or the page table's extent is absent: its tiles do not
    # exist (a live launch binds both to the live count); the batch of the tile grid is q's
    live_rows_inputs: ClassVar[tuple[str, ...]] = ("page_table", "seq_lens")
    inputs: ClassVar[tuple[str, ...]] = ("q", "k_cache", "v_cache", "page_table", "seq_lens")
    outputs: ClassVar[tuple[str, ...]] = ("out", "part_o", "part_ml", "merges")
    data_inputs: ClassVar[tuple[str, ...]] = ("page_table", "seq_lens")
    # every range tile of a (sequence, KV head) may be the one that writes its output
    scatter_outputs: ClassVar[tuple[str, ...]] = ("out",)
    zeroed_outputs: ClassVar[tuple[str, ...]] = ("merges",)

    def __post_init__(self) -> None:
        _checked_config(self.q, self.k_cache, self.v_cache)
        expect_ndim(self.page_table, 2, "attention page_table")
        expect_ndim(self.seq_lens, 1, "attention seq_lens")
        expect_dtype(self.page_table, (torch.int32,), "attention page_table")
        expect_dtype(self.seq_lens, (torch.int32,), "attention seq_lens")
        expect_same_dim(self.page_table.shape[0], self.q.shape[0], "attention: batch of pages")
        expect_same_dim(self.seq_lens.shape[0], self.q.shape[0], "attention: batch of lengths")
        if not isinstance(self.page_table.shape[1], int):
            raise ShapeError("attention: the page table's width must be a static int")
        kvs.check_policy(self.splits, self.target_tiles, self.align, "attention")
        if self.merge_batched and not kvs.batched_merge_fits(self.q.shape[2], self.splits):
            raise ValueError(
                "attention merge_batched needs splits a power of two up to 32 and a head dim "
                f"a multiple of 4, got splits={self.splits}, head dim {self.q.shape[2]}"
            )
        if self.align % UNROLL:
            raise ValueError(f"attention align must be a multiple of {UNROLL}, got {self.align}")
        if self.merge_batched and self._sm90_config(True) is None:  # no silent one-pass merge
            raise ValueError(
                "attention merge_batched is the Hopper tile's merge: it needs a 16-bit cache, a "
                "head dim a multiple of 64 up to 256, a power-of-two page of 8 to 256 tokens, at "
                "most 16 query heads a KV head and ranges aligned to the tile's slice"
            )

    # -- shapes ------------------------------------------------------------------------------
    @property
    def group(self) -> int:
        return self.q.shape[1] // self.k_cache.shape[2]

    @property
    def max_tokens(self) -> int:
        """The longest sequence the page table can hold."""
        return self.page_table.shape[1] * self.k_cache.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.k_cache.shape[2]

    def split_count(self, batch):
        """Ranges a sequence is split into at ``batch`` sequences (``ops.kv_split``)."""
        return kvs.split_count(batch, self.kv_heads, self.splits, self.target_tiles)

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.q.shape[2])

    def output_specs(self):
        b, hq, d = self.q.shape
        return {
            "out": TensorSpec((b, hq * d), self.q.dtype),
            "part_o": TensorSpec((b, hq, self.splits, d), torch.float32),
            "part_ml": TensorSpec((b, hq, self.splits, 2), torch.float32),
            "merges": TensorSpec((b, self.kv_heads), torch.int32),
        }

    def grid(self):
        b = self.q.shape[0]
        return (b, self.kv_heads * self.split_count(b))

    def _heads(self, coord, env) -> tuple[int, int, int, int]:
        """(batch, KV head, range, ranges a sequence) of a tile."""
        b, hs = coord
        count = evaluate(self.split_count(self.q.shape[0]), env)
        return b, hs // count, hs % count, count

    def _valid(self, length: int) -> int:
        """The length tiles use: 0 for a bad one (outside [1, the page table's capacity])."""
        return length if 1 <= length <= self.max_tokens else 0

    def _span(self, coord, env, length: int) -> tuple[int, int, int]:
        """Tokens [lo, hi) of tile ``coord`` and the ranges of its sequence, for a sequence of
        ``length`` tokens."""
        _, _, s, count = self._heads(coord, env)
        length = self._valid(length)
        if length == 0:
            return (0, 0, 0)
        c = kvs.span(length, count, self.align)
        return (
            min(s * c, length),
            min((s + 1) * c, length),
            kvs.ranges_of(length, count, self.align),
        )

    def exists(self, coord, env, data):
        if coord[0] >= min(data["seq_lens"].shape[0], data["page_table"].shape[0]):
            return False  # an absent sequence (past the live count), as on the device
        # range 0 always exists: for a bad length it writes the sequence's NaN output
        lo, hi, _ = self._span(coord, env, int(data["seq_lens"][coord[0]]))
        return lo < hi or self._heads(coord, env)[2] == 0

    def reads(self, coord, env, data=None):
        b, h, _, _ = self._heads(coord, env)
        g = self.group
        return {
            "q": ((b, b + 1), (h * g, (h + 1) * g), (0, self.q.shape[2])),
            "k_cache": full_box(self.k_cache.concrete(env)),
            "v_cache": full_box(self.v_cache.concrete(env)),
            "page_table": ((b, b + 1), (0, self.page_table.shape[1])),
            "seq_lens": ((b, b + 1),),
        }

    def writes(self, coord, env, data=None):
        # A tile writes its range's partials; the sequence's only range, or the last of its
        # ranges to finish, writes the G heads' output. Which one is last is decided at run
        # time (the ``merges`` count, an atomic the tiles share; not an event), so without
        # data every range may write the output (readers wait for all of them) and with data
        # range ``ranges - 1`` stands for the writer: the readers' order is the same.
        # ``merges`` is the op's own counter: zero before and after every launch, read by
        # no other node, and not declared.
        b, h, s, _ = self._heads(coord, env)
        g, d = self.group, self.q.shape[2]
        heads = (h * g, (h + 1) * g)
        out = ((b, b + 1), (h * g * d, (h + 1) * g * d))
        parts = {
            "part_o": ((b, b + 1), heads, (s, s + 1), (0, d)),
            "part_ml": ((b, b + 1), heads, (s, s + 1), (0, 2)),
        }
        if data is None:
            return {"out": out, **parts}
        ranges = self._span(coord, env, int(data["seq_lens"][b]))[2]
        return {
            **({"out": out} if s == max(ranges - 1, 0) else {}),
            **(parts if ranges > 1 else {}),
        }

    def cost(self, coord, env):
        d, es = self.q.shape[2], self.q.dtype.itemsize
        count = self._heads(coord, env)[3]
        tokens = self.max_tokens / count  # the longest range
        stream = tile_time_us(4.0 * self.group * tokens * d, 2.0 * tokens * d * es, self.q.dtype)
        # the first slice's round trip, and where ranges merge the count's and the partials'
        return stream + H200.load_latency_us * (1 if count == 1 else 3)

    def reference(self, coord, env, t):
        b, h, s, _ = self._heads(coord, env)
        g, page, d = self.group, self.k_cache.shape[1], self.q.shape[2]
        lo, hi, ranges = self._span(coord, env, int(t["seq_lens"][b]))
        heads = slice(h * g, (h + 1) * g)
        out = t["out"][b, h * g * d : (h + 1) * g * d].view(g, d)
        if ranges == 0:  # a bad length
            out.fill_(float("nan"))
            return
        pos = torch.arange(lo, hi, device=t["q"].device)
        pages = t["page_table"][b, pos // page].long()
        bad = bool(((pages < 0) | (pages >= t["k_cache"].shape[0])).any())
        pages = torch.where((pages < 0) | (pages >= t["k_cache"].shape[0]), 0, pages)
        k = t["k_cache"][pages, pos % page, h].float()  # (n, D)
        v = t["v_cache"][pages, pos % page, h].float()
        q = t["q"][b, h * g : (h + 1) * g].float()  # (G, D)
        scores = (q @ k.T) * (self.softmax_scale * LOG2E)  # (G, n), log2 units
        m = scores.max(dim=1).values
        p = torch.exp2(scores - m[:, None])
        o = p @ v if not bad else torch.full((g, d), float("nan"), device=p.device)
        if ranges == 1:
            out.copy_(o / p.sum(dim=1)[:, None])
            return
        t["part_o"][b, heads, s] = o
        t["part_ml"][b, heads, s, 0] = m
        t["part_ml"][b, heads, s, 1] = p.sum(dim=1)
        t["merges"][b, h] += 1
        if int(t["merges"][b, h]) == ranges:  # the last range in: merge them all
            t["merges"][b, h] = 0
            ml = t["part_ml"][b, heads, :ranges]  # (G, ranges, 2)
            f = torch.exp2(ml[..., 0] - ml[..., 0].max(dim=1, keepdim=True).values)
            num = (t["part_o"][b, heads, :ranges] * f[..., None]).sum(dim=1)
            out.copy_(num / (ml[..., 1] * f).sum(dim=1)[:, None])

    # -- device ------------------------------------------------------------------------------
    exists_on_device: ClassVar[bool] = True

    def sm90(self) -> dsm90.Sm90DecodeConfig | None:
        """The Hopper tile (K and V through the megakernel's ring by TMA) where the target arch
        and the shapes allow it; else None and the portable tile below runs."""
        if target_arch() != "sm_90a":
            return None
        return self._sm90_config()

    @property
    def batched_merge(self) -> bool:
        """Whether the Hopper tile's last range merges in two steps: ``merge_batched``, or
        where that is None (the default) wherever the tile runs these shapes and the split
        fits the merge. The field itself keeps None, so a ``dataclasses.replace`` of the op
        decides again for its own shapes."""
        if self.merge_batched is not None:
            return self.merge_batched
        fits = kvs.batched_merge_fits(self.q.shape[2], self.splits)
        return fits and self._sm90_config(False) is not None

    def _sm90_config(self, merge_batched: bool | None = None) -> dsm90.Sm90DecodeConfig | None:
        """The Hopper tile's config for these shapes, whatever the target arch (its merge:
        :attr:`batched_merge`, or ``merge_batched`` where given)."""
        if merge_batched is None:
            merge_batched = self.batched_merge
        return dsm90.sm90_decode_config(
            self.q.dtype,
            self.group,
            self.q.shape[2],
            self.k_cache.shape[1],
            self.kv_heads,
            self.splits,
            self.target_tiles,
            self.align,
            self.max_tokens,
            self.softmax_scale,
            merge_batched,
        )

    def ring_tile(self) -> RingTile | None:
        cfg = self.sm90()
        if cfg is None:
            return None
        return RingTile(cfg.slices, cfg.tx_bytes, cfg.slot_bytes, cfg.epi_bytes)

    def host_args(self, tensors) -> tuple:
        cfg = self.sm90()
        if cfg is None:
            return ()
        return dsm90.tma_args(cfg, tensors[0], tensors[1], tensors[2])

    def reads_async_proxy(self) -> bool:
        return self.sm90() is not None

    @cute.jit
    def device_task_word(self, tensors, coord0: Int32, coord1: Int32) -> Int32:
        """The sequence's length (0 for a bad one or an absent one, past the lengths' or the
        page table's extent): the tile's range follows from it."""
        word = Int32(0)
        if coord0 < tensors[4].shape[0] and coord0 < tensors[3].shape[0]:
            n = tensors[4][coord0]
            if n >= 1 and n <= self.max_tokens:
                word = n
        return word

    @cute.jit
    def device_span(self, tensors, coord1: Int32, length: Int32):
        """(KV head, range, first token, end token) of a tile (``ops.kv_split``)."""
        return kvs.device_tile_span(
            tensors[0].shape[0],  # the batch of the tile grid: q's (the plan's count)
            coord1,
            length,
            self.kv_heads,
            self.splits,
            self.target_tiles,
            self.align,
        )

    @cute.jit
    def device_slices(self, tensors, coord0: Int32, coord1: Int32, word: Int32) -> Int32:
        """Ring slices of a live tile: its range in slices of the Hopper tile."""
        _, _, t0, t1, _ = self.device_span(tensors, coord1, word)
        return dsm90.slices_of(self.sm90(), t0, t1)  # 0 for range 0 of a bad length

    dynamic_slices: ClassVar[bool] = True
    # which tiles exist and what they stream follow from the lengths and the page table alone:
    # where those are launch inputs, a tile's keys and values load before its events
    early_exists: ClassVar[bool] = True
    independent_inputs: ClassVar[tuple[str, ...]] = ("k_cache", "v_cache")

    def independent_loads_allowed(self, producers) -> bool:
        """A ``kv_append`` of the launch (or a ``qk_norm_rope`` that appends) writes each
        sequence's last position only (two sequences never name the same page slot: bad data
        otherwise), and the slice holding it is loaded after the events; any other writer of
        the cache is not known."""
        return all(
            p.name == "kv_append" or (p.name == "qk_norm_rope" and p.appends)
            for p in producers.values()
        )

    @cute.jit
    def device_load_independent(
        self, tensors, coord0, coord1, word, kt, idx, bar, ring, stages, slot
    ):
        dsm90.load_kv(self.sm90(), tensors, coord0, coord1, word, kt, idx, bar, ring, slot, False)

    @cute.jit
    def device_load_dependent(
        self, tensors, coord0, coord1, word, kt, idx, bar, ring, stages, slot
    ):
        dsm90.load_kv(self.sm90(), tensors, coord0, coord1, word, kt, idx, bar, ring, slot, True)

    @cute.jit
    def device_compute(
        self,
        tensors,
        coord0,
        coord1,
        word,
        full,
        empty,
        count,
        ring,
        stages,
        slot,
        epi,
        ctid,
        wait,
        epi_free=None,
    ):
        return dsm90.compute(
            self.sm90(),
            tensors,
            coord0,
            coord1,
            word,
            full,
            empty,
            count,
            ring,
            stages,
            slot,
            epi,
            ctid,
            wait,
            epi_free,
        )

    @cute.jit
    def device_store(self, tensors, coord0, coord1, epi):
        pass  # the consumers wrote the tile; the storer warp only publishes it

    def device_smem_bytes(self) -> int:
        # per warp and head: its m and l, and its o (D floats)
        return 4 * WARPS * self.group * (2 + self.q.shape[2])

    @cute.jit
    def device_exists(self, tensors, coord0: Int32, coord1: Int32) -> Boolean:
        word = self.device_task_word(tensors, coord0, coord1)
        _, s, t0, t1, _ = self.device_span(tensors, coord1, word)
        present = coord0 < tensors[4].shape[0] and coord0 < tensors[3].shape[0]
        return (t0 < t1 or s == 0) and present

    @cute.jit
    def device_tile(self, tensors, coord0: Int32, coord1: Int32, tidx: Int32, smem_ptr):
        """Tile (b, h * S + s); ``tensors`` = (mQ, mK, mV, mPT, mLen, mOut, mPO, mPML,
        mCnt)."""
        mQ, mK, mV, mPT, _, mOut, mPO, mPML, mCnt = tensors
        g_n, d = self.group, self.q.shape[2]
        per = d // WARP  # dims a lane holds
        page = self.k_cache.shape[1]
        b = coord0
        length = self.device_task_word(tensors, coord0, coord1)  # 0: a bad length
        h, s, t0, t1, ranges = self.device_span(tensors, coord1, length)
        num_pages = mK.shape[0]
        poisoned = Boolean(False)
        warp = tidx // WARP
        lane = tidx % WARP
        c = self.softmax_scale * LOG2E
        q = cute.make_rmem_tensor((g_n, per), Float32)
        o = cute.make_rmem_tensor((g_n, per), Float32)
        m = cute.make_rmem_tensor((g_n,), Float32)
        el = cute.make_rmem_tensor((g_n,), Float32)
        for g in cutlass.range_constexpr(g_n):
            m[g] = Float32(-math.inf)
            el[g] = Float32(0.0)
            for i in cutlass.range_constexpr(per):
                q[g, i] = mQ[b, h * g_n + g, lane * per + i].to(Float32) * c
                o[g, i] = Float32(0.0)
        # this warp's tokens: t0 + warp, t0 + warp + WARPS, ... in batches of UNROLL
        for base in range(t0 + warp, t1, WARPS * UNROLL):
            ks = cute.make_rmem_tensor((UNROLL, per), Float32)
            vs = cute.make_rmem_tensor((UNROLL, per), Float32)
            for u in cutlass.range_constexpr(UNROLL):
                pos = cute.min(base + u * WARPS, t1 - 1)  # clamped: every load in flight
                pg = mPT[b, pos // page]
                if pg < 0 or pg >= num_pages:  # a bad page id: load page 0, poison the result
                    pg = Int32(0)
                    if base + u * WARPS < t1:
                        poisoned = Boolean(True)
                slot = pos % page
                for i in cutlass.range_constexpr(per):
                    ks[u, i] = mK[pg, slot, h, lane * per + i].to(Float32)
                    vs[u, i] = mV[pg, slot, h, lane * per + i].to(Float32)
            for u in cutlass.range_constexpr(UNROLL):
                if base + u * WARPS < t1:
                    for g in cutlass.range_constexpr(g_n):
                        part = Float32(0.0)
                        for i in cutlass.range_constexpr(per):
                            part = part + q[g, i] * ks[u, i]
                        for sh in cutlass.range_constexpr(5):
                            part = part + cute.arch.shuffle_sync_bfly(part, 1 << sh)
                        m_new = cute.arch.fmax(m[g], part)
                        rescale = cute.math.exp2(m[g] - m_new, fastmath=True)
                        p = cute.math.exp2(part - m_new, fastmath=True)
                        el[g] = el[g] * rescale + p
                        for i in cutlass.range_constexpr(per):
                            o[g, i] = o[g, i] * rescale + p * vs[u, i]
                        m[g] = m_new
        # merge the warps: each stages its m, l and o; thread (g, dim) merges one output
        sM = cute.make_tensor(
            cute.recast_ptr(smem_ptr, dtype=Float32),
            cute.make_layout((WARPS, g_n, 2), stride=(g_n * 2, 2, 1)),
        )
        sO = cute.make_tensor(  # row-major: a warp's lanes store consecutive words
            cute.recast_ptr(smem_ptr, dtype=Float32) + WARPS * g_n * 2,
            cute.make_layout((WARPS, g_n, d), stride=(g_n * d, d, 1)),
        )
        poisoned = cute.arch.vote_any_sync(poisoned)
        for g in cutlass.range_constexpr(g_n):
            if lane == 0:
                sM[warp, g, 0] = m[g]
                sM[warp, g, 1] = el[g]
            for i in cutlass.range_constexpr(per):
                val = o[g, i]
                if poisoned:
                    val = Float32(math.nan)
                sO[warp, g, lane * per + i] = val
        simt_sync()
        for idx in range(tidx, g_n * d, NUM_THREADS):
            g = idx // d
            dim = idx % d
            mm = sM[0, g, 0]
            for w in cutlass.range_constexpr(1, WARPS):
                mm = cute.arch.fmax(mm, sM[w, g, 0])
            acc = Float32(0.0)
            tot = Float32(0.0)
            for w in cutlass.range_constexpr(WARPS):
                f = Float32(0.0)
                if sM[w, g, 1] > Float32(0.0):  # a warp with no token has m = -inf
                    f = cute.math.exp2(sM[w, g, 0] - mm, fastmath=True)
                acc = acc + sO[w, g, dim] * f
                tot = tot + sM[w, g, 1] * f
            kvs.store_range(mOut, mPO, mPML, b, h * g_n + g, s, dim, d, ranges, acc, tot, mm)
        if ranges > 1:
            if kvs.claim_merge(mCnt, b, h, self.kv_heads, ranges, tidx, SIMT_BARRIER, NUM_THREADS):
                kvs.merge_ranges(
                    mPO, mPML, mOut, b, h, g_n, d, self.splits, ranges, tidx, NUM_THREADS
                )


def attention_decode(
    q: TensorSpec,
    k_cache: TensorSpec,
    v_cache: TensorSpec,
    page_table: TensorSpec,
    seq_lens: TensorSpec,
    *,
    splits: int = kvs.SPLITS,
    target_tiles: int = kvs.TARGET_TILES,
    align: int = kvs.ALIGN,
    scale: float | None = None,
    merge_batched: bool | None = None,
) -> AttentionDecodeTile:
    """Split-KV decode attention (see the module doc and ``ops.kv_split``); ``g.call`` gives
    ``(out, part_o, part_ml, merges)``: use ``out``. ``merge_batched``: the last range's merge
    in two steps (None: wherever the Hopper tile takes it; see :class:`AttentionDecodeTile`)."""
    return AttentionDecodeTile(
        q,
        k_cache,
        v_cache,
        page_table,
        seq_lens,
        splits,
        target_tiles,
        align,
        scale,
        merge_batched,
    )


def decode_attention_reference(q, k_cache, v_cache, page_table, seq_lens, scale=None):
    """fp32 SDPA of each sequence's one query over its pages (GQA): (B, Hq * D)."""
    b_n, hq, d = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    out = torch.empty(b_n, hq, d, dtype=torch.float32, device=q.device)
    for b in range(b_n):
        n = int(seq_lens[b])
        pos = torch.arange(n, device=q.device)
        pages = page_table[b, pos // page].long()
        k = k_cache[pages, pos % page].float()  # (n, Hkv, D)
        v = v_cache[pages, pos % page].float()
        k = k.repeat_interleave(hq // hkv, dim=1)  # (n, Hq, D)
        v = v.repeat_interleave(hq // hkv, dim=1)
        att = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), k) * scale, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", att, v)
    return out.reshape(b_n, hq * d)
