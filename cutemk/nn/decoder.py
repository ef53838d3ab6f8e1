"""MegaDecoderLayer: a Qwen3 decoder layer's decode step as one megakernel."""

from __future__ import annotations

import math
from dataclasses import fields, replace
from typing import Any

import torch
from torch import nn

from .. import torch_ops
from ..errors import CuteMKError, DataError, LayoutError, ShapeError
from ..moe_layers import fused_combine_has_tile
from ..regimes import (
    DECODER_FUSED_REDUCE,
    DECODER_MOE_CONFIG,
    DECODER_MOE_REGIME_LIMITS,
    DECODER_REGIME_CONFIG,
    DECODER_REGIME_LIMITS,
    MOE_REGIME_LIMITS,
    moe_tiles,
    regime_of,
    split_reduce_in_tiles,
)
from ..symbolic import sym
from ..tileop import expect_positive_int
from .base import (
    _check_launch,
    _check_no_bias,
    _check_silu,
    _KeyedModule,
    _sm_count,
    check_live_reference_args,
)
from .moe import MegaMoE


class MegaDecoderLayer(_KeyedModule):
    """Decode steps of a Qwen3 decoder layer (dense MLP) as one megakernel
    (:func:`cutemk.layers.decoder_layer_graph`), over a paged KV cache the caller owns.

    ``forward(x, positions, k_cache, v_cache, page_table, seq_lens)``: ``x`` (B, H) one new
    token per sequence, ``positions`` (B,) int32 its position, caches (pages, page_size, Hkv, D)
    (the new keys and values are written into them, in place), ``page_table`` (B, max_pages)
    int32, ``seq_lens`` (B,) int32 counting the new token; returns the layer's output (B, H).
    Built from transformers' ``Qwen3DecoderLayer`` or ``Qwen3MoeDecoderLayer`` (``moe``: its
    sparse block's :class:`cutemk.layers.MoeConfig`) by :meth:`from_hf`. Inference only.
    Three regimes (:data:`DECODER_REGIME_LIMITS`), one graph each, compiled on first use: up
    to 8 sequences with the q/k/v tail as one phase, up to 16 with it in three, then larger
    tiles; a MoE layer has instead one for one or two sequences, then the last two
    (:data:`DECODER_MOE_REGIME_LIMITS`), its sparse block on the tiles MegaMoE runs for the
    regime's largest batch (:func:`cutemk.regimes.moe_tiles`: 'slots' for one or two
    sequences, 'gemv' up to 16, 'decode' past that; the block's own tile fields are not used,
    in decode steps or prefill).
    With ``max_prefill_tokens`` it also takes prefill steps (:meth:`prefill`, a third graph:
    :func:`cutemk.layers.decoder_prefill_graph`); ``prefill_tiles`` (block_m, block_n) are its
    dense GEMMs' tiles (default: the decode ones); a MoE layer's sparse block takes
    MegaMoE's prefill tiles and routing there.
    """

    regime_limits = DECODER_REGIME_LIMITS

    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        cfg: Any,
        moe: Any = None,
        max_batch: int = 64,
        backend: str | None = None,
        scheduler: Any = "static",
        num_sms: int | None = None,
        max_prefill_tokens: int = 0,
        prefill_tiles: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        from ..layers import DecoderConfig, MoeConfig

        if not isinstance(cfg, DecoderConfig):
            raise TypeError(f"cfg must be a DecoderConfig, got {type(cfg).__name__}")
        if moe is not None and not isinstance(moe, MoeConfig):
            raise TypeError(f"moe must be None or a MoeConfig, got {type(moe).__name__}")
        expect_positive_int(max_batch, "max_batch")
        if max_prefill_tokens:
            expect_positive_int(max_prefill_tokens, "max_prefill_tokens")
        if prefill_tiles is not None:
            if not isinstance(prefill_tiles, (tuple, list)) or len(prefill_tiles) != 2:
                raise ValueError(f"prefill_tiles must be (block_m, block_n), got {prefill_tiles}")
            for v in prefill_tiles:
                expect_positive_int(v, "prefill_tiles")
            prefill_tiles = tuple(int(v) for v in prefill_tiles)
        self.max_prefill_tokens, self.prefill_tiles = max_prefill_tokens, prefill_tiles
        if backend not in (None, "cute", "interpret"):
            raise ValueError(f"backend must be None, 'cute' or 'interpret', got {backend!r}")
        self.cfg, self.moe, self.max_batch = cfg, moe, max_batch
        if moe is not None:
            self.regime_limits = DECODER_MOE_REGIME_LIMITS
        _check_launch(scheduler, num_sms)
        self.backend, self.scheduler, self.num_sms = backend, scheduler, num_sms
        if not isinstance(weights, dict) or not all(
            isinstance(k, str) and isinstance(w, torch.Tensor) for k, w in weights.items()
        ):
            raise TypeError("weights must be a dict of name -> torch.Tensor")
        self._check_weight_names(weights)
        self._names = list(weights)
        for name, w in weights.items():
            self.register_buffer(name, w.detach().contiguous())
        self._cutemk_key = (
            f"MegaDecoderLayer({cfg!r}, moe={moe!r}, weights={self._names}, max={max_batch}, "
            f"backend={backend}, scheduler={scheduler!r}, sms={num_sms}, "
            f"prefill={max_prefill_tokens}, prefill_tiles={prefill_tiles})"
        )
        torch_ops.key_of(self)

    def _check_weight_names(self, weights: dict[str, torch.Tensor]) -> None:
        """The weights are exactly the decode graph's (a missing one would surface at the first
        call, an extra one clash with a call argument or a module attribute)."""
        first = next(iter(self.regime_limits))
        dtype = next(iter(weights.values())).dtype if weights else torch.float32
        graph = self.regime_graph(first, dtype, "interpret")
        want = {v.name for v in graph.leaves if v.kind == "weight"}
        missing = sorted(want - set(weights))
        extra = sorted(set(weights) - want)
        if missing or extra:
            raise ValueError(
                f"MegaDecoderLayer weights: missing {missing}, unexpected {extra} (this "
                f"configuration takes {sorted(want)})"
            )

    @classmethod
    def from_hf(
        cls,
        layer: nn.Module,
        page_size: int = 16,
        max_pages: int = 256,
        max_positions: int | None = None,
        rope_theta: float | None = None,
        tiles: tuple[int, int] = (64, 64),
        options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> MegaDecoderLayer:
        """From transformers' ``Qwen3DecoderLayer`` / ``Qwen3MoeDecoderLayer`` (its rotary
        settings from its attention's config: the default rope, ``rope_theta``). ``options``:
        further :class:`cutemk.layers.DecoderConfig` fields (e.g. ``{"fused_append": True}``).

        The attention and dense MLP weights are copied; a MoE block's router and experts are
        taken as :meth:`MegaMoE.from_hf` takes them (the 5.x layout's experts not copied: they
        are most of the layer's memory), so an in-place change of those shows in both modules;
        ``copy.deepcopy`` the layer first where the two must be independent."""
        from ..layers import DecoderConfig, MoeConfig, fold_decoder_norms
        from ..ops import rope_table

        if not (hasattr(layer, "self_attn") and hasattr(layer, "mlp")):
            raise TypeError(
                "MegaDecoderLayer.from_hf takes a transformers decoder layer (self_attn, mlp), "
                f"got {type(layer).__name__}"
            )
        if not (
            isinstance(tiles, (tuple, list))
            and len(tiles) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in tiles)
        ):
            raise ValueError(f"tiles must be (block_m, block_n), two positive ints, got {tiles!r}")
        if max_positions is not None:
            expect_positive_int(max_positions, "max_positions")
        a, m = layer.self_attn, layer.mlp
        conf = a.config
        head_dim = a.head_dim
        params = getattr(conf, "rope_parameters", None) or getattr(conf, "rope_scaling", None)
        params = params or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in (None, "default"):
            raise ValueError(f"MegaDecoderLayer: rope type {rope_type!r} is not supported yet")
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if getattr(a, name).bias is not None:
                raise ValueError(f"MegaDecoderLayer: {name} has a bias, not supported yet")
        if getattr(a, "sliding_window", None):
            raise ValueError("MegaDecoderLayer: sliding-window attention is not supported yet")
        for name in ("q_norm", "k_norm"):  # Qwen3's per-head norms (Llama's layers have none)
            if not isinstance(getattr(getattr(a, name, None), "weight", None), torch.Tensor):
                raise ValueError(
                    f"MegaDecoderLayer: {type(a).__name__} has no {name}; the layer computes "
                    "Qwen3's per-head q/k RMSNorm (Qwen3DecoderLayer, Qwen3MoeDecoderLayer)"
                )
        theta = rope_theta
        if theta is None:
            theta = params.get("rope_theta", getattr(conf, "rope_theta", 10000.0))
        if not (isinstance(theta, (int, float)) and math.isfinite(theta) and theta > 0):
            raise ValueError(
                f"MegaDecoderLayer: rope_theta must be a finite number > 0, got {theta!r}"
            )
        max_pos = max_positions or conf.max_position_embeddings
        sparse = hasattr(m, "experts")
        if not sparse:
            for name in ("gate_proj", "up_proj", "down_proj"):
                _check_no_bias(getattr(m, name), f"{type(m).__name__}.{name}")
            _check_silu(m)
        moe = None
        if sparse:  # the sparse block's weights as MegaMoE reads them (5.x or 4.x layout)
            block = MegaMoE.from_hf(m, max_tokens=kwargs.get("max_batch", 64), backend="interpret")
            moe = MoeConfig(
                block.hidden,
                block.intermediate,
                block.num_experts,
                block.top_k,
                block.norm_topk_prob,
                block_m=tiles[0],
                block_n=tiles[1],
                router_dtype=None,
            )
        cfg = DecoderConfig(
            hidden=conf.hidden_size,
            intermediate=moe.intermediate if sparse else m.gate_proj.weight.shape[0],
            heads=conf.num_attention_heads,
            kv_heads=conf.num_key_value_heads,
            head_dim=head_dim,
            page_size=page_size,
            max_pages=max_pages,
            max_positions=max_pos,
            eps=layer.input_layernorm.variance_epsilon,
            block_m=tiles[0],
            block_n=tiles[1],
            fold_norms=True,
        )
        _check_layer_options(options, sparse)
        if options:
            # what the layer and the arguments above decide (the folded weights below assume
            # fold_norms) is not an option
            fixed = {"hidden", "intermediate", "heads", "kv_heads", "head_dim", "eps"}
            fixed |= {"page_size", "max_pages", "max_positions", "block_m", "block_n"}
            taken = sorted((fixed | {"fold_norms"}) & set(options))
            if taken:
                raise ValueError(
                    f"MegaDecoderLayer.from_hf: options may not set {taken} (the HF layer and "
                    "from_hf's own arguments decide them)"
                )
            cfg = replace(cfg, **options)
        w = {
            "input_norm": layer.input_layernorm.weight,
            "w_qkv": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
            "q_norm": a.q_norm.weight,
            "k_norm": a.k_norm.weight,
            "cos_sin": rope_table(max_pos, head_dim, float(theta)).to(a.q_proj.weight.device),
            "w_o": a.o_proj.weight,
            "post_norm": layer.post_attention_layernorm.weight,
        }
        if sparse:
            w.update(w_router=block.w_router, w_gate_up=block.w_gate_up, w_down=block.w_down)
        else:
            w.update(
                w_gate_up=torch.cat([m.gate_proj.weight, m.up_proj.weight]),
                w_down=m.down_proj.weight,
            )
        # copies, as the docstring says: a tensor taken as it is would share the HF layer's
        # memory, so loading or editing one module would change the other. The MoE block's
        # weights stay as MegaMoE.from_hf took them (a copy of the experts would double the
        # memory of a model converted while its HF copy is alive)
        held = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), *layer.buffers())}
        moe_names = {"w_router", "w_gate_up", "w_down"} if sparse else set()
        w = {
            k: v.detach().clone()
            if k not in moe_names and v.untyped_storage().data_ptr() in held
            else v
            for k, v in fold_decoder_norms(w, moe=sparse).items()
        }
        return cls(w, cfg, moe=moe, **kwargs)

    def _apply(self, fn, *args, **kwargs):
        # the rotary table stays fp32 whatever the weights are cast to (the graphs read it
        # so): ``.to(torch.bfloat16)`` / ``.half()`` move it with them, never cast it
        table = self._buffers.get("cos_sin")
        out = super()._apply(fn, *args, **kwargs)
        moved = self._buffers.get("cos_sin")
        if table is not None and moved is not None and moved.dtype != torch.float32:
            self._buffers["cos_sin"] = table.to(device=moved.device, dtype=torch.float32)
        return out

    @property
    def max_tokens(self) -> int:
        """One new token a sequence: the most tokens a step takes is ``max_batch``."""
        return self.max_batch

    @property
    def hidden(self) -> int:
        return self.cfg.hidden

    def compiled(self, regime: str, like: torch.Tensor | None = None) -> Any:
        """The compiled graph of a regime (``regime_limits``: :data:`DECODER_REGIME_LIMITS`, or
        :data:`DECODER_MOE_REGIME_LIMITS` with a MoE block) for weights like
        ``like`` (default: this module's ``w_down``), compiled on first use: graphs up to
        ``GEMV_MAX_BATCH`` sequences, one for the rest (a graph's weight loads are sized for
        its largest batch, and a box of mostly absent rows costs the copy engine nearly a full
        one); a regime's :data:`DECODER_REGIME_CONFIG` sets the switches the module's config
        leaves None."""

        def build(dtype, device, backend):
            return self.regime_graph(regime, dtype, backend, self.num_sms or _sm_count(device))

        return self._graph(regime, like, build)

    def regime_graph(
        self, regime: str, dtype: torch.dtype, backend: str = "cute", num_sms: int | None = None
    ) -> Any:
        """The graph :meth:`compiled` compiles for ``regime`` (no weights needed), its tiles
        fitted to ``num_sms`` SMs (default: the module's, else the H200's)."""
        from ..layers import decoder_layer_graph, decoder_prefill_graph

        if regime == "prefill":
            cfg, moe = self.cfg, self.moe
            if self.prefill_tiles is not None:
                cfg = replace(cfg, block_m=self.prefill_tiles[0], block_n=self.prefill_tiles[1])
            if moe is not None:  # the sparse block: MegaMoE's prefill tiles and routing
                moe = replace(moe, **moe_tiles("prefill", moe.hidden, backend, dtype))
            tokens = sym("T", max=self.max_prefill_tokens)
            return decoder_prefill_graph(tokens, sym("B", max=self.max_batch), cfg, dtype, moe)
        limit = self.regime_limits[regime]
        limit = self.max_batch if limit is None else min(self.max_batch, limit)
        moe, cfg = self.moe, self.cfg
        if moe is not None:  # MegaMoE's tiles for the largest count the graph serves
            block_regime = regime_of(MOE_REGIME_LIMITS, limit)
            sms = num_sms or self.num_sms
            sizes = {"intermediate": moe.intermediate, "top_k": moe.top_k, "num_sms": sms}
            moe = replace(moe, **moe_tiles(block_regime, moe.hidden, backend, dtype, **sizes))
            if self.cfg.moe_router_topk is not None:
                moe = replace(moe, router_topk=self.cfg.moe_router_topk)
        chosen = dict(DECODER_REGIME_CONFIG.get(regime, {}))
        if moe is not None:
            chosen.update(DECODER_MOE_CONFIG)
        cfg = replace(cfg, **{k: v for k, v in chosen.items() if getattr(cfg, k) is None})
        if split_reduce_in_tiles(DECODER_FUSED_REDUCE.get((backend, regime))):
            cfg = replace(cfg, fused_reduce=True)
        g = decoder_layer_graph(sym("B", max=limit), cfg, dtype, moe)
        if backend == "cute" and moe is not None and moe.fused_combine:
            if not fused_combine_has_tile(g):  # its only (Hopper) tile: the combine step
                g = decoder_layer_graph(
                    sym("B", max=limit), cfg, dtype, replace(moe, fused_combine=False)
                )
        return g

    def warm_inputs(self, batch: int) -> tuple[torch.Tensor, ...]:
        """A decode step of ``batch`` sequences for :func:`cutemk.warmup`: one token each, at
        position 0 of its own one-page cache (zeros, on the weights' device and dtype)."""
        cfg, w = self.cfg, self.w_down
        kw = {"device": w.device}
        cache = (batch, cfg.page_size, cfg.kv_heads, cfg.head_dim)
        table = torch.arange(batch, dtype=torch.int32, **kw)[:, None].repeat(1, cfg.max_pages)
        return (
            torch.zeros(batch, cfg.hidden, dtype=w.dtype, **kw),
            torch.zeros(batch, dtype=torch.int32, **kw),
            torch.zeros(cache, dtype=w.dtype, **kw),
            torch.zeros(cache, dtype=w.dtype, **kw),
            table,
            torch.ones(batch, dtype=torch.int32, **kw),
        )

    def warm_step(self, regime: str) -> None:
        """A step of ``regime`` on its own inputs, for :func:`cutemk.warmup` (the prefill
        regime: one sequence of one token at position 0 of a one-page cache of zeros)."""
        if regime != "prefill":
            raise ValueError(f"no warm-up step for regime {regime!r}")
        x, positions, k, v, table, lens = self.warm_inputs(1)
        cu = torch.tensor([0, 1], dtype=torch.int32, device=x.device)
        self.prefill(x, positions, k, v, table, lens, cu)

    def regimes(self) -> tuple[str, ...]:
        """The decode regimes, and 'prefill' where the module takes prefill steps."""
        decode = super().regimes()
        return decode + ("prefill",) if self.max_prefill_tokens else decode

    def forward(
        self,
        x,
        positions,
        k_cache,
        v_cache,
        page_table,
        seq_lens,
        cu_seqlens=None,
        num_tokens=None,
    ) -> torch.Tensor:
        """A decode step, or with ``cu_seqlens`` a prefill step (:meth:`prefill`); with
        ``num_tokens`` a decode step whose batch is device data (:meth:`forward_live`)."""
        if num_tokens is not None:
            if cu_seqlens is not None:
                raise CuteMKError("num_tokens is for decode steps; a prefill step has cu_seqlens")
            return self.forward_live(
                x, positions, k_cache, v_cache, page_table, seq_lens, num_tokens
            )
        if cu_seqlens is not None:
            return self.prefill(x, positions, k_cache, v_cache, page_table, seq_lens, cu_seqlens)
        _expect_tensor(x, "x")
        if x.dim() != 2 or x.shape[1] != self.cfg.hidden:
            raise ShapeError(f"x must be (B, {self.cfg.hidden}), got {tuple(x.shape)}")
        if x.shape[0] > self.max_batch:
            raise ShapeError(f"batch {x.shape[0]} is more than max_batch={self.max_batch}")
        weights = [getattr(self, n) for n in self._names]
        x = x.detach()
        if torch_ops.direct(x):
            return self._launch(x, positions, k_cache, v_cache, page_table, seq_lens, weights)
        key = torch_ops.key_of(self)
        return torch.ops.cutemk.mega_decoder_layer(
            x, positions, k_cache, v_cache, page_table, seq_lens, weights, key
        )

    _op_rows_name = "max_batch"

    def _leaf_weights(self) -> tuple[torch.Tensor, ...]:
        """The weights the custom op takes, in ``_names`` order."""
        return tuple(getattr(self, n) for n in self._names)

    def decode_regime_starts(self) -> list[tuple[str, int]]:
        """(regime, its smallest batch) of each decode regime this module runs."""
        return [(r, first) for r, first in self.regime_starts() if r != "prefill"]

    def forward_live(
        self, x, positions, k_cache, v_cache, page_table, seq_lens, num_tokens, out=None
    ) -> torch.Tensor:
        """A decode step of the first ``num_tokens`` sequences, the count read on the GPU: no
        host work depends on it, so a CUDA graph captured once replays at every batch up to
        ``max_batch``. ``x`` (max_batch, H), ``positions`` / ``seq_lens`` (max_batch,) and
        ``page_table`` (max_batch, max_pages) hold the live sequences in their first rows;
        rows past the count are absent whatever they hold: no append into the caches, no
        attention (``TileOp.live_rows_inputs``), their output rows undefined. Launches every
        decode regime's kernel (:meth:`CuteGraph.live <cutemk.runtime.CuteGraph.live>`, the
        caches' page count fixed per live graph); the one whose range holds the count runs.
        A count outside [0, max_batch] runs nothing and is raised by :meth:`check_live`. On
        the interpreter the count is read on the host."""
        _check_caches(k_cache, v_cache)
        b, hidden = self.max_batch, self.cfg.hidden
        shapes = {
            "x": (x, (b, hidden)),
            "positions": (positions, (b,)),
            "page_table": (page_table, (b, self.cfg.max_pages)),
            "seq_lens": (seq_lens, (b,)),
        }
        for name, (t, want) in shapes.items():
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ShapeError(
                    f"forward_live takes {name} at max_batch={b} rows: {want}, got {got}"
                )
        if not torch_ops.direct(x):
            raise CuteMKError("MegaDecoderLayer.forward_live runs eagerly or under a CUDA graph")
        if self.resolved_backend() != "cute":
            return self._live_reference(
                x, positions, k_cache, v_cache, page_table, seq_lens, num_tokens, out
            )
        named = {n: getattr(self, n) for n in self._names}
        named.update(
            x=x.detach(),
            positions=positions,
            k_cache=k_cache,
            v_cache=v_cache,
            page_table=page_table,
            seq_lens=seq_lens,
        )
        y = torch.empty_like(x) if out is None else out
        rows_of = {"x", "positions", "page_table", "seq_lens"}
        with torch.no_grad():
            for rows, graph, live in self.live_graphs(k_cache.shape[0]):
                leaves = [
                    named[v.name][:rows] if v.name in rows_of else named[v.name]
                    for v in graph.graph.leaves
                ]
                live(*leaves, num_tokens=num_tokens, out=(y[:rows],))
        return y

    def live_graphs(self, pages: int, build: bool = True) -> list[tuple[int, Any, Any]]:
        """(rows, compiled graph, :class:`~cutemk.live.LiveGraph`) of each decode regime for
        caches of ``pages`` pages: built on first use (compiling the live kernels, planning
        every batch); with ``build=False`` only those built so far."""
        if self.resolved_backend() != "cute":
            raise CuteMKError("a live batch needs the cute backend (a CUDA GPU)")
        out = []
        fixed = {"pages": int(pages)}
        for regime, first in self.decode_regime_starts():
            rows = min(self.regime_limits[regime] or self.max_batch, self.max_batch)
            graph = self.compiled(regime)
            if build:
                live = graph.live(first=first, limit=self.max_batch, fixed=fixed)
            else:
                live = graph.live_built(first=first, limit=self.max_batch, fixed=fixed)
            if live is not None:
                out.append((rows, graph, live))
        return out

    def check_live(self, pages: int) -> None:
        """Raise CuteMKError if a :meth:`forward_live` on caches of ``pages`` pages since the
        last check got a count outside [0, max_batch] (it ran nothing); waits for them."""
        if self.resolved_backend() != "cute":
            return
        tallies = [live.take_errors() for _, _, live in self.live_graphs(pages, build=False)]
        bad, last = max(tallies, default=(0, 0))
        if bad:
            raise CuteMKError(
                f"MegaDecoderLayer: {bad} forward_live call(s) got a batch outside "
                f"[0, {self.max_batch}] (the last: {last}) and computed nothing"
            )

    def _live_reference(
        self, x, positions, k_cache, v_cache, page_table, seq_lens, num_tokens, out
    ):
        """:meth:`forward_live` on the interpreter: the count read on the host, the first
        ``n`` sequences stepped (the rest absent: nothing appended for them)."""
        check_live_reference_args(x, num_tokens, out)
        n = int(num_tokens.reshape(()))
        if not 0 <= n <= self.max_batch:
            raise CuteMKError(
                f"MegaDecoderLayer: forward_live got a batch of {n}, outside [0, {self.max_batch}]"
            )
        y = torch.empty_like(x) if out is None else out
        if n:
            y[:n] = self.forward(
                x[:n], positions[:n], k_cache, v_cache, page_table[:n], seq_lens[:n]
            )
        return y

    def _launch(self, x, positions, k_cache, v_cache, page_table, seq_lens, weights):
        """The megakernel call behind ``torch.ops.cutemk.mega_decoder_layer``."""
        _check_caches(k_cache, v_cache)
        if x.shape[0] == 0:  # no sequence: nothing to append or attend (as a live count of 0)
            return x.new_empty((0, self.cfg.hidden))
        named = dict(zip(self._names, weights))
        with torch.no_grad():
            return self.compiled(self.regime(x.shape[0]), like=named["w_down"])(
                x=x,
                positions=positions,
                k_cache=k_cache,
                v_cache=v_cache,
                page_table=page_table,
                seq_lens=seq_lens,
                **named,
            )

    def prefill(self, x, positions, k_cache, v_cache, page_table, seq_lens, cu_seqlens):
        """A prefill step (:func:`cutemk.layers.decoder_prefill_graph`): ``x`` (T, H) the new
        tokens of B sequences side by side, sequence b's rows ``[cu_seqlens[b], cu_seqlens[b +
        1])`` (int32, B + 1), ``positions`` (T,) int32 each token's position, ``seq_lens`` (B,)
        counting the new tokens, the caches and page table as a decode step's (every new
        token's keys and values are written into the caches, in place). Needs a module built
        with ``max_prefill_tokens``; eager only (no custom op for ``torch.compile`` yet)."""
        _check_caches(k_cache, v_cache)
        if not self.max_prefill_tokens:
            raise CuteMKError(
                "this MegaDecoderLayer takes no prefill steps: build it with max_prefill_tokens"
            )
        _expect_tensor(x, "x")
        _expect_tensor(seq_lens, "seq_lens")
        if x.dim() != 2 or x.shape[1] != self.cfg.hidden:
            raise ShapeError(f"x must be (T, {self.cfg.hidden}), got {tuple(x.shape)}")
        if x.shape[0] > self.max_prefill_tokens:
            raise ShapeError(
                f"{x.shape[0]} new tokens is more than max_prefill_tokens={self.max_prefill_tokens}"
            )
        if seq_lens.dim() != 1 or seq_lens.shape[0] > self.max_batch:
            raise ShapeError(
                f"seq_lens must be (B,) with B <= max_batch={self.max_batch}, got "
                f"{tuple(seq_lens.shape)}"
            )
        x = x.detach()
        if not torch_ops.direct(x):
            raise CuteMKError(
                "MegaDecoderLayer.prefill runs eagerly only: it has no custom op for "
                "torch.compile or tracing yet"
            )
        _check_cu_seqlens(cu_seqlens, seq_lens.shape[0], x.shape[0])
        named = {n: getattr(self, n) for n in self._names}
        with torch.no_grad():
            return self.compiled("prefill", like=named["w_down"])(
                x=x,
                positions=positions,
                k_cache=k_cache,
                v_cache=v_cache,
                page_table=page_table,
                seq_lens=seq_lens,
                cu_seqlens=cu_seqlens,
                **named,
            )


MOE_ONLY_OPTIONS = frozenset({"moe_residual_in_combine", "moe_router_topk", "post_norm_in_reduce"})
""":class:`cutemk.layers.DecoderConfig` switches that change only a layer with a MoE block (a
dense layer's post-attention norm is folded into its gate/up projection)."""


def _check_layer_options(options: Any, sparse: bool) -> None:
    """``MegaDecoderLayer.from_hf``'s ``options``: a dict of known
    :class:`~cutemk.layers.DecoderConfig` fields with values of their types (a bool switch
    takes a bool: ``"no"`` would be true), the MoE block's switches only on a MoE layer."""
    from ..layers import DecoderConfig

    if options is None:
        return
    if not isinstance(options, dict):
        raise TypeError(f"options must be a dict of DecoderConfig fields, got {options!r}")
    kinds = {f.name: str(f.type) for f in fields(DecoderConfig)}
    for name, value in options.items():
        kind = kinds.get(name)
        if kind is None:
            raise TypeError(f"options: DecoderConfig has no field {name!r}")
        if value is None and "None" in kind:
            continue
        if kind.startswith("bool"):
            if not isinstance(value, bool):
                raise TypeError(f"options: {name} must be a bool, got {value!r}")
        elif kind.startswith("int") and (not isinstance(value, int) or isinstance(value, bool)):
            raise TypeError(f"options: {name} must be an int, got {value!r}")
        if name in MOE_ONLY_OPTIONS and value and not sparse:
            raise ValueError(f"options: {name} applies to a layer with a MoE block only")


def _expect_tensor(value: Any, name: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"MegaDecoderLayer: {name} must be a torch.Tensor, got {type(value).__name__}"
        )


def _check_caches(k_cache: Any, v_cache: Any) -> None:
    """The layer writes both caches in place: they must not share memory."""
    if not (isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)):
        return
    if not (torch_ops.direct(k_cache) and torch_ops.direct(v_cache)):
        return  # traced (fake tensors have no memory): the op's real call checks them
    if k_cache.device != v_cache.device or k_cache.numel() == 0 or v_cache.numel() == 0:
        return
    k0, v0 = k_cache.data_ptr(), v_cache.data_ptr()
    k1 = k0 + k_cache.numel() * k_cache.element_size()
    v1 = v0 + v_cache.numel() * v_cache.element_size()
    if k0 < v1 and v0 < k1:
        raise LayoutError("k_cache and v_cache share memory: the layer writes both in place")


def _check_cu_seqlens(cu_seqlens: Any, batch: int, tokens: int) -> None:
    """A prefill step's row offsets must cut x's rows exactly into the batch's sequences:
    rows no sequence covers would never be written. Read on the host (a prefill step is an
    eager call of milliseconds; the copy of B + 1 ints is a small part of it)."""
    if not (
        isinstance(cu_seqlens, torch.Tensor)
        and cu_seqlens.dtype == torch.int32
        and tuple(cu_seqlens.shape) == (batch + 1,)
    ):
        got = (
            (cu_seqlens.dtype, tuple(cu_seqlens.shape))
            if isinstance(cu_seqlens, torch.Tensor)
            else cu_seqlens
        )
        raise ShapeError(f"cu_seqlens must be an int32 tensor of shape ({batch + 1},), got {got}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != tokens or any(b < a for a, b in zip(cu, cu[1:])):
        raise DataError(
            f"cu_seqlens must rise from 0 to x's {tokens} rows (each sequence's rows side by "
            f"side), got {cu}"
        )
