"""16-byte vector views of row-major tensors, for SIMT tile bodies that move rows in vectors.

A row of ``width`` elements moves in 16-byte accesses only where every vector stays aligned:
``width`` known at compile time and a multiple of the vector (:func:`vec16`); otherwise one
element an access. :func:`row_vectors` views the memory as (rows, vectors, elements).
"""

from __future__ import annotations

from cutlass import cute


def vec16(itemsize: int, width) -> int:
    """Elements of one 16-byte access for rows ``width`` elements long (a static int that is a
    multiple of the vector), else 1."""
    v = 16 // itemsize
    return v if isinstance(width, int) and width % v == 0 else 1


def row_vectors(m: cute.Tensor, rows, width, vec: int) -> cute.Tensor:
    """``m``'s memory as (rows, width // vec, vec): rows ``width`` elements apart."""
    return cute.make_tensor(
        m.iterator, cute.make_layout((rows, width // vec, vec), stride=(width, vec, 1))
    )
