"""CPU-only: compile a small persistent kernel that uses cutemk.device.sync for sm_90a, check PTX.

No GPU is needed: the target arch comes from CUTE_DSL_ARCH (read once, when cutlass is first
imported, hence set before any import of it) and the arguments are fake tensors. The assertions
are on the PTX that ptxas would get, so a helper that silently lowers to the wrong memory
semantics (relaxed instead of acquire/release, cta instead of gpu scope) fails here.
"""

import os
import re
import time
from pathlib import Path

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cuda.bindings.driver as cuda
import cutlass
import pytest
from cutlass import Boolean, Int32, Int64, cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from cutemk.device.sync import (
    notify_event,
    pop_task,
    wait_event,
    wait_event_or_timeout,
)

NUM_THREADS = 128
NUM_CTAS = 132  # H200 SM count, a plain int: nothing here may query a GPU.


@cute.kernel
def cutemk_chain_kernel(
    mCounter: cute.Tensor,  # (1,) task counter, reset to 0 before the launch
    mEvents: cute.Tensor,  # (num_tasks,) event counters, +1 per launch per task
    mOut: cute.Tensor,  # (num_tasks,)
    mDebug: cute.Tensor,  # (4,) (task, event, expected, seen) of a timed-out wait
    num_tasks: Int32,
    epoch: Int32,
    timeout_ns: Int64,
    watchdog: cutlass.Constexpr[bool],
):
    """Task i waits for event i-1 to reach ``epoch``, writes out[i] = 2 i, notifies event i."""
    tidx, _, _ = cute.arch.thread_idx()
    smem = cutlass.memory.SmemAllocator()
    sTask = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=4)  # (1,)

    running = Boolean(True)
    while running:
        if tidx == 0:
            sTask[0] = pop_task(mCounter.iterator)
        cute.arch.sync_threads()
        task = sTask[0]
        # Second barrier: nobody may overwrite sTask for the next task before all have read it.
        cute.arch.sync_threads()
        running = task < num_tasks
        if running:
            if tidx == 0 and task > 0:
                dep = mEvents.iterator + (task - 1)
                if cutlass.const_expr(watchdog):
                    timed_out, seen = wait_event_or_timeout(dep, epoch, timeout_ns)
                    if timed_out:
                        mDebug[0] = task
                        mDebug[1] = task - 1
                        mDebug[2] = epoch
                        mDebug[3] = seen
                        sTask[0] = num_tasks  # ends the loop for the whole CTA
                else:
                    wait_event(dep, epoch)
            cute.arch.sync_threads()
            running = sTask[0] < num_tasks
            if running:
                if tidx == 0:
                    mOut[task] = task * 2
                cute.arch.sync_threads()
                if tidx == 0:
                    notify_event(mEvents.iterator + task, Int32(1))


# The DSL prefixes every generated symbol with "cutlass_"; drop it (that string
# in a kernel name once triggered heavy ptxas spilling).
cutemk_chain_kernel.set_name_prefix("", remove_cutlass_symbol=True)


@cute.jit
def cutemk_chain_launch(
    mCounter: cute.Tensor,  # (1,)
    mEvents: cute.Tensor,  # (num_tasks,)
    mOut: cute.Tensor,  # (num_tasks,)
    mDebug: cute.Tensor,  # (4,)
    num_tasks: Int32,
    epoch: Int32,
    timeout_ns: Int64,
    stream: cuda.CUstream,
    watchdog: cutlass.Constexpr[bool],
):
    cutemk_chain_kernel(
        mCounter, mEvents, mOut, mDebug, num_tasks, epoch, timeout_ns, watchdog
    ).launch(grid=(NUM_CTAS, 1, 1), block=(NUM_THREADS, 1, 1), stream=stream)


cutemk_chain_launch.set_name_prefix("", remove_cutlass_symbol=True)


def _compile_ptx(dump_dir: Path, watchdog: bool) -> str:
    n = cute.sym_int()
    args = (
        make_fake_compact_tensor(Int32, (1,), assumed_align=4),
        make_fake_compact_tensor(Int32, (n,), assumed_align=4),
        make_fake_compact_tensor(Int32, (n,), assumed_align=4),
        make_fake_compact_tensor(Int32, (4,), assumed_align=4),
        Int32(8),
        Int32(1),
        Int64(1_000_000_000),
        make_fake_stream(),
    )
    # "--keep-ptx" is the option-string form of CUTE_DSL_KEEP=ptx; with it the compiled object
    # carries the PTX text in __ptx__ (None otherwise) and a copy lands in dump_dir.
    compiled = cute.compile(
        cutemk_chain_launch,
        *args,
        watchdog,
        options=f"--keep-ptx --dump-dir={dump_dir}",
    )
    ptx = compiled.__ptx__
    assert ptx, "compiled.__ptx__ is empty although --keep-ptx was given"
    assert list(dump_dir.glob("*.sm_90a.ptx")), f"no sm_90a PTX in {dump_dir}"
    return ptx


@pytest.mark.parametrize("watchdog", [False, True], ids=["plain", "watchdog"])
def test_sync_helpers_lower_to_gpu_scope_acquire_release(tmp_path: Path, watchdog: bool) -> None:
    t0 = time.perf_counter()
    ptx = _compile_ptx(tmp_path, watchdog)
    elapsed = time.perf_counter() - t0
    assert elapsed < 60, f"compile took {elapsed:.1f} s"

    entries = re.findall(r"\.entry\s+(\w+)", ptx)
    assert len(entries) == 1 and "cutemk_chain_kernel" in entries[0], entries
    assert "cutlass" not in entries[0].lower(), entries[0]
    # pop_task: relaxed gpu-scope atomic add on a global int32, old value returned.
    pop = r"\batom(\.(relaxed|acq_rel))?(\.gpu)?\.global\.add\.[us]32\b"
    assert re.search(pop, ptx), "pop_task"
    # wait_event: acquire load at gpu scope, polled with a nanosleep back-off.
    assert re.search(r"\bld\.acquire\.gpu(\.global)?\.[bsu]32\b", ptx), "wait_event load"
    assert re.search(r"\bnanosleep\.u32\b", ptx), "wait_event back-off"
    # notify_event: release at gpu scope (red, or atom/st with .release.gpu).
    assert re.search(r"\b(red|atom|st)\.release\.gpu(\.global)?\.(add\.)?[bsu]32\b", ptx), (
        "notify_event"
    )
    # No helper may fall back to a weaker scope.
    assert not re.search(r"\.(acquire|release)\.cta\b", ptx)
    if watchdog:
        assert "%globaltimer" in ptx
    else:
        assert "%globaltimer" not in ptx
