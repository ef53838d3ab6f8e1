"""RMSNorm tile op: y = x / sqrt(mean(x^2) + eps) * weight, one block of rows a task."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from cutemk.costmodel import tile_time_us
from cutemk.errors import ShapeError
from cutemk.symbolic import cdiv
from cutemk.tileop import FLOAT_DTYPES, TensorSpec, TileOp, block, expect_dtype, expect_ndim, register_op


@register_op
@dataclass(frozen=True)
class RmsNormTile(TileOp):
    x: TensorSpec  # (rows, hidden)
    weight: TensorSpec  # (hidden,)
    eps: float = 1e-6
    block_m: int = 16

    name: ClassVar[str] = "rmsnorm"
    inputs: ClassVar[tuple[str, ...]] = ("x", "weight")
    outputs: ClassVar[tuple[str, ...]] = ("y",)

    def __post_init__(self) -> None:
        expect_ndim(self.x, 2, "rmsnorm x")
        expect_ndim(self.weight, 1, "rmsnorm weight")
        expect_dtype(self.x, FLOAT_DTYPES, "rmsnorm x")
        if self.weight.shape[0] != self.x.shape[1]:
            raise ShapeError(f"rmsnorm weight has {self.weight.shape[0]} elements, x has "
                             f"{self.x.shape[1]} columns")
        if not isinstance(self.block_m, int) or self.block_m < 1:
            raise ValueError(f"rmsnorm block_m must be a positive int, got {self.block_m!r}")
        if not self.eps > 0:
            raise ValueError(f"rmsnorm eps must be > 0, got {self.eps}")

    def output_specs(self):
        return {"y": TensorSpec(self.x.shape, self.x.dtype)}

    def grid(self):
        return (cdiv(self.x.shape[0], self.block_m),)

    def _dims(self, env):
        return tuple(d if isinstance(d, int) else d.eval(env) for d in self.x.shape)

    def reads(self, coord, env, data=None):
        rows, cols = self._dims(env)
        return {"x": (block(coord[0], self.block_m, rows), (0, cols)), "weight": ((0, cols),)}

    def writes(self, coord, env, data=None):
        rows, cols = self._dims(env)
        return {"y": (block(coord[0], self.block_m, rows), (0, cols))}

    def cost(self, coord, env):
        _, cols = self._dims(env)
        es = self.x.dtype.itemsize
        return tile_time_us(3.0 * self.block_m * cols, 2.0 * self.block_m * cols * es, self.x.dtype)

    def reference(self, coord, env, t):
        (r0, r1), _ = self.writes(coord, env)["y"]
        x = t["x"][r0:r1].float()
        y = x * (x.pow(2).mean(dim=-1, keepdim=True) + self.eps).rsqrt() * t["weight"].float()
        t["y"][r0:r1] = y.to(t["y"].dtype)


def rmsnorm(x: TensorSpec, weight: TensorSpec, *, eps: float = 1e-6, block_m: int = 16
            ) -> RmsNormTile:
    return RmsNormTile(x, weight, eps, block_m)
