"""Qwen3's per-head q/k RMSNorm and rotary embedding, splitting a fused QKV projection.

Input ``qkv`` (T, (Hq + 2 Hkv) * D): one GEMM's output with the q, k and v projections side by
side. Per token: each query head and each key head is RMS-normalised over D (``q_weight`` /
``k_weight``, eps) and rotated by its position (``positions`` (T,) int32, data) with the
"rotate half" convention of Hugging Face's ``apply_rotary_pos_emb``, using a table
``cos_sin`` (max_positions, D) fp32 whose row p is [cos(p f_0..f_{D/2-1}), sin(...)] (see
:func:`rope_table`); value heads are copied. Outputs ``q`` (T, Hq, D), ``k`` (T, Hkv, D),
``v`` (T, Hkv, D) in ``qkv``'s dtype, computed in fp32 and rounded once.

A tile is ``block_m`` tokens by ``head_block`` heads (q, k and v heads counted together), so a
decode step's few tokens still spread over many SMs. Device: one warp per (token, head), a lane
holding D/32 consecutive dims; the position, the head's dims, the norm weight and (once the
position is in) the rotary row are loaded before the sum of squares needs them: two round trips
to memory an item. The sum of squares is a warp all-reduce and each dim's rotation partner
(i +- D/2) sits 16 lanes away (one shuffle). A position outside the table is bad data: that
token's q and k come out NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import cutlass
import torch
from cutlass import Float32, Int32, cute

from cutemk.costmodel import H200, tile_time_us
from cutemk.device.config import NUM_THREADS
from cutemk.device.config import WARP_SIZE as WARP
from cutemk.errors import ShapeError
from cutemk.symbolic import cdiv
from cutemk.tileop import (
    FLOAT_DTYPES,
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

WARPS = NUM_THREADS // WARP


def rope_table(max_positions: int, head_dim: int, theta: float = 1_000_000.0) -> torch.Tensor:
    """(max_positions, head_dim) fp32: row p = [cos(p f_i), sin(p f_i)], f_i = theta^(-2i/D),
    the default rotary frequencies of Hugging Face's Qwen3 / LLaMA."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    ang = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=1)


@register_op
@dataclass(frozen=True)
class QkNormRopeTile(TileOp):
    qkv: TensorSpec  # (T, (Hq + 2 Hkv) * D)
    q_weight: TensorSpec  # (D,)
    k_weight: TensorSpec  # (D,)
    cos_sin: TensorSpec  # (max_positions, D) fp32
    positions: TensorSpec  # (T,) int32
    heads: int
    kv_heads: int
    eps: float = 1e-6
    block_m: int = 4  # tokens a tile
    head_block: int = WARPS  # heads a tile (of the Hq + 2 Hkv)

    name: ClassVar[str] = "qk_norm_rope"
    inputs: ClassVar[tuple[str, ...]] = ("qkv", "q_weight", "k_weight", "cos_sin", "positions")
    outputs: ClassVar[tuple[str, ...]] = ("q", "k", "v")

    def __post_init__(self) -> None:
        expect_ndim(self.qkv, 2, "qk_norm_rope qkv")
        expect_dtype(self.qkv, FLOAT_DTYPES, "qk_norm_rope qkv")
        expect_ndim(self.cos_sin, 2, "qk_norm_rope cos_sin")
        expect_dtype(self.cos_sin, (torch.float32,), "qk_norm_rope cos_sin")
        expect_ndim(self.positions, 1, "qk_norm_rope positions")
        expect_dtype(self.positions, (torch.int32,), "qk_norm_rope positions")
        expect_same_dim(self.positions.shape[0], self.qkv.shape[0], "qk_norm_rope: tokens")
        d = self.head_dim
        for name, w in (("q_weight", self.q_weight), ("k_weight", self.k_weight)):
            expect_ndim(w, 1, f"qk_norm_rope {name}")
            expect_same_dim(w.shape[0], d, f"qk_norm_rope {name} vs the head dim")
        expect_same_dim(self.cos_sin.shape[1], d, "qk_norm_rope cos_sin width vs the head dim")
        if d % WARP or d > 8 * WARP:
            raise ShapeError(f"qk_norm_rope: head dim {d} must be a multiple of 32, at most 256")
        if self.heads % self.kv_heads:
            raise ShapeError(f"qk_norm_rope: {self.heads} heads not a multiple of {self.kv_heads}")
        expect_positive_int(self.block_m, "qk_norm_rope block_m")
        expect_positive_int(self.head_block, "qk_norm_rope head_block")

    @property
    def head_dim(self) -> int:
        width = self.qkv.shape[1]
        total = self.heads + 2 * self.kv_heads
        if not isinstance(width, int) or width % total:
            raise ShapeError(f"qk_norm_rope: qkv width {width} is not (Hq + 2 Hkv) * D")
        return width // total

    def output_specs(self):
        t, d, dt = self.qkv.shape[0], self.head_dim, self.qkv.dtype
        return {
            "q": TensorSpec((t, self.heads, d), dt),
            "k": TensorSpec((t, self.kv_heads, d), dt),
            "v": TensorSpec((t, self.kv_heads, d), dt),
        }

    @property
    def total_heads(self) -> int:
        return self.heads + 2 * self.kv_heads

    def grid(self):
        return (cdiv(self.qkv.shape[0], self.block_m), cdiv(self.total_heads, self.head_block))

    def _rows(self, coord, env):
        return block(coord[0], self.block_m, self.qkv.concrete(env)[0])

    def _heads(self, coord):
        """The tile's heads [h0, h1) and their parts among q, k and v heads (local ranges)."""
        h0, h1 = block(coord[1], self.head_block, self.total_heads)
        hq, hkv = self.heads, self.kv_heads

        def part(lo: int, n: int) -> tuple[int, int]:
            return (min(max(h0 - lo, 0), n), min(max(h1 - lo, 0), n))

        return (h0, h1), part(0, hq), part(hq, hkv), part(hq + hkv, hkv)

    def reads(self, coord, env, data=None):
        rows = self._rows(coord, env)
        d = self.head_dim
        (h0, h1), _, _, _ = self._heads(coord)
        return {
            "qkv": (rows, (h0 * d, h1 * d)),
            "q_weight": ((0, d),),
            "k_weight": ((0, d),),
            "cos_sin": full_box(self.cos_sin.concrete(env)),
            "positions": (rows,),
        }

    def writes(self, coord, env, data=None):
        rows, d = self._rows(coord, env), self.head_dim
        _, q, k, v = self._heads(coord)
        return {"q": (rows, q, (0, d)), "k": (rows, k, (0, d)), "v": (rows, v, (0, d))}

    uniform_cost: ClassVar[bool] = True

    def cost(self, coord, env):
        # latency-bound: a warp takes its (token, head) items one after another, each a round
        # trip to memory (its loads overlap); on the H200 a tile of 4 items measured ~2 us and
        # one of 16 items 3-5 us, where the bandwidth term alone says 0.3 us (which packed a
        # B=16 step's 48 tiles onto 28 SMs, one after another)
        # (uniform: every tile is priced as the first, whose tokens are the block's or, at
        # fewer tokens, all of them)
        w = self.head_block * self.head_dim
        stream = tile_time_us(8.0 * self.block_m * w, 2.0 * self.block_m * w * 2, self.qkv.dtype)
        r0, r1 = self._rows((0, 0), env)
        heads = min(self.head_block, self.total_heads)
        items_per_warp = -(-(r1 - r0) * heads // WARPS)
        return stream + H200.load_latency_us * (1 + items_per_warp)

    def reference(self, coord, env, t):
        r0, r1 = self._rows(coord, env)
        d, hq, hkv = self.head_dim, self.heads, self.kv_heads
        x = t["qkv"][r0:r1].float().view(r1 - r0, hq + 2 * hkv, d)
        pos = t["positions"][r0:r1].long()
        bad = (pos < 0) | (pos >= t["cos_sin"].shape[0])
        cs = t["cos_sin"][pos.clamp(0, t["cos_sin"].shape[0] - 1)]
        cos, sin = cs[:, None, : d // 2], cs[:, None, d // 2 :]

        def norm_rope(h, w):
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * w.float()
            h1, h2 = h[..., : d // 2], h[..., d // 2 :]
            out = torch.cat([h1 * cos - h2 * sin, h2 * cos + h1 * sin], dim=-1)
            return torch.where(bad[:, None, None], float("nan"), out)

        _, (q0, q1), (k0, k1), (v0, v1) = self._heads(coord)
        if q1 > q0:
            t["q"][r0:r1, q0:q1] = norm_rope(x[:, q0:q1], t["q_weight"]).to(t["q"].dtype)
        if k1 > k0:
            xk = x[:, hq + k0 : hq + k1]
            t["k"][r0:r1, k0:k1] = norm_rope(xk, t["k_weight"]).to(t["k"].dtype)
        if v1 > v0:
            t["v"][r0:r1, v0:v1] = x[:, hq + hkv + v0 : hq + hkv + v1].to(t["v"].dtype)

    @cute.jit
    def device_tile(self, tensors, coord0: Int32, coord1: Int32, tidx: Int32, smem_ptr):
        """Tile (coord0, coord1): tokens of row block ``coord0`` by heads of head block
        ``coord1``; ``tensors`` = (mQKV, mQW, mKW, mCS, mPos, mQ, mK, mV). Warp w takes the
        tile's (token, head) pairs w, w + 4, ..."""
        mQKV, mQW, mKW, mCS, mPos, mQ, mK, mV = tensors
        d, hq, hkv = self.head_dim, self.heads, self.kv_heads
        per = d // WARP
        half = d // 2
        tokens = mQKV.shape[0]
        max_pos = mCS.shape[0]
        t0 = coord0 * self.block_m
        t1 = cute.min(t0 + self.block_m, tokens)
        h0 = coord1 * self.head_block
        nh = cute.min(h0 + self.head_block, self.total_heads) - h0
        warp = tidx // WARP
        lane = tidx % WARP
        for item in range(warp, (t1 - t0) * nh, WARPS):
            tok = t0 + item // nh
            head = h0 + item % nh
            pos = mPos[tok]
            x = cute.make_rmem_tensor((per,), Float32)
            for i in cutlass.range_constexpr(per):
                x[i] = mQKV[tok, head * d + lane * per + i].to(Float32)
            if head >= hq + hkv:  # a value head: copied
                for i in cutlass.range_constexpr(per):
                    mV[tok, head - hq - hkv, lane * per + i] = x[i].to(mV.element_type)
            else:
                # the weight and the rotary row are in flight while the squares are summed
                w = cute.make_rmem_tensor((per,), Float32)
                for i in cutlass.range_constexpr(per):
                    if head < hq:
                        w[i] = mQW[lane * per + i].to(Float32)
                    else:
                        w[i] = mKW[lane * per + i].to(Float32)
                ok = pos >= 0 and pos < max_pos
                pos = cute.max(cute.min(pos, max_pos - 1), 0)
                cs = cute.make_rmem_tensor((2 * per,), Float32)
                for i in cutlass.range_constexpr(per):
                    f = (lane * per + i) % half
                    cs[2 * i] = mCS[pos, f]
                    cs[2 * i + 1] = mCS[pos, half + f]
                ss = Float32(0.0)
                for i in cutlass.range_constexpr(per):
                    ss = ss + x[i] * x[i]
                for sh in cutlass.range_constexpr(5):
                    ss = ss + cute.arch.shuffle_sync_bfly(ss, 1 << sh)
                rstd = cute.math.rsqrt(ss / Float32(d) + Float32(self.eps), fastmath=True)
                first = lane < WARP // 2  # dims [0, D/2): the partner is D/2 above
                out = cute.make_rmem_tensor((per,), Float32)
                for i in cutlass.range_constexpr(per):
                    y = x[i] * rstd * w[i]
                    partner = cute.arch.shuffle_sync_bfly(y, WARP // 2)
                    c = cs[2 * i]
                    s = cs[2 * i + 1]
                    r = y * c + partner * s
                    if first:
                        r = y * c - partner * s
                    if not ok:
                        r = Float32(math.nan)
                    out[i] = r
                for i in cutlass.range_constexpr(per):
                    if head < hq:
                        mQ[tok, head, lane * per + i] = out[i].to(mQ.element_type)
                    else:
                        mK[tok, head - hq, lane * per + i] = out[i].to(mK.element_type)


def qk_norm_rope(
    qkv: TensorSpec,
    q_weight: TensorSpec,
    k_weight: TensorSpec,
    cos_sin: TensorSpec,
    positions: TensorSpec,
    *,
    heads: int,
    kv_heads: int,
    eps: float = 1e-6,
    block_m: int = 4,
    head_block: int = WARPS,
) -> QkNormRopeTile:
    """Per-head RMSNorm + rotary embedding of q and k, v split off (see the module doc)."""
    return QkNormRopeTile(
        qkv, q_weight, k_weight, cos_sin, positions, heads, kv_heads, eps, block_m, head_block
    )
