"""Blocks of rows over variable-length sequences laid side by side (``cu_seqlens``).

Ops over the new tokens of B sequences (prefill attention, the KV append of a prefill) tile
each sequence's rows ``[cu_seqlens[b], cu_seqlens[b + 1])`` in blocks of ``rows``, numbered
sequence after sequence: a grid of ``cdiv(T, rows) + B`` tiles covers every block, and tiles
past the last do not exist (the offsets are data). A sequence's rows are clamped to the
``T`` rows there are, so whatever a bad sequence's offsets claim, with non-decreasing offsets
the blocks of all sequences fit the grid. Optionally a sequence's last block comes first (for
causal attention: its longest tile). The host function and the device function are one
formula; the op's interpreter reference and its device code both go through them.
"""

from __future__ import annotations

from collections.abc import Sequence

import cutlass
from cutlass import Int32, cute

from cutemk.symbolic import IntLike, cdiv


def grid_blocks(tokens: IntLike, batch: IntLike, rows: int) -> IntLike:
    """Tiles that cover every block of ``batch`` sequences over ``tokens`` rows."""
    return cdiv(tokens, rows) + batch


def find_block(
    j: int, cu: Sequence[int], tokens: int, rows: int, last_first: bool
) -> tuple[int, int, int, int] | None:
    """(sequence, block index in it, first row, end row) of block ``j`` (rows clamped to
    ``[0, tokens)``), or None past the last block."""
    first = 0
    for b in range(len(cu) - 1):
        lo, hi = max(cu[b], 0), min(cu[b + 1], tokens)
        blocks = 0 if hi <= lo else -(-(hi - lo) // rows)
        if j < first + blocks:
            k = first + blocks - 1 - j if last_first else j - first
            return b, k, lo + k * rows, min(lo + (k + 1) * rows, hi)
        first += blocks
    return None


@cute.jit
def device_find_block(
    tokens: Int32,
    batch: Int32,
    mCu: cute.Tensor,
    rows: cutlass.Constexpr,
    last_first: cutlass.Constexpr,
    j: Int32,
):
    """:func:`find_block` on the device: (sequence, block index) of block ``j``, (-1, 0) past
    the last block. A loop over the sequences (one a step)."""
    found_b = Int32(-1)
    found_k = Int32(0)
    first = Int32(0)
    for b in range(batch):
        if found_b < 0:
            n = cute.min(mCu[b + 1], tokens) - cute.max(mCu[b], 0)
            blocks = Int32(0)
            if n > 0:
                blocks = (n + rows - 1) // rows
            if j < first + blocks:
                found_b = b
                found_k = j - first
                if cutlass.const_expr(last_first):
                    found_k = first + blocks - 1 - j
            first = first + blocks
    return found_b, found_k


@cute.jit
def device_block_rows(tokens: Int32, mCu: cute.Tensor, rows: cutlass.Constexpr, b: Int32, k):
    """(first row, row count) of block ``k`` of sequence ``b`` (rows clamped to ``[0,
    tokens)``)."""
    first = cute.max(mCu[b], 0) + k * rows
    return first, cute.min(rows, cute.min(mCu[b + 1], tokens) - first)
