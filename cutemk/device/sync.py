"""Inter-CTA synchronisation through global-memory int32 counters (device side).

A persistent megakernel hands out work and orders it with two kinds of int32 counters in global
memory, both touched by exactly one elected thread per CTA:

* a **task counter**: ``pop_task`` atomically takes the next task index (``atom.add``). It only
  distributes indices; it carries no data, so the atomic is relaxed.
* **event counters**: a producer tile ends with ``notify_event`` (a gpu-scope *release* add); a
  consumer tile starts with ``wait_event`` (a gpu-scope *acquire* load polled until the counter
  reaches a target). Release/acquire on the same counter makes every global write that is
  ordered before the release visible to every read ordered after the acquire.

Memory-ordering protocol (the invariant every caller must keep):

1. Producer CTA: all threads issue their global writes of the tile, then
   ``cute.arch.sync_threads()`` (``bar.sync``: orders the other threads' writes before the
   elected thread at CTA scope), then ONE thread calls ``notify_event``. PTX release is
   cumulative, so ``red.release.gpu`` publishes the writes the releasing thread has observed
   through ``bar.sync``, not only its own: the same guarantee as the
   ``fence.acq_rel.gpu; red.relaxed.gpu`` idiom of CUTLASS's generic barrier, in one instruction.
   Writes made through the async proxy (TMA stores) are not covered until they have completed:
   ``cp.async.bulk.wait_group 0`` (not ``.read``) in the issuing thread before the barrier.
2. Consumer CTA: ONE thread calls ``wait_event`` (``ld.acquire.gpu`` polled), then
   ``cute.arch.sync_threads()`` so the other threads' reads are ordered after the acquire. Reads
   through the async proxy (TMA loads) additionally need ``cute.arch.fence_proxy("async.global")``
   (generic-to-async proxy ordering) after the barrier.
3. Counters only grow within a launch. Wait for ``count_per_launch * epoch`` (epoch = launch
   index, a runtime argument) instead of resetting counters between launches: no host memset, no
   parity bugs. The task counter is the exception: every CTA pops one index past the end, so it
   must be reset (or offset by ``num_tasks + grid_size`` per launch) by the caller.
4. A waiter must not be able to starve its producer: the grid must be co-resident (at most one
   persistent CTA per SM slot, or a cooperative launch), and tasks must be handed out in an order
   where every dependency has a smaller index than its consumer.

Only one thread per CTA may spin: 128+ threads polling the same line waste issue slots and L2
bandwidth for nothing. The helpers do not elect that thread or synchronise the CTA themselves,
because the caller already has a barrier in the same place (task broadcast through shared
memory) and a second one would be pure cost.

All functions are ``@cute.jit``: called from a ``@cute.kernel`` they are inlined when traced.
"""

import cutlass
from cutlass import Boolean, Int32, Int64, cute
from cutlass.experimental import primitives as _prims

from .config import named_sync, named_sync_or

# Back-off for one spinning thread. The first sleep is short because the common case is a
# producer that finishes within a few hundred ns; the cap keeps the wake-up latency a hop adds
# near 0.1 us (a 1 us cap cost the Qwen3-8B decode layer ~7 us over its ~10 dependent hops)
# while still taking the poller off the issue ports between polls.
BACKOFF_MIN_NS: int = 32
BACKOFF_MAX_NS: int = 128


@cute.jit
def pop_task(counter_ptr: cute.Pointer) -> Int32:
    """Take the next task index: ``old = atomicAdd(counter, 1)``, returns ``old``.

    ``counter_ptr``: pointer to an int32 counter in global memory (e.g. ``mCounter.iterator``).
    Relaxed, gpu scope: the index carries no data (dependencies go through events), and relaxed
    atomics on one address are still totally ordered, so every index is handed out exactly once.
    Call from one thread and broadcast the result through shared memory.
    """
    return cute.arch.atomic_add(counter_ptr, Int32(1), sem="relaxed", scope="gpu")


@cute.jit
def _poll_until(
    event_ptr: cute.Pointer,
    target: Int32,
    timeout_ns: Int64,
    abort_ptr: cute.Pointer,
    bounded: cutlass.Constexpr[bool],
    abortable: cutlass.Constexpr[bool],
    scope: cutlass.Constexpr[str] = "gpu",
) -> tuple[Boolean, Int32]:
    """Spin (acquire loads, exponential nanosleep back-off) until ``*event_ptr >= target``.

    With ``bounded`` the spin also stops once ``timeout_ns`` of ``%globaltimer`` have passed;
    with ``abortable`` also as soon as the int32 at ``abort_ptr`` is non-zero (another CTA's
    watchdog fired: the awaited event may never come). Both report ``timed_out``.
    Returns ``(timed_out, last_seen)``. CuTe DSL has no ``break``/``return`` inside a dynamic
    loop, so the exit condition is carried as ``spinning`` and every carried value is created
    with its final type before the loop.
    """
    seen = cute.arch.load(event_ptr, Int32, sem="acquire", scope=scope)
    timed_out = Boolean(False)
    spinning = seen < target
    backoff = Int32(BACKOFF_MIN_NS)
    start = Int64(0)
    if cutlass.const_expr(bounded):
        start = cute.arch.globaltimer()
    while spinning:
        _prims.nanosleep(backoff)
        if backoff < BACKOFF_MAX_NS:
            backoff = backoff * 2
        seen = cute.arch.load(event_ptr, Int32, sem="acquire", scope=scope)
        spinning = seen < target
        # Not merged with the inner `if`: const_expr must be the whole condition to stay a
        # compile-time branch.
        if cutlass.const_expr(bounded):  # noqa: SIM102
            # Checked after the poll, so a counter that arrives exactly at the deadline counts
            # as success, not as a timeout.
            if spinning and cute.arch.globaltimer() - start > timeout_ns:
                timed_out = Boolean(True)
                spinning = Boolean(False)
        if cutlass.const_expr(abortable):  # noqa: SIM102
            if spinning and cute.arch.load(abort_ptr, Int32, sem="relaxed", scope="gpu") != 0:
                timed_out = Boolean(True)
                spinning = Boolean(False)
    return timed_out, seen


@cute.jit
def wait_event(
    event_ptr: cute.Pointer, target: Int32, scope: cutlass.Constexpr[str] = "gpu"
) -> None:
    """Block until the int32 event counter at ``event_ptr`` is ``>= target`` (acquire, gpu scope).

    One thread only; follow with ``cute.arch.sync_threads()`` so the whole CTA is ordered after
    the acquire (see the module docstring). Spins forever if the producer never arrives: use
    ``wait_event_or_timeout`` where a hang must be diagnosable.
    """
    _poll_until(event_ptr, target, Int64(0), event_ptr, False, False, scope)


@cute.jit
def wait_event_or_timeout(
    event_ptr: cute.Pointer, target: Int32, timeout_ns: Int64
) -> tuple[Boolean, Int32]:
    """``wait_event`` with a watchdog: give up after ``timeout_ns`` nanoseconds of ``%globaltimer``.

    Returns ``(timed_out, seen)``: ``seen`` is the last counter value read, so the caller can
    record ``(task, event, target, seen)`` in a debug buffer and end the kernel instead of hanging.
    When ``timed_out`` is false, ``seen >= target`` and the acquire has happened. The bound is in
    wall time, not polls, because the back-off makes the poll count a poor measure of time.
    """
    return _poll_until(event_ptr, target, timeout_ns, event_ptr, True, False)


@cute.jit
def wait_event_or_abort(
    event_ptr: cute.Pointer,
    target: Int32,
    timeout_ns: Int64,
    abort_ptr: cute.Pointer,
    scope: cutlass.Constexpr[str] = "gpu",
) -> tuple[Boolean, Int32]:
    """``wait_event_or_timeout`` that also gives up once ``*abort_ptr != 0``, so one CTA's
    watchdog stops every other CTA's wait at once instead of after its own timeout.
    ``scope="sys"`` for a counter another GPU releases (a peer's, over NVLink)."""
    return _poll_until(event_ptr, target, timeout_ns, abort_ptr, True, True, scope)


@cute.jit
def notify_event(
    event_ptr: cute.Pointer, inc: Int32, scope: cutlass.Constexpr[str] = "gpu"
) -> None:
    """Add ``inc`` to the int32 event counter at ``event_ptr`` with release semantics, gpu scope.

    One thread only, after ``cute.arch.sync_threads()`` has ordered the whole CTA's global writes
    of the tile before it (module docstring, rule 1). ``red`` rather than ``atom``: the old value
    is not needed, so no round trip to L2 is waited for.
    """
    cute.arch.red(event_ptr, inc, op="add", dtype=Int32, sem="release", scope=scope)


@cute.jit
def claim_last(
    counter_ptr: cute.Pointer,
    group: Int32,
    tid: Int32,
    barrier_id: cutlass.Constexpr,
    threads: cutlass.Constexpr,
) -> Boolean:
    """The tiles of a group that finish in any order, each ending here after its own global
    writes (every thread of the caller's named barrier ``barrier_id`` of ``threads``): thread 0
    counts the tile in the counter (a gpu-scope acq_rel add: it releases this tile's writes and
    acquires those of the tiles counted before); True, on every thread, for the tile that
    brings the count to ``group``, which then puts the counter back to zero for the next launch
    and may read the other tiles' writes. Thread 0's verdict reaches the others through the
    second barrier itself (``named_sync_or``), not a shared word: a word written by thread 0
    and read by every thread across a barrier of two warpgroups is a hand-over
    ``compute-sanitizer --tool racecheck`` reported in the MoE kernels."""
    named_sync(barrier_id, threads)
    last = Boolean(False)
    if tid == 0:
        old = cute.arch.atomic_add(counter_ptr, Int32(1), sem="acq_rel", scope="gpu")
        if old == group - 1:
            last = Boolean(True)
            cute.arch.store(counter_ptr, Int32(0), sem="relaxed", scope="gpu")
    return named_sync_or(barrier_id, threads, last)
