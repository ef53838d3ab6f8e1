"""Warp selection by integer keys: fp32 values as order-preserving 32-bit integers, so a warp's
largest value is one ``redux.sync.max.s32`` (Hopper has no fp32 ``redux.sync``) where a
butterfly of shuffles takes five dependent rounds.

The key of a value with bits ``b`` (as a signed int) is ``b ^ ((b >> 31) & 0x7FFFFFFF)``:
non-negative floats keep their bits, negative ones get their magnitude bits flipped, so
``key(x) < key(y)`` exactly when ``x < y`` for non-NaN x, y other than -0.0 vs +0.0 (map -0.0
to +0.0 first, see :func:`ordered_key`). The map is its own inverse (:func:`key_value`).
``NO_KEY`` (INT_MIN) is the key of no non-NaN float: "no candidate".
"""

from __future__ import annotations

from cutlass import Float32, Int32
from cutlass.cutlass_dsl import T, dsl_user_op

from .mma import _asm

NO_KEY = -(2**31)
"""The smallest key, no non-NaN value's (the bits 0xFFFFFFFF are a NaN's)."""

_FLIP = "shr.s32 %s, {src}, 31; and.b32 %s, %s, 0x7FFFFFFF; xor.b32 {dst}, {src}, %s;"


@dsl_user_op
def ordered_key(v, *, loc=None, ip=None) -> Int32:
    """The order-preserving key of fp32 ``v`` (-0.0 counted as +0.0; a NaN gets a key, so
    exclude NaNs before comparing)."""
    body = _FLIP.format(src="%b", dst="$0")
    text = (
        "{ .reg .b32 %b, %s; .reg .pred %z; setp.eq.f32 %z, $1, 0f00000000; "
        f"mov.b32 %b, $1; @%z mov.b32 %b, 0; {body} }}"
    )
    return Int32(_asm(T.i32(), [Float32(v).ir_value(loc=loc, ip=ip)], text, "=r,f", loc, ip))


@dsl_user_op
def key_value(k, *, loc=None, ip=None) -> Float32:
    """The fp32 value whose key is ``k`` (the inverse of :func:`ordered_key`)."""
    text = "{ .reg .b32 %b, %s; " + _FLIP.format(src="$1", dst="%b") + " mov.b32 $0, %b; }"
    return Float32(_asm(T.f32(), [Int32(k).ir_value(loc=loc, ip=ip)], text, "=f,r", loc, ip))
