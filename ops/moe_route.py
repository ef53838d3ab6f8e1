"""MoE routing tile op: top-k expert ids -> per-expert counts, grouped layout, permutation.

Input ``ids`` (T, k) int32 from ``topk_softmax`` (gate logits -> softmax -> top-k ->
renormalise). One task builds the grouped ("padded") layout every later MoE op reads:

- each expert e owns ``ceil(count_e / block_m)`` consecutive row tiles of ``block_m`` rows;
  tiles are numbered across experts, at most ``max_tiles = T*k // block_m + min(E, T*k)``;
- ``tile_info`` (max_tiles, 2) int32: ``[expert, valid_rows]`` of each tile, ``[-1, 0]`` for
  tiles that do not exist at this routing (data-dependent task grids read it);
- ``row_token`` (max_tiles*block_m,) int32: the token each padded row comes from, -1 for
  padding;
- ``slot_row`` (T, k) int32: the padded row holding token t's j-th expert's result;
- ``exp_indptr`` (E+1,) int32: prefix sums of the per-expert token counts.

Within an expert, rows keep token order (stable), so results do not depend on scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import cutlass
import torch
from cutlass import Int16, Int32, cute

from cutemk.costmodel import tile_time_us
from cutemk.device.config import NUM_THREADS, simt_sync
from cutemk.device.config import WARP_SIZE as WARP
from cutemk.errors import DataError, GraphError
from cutemk.symbolic import IntLike, smin, upper
from cutemk.tileop import TensorSpec, TileOp, expect_dtype, expect_ndim, full_box, register_op


def max_tiles(tokens: IntLike, k: int, num_experts: int, block_m: int) -> IntLike:
    """Upper bound on grouped row tiles: sum_e ceil(c_e/b) <= T*k/b + #non-empty experts."""
    return (tokens * k) // block_m + smin(num_experts, tokens * k)


@register_op
@dataclass(frozen=True)
class MoeRouteTile(TileOp):
    ids: TensorSpec  # (tokens, k) int32
    num_experts: int
    block_m: int = 64
    # each token names an expert at most once (what topk_softmax yields): an expert then holds
    # at most T rows, which sizes the counters; the interpreter checks it
    distinct_ids: bool = True

    name: ClassVar[str] = "moe_route"
    token_local: ClassVar[bool] = True
    inputs: ClassVar[tuple[str, ...]] = ("ids",)
    outputs: ClassVar[tuple[str, ...]] = ("tile_info", "row_token", "slot_row", "exp_indptr")

    def __post_init__(self) -> None:
        expect_ndim(self.ids, 2, "moe_route ids")
        expect_dtype(self.ids, (torch.int32,), "moe_route ids")
        if not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ValueError(
                f"moe_route num_experts must be a positive int, got {self.num_experts!r}"
            )
        if not isinstance(self.block_m, int) or self.block_m < 1:
            raise ValueError(f"moe_route block_m must be a positive int, got {self.block_m!r}")
        if not isinstance(self.ids.shape[1], int):
            raise ValueError("moe_route: top-k must be a static int")
        lo = self.ids.shape[0]
        lo = lo if isinstance(lo, int) else lo.bounds()[0]
        if lo < 1:
            raise ValueError("moe_route: the token count must be at least 1 (declare its min >= 1)")

    def check_producers(self, producers) -> None:
        src = producers.get("ids")
        width = getattr(src, "picks_over", None)  # a top-k's, or a router's that picks
        if width is not None:
            if width != self.num_experts:
                raise GraphError(
                    f"moe_route routes to {self.num_experts} experts but its ids come from a "
                    f"top-k over {width} router logits"
                )

    @property
    def max_tiles(self) -> IntLike:
        return max_tiles(self.ids.shape[0], self.ids.shape[1], self.num_experts, self.block_m)

    def output_specs(self):
        t, k = self.ids.shape
        return {
            "tile_info": TensorSpec((self.max_tiles, 2), torch.int32),
            "row_token": TensorSpec((self.max_tiles * self.block_m,), torch.int32),
            "slot_row": TensorSpec((t, k), torch.int32),
            "exp_indptr": TensorSpec((self.num_experts + 1,), torch.int32),
        }

    def grid(self):
        return (1,)

    def _shapes(self, env):
        return {n: s.concrete(env) for n, s in self.output_specs().items()}

    def reads(self, coord, env, data=None):
        return {"ids": full_box(self.ids.concrete(env))}

    def writes(self, coord, env, data=None):
        return {n: full_box(s) for n, s in self._shapes(env).items()}

    def cost(self, coord, env):
        t, k = self.ids.concrete(env)
        return tile_time_us(20.0 * t * k, 16.0 * t * k, torch.float32)

    def reference(self, coord, env, t):
        check_ids(t["ids"], self.num_experts, self.distinct_ids, "moe_route")
        ids = t["ids"].long()
        tokens, k = ids.shape
        e, bm = self.num_experts, self.block_m
        dev = ids.device
        # -1 is "no expert" (top-k found fewer than k usable logits): the slot gets no row
        flat = ids.reshape(-1)
        flat = torch.where(flat < 0, e, flat)  # sorts after every expert
        counts = torch.bincount(flat, minlength=e + 1)[:e]
        tile_start, indptr, tile_info = route_layout(counts, bm, t["tile_info"].shape[0])
        order = torch.argsort(flat, stable=True)  # slots grouped by expert, token order kept
        order = order[: int(counts.sum())]  # the slots with an expert
        sorted_e = flat[order]
        rank = torch.arange(order.numel(), device=dev) - indptr[sorted_e]
        row = tile_start[sorted_e] * bm + rank
        slot_row = torch.full_like(flat, -1)
        slot_row[order] = row
        t["slot_row"].copy_(slot_row.view(tokens, k).to(torch.int32))
        t["row_token"].fill_(-1)
        t["row_token"][row] = (order // k).to(torch.int32)
        t["tile_info"].copy_(tile_info.to(torch.int32))
        t["exp_indptr"].copy_(indptr.to(torch.int32))

    # -- device -----------------------------------------------------------------------------
    def _counter_layout(self) -> tuple[int, int]:
        """(bytes per counter, row pitch in counters) of the per-thread counter table. A rank
        within an expert is below the rows it can hold (the token count with distinct ids), so
        16-bit counters do wherever those stay below 2**15: half the shared memory of 32-bit
        ones, which the megakernel's ring can use. The pitch keeps a row an odd number of 32-bit
        words apart (no bank conflicts down a column), or E+1 counters for 32-bit ones."""
        rows = upper(self.ids.shape[0]) * (1 if self.distinct_ids else self.ids.shape[1])
        if rows < 2**15:
            pitch = self.num_experts + 1
            return 2, pitch + (2 - pitch % 4) % 4  # pitch = 2 (mod 4): an odd word count
        return 4, self.num_experts + 1

    def _table_bytes(self) -> int:
        width, pitch = self._counter_layout()
        return -(-(NUM_THREADS * pitch * width) // 16) * 16

    def device_smem_bytes(self) -> int:
        e = self.num_experts
        # per-thread-chunk counters (NUM_THREADS, E), then tile starts (E+1) and per-expert
        # counts (E) in int32
        return self._table_bytes() + 4 * ((e + 1) + e)

    @cute.jit
    def device_tile(self, tensors, coord0: Int32, coord1: Int32, tidx: Int32, smem_ptr):
        """The whole routing (grid (1,)); ``tensors`` = (mIds, mTileInfo, mRowToken, mSlotRow,
        mIndptr).

        mIds: (T, k), mTileInfo: (max_tiles, 2), mRowToken: (max_tiles*block_m,),
        mSlotRow: (T, k), mIndptr: (E+1,), all int32. Stable without sorting: thread c owns the
        c-th contiguous chunk of tokens, so (chunk, token) order is token order.

        1. the threads zero the counter table and fill row_token with -1; each thread counts
           its chunk per expert into its own smem row (no atomics), a token's k ids loaded
           together;
        2. thread e scans column e over the chunks that hold tokens: sCnt[c, e] becomes the rank
           of chunk c's first row within expert e, and sCount[e] the expert's total;
        3. warp 0 scans the experts (shuffle scan): tile starts and exp_indptr;
        4. thread e writes expert e's tile_info rows, all threads the [-1, 0] tail;
        5. each thread walks its chunk again in token order, placing rows at tile_start*bm + rank.

        Ids outside [0, E) are ignored (their slot_row is -1), and so is a row a wrapped 16-bit
        rank would place outside the layout (ids that break ``distinct_ids``), so bad routing
        cannot write out of bounds. The smem row pitch E+1 keeps both access patterns (a thread along its row, a
        warp across a row) free of bank conflicts.
        """
        mIds, mTileInfo, mRowToken, mSlotRow, mIndptr = tensors
        num_e = self.num_experts
        k = self.ids.shape[1]
        bm = self.block_m
        tokens = mIds.shape[0]
        width, pitch = self._counter_layout()
        cnt_t = Int16 if width == 2 else Int32
        sCnt = cute.make_tensor(
            cute.recast_ptr(smem_ptr, dtype=cnt_t),
            cute.make_layout((NUM_THREADS, num_e), stride=(pitch, 1)),
        )
        base = cute.recast_ptr(smem_ptr + self._table_bytes(), dtype=Int32)
        sTileStart = cute.make_tensor(base, cute.make_layout(num_e + 1))
        sCount = cute.make_tensor(base + num_e + 1, cute.make_layout(num_e))

        chunk = (tokens + NUM_THREADS - 1) // NUM_THREADS
        chunks = (tokens + chunk - 1) // chunk  # the chunks that hold tokens
        tok_lo = cute.min(tidx * chunk, tokens)
        tok_hi = cute.min(tok_lo + chunk, tokens)

        # the counter table zeroed by all threads, four words an iteration (the table is
        # rounded to 16 bytes), and row_token filled with -1; every loop here stays rolled:
        # the routing runs on one SM, often from a cold instruction cache, and its code
        # (fetched from HBM after a flushed L2) is most of its time
        sZero = cute.make_tensor(
            cute.recast_ptr(smem_ptr, dtype=Int32),
            cute.make_layout(self._table_bytes() // 4),
        )
        for w in cutlass.range(tidx, self._table_bytes() // 16, NUM_THREADS, unroll=1):
            for q in cutlass.range_constexpr(4):
                sZero[w * 4 + q] = Int32(0)
        for r in cutlass.range(tidx, mRowToken.shape[0], NUM_THREADS, unroll=1):
            mRowToken[r] = Int32(-1)
        simt_sync()
        for tok in cutlass.range(tok_lo, tok_hi, unroll=1):
            ids = self._token_ids(mIds, tok)
            for j in cutlass.range_constexpr(k):
                e = ids[j]
                if e >= 0 and e < num_e:
                    sCnt[tidx, e] = sCnt[tidx, e] + cnt_t(1)
        simt_sync()

        for e in cutlass.range(tidx, num_e, NUM_THREADS, unroll=1):
            run = Int32(0)
            for c in cutlass.range(chunks, unroll=1):
                n = Int32(sCnt[c, e])
                sCnt[c, e] = cnt_t(run)
                run = run + n
            sCount[e] = run
        simt_sync()

        scan_experts(sCount, sTileStart, mIndptr, num_e, bm, tidx)
        simt_sync()
        write_tile_info(mTileInfo, sCount, sTileStart, num_e, bm, tidx)

        for tok in cutlass.range(tok_lo, tok_hi, unroll=1):
            ids = self._token_ids(mIds, tok)
            for j in cutlass.range_constexpr(k):
                e = ids[j]
                row = Int32(-1)
                if e >= 0 and e < num_e:
                    rank = Int32(sCnt[tidx, e])
                    sCnt[tidx, e] = cnt_t(rank + 1)
                    row = sTileStart[e] * bm + rank
                    # ids that break distinct_ids can wrap a 16-bit rank: never out of bounds
                    if row < 0 or row >= mRowToken.shape[0]:
                        row = Int32(-1)
                    else:
                        mRowToken[row] = tok
                mSlotRow[tok, j] = row

    @cute.jit
    def _token_ids(self, mIds, tok: Int32):
        """Token ``tok``'s k ids, loaded together (all in flight before the first is used)."""
        ids = []
        for j in cutlass.range_constexpr(self.ids.shape[1]):
            ids.append(mIds[tok, j])
        return ids


def check_ids(
    ids: torch.Tensor, num_experts: int, distinct: bool, op: str, first_row: int = 0
) -> None:
    """Interpreter check of routed ids (T, k) (rows from ``first_row`` on): each in [0, E) or
    -1 ("no expert"), and with ``distinct`` no expert twice in a token; a ``DataError`` naming
    the first bad id."""
    tokens, k = ids.shape
    flat = ids.reshape(-1)
    bad = (flat < -1) | (flat >= num_experts)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise DataError(
            f"{op}: expert id {int(flat[i])} at ids[{first_row + i // k}, {i % k}] is outside "
            f"[0, {num_experts}) ({int(bad.sum())} of {flat.numel()} ids out of range)"
        )
    if distinct and k > 1:
        s_ids = ids.sort(dim=1).values
        dup = ((s_ids[:, 1:] == s_ids[:, :-1]) & (s_ids[:, 1:] >= 0)).any(dim=1)
        if bool(dup.any()):
            r = int(dup.nonzero()[0])
            raise DataError(
                f"{op}: token {first_row + r} names an expert twice ({ids[r].tolist()}); its ids "
                "must be distinct (build the op with distinct_ids=False otherwise)"
            )


def route_layout(counts: torch.Tensor, block_m: int, max_tiles: int):
    """The grouped layout of per-expert row counts (E,): (tile_start (E,), exp_indptr (E+1,),
    tile_info (max_tiles, 2) with ``[-1, 0]`` past the last tile), int64."""
    counts = counts.long()
    e, dev = counts.numel(), counts.device
    tiles = (counts + block_m - 1) // block_m
    tile_start = torch.cumsum(tiles, 0) - tiles
    indptr = torch.zeros(e + 1, dtype=torch.long, device=dev)
    indptr[1:] = torch.cumsum(counts, 0)
    info = torch.zeros(max_tiles, 2, dtype=torch.long, device=dev)
    info[:, 0] = -1
    n = int(tiles.sum())
    tile_e = torch.repeat_interleave(torch.arange(e, device=dev), tiles)
    j = torch.arange(n, device=dev) - tile_start[tile_e]
    info[:n, 0] = tile_e
    info[:n, 1] = torch.clamp(counts[tile_e] - j * block_m, max=block_m)
    return tile_start, indptr, info


@cute.jit
def scan_experts(
    sCount, sTileStart, mIndptr, num_e: cutlass.Constexpr, bm: cutlass.Constexpr, tidx: Int32
):
    """Warp 0 of the SIMT group: from the per-expert row counts ``sCount`` (E,), the tile
    starts ``sTileStart`` (E+1,) and ``exp_indptr``: an exclusive scan over the experts, each
    lane summing a contiguous run of experts, the lanes joined by a shuffle scan."""
    if tidx < WARP:
        per_lane = (num_e + WARP - 1) // WARP
        e0 = tidx * per_lane
        tiles = Int32(0)
        rows = Int32(0)
        for q in cutlass.range_constexpr(per_lane):
            if e0 + q < num_e:
                n = sCount[e0 + q]
                rows = rows + n
                tiles = tiles + (n + bm - 1) // bm
        tiles_incl = tiles
        rows_incl = rows
        for i in cutlass.range_constexpr(5):
            ot = cute.arch.shuffle_sync_up(tiles_incl, 1 << i)
            orow = cute.arch.shuffle_sync_up(rows_incl, 1 << i)
            if tidx >= (1 << i):
                tiles_incl = tiles_incl + ot
                rows_incl = rows_incl + orow
        t_run = tiles_incl - tiles
        r_run = rows_incl - rows
        for q in cutlass.range_constexpr(per_lane):
            if e0 + q < num_e:
                n = sCount[e0 + q]
                sTileStart[e0 + q] = t_run
                mIndptr[e0 + q] = r_run
                r_run = r_run + n
                t_run = t_run + (n + bm - 1) // bm
        if tidx == WARP - 1:
            sTileStart[num_e] = tiles_incl
            mIndptr[num_e] = rows_incl


@cute.jit
def write_tile_info(
    mTileInfo, sCount, sTileStart, num_e: cutlass.Constexpr, bm: cutlass.Constexpr, tidx: Int32
):
    """SIMT group, after :func:`scan_experts`: thread e writes expert e's ``[e, valid]`` tile
    rows, all threads the ``[-1, 0]`` rows past the last tile."""
    for e in cutlass.range(tidx, num_e, NUM_THREADS, unroll=1):  # rolled: small code
        n = sCount[e]
        t0 = sTileStart[e]
        for i in cutlass.range((n + bm - 1) // bm, unroll=1):
            mTileInfo[t0 + i, 0] = e
            mTileInfo[t0 + i, 1] = cute.min(n - i * bm, bm)
    for i in cutlass.range(sTileStart[num_e] + tidx, mTileInfo.shape[0], NUM_THREADS, unroll=1):
        mTileInfo[i, 0] = Int32(-1)
        mTileInfo[i, 1] = Int32(0)


def moe_route(
    ids: TensorSpec, *, num_experts: int, block_m: int = 64, distinct_ids: bool = True
) -> MoeRouteTile:
    return MoeRouteTile(ids, num_experts, block_m, distinct_ids)
