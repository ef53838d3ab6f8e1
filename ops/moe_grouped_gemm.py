"""MoE grouped GEMM tile op over the grouped (padded) layout of ``moe_route``.

Tile (i, j) computes rows of row tile i (``block_m`` rows, all of expert ``tile_info[i, 0]``)
times columns block j of that expert's weight: ``out[rows] = x[rows] @ w[e, cols]^T``. The task
grid is declared at its maximum; a tile whose ``tile_info[i, 0] < 0`` does not exist at this
routing and is skipped (the data-dependent part of the MoE graph). Padding rows of an existing
tile are written as zeros, so every later op may read whole tiles.

Two input layouts: with ``row_token`` the A rows are gathered from the token-major ``x``
(T, K) (gate/up projection); without it ``x`` is already in the padded layout (down projection).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from cutemk.costmodel import tile_time_us
from cutemk.symbolic import cdiv
from cutemk.tileop import (FLOAT_DTYPES, TensorSpec, TileOp, block, expect_dtype, expect_ndim,
                           expect_same_dim, full_box, register_op)


@register_op
@dataclass(frozen=True)
class MoeGroupedGemmTile(TileOp):
    x: TensorSpec  # (tokens, k) gathered through row_token, or (tiles*block_m, k) padded
    w: TensorSpec  # (experts, n, k)
    tile_info: TensorSpec  # (tiles, 2) int32
    row_token: Optional[TensorSpec] = None  # (tiles*block_m,) int32
    block_m: int = 64
    block_n: int = 64

    name: ClassVar[str] = "moe_grouped_gemm"
    outputs: ClassVar[tuple[str, ...]] = ("out",)
    data_inputs: ClassVar[tuple[str, ...]] = ("tile_info", "row_token")

    def __post_init__(self) -> None:
        expect_ndim(self.x, 2, "moe_grouped_gemm x")
        expect_ndim(self.w, 3, "moe_grouped_gemm w")
        expect_ndim(self.tile_info, 2, "moe_grouped_gemm tile_info")
        expect_dtype(self.x, FLOAT_DTYPES, "moe_grouped_gemm x")
        expect_dtype(self.tile_info, (torch.int32,), "moe_grouped_gemm tile_info")
        if self.w.dtype != self.x.dtype:
            raise TypeError(f"moe_grouped_gemm w must have x's dtype {self.x.dtype}, got {self.w.dtype}")
        expect_same_dim(self.x.shape[1], self.w.shape[2], "moe_grouped_gemm: x.shape[1] vs w.shape[2]")
        if self.row_token is not None:
            expect_ndim(self.row_token, 1, "moe_grouped_gemm row_token")
            expect_dtype(self.row_token, (torch.int32,), "moe_grouped_gemm row_token")
        else:
            expect_same_dim(self.x.shape[0], self.tile_info.shape[0] * self.block_m,
                            "moe_grouped_gemm: padded x rows vs tiles*block_m")
        for f in ("block_m", "block_n"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                raise ValueError(f"moe_grouped_gemm {f} must be a positive int")

    @property
    def inputs(self) -> tuple[str, ...]:
        base = ("x", "w", "tile_info")
        return base if self.row_token is None else base + ("row_token",)

    def output_specs(self):
        rows = self.tile_info.shape[0] * self.block_m
        return {"out": TensorSpec((rows, self.w.shape[1]), self.x.dtype)}

    def grid(self):
        return (self.tile_info.shape[0], cdiv(self.w.shape[1], self.block_n))

    def _ev(self, d, env):
        return d if isinstance(d, int) else d.eval(env)

    def exists(self, coord, env, data):
        return int(data["tile_info"][coord[0], 0]) >= 0

    def reads(self, coord, env, data=None):
        i, j = coord
        tiles = self._ev(self.tile_info.shape[0], env)
        rows = block(i, self.block_m, tiles * self.block_m)
        r = {"tile_info": ((i, i + 1), (0, 2)), "w": full_box(self.w.concrete(env))}
        if self.row_token is None:
            r["x"] = (rows, (0, self._ev(self.x.shape[1], env)))
        else:
            r["row_token"] = (rows,)
            # which tokens are gathered is data: without data, any row of x
            r["x"] = full_box(self.x.concrete(env))
        if data is not None:  # exact: only this expert's weight block
            e = int(data["tile_info"][i, 0])
            _, n, k = self.w.concrete(env)
            r["w"] = ((e, e + 1), block(j, self.block_n, n), (0, k))
        return r

    def writes(self, coord, env, data=None):
        i, j = coord
        rows = self._ev(self.tile_info.shape[0], env) * self.block_m
        n = self._ev(self.w.shape[1], env)
        return {"out": (block(i, self.block_m, rows), block(j, self.block_n, n))}

    def cost(self, coord, env):
        k = self._ev(self.x.shape[1], env)
        es = self.x.dtype.itemsize
        bm, bn = self.block_m, self.block_n
        return tile_time_us(2.0 * bm * bn * k, (bm + bn) * k * es + bm * bn * es, self.x.dtype)

    def reference(self, coord, env, t):
        i, _ = coord
        (r0, r1), (c0, c1) = self.writes(coord, env)["out"]
        e, valid = (int(v) for v in t["tile_info"][i])
        if self.row_token is None:
            a = t["x"][r0:r0 + valid].float()
        else:
            a = t["x"][t["row_token"][r0:r0 + valid].long()].float()
        out = t["out"][r0:r1, c0:c1]
        out[:valid] = (a @ t["w"][e, c0:c1].float().T).to(out.dtype)
        out[valid:] = 0


def moe_grouped_gemm(x: TensorSpec, w: TensorSpec, tile_info: TensorSpec,
                     row_token: Optional[TensorSpec] = None, *, block_m: int = 64,
                     block_n: int = 64) -> MoeGroupedGemmTile:
    return MoeGroupedGemmTile(x, w, tile_info, row_token, block_m, block_n)
