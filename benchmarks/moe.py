"""Qwen3-MoE sparse block (Qwen3-30B-A3B: E=128, top-8, H=2048, I=768, bf16): cutemk vs torch.

Implementations, one process, same bf16 inputs and weights:
  mk_static / mk_dynamic   ``cutemk.layers.moe_graph`` compiled once for T <= max, one
                           megakernel launch per call, timed from CUDA-graph replays
  torch_graph              router matmul, softmax/top-k, a stable sort of the routed slots,
                           ``torch._grouped_mm`` for gate/up and down, SiLU*mul, a weighted
                           ``index_add_`` combine; replayed from a CUDA graph
  mk_static[routed]        at one or two tokens: MegaMoE's 'gemv' graph (route and permute
                           steps) beside the 'slots' graph that mk_static runs there
  mk_static[combine step]  at one or two tokens: the 'slots' graph with a combine step of its
                           own (``MoeConfig.fused_combine`` off) instead of the down tiles'
  torch_eager              the same, launched eagerly
  quack_graph              the same routing and combine around quack's grouped GEMMs (CuTe
                           DSL, where importable): the expert-sorted slots gathered from x's
                           rows by index (gather_A) in one GEMM per call, variable rows per
                           expert (cu_seqlens_m), gate/up with a fused SwiGLU epilogue (its
                           weight rows interleaved gate/up once, outside the timing), then
                           down; its default config (``--quack-tuned``: autotuned per shape);
                           replayed from a CUDA graph
  hf_eager                 transformers' ``Qwen3MoeSparseMoeBlock`` with the same weights, eager
                           (where transformers is importable)

Columns: median_us, floor_us = max(FLOPs / 790 TFLOP/s, bytes / 4.3 TB/s) with bytes = the
weights of the experts this routing touches + the router weight + x and y, of_floor, rel_err
against an fp32 reference on the same bf16 inputs (``cutemk.layers.moe_reference``), and
``speedup_vs_torch_graph``. A megakernel error above 2e-2 is reported and makes the script
exit non-zero after writing the results.

Run: python benchmarks/moe.py [--tokens 1 16 128] [--quick] [--trace] [--ab router_topk=off block_m=64]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from cutemk.bench import Results, add_trace_argument, floor_us, profile_launch, time_impl

H, I, E, TOP_K = 2048, 768, 128, 8
TOKENS = (1, 16, 128, 1024, 4096)
MAX_TOKENS = 4096
MAX_ERR = 2e-2


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(out).any():
        return float("nan")
    return ((out.float() - ref).norm() / ref.norm()).item()


def torch_moe(x, w_router, w_gate_up, w_down, top_k: int = TOP_K):
    """The MoE block with torch's grouped GEMM (what a serving stack without fused MoE runs)."""
    w, order, offs, tok = _route(x, w_router, top_k)
    h = torch._grouped_mm(x[tok], w_gate_up.transpose(1, 2), offs=offs[1:])
    inter = w_gate_up.shape[1] // 2
    a = F.silu(h[:, :inter]) * h[:, inter:]
    d = torch._grouped_mm(a, w_down.transpose(1, 2), offs=offs[1:])
    return _combine(x.shape[0], tok, d, w, order, x)


def _route(x, w_router, top_k: int):
    """Softmax top-k routing as HF does it, the routed slots sorted by expert (stable): (weights
    (T, k), the slots' order, per-expert slot offsets (E + 1,) int32, each sorted slot's
    token)."""
    probs = torch.softmax((x @ w_router.T).float(), dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    # a scatter count: bincount synchronizes with the host, which a CUDA graph cannot capture
    counts = torch.zeros(w_router.shape[0], dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offs = torch.zeros(w_router.shape[0] + 1, dtype=torch.int32, device=x.device)
    offs[1:] = torch.cumsum(counts, 0)
    return w, order, offs, order // top_k


def _combine(t: int, tok, d, w, order, like):
    """y[t] = sum over t's picks of weight x the pick's down row (fp32 accumulation)."""
    y = torch.zeros(t, d.shape[1], device=d.device, dtype=torch.float32)
    y.index_add_(0, tok, d.float() * w.flatten()[order, None])
    return y.to(like.dtype)


def load_quack_moe(tuned: bool):
    """quack's grouped GEMMs as an MoE pipeline (``quack_moe``), or None where quack is not
    importable."""
    try:
        from quack.gemm_interface import gemm, gemm_act
    except Exception as e:  # noqa: BLE001  (any import failure: the baseline is optional)
        print(f"quack_graph skipped: {type(e).__name__}: {e}")
        return None

    def quack_moe(x, w_router, w_gate_up_il, w_down, top_k: int = TOP_K):
        """``w_gate_up_il``: (E, 2I, H) with gate and up rows interleaved (g0, u0, g1, ...),
        the column order quack's gated epilogue pairs."""
        w, order, offs, tok = _route(x, w_router, top_k)
        _, a = gemm_act(
            x,
            w_gate_up_il.transpose(1, 2),
            activation="swiglu",
            cu_seqlens_m=offs,
            A_idx=tok.to(torch.int32),
            store_preact=False,
            tuned=tuned,
        )
        d = gemm(a, w_down.transpose(1, 2), cu_seqlens_m=offs, tuned=tuned)
        return _combine(x.shape[0], tok, d, w, order, x)

    return quack_moe


def interleave_gate_up(w_gate_up: torch.Tensor) -> torch.Tensor:
    """(E, 2I, H) [gate; up] -> rows g0, u0, g1, u1, ... (a copy)."""
    e, two_i, h = w_gate_up.shape
    half = two_i // 2
    return torch.stack((w_gate_up[:, :half], w_gate_up[:, half:]), dim=2).reshape(e, two_i, h)


def hf_block(w_router, w_gate_up, w_down):
    """transformers' Qwen3MoeSparseMoeBlock holding these weights, or None."""
    try:
        from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    except Exception as e:  # noqa: BLE001  (any import failure: the baseline is optional)
        print(f"hf_eager skipped: {e}")
        return None
    cfg = Qwen3MoeConfig(
        hidden_size=H,
        moe_intermediate_size=I,
        num_experts=E,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
    )
    block = Qwen3MoeSparseMoeBlock(cfg).to("cuda", torch.bfloat16).eval()
    with torch.no_grad():
        block.gate.weight.copy_(w_router)
        experts = block.experts
        if hasattr(experts, "gate_up_proj"):  # transformers 5.x: stacked expert weights
            experts.gate_up_proj.copy_(w_gate_up)
            experts.down_proj.copy_(w_down)
        else:  # 4.x: one MLP module per expert
            for e, mlp in enumerate(experts):
                mlp.gate_proj.weight.copy_(w_gate_up[e, :I])
                mlp.up_proj.weight.copy_(w_gate_up[e, I:])
                mlp.down_proj.weight.copy_(w_down[e])
    return block


def _ab_options(p: argparse.ArgumentParser, opt: str) -> dict:
    """``--ab`` item ``NAME[=VALUE][+NAME...]`` as MegaMoE options: a name alone or ``=on`` a
    switch on, ``=off`` off, digits a size, ``=none`` None; anything else is an error (a typo
    must not become an A/B column identical to the default)."""
    words = {"": True, "on": True, "off": False, "none": None}
    options = {}
    for item in opt.split("+"):
        name, _, value = item.partition("=")
        if value.isdigit():
            options[name] = int(value)
        elif value in words:
            options[name] = words[value]
        else:
            p.error(f"--ab {opt}: {value!r} is not on, off, none or a positive int")
    return options


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", nargs="*", type=int, default=list(TOKENS))
    p.add_argument("--quick", action="store_true", help="fewer timed runs (3 warm-up, 10 timed)")
    p.add_argument("--no-hf", action="store_true", help="leave out the transformers module")
    p.add_argument("--no-quack", action="store_true", help="leave out quack's grouped GEMMs")
    p.add_argument("--quack-tuned", action="store_true", help="let quack autotune each shape")
    add_trace_argument(p, "also: per case, the per-node summary")
    p.add_argument(
        "--ab",
        nargs="*",
        default=[],
        metavar="OPTION",
        help="also a static MegaMoE with these tile fields (MegaMoE options): NAME or NAME=on a "
        "switch on, NAME=off off, NAME=INT a size, NAME=none None, several joined by + (e.g. "
        "router_topk=off, block_m=64+combine_block_m=8): a same-process A/B column "
        "mk_static_OPTION",
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    from cutemk.layers import moe_reference

    warmup, rep = (3, 10) if args.quick else (10, 50)
    from cutemk.nn import MOE_DECODE_MAX_TOKENS, MOE_REGIME_LIMITS, MegaMoE
    from cutemk.regimes import moe_tiles

    res = Results(
        "moe",
        meta={
            "dtype": "bf16",
            "layer": "Qwen3-30B-A3B sparse MoE block",
            "hidden": H,
            "intermediate": I,
            "experts": E,
            "top_k": TOP_K,
            "max_tokens": MAX_TOKENS,
            "decode_max_tokens": MOE_DECODE_MAX_TOKENS,
            "tiles": {
                r: moe_tiles(r, H, dtype=torch.bfloat16, intermediate=I, top_k=TOP_K)
                for r in MOE_REGIME_LIMITS
            },
            "routing": "on bf16 router logits (as HF); rel_err against an fp32 reference that "
            "rounds the logits to bf16 the same way",
            "rep": rep,
        },
    )
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    w = dict(
        w_router=(torch.randn(E, H, device=dev, generator=gen) / H**0.5).to(dt),
        w_gate_up=(torch.randn(E, 2 * I, H, device=dev, generator=gen) / H**0.5).to(dt),
        w_down=(torch.randn(E, H, I, device=dev, generator=gen) / I**0.5).to(dt),
    )
    megas = {
        f"mk_{s}": MegaMoE(**w, top_k=TOP_K, max_tokens=MAX_TOKENS, scheduler=s)
        for s in ("static", "dynamic")
    }
    for opt in args.ab:  # same-process A/Bs of MegaMoE's tile fields
        options = _ab_options(p, opt)
        megas[f"mk_static_{opt.replace('=', '_')}"] = MegaMoE(
            **w, top_k=TOP_K, max_tokens=MAX_TOKENS, options=options
        )
    # first_call_s_*: the first call at a token count plans it, and the first call of a regime
    # also compiles its kernel (compiled() only builds the graph; the kernel compiles on launch)
    profiled = {}
    if args.trace:  # separate modules: profiling adds a timestamp store per task
        for s in ("static", "dynamic"):
            profiled[s] = MegaMoE(
                **w, top_k=TOP_K, max_tokens=MAX_TOKENS, scheduler=s, profile=args.trace
            )
    hf = None if args.no_hf else hf_block(**w)
    quack_moe = None if args.no_quack else load_quack_moe(args.quack_tuned)
    w_gate_up_il = interleave_gate_up(w["w_gate_up"]) if quack_moe is not None else None
    res.meta["quack"] = quack_moe is not None
    res.meta["quack_tuned"] = bool(args.quack_tuned)
    step = None  # the slots graph with its combine as a step of its own
    if any(t <= MOE_REGIME_LIMITS["slots"] for t in args.tokens):
        from cutemk import sym
        from cutemk.layers import MoeConfig, moe_graph

        tiles = moe_tiles("slots", H, dtype=dt, intermediate=I, top_k=TOP_K)
        tiles["fused_combine"] = False
        cfg = MoeConfig(H, I, E, TOP_K, True, router_dtype=None, **tiles)
        limit = MOE_REGIME_LIMITS["slots"]
        step = moe_graph(sym("T", max=limit), cfg, dt).compile("cute", scheduler="static")
    for t in args.tokens:
        case = f"T={t}"
        x = torch.randn(t, H, device=dev, generator=gen).to(dt)
        impls = {}
        for name, m in megas.items():
            t0 = time.perf_counter()
            m(x)  # plans this token count
            torch.cuda.synchronize()
            res.meta[f"first_call_s_{name}_T{t}"] = round(time.perf_counter() - t0, 3)
            impls[name] = lambda m=m: m(x)
        if t <= MOE_DECODE_MAX_TOKENS:  # the prefill graph at a decode size: is the split right?
            other = megas["mk_static"].compiled("prefill")
            impls["mk_static[prefill tiles]"] = lambda: other(x, *w.values())
        if t <= MOE_REGIME_LIMITS["slots"]:  # the slot layout against the routed graph
            routed = megas["mk_static"].compiled("gemv")
            impls["mk_static[routed]"] = lambda: routed(x, *w.values())
            impls["mk_static[combine step]"] = lambda: step(x, *w.values())
        impls["torch_graph"] = lambda: torch_moe(x, **w)
        ref = moe_reference(x, **w, top_k=TOP_K, router_dtype=dt)
        errs = {name: rel_err(fn(), ref) for name, fn in impls.items()}
        if quack_moe is not None:
            wq = dict(w, w_gate_up_il=w_gate_up_il)
            del wq["w_gate_up"]

            def quack_call():
                return quack_moe(x, **wq)

            try:  # a peer's failure (a shape its kernels refuse) skips its column, not the run
                errs["quack_graph"] = rel_err(quack_call(), ref)
                impls["quack_graph"] = quack_call
            except Exception as e:  # noqa: BLE001
                res.meta.setdefault("quack_errors", {})[case] = f"{type(e).__name__}: {e}"
                print(f"quack_graph {case} skipped: {type(e).__name__}: {e}")
            if not errs.get("quack_graph", 0.0) <= MAX_ERR:
                print(f"WARNING {case} quack_graph: rel_err {errs['quack_graph']:.3g}")
        impls["torch_eager"] = impls["torch_graph"]
        errs["torch_eager"] = errs["torch_graph"]
        if hf is not None:

            def hf_call():
                with torch.no_grad():
                    out = hf(x.view(1, t, H))
                return (out[0] if isinstance(out, tuple) else out).view(t, H)

            impls["hf_eager"] = hf_call
            errs["hf_eager"] = rel_err(hf_call(), ref)
        del ref
        for s, m in profiled.items():  # per-node spans and where the launch's time goes
            c = m.compiled(m.regime(t))
            profile_launch(res, f"{case} {s}", lambda m=m: m(x), c, warmup, rep)
        with torch.no_grad():
            ids = torch.topk(x.float() @ w["w_router"].float().T, TOP_K, dim=-1).indices
        touched = int(torch.unique(ids).numel())
        flops = 2.0 * t * H * E + 2.0 * t * TOP_K * 3 * H * I
        nbytes = 2.0 * (touched * 3 * H * I + E * H + 2 * t * H)
        fl = floor_us(flops, nbytes)
        for name, fn in impls.items():
            try:
                us = time_impl(fn, name in ("torch_eager", "hf_eager"), warmup, rep)
            except Exception as e:  # noqa: BLE001  (a peer that fails in its capture)
                if not name.startswith("quack"):
                    raise
                res.meta.setdefault("quack_errors", {})[case] = f"{type(e).__name__}: {e}"
                print(f"{name} {case} not timed: {type(e).__name__}: {e}")
                continue
            res.add_timed(case, name, us, fl, experts_touched=touched, rel_err=round(errs[name], 5))
            if name.startswith("mk_") and not errs[name] <= MAX_ERR:
                res.meta.setdefault("failures", []).append(f"{case} {name}")
                print(f"WARNING {case} {name}: rel_err {errs[name]:.3g}")
    res.add_ratios("torch_graph")
    if quack_moe is not None:
        res.add_ratios("quack_graph")
    res.finish(chart=True)
    failures = res.meta.get("failures", [])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
