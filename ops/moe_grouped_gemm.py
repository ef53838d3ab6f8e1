"""MoE grouped GEMM tile op over the grouped (padded) layout of ``moe_route``.

Tile (i, j) computes rows of row tile i (``block_m`` rows, all of expert ``tile_info[i, 0]``)
times columns block j of that expert's weight: ``out[rows] = x[rows] @ w[e, cols]^T``. The task
grid is declared at its maximum; a tile whose ``tile_info[i, 0] < 0`` does not exist at this
routing and is skipped (the data-dependent part of the MoE graph). Rows of a tile past its
``valid`` count (padding) are unspecified: later ops read only the rows ``slot_row`` names (the
torch reference poisons them with NaN, so a reader of padding shows up in the interpreter).

Two input layouts: with ``row_token`` the A rows are gathered from the token-major ``x``
(T, K) (portable SIMT path); without it ``x`` is already in the padded layout (``moe_permute``
writes it for the gate/up projection; the down projection reads the gate/up output).

Epilogue ``silu_mul``: ``w`` stacks ``[W_gate; W_up]`` per expert (E, 2N, K) and the tile is
``silu(x W_gate[e]^T) * (x W_up[e]^T)`` (N columns).

**Slot layout** (``slot_input``, a decode step of a few tokens: ``moe_slot_gemm``): no routing
step at all. The routing input is the top-k's ``ids`` (T, k) itself and row tile ``i = t * k +
j`` is slot j of token t: expert ``ids[t, j]``, one row, kept at row ``i * block_m + t`` of
the output (T * k * block_m, N); the tile's other rows are unspecified. A tile exists where the
id names an expert (``0 <= id < E``; the top-k writes -1 for a slot with no usable logit).
``slot_input="tokens"``: x is the token-major (T, K) input and every tile reads its first rows
(T <= ``expert_rows`` <= ``block_m``: one A box holds every token); ``"slots"``: x is a slot
layout (the gate/up tile's output, read by the down projection). An expert that two tokens
pick is streamed once per slot, so the layout pays at one or two tokens a step, where it saves
the route and permute steps (and their hops) between the top-k and the expert weights.

On sm_90a with bf16/fp16 and the padded layout the tile is the Hopper GEMM of
``ops/gemm_sm90.py`` (one shared main loop with ``ops.gemm``): TMA through the megakernel's
ring, the expert a TMA coordinate of the weight (no descriptor updates), wgmma on two consumer
warpgroups, a TMA-store epilogue. Elsewhere a portable SIMT FMA tile runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import cutlass
import numpy as np
import torch
import torch.nn.functional as F
from cutlass import Boolean, Float32, Int32, cute

from cutemk.arch import target_arch
from cutemk.costmodel import tile_time_us
from cutemk.device.config import NUM_THREADS, simt_sync
from cutemk.errors import DataError, GraphError, ShapeError
from cutemk.symbolic import cdiv, upper
from cutemk.tileop import (
    FLOAT_DTYPES,
    TensorSpec,
    TileOp,
    block,
    blocks,
    boxes,
    expect_dtype,
    expect_ndim,
    expect_same_dim,
    full_box,
    register_op,
    span,
)

from . import gemm_sm90


@register_op
@dataclass(frozen=True)
class MoeGroupedGemmTile(gemm_sm90.HopperGemmOp, TileOp):
    x: TensorSpec  # (tokens, k) gathered through row_token, or (tiles*block_m, k) padded
    w: TensorSpec  # (experts, n, k)
    tile_info: TensorSpec  # (tiles, 2) int32
    row_token: Optional[TensorSpec] = None  # (tiles*block_m,) int32
    block_m: int = 64
    block_n: int = 64
    epilogue: Optional[str] = None  # None or "silu_mul" (w stacks [W_gate; W_up] per expert)
    expert_rows: Optional[int] = None  # the most rows one expert can have (the max tokens)
    slot_input: Optional[str] = None  # None, or the slot layout's x: "tokens" or "slots"
    # the slot layout's down projection with the MoE combine fused: the top-k's weights (T, k)
    combine: Optional[TensorSpec] = None
    # with the combine: a residual (T, N) added to y's rows as the last pick writes them
    residual: Optional[TensorSpec] = None

    name: ClassVar[str] = "moe_grouped_gemm"
    token_local: ClassVar[bool] = True
    block_k: ClassVar[int] = 32
    """K slice staged through shared memory per step of the device main loop."""
    data_inputs: ClassVar[tuple[str, ...]] = ("tile_info", "row_token")

    @property
    def outputs(self) -> tuple[str, ...]:
        # with the combine: y (T, N), each pick's weighted fp32 row, the picks counted per
        # (token, column block)
        return ("y", "part", "counts") if self.combine is not None else ("out",)

    @property
    def scatter_outputs(self) -> tuple[str, ...]:
        # the last pick of a (token, column block) to finish writes y's columns: any of them
        return ("y",) if self.combine is not None else ()

    @property
    def zeroed_outputs(self) -> tuple[str, ...]:
        return ("counts",) if self.combine is not None else ()

    def __post_init__(self) -> None:
        expect_ndim(self.x, 2, "moe_grouped_gemm x")
        expect_ndim(self.w, 3, "moe_grouped_gemm w")
        expect_ndim(self.tile_info, 2, "moe_grouped_gemm tile_info")
        expect_dtype(self.x, FLOAT_DTYPES, "moe_grouped_gemm x")
        expect_dtype(self.tile_info, (torch.int32,), "moe_grouped_gemm tile_info")
        if self.w.dtype != self.x.dtype:
            raise TypeError(
                f"moe_grouped_gemm w must have x's dtype {self.x.dtype}, got {self.w.dtype}"
            )
        expect_same_dim(
            self.x.shape[1], self.w.shape[2], "moe_grouped_gemm: x.shape[1] vs w.shape[2]"
        )
        if self.row_token is not None:
            expect_ndim(self.row_token, 1, "moe_grouped_gemm row_token")
            expect_dtype(self.row_token, (torch.int32,), "moe_grouped_gemm row_token")
            expect_same_dim(
                self.row_token.shape[0],
                self.tile_info.shape[0] * self.block_m,
                "moe_grouped_gemm: row_token rows vs tiles*block_m (block_m must be moe_route's)",
            )
        elif self.slot_input is None:
            expect_same_dim(
                self.x.shape[0],
                self.tile_info.shape[0] * self.block_m,
                "moe_grouped_gemm: padded x rows vs tiles*block_m",
            )
        for f in ("block_m", "block_n"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                raise ValueError(f"moe_grouped_gemm {f} must be a positive int")
        if self.epilogue not in (None, "silu_mul"):
            raise ValueError(
                f"moe_grouped_gemm epilogue must be None or 'silu_mul', got {self.epilogue!r}"
            )
        if self.epilogue == "silu_mul" and isinstance(self.w.shape[1], int) and self.w.shape[1] % 2:
            raise ShapeError(
                f"moe_grouped_gemm silu_mul needs an even w.shape[1], got {self.w.shape[1]}"
            )
        if self.expert_rows is not None and (
            not isinstance(self.expert_rows, int) or self.expert_rows < 1
        ):
            raise ValueError(
                f"moe_grouped_gemm expert_rows must be a positive int, got {self.expert_rows!r}"
            )
        if self.slot_input is not None:
            self._check_slots()
        if self.combine is not None:
            self._check_combine()
        elif self.residual is not None:
            raise GraphError("moe_grouped_gemm: a residual is added by the fused combine only")

    def _check_combine(self) -> None:
        if self.slot_input != "slots" or self.epilogue is not None:
            raise GraphError(
                "moe_grouped_gemm: the fused combine is the slot layout's down projection "
                "(slot_input='slots', no epilogue)"
            )
        expect_ndim(self.combine, 2, "moe_grouped_gemm combine weights")
        expect_dtype(self.combine, (torch.float32,), "moe_grouped_gemm combine weights")
        expect_same_dim(self.combine.shape[0], self.tile_info.shape[0], "combine weights: tokens")
        expect_same_dim(self.combine.shape[1], self.tile_info.shape[1], "combine weights: top-k")
        n = self.n
        if not isinstance(n, int) or n % 4 or self.block_n % 4:
            raise ShapeError(
                f"moe_grouped_gemm: the fused combine needs N and block_n multiples of 4, got "
                f"{n} and {self.block_n}"
            )
        if self.residual is not None:
            expect_ndim(self.residual, 2, "moe_grouped_gemm residual")
            if self.residual.dtype != self.x.dtype:
                raise TypeError(
                    f"moe_grouped_gemm residual must be {self.x.dtype}, got {self.residual.dtype}"
                )
            expect_same_dim(self.residual.shape[0], self.combine.shape[0], "residual: tokens")
            expect_same_dim(self.residual.shape[1], n, "moe_grouped_gemm residual: columns vs N")

    def _check_slots(self) -> None:
        """The slot layout's extra rules (see the module doc)."""
        if self.slot_input not in ("tokens", "slots"):
            raise ValueError(
                f"moe_grouped_gemm slot_input must be None, 'tokens' or 'slots', got "
                f"{self.slot_input!r}"
            )
        if self.row_token is not None:
            raise GraphError("moe_grouped_gemm: the slot layout gathers no rows (no row_token)")
        k = self.tile_info.shape[1]
        if not isinstance(k, int):
            raise ShapeError("moe_grouped_gemm: the slot layout needs a static top-k (ids dim 1)")
        t_max = upper(self.tile_info.shape[0])
        if self.expert_rows is None or not t_max <= self.expert_rows <= self.block_m:
            raise ShapeError(
                f"moe_grouped_gemm: the slot layout keeps token t at row t of its tile, so the "
                f"most tokens ({t_max}) <= expert_rows ({self.expert_rows}) <= block_m "
                f"({self.block_m}) must hold"
            )
        if self.slot_input == "tokens":
            expect_same_dim(
                self.x.shape[0], self.tile_info.shape[0], "moe_grouped_gemm: x tokens vs ids"
            )
        else:
            expect_same_dim(
                self.x.shape[0],
                self.tile_info.shape[0] * k * self.block_m,  # a slot-layout output's rows
                "moe_grouped_gemm: slot-layout x rows vs tokens*top_k*block_m",
            )

    @property
    def _slots(self) -> int:
        """Slots a token has in the slot layout (the top-k), 0 in moe_route's layout."""
        return 0 if self.slot_input is None else self.tile_info.shape[1]

    def _tiles(self):
        """Row tiles: moe_route's tiles, or tokens * top_k slots."""
        k = self._slots
        return self.tile_info.shape[0] * k if k else self.tile_info.shape[0]

    def _expert_of(self, i: int, data) -> int:
        """Expert of row tile ``i`` at this routing (-1: none)."""
        k = self._slots
        if not k:
            return int(data["tile_info"][i, 0])
        e = int(data["tile_info"][i // k, i % k])
        return e if 0 <= e < self.w.shape[0] else -1

    def check_producers(self, producers) -> None:
        route = producers.get("tile_info")
        if self.slot_input is not None:
            experts = getattr(route, "picks_over", None)  # a top-k's, or a router's that picks
            if experts is not None and experts != self.w.shape[0]:
                raise GraphError(
                    f"moe_grouped_gemm has weights of {self.w.shape[0]} experts but its ids "
                    f"come from a top-k over {experts}"
                )
            return
        name = getattr(route, "name", None)
        if name in ("moe_route", "moe_route_layout"):
            experts = self.w.shape[0]
            if experts != route.num_experts:
                raise GraphError(
                    f"moe_grouped_gemm has weights of {experts} experts but its tiles come from "
                    f"a moe_route over {route.num_experts}"
                )
            if route.block_m != self.block_m:
                raise GraphError(
                    f"moe_grouped_gemm block_m={self.block_m} differs from its moe_route's "
                    f"{route.block_m}"
                )
            # below block_m the tile's A box holds expert_rows rows (see gemm_sm90.sm90_config):
            # fewer than one expert can be given would drop rows
            if name == "moe_route":
                tokens, k = route.ids.shape
                most = upper(tokens) * (1 if route.distinct_ids else k)
            else:
                most = upper(route.tokens)
            if self.expert_rows is not None and self.expert_rows < min(most, self.block_m):
                raise GraphError(
                    f"moe_grouped_gemm expert_rows={self.expert_rows} is below the {most} rows "
                    f"one expert can be routed (the most tokens"
                    f"{'' if name != 'moe_route' or route.distinct_ids else ' x top-k'})"
                )

    @property
    def n(self):
        """Output columns: w's rows, halved by the silu_mul epilogue."""
        return self.w.shape[1] // 2 if self.epilogue == "silu_mul" else self.w.shape[1]

    @property
    def inputs(self) -> tuple[str, ...]:
        base = ("x", "w", "tile_info")
        if self.combine is not None:
            return base + ("combine",) + ("residual",) * (self.residual is not None)
        return base if self.row_token is None else base + ("row_token",)

    def output_specs(self):
        if self.combine is not None:
            t, k = self.tile_info.shape
            return {
                "y": TensorSpec((t, self.n), self.x.dtype),
                "part": TensorSpec((t, k, self.n), torch.float32),
                "counts": TensorSpec((t, cdiv(self.n, self.block_n)), torch.int32),
            }
        rows = self._tiles() * self.block_m
        return {"out": TensorSpec((rows, self.n), self.x.dtype)}

    def grid(self):
        return (self._tiles(), cdiv(self.n, self.block_n))

    def _ev(self, d, env):
        return d if isinstance(d, int) else d.eval(env)

    def exists(self, coord, env, data):
        # with the combine every pick has a tile: the combine counts k of them
        return self.combine is not None or self._expert_of(coord[0], data) >= 0

    def reads(self, coord, env, data=None):
        i, j = coord
        tiles = self._ev(self._tiles(), env)
        rows = block(i, self.block_m, tiles * self.block_m)
        k = self._slots
        info = ((i // k, i // k + 1), (i % k, i % k + 1)) if k else ((i, i + 1), (0, 2))
        r = {"tile_info": info, "w": full_box(self.w.concrete(env))}
        if self.combine is not None:
            r["combine"] = info
        if self.residual is not None:  # the token's columns, read by the pick that is last
            r["residual"] = (info[0], block(j, self.block_n, self._ev(self.n, env)))
        if self.slot_input == "tokens":  # the first rows of x: every token
            r["x"] = full_box(self.x.concrete(env))
        elif self.row_token is None:
            r["x"] = (rows, (0, self._ev(self.x.shape[1], env)))
        else:
            r["row_token"] = (rows,)
            # which tokens are gathered is data: without data, any row of x
            r["x"] = full_box(self.x.concrete(env))
        if data is not None:  # exact: only this expert's weight block
            e = self._expert_of(i, data)
            if e < 0:  # the combine's tile of a pick without an expert: NaN, whatever it reads
                r["x"] = ((rows[0], rows[0]), r["x"][1])
                e = 0  # (the weights it streams: expert 0's)
            _, n2, k = self.w.concrete(env)
            n = self._ev(self.n, env)
            cols = block(j, self.block_n, n)
            if self.epilogue == "silu_mul":  # gate rows, then up rows: one box spanning both
                cols = (cols[0], n + cols[1])
            r["w"] = ((e, e + 1), cols, (0, k))
        return r

    def writes(self, coord, env, data=None):
        i, j = coord
        rows = self._ev(self._tiles(), env) * self.block_m
        n = self._ev(self.n, env)
        cols = block(j, self.block_n, n)
        if self.combine is not None:
            # which pick is last is decided at run time (the counts, an atomic the tiles
            # share; not an event): without data every pick may write y's columns, with data
            # the last pick stands for the writer (the readers' order is the same)
            k = self._slots
            t = (i // k, i // k + 1)
            w = {"part": (t, (i % k, i % k + 1), cols)}
            if data is None or i % k == k - 1:
                w["y"] = (t, cols)
            return w
        return {"out": (block(i, self.block_m, rows), cols)}

    uniform_cost: ClassVar[bool] = True

    def region_arrays(self, which, env, coords):
        n_t = len(coords)
        i = coords[:, 0]
        rows = blocks(i, self.block_m, self._ev(self._tiles(), env) * self.block_m)
        k = self._slots
        if which == "writes":
            if self.combine is not None:
                return None  # per tile: the counts are the op's own (undeclared, as writes says)
            return {"out": boxes(rows, blocks(coords[:, 1], self.block_n, self._ev(self.n, env)))}
        w = self.w.concrete(env)
        if k:  # the pick's id: row t, column j of the ids
            t, j = i // k, i % k
            info = boxes(np.stack([t, t + 1], axis=1), np.stack([j, j + 1], axis=1))
        else:
            info = boxes(np.stack([i, i + 1], axis=1), span(0, 2, n_t))
        r = {"tile_info": info, "w": boxes(*(span(0, d, n_t) for d in w))}
        if self.combine is not None:
            r["combine"] = info
        if self.residual is not None:
            cols = blocks(coords[:, 1], self.block_n, self._ev(self.n, env))
            r["residual"] = boxes(np.stack([i // k, i // k + 1], axis=1), cols)
        if self.slot_input == "tokens":
            r["x"] = boxes(*(span(0, d, n_t) for d in self.x.concrete(env)))
        elif self.row_token is None:
            r["x"] = boxes(rows, span(0, self._ev(self.x.shape[1], env), n_t))
        else:
            r["row_token"] = boxes(rows)
            r["x"] = boxes(*(span(0, d, n_t) for d in self.x.concrete(env)))
        return r

    def cost(self, coord, env):
        k = self._ev(self.x.shape[1], env)
        es = self.x.dtype.itemsize
        bm, bn = self.block_m, self.block_n
        nb = 2 if self.epilogue == "silu_mul" else 1
        return tile_time_us(
            2.0 * bm * bn * k * nb, (bm + nb * bn) * k * es + bm * bn * es, self.x.dtype
        )

    def reference(self, coord, env, t):
        if self.combine is not None:
            return self._combine_reference(coord, env, t)
        i, _ = coord
        (r0, r1), (c0, c1) = self.writes(coord, env)["out"]
        k = self._slots
        if k:  # one row, token i // k's, at row i // k of the tile
            e, lo, hi = self._expert_of(i, t), i // k, i // k + 1
            a = t["x"][lo:hi] if self.slot_input == "tokens" else t["x"][r0 + lo : r0 + hi]
            a = a.float()
        else:
            e, hi = (int(v) for v in t["tile_info"][i])
            lo = 0
            if self.expert_rows is not None and hi > self.expert_rows:
                # the device's A box holds expert_rows rows: the routing broke the promise
                raise DataError(
                    f"{self.name}: row tile {i} of expert {e} holds {hi} rows, more than "
                    f"expert_rows={self.expert_rows} (ids that are not distinct in a token?)"
                )
            if self.row_token is None:
                a = t["x"][r0 : r0 + hi].float()
            else:
                a = t["x"][t["row_token"][r0 : r0 + hi].long()].float()
        out = t["out"][r0:r1, c0:c1]
        out[:] = float("nan")  # rows past the tile's own: unspecified, poisoned for the checks
        if self.epilogue == "silu_mul":
            n = self._ev(self.n, env)
            gate = a @ t["w"][e, c0:c1].float().T
            up = a @ t["w"][e, n + c0 : n + c1].float().T
            out[lo:hi] = (F.silu(gate) * up).to(out.dtype)
        else:
            out[lo:hi] = (a @ t["w"][e, c0:c1].float().T).to(out.dtype)

    def _combine_reference(self, coord, env, t):
        """The down tile of pick j of token tok with the combine: its row times the pick's
        weight (NaN for a pick without an expert) into ``part``, then the pick counted; the
        last of the k sums them in pick order into ``y``."""
        i, j = coord
        k = self._slots
        tok, pick = i // k, i % k
        (c0, c1) = block(j, self.block_n, self._ev(self.n, env))
        e = self._expert_of(i, t)
        r0 = i * self.block_m + tok
        a = t["x"][r0 : r0 + 1].float()
        row = (a @ t["w"][max(e, 0), c0:c1].float().T)[0]
        wt = float(t["combine"][tok, pick]) if e >= 0 else float("nan")
        t["part"][tok, pick, c0:c1] = row * wt
        t["counts"][tok, j] += 1
        if int(t["counts"][tok, j]) == k:
            t["counts"][tok, j] = 0
            rows = t["part"][tok, :, c0:c1]
            acc = rows[0].clone()
            for q in range(1, k):  # pick order, as the device sums
                acc = acc + rows[q]
            if self.residual is not None:
                acc = acc + t["residual"][tok, c0:c1].float()
            t["y"][tok, c0:c1] = acc.to(t["y"].dtype)

    # -- device: the Hopper path (ring methods from gemm_sm90.HopperGemmOp) ----------------
    independent_inputs: ClassVar[tuple[str, ...]] = ("w",)

    def sm90(self) -> Optional[gemm_sm90.Sm90GemmConfig]:
        """The Hopper tile (TMA + wgmma through the megakernel's ring) for the padded layout on
        sm_90a; None (the SIMT tile) for fp32, the gathered layout or shapes TMA cannot take."""
        if target_arch() != "sm_90a" or self.row_token is not None:
            return None
        return gemm_sm90.sm90_config(
            self.x.dtype,
            self.x.dtype,
            self.block_m,
            self.block_n,
            self.x.shape[1],
            self.n,
            self.epilogue == "silu_mul",
            self.expert_rows,
            grouped=True,
            a_one_box=self.slot_input == "tokens",
            combine_k=self._slots if self.combine is not None else 0,
            residual=self.residual is not None,
        )

    # -- device: the portable path ---------------------------------------------------------
    def device_smem_bytes(self) -> int:
        if self.sm90() is not None:
            return 0  # the ring and the output staging belong to the megakernel
        # fp32 A (block_m, block_k) and B (block_n, block_k) slices (two with silu_mul) with row
        # pitch block_k + 1, then the block_m source rows (int32)
        nb = 2 if self.epilogue == "silu_mul" else 1
        return 4 * ((self.block_m + nb * self.block_n) * (self.block_k + 1) + self.block_m)

    exists_on_device: ClassVar[bool] = True

    @cute.jit
    def _device_expert(self, tensors, coord0: Int32) -> Int32:
        """Row tile ``coord0``'s expert as the routing input says (unchecked in the slot
        layout: an id the top-k wrote)."""
        k = self._slots
        e = Int32(0)
        if cutlass.const_expr(k):
            t = coord0 // k
            e = tensors[2][t, coord0 - t * k]
        else:
            e = tensors[2][coord0, 0]
        return e

    @cute.jit
    def device_exists(self, tensors, coord0: Int32, coord1: Int32) -> Boolean:
        """Device twin of :meth:`exists`: row tile ``coord0`` has an expert at this routing
        (with the combine every pick has a tile)."""
        ok = Boolean(True)
        if cutlass.const_expr(self.combine is None):
            e = self._device_expert(tensors, coord0)
            ok = e >= 0
            if cutlass.const_expr(self._slots):
                ok = ok and e < self.w.shape[0]
        return ok

    @cute.jit
    def device_task_word(self, tensors, coord0: Int32, coord1: Int32) -> Int32:
        """The tile's expert, which the weight loads of every slice take as a coordinate."""
        return self._device_expert(tensors, coord0)

    @cute.jit
    def device_tile(self, tensors, coord0: Int32, coord1: Int32, tidx: Int32, smem_ptr):
        """out[row tile coord0, cols block coord1]; ``tensors`` = (mX, mW, mTileInfo,
        [mRowToken,] mOut).

        mX: (T, K) gathered through mRowToken (x token-major) or (tiles*block_m, K) padded,
        mW: (E, N, K) or (E, 2N, K) with silu_mul, mTileInfo: (tiles, 2) int32 (in the slot
        layout the top-k's ids (T, k): tiles = T * k, the tile's one row is row t), mRowToken:
        (tiles*block_m,) int32, mOut: (tiles*block_m, N). The portable path (fp32, or no
        Hopper): SIMT FMA. Each block_k slice of A and of w[e] is converted to fp32 into shared
        memory (zero outside valid rows, N and K: the main loop needs no predicates); thread t
        owns outputs t, t + NUM_THREADS, ... of the (block_m, block_n) tile in row-major order
        with fp32 accumulators in registers. Consecutive threads read consecutive n: the B pitch
        block_k + 1 spreads them over all banks while A is a broadcast. Rows outside the tile's
        own ([0, valid), or row t) are not written; no-op when e names no expert.
        """
        bm, bn, bk = self.block_m, self.block_n, self.block_k
        gathered = self.row_token is not None
        fused = self.epilogue == "silu_mul"
        mX, mW, mTileInfo = tensors[0], tensors[1], tensors[2]
        if cutlass.const_expr(self.combine is not None):
            raise GraphError(
                "moe_grouped_gemm: the fused combine has only the Hopper tile (sm_90a); "
                "build the graph without it here"
            )
        mOut = tensors[len(tensors) - 1]
        k_slots = self._slots
        expert = self._device_expert(tensors, coord0)
        lo = Int32(0)  # the tile's rows [lo, hi) are its own
        hi = Int32(0)
        if cutlass.const_expr(k_slots):
            lo = coord0 // k_slots
            hi = lo + 1
            if expert >= mW.shape[0]:
                expert = Int32(-1)
        else:
            hi = mTileInfo[coord0, 1]
        if expert >= 0:
            kdim = mX.shape[1]
            ndim = mOut.shape[1]
            r0 = coord0 * bm
            c0 = coord1 * bn
            pitch = bk + 1
            base = cute.recast_ptr(smem_ptr, dtype=Float32)
            sA = cute.make_tensor(base, cute.make_layout((bm, bk), stride=(pitch, 1)))
            sB = cute.make_tensor(base + bm * pitch, cute.make_layout((bn, bk), stride=(pitch, 1)))
            sU = sB  # the up rows (silu_mul); aliases sB otherwise (never read then)
            if cutlass.const_expr(fused):
                sU = cute.make_tensor(
                    base + (bm + bn) * pitch, cute.make_layout((bn, bk), stride=(pitch, 1))
                )
            nb = 2 if fused else 1
            sSrc = cute.make_tensor(
                cute.recast_ptr(base + (bm + nb * bn) * pitch, dtype=Int32), cute.make_layout(bm)
            )
            from_tokens = self.slot_input == "tokens"
            for m in range(tidx, bm, NUM_THREADS):
                src = Int32(-1)
                if m >= lo and m < hi:
                    if cutlass.const_expr(gathered):
                        src = tensors[3][r0 + m]
                    elif cutlass.const_expr(from_tokens):
                        src = m
                    else:
                        src = r0 + m
                sSrc[m] = src

            per_thread = (bm * bn + NUM_THREADS - 1) // NUM_THREADS
            acc = cute.make_rmem_tensor((per_thread,), Float32)
            acc_up = cute.make_rmem_tensor((per_thread,), Float32)
            acc.fill(0.0)
            acc_up.fill(0.0)
            simt_sync()
            for k0 in range(0, kdim, bk):
                for idx in range(tidx, bm * bk, NUM_THREADS):
                    m = idx // bk
                    kk = k0 + idx % bk
                    src = sSrc[m]
                    a = Float32(0.0)
                    if src >= 0 and kk < kdim:
                        a = mX[src, kk].to(Float32)
                    sA[m, idx % bk] = a
                for idx in range(tidx, bn * bk, NUM_THREADS):
                    n = c0 + idx // bk
                    kk = k0 + idx % bk
                    b = Float32(0.0)
                    if n < ndim and kk < kdim:
                        b = mW[expert, n, kk].to(Float32)
                    sB[idx // bk, idx % bk] = b
                    if cutlass.const_expr(fused):
                        u = Float32(0.0)
                        if n < ndim and kk < kdim:
                            u = mW[expert, ndim + n, kk].to(Float32)
                        sU[idx // bk, idx % bk] = u
                simt_sync()
                for q in cutlass.range_constexpr(per_thread):
                    idx = tidx + q * NUM_THREADS
                    if idx < bm * bn:
                        m = idx // bn
                        n = idx % bn
                        s = acc[q]
                        for kk in cutlass.range_constexpr(bk):
                            s = s + sA[m, kk] * sB[n, kk]
                        acc[q] = s
                        if cutlass.const_expr(fused):
                            su = acc_up[q]
                            for kk in cutlass.range_constexpr(bk):
                                su = su + sA[m, kk] * sU[n, kk]
                            acc_up[q] = su
                # the next slice overwrites sA/sB: everyone must be done reading this one
                simt_sync()

            for q in cutlass.range_constexpr(per_thread):
                idx = tidx + q * NUM_THREADS
                m = idx // bn
                n = c0 + idx % bn
                if idx < bm * bn and n < ndim and m >= lo and m < hi:
                    v = acc[q]
                    if cutlass.const_expr(fused):
                        v = v / (Float32(1.0) + cute.math.exp(-v)) * acc_up[q]
                    mOut[r0 + m, n] = v.to(mOut.element_type)


def moe_grouped_gemm(
    x: TensorSpec,
    w: TensorSpec,
    tile_info: TensorSpec,
    row_token: Optional[TensorSpec] = None,
    *,
    block_m: int = 64,
    block_n: int = 64,
    epilogue: Optional[str] = None,
    expert_rows: Optional[int] = None,
) -> MoeGroupedGemmTile:
    """Grouped GEMM over ``moe_route``'s layout (see the module doc); ``expert_rows``, the most
    rows one expert can have (the most tokens), lets the Hopper tile load fewer A rows."""
    return MoeGroupedGemmTile(x, w, tile_info, row_token, block_m, block_n, epilogue, expert_rows)


def moe_slot_gemm(
    x: TensorSpec,
    w: TensorSpec,
    ids: TensorSpec,
    combine: Optional[TensorSpec] = None,
    residual: Optional[TensorSpec] = None,
    *,
    slot_input: str = "tokens",
    block_m: int = 64,
    block_n: int = 64,
    epilogue: Optional[str] = None,
    expert_rows: Optional[int] = None,
) -> MoeGroupedGemmTile:
    """Grouped GEMM over the slot layout of the top-k's ``ids`` (T, k) (see the module doc):
    ``slot_input="tokens"`` for the gate/up projection of the token-major x, ``"slots"`` for the
    down projection of its output. ``expert_rows`` defaults to the most tokens.

    ``combine``: the top-k's weights (T, k) fp32, for the down projection with the MoE combine
    fused (Hopper tile only): the op's outputs are then ``(y, part, counts)``, y (T, N) the
    block's output; use ``y``. ``residual`` (T, N), with ``combine``: y = the block's output +
    residual, added in fp32 before the one rounding (a decoder layer's residual add)."""
    expect_ndim(ids, 2, "moe_slot_gemm ids")
    if expert_rows is None:
        expert_rows = upper(ids.shape[0])
    return MoeGroupedGemmTile(
        x,
        w,
        ids,
        None,
        block_m,
        block_n,
        epilogue,
        expert_rows,
        slot_input=slot_input,
        combine=combine,
        residual=residual,
    )
