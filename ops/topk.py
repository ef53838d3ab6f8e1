"""Top-k softmax tile op (MoE gate): softmax over experts, top-k, optional renormalisation.

One block of tokens a task. Outputs ``weights`` (T, k) fp32 and ``ids`` (T, k) int32, ordered by
decreasing weight (ties go to the lower expert id, as ``torch.topk`` does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from cutemk.costmodel import tile_time_us
from cutemk.symbolic import cdiv
from cutemk.tileop import FLOAT_DTYPES, TensorSpec, TileOp, block, expect_dtype, expect_ndim, register_op


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
        return {"weights": TensorSpec((t, self.k), torch.float32),
                "ids": TensorSpec((t, self.k), torch.int32)}

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
        w, ids = torch.topk(p, self.k, dim=-1)
        if self.renormalize:
            w = w / w.sum(dim=-1, keepdim=True)
        t["weights"][r0:r1] = w
        t["ids"][r0:r1] = ids.to(torch.int32)


def topk_softmax(logits: TensorSpec, *, k: int = 2, renormalize: bool = True, block_m: int = 32
                 ) -> TopkSoftmaxTile:
    return TopkSoftmaxTile(logits, k, renormalize, block_m)
