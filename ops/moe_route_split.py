"""MoE routing over many SMs: ``moe_route``'s grouped layout built by three tile ops.

``moe_route`` is one task: at prefill sizes (32K routed slots at T=4096, k=8) that one SM is
on the critical path for ~100 us. Here the slots are cut into chunks of ``chunk`` tokens:

1. ``moe_route_count`` (one tile a chunk): per-expert counts of the chunk -> ``chunk_count``
   (chunks, E) int32;
2. ``moe_route_layout`` (one tile): per-expert totals, ``tile_info`` and ``exp_indptr`` exactly
   as ``moe_route`` writes them, and ``chunk_base`` (chunks, E): the padded row where chunk c's
   first slot routed to expert e goes;
3. ``moe_route_place`` (one tile a chunk): each slot's row = ``chunk_base`` + its rank among
   the chunk's earlier slots of the same expert -> ``row_token`` and ``slot_row``; each tile
   also writes -1 into the padding rows of its share of the row tiles.

The result is ``moe_route``'s, element for element (rows keep token order within an expert),
for any ids: ids outside [0, E) get no row (``slot_row`` -1). Counters are 32-bit, so ids
need not be distinct. Within a warp, slots of the same expert are ranked with ``match.any``
(a warp takes 32 consecutive slots at a time), so no shared-memory atomics decide an order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import cutlass
import torch
from cutlass import Int32, Uint32, cute

from cutemk.costmodel import tile_time_us
from cutemk.device.config import NUM_THREADS, simt_sync
from cutemk.device.config import WARP_SIZE as WARP
from cutemk.errors import GraphError
from cutemk.symbolic import IntLike, cdiv
from cutemk.tileop import (
    TensorSpec,
    TileOp,
    block,
    expect_dtype,
    expect_ndim,
    expect_positive_int,
    expect_same_dim,
    full_box,
    register_op,
)

from .moe_route import check_ids, max_tiles, route_layout, scan_experts, write_tile_info

WARPS = NUM_THREADS // WARP
ROUNDS_BATCH = 8
"""Rounds of 32 slots a warp loads at once (their loads are in flight together)."""


def _check_chunk(op_name: str, chunk) -> None:
    if not isinstance(chunk, int) or isinstance(chunk, bool) or not 1 <= chunk <= 2**20:
        raise ValueError(
            f"{op_name} chunk must be an int in [1, 2**20] (tokens a tile), got {chunk!r}"
        )


def _chunk_slots(ids: torch.Tensor, c: int, chunk: int, num_e: int):
    """Chunk c's slots in flat order: (expert or num_e where none, token, pick)."""
    t, k = ids.shape
    lo, hi = block(c, chunk, t)
    flat = ids[lo:hi].reshape(-1).long()
    key = torch.where((flat >= 0) & (flat < num_e), flat, num_e)
    pos = torch.arange(flat.numel(), device=ids.device)
    return key, lo + pos // k, pos % k


@cute.jit
def _warp_rank(key: Int32):
    """(prior, total): lanes of this warp with the same key before this lane, and in all."""
    peers = cute.arch.match_sync(Uint32(0xFFFFFFFF), key, kind="any")
    prior = cute.arch.popc(peers & cute.arch.lanemask_lt())
    return Int32(prior), Int32(cute.arch.popc(peers))


@cute.jit
def _load_rounds(mIds, id0: Int32, r0: Int32, n_ids: Int32, lane: Int32, k: cutlass.Constexpr):
    """Slots ``id0 + (r0 + q) * 32 + lane`` for q < ROUNDS_BATCH, as keys: the expert, or -1
    for a slot past the chunk (loaded clamped, so all loads are in flight at once)."""
    keys = []
    for q in cutlass.range_constexpr(ROUNDS_BATCH):
        i = (r0 + q) * WARP + lane
        flat = id0 + cute.min(i, n_ids - 1)
        tok = flat // k
        e = mIds[tok, flat - tok * k]
        if i >= n_ids:
            e = Int32(-1)
        keys.append(e)
    return keys


@cute.jit
def _count_warp_slots(
    mIds, sWarp, id0, n_ids, r_lo, r_hi, num_e: cutlass.Constexpr, k: cutlass.Constexpr, lane
):
    """Add this warp's slots (rounds [r_lo, r_hi)) to its counter row ``sWarp`` (E,)."""
    for r0 in range(r_lo, r_hi, ROUNDS_BATCH):
        keys = _load_rounds(mIds, id0, r0, n_ids, lane, k)
        for q in cutlass.range_constexpr(ROUNDS_BATCH):
            e = keys[q]
            if r0 + q >= r_hi or e >= num_e:
                e = Int32(-1)
            prior, total = _warp_rank(e)
            if e >= 0 and prior == 0:
                sWarp[e] = sWarp[e] + total
            cute.arch.sync_warp()


class _ChunkedIds:
    """Shared by the per-chunk ops: the chunk's slots and the warps' shares of them."""

    @cute.jit
    def _chunk(self, mIds, coord0: Int32, tidx: Int32):
        """(id0, n_ids, warp, lane, r_lo, r_hi): the chunk's first flat slot and slot count, and
        the rounds of 32 slots this thread's warp takes (contiguous, in slot order)."""
        k = self.ids.shape[1]
        tokens = mIds.shape[0]
        tok_lo = cute.min(coord0 * self.chunk, tokens)
        tok_hi = cute.min(tok_lo + self.chunk, tokens)
        n_ids = (tok_hi - tok_lo) * k
        rounds = (n_ids + WARP - 1) // WARP
        per_warp = (rounds + WARPS - 1) // WARPS
        warp = tidx // WARP
        r_lo = cute.min(warp * per_warp, rounds)
        r_hi = cute.min(r_lo + per_warp, rounds)
        return tok_lo * k, n_ids, warp, tidx % WARP, r_lo, r_hi

    def _chunks(self) -> IntLike:
        return cdiv(self.ids.shape[0], self.chunk)


@register_op
@dataclass(frozen=True)
class MoeRouteCountTile(_ChunkedIds, TileOp):
    ids: TensorSpec  # (tokens, k) int32
    num_experts: int
    chunk: int = 128  # tokens a tile

    name: ClassVar[str] = "moe_route_count"
    token_local: ClassVar[bool] = True
    inputs: ClassVar[tuple[str, ...]] = ("ids",)
    outputs: ClassVar[tuple[str, ...]] = ("chunk_count",)

    def __post_init__(self) -> None:
        expect_ndim(self.ids, 2, "moe_route_count ids")
        expect_dtype(self.ids, (torch.int32,), "moe_route_count ids")
        expect_positive_int(self.num_experts, "moe_route_count num_experts")
        _check_chunk("moe_route_count", self.chunk)

    def check_producers(self, producers) -> None:
        src = producers.get("ids")
        width = getattr(src, "picks_over", None)  # a top-k's, or a router's that picks
        if width is not None and width != self.num_experts:
            raise GraphError(
                f"moe_route_count routes to {self.num_experts} experts but its ids come from a "
                f"top-k over {width} router logits"
            )

    def output_specs(self):
        return {"chunk_count": TensorSpec((self._chunks(), self.num_experts), torch.int32)}

    def grid(self):
        return (self._chunks(),)

    def reads(self, coord, env, data=None):
        t, k = self.ids.concrete(env)
        return {"ids": (block(coord[0], self.chunk, t), (0, k))}

    def writes(self, coord, env, data=None):
        return {"chunk_count": ((coord[0], coord[0] + 1), (0, self.num_experts))}

    def cost(self, coord, env):
        k = self.ids.concrete(env)[1]
        return tile_time_us(8.0 * self.chunk * k, 4.0 * self.chunk * k, torch.float32)

    def reference(self, coord, env, t):
        lo, hi = block(coord[0], self.chunk, t["ids"].shape[0])
        check_ids(t["ids"][lo:hi], self.num_experts, False, "moe_route_count", first_row=lo)
        key, _, _ = _chunk_slots(t["ids"], coord[0], self.chunk, self.num_experts)
        counts = torch.bincount(key, minlength=self.num_experts + 1)[: self.num_experts]
        t["chunk_count"][coord[0]] = counts.to(torch.int32)

    def device_smem_bytes(self) -> int:
        return 4 * WARPS * self.num_experts

    @cute.jit
    def device_tile(self, tensors, coord0: Int32, coord1: Int32, tidx: Int32, smem_ptr):
        """Chunk ``coord0``'s counts; ``tensors`` = (mIds (T, k), mCount (chunks, E)). Each warp
        counts its share into its own shared-memory row, leaders of equal experts adding."""
        mIds, mCount = tensors
        num_e = self.num_experts
        sWarp = cute.make_tensor(
            cute.recast_ptr(smem_ptr, dtype=Int32),
            cute.make_layout((WARPS, num_e), stride=(num_e, 1)),
        )
        for i in range(tidx, WARPS * num_e, NUM_THREADS):
            sWarp[i // num_e, i % num_e] = Int32(0)
        simt_sync()
        id0, n_ids, warp, lane, r_lo, r_hi = self._chunk(mIds, coord0, tidx)
        sMine = cute.make_tensor(sWarp.iterator + warp * num_e, cute.make_layout(num_e))
        _count_warp_slots(mIds, sMine, id0, n_ids, r_lo, r_hi, num_e, self.ids.shape[1], lane)
        simt_sync()
        for e in range(tidx, num_e, NUM_THREADS):
            n = Int32(0)
            for w in cutlass.range_constexpr(WARPS):
                n = n + sWarp[w, e]
            mCount[coord0, e] = n


@register_op
@dataclass(frozen=True)
class MoeRouteLayoutTile(TileOp):
    chunk_count: TensorSpec  # (chunks, E) int32 from moe_route_count
    num_experts: int
    block_m: int
    tokens: IntLike  # T: sizes tile_info like moe_route's
    top_k: int

    name: ClassVar[str] = "moe_route_layout"
    token_local: ClassVar[bool] = True
    inputs: ClassVar[tuple[str, ...]] = ("chunk_count",)
    outputs: ClassVar[tuple[str, ...]] = ("tile_info", "exp_indptr", "chunk_base")

    def __post_init__(self) -> None:
        expect_ndim(self.chunk_count, 2, "moe_route_layout chunk_count")
        expect_dtype(self.chunk_count, (torch.int32,), "moe_route_layout chunk_count")
        expect_positive_int(self.num_experts, "moe_route_layout num_experts")
        if self.chunk_count.shape[1] != self.num_experts:
            raise GraphError(
                f"moe_route_layout over {self.num_experts} experts got counts of "
                f"{self.chunk_count.shape[1]}"
            )
        expect_positive_int(self.block_m, "moe_route_layout block_m")

    def check_producers(self, producers) -> None:
        count = producers.get("chunk_count")
        if getattr(count, "name", None) == "moe_route_count":
            # tokens and top_k size tile_info: smaller than the counted ids, the layout would
            # write tiles past it
            expect_same_dim(
                self.tokens, count.ids.shape[0], "moe_route_layout tokens vs the counted ids"
            )
            expect_same_dim(self.top_k, count.ids.shape[1], "moe_route_layout top_k vs the ids")

    @property
    def max_tiles(self) -> IntLike:
        return max_tiles(self.tokens, self.top_k, self.num_experts, self.block_m)

    def output_specs(self):
        return {
            "tile_info": TensorSpec((self.max_tiles, 2), torch.int32),
            "exp_indptr": TensorSpec((self.num_experts + 1,), torch.int32),
            "chunk_base": TensorSpec(self.chunk_count.shape, torch.int32),
        }

    def grid(self):
        return (1,)

    def reads(self, coord, env, data=None):
        return {"chunk_count": full_box(self.chunk_count.concrete(env))}

    def writes(self, coord, env, data=None):
        return {n: full_box(s.concrete(env)) for n, s in self.output_specs().items()}

    def cost(self, coord, env):
        chunks = self.chunk_count.concrete(env)[0]
        return tile_time_us(
            4.0 * chunks * self.num_experts, 12.0 * chunks * self.num_experts, torch.float32
        )

    def reference(self, coord, env, t):
        counts = t["chunk_count"].long()
        bm = self.block_m
        tile_start, indptr, tile_info = route_layout(counts.sum(0), bm, t["tile_info"].shape[0])
        before = torch.cumsum(counts, 0) - counts  # the expert's slots in earlier chunks
        t["chunk_base"].copy_((tile_start[None, :] * bm + before).to(torch.int32))
        t["exp_indptr"].copy_(indptr.to(torch.int32))
        t["tile_info"].copy_(tile_info.to(torch.int32))

    def device_smem_bytes(self) -> int:
        return 4 * (2 * self.num_experts + 1)

    @cute.jit
    def device_tile(self, tensors, coord0: Int32, coord1: Int32, tidx: Int32, smem_ptr):
        """``tensors`` = (mCount (chunks, E), mTileInfo (max_tiles, 2), mIndptr (E+1,), mBase
        (chunks, E)). Thread e sums column e (its loads batched), warp 0 scans the experts,
        then thread e writes its tiles and turns column e's running counts into rows."""
        mCount, mTileInfo, mIndptr, mBase = tensors
        num_e, bm = self.num_experts, self.block_m
        base = cute.recast_ptr(smem_ptr, dtype=Int32)
        sTileStart = cute.make_tensor(base, cute.make_layout(num_e + 1))
        sCount = cute.make_tensor(base + num_e + 1, cute.make_layout(num_e))
        chunks = mCount.shape[0]
        for e in range(tidx, num_e, NUM_THREADS):
            run = Int32(0)
            for c0 in range(0, chunks, ROUNDS_BATCH):
                vals = self._counts(mCount, c0, e)
                for q in cutlass.range_constexpr(ROUNDS_BATCH):
                    if c0 + q < chunks:
                        run = run + vals[q]
            sCount[e] = run
        simt_sync()
        scan_experts(sCount, sTileStart, mIndptr, num_e, bm, tidx)
        simt_sync()
        write_tile_info(mTileInfo, sCount, sTileStart, num_e, bm, tidx)
        for e in range(tidx, num_e, NUM_THREADS):
            run = sTileStart[e] * bm
            for c0 in range(0, chunks, ROUNDS_BATCH):
                vals = self._counts(mCount, c0, e)
                for q in cutlass.range_constexpr(ROUNDS_BATCH):
                    if c0 + q < chunks:
                        mBase[c0 + q, e] = run
                        run = run + vals[q]

    @cute.jit
    def _counts(self, mCount, c0: Int32, e: Int32):
        """Column e's counts of chunks c0, c0 + 1, ... (ROUNDS_BATCH of them, clamped), loaded
        together."""
        chunks = mCount.shape[0]
        vals = []
        for q in cutlass.range_constexpr(ROUNDS_BATCH):
            vals.append(mCount[cute.min(c0 + q, chunks - 1), e])
        return vals


@register_op
@dataclass(frozen=True)
class MoeRoutePlaceTile(_ChunkedIds, TileOp):
    ids: TensorSpec  # (tokens, k) int32
    chunk_base: TensorSpec  # (chunks, E) int32 from moe_route_layout
    tile_info: TensorSpec  # (max_tiles, 2) int32 from moe_route_layout
    num_experts: int
    block_m: int
    chunk: int = 128

    name: ClassVar[str] = "moe_route_place"
    token_local: ClassVar[bool] = True
    inputs: ClassVar[tuple[str, ...]] = ("ids", "chunk_base", "tile_info")
    outputs: ClassVar[tuple[str, ...]] = ("row_token", "slot_row")
    data_inputs: ClassVar[tuple[str, ...]] = ("ids", "chunk_base", "tile_info")
    scatter_outputs: ClassVar[tuple[str, ...]] = ("row_token",)

    def __post_init__(self) -> None:
        expect_ndim(self.ids, 2, "moe_route_place ids")
        expect_dtype(self.ids, (torch.int32,), "moe_route_place ids")
        expect_positive_int(self.num_experts, "moe_route_place num_experts")
        _check_chunk("moe_route_place", self.chunk)
        expect_ndim(self.chunk_base, 2, "moe_route_place chunk_base")
        expect_ndim(self.tile_info, 2, "moe_route_place tile_info")
        if self.chunk_base.shape[1] != self.num_experts:
            raise GraphError(
                f"moe_route_place over {self.num_experts} experts got chunk_base of "
                f"{self.chunk_base.shape[1]}"
            )
        # one chunk_base row per tile: the counts must have been taken in chunks of this size
        expect_same_dim(
            self.chunk_base.shape[0],
            self._chunks(),
            f"moe_route_place (chunk={self.chunk}) chunk_base rows vs its chunks of tokens",
        )

    def check_producers(self, producers) -> None:
        layout = producers.get("chunk_base")
        if getattr(layout, "name", None) == "moe_route_layout" and layout.block_m != self.block_m:
            raise GraphError(
                f"moe_route_place block_m={self.block_m} differs from its layout's {layout.block_m}"
            )

    def output_specs(self):
        t, k = self.ids.shape
        return {
            "row_token": TensorSpec((self.tile_info.shape[0] * self.block_m,), torch.int32),
            "slot_row": TensorSpec((t, k), torch.int32),
        }

    def grid(self):
        return (self._chunks(),)

    def _pad_tiles(self, c: int, env) -> tuple[int, int]:
        """The row tiles whose padding rows tile c fills (an even share of them)."""
        tiles = self.tile_info.concrete(env)[0]
        share = -(-tiles // max(1, -(-self.ids.concrete(env)[0] // self.chunk)))
        return block(c, share, tiles)

    def reads(self, coord, env, data=None):
        t, k = self.ids.concrete(env)
        return {
            "ids": (block(coord[0], self.chunk, t), (0, k)),
            "chunk_base": ((coord[0], coord[0] + 1), (0, self.num_experts)),
            "tile_info": (self._pad_tiles(coord[0], env), (0, 2)),
        }

    def _rows(self, c: int, t) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(row or -1, token, pick) of chunk c's slots, as the device places them."""
        e = self.num_experts
        key, tok, pick = _chunk_slots(t["ids"], c, self.chunk, e)
        counts = torch.bincount(key, minlength=e + 1)
        order = torch.argsort(key, stable=True)
        rank = torch.empty_like(key)
        rank[order] = (
            torch.arange(key.numel(), device=key.device)
            - (torch.cumsum(counts, 0) - counts)[key[order]]
        )
        base = torch.cat([t["chunk_base"][c].long(), key.new_full((1,), -1)])
        row = torch.where(key < e, base[key] + rank, -1)
        n_rows = t["tile_info"].shape[0] * self.block_m
        return torch.where((row >= 0) & (row < n_rows), row, -1), tok, pick

    def _padding(self, c: int, env, t) -> list[tuple[int, int]]:
        bm = self.block_m
        lo, hi = self._pad_tiles(c, env)
        valid = t["tile_info"][lo:hi, 1].tolist()
        return [((lo + i) * bm + v, (lo + i + 1) * bm) for i, v in enumerate(valid) if v < bm]

    def writes(self, coord, env, data=None):
        t, k = self.ids.concrete(env)
        own = {"slot_row": (block(coord[0], self.chunk, t), (0, k))}
        if data is None:
            return {"row_token": full_box(self.output_specs()["row_token"].concrete(env)), **own}
        row, _, _ = self._rows(coord[0], data)
        boxes = [((r, r + 1),) for r in row[row >= 0].tolist()]
        boxes += [(p,) for p in self._padding(coord[0], env, data)]
        return {"row_token": boxes, **own}

    def cost(self, coord, env):
        k = self.ids.concrete(env)[1]
        return tile_time_us(16.0 * self.chunk * k, 12.0 * self.chunk * k, torch.float32)

    def reference(self, coord, env, t):
        c = coord[0]
        row, tok, pick = self._rows(c, t)
        t["slot_row"][tok, pick] = row.to(torch.int32)
        placed = row >= 0
        t["row_token"][row[placed]] = tok[placed].to(torch.int32)
        for lo, hi in self._padding(c, env, t):
            t["row_token"][lo:hi] = -1

    def device_smem_bytes(self) -> int:
        return 4 * WARPS * self.num_experts

    @cute.jit
    def device_tile(self, tensors, coord0: Int32, coord1: Int32, tidx: Int32, smem_ptr):
        """Chunk ``coord0``'s rows; ``tensors`` = (mIds (T, k), mBase (chunks, E), mTileInfo
        (max_tiles, 2), mRowToken (max_tiles*bm,), mSlotRow (T, k)).

        1. -1 into the padding rows of this tile's share of the row tiles;
        2. each warp counts its rounds of slots per expert (as ``moe_route_count``);
        3. thread e turns the warps' counts into each warp's first row for expert e;
        4. each warp walks its rounds again in slot order: a slot's row is its warp's next row
           for the expert plus its rank among the round's lanes of that expert.
        Rows outside row_token (a ``chunk_base`` that does not fit these ids) are dropped."""
        mIds, mBase, mTileInfo, mRowToken, mSlotRow = tensors
        num_e, bm, k = self.num_experts, self.block_m, self.ids.shape[1]
        n_rows = mRowToken.shape[0]
        sWarp = cute.make_tensor(
            cute.recast_ptr(smem_ptr, dtype=Int32),
            cute.make_layout((WARPS, num_e), stride=(num_e, 1)),
        )
        for i in range(tidx, WARPS * num_e, NUM_THREADS):
            sWarp[i // num_e, i % num_e] = Int32(0)
        # 1. padding rows of tiles [t_lo, t_hi)
        tiles = mTileInfo.shape[0]
        chunks = (mIds.shape[0] + self.chunk - 1) // self.chunk
        share = (tiles + chunks - 1) // chunks
        t_lo = cute.min(coord0 * share, tiles)
        t_hi = cute.min(t_lo + share, tiles)
        for i in range(t_lo, t_hi):
            valid = mTileInfo[i, 1]
            for r in range(i * bm + valid + tidx, (i + 1) * bm, NUM_THREADS):
                mRowToken[r] = Int32(-1)
        simt_sync()
        # 2.
        id0, n_ids, warp, lane, r_lo, r_hi = self._chunk(mIds, coord0, tidx)
        sMine = cute.make_tensor(sWarp.iterator + warp * num_e, cute.make_layout(num_e))
        _count_warp_slots(mIds, sMine, id0, n_ids, r_lo, r_hi, num_e, k, lane)
        simt_sync()
        # 3.
        for e in range(tidx, num_e, NUM_THREADS):
            run = mBase[coord0, e]
            for w in cutlass.range_constexpr(WARPS):
                n = sWarp[w, e]
                sWarp[w, e] = run
                run = run + n
        simt_sync()
        # 4.
        for r0 in range(r_lo, r_hi, ROUNDS_BATCH):
            keys = _load_rounds(mIds, id0, r0, n_ids, lane, k)
            for q in cutlass.range_constexpr(ROUNDS_BATCH):
                e = keys[q]
                if r0 + q >= r_hi or e >= num_e:
                    e = Int32(-1)
                prior, total = _warp_rank(e)
                row = Int32(-1)
                if e >= 0:
                    row = sMine[e] + prior
                cute.arch.sync_warp()
                if e >= 0 and prior == 0:
                    sMine[e] = sMine[e] + total
                cute.arch.sync_warp()
                i = (r0 + q) * WARP + lane
                if r0 + q < r_hi and i < n_ids:
                    flat = id0 + i
                    tok = flat // k
                    if row < 0 or row >= n_rows:
                        row = Int32(-1)
                    if row >= 0:
                        mRowToken[row] = tok
                    mSlotRow[tok, flat - tok * k] = row


def moe_route_count(ids: TensorSpec, *, num_experts: int, chunk: int = 128) -> MoeRouteCountTile:
    return MoeRouteCountTile(ids, num_experts, chunk)


def moe_route_layout(
    chunk_count: TensorSpec, *, num_experts: int, block_m: int, tokens: IntLike, top_k: int
) -> MoeRouteLayoutTile:
    return MoeRouteLayoutTile(chunk_count, num_experts, block_m, tokens, top_k)


def moe_route_place(
    ids: TensorSpec,
    chunk_base: TensorSpec,
    tile_info: TensorSpec,
    *,
    num_experts: int,
    block_m: int,
    chunk: int = 128,
) -> MoeRoutePlaceTile:
    return MoeRoutePlaceTile(ids, chunk_base, tile_info, num_experts, block_m, chunk)
