"""Top-k softmax and the MoE routing in one task, for a few tokens.

At decode the routing is a chain of small steps before the experts' weights can stream:
router -> top-k -> route -> permute -> grouped GEMMs. Each hop between two of them is an
event (a release, a poll, then the next step's reload of what the last one wrote: ~1.5 us,
more with a cold L2). For at most :data:`MAX_TOKENS` tokens, :class:`MoeTopkRouteTile`
(``moe_topk_route``) does the top-k of every token (``topk_softmax``'s device rows, several
tokens a warp interleaved) and then the whole routing (``moe_route``'s tile) in one task of one
CTA, the ids passing between them through global memory under the SIMT group's barrier.

Outputs are those of both ops: ``weights`` and ``ids`` (T, k), ``tile_info``, ``row_token``,
``slot_row``, ``exp_indptr`` (see ``ops.moe_route``); the logits are (T, E), or the router's
split-K partials (S, T, E) fp32 with ``logits_dtype`` rounding their sums (``ops.topk``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import torch
from cutlass import Int32, cute

from cutemk.device.config import simt_sync
from cutemk.symbolic import upper
from cutemk.tileop import TensorSpec, TileOp, full_box, register_op

from .moe_route import MoeRouteTile
from .topk import TopkSoftmaxTile

MAX_TOKENS = 64
"""Most tokens one task routes: its top-k runs on one CTA's four SIMT warps."""


@register_op
@dataclass(frozen=True)
class MoeTopkRouteTile(TileOp):
    logits: TensorSpec  # (tokens, experts), or split-K partials (splits, tokens, experts) fp32
    k: int
    renormalize: bool = True
    block_m: int = 64  # rows of a grouped tile (the grouped GEMMs' block_m)
    logits_dtype: torch.dtype | None = None

    name: ClassVar[str] = "moe_topk_route"
    inputs: ClassVar[tuple[str, ...]] = ("logits",)
    outputs: ClassVar[tuple[str, ...]] = (
        "weights",
        "ids",
        "tile_info",
        "row_token",
        "slot_row",
        "exp_indptr",
    )

    def __post_init__(self) -> None:
        most = upper(self.logits.shape[-2])
        if most > MAX_TOKENS:
            raise ValueError(
                f"moe_topk_route routes at most {MAX_TOKENS} tokens in one task (its top-k runs "
                f"on one CTA); got up to {most}: use topk_softmax and moe_route"
            )
        self.topk  # noqa: B018 (validates k, the logits and logits_dtype)
        self.route  # noqa: B018

    @cached_property
    def topk(self) -> TopkSoftmaxTile:
        """The top-k over every token: one block of all of them."""
        most = upper(self.logits.shape[-2])
        return TopkSoftmaxTile(self.logits, self.k, self.renormalize, most, self.logits_dtype)

    @cached_property
    def route(self) -> MoeRouteTile:
        ids = TensorSpec((self.logits.shape[-2], self.k), torch.int32)
        return MoeRouteTile(ids, self.topk.num_experts, self.block_m)

    @property
    def num_experts(self) -> int:
        return self.topk.num_experts

    @property
    def max_tiles(self):
        return self.route.max_tiles

    def output_specs(self):
        return {**self.topk.output_specs(), **self.route.output_specs()}

    def grid(self):
        return (1,)

    def reads(self, coord, env, data=None):
        return {"logits": full_box(self.logits.concrete(env))}

    def writes(self, coord, env, data=None):
        return {n: full_box(s.concrete(env)) for n, s in self.output_specs().items()}

    def cost(self, coord, env):
        return self.topk.cost(coord, env) + self.route.cost(coord, env)

    def reference(self, coord, env, t):
        self.topk.reference((0,), env, t)
        self.route.reference((0,), env, t)

    # -- device -----------------------------------------------------------------------------
    def device_smem_bytes(self) -> int:
        return self.route.device_smem_bytes()  # the top-k keeps its rows in registers

    @cute.jit
    def device_tile(self, tensors, coord0: Int32, coord1: Int32, tidx: Int32, smem_ptr):
        """``tensors`` = (mLogits, mWeights, mIds, mTileInfo, mRowToken, mSlotRow, mIndptr).

        The top-k writes weights and ids for every token; the SIMT group's barrier then orders
        those writes before the routing reads the ids back (one CTA: its own writes, seen
        through L1 after the barrier); the routing tile runs as ``moe_route`` does."""
        mLogits, mWeights, mIds, mTileInfo, mRowToken, mSlotRow, mIndptr = tensors
        per_warp = self.topk.rows_per_warp(upper(self.logits.shape[-2]))
        self.topk.device_rows((mLogits, mWeights, mIds), Int32(0), mIds.shape[0], tidx, per_warp)
        simt_sync()
        self.route.device_tile(
            (mIds, mTileInfo, mRowToken, mSlotRow, mIndptr), coord0, coord1, tidx, smem_ptr
        )


def moe_topk_route(
    logits: TensorSpec,
    *,
    k: int,
    renormalize: bool = True,
    block_m: int = 64,
    logits_dtype: torch.dtype | None = None,
) -> MoeTopkRouteTile:
    return MoeTopkRouteTile(logits, k, renormalize, block_m, logits_dtype)
