"""Qwen3's per-head q/k RMSNorm and rotary embedding, splitting a fused QKV projection.

Input ``qkv`` (T, (Hq + 2 Hkv) * D): one GEMM's output with the q, k and v projections side by
side. Per token: each query head and each key head is RMS-normalised over D (``q_weight`` /
``k_weight``, eps) and rotated by its position (``positions`` (T,) int32, data) with the
"rotate half" convention of Hugging Face's ``apply_rotary_pos_emb``, using a table
``cos_sin`` (max_positions, D) fp32 whose row p is [cos(p f_0..f_{D/2-1}), sin(...)] (see
:func:`rope_table`); value heads are copied. Outputs ``q`` (T, Hq, D), ``k`` (T, Hkv, D),
``v`` (T, Hkv, D) in ``qkv``'s dtype, computed in fp32 and rounded once.

Two fusions take a decode step's tail of phases into this one (``cutemk.layers``):

- **The split projection's reduce.** ``qkv`` may be the fp32 partials (split_k, T, W) of a
  projection split along K (``ops.gemm_partial``): a tile sums its columns' partials itself,
  and with ``norm_eps`` scales each row by ``1 / rms(x_row)`` (``x`` (T, K), the projection's
  un-normalised A operand: an RMSNorm folded into the weight, as ``gemm_split_reduce`` does),
  so the projection needs no reduce phase. The outputs take ``out_dtype``.
- **The KV-cache append** (``ops.kv_append``): given ``k_cache`` / ``v_cache`` (pages,
  page_size, Hkv, D), ``page_table`` (T, max_pages) and ``seq_lens`` (T,) (one token a
  sequence), the key and value heads go straight to sequence t's position ``seq_lens[t] - 1``
  in its pages, in place: the outputs are ``q``, ``k_cache_out``, ``v_cache_out``. A position
  or page outside the cache is bad data: that row is not written (attention then reads a bad
  page or length and comes out NaN), as ``kv_append`` does.

A tile is ``block_m`` tokens by ``head_block`` heads (q, k and v heads counted together), so a
decode step's few tokens still spread over many SMs. Device: one warp per (token, head), a lane
holding D/32 consecutive dims; the position, the head's dims (every range's partials at once),
the norm weight, x's row (for its sum of squares) and (once the position is in) the rotary row
are loaded before the sums need them: two round trips to memory an item. The sum of squares is
a warp all-reduce and each dim's rotation partner (i +- D/2) sits 16 lanes away (one shuffle).
A position outside the table is bad data: that token's q and k come out NaN.
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
from cutemk.device.vectors import row_vectors, vec16
from cutemk.errors import GraphError, ShapeError
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

from .kv_append import append_target

WARPS = NUM_THREADS // WARP


def rope_table(max_positions: int, head_dim: int, theta: float = 1_000_000.0) -> torch.Tensor:
    """(max_positions, head_dim) fp32: row p = [cos(p f_i), sin(p f_i)], f_i = theta^(-2i/D),
    the default rotary frequencies of Hugging Face's Qwen3 / LLaMA."""
    for name, v in (("max_positions", max_positions), ("head_dim", head_dim)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"rope_table {name} must be a positive int, got {v!r}")
    if head_dim % 2:
        raise ValueError(f"rope_table head_dim must be even (cos and sin halves), got {head_dim}")
    if not (isinstance(theta, (int, float)) and math.isfinite(theta) and theta > 0):
        raise ValueError(f"rope_table theta must be a finite number > 0, got {theta!r}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    ang = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=1)


@register_op
@dataclass(frozen=True)
class QkNormRopeTile(TileOp):
    qkv: TensorSpec  # (T, (Hq + 2 Hkv) * D), or the split projection's partials (S, T, ...) fp32
    q_weight: TensorSpec  # (D,)
    k_weight: TensorSpec  # (D,)
    cos_sin: TensorSpec  # (max_positions, D) fp32
    positions: TensorSpec  # (T,) int32
    heads: int
    kv_heads: int
    eps: float = 1e-6
    block_m: int = 4  # tokens a tile
    head_block: int = WARPS  # heads a tile (of the Hq + 2 Hkv)
    # with split partials: the projection's A operand (T, K) for a folded RMSNorm of eps
    # ``norm_eps`` (each row's sum scaled by 1 / rms(x_row)); None: no norm
    x: TensorSpec | None = None
    norm_eps: float | None = None
    # the decode step's KV-cache append (all four, or none; see the module doc)
    k_cache: TensorSpec | None = None  # (pages, page_size, Hkv, D)
    v_cache: TensorSpec | None = None
    page_table: TensorSpec | None = None  # (T, max_pages) int32
    seq_lens: TensorSpec | None = None  # (T,) int32, counting the new token
    out_dtype: torch.dtype | None = None  # the outputs' dtype (None: qkv's; split: needed)

    name: ClassVar[str] = "qk_norm_rope"
    token_local: ClassVar[bool] = True
    live_updates: ClassVar[bool] = True  # rows past the positions' (and lengths') extent skip
    uniform_cost: ClassVar[bool] = True

    @property
    def split(self) -> bool:
        """``qkv`` is a split projection's fp32 partials (S, T, W)."""
        return len(self.qkv.shape) == 3

    @property
    def appends(self) -> bool:
        """k and v go into the paged cache (``kv_append`` fused)."""
        return self.k_cache is not None

    @property
    def inputs(self) -> tuple[str, ...]:
        base = ("qkv", "q_weight", "k_weight", "cos_sin", "positions")
        cache = ("k_cache", "v_cache", "page_table", "seq_lens")
        return base + ("x",) * (self.x is not None) + cache * self.appends

    @property
    def outputs(self) -> tuple[str, ...]:
        return ("q", "k_cache_out", "v_cache_out") if self.appends else ("q", "k", "v")

    @property
    def updates(self) -> dict[str, str]:
        return {"k_cache_out": "k_cache", "v_cache_out": "v_cache"} if self.appends else {}

    @property
    def scatter_outputs(self) -> tuple[str, ...]:
        return ("k_cache_out", "v_cache_out") if self.appends else ()

    @property
    def data_inputs(self) -> tuple[str, ...]:
        return ("page_table", "seq_lens") if self.appends else ()

    @property
    def live_rows_inputs(self) -> tuple[str, ...]:
        """A tile takes the rows below these inputs' extents (``TileOp.live_rows_inputs``)."""
        return ("positions", "page_table", "seq_lens") if self.appends else ("positions",)

    def __post_init__(self) -> None:
        expect_positive_int(self.heads, "qk_norm_rope heads")
        expect_positive_int(self.kv_heads, "qk_norm_rope kv_heads")
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)):
            raise TypeError(f"qk_norm_rope eps must be a number, got {self.eps!r}")
        if not 0 < self.eps < float("inf"):  # 0 on an all-zero row, or negative: NaN q and k
            raise ValueError(f"qk_norm_rope eps must be positive and finite, got {self.eps}")
        if self.split:
            expect_dtype(self.qkv, (torch.float32,), "qk_norm_rope split partials")
            if not isinstance(self.qkv.shape[0], int):
                raise ShapeError("qk_norm_rope: the number of K ranges must be static")
            if self.out_dtype is None:
                raise ValueError("qk_norm_rope: split partials need out_dtype")
        else:
            expect_ndim(self.qkv, 2, "qk_norm_rope qkv")
            expect_dtype(self.qkv, FLOAT_DTYPES, "qk_norm_rope qkv")
        if self.out_dtype is not None and self.out_dtype not in FLOAT_DTYPES:
            raise TypeError(f"qk_norm_rope out_dtype must be one of {FLOAT_DTYPES}")
        if (self.x is None) != (self.norm_eps is None):
            raise ValueError("qk_norm_rope: x and norm_eps go together")
        if self.x is not None:
            if not self.split:
                raise ValueError("qk_norm_rope: x (a folded norm) only with split partials")
            expect_ndim(self.x, 2, "qk_norm_rope x")
            expect_dtype(self.x, FLOAT_DTYPES, "qk_norm_rope x")
            expect_same_dim(self.x.shape[0], self.tokens, "qk_norm_rope: x rows vs tokens")
            if not isinstance(self.x.shape[1], int):
                raise ShapeError("qk_norm_rope: x's width (the projection's K) must be static")
            if not self.norm_eps > 0:
                raise ValueError(f"qk_norm_rope norm_eps must be positive, got {self.norm_eps}")
        expect_ndim(self.cos_sin, 2, "qk_norm_rope cos_sin")
        expect_dtype(self.cos_sin, (torch.float32,), "qk_norm_rope cos_sin")
        expect_ndim(self.positions, 1, "qk_norm_rope positions")
        expect_dtype(self.positions, (torch.int32,), "qk_norm_rope positions")
        expect_same_dim(self.positions.shape[0], self.tokens, "qk_norm_rope: tokens")
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
        self._check_cache()

    def check_producers(self, producers) -> None:
        """The folded norm's x must be the A operand of the partial GEMM that made ``qkv``
        (the same width K; a wrong x would scale the rows silently wrong)."""
        p = producers.get("qkv")
        gemm = p is not None and p.name == "gemm_partial"
        if self.x is not None and gemm and p.a.shape[1] != self.x.shape[1]:
            raise GraphError(
                f"qk_norm_rope: x is {self.x.shape[1]} wide, the projection's K is {p.a.shape[1]}"
            )

    def _check_cache(self) -> None:
        given = [
            a is not None for a in (self.k_cache, self.v_cache, self.page_table, self.seq_lens)
        ]
        if not any(given):
            return
        if not all(given):
            raise ValueError(
                "qk_norm_rope: the append takes k_cache, v_cache, page_table, seq_lens"
            )
        dt = self.dtype
        for arg in ("k_cache", "v_cache"):
            spec = getattr(self, arg)
            expect_ndim(spec, 4, f"qk_norm_rope {arg}")
            if spec.dtype != dt:
                raise TypeError(f"qk_norm_rope {arg} must have the outputs' dtype {dt}")
        for i in range(4):
            expect_same_dim(
                self.k_cache.shape[i], self.v_cache.shape[i], f"qk_norm_rope cache dim {i}"
            )
        expect_same_dim(self.k_cache.shape[2], self.kv_heads, "qk_norm_rope cache heads")
        expect_same_dim(self.k_cache.shape[3], self.head_dim, "qk_norm_rope cache head dim")
        expect_ndim(self.page_table, 2, "qk_norm_rope page_table")
        expect_dtype(self.page_table, (torch.int32,), "qk_norm_rope page_table")
        expect_ndim(self.seq_lens, 1, "qk_norm_rope seq_lens")
        expect_dtype(self.seq_lens, (torch.int32,), "qk_norm_rope seq_lens")
        expect_same_dim(self.page_table.shape[0], self.tokens, "qk_norm_rope page_table rows")
        expect_same_dim(self.seq_lens.shape[0], self.tokens, "qk_norm_rope seq_lens")

    @property
    def tokens(self):
        return self.qkv.shape[-2]

    @property
    def dtype(self) -> torch.dtype:
        return self.out_dtype or self.qkv.dtype

    @property
    def head_dim(self) -> int:
        width = self.qkv.shape[-1]
        total = self.heads + 2 * self.kv_heads
        if not isinstance(width, int) or width % total:
            raise ShapeError(f"qk_norm_rope: qkv width {width} is not (Hq + 2 Hkv) * D")
        return width // total

    def output_specs(self):
        t, d, dt = self.tokens, self.head_dim, self.dtype
        q = TensorSpec((t, self.heads, d), dt)
        if self.appends:
            return {"q": q, "k_cache_out": self.k_cache, "v_cache_out": self.v_cache}
        kv = TensorSpec((t, self.kv_heads, d), dt)
        return {"q": q, "k": kv, "v": kv}

    @property
    def total_heads(self) -> int:
        return self.heads + 2 * self.kv_heads

    def grid(self):
        return (cdiv(self.tokens, self.block_m), cdiv(self.total_heads, self.head_block))

    def _rows(self, coord, env):
        return block(coord[0], self.block_m, self.qkv.concrete(env)[-2])

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
        cols = (h0 * d, h1 * d)
        r = {
            "qkv": ((0, self.qkv.shape[0]), rows, cols) if self.split else (rows, cols),
            "q_weight": ((0, d),),
            "k_weight": ((0, d),),
            "cos_sin": full_box(self.cos_sin.concrete(env)),
            "positions": (rows,),
        }
        if self.x is not None:
            r["x"] = (rows, (0, self.x.concrete(env)[1]))
        if self.appends:
            r.update(k_cache=[], v_cache=[], seq_lens=(rows,))
            r["page_table"] = (rows, (0, self.page_table.concrete(env)[1]))
        return r

    def _targets(self, rows, t) -> list[tuple[int, int, int]]:
        """(token, page, slot) of each row of ``rows`` whose new key and value go to the cache
        (bad positions and pages left out: ``ops.kv_append``'s rule)."""
        targets = ((tok, append_target(tok, t)) for tok in range(*rows))
        return [(tok, *target) for tok, target in targets if target is not None]

    def writes(self, coord, env, data=None):
        rows, d = self._rows(coord, env), self.head_dim
        _, q, k, v = self._heads(coord)
        if not self.appends:
            return {"q": (rows, q, (0, d)), "k": (rows, k, (0, d)), "v": (rows, v, (0, d))}
        w = {"q": (rows, q, (0, d))}
        pages, page = self.k_cache.concrete(env)[:2]
        for oname, heads in (("k_cache_out", k), ("v_cache_out", v)):
            if heads[1] <= heads[0]:
                w[oname] = []
            elif data is None:  # anywhere in the pages: a superset
                w[oname] = ((0, pages), (0, page), heads, (0, d))
            else:
                w[oname] = [
                    ((pg, pg + 1), (slot, slot + 1), heads, (0, d))
                    for _, pg, slot in self._targets(rows, data)
                ]
        return w

    def cost(self, coord, env):
        # latency-bound: a warp takes its (token, head) items one after another, each a round
        # trip to memory (its loads overlap); on the H200 a tile of 4 items measured ~2 us and
        # one of 16 items 3-5 us, where the bandwidth term alone says 0.3 us (which packed a
        # B=16 step's 48 tiles onto 28 SMs, one after another)
        # (uniform: every tile is priced as the first, whose tokens are the block's or, at
        # fewer tokens, all of them)
        w = self.head_block * self.head_dim
        reads = 2.0 * self.block_m * w
        if self.split:
            reads = 4.0 * self.qkv.shape[0] * self.block_m * w
        if self.x is not None:  # a row of x an item
            reads += self.x.dtype.itemsize * self.block_m * self.head_block * int(self.x.shape[1])
        stream = tile_time_us(8.0 * self.block_m * w, reads + 2.0 * self.block_m * w, self.dtype)
        r0, r1 = self._rows((0, 0), env)
        heads = min(self.head_block, self.total_heads)
        items_per_warp = -(-(r1 - r0) * heads // WARPS)
        return stream + H200.load_latency_us * (1 + items_per_warp)

    def _input_rows(self, t, r0: int, r1: int) -> torch.Tensor:
        """Rows [r0, r1) of the projection's output in fp32 (the partials summed in range
        order and scaled by the folded norm)."""
        if not self.split:
            return t["qkv"][r0:r1].float()
        parts = t["qkv"][:, r0:r1].float()
        y = parts[0].clone()
        for s in range(1, parts.shape[0]):
            y = y + parts[s]
        if self.x is not None:
            x = t["x"][r0:r1].float()
            y = y * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        return y

    def reference(self, coord, env, t):
        r0, r1 = self._rows(coord, env)
        r1 = min(r1, t["positions"].shape[0])  # rows past it absent, as on the device
        if self.appends:
            r1 = min(r1, t["page_table"].shape[0], t["seq_lens"].shape[0])
        if r1 <= r0:
            return
        d, hq, hkv = self.head_dim, self.heads, self.kv_heads
        x = self._input_rows(t, r0, r1).view(r1 - r0, hq + 2 * hkv, d)
        pos = t["positions"][r0:r1].long()
        bad = (pos < 0) | (pos >= t["cos_sin"].shape[0])
        cs = t["cos_sin"][pos.clamp(0, t["cos_sin"].shape[0] - 1)]
        cos, sin = cs[:, None, : d // 2], cs[:, None, d // 2 :]
        dt = self.dtype

        def norm_rope(h, w):
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * w.float()
            h1, h2 = h[..., : d // 2], h[..., d // 2 :]
            out = torch.cat([h1 * cos - h2 * sin, h2 * cos + h1 * sin], dim=-1)
            return torch.where(bad[:, None, None], float("nan"), out)

        _, (q0, q1), (k0, k1), (v0, v1) = self._heads(coord)
        if q1 > q0:
            t["q"][r0:r1, q0:q1] = norm_rope(x[:, q0:q1], t["q_weight"]).to(dt)
        k = norm_rope(x[:, hq + k0 : hq + k1], t["k_weight"]).to(dt) if k1 > k0 else None
        v = x[:, hq + hkv + v0 : hq + hkv + v1].to(dt) if v1 > v0 else None
        if not self.appends:
            if k is not None:
                t["k"][r0:r1, k0:k1] = k
            if v is not None:
                t["v"][r0:r1, v0:v1] = v
            return
        for tok, pg, slot in self._targets((r0, r1), t):
            if k is not None:
                t["k_cache_out"][pg, slot, k0:k1] = k[tok - r0]
            if v is not None:
                t["v_cache_out"][pg, slot, v0:v1] = v[tok - r0]

    @cute.jit
    def _issue_head(self, tensors, tok: Int32, head: Int32, lane: Int32, ps, xv):
        """Lane ``lane``'s loads of (token, head), issued, not used: its D/32 dims of the
        projection's output (or of every range's partials) into ``ps`` and, for the folded
        norm, its share of x's row into ``xv``."""
        mQKV = tensors[0]
        d = self.head_dim
        per = d // WARP
        if cutlass.const_expr(not self.split):
            for i in cutlass.range_constexpr(per):
                ps[0, i] = mQKV[tok, head * d + lane * per + i].to(Float32)
        else:
            for s in cutlass.range_constexpr(self.qkv.shape[0]):
                for i in cutlass.range_constexpr(per):
                    ps[s, i] = mQKV[s, tok, head * d + lane * per + i]
        if cutlass.const_expr(self.x is not None):
            mX = tensors[5]
            k = self.x.shape[1]
            vx = xv.shape[1]
            x3 = row_vectors(mX, mX.shape[0], k, vx)
            for j in cutlass.range_constexpr(xv.shape[0]):
                c = cute.min(lane + j * WARP, k // vx - 1)  # a short last round re-reads
                v = cute.make_rmem_tensor((vx,), mX.element_type)  # a compact vector: one
                cute.autovec_copy(x3[tok, c, None], v)  # 16-byte load (a row of xv is not)
                for e in cutlass.range_constexpr(vx):
                    xv[j, e] = v[e]

    @cute.jit
    def _head_values(self, ps, xv, lane: Int32, x):
        """The (token, head) values of :meth:`_issue_head`'s loads into ``x`` (fp32): the
        partials summed in range order, scaled by 1 / sqrt(mean(x_row^2) + norm_eps)."""
        per = self.head_dim // WARP
        scale = Float32(1.0)
        if cutlass.const_expr(self.x is not None):
            k = self.x.shape[1]
            vx = xv.shape[1]
            ss = Float32(0.0)
            if cutlass.const_expr((k // vx) % WARP == 0):  # every lane's rounds are its own
                sq = [Float32(0.0) for _ in range(vx)]  # vx chains, not one of K / 32 steps
                for j in cutlass.range_constexpr(xv.shape[0]):
                    for e in cutlass.range_constexpr(vx):
                        v = xv[j, e].to(Float32)
                        sq[e] = sq[e] + v * v
                ss = sq[0]
                for e in cutlass.range_constexpr(1, vx):
                    ss = ss + sq[e]
            else:
                for j in cutlass.range_constexpr(xv.shape[0]):
                    if lane + j * WARP < k // vx:
                        for e in cutlass.range_constexpr(vx):
                            v = xv[j, e].to(Float32)
                            ss = ss + v * v
            ss = cute.arch.warp_reduction_sum(ss)
            scale = cute.math.rsqrt(ss / Float32(k) + Float32(self.norm_eps))
        for i in cutlass.range_constexpr(per):
            acc = ps[0, i]
            for s in cutlass.range_constexpr(1, ps.shape[0]):
                acc = acc + ps[s, i]
            x[i] = acc * scale

    @cute.jit
    def _cache_slot(self, tensors, tok: Int32, seq: Int32) -> Int32:
        """Token ``tok``'s slot in the cache (page * page_size + offset) for its length
        ``seq``, -1 for bad data. The page-table load is always in bounds (a clamped index),
        so no branch waits on ``seq`` before it."""
        n_in = len(self.inputs)
        mKc, mPT = tensors[n_in - 4], tensors[n_in - 2]
        page = self.k_cache.shape[1]
        cap = mPT.shape[1] * page
        pos = seq - 1
        pg = mPT[tok, cute.max(cute.min(pos, cap - 1), 0) // page]
        slot = pg * page + pos % page
        if pos < 0 or pos >= cap or pg < 0 or pg >= mKc.shape[0]:
            slot = Int32(-1)
        return slot

    @cute.jit
    def device_tile(self, tensors, coord0: Int32, coord1: Int32, tidx: Int32, smem_ptr):
        """Tile (coord0, coord1): tokens of row block ``coord0`` by heads of head block
        ``coord1``; ``tensors`` = (mQKV, mQW, mKW, mCS, mPos, [mX,] [mKc, mVc, mPT, mLen,]
        mQ, mK, mV), mK / mV the caches themselves with the append. Warp w takes the tile's
        (token, head) pairs w, w + 4, ...; an item's loads are all issued before the first
        use of any of them (no branch on loaded data between), so an item costs about two
        round trips to memory: its inputs, then the rotary row and the page id."""
        mQW, mKW, mCS, mPos = tensors[1], tensors[2], tensors[3], tensors[4]
        n_in = len(self.inputs)
        mQ, mK, mV = tensors[n_in], tensors[n_in + 1], tensors[n_in + 2]
        d, hq, hkv = self.head_dim, self.heads, self.kv_heads
        per = d // WARP
        half = d // 2
        # rows past the positions' extent (and with the append the page table's and lengths')
        # are absent: a live launch binds them to the live count (``live_rows_inputs``)
        tokens = mPos.shape[0]
        if cutlass.const_expr(self.appends):
            tokens = cute.min(
                tokens, cute.min(tensors[n_in - 2].shape[0], tensors[n_in - 1].shape[0])
            )
        max_pos = mCS.shape[0]
        t0 = coord0 * self.block_m
        t1 = cute.min(t0 + self.block_m, tokens)
        h0 = coord1 * self.head_block
        nh = cute.min(h0 + self.head_block, self.total_heads) - h0
        warp = tidx // WARP
        lane = tidx % WARP
        if cutlass.const_expr(self.appends):  # the caches as (slots, Hkv, D)
            page = self.k_cache.shape[1]
            slots = mK.shape[0] * page
            lay = cute.make_layout((slots, hkv, d), stride=(hkv * d, d, 1))
            mK = cute.make_tensor(mK.iterator, lay)
            mV = cute.make_tensor(mV.iterator, lay)
        ranges = self.qkv.shape[0] if self.split else 1
        vx, rounds, x_dtype = 1, 1, mQ.element_type
        if cutlass.const_expr(self.x is not None):
            x_dtype = tensors[5].element_type
            vx = vec16(self.x.dtype.itemsize, self.x.shape[1])
            rounds = -(-(self.x.shape[1] // vx) // WARP)
        for item in range(warp, (t1 - t0) * nh, WARPS):
            tok = t0 + item // nh
            head = h0 + item % nh
            pos = mPos[tok]
            seq = Int32(0)
            if cutlass.const_expr(self.appends):
                seq = tensors[n_in - 1][tok]
            ps = cute.make_rmem_tensor((ranges, per), Float32)
            xv = cute.make_rmem_tensor((rounds, vx), x_dtype)
            self._issue_head(tensors, tok, head, lane, ps, xv)
            # the norm weight (q's or k's) and the rotary row (a value head uses neither)
            w = cute.make_rmem_tensor((per,), Float32)
            is_q = head < hq
            for i in cutlass.range_constexpr(per):
                wq = mQW[lane * per + i].to(Float32)
                wk = mKW[lane * per + i].to(Float32)
                w[i] = wk
                if is_q:
                    w[i] = wq
            ok = pos >= 0 and pos < max_pos
            pos = cute.max(cute.min(pos, max_pos - 1), 0)
            cs = cute.make_rmem_tensor((2 * per,), Float32)
            for i in cutlass.range_constexpr(per):
                f = (lane * per + i) % half
                cs[2 * i] = mCS[pos, f]
                cs[2 * i + 1] = mCS[pos, half + f]
            row = tok  # where k and v go: the token's row, or its cache slot
            if cutlass.const_expr(self.appends):
                row = self._cache_slot(tensors, tok, seq)
            x = cute.make_rmem_tensor((per,), Float32)
            self._head_values(ps, xv, lane, x)
            if head >= hq + hkv:  # a value head: copied
                if row >= 0:
                    for i in cutlass.range_constexpr(per):
                        mV[row, head - hq - hkv, lane * per + i] = x[i].to(mV.element_type)
            else:
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
                if is_q:
                    for i in cutlass.range_constexpr(per):
                        mQ[tok, head, lane * per + i] = out[i].to(mQ.element_type)
                elif row >= 0:
                    for i in cutlass.range_constexpr(per):
                        mK[row, head - hq, lane * per + i] = out[i].to(mK.element_type)


def qk_norm_rope(
    qkv: TensorSpec,
    q_weight: TensorSpec,
    k_weight: TensorSpec,
    cos_sin: TensorSpec,
    positions: TensorSpec,
    *rest: TensorSpec,
    heads: int,
    kv_heads: int,
    eps: float = 1e-6,
    block_m: int = 4,
    head_block: int = WARPS,
    norm_eps: float | None = None,
    out_dtype: torch.dtype | None = None,
) -> QkNormRopeTile:
    """Per-head RMSNorm + rotary embedding of q and k, v split off (see the module doc).
    ``rest``: ``x`` first where ``norm_eps`` is given (``qkv`` then the split projection's
    partials), then, for the fused append, ``k_cache, v_cache, page_table, seq_lens``."""
    rest = list(rest)
    x = rest.pop(0) if norm_eps is not None and rest else None
    if rest and len(rest) != 4:
        raise ValueError(
            "qk_norm_rope: after the five inputs come x (with norm_eps) and/or "
            f"k_cache, v_cache, page_table, seq_lens; got {len(rest)} more"
        )
    cache = tuple(rest) if rest else (None,) * 4
    return QkNormRopeTile(
        qkv,
        q_weight,
        k_weight,
        cos_sin,
        positions,
        heads,
        kv_heads,
        eps,
        block_m,
        head_block,
        x,
        norm_eps,
        *cache,
        out_dtype,
    )
