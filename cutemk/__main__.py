"""``python -m cutemk demo``: build the Qwen3-MoE layer once, run it, check it against torch."""

from __future__ import annotations

import argparse
import sys
import time

import torch

import cutemk as mk
from cutemk.layers import MoeConfig, moe_graph, moe_reference


def demo(args: argparse.Namespace) -> int:
    cfg = MoeConfig(
        hidden=args.hidden,
        intermediate=args.intermediate,
        num_experts=args.experts,
        top_k=args.top_k,
        block_m=16,
        block_n=32,
    )
    T = mk.sym("T", max=args.max_tokens)
    g = moe_graph(T, cfg)
    print(g)
    gen = torch.Generator().manual_seed(args.seed)
    e, h, i = cfg.num_experts, cfg.hidden, cfg.intermediate
    weights = dict(
        w_router=torch.randn(e, h, generator=gen),
        w_gate_up=torch.randn(e, 2 * i, h, generator=gen) / h**0.5,
        w_down=torch.randn(e, h, i, generator=gen) / i**0.5,
    )
    gpu = torch.cuda.is_available() and not args.cpu
    if gpu:
        weights = {k: v.cuda() for k, v in weights.items()}
        print(
            f"\nbackend: cute megakernel on {torch.cuda.get_device_name(0)}; one compiled "
            "kernel, every token count"
        )
    else:
        print(
            f"\nbackend: interpret (CPU reference, {args.sms} simulated SMs); "
            "one graph, every token count"
        )
    ok = True
    for sched in ("static", "dynamic"):
        if gpu:
            compiled = g.compile("cute", scheduler=sched, watchdog=True)
        else:
            compiled = g.compile("interpret", num_sms=args.sms, scheduler=sched, seed=args.seed)
        for t in args.tokens:
            x = torch.randn(t, h, generator=gen).to(weights["w_router"].device)
            t0 = time.perf_counter()
            y = compiled(x, **weights)
            ms = 1e3 * (time.perf_counter() - t0)
            ref = moe_reference(x, **weights, top_k=cfg.top_k)
            err = ((y - ref).norm() / ref.norm()).item()
            good = err < (1e-4 if gpu else 1e-5) and not torch.isnan(y).any()
            ok &= good
            line = f"  {sched:7s} T={t:4d}: rel err vs torch fp32 {err:.1e} [{'ok' if good else 'FAIL'}]"
            if gpu:
                from .bench import time_us

                mk_us = time_us(lambda: compiled(x, **weights), warmup=3, rep=20)
                eager_us = time_us(
                    lambda: moe_reference(x, **weights, top_k=cfg.top_k), warmup=3, rep=20
                )
                line += f"  megakernel {mk_us:8.1f} us | eager torch {eager_us:8.1f} us"
            else:
                line += f"  ({ms:.0f} ms interpreted)"
            print(line)
        if not gpu:
            print(compiled.last_report.summary())
    print("\ndemo:", "all checks passed" if ok else "CHECK FAILED")
    return 0 if ok else 1


def trace(args: argparse.Namespace) -> int:
    """Profile one launch of a Qwen3-sized MLP graph; print where each node's time goes (the
    per-node summary with the tasks' phases), write Chrome-trace JSON and a PNG."""
    from .layers import mlp_graph
    from .trace import node_summary, timeline_png

    if not torch.cuda.is_available():
        print("trace needs a CUDA GPU", file=sys.stderr)
        return 2
    g = mlp_graph(
        mk.sym("T", max=4096),
        args.hidden,
        args.intermediate,
        torch.bfloat16,
        block_m=64,
        block_n=64,
    )
    c = g.compile("cute", scheduler=args.scheduler, profile=True)
    dev = "cuda"
    x = torch.randn(args.tokens, args.hidden, device=dev).bfloat16()
    wgu = (torch.randn(2 * args.intermediate, args.hidden, device=dev) / 45).bfloat16()
    wd = (torch.randn(args.hidden, args.intermediate, device=dev) / 78).bfloat16()
    c(x, wgu, wd)
    torch.cuda.synchronize()
    for row in node_summary(c.profile_records()):  # us since the launch's first task
        print(row)
    path = c.export_trace(args.out)
    print(f"wrote {path} ({len(c.profile_records())} tasks; open it in https://ui.perfetto.dev)")
    try:
        png = timeline_png(c.profile_records(), path.with_suffix(".png"), g.name)
        print(f"wrote {png}")
    except ImportError:
        print("matplotlib not installed: no PNG (pip install 'cutemk[plot]')")
    return 0


def _positive(text: str) -> int:
    """argparse type: a positive int (a bad one is a usage error, not a traceback)."""
    try:
        n = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is not positive")
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cutemk")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run the Qwen3-MoE layer and check it against torch")
    d.add_argument("--tokens", type=_positive, nargs="+", default=[1, 7, 64, 300])
    d.add_argument("--max-tokens", type=_positive, default=512)
    d.add_argument("--hidden", type=_positive, default=128)
    d.add_argument("--intermediate", type=_positive, default=64)
    d.add_argument("--experts", type=_positive, default=8)
    d.add_argument("--top-k", type=_positive, default=2)
    d.add_argument("--sms", type=_positive, default=16)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--cpu", action="store_true", help="use the interpreter even with a GPU")
    tr = sub.add_parser("trace", help="profile a Qwen3-sized MLP megakernel (GPU)")
    tr.add_argument("--tokens", type=_positive, default=256)
    tr.add_argument("--hidden", type=_positive, default=2048)
    tr.add_argument("--intermediate", type=_positive, default=6144)
    tr.add_argument("--scheduler", default="dynamic", choices=["static", "dynamic"])
    tr.add_argument("--out", default="mlp.trace.json")
    args = p.parse_args(argv)
    if args.cmd == "demo":
        if max(args.tokens) > args.max_tokens:
            d.error(f"--tokens {max(args.tokens)} is past --max-tokens {args.max_tokens}")
        if args.top_k > args.experts:
            d.error(f"--top-k {args.top_k} is more than --experts {args.experts}")
        return demo(args)
    return trace(args)


if __name__ == "__main__":
    sys.exit(main())
