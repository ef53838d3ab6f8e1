"""Compile time of the Qwen3-MoE megakernel in a fresh process: run twice to see the on-disk
CuTe DSL cache (CUTE_DSL_CACHE_DIR, set by cutemk.arch) at work.

Run: python benchmarks/compile_cache_probe.py   (GPU)
"""

import time

import torch

import cutemk as mk
from cutemk import runtime
from cutemk.layers import MoeConfig, moe_graph

cfg = MoeConfig(hidden=128, intermediate=64, num_experts=8, top_k=2, block_m=16, block_n=64)
g = moe_graph(mk.sym("T", max=512), cfg)
c = g.compile("cute", scheduler="dynamic")
w = dict(
    w_router=torch.randn(8, 128, device="cuda"),
    w_gate_up=torch.randn(8, 128, 128, device="cuda"),
    w_down=torch.randn(8, 128, 64, device="cuda"),
)
t0 = time.perf_counter()
c(torch.randn(5, 128, device="cuda"), **w)
torch.cuda.synchronize()
print(
    f"first launch (trace + compile or cache load): {time.perf_counter() - t0:.2f} s, "
    f"compiles this process: {runtime.compile_count}"
)
