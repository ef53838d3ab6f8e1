"""Tile operators, one per file. Importing this package registers them.

Each module defines a ``...Tile`` op class (a frozen dataclass) and a builder function of the
same name as the module, used with ``Graph.call``: ``g.call(ops.gemm, x, w, block_n=128)``.
"""

from .add import AddTile, add
from .all_gather import AllGatherTile, all_gather
from .attention_decode import (
    AttentionDecodeTile,
    attention_decode,
)
from .attention_prefill import AttentionPrefillTile, attention_prefill
from .gemm import GemmTile, gemm
from .gemm_split import GemmSplitTile, gemm_split
from .gemm_splitk import (
    GemmPartialTile,
    SplitReduceTile,
    DECODE_GATE_UP_WIDTHS,
    SPLIT_WIDTHS,
    choose_split,
    choose_split_k,
    wave_fit_width,
    gemm_partial,
    gemm_split_reduce,
    out_norm_fits,
)
from .kv_append import KvAppendTile, kv_append
from .kv_append_varlen import KvAppendVarlenTile, kv_append_varlen
from .moe_combine import MoeCombineTile, moe_combine
from .moe_grouped_gemm import MoeGroupedGemmTile, moe_grouped_gemm, moe_slot_gemm
from .moe_permute import MoePermuteTile, moe_permute
from .moe_route import MoeRouteTile, max_tiles, moe_route
from .moe_route_split import (
    MoeRouteCountTile,
    MoeRouteLayoutTile,
    MoeRoutePlaceTile,
    moe_route_count,
    moe_route_layout,
    moe_route_place,
)
from .qk_norm_rope import QkNormRopeTile, qk_norm_rope, rope_table
from .reduce_scatter import ReduceScatterTile, reduce_scatter
from .rmsnorm import RmsNormTile, rmsnorm
from .silu_mul import SiluMulTile, silu_mul
from .synthetic import SyntheticDagTile, dag_graph, dag_inputs, synthetic_dag
from .topk import TopkSoftmaxTile, topk_softmax

__all__ = [
    "AddTile",
    "add",
    "AllGatherTile",
    "all_gather",
    "AttentionDecodeTile",
    "attention_decode",
    "AttentionPrefillTile",
    "attention_prefill",
    "ReduceScatterTile",
    "reduce_scatter",
    "GemmTile",
    "gemm",
    "GemmPartialTile",
    "gemm_partial",
    "GemmSplitTile",
    "gemm_split",
    "SplitReduceTile",
    "gemm_split_reduce",
    "out_norm_fits",
    "DECODE_GATE_UP_WIDTHS",
    "SPLIT_WIDTHS",
    "choose_split",
    "choose_split_k",
    "wave_fit_width",
    "KvAppendTile",
    "kv_append",
    "KvAppendVarlenTile",
    "kv_append_varlen",
    "MoeCombineTile",
    "moe_combine",
    "MoeGroupedGemmTile",
    "moe_grouped_gemm",
    "moe_slot_gemm",
    "MoePermuteTile",
    "moe_permute",
    "MoeRouteTile",
    "max_tiles",
    "moe_route",
    "MoeRouteCountTile",
    "moe_route_count",
    "MoeRouteLayoutTile",
    "moe_route_layout",
    "MoeRoutePlaceTile",
    "moe_route_place",
    "QkNormRopeTile",
    "qk_norm_rope",
    "rope_table",
    "RmsNormTile",
    "rmsnorm",
    "SiluMulTile",
    "silu_mul",
    "SyntheticDagTile",
    "synthetic_dag",
    "dag_graph",
    "dag_inputs",
    "TopkSoftmaxTile",
    "topk_softmax",
]
