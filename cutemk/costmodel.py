"""Per-tile cost estimates, used by the static scheduler to balance SM queues.

Numbers are per-GPU rates measured on the H200 (the hardware every cutemk number is claimed on);
``Hardware`` is the single place a new architecture adds its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Hardware:
    name: str
    num_sms: int
    tensor_flops: float  # dense bf16/fp16 matrix FLOP/s, whole GPU
    simt_flops: float  # fp32 FMA FLOP/s, whole GPU
    mem_bw: float  # device memory bytes/s (read + write), whole GPU
    hop_us: float  # one cross-SM notify -> wait hop
    task_overhead_us: float  # fetch + dispatch of one task
    load_latency_us: float  # one dependent round trip to device memory (a pipeline's fill)


H200 = Hardware(
    "H200",
    num_sms=132,
    tensor_flops=790e12,
    simt_flops=60e12,
    mem_bw=4.3e12,
    hop_us=0.55,
    task_overhead_us=0.25,
    load_latency_us=0.8,
)


def tile_time_us(
    flops: float, nbytes: float, dtype: torch.dtype = torch.bfloat16, hw: Hardware = H200
) -> float:
    """Roofline time of one tile on one SM while every SM is busy (its 1/num_sms share)."""
    rate = hw.tensor_flops if dtype in (torch.bfloat16, torch.float16) else hw.simt_flops
    per_sm_flops = rate / hw.num_sms
    per_sm_bw = hw.mem_bw / hw.num_sms
    return hw.task_overhead_us + 1e6 * max(flops / per_sm_flops, nbytes / per_sm_bw)
