"""Multi-GPU check, one process per GPU: ``torchrun --nproc_per_node=N tests/dist_worker.py``.

Every rank draws all ranks' inputs from one seed, so each can compute the fp32 reference of the
whole layer by itself, then runs its megakernel (GEMM + reduce-scatter, dynamic and static;
all-gather + GEMM, static) for several token counts and launches, and compares its own slice; then calls one cached plan
per rank (different token counts) and expects every rank to refuse it.
Prints ``dist_worker: ok rank R`` on success; any mismatch or error exits non-zero.
"""

import os
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import torch
import torch.distributed as dist

import cutemk as mk
from cutemk.tp import ag_gemm_graph, ag_gemm_reference, gemm_rs_graph, gemm_rs_reference

TOL = 2e-2  # bf16 inputs and output, fp32 accumulation


def rel_err(out, ref):
    if torch.isnan(out).any():
        return float("inf")
    return ((out.float() - ref).norm() / ref.norm()).item()


def main() -> int:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    h, n = 1024, 768
    failures = []
    for sched in ("dynamic", "static"):
        g = gemm_rs_graph(mk.sym("T", max=4096), h, n, world, torch.bfloat16, 128, 128, 64, 256)
        c = g.compile("cute", scheduler=sched, watchdog=True, poison_outputs=True)
        for t in (256 * world, 64 * world, 256 * world):
            gen = torch.Generator().manual_seed(t)
            a = [torch.randn(t, h, generator=gen).bfloat16() for _ in range(world)]
            w = [(torch.randn(n, h, generator=gen) / h**0.5).bfloat16() for _ in range(world)]
            ref = gemm_rs_reference(a, w)[rank].cuda()
            err = rel_err(c(a[rank].cuda(), w[rank].cuda()), ref)
            if not err < TOL:
                failures.append(f"gemm_rs {sched} T={t}: rel err {err:.2e}")
        if world > 1:
            # both plans are built on every rank now: ranks calling them with different dims
            # are refused on every rank before the launch (they would wait on each other
            # forever), and the graph still serves a matched call after that
            t = (256 if rank == 0 else 64) * world
            try:
                c(torch.randn(t, h).bfloat16().cuda(), w[rank].cuda())
                failures.append(f"gemm_rs {sched}: ranks at different T were not refused")
            except mk.CuteMKError as e:
                if "different plans" not in str(e):
                    failures.append(f"gemm_rs {sched}: unexpected error {e}")
            err = rel_err(c(a[rank].cuda(), w[rank].cuda()), ref)
            if not err < TOL:
                failures.append(f"gemm_rs {sched} after the refusal: rel err {err:.2e}")
    g = ag_gemm_graph(mk.sym("S", max=4096), h, n, world, torch.bfloat16, 128, 128, 64)
    c = g.compile("cute", scheduler="static", watchdog=True, poison_outputs=True)
    for s in (256, 64, 256):
        gen = torch.Generator().manual_seed(s)
        x = [torch.randn(s, h, generator=gen).bfloat16() for _ in range(world)]
        w = [(torch.randn(n, h, generator=gen) / h**0.5).bfloat16() for _ in range(world)]
        ref = ag_gemm_reference(x, w)[rank].cuda()
        err = rel_err(c(x[rank].cuda(), w[rank].cuda()), ref)
        if not err < TOL:
            failures.append(f"ag_gemm static S={s}: rel err {err:.2e}")
    dist.barrier()
    dist.destroy_process_group()
    if failures:
        print(f"dist_worker: FAILED rank {rank}: " + "; ".join(failures), flush=True)
        return 1
    print(f"dist_worker: ok rank {rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
