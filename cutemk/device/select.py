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

import cutlass
from cutlass import Float32, Int32, cute
from cutlass.cutlass_dsl import T, dsl_user_op

from .mma import _asm

NO_KEY = -(2**31)
"""The smallest key, no non-NaN value's (the bits 0xFFFFFFFF are a NaN's)."""

NO_ID = 2**31 - 1
"""A lane's id when it holds none of the warp's largest key (the min reduction's identity)."""

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


@cute.jit
def warp_topk_softmax(vals, ids, valid, k: cutlass.Constexpr, renormalize: cutlass.Constexpr):
    """One token row held by a warp: lane l holds the logits ``vals[q]`` (fp32) of experts
    ``ids[q]`` (each lane's ids increasing in q), ``valid[q]`` (a Python bool or a Boolean)
    whether that expert exists. Returns (weight, id) of pick ``lane`` for lanes < k:
    softmax over the row (max and sum by butterflies), the k largest logits in order (ties
    to the lower id), each pick two warp reductions over order-preserving keys (the largest,
    then the lowest id holding it). NaN logits are never picked (a NaN makes the weights NaN,
    as the softmax does), and a row with fewer than k usable logits gets id -1, weight 0, in
    the remaining picks. Every lane of the warp must call it (convergent)."""
    n = len(vals)
    lane = cute.arch.lane_idx()
    vmax = Float32(-float("inf"))
    for q in cutlass.range_constexpr(n):
        if valid[q]:
            vmax = cute.arch.fmax(vmax, vals[q])
    for i in cutlass.range_constexpr(5):
        vmax = cute.arch.fmax(vmax, cute.arch.shuffle_sync_bfly(vmax, 1 << i))
    denom = Float32(0.0)
    for q in cutlass.range_constexpr(n):
        if valid[q]:
            denom = denom + cute.math.exp(vals[q] - vmax)
    for i in cutlass.range_constexpr(5):
        denom = denom + cute.arch.shuffle_sync_bfly(denom, 1 << i)
    keys = cute.make_rmem_tensor((n,), Int32)
    for q in cutlass.range_constexpr(n):
        keys[q] = Int32(NO_KEY)
        v = vals[q]
        if valid[q] and v == v:  # noqa: PLR0124 (NaN != NaN)
            keys[q] = ordered_key(v)
    # pick j's weight and id stay with lane j; a runtime loop over the picks keeps the code
    # small (cold straight-line code in a megakernel costs instruction misses)
    my_w = Float32(0.0)
    my_id = Int32(-1)
    wsum = Float32(0.0)
    for j in cutlass.range(k, unroll=1):
        best = Int32(NO_KEY)
        best_e = Int32(NO_ID)
        for q in cutlass.range_constexpr(n):
            if keys[q] > best:  # a lane's ids increase in q: > keeps its lowest of a tie
                best = keys[q]
                best_e = ids[q]
        top = cute.arch.warp_redux_sync(best, "max")
        if best != top:
            best_e = Int32(NO_ID)
        best_e = cute.arch.warp_redux_sync(best_e, "min")
        for q in cutlass.range_constexpr(n):
            if best_e == ids[q]:
                keys[q] = Int32(NO_KEY)
        w = Float32(0.0)
        if top == Int32(NO_KEY):  # fewer than k usable logits: "no expert"
            best_e = Int32(-1)
        else:
            w = cute.math.exp(key_value(top) - vmax) / denom
        wsum = wsum + w
        if lane == j:
            my_w = w
            my_id = best_e
    if cutlass.const_expr(renormalize):
        my_w = my_w / wsum
    return my_w, my_id
