"""Top-k softmax tile op (MoE gate): softmax over experts, top-k, optional renormalisation.

One block of tokens a task, one warp per token. Outputs ``weights`` (T, k) fp32 and ``ids``
(T, k) int32, ordered by decreasing weight (ties go to the lower expert id, on every backend).

The logits are (T, E), or the router's split-K partials (S, T, E) fp32 (``gemm_partial``),
summed here, so the router streams its weight over S times as many SMs with no reduce phase
between it and the top-k; ``logits_dtype`` then rounds the sums as the router's output would
have been rounded (bf16 logits route as a bf16 gate ``Linear`` does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import cutlass
import torch
from cutlass import BFloat16, Float16, Float32, Int32, cute

from cutemk.costmodel import tile_time_us
from cutemk.device.config import SIMT_WIDE_THREADS
from cutemk.device.config import WARP_SIZE as WARP
from cutemk.device.select import warp_topk_softmax
from cutemk.symbolic import cdiv
from cutemk.tileop import (
    FLOAT_DTYPES,
    TensorSpec,
    TileOp,
    block,
    blocks,
    boxes,
    expect_dtype,
    expect_ndim,
    register_op,
    span,
)


def topk_reference(
    logits: torch.Tensor, k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32, ids int32) of rows of fp32 ``logits`` (T, E), as the device picks them."""
    p = torch.softmax(logits, dim=-1)  # a NaN logit makes the row's weights NaN
    # picks: by logit, descending, ties to the lower id (stable sorts, not torch.topk, whose
    # CPU kernel prefers higher ids); NaN logits are never picked: they sort last and a pick
    # that lands on one is "no expert" (-1) with weight 0
    nan = torch.isnan(logits)
    order = torch.sort(
        logits.masked_fill(nan, -float("inf")), dim=-1, descending=True, stable=True
    ).indices
    order = order.gather(1, torch.sort(nan.gather(1, order).int(), dim=-1, stable=True).indices)
    ids = order[:, :k]
    none = nan.gather(1, ids)
    w = torch.where(none, 0.0, p.gather(1, ids))
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, torch.where(none, -1, ids).to(torch.int32)


@register_op
@dataclass(frozen=True)
class TopkSoftmaxTile(TileOp):
    logits: TensorSpec  # (tokens, experts), or split-K partials (splits, tokens, experts) fp32
    k: int = 2
    renormalize: bool = True
    block_m: int = 32
    # partials only: the dtype the summed logits are rounded to before the softmax (None: fp32)
    logits_dtype: torch.dtype | None = None

    name: ClassVar[str] = "topk_softmax"
    token_local: ClassVar[bool] = True
    # a warp a row, each row a latency chain: both consumer warpgroups, 8 rows at once
    simt_threads: ClassVar[int] = SIMT_WIDE_THREADS
    live_rows_inputs: ClassVar[tuple[str, ...]] = ("logits",)
    inputs: ClassVar[tuple[str, ...]] = ("logits",)
    outputs: ClassVar[tuple[str, ...]] = ("weights", "ids")

    def __post_init__(self) -> None:
        if len(self.logits.shape) == 3:
            expect_dtype(self.logits, (torch.float32,), "topk_softmax split-K partial logits")
            if not isinstance(self.logits.shape[0], int) or self.logits.shape[0] < 1:
                raise ValueError(
                    "topk_softmax: the partials' split count must be a static positive int, got "
                    f"{self.logits.shape[0]!r}"
                )
        else:
            expect_ndim(self.logits, 2, "topk_softmax logits")
            expect_dtype(self.logits, FLOAT_DTYPES, "topk_softmax logits")
            if self.logits_dtype is not None:
                raise ValueError(
                    "topk_softmax logits_dtype rounds summed split-K partials; (T, E) logits "
                    "are routed in their own dtype"
                )
        if self.logits_dtype not in (None, *FLOAT_DTYPES):
            raise ValueError(
                f"topk_softmax logits_dtype must be one of {FLOAT_DTYPES} or None, got "
                f"{self.logits_dtype!r}"
            )
        e = self.logits.shape[-1]
        if not isinstance(e, int):
            raise ValueError("topk_softmax: the number of experts must be a static int")
        if not isinstance(self.k, int) or not 1 <= self.k <= min(e, WARP):
            raise ValueError(
                f"topk_softmax k must be in [1, {min(e, WARP)}] (at most the experts and one "
                f"pick per lane of a warp), got {self.k!r}"
            )
        if not isinstance(self.block_m, int) or self.block_m < 1:
            raise ValueError(f"topk_softmax block_m must be a positive int, got {self.block_m!r}")

    @property
    def splits(self) -> int:
        """Split-K partials summed per logit (1: plain logits)."""
        return self.logits.shape[0] if len(self.logits.shape) == 3 else 1

    @property
    def tokens(self):
        return self.logits.shape[-2]

    @property
    def num_experts(self) -> int:
        return self.logits.shape[-1]

    @property
    def picks_over(self) -> int:
        """Experts the ids it writes name (what their readers check they route to)."""
        return self.num_experts

    def output_specs(self):
        t = self.tokens
        return {
            "weights": TensorSpec((t, self.k), torch.float32),
            "ids": TensorSpec((t, self.k), torch.int32),
        }

    def grid(self):
        return (cdiv(self.tokens, self.block_m),)

    def _rows(self, coord, env):
        t = self.tokens
        return block(coord[0], self.block_m, t if isinstance(t, int) else t.eval(env))

    def reads(self, coord, env, data=None):
        box = (self._rows(coord, env), (0, self.num_experts))
        return {"logits": ((0, self.splits), *box) if self._split else box}

    def writes(self, coord, env, data=None):
        r = self._rows(coord, env)
        return {"weights": (r, (0, self.k)), "ids": (r, (0, self.k))}

    uniform_cost: ClassVar[bool] = True

    def region_arrays(self, which, env, coords):
        t = self.tokens
        rows = blocks(coords[:, 0], self.block_m, t if isinstance(t, int) else t.eval(env))
        n_t = len(coords)
        if which == "writes":
            b = boxes(rows, span(0, self.k, n_t))
            return {"weights": b, "ids": b}
        experts = span(0, self.num_experts, n_t)
        if self._split:
            return {"logits": boxes(span(0, self.splits, n_t), rows, experts)}
        return {"logits": boxes(rows, experts)}

    @property
    def _split(self) -> bool:
        return len(self.logits.shape) == 3

    def cost(self, coord, env):
        e = self.num_experts
        return tile_time_us(
            8.0 * self.block_m * e, self.splits * self.block_m * e * 4.0, torch.float32
        )

    def reference(self, coord, env, t):
        r0, r1 = self._rows(coord, env)
        if self._split:  # summed in fp32 in split order, then rounded as the router's output
            logits = t["logits"][0, r0:r1].float()
            for s in range(1, self.splits):
                logits = logits + t["logits"][s, r0:r1].float()
            if self.logits_dtype is not None:
                logits = logits.to(self.logits_dtype).float()
        else:
            logits = t["logits"][r0:r1].float()
        t["weights"][r0:r1], t["ids"][r0:r1] = topk_reference(logits, self.k, self.renormalize)

    # -- device -----------------------------------------------------------------------------
    def device_smem_bytes(self) -> int:
        return 0  # a warp owns a whole token row: its lanes share through shuffles

    @cute.jit
    def device_tile(self, tensors, coord0: Int32, coord1: Int32, tidx: Int32, smem_ptr):
        """Rows ``[coord0 * block_m, +block_m)``; ``tensors`` = (mLogits, mWeights, mIds).

        mLogits: (T, E) float, mWeights: (T, k) fp32, mIds: (T, k) int32. One warp per token
        row (rows strided by the body's 8 warps): lane l holds experts l, l + 32, ... in
        registers (one coalesced load each); max and sum are butterfly reductions, and each of
        the k picks is two warp reductions (``redux.sync``) over the lanes' best untaken
        logits as order-preserving integer keys: the largest key, then the lowest id holding
        it (a butterfly arg-max of (logit, id) pairs took five rounds of two shuffles).
        Selected on logits (softmax is monotone in them), so only equal logits tie, never two
        probabilities that rounding made equal; ties go to the lower expert id. NaN logits are
        never picked; a row with fewer than k non-NaN logits gets id -1 in the remaining slots
        (``moe_route`` ignores ids outside [0, E)).
        """
        mLogits, mWeights, mIds = tensors[0], tensors[1], tensors[2]
        num_experts = self.num_experts
        per_lane = (num_experts + WARP - 1) // WARP
        warps = self.simt_threads // WARP
        tokens = mWeights.shape[0]
        # a live launch binds the logits' token dim to the live count (``live_rows_inputs``):
        # rows past it are absent, their picks "no expert" (-1) like an all-NaN row's
        logit_rows = mLogits.shape[1] if cutlass.const_expr(self._split) else mLogits.shape[0]
        lane = tidx % WARP
        row0 = coord0 * self.block_m
        row_end = cute.min(row0 + self.block_m, tokens)
        for row in range(row0 + tidx // WARP, row_end, warps):
            vals = cute.make_rmem_tensor((per_lane,), Float32)
            for q in cutlass.range_constexpr(per_lane):
                vals[q] = Float32(float("nan"))  # an absent row's: nothing is picked
            if row < logit_rows:
                # every logit of the lane (all split partials) loaded before any is used: one
                # round trip to memory, not one a register (ids past E read expert E - 1)
                got = [
                    self._logit(mLogits, row, cute.min(lane + q * WARP, num_experts - 1))
                    for q in range(per_lane)
                ]
                for q in cutlass.range_constexpr(per_lane):
                    if cutlass.const_expr(num_experts % WARP == 0):
                        vals[q] = got[q]
                    else:
                        if lane + q * WARP < num_experts:
                            vals[q] = got[q]
            valid = [
                True if num_experts % WARP == 0 else lane + q * WARP < num_experts
                for q in range(per_lane)
            ]
            ids = [lane + q * WARP for q in range(per_lane)]
            my_w, my_id = warp_topk_softmax(
                [vals[q] for q in range(per_lane)], ids, valid, self.k, self.renormalize
            )
            if lane < self.k:
                mIds[row, lane] = my_id.to(mIds.element_type)
                mWeights[row, lane] = my_w.to(mWeights.element_type)

    @cute.jit
    def _logit(self, mLogits, row: Int32, e: Int32) -> Float32:
        """Expert ``e``'s logit of token ``row`` in fp32 (split-K partials summed and rounded)."""
        v = Float32(0.0)
        if cutlass.const_expr(self._split):
            parts = [mLogits[s, row, e] for s in range(self.splits)]
            v = parts[0]
            for s in cutlass.range_constexpr(1, self.splits):
                v = v + parts[s]
            if cutlass.const_expr(self.logits_dtype is not None):
                v = v.to(_CUTE_DTYPES[self.logits_dtype]).to(Float32)
        else:
            v = mLogits[row, e].to(Float32)
        return v


_CUTE_DTYPES = {torch.float32: Float32, torch.bfloat16: BFloat16, torch.float16: Float16}


def topk_softmax(
    logits: TensorSpec,
    *,
    k: int = 2,
    renormalize: bool = True,
    block_m: int = 32,
    logits_dtype: torch.dtype | None = None,
) -> TopkSoftmaxTile:
    return TopkSoftmaxTile(logits, k, renormalize, block_m, logits_dtype)
