"""The static schedule of a layer's megakernel at one size, on the CPU (no GPU needed): per node
its tasks and ring slices, then the SMs' queues grouped by their sequence of nodes, e.g.
"116 SMs: qkv_proj x1 > attention_decode0 x1 > o_proj x1 > gate_up x1 > down x1". It shows
where the static scheduler puts small tasks (norms, split reduces, the q/k/v tail) against the
GEMM tiles, and which SMs get nothing, before a GPU trace says what that costs.

Layers (bf16, the graphs the modules build): ``decoder`` (Qwen3-8B, KV 4096, the regime of
``--batch`` sequences), ``mlp`` (Qwen3-8B MLP, the regime of ``--batch`` tokens), ``moe``
(Qwen3-30B-A3B block, likewise).

Run: python benchmarks/schedule_view.py [decoder|mlp|moe] [--batch 1] [--sms 132]
[--ties index|idle]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

import torch

from cutemk.arch import pin_arch


def _decoder_graph(batch: int):
    from dataclasses import replace

    import cutemk as mk
    from cutemk.layers import DecoderConfig, decoder_layer_graph
    from cutemk.regimes import DECODER_REGIME_CONFIG, DECODER_REGIME_LIMITS, regime_of

    kv, page = 4096, 16
    cfg = DecoderConfig(
        hidden=4096,
        intermediate=12288,
        heads=32,
        kv_heads=8,
        head_dim=128,
        page_size=page,
        max_pages=kv // page + 1,
        max_positions=kv + 1,
        block_m=64,
        block_n=64,
        fold_norms=True,
    )
    regime = regime_of(DECODER_REGIME_LIMITS, batch)
    chosen = DECODER_REGIME_CONFIG.get(regime, {})
    cfg = replace(cfg, **{k: v for k, v in chosen.items() if getattr(cfg, k) is None})
    limit = DECODER_REGIME_LIMITS[regime] or max(batch, 64)
    g = decoder_layer_graph(mk.sym("B", max=limit), cfg, torch.bfloat16)
    return g, {"B": batch, "pages": (kv // page) * batch + 1}, regime


def _mlp_graph(tokens: int):
    from cutemk.regimes import REGIME_LIMITS, mlp_regime_graph, regime_of

    regime = regime_of(REGIME_LIMITS, tokens)
    g = mlp_regime_graph(4096, 12288, regime, torch.bfloat16, 8192, "cute", 132)
    return g, {"T": tokens}, regime


def _moe_graph(tokens: int):
    from cutemk.regimes import MOE_REGIME_LIMITS, moe_regime_graph, regime_of

    regime = regime_of(MOE_REGIME_LIMITS, tokens)
    g = moe_regime_graph(2048, 768, 128, 8, True, regime, torch.bfloat16, 4096)
    return g, {"T": tokens}, regime


LAYERS = {"decoder": _decoder_graph, "mlp": _mlp_graph, "moe": _moe_graph}


def queue_patterns(plan, queues) -> Counter:
    """Per distinct sequence of nodes (runs of one node folded to ``name xN``), how many SMs'
    queues have it; an empty queue is ``(idle)``."""
    out: Counter = Counter()
    for q in queues:
        runs: list[list] = []
        for t in q:
            name = plan.tasks[t].node.name
            if runs and runs[-1][0] == name:
                runs[-1][1] += 1
            else:
                runs.append([name, 1])
        out[" > ".join(f"{n} x{c}" for n, c in runs) or "(idle)"] += 1
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("layer", nargs="?", default="decoder", choices=sorted(LAYERS))
    p.add_argument("--batch", type=int, default=1, help="sequences (decoder) or tokens")
    p.add_argument("--sms", type=int, default=132)
    p.add_argument("--ties", default="index", choices=["index", "idle"])
    args = p.parse_args(argv)
    if args.batch < 1 or args.sms < 1:
        p.error("--batch and --sms must be at least 1")
    pin_arch()  # the graphs take the Hopper tiles' shapes (sm_90a unless set)
    from cutemk.plan import instantiate
    from cutemk.scheduling import check_static_schedule
    from cutemk.schedulers import StaticScheduler

    g, env, regime = LAYERS[args.layer](args.batch)
    plan = instantiate(g, env)
    sched = StaticScheduler(ties=args.ties).build(plan, args.sms)
    check_static_schedule(plan, sched, args.sms)
    print(f"{args.layer} at {args.batch} ({regime} regime), {args.sms} SMs, ties {args.ties}:")
    for node in g.nodes:
        ring = node.op.ring_tile()
        slices = f"{ring.slices} slices of {ring.tx_bytes} B" if ring else "SIMT"
        print(f"  {node.name:20s} {len(plan.node_tasks[node.index]):6d} tasks  {slices}")
    for pattern, count in queue_patterns(plan, sched.queues).most_common():
        print(f"{count:4d} SMs: {pattern}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
