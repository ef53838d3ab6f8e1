"""``python -m cutemk demo``: build the Qwen3-MoE layer once, run it, check it against torch."""

from __future__ import annotations

import argparse
import sys
import time

import torch

import cutemk as mk
from cutemk.layers import MoeConfig, moe_graph, moe_reference


def demo(args: argparse.Namespace) -> int:
    cfg = MoeConfig(hidden=args.hidden, intermediate=args.intermediate,
                    num_experts=args.experts, top_k=args.top_k, block_m=16, block_n=32)
    T = mk.sym("T", max=args.max_tokens)
    g = moe_graph(T, cfg)
    print(g)
    gen = torch.Generator().manual_seed(args.seed)
    e, h, i = cfg.num_experts, cfg.hidden, cfg.intermediate
    weights = dict(w_router=torch.randn(e, h, generator=gen),
                   w_gate_up=torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5,
                   w_down=torch.randn(e, h, i, generator=gen) / i ** 0.5)
    print(f"\nbackend: interpret (CPU reference, {args.sms} simulated SMs); "
          "one graph, every token count")
    ok = True
    for sched in ("static", "dynamic"):
        compiled = g.compile("interpret", num_sms=args.sms, scheduler=sched, seed=args.seed)
        for t in args.tokens:
            x = torch.randn(t, h, generator=gen)
            t0 = time.perf_counter()
            y = compiled(x, **weights)
            ms = 1e3 * (time.perf_counter() - t0)
            ref = moe_reference(x, **weights, top_k=cfg.top_k)
            err = ((y - ref).norm() / ref.norm()).item()
            good = err < 1e-5 and not torch.isnan(y).any()
            ok &= good
            print(f"  {sched:7s} T={t:4d}: rel err vs torch fp32 {err:.1e} "
                  f"[{'ok' if good else 'FAIL'}]  ({ms:.0f} ms interpreted)")
        print(compiled.last_report.summary())
    print("\ndemo:", "all checks passed" if ok else "CHECK FAILED")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cutemk")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run the Qwen3-MoE layer and check it against torch")
    d.add_argument("--tokens", type=int, nargs="+", default=[1, 7, 64, 300])
    d.add_argument("--max-tokens", type=int, default=512)
    d.add_argument("--hidden", type=int, default=128)
    d.add_argument("--intermediate", type=int, default=64)
    d.add_argument("--experts", type=int, default=8)
    d.add_argument("--top-k", type=int, default=2)
    d.add_argument("--sms", type=int, default=16)
    d.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.cmd == "demo":
        return demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
