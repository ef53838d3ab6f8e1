"""Compile-time facts shared by every device function of the megakernel.

Every tile op's ``device_tile`` is traced into the same ``@cute.kernel`` and called by all
threads of the CTA, so the CTA shape is one constant for the whole kernel, not a per-op knob.
"""

NUM_THREADS: int = 128
"""Threads per CTA (4 warps): the block size of the megakernel and of the op test harness."""

WARP_SIZE: int = 32
NUM_WARPS: int = NUM_THREADS // WARP_SIZE
