"""GEMM tile op: C = A @ B^T (B in nn.Linear's (out, in) layout), one (block_m, block_n) tile a task.

Optional fused epilogue ``silu_mul``: B stacks [W_gate; W_up] (2N rows) and tile n computes
``silu(A @ W_gate[n]^T) * (A @ W_up[n]^T)``, writing an (M, N) result (Qwen3 MLP's gate/up).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
import torch.nn.functional as F

from cutemk.costmodel import tile_time_us
from cutemk.errors import ShapeError
from cutemk.symbolic import IntLike, cdiv
from cutemk.tileop import (FLOAT_DTYPES, TensorSpec, TileOp, block, expect_dtype, expect_ndim,
                           expect_same_dim, register_op)

EPILOGUES = (None, "silu_mul")


@register_op
@dataclass(frozen=True)
class GemmTile(TileOp):
    a: TensorSpec  # (m, k)
    b: TensorSpec  # (n, k), or (2n, k) with epilogue "silu_mul"
    block_m: int = 64
    block_n: int = 64
    epilogue: Optional[str] = None
    out_dtype: Optional[torch.dtype] = None

    name: ClassVar[str] = "gemm"
    inputs: ClassVar[tuple[str, ...]] = ("a", "b")
    outputs: ClassVar[tuple[str, ...]] = ("c",)

    def __post_init__(self) -> None:
        expect_ndim(self.a, 2, "gemm a")
        expect_ndim(self.b, 2, "gemm b")
        expect_dtype(self.a, FLOAT_DTYPES, "gemm a")
        if self.b.dtype != self.a.dtype:
            raise TypeError(f"gemm b must have a's dtype {self.a.dtype}, got {self.b.dtype}")
        expect_same_dim(self.a.shape[1], self.b.shape[1], "gemm: a.shape[1] (K) vs b.shape[1]")
        if self.epilogue not in EPILOGUES:
            raise ValueError(f"gemm epilogue must be one of {EPILOGUES}, got {self.epilogue!r}")
        for f in ("block_m", "block_n"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                raise ValueError(f"gemm {f} must be a positive int, got {getattr(self, f)!r}")
        if self.epilogue == "silu_mul" and isinstance(self.b.shape[0], int) and self.b.shape[0] % 2:
            raise ShapeError(f"gemm silu_mul epilogue needs an even b.shape[0], got {self.b.shape[0]}")

    @property
    def m(self) -> IntLike:
        return self.a.shape[0]

    @property
    def n(self) -> IntLike:
        return self.b.shape[0] // 2 if self.epilogue == "silu_mul" else self.b.shape[0]

    @property
    def k(self) -> IntLike:
        return self.a.shape[1]

    def output_specs(self) -> dict[str, TensorSpec]:
        return {"c": TensorSpec((self.m, self.n), self.out_dtype or self.a.dtype)}

    def grid(self):
        return (cdiv(self.m, self.block_m), cdiv(self.n, self.block_n))

    def _dims(self, env):
        return tuple(d if isinstance(d, int) else d.eval(env) for d in (self.m, self.n, self.k))

    def reads(self, coord, env, data=None):
        m, n, k = self._dims(env)
        i, j = coord
        rows = block(j, self.block_n, n)
        b_box = ((rows[0], rows[1]), (0, k))
        if self.epilogue == "silu_mul":  # gate rows, then up rows: one box spanning both
            b_box = ((rows[0], n + rows[1]), (0, k))
        return {"a": (block(i, self.block_m, m), (0, k)), "b": b_box}

    def writes(self, coord, env, data=None):
        m, n, _ = self._dims(env)
        i, j = coord
        return {"c": (block(i, self.block_m, m), block(j, self.block_n, n))}

    def cost(self, coord, env):
        _, _, k = self._dims(env)
        bm, bn = self.block_m, self.block_n
        nb = 2 if self.epilogue == "silu_mul" else 1
        es = self.a.dtype.itemsize
        return tile_time_us(2.0 * bm * bn * k * nb, (bm + nb * bn) * k * es + bm * bn * es,
                            self.a.dtype)

    def reference(self, coord, env, t):
        m, n, _ = self._dims(env)
        (r0, r1), (c0, c1) = self.writes(coord, env)["c"]
        a = t["a"][r0:r1].float()
        if self.epilogue == "silu_mul":
            gate = a @ t["b"][c0:c1].float().T
            up = a @ t["b"][n + c0:n + c1].float().T
            out = F.silu(gate) * up
        else:
            out = a @ t["b"][c0:c1].float().T
        t["c"][r0:r1, c0:c1] = out.to(t["c"].dtype)


def gemm(a: TensorSpec, b: TensorSpec, *, block_m: int = 64, block_n: int = 64,
         epilogue: Optional[str] = None, out_dtype: Optional[torch.dtype] = None) -> GemmTile:
    """C = A @ B^T with an optional fused epilogue (see module doc)."""
    return GemmTile(a, b, block_m, block_n, epilogue, out_dtype)
