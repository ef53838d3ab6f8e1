"""Causal prefill attention over a paged KV cache, variable sequence lengths.

The new tokens of B sequences lie side by side in ``q`` (T, Hq, D): sequence b's rows are
``[cu_seqlens[b], cu_seqlens[b + 1])``; its keys and values, the ones cached before this step
and the new ones (a ``kv_append`` of the launch writes those), are in pages: ``k_cache`` /
``v_cache`` (num_pages, page_size, Hkv, D), ``page_table`` (B, max_pages) int32 naming the
sequence's pages in order, ``seq_lens`` (B,) int32 the sequence's length after this step. The
new tokens are the sequence's last ones: query row i of sequence b sits at position
``seq_lens[b] - n_b + (i - cu_seqlens[b])`` (``n_b`` its new tokens) and attends to the keys at
positions up to its own (causal). Grouped-query attention: ``Hq = G * Hkv``.

Tile (j, h) takes the G query heads of KV head h over the j-th (sequence, query block) pair:
sequences are cut into blocks of ``QB = 16 * 8 / G`` rows (8 consumer warps, one head and 16
rows each), numbered sequence after sequence, a sequence's last block (the most keys) first;
there are at most ``cdiv(T, QB) + B`` of them,
and tiles past the last do not exist (data: the lengths decide). Output ``out`` (T, Hq * D) in
q's dtype, the heads side by side as the output projection reads them.

Bad data never leaves a buffer: a sequence whose lengths are inconsistent (``n_b < 0``,
``seq_lens[b] < n_b`` or past the page table's capacity, rows outside ``q``) gets NaN rows,
and a page id outside the cache makes the heads that meet it NaN; the reference does the same.

The Hopper tile (``ops.attention_prefill_sm90``) streams each block's keys and values through
the megakernel's ring and runs scores and P V on the tensor cores; other arches are refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from cutlass import Int32, cute

from cutemk.arch import target_arch
from cutemk.costmodel import H200, tile_time_us
from cutemk.envvars import env_choice
from cutemk.errors import ShapeError
from cutemk.symbolic import evaluate, upper
from cutemk.tileop import (
    FLOAT_DTYPES,
    RingTile,
    TensorSpec,
    TileOp,
    expect_dtype,
    expect_ndim,
    expect_same_dim,
    full_box,
    register_op,
)

from . import attention_prefill_sm90 as psm90
from . import varlen

LOG2E = math.log2(math.e)
CONSUMER_WARPS = 8
MMA_ROWS = 16
MAX_BATCH = 1 << 12
"""Most sequences a launch: a tile's task word packs the sequence in 12 bits."""


def block_rows(group: int) -> int:
    """Query rows of a tile: 16 per consumer warp, the G heads' warps side by side."""
    return MMA_ROWS * CONSUMER_WARPS // group


@register_op
@dataclass(frozen=True)
class AttentionPrefillTile(TileOp):
    q: TensorSpec  # (T, Hq, D)
    k_cache: TensorSpec  # (pages, page_size, Hkv, D)
    v_cache: TensorSpec  # (pages, page_size, Hkv, D)
    page_table: TensorSpec  # (B, max_pages) int32
    seq_lens: TensorSpec  # (B,) int32: lengths after this step
    cu_seqlens: TensorSpec  # (B + 1,) int32: q's row offsets
    scale: float | None = None  # softmax scale (default 1/sqrt(D))
    # keys a step of the Hopper tile: 64 (one ring slot holds them, K then V) or 128 (K and V
    # in a slot each: S is m64 n128, K's slot is freed once S is in; ``psm90.WIDE_STEP``)
    step: int = psm90.SLICE_TOKENS

    name: ClassVar[str] = "attention_prefill"
    inputs: ClassVar[tuple[str, ...]] = (
        "q",
        "k_cache",
        "v_cache",
        "page_table",
        "seq_lens",
        "cu_seqlens",
    )
    outputs: ClassVar[tuple[str, ...]] = ("out",)
    data_inputs: ClassVar[tuple[str, ...]] = ("page_table", "seq_lens", "cu_seqlens")
    # which rows a tile writes follows from the offsets (data): without it, any
    scatter_outputs: ClassVar[tuple[str, ...]] = ("out",)

    def __post_init__(self) -> None:
        expect_ndim(self.q, 3, "attention_prefill q")
        expect_ndim(self.k_cache, 4, "attention_prefill k_cache")
        expect_ndim(self.v_cache, 4, "attention_prefill v_cache")
        expect_ndim(self.page_table, 2, "attention_prefill page_table")
        expect_ndim(self.seq_lens, 1, "attention_prefill seq_lens")
        expect_ndim(self.cu_seqlens, 1, "attention_prefill cu_seqlens")
        expect_dtype(self.q, FLOAT_DTYPES, "attention_prefill q")
        for name in ("k_cache", "v_cache"):
            if getattr(self, name).dtype != self.q.dtype:
                raise TypeError(
                    f"attention_prefill {name} must have q's dtype {self.q.dtype}, got "
                    f"{getattr(self, name).dtype}"
                )
        for name in ("page_table", "seq_lens", "cu_seqlens"):
            expect_dtype(getattr(self, name), (torch.int32,), f"attention_prefill {name}")
        for i in range(4):
            expect_same_dim(self.k_cache.shape[i], self.v_cache.shape[i], f"k/v cache dim {i}")
        hq, d = self.q.shape[1], self.q.shape[2]
        hkv, page = self.k_cache.shape[2], self.k_cache.shape[1]
        if not all(isinstance(v, int) for v in (hq, d, hkv, page, self.page_table.shape[1])):
            raise ShapeError(
                "attention_prefill: heads, head dim, page size and the page table's width "
                "must be static ints"
            )
        expect_same_dim(self.k_cache.shape[3], d, "attention_prefill: head dim of q vs cache")
        expect_same_dim(self.page_table.shape[0], self.seq_lens.shape[0], "batch of pages")
        expect_same_dim(self.cu_seqlens.shape[0], self.seq_lens.shape[0] + 1, "cu_seqlens")
        if hq % hkv or hq // hkv not in (1, 2, 4, 8):
            raise ShapeError(
                f"attention_prefill: {hq} query heads over {hkv} KV heads; the tile takes "
                "1, 2, 4 or 8 query heads a KV head"
            )
        if self.step not in (psm90.SLICE_TOKENS, psm90.WIDE_STEP):
            raise ValueError(
                f"attention_prefill step must be {psm90.SLICE_TOKENS} or {psm90.WIDE_STEP}, got "
                f"{self.step!r}"
            )
        if upper(self.seq_lens.shape[0]) > MAX_BATCH:
            raise ShapeError(
                f"attention_prefill: at most {MAX_BATCH} sequences a launch, the batch dim "
                f"allows {upper(self.seq_lens.shape[0])}"
            )

    # -- shapes ------------------------------------------------------------------------------
    @property
    def group(self) -> int:
        return self.q.shape[1] // self.k_cache.shape[2]

    @property
    def kv_heads(self) -> int:
        return self.k_cache.shape[2]

    @property
    def rows(self) -> int:
        return block_rows(self.group)

    @property
    def max_tokens(self) -> int:
        """The longest sequence the page table can hold."""
        return self.page_table.shape[1] * self.k_cache.shape[1]

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.q.shape[2])

    def output_specs(self):
        t, hq, d = self.q.shape
        return {"out": TensorSpec((t, hq * d), self.q.dtype)}

    def grid(self):
        return (
            varlen.grid_blocks(self.q.shape[0], self.seq_lens.shape[0], self.rows),
            self.kv_heads,
        )

    # -- a tile's rows (data) ----------------------------------------------------------------
    def _block(self, j: int, data) -> tuple[int, int, int, int, bool] | None:
        """(sequence, first q row, end q row, position of the first row, bad) of block j
        (``ops.varlen``: rows clamped to q's, a sequence's last block first), or None past the
        last block. A sequence with inconsistent lengths is bad: its blocks write NaN."""
        cu = data["cu_seqlens"].tolist()
        lens = data["seq_lens"].tolist()
        t = data["q"].shape[0]
        blk = varlen.find_block(j, cu, t, self.rows, last_first=True)
        if blk is None:
            return None
        b, k, lo, hi = blk
        n = cu[b + 1] - cu[b]
        bad = n < 0 or cu[b] < 0 or cu[b + 1] > t or lens[b] < n or lens[b] > self.max_tokens
        return b, lo, hi, lens[b] - n + k * self.rows, bad

    def exists(self, coord, env, data):
        return self._block(coord[0], data) is not None

    def reads(self, coord, env, data=None):
        _, h = coord
        g, d = self.group, self.q.shape[2]
        heads = (h * g, (h + 1) * g)
        full = {
            "k_cache": full_box(self.k_cache.concrete(env)),
            "v_cache": full_box(self.v_cache.concrete(env)),
            "page_table": full_box(self.page_table.concrete(env)),
            "seq_lens": full_box(self.seq_lens.concrete(env)),
            "cu_seqlens": full_box(self.cu_seqlens.concrete(env)),
        }
        blk = None if data is None else self._block(coord[0], data)
        if blk is None or blk[4]:
            rows = (0, evaluate(self.q.shape[0], env))
        else:
            rows = (blk[1], blk[2])
        return {"q": (rows, heads, (0, d)), **full}

    def writes(self, coord, env, data=None):
        _, h = coord
        g, d = self.group, self.q.shape[2]
        cols = (h * g * d, (h + 1) * g * d)
        blk = None if data is None else self._block(coord[0], data)
        if blk is None:
            return {"out": ((0, evaluate(self.q.shape[0], env)), cols)}
        _, lo, hi, _, _ = blk
        t = evaluate(self.q.shape[0], env)
        return {"out": ((min(max(lo, 0), t), min(max(hi, 0), t)), cols)}

    def cost(self, coord, env):
        d, es = self.q.shape[2], self.q.dtype.itemsize
        t = max(evaluate(self.q.shape[0], env), 1)
        keys = min(t, self.max_tokens) / 2  # causal: half the keys on average
        flops = 4.0 * self.rows * self.group * keys * d
        return tile_time_us(flops, 2.0 * keys * d * es, self.q.dtype) + H200.load_latency_us

    def reference(self, coord, env, t):
        j, h = coord
        blk = self._block(j, t)
        if blk is None:
            return
        b, lo, hi, p0, bad = blk
        g, page, d = self.group, self.k_cache.shape[1], self.q.shape[2]
        tq = t["q"].shape[0]
        lo_c, hi_c = min(max(lo, 0), tq), min(max(hi, 0), tq)
        out = t["out"][lo_c:hi_c, h * g * d : (h + 1) * g * d].view(hi_c - lo_c, g, d)
        if bad:
            out.fill_(float("nan"))
            return
        n_rows = hi - lo
        end = p0 + n_rows  # keys [0, end) reach some row of the block
        pos = torch.arange(0, end, device=t["q"].device)
        pages = t["page_table"][b, pos // page].long()
        wrong = (pages < 0) | (pages >= t["k_cache"].shape[0])
        pages = torch.where(wrong, 0, pages)
        k = t["k_cache"][pages, pos % page, h].float()  # (end, D)
        v = t["v_cache"][pages, pos % page, h].float()
        q = t["q"][lo:hi, h * g : (h + 1) * g].float()  # (rows, G, D)
        scores = torch.einsum("rgd,kd->grk", q, k) * self.softmax_scale
        rowpos = p0 + torch.arange(n_rows, device=q.device)
        mask = pos[None, :] > rowpos[:, None]  # (rows, end): future keys
        scores = scores.masked_fill(mask[None], float("-inf"))
        o = torch.einsum("grk,kd->rgd", torch.softmax(scores, dim=-1), v)
        if bool(wrong.any()):
            o = torch.full_like(o, float("nan"))
        out.copy_(o)

    # -- device ------------------------------------------------------------------------------
    exists_on_device: ClassVar[bool] = True
    dynamic_slices: ClassVar[bool] = True

    def sm90(self) -> psm90.Sm90PrefillConfig:
        if (
            target_arch() != "sm_90a"
            or self.q.dtype not in (torch.bfloat16, torch.float16)
            or self.q.shape[2] % 64  # 128-byte swizzled rows of 64 dimensions
            or self.q.shape[2] > 128  # o's accumulators: D / 2 registers a lane
            or self.k_cache.shape[1] not in (8, 16, 32, 64, 128, 256)  # a box of 8+ rows
        ):
            raise ShapeError(
                "attention_prefill runs on the GPU as a Hopper (sm_90a) tile of 16-bit q and "
                "cache, head dim 64 or 128 and a power-of-two page of 8 to 256 tokens only "
                f"(target {target_arch()}, {self.q.dtype}, head dim {self.q.shape[2]}, page "
                f"{self.k_cache.shape[1]}); the interpreter takes the rest"
            )
        return psm90.Sm90PrefillConfig(
            group=self.group,
            head_dim=self.q.shape[2],
            page=self.k_cache.shape[1],
            kv_heads=self.kv_heads,
            max_tokens=self.max_tokens,
            scale_log2=self.softmax_scale * LOG2E,
            dtype=self.q.dtype,
            step=self.step,
        )

    def ring_tile(self) -> RingTile:
        cfg = self.sm90()
        return RingTile(cfg.slices, cfg.tx_bytes, cfg.slot_bytes, cfg.epi_bytes)

    def host_args(self, tensors) -> tuple:
        return psm90.tma_args(self.sm90(), tensors[1], tensors[2])

    def reads_async_proxy(self) -> bool:
        return True

    @cute.jit
    def device_exists(self, tensors, coord0: Int32, coord1: Int32):
        return psm90.find_block(self.sm90(), tensors, coord0)[0] >= 0

    @cute.jit
    def device_task_word(self, tensors, coord0: Int32, coord1: Int32) -> Int32:
        """The block: its sequence and its index in the sequence, packed."""
        b, k = psm90.find_block(self.sm90(), tensors, coord0)
        return psm90.pack_word(b, k)

    @cute.jit
    def device_slices(self, tensors, coord0: Int32, coord1: Int32, word: Int32) -> Int32:
        return psm90.slices_of_block(self.sm90(), tensors, word)

    @cute.jit
    def device_load_independent(
        self, tensors, coord0, coord1, word, kt, idx, bar, ring, stages, slot
    ):
        pass  # the new tokens' keys are written in the launch: every slice after the events

    @cute.jit
    def device_load_dependent(
        self, tensors, coord0, coord1, word, kt, idx, bar, ring, stages, slot
    ):
        psm90.load_kv(self.sm90(), tensors, coord1, word, kt, idx, bar, ring, slot)

    @cute.jit
    def device_compute(
        self,
        tensors,
        coord0,
        coord1,
        word,
        full,
        empty,
        count,
        ring,
        stages,
        slot,
        epi,
        ctid,
        wait,
        epi_free=None,
    ):
        return psm90.compute(
            self.sm90(),
            tensors,
            coord1,
            word,
            full,
            empty,
            count,
            ring,
            stages,
            slot,
            epi,
            ctid,
            wait,
            epi_free,
        )

    @cute.jit
    def device_store(self, tensors, coord0, coord1, epi):
        pass  # the consumers wrote the rows; the storer warp only publishes the tile


def attention_prefill(
    q: TensorSpec,
    k_cache: TensorSpec,
    v_cache: TensorSpec,
    page_table: TensorSpec,
    seq_lens: TensorSpec,
    cu_seqlens: TensorSpec,
    scale: float | None = None,
    step: int | None = None,
) -> AttentionPrefillTile:
    """``step``: keys a step of the Hopper tile (``AttentionPrefillTile.step``); default
    ``CUTEMK_PREFILL_STEP`` (64 or 128), else 64."""
    if step is None:
        step = int(env_choice("CUTEMK_PREFILL_STEP", ("64", "128")) or psm90.SLICE_TOKENS)
    return AttentionPrefillTile(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens, scale, step)
