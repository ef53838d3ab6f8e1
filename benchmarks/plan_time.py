"""Host time to plan a new token count: instantiate (tasks and events), static schedule and its
check, lowering to the kernel's arrays (static and dynamic), for the Qwen3-30B-A3B MoE block
(MegaMoE's prefill tiles) and the Qwen3-8B MLP, at several token counts, best of 5 runs each;
also the per-tile planning path (``cutemk.plan.PER_TILE``) the array path replaced. Runs
without a GPU (these are the stages a first call at a new token count pays before its
launch).

Run: python benchmarks/plan_time.py [--tokens 128 1024 4096]
"""

from __future__ import annotations

import argparse

import torch

import cutemk as mk
import cutemk.plan as plan_mod
from cutemk.bench import Results, plan_stages
from cutemk.layers import MoeConfig, mlp_graph, moe_graph
from cutemk.regimes import MOE_TILES

NUM_SMS = 132


def _stages(graph, t: int, repeat: int = 5) -> dict[str, float]:
    """Each stage's best of ``repeat`` runs (a shared machine's timings are noisy)."""
    runs = [_stages_once(graph, t) for _ in range(repeat)]
    return {k: min(r[k] for r in runs) for k in runs[0]}


def _stages_once(graph, t: int) -> dict[str, float]:
    out = plan_stages(graph, {"T": t}, NUM_SMS)
    return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in out.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 128, 1024, 4096])
    p.add_argument("--per-tile", action="store_true", help="also time the per-tile path")
    args = p.parse_args(argv)
    moe_cfg = MoeConfig(2048, 768, 128, 8, router_dtype=None, **MOE_TILES[("cute", "prefill")])
    graphs = {
        "moe_qwen3_30b_a3b": moe_graph(mk.sym("T", max=8192), moe_cfg, torch.bfloat16),
        "mlp_qwen3_8b": mlp_graph(
            mk.sym("T", max=8192), 4096, 12288, torch.bfloat16, 128, 128, fuse_silu=True
        ),
    }
    res = Results("plan_time", meta={"num_sms": NUM_SMS, "unit": "ms of host time"})
    for name, g in graphs.items():
        g.validate()
        _stages_once(g, 1)  # warm imports and caches
        paths = [False, True] if args.per_tile else [False]
        for per_tile in paths:
            plan_mod.PER_TILE = per_tile
            for t in args.tokens:
                s = _stages(g, t)
                total_static = s["instantiate"] + s["schedule"] + s["lower_static"]
                total_dynamic = s["instantiate"] + s["lower_dynamic"]
                impl = "per_tile" if per_tile else "arrays"
                res.add(
                    f"{name} T={t}",
                    impl,
                    1e3 * total_static,
                    static_ms=round(total_static, 2),
                    dynamic_ms=round(total_dynamic, 2),
                    **s,
                )
        plan_mod.PER_TILE = False
    print(res.table())
    res.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
