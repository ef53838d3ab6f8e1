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

import torch

from cutemk.costmodel import tile_time_us
from cutemk.symbolic import IntLike, smin
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

    name: ClassVar[str] = "moe_route"
    inputs: ClassVar[tuple[str, ...]] = ("ids",)
    outputs: ClassVar[tuple[str, ...]] = ("tile_info", "row_token", "slot_row", "exp_indptr")

    def __post_init__(self) -> None:
        expect_ndim(self.ids, 2, "moe_route ids")
        expect_dtype(self.ids, (torch.int32,), "moe_route ids")
        if not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ValueError(f"moe_route num_experts must be a positive int, got {self.num_experts!r}")
        if not isinstance(self.block_m, int) or self.block_m < 1:
            raise ValueError(f"moe_route block_m must be a positive int, got {self.block_m!r}")
        if not isinstance(self.ids.shape[1], int):
            raise ValueError("moe_route: top-k must be a static int")

    @property
    def max_tiles(self) -> IntLike:
        return max_tiles(self.ids.shape[0], self.ids.shape[1], self.num_experts, self.block_m)

    def output_specs(self):
        t, k = self.ids.shape
        return {"tile_info": TensorSpec((self.max_tiles, 2), torch.int32),
                "row_token": TensorSpec((self.max_tiles * self.block_m,), torch.int32),
                "slot_row": TensorSpec((t, k), torch.int32),
                "exp_indptr": TensorSpec((self.num_experts + 1,), torch.int32)}

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
        ids = t["ids"].long()
        tokens, k = ids.shape
        e, bm = self.num_experts, self.block_m
        dev = ids.device
        flat = ids.reshape(-1)
        counts = torch.bincount(flat, minlength=e)[:e]
        tiles = (counts + bm - 1) // bm
        tile_start = torch.cumsum(tiles, 0) - tiles
        indptr = torch.zeros(e + 1, dtype=torch.long, device=dev)
        indptr[1:] = torch.cumsum(counts, 0)
        order = torch.argsort(flat, stable=True)  # slots grouped by expert, token order kept
        sorted_e = flat[order]
        rank = torch.arange(flat.numel(), device=dev) - indptr[sorted_e]
        row = tile_start[sorted_e] * bm + rank
        slot_row = torch.empty_like(flat)
        slot_row[order] = row
        t["slot_row"].copy_(slot_row.view(tokens, k).to(torch.int32))
        t["row_token"].fill_(-1)
        t["row_token"][row] = (order // k).to(torch.int32)
        n = int(tiles.sum())
        t["tile_info"][:, 0] = -1
        t["tile_info"][:, 1] = 0
        tile_e = torch.repeat_interleave(torch.arange(e, device=dev), tiles)
        j = torch.arange(n, device=dev) - tile_start[tile_e]
        t["tile_info"][:n, 0] = tile_e.to(torch.int32)
        t["tile_info"][:n, 1] = torch.clamp(counts[tile_e] - j * bm, max=bm).to(torch.int32)
        t["exp_indptr"].copy_(indptr.to(torch.int32))


def moe_route(ids: TensorSpec, *, num_experts: int, block_m: int = 64) -> MoeRouteTile:
    return MoeRouteTile(ids, num_experts, block_m)
