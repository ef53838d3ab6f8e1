"""Append a prefill step's keys and values (many new tokens a sequence) to a paged KV cache,
in place.

``k_new`` / ``v_new`` (T, Hkv, D): the new tokens' key and value heads, sequences side by
side as in ``ops.attention_prefill``: sequence b's rows are ``[cu_seqlens[b], cu_seqlens[b +
1])``, its new tokens the last ones of the ``seq_lens[b]`` it counts after the step, so row i
goes to position ``seq_lens[b] - n_b + (i - cu_seqlens[b])``: page ``page_table[b, pos //
page_size]``, slot ``pos % page_size``. The outputs are the caches updated in place
(``TileOp.updates``), as ``ops.kv_append`` (the decode step's append, one token a sequence)
does. Tiles are blocks of ``TOKENS`` rows of one sequence (``ops.varlen``). Two sequences
must never name the same page slot (the interpreter reports it as a race). Bad data is not
written: a sequence of inconsistent lengths (its attention comes out NaN), a position outside
the page table or a page outside the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from cutlass import Boolean, Int32, cute

from cutemk.costmodel import tile_time_us
from cutemk.device.config import NUM_THREADS
from cutemk.errors import ShapeError
from cutemk.tileop import (
    TensorSpec,
    TileOp,
    expect_dtype,
    expect_ndim,
    expect_same_dim,
    full_box,
    register_op,
)

from . import varlen
from .kv_append import check_rows_and_caches, copy_kv_vector, kv_vectors

TOKENS = 16
"""New tokens a tile."""


@register_op
@dataclass(frozen=True)
class KvAppendVarlenTile(TileOp):
    k_new: TensorSpec  # (T, Hkv, D)
    v_new: TensorSpec  # (T, Hkv, D)
    k_cache: TensorSpec  # (pages, page_size, Hkv, D)
    v_cache: TensorSpec
    page_table: TensorSpec  # (B, max_pages) int32
    seq_lens: TensorSpec  # (B,) int32, counting the new tokens
    cu_seqlens: TensorSpec  # (B + 1,) int32

    name: ClassVar[str] = "kv_append_varlen"
    inputs: ClassVar[tuple[str, ...]] = (
        "k_new",
        "v_new",
        "k_cache",
        "v_cache",
        "page_table",
        "seq_lens",
        "cu_seqlens",
    )
    outputs: ClassVar[tuple[str, ...]] = ("k_cache_out", "v_cache_out")
    updates: ClassVar[dict[str, str]] = {"k_cache_out": "k_cache", "v_cache_out": "v_cache"}
    scatter_outputs: ClassVar[tuple[str, ...]] = ("k_cache_out", "v_cache_out")
    data_inputs: ClassVar[tuple[str, ...]] = ("page_table", "seq_lens", "cu_seqlens")
    exists_on_device: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_rows_and_caches(self)
        expect_same_dim(self.page_table.shape[0], self.seq_lens.shape[0], "batch of pages")
        expect_same_dim(self.cu_seqlens.shape[0], self.seq_lens.shape[0] + 1, "cu_seqlens")
        for name, ndim in (("page_table", 2), ("seq_lens", 1), ("cu_seqlens", 1)):
            expect_ndim(getattr(self, name), ndim, f"kv_append_varlen {name}")
            expect_dtype(getattr(self, name), (torch.int32,), f"kv_append_varlen {name}")
        dims = (*self.k_cache.shape[1:], self.page_table.shape[1])
        if not all(isinstance(v, int) for v in dims):
            raise ShapeError(
                "kv_append_varlen: page size, heads, head dim and the page table's width must "
                "be static ints"
            )

    def output_specs(self):
        return {"k_cache_out": self.k_cache, "v_cache_out": self.v_cache}

    def grid(self):
        return (varlen.grid_blocks(self.k_new.shape[0], self.seq_lens.shape[0], TOKENS),)

    # -- host --------------------------------------------------------------------------------
    def _targets(self, j: int, data) -> list[tuple[int, int, int]] | None:
        """(row, page, slot) of each row block j writes (bad rows left out), or None past the
        last block."""
        cu, lens = data["cu_seqlens"].tolist(), data["seq_lens"].tolist()
        t = data["k_new"].shape[0]
        blk = varlen.find_block(j, cu, t, TOKENS, last_first=False)
        if blk is None:
            return None
        b, _, lo, hi = blk
        n = cu[b + 1] - cu[b]
        if n < 0 or cu[b] < 0 or cu[b + 1] > t or lens[b] < n:
            return []
        table = data["page_table"]
        pages, page = data["k_cache"].shape[0], data["k_cache"].shape[1]
        out = []
        for row in range(lo, hi):
            pos = lens[b] - n + row - cu[b]
            if not 0 <= pos < table.shape[1] * page:
                continue
            pg = int(table[b, pos // page])
            if 0 <= pg < pages:
                out.append((row, pg, pos % page))
        return out

    def exists(self, coord, env, data):
        return self._targets(coord[0], data) is not None

    def reads(self, coord, env, data=None):
        _, hkv, d = self.k_new.concrete(env)
        t = self.k_new.concrete(env)[0]
        rows = (0, t)
        if data is not None:
            blk = varlen.find_block(
                coord[0], data["cu_seqlens"].tolist(), t, TOKENS, last_first=False
            )
            if blk is not None:
                rows = (blk[2], blk[3])
        return {
            "k_new": (rows, (0, hkv), (0, d)),
            "v_new": (rows, (0, hkv), (0, d)),
            "k_cache": [],
            "v_cache": [],
            "page_table": full_box(self.page_table.concrete(env)),
            "seq_lens": full_box(self.seq_lens.concrete(env)),
            "cu_seqlens": full_box(self.cu_seqlens.concrete(env)),
        }

    def writes(self, coord, env, data=None):
        if data is None:
            full = full_box(self.k_cache.concrete(env))
            return {"k_cache_out": full, "v_cache_out": full}
        _, _, hkv, d = self.k_cache.concrete(env)
        boxes = [
            ((pg, pg + 1), (slot, slot + 1), (0, hkv), (0, d))
            for _, pg, slot in self._targets(coord[0], data) or []
        ]
        return {"k_cache_out": boxes, "v_cache_out": boxes}

    def cost(self, coord, env):
        _, hkv, d = self.k_new.concrete(env)
        nbytes = 4.0 * TOKENS * hkv * d * self.k_new.dtype.itemsize
        return tile_time_us(0.0, nbytes, self.k_new.dtype)

    def reference(self, coord, env, t):
        for row, pg, slot in self._targets(coord[0], t) or []:
            t["k_cache_out"][pg, slot] = t["k_new"][row]
            t["v_cache_out"][pg, slot] = t["v_new"][row]

    # -- device ------------------------------------------------------------------------------
    @cute.jit
    def device_exists(self, tensors, coord0: Int32, coord1: Int32):
        mKn, mLen, mCu = tensors[0], tensors[5], tensors[6]
        b, _ = varlen.device_find_block(mKn.shape[0], mLen.shape[0], mCu, TOKENS, False, coord0)
        return b >= 0

    @cute.jit
    def device_tile(self, tensors, coord0: Int32, coord1: Int32, tidx: Int32, smem_ptr):
        """Block ``coord0``; ``tensors`` = (mKn, mVn, mKc, mVc, mPT, mLen, mCu, mKo, mVo) with
        mKo / mVo the caches themselves."""
        mKn, mVn, _, _, mPT, mLen, mCu, mKo, mVo = tensors
        page = self.k_cache.shape[1]
        kn, vn, ko, vo, vec, nv = kv_vectors(self, mKn, mVn, mKo, mVo)
        t = mKn.shape[0]
        b, k = varlen.device_find_block(t, mLen.shape[0], mCu, TOKENS, False, coord0)
        lo, hi = mCu[b], mCu[b + 1]
        n = hi - lo
        ok = Boolean(True)
        if n < 0 or lo < 0:
            ok = Boolean(False)
        if hi > t or mLen[b] < n:
            ok = Boolean(False)
        if ok:
            first, rows = varlen.device_block_rows(t, mCu, TOKENS, b, k)
            cap = mPT.shape[1] * page
            for i in range(tidx, rows * nv, NUM_THREADS):
                row = first + i // nv
                v = i % nv
                pos = mLen[b] - n + row - lo
                if pos >= 0 and pos < cap:
                    pg = mPT[b, pos // page]
                    if pg >= 0 and pg < mKo.shape[0]:
                        copy_kv_vector(kn, vn, ko, vo, row, pg * page + pos % page, v, vec)


def kv_append_varlen(
    k_new: TensorSpec,
    v_new: TensorSpec,
    k_cache: TensorSpec,
    v_cache: TensorSpec,
    page_table: TensorSpec,
    seq_lens: TensorSpec,
    cu_seqlens: TensorSpec,
) -> KvAppendVarlenTile:
    """Write each sequence's new key and value rows into its pages (see the module doc)."""
    return KvAppendVarlenTile(k_new, v_new, k_cache, v_cache, page_table, seq_lens, cu_seqlens)
