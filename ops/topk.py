"""Top-k softmax tile op (MoE gate): softmax over experts, top-k, optional renormalisation.

One block of tokens a task. Outputs ``weights`` (T, k) fp32 and ``ids`` (T, k) int32, ordered by
decreasing weight (ties go to the lower expert id, on every backend).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import cutlass
import torch
from cutlass import Float32, Int32, cute

from cutemk.costmodel import tile_time_us
from cutemk.device.config import NUM_THREADS
from cutemk.symbolic import cdiv
from cutemk.tileop import (
    FLOAT_DTYPES,
    TensorSpec,
    TileOp,
    block,
    expect_dtype,
    expect_ndim,
    register_op,
)


@register_op
@dataclass(frozen=True)
class TopkSoftmaxTile(TileOp):
    logits: TensorSpec  # (tokens, experts)
    k: int = 2
    renormalize: bool = True
    block_m: int = 32

    name: ClassVar[str] = "topk_softmax"
    inputs: ClassVar[tuple[str, ...]] = ("logits",)
    outputs: ClassVar[tuple[str, ...]] = ("weights", "ids")

    def __post_init__(self) -> None:
        expect_ndim(self.logits, 2, "topk_softmax logits")
        expect_dtype(self.logits, FLOAT_DTYPES, "topk_softmax logits")
        e = self.logits.shape[1]
        if not isinstance(e, int):
            raise ValueError("topk_softmax: the number of experts must be a static int")
        if not isinstance(self.k, int) or not 1 <= self.k <= e:
            raise ValueError(f"topk_softmax k must be in [1, {e}], got {self.k!r}")
        if not isinstance(self.block_m, int) or self.block_m < 1:
            raise ValueError(f"topk_softmax block_m must be a positive int, got {self.block_m!r}")

    def output_specs(self):
        t = self.logits.shape[0]
        return {
            "weights": TensorSpec((t, self.k), torch.float32),
            "ids": TensorSpec((t, self.k), torch.int32),
        }

    def grid(self):
        return (cdiv(self.logits.shape[0], self.block_m),)

    def _rows(self, coord, env):
        t = self.logits.shape[0]
        return block(coord[0], self.block_m, t if isinstance(t, int) else t.eval(env))

    def reads(self, coord, env, data=None):
        return {"logits": (self._rows(coord, env), (0, self.logits.shape[1]))}

    def writes(self, coord, env, data=None):
        r = self._rows(coord, env)
        return {"weights": (r, (0, self.k)), "ids": (r, (0, self.k))}

    def cost(self, coord, env):
        e = self.logits.shape[1]
        return tile_time_us(8.0 * self.block_m * e, self.block_m * e * 4.0, torch.float32)

    def reference(self, coord, env, t):
        r0, r1 = self._rows(coord, env)
        p = torch.softmax(t["logits"][r0:r1].float(), dim=-1)
        # a stable descending sort, not torch.topk: topk does not break ties to the lower
        # expert id on every backend (the CPU one picks higher ids first)
        w, ids = torch.sort(p, dim=-1, descending=True, stable=True)
        w, ids = w[:, : self.k], ids[:, : self.k]
        if self.renormalize:
            w = w / w.sum(dim=-1, keepdim=True)
        t["weights"][r0:r1] = w
        t["ids"][r0:r1] = ids.to(torch.int32)

    # -- device -----------------------------------------------------------------------------
    def device_smem_bytes(self) -> int:
        return 0  # one thread owns a whole token row: nothing is shared

    @cute.jit
    def device_tile(self, tensors, coord0: Int32, coord1: Int32, tidx: Int32, smem_ptr):
        """Rows ``[coord0 * block_m, +block_m)``; ``tensors`` = (mLogits, mWeights, mIds).

        mLogits: (T, E) float, mWeights: (T, k) fp32, mIds: (T, k) int32. One thread per token
        row (rows strided by NUM_THREADS when block_m > NUM_THREADS): E is at most a few hundred,
        so a serial sweep is cheaper than a warp reduction's shuffles at decode sizes.
        """
        mLogits, mWeights, mIds = tensors[0], tensors[1], tensors[2]
        num_experts = self.logits.shape[1]
        tokens = mLogits.shape[0]
        row0 = coord0 * self.block_m
        row_end = cute.min(row0 + self.block_m, tokens)
        for row in range(row0 + tidx, row_end, NUM_THREADS):
            # Selected on logits (softmax is monotone in them), so only equal logits tie, never
            # two probabilities that rounding made equal; ties go to the lower expert id.
            vmax = mLogits[row, 0].to(Float32)
            for e in range(1, num_experts):
                vmax = cute.arch.fmax(vmax, mLogits[row, e].to(Float32))
            denom = Float32(0.0)
            for e in range(num_experts):
                denom = denom + cute.math.exp(mLogits[row, e].to(Float32) - vmax)
            rW = cute.make_rmem_tensor((self.k,), Float32)
            # pick j = the largest (logit, -id) strictly below pick j-1 in that order
            prev_v = Float32(float("inf"))
            prev_e = Int32(-1)
            wsum = Float32(0.0)
            for j in cutlass.range_constexpr(self.k):
                best_v = Float32(-float("inf"))
                best_e = Int32(-1)
                for e in range(num_experts):
                    v = mLogits[row, e].to(Float32)
                    below = v < prev_v or (v == prev_v and e > prev_e)
                    if below and (v > best_v or best_e < 0):
                        best_v = v
                        best_e = e
                rW[j] = cute.math.exp(best_v - vmax) / denom
                wsum = wsum + rW[j]
                mIds[row, j] = best_e.to(mIds.element_type)
                prev_v = best_v
                prev_e = best_e
            for j in cutlass.range_constexpr(self.k):
                w = rW[j]
                if cutlass.const_expr(self.renormalize):
                    w = w / wsum
                mWeights[row, j] = w.to(mWeights.element_type)


def topk_softmax(
    logits: TensorSpec, *, k: int = 2, renormalize: bool = True, block_m: int = 32
) -> TopkSoftmaxTile:
    return TopkSoftmaxTile(logits, k, renormalize, block_m)
