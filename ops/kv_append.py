"""Append one decode step's keys and values to a paged KV cache, in place.

``k_new`` / ``v_new`` (B, Hkv, D): the step's key and value heads (``qk_norm_rope``'s k and v);
``k_cache`` / ``v_cache`` (num_pages, page_size, Hkv, D), ``page_table`` (B, max_pages) int32,
``seq_lens`` (B,) int32 counting the new token: sequence b's new row goes to position
``seq_lens[b] - 1``, i.e. page ``page_table[b, pos // page_size]``, slot ``pos % page_size``.
The outputs ``k_cache_out`` / ``v_cache_out`` are the caches updated in place
(``TileOp.updates``): attention reads them, so it runs after the append. One tile per
sequence; its writes land where the page table says (``scatter_outputs``). A position or page
outside the cache is bad data: that row is not written (the attention of that sequence then
reads a bad page or length and comes out NaN). Two sequences must never name the same page
slot (the interpreter reports it as a race): a padding row of a batch takes ``seq_lens`` 0,
which writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import cutlass
import torch
from cutlass import Int32, cute

from cutemk.costmodel import tile_time_us
from cutemk.device.config import NUM_THREADS
from cutemk.device.vectors import row_vectors, vec16
from cutemk.tileop import (
    FLOAT_DTYPES,
    TensorSpec,
    TileOp,
    expect_dtype,
    expect_ndim,
    expect_same_dim,
    full_box,
    register_op,
)


def append_target(b: int, t) -> tuple[int, int] | None:
    """(page, slot) sequence b's new row goes to, or None for bad data; ``t``: the tensors of
    an append (``k_cache_out``, ``page_table``, ``seq_lens``)."""
    if b >= t["seq_lens"].shape[0] or b >= t["page_table"].shape[0]:
        return None  # an absent sequence (past the live count), as on the device
    pages, page = t["k_cache_out"].shape[0], t["k_cache_out"].shape[1]
    pos = int(t["seq_lens"][b]) - 1
    max_pages = t["page_table"].shape[1]
    if not 0 <= pos < max_pages * page:
        return None
    pg = int(t["page_table"][b, pos // page])
    if not 0 <= pg < pages:
        return None
    return pg, pos % page


def check_rows_and_caches(op) -> None:
    """The checks an append op (``op.name``, its ``k_new`` / ``v_new`` rows of keys and values
    and its ``k_cache`` / ``v_cache``) makes of those four: ranks, one dtype, the caches'
    shapes equal, the rows' heads and head dim the caches'."""
    name = op.name
    for arg in ("k_new", "v_new"):
        expect_ndim(getattr(op, arg), 3, f"{name} {arg}")
    for arg in ("k_cache", "v_cache"):
        expect_ndim(getattr(op, arg), 4, f"{name} {arg}")
    expect_dtype(op.k_new, FLOAT_DTYPES, f"{name} k_new")
    for arg in ("v_new", "k_cache", "v_cache"):
        if getattr(op, arg).dtype != op.k_new.dtype:
            raise TypeError(f"{name} {arg} must have k_new's dtype {op.k_new.dtype}")
    for i in range(4):
        expect_same_dim(op.k_cache.shape[i], op.v_cache.shape[i], f"{name} cache dim {i}")
    for i in (1, 2):
        expect_same_dim(op.k_new.shape[i], op.k_cache.shape[i + 1], f"{name} new dim {i}")
        expect_same_dim(op.v_new.shape[i], op.k_cache.shape[i + 1], f"{name} new dim {i}")
    expect_same_dim(op.v_new.shape[0], op.k_new.shape[0], f"{name} batch")


@register_op
@dataclass(frozen=True)
class KvAppendTile(TileOp):
    k_new: TensorSpec  # (B, Hkv, D)
    v_new: TensorSpec  # (B, Hkv, D)
    k_cache: TensorSpec  # (pages, page_size, Hkv, D)
    v_cache: TensorSpec
    page_table: TensorSpec  # (B, max_pages) int32
    seq_lens: TensorSpec  # (B,) int32, counting the new token

    name: ClassVar[str] = "kv_append"
    token_local: ClassVar[bool] = True
    # a sequence past the lengths' (or page table's) extent appends nothing: a live launch
    # binds them to the live count
    live_rows_inputs: ClassVar[tuple[str, ...]] = ("page_table", "seq_lens")
    live_updates: ClassVar[bool] = True
    inputs: ClassVar[tuple[str, ...]] = (
        "k_new",
        "v_new",
        "k_cache",
        "v_cache",
        "page_table",
        "seq_lens",
    )
    outputs: ClassVar[tuple[str, ...]] = ("k_cache_out", "v_cache_out")
    updates: ClassVar[dict[str, str]] = {"k_cache_out": "k_cache", "v_cache_out": "v_cache"}
    scatter_outputs: ClassVar[tuple[str, ...]] = ("k_cache_out", "v_cache_out")
    data_inputs: ClassVar[tuple[str, ...]] = ("page_table", "seq_lens")

    def __post_init__(self) -> None:
        check_rows_and_caches(self)
        expect_same_dim(self.page_table.shape[0], self.k_new.shape[0], "kv_append page_table batch")
        expect_same_dim(self.seq_lens.shape[0], self.k_new.shape[0], "kv_append seq_lens batch")
        expect_dtype(self.page_table, (torch.int32,), "kv_append page_table")
        expect_dtype(self.seq_lens, (torch.int32,), "kv_append seq_lens")

    def output_specs(self):
        return {"k_cache_out": self.k_cache, "v_cache_out": self.v_cache}

    def grid(self):
        return (self.k_new.shape[0],)

    def reads(self, coord, env, data=None):
        b = coord[0]
        _, hkv, d = self.k_new.concrete(env)
        return {
            "k_new": ((b, b + 1), (0, hkv), (0, d)),
            "v_new": ((b, b + 1), (0, hkv), (0, d)),
            "k_cache": [],
            "v_cache": [],
            "page_table": ((b, b + 1), (0, self.page_table.concrete(env)[1])),
            "seq_lens": ((b, b + 1),),
        }

    def _target(self, b: int, t, env) -> tuple[int, int] | None:
        return append_target(b, t)

    def writes(self, coord, env, data=None):
        if data is None:
            full = full_box(self.k_cache.concrete(env))
            return {"k_cache_out": full, "v_cache_out": full}
        target = self._target(coord[0], data, env)
        if target is None:
            return {"k_cache_out": [], "v_cache_out": []}
        pg, slot = target
        _, _, hkv, d = self.k_cache.concrete(env)
        box = ((pg, pg + 1), (slot, slot + 1), (0, hkv), (0, d))
        return {"k_cache_out": box, "v_cache_out": box}

    def cost(self, coord, env):
        _, hkv, d = self.k_new.concrete(env)
        return tile_time_us(0.0, 4.0 * hkv * d * self.k_new.dtype.itemsize, self.k_new.dtype)

    def reference(self, coord, env, t):
        b = coord[0]
        target = self._target(b, t, env)
        if target is not None:
            pg, slot = target
            t["k_cache_out"][pg, slot] = t["k_new"][b]
            t["v_cache_out"][pg, slot] = t["v_new"][b]

    @cute.jit
    def device_tile(self, tensors, coord0: Int32, coord1: Int32, tidx: Int32, smem_ptr):
        """Sequence ``coord0``; ``tensors`` = (mKn, mVn, mKc, mVc, mPT, mLen, mKo, mVo) with
        mKo / mVo the caches themselves."""
        mKn, mVn, _, _, mPT, mLen, mKo, mVo = tensors
        page = self.k_cache.shape[1]
        kn, vn, ko, vo, vec, nv = kv_vectors(self, mKn, mVn, mKo, mVo)
        # a sequence past the lengths' or the page table's extent is absent (``live_rows_inputs``)
        if coord0 < mLen.shape[0] and coord0 < mPT.shape[0]:
            pos = mLen[coord0] - 1
            cap = mPT.shape[1] * page
            if pos >= 0 and pos < cap:
                pg = mPT[coord0, pos // page]
                if pg >= 0 and pg < mKo.shape[0]:
                    dst = pg * page + pos % page
                    for i in range(tidx, nv, NUM_THREADS):
                        copy_kv_vector(kn, vn, ko, vo, coord0, dst, i, vec)


def kv_vectors(op, mKn, mVn, mKo, mVo):
    """(rows, vectors, vec) views of the new rows (``mKn`` / ``mVn``, a token a row) and of the
    caches' token slots (``mKo`` / ``mVo``), the vector width and the vectors a row: one
    token's keys (or values) are contiguous in both layouts. ``op``: an append op (its
    ``k_new`` / ``k_cache`` specs)."""
    row = op.k_new.shape[1] * op.k_new.shape[2]
    vec = vec16(op.k_new.dtype.itemsize, row)
    slots = mKo.shape[0] * op.k_cache.shape[1]
    return (
        row_vectors(mKn, mKn.shape[0], row, vec),
        row_vectors(mVn, mVn.shape[0], row, vec),
        row_vectors(mKo, slots, row, vec),
        row_vectors(mVo, slots, row, vec),
        vec,
        row // vec,
    )


@cute.jit
def copy_kv_vector(kn, vn, ko, vo, src, dst, i, vec: cutlass.Constexpr):
    """Vector ``i`` of new row ``src``'s keys and values into cache slot ``dst``."""
    kr = cute.make_rmem_tensor((vec,), kn.element_type)
    vr = cute.make_rmem_tensor((vec,), vn.element_type)
    cute.autovec_copy(kn[src, i, None], kr)
    cute.autovec_copy(vn[src, i, None], vr)
    cute.autovec_copy(kr, ko[dst, i, None])
    cute.autovec_copy(vr, vo[dst, i, None])


def kv_append(
    k_new: TensorSpec,
    v_new: TensorSpec,
    k_cache: TensorSpec,
    v_cache: TensorSpec,
    page_table: TensorSpec,
    seq_lens: TensorSpec,
) -> KvAppendTile:
    """Write each sequence's new key and value rows into its pages (see the module doc)."""
    return KvAppendTile(k_new, v_new, k_cache, v_cache, page_table, seq_lens)
