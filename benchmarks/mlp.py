"""Whole gated-SiLU MLPs: cutemk.nn.MegaMLP (static and dynamic scheduler) vs torch, one process.

Cases (bf16, random weights scaled 1/sqrt(fan_in)):
  prefill  the Event Tensor paper's Table 4 MLPs at S=8192 tokens: Qwen3-8B, LLaMA-3.1-8B,
           Gemma-2-9B, Gemma-2-27B, Qwen3-32B
  decode   T in {1, 16, 128} for Qwen3-8B and Qwen3-32B

Implementations (every one timed from CUDA-graph replays except torch_eager):
  mk_static / mk_dynamic   MegaMLP (max_tokens=8192: its decode graph serves T <= 128, its
                           prefill graph the rest), one megakernel launch per call
  torch_graph              gate and up as one matmul, F.silu(gate) * up, then the down matmul
                           (what HF's MLP computes), replayed from a CUDA graph
  torch_eager              the same torch code launched eagerly (what HF runs)

Columns: median_us, speedup_vs_torch_graph, tflops, floor_us = max(FLOPs / 790 TFLOP/s,
bytes / 4.3 TB/s) with bytes = weights + x + y, of_floor, and rel_err of each output against an
fp32 reference on the same bf16 inputs. A megakernel error above 2e-2 is reported and makes
the script exit non-zero after writing the results.

``--trace``: a profiled static MegaMLP's per-node spans and launch summary (CTA entries, the
first task, the SMs' busy share of the task span, the close; ``cutemk.trace.launch_summary``)
per case go to the JSON's ``trace`` and are printed.

``--variant NAME:VAR=VALUE[,...]``: one more static MegaMLP, ``mk_NAME``, whose kernels compile
with those environment variables set (e.g. ``ring3:CUTEMK_RING_STAGES=3``), timed beside the
others in the same process.

Run: python benchmarks/mlp.py [--cases qwen3-8b T=1] [--quick] [--trace [slices]] [--variant ...]
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch
import torch.nn.functional as F

from cutemk.bench import (
    Results,
    add_trace_argument,
    floor_us,
    parse_variants,
    profile_launch,
    time_impl,
    with_env,
)

MODELS = {  # name: (hidden, intermediate)
    "qwen3-8b": (4096, 12288),
    "llama-3.1-8b": (4096, 14336),
    "gemma-2-9b": (3584, 14336),
    "gemma-2-27b": (4608, 36864),
    "qwen3-32b": (5120, 25600),
}
PREFILL_TOKENS = 8192
DECODE_TOKENS = {"qwen3-8b": (1, 16, 128), "qwen3-32b": (1, 16, 128)}
MAX_ERR = 2e-2  # bf16 outputs of a K ~ 10^4 reduction, against fp32


def case_list(filters: list[str]) -> list[tuple[str, int]]:
    """(model, tokens) pairs whose case name contains any filter (all without filters)."""
    pairs = [(m, t) for m in MODELS for t in DECODE_TOKENS.get(m, ()) + (PREFILL_TOKENS,)]
    return [(m, t) for m, t in pairs if not filters or any(f in case_name(m, t) for f in filters)]


def case_name(model: str, tokens: int) -> str:
    return f"{model} T={tokens}"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(out).any():
        return float("nan")
    return ((out.float() - ref).norm() / ref.norm()).item()


def run_model(
    res: Results,
    model: str,
    token_counts: list[int],
    warmup: int,
    rep: int,
    trace: bool = False,
    variants: dict[str, dict[str, str]] | None = None,
) -> None:
    """All cases of one model: its weights (and both MegaMLPs' copies) live only here."""
    from cutemk.nn import MegaMLP

    h, i = MODELS[model]
    dev, dt = "cuda", torch.bfloat16
    w_gate = (torch.randn(i, h, device=dev) / h**0.5).to(dt)
    w_up = (torch.randn(i, h, device=dev) / h**0.5).to(dt)
    w_down = (torch.randn(h, i, device=dev) / i**0.5).to(dt)
    megas = {
        f"mk_{s}": MegaMLP(w_gate, w_up, w_down, max_tokens=PREFILL_TOKENS, scheduler=s)
        for s in ("static", "dynamic")
    }
    envs = {}
    for name, env in (variants or {}).items():
        megas[f"mk_{name}"] = MegaMLP(
            w_gate, w_up, w_down, max_tokens=PREFILL_TOKENS, scheduler="static"
        )
        envs[f"mk_{name}"] = env
    profiled = None
    if trace:  # a module of its own: profiling adds a timestamp store per task
        profiled = MegaMLP(w_gate, w_up, w_down, max_tokens=PREFILL_TOKENS, scheduler="static")
        profiled.profile = trace
    del w_gate, w_up  # each MegaMLP keeps its own stacked copy
    for t in token_counts:
        x = torch.randn(t, h, device=dev).to(dt)
        run_case(res, case_name(model, t), x, megas, warmup, rep, envs)
        if profiled is not None:
            graph = profiled.compiled(profiled.regime(t))
            profile_launch(res, case_name(model, t), lambda: profiled(x), graph, warmup, rep)
        gc.collect()
        torch.cuda.empty_cache()


def run_case(
    res: Results,
    case: str,
    x: torch.Tensor,
    megas: dict,
    warmup: int,
    rep: int,
    envs: dict[str, dict[str, str]] | None = None,
):
    from cutemk.layers import mlp_reference

    mega = megas["mk_static"]
    w_gu, w_down = mega.w_gate_up, mega.w_down  # the torch baseline reads the same stacked weight
    t, h, i = x.shape[0], mega.hidden, mega.intermediate

    def torch_mlp():
        gate, up = (x @ w_gu.T).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ w_down.T

    impls = {
        name: with_env((envs or {}).get(name, {}), lambda m=m: m(x)) for name, m in megas.items()
    }
    impls["torch_graph"] = torch_mlp
    ref = mlp_reference(x, w_gu, w_down)
    errs = {name: rel_err(fn(), ref) for name, fn in impls.items()}
    del ref
    impls["torch_eager"] = torch_mlp
    errs["torch_eager"] = errs["torch_graph"]
    flops = 6.0 * t * h * i
    nbytes = 2.0 * (3 * h * i + 2 * t * h)
    fl = floor_us(flops, nbytes)
    for name, fn in impls.items():
        us = time_impl(fn, name == "torch_eager", warmup, rep)  # eager: host time included
        res.add_timed(case, name, us, fl, flops, rel_err=round(errs[name], 5))
        if name.startswith("mk_") and not errs[name] <= MAX_ERR:
            res.meta.setdefault("failures", []).append(f"{case} {name}")
            print(f"WARNING {case} {name}: rel_err {errs[name]:.3g}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="*", default=[], help="keep cases whose name contains any")
    p.add_argument("--quick", action="store_true", help="fewer timed runs (3 warm-up, 10 timed)")
    add_trace_argument(p, "per-node trace")
    p.add_argument(
        "--variant",
        nargs="*",
        default=[],
        help="NAME:VAR=VALUE[,...]: a static MegaMLP compiled under that environment",
    )
    args = p.parse_args(argv)
    try:
        variants = parse_variants(args.variant)
    except ValueError as e:
        p.error(str(e))
    cases = case_list(args.cases)
    if not cases:
        p.error(f"no case matches {args.cases}; cases: {[case_name(*c) for c in case_list([])]}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (the megakernel and the CUDA-graph baselines run on it)")
    warmup, rep = (3, 10) if args.quick else (10, 50)
    res = Results("mlp", meta={"dtype": "bf16", "max_tokens": PREFILL_TOKENS, "rep": rep})
    for model in dict.fromkeys(m for m, _ in cases):
        tokens = [t for m, t in cases if m == model]
        run_model(res, model, tokens, warmup, rep, args.trace, variants)
        gc.collect()
        torch.cuda.empty_cache()
    res.add_ratios("torch_graph")
    res.finish(chart=True)
    failures = res.meta.get("failures", [])
    if failures:
        print(f"rel_err above {MAX_ERR}: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
