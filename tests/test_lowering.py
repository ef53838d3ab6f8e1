"""The lowered program (``cutemk.codegen.lower``) checked on the CPU.

A small Python emulator runs the megakernel's protocol over the same int32 arrays the GPU reads
(static queue records with wait targets, the dynamic ring with single-wait consumers encoded as
-(c+1), epoch-counted counters, the device-side wrap) with a random interleaving of CTAs, and
must reproduce the synthetic DAG's exact values. A lowering bug shows up here without a GPU.
"""

import random

import numpy as np
import pytest
import torch

import cutemk as mk
from cutemk import ops
from cutemk.codegen.lower import (
    QHEAD_BEGIN,
    QHEAD_END,
    QHEAD_WIDTH,
    QUEUE_CHUNK,
    R_C0,
    R_NHI,
    R_NLO,
    R_NODE,
    R_TASK,
    R_WHI,
    R_WLO,
    REC_WIDTH,
    first_offset,
    lower,
    pack_int32,
)
from cutemk.codegen.layout import PROGRAM
from cutemk.plan import instantiate
from cutemk.schedulers import StaticScheduler

N = mk.sym("N", max=1 << 16)
M = mk.sym("M", max=1 << 20)


def random_dag(rng, n, fan_in=4):
    return [sorted(rng.sample(range(t), rng.randint(0, min(fan_in, t)))) for t in range(n)]


def expected(deps):
    out = []
    for t, ds in enumerate(deps):
        v = t * ops.synthetic.SEED_MUL + ops.synthetic.SEED_ADD + sum(out[d] for d in ds)
        out.append(((v + 2**31) % 2**32) - 2**31)
    return out


class Emulator:
    """The device protocol of ``cutemk.codegen.megakernel`` over a LoweredPlan, in Python."""

    def __init__(self, low, deps, grid, rng, max_epoch=None):
        self.low, self.deps, self.grid, self.rng = low, deps, grid, rng
        self.rec = low.task_rec.reshape(-1, REC_WIDTH)
        self.ev = np.zeros(max(low.num_events, 1), dtype=np.int64)
        self.pending = np.zeros(max(low.num_tasks, 1), dtype=np.int64)
        self.ring = np.zeros(max(low.num_tasks, 1), dtype=np.int64)
        self.epoch_state = 0
        self.max_epoch = max_epoch or low.max_launches()

    def body(self, out, rec):
        t = int(rec[R_C0])
        out[t] = expected_step(t, self.deps, out)

    def launch_static(self):
        epoch = self.epoch_state + 1
        out = [None] * self.low.num_tasks
        qp, qr = self.low.queue_ptr, self.low.queue_rec.reshape(-1, REC_WIDTH)
        pos = [int(qp[g]) for g in range(self.grid)]
        while any(pos[g] < qp[g + 1] for g in range(self.grid)):
            runnable = []
            for g in range(self.grid):
                if pos[g] < qp[g + 1]:
                    r = qr[pos[g]]
                    waits = range(r[R_WLO], r[R_WHI])
                    if all(
                        self.ev[self.low.wait_ev[j]] >= self.low.wait_target[j] * epoch
                        for j in waits
                    ):
                        runnable.append(g)
            assert runnable, "static queues deadlocked"
            g = self.rng.choice(runnable)
            r = qr[pos[g]]
            self.body(out, r)
            for j in range(r[R_NLO], r[R_NHI]):
                self.ev[self.low.notify_ev[j]] += 1
            pos[g] += 1
        self._close(epoch)
        return out

    def launch_dynamic(self):
        low = self.low
        epoch = self.epoch_state + 1
        n = low.num_tasks
        stamp = epoch * n
        out = [None] * n
        for j in range(low.num_init):
            self.ring[j] = stamp + low.init_tasks[j]
        tail, head, done = 0, 0, 0
        while done < n:
            ready = [s for s in range(head, n) if self.ring[s] >= stamp]
            assert ready, "dynamic queue ran dry with tasks left"
            slot = head  # tickets are taken in order; the holder of the oldest one runs next
            assert self.ring[slot] >= stamp
            head += 1
            t = int(self.ring[slot] - stamp)
            r = self.rec[t]
            assert r[R_TASK] == t
            self.body(out, r)
            for j in range(r[R_NLO], r[R_NHI]):
                e = low.notify_ev[j]
                self.ev[e] += 1
                if self.ev[e] == low.ev_count[e] * epoch:
                    for i in range(low.cons_ptr[e], low.cons_ptr[e + 1]):
                        c = int(low.cons_task[i])
                        if c < 0:
                            c = -c - 1
                        else:
                            self.pending[c] += 1
                            if self.pending[c] != low.task_nwait[c] * epoch:
                                continue
                        self.ring[low.num_init + tail] = stamp + c
                        tail += 1
            done += 1
        self._close(epoch)
        return out

    def _close(self, epoch):
        if epoch >= self.max_epoch:  # the last CTA's wrap
            self.ev[:] = 0
            self.pending[:] = 0
            self.ring[:] = 0
            self.epoch_state = 0
        else:
            self.epoch_state = epoch


def expected_step(t, deps, out):
    v = t * ops.synthetic.SEED_MUL + ops.synthetic.SEED_ADD
    for d in deps[t]:
        assert out[d] is not None, f"task {t} ran before its dependency {d}"
        v += out[d]
    return ((v + 2**31) % 2**32) - 2**31


@pytest.mark.parametrize("mode", ["static", "dynamic"])
@pytest.mark.parametrize("seed", range(12))
def test_lowered_program_reproduces_the_dag(mode, seed):
    rng = random.Random(seed)
    deps = random_dag(rng, rng.choice([1, 3, 40, 150]), fan_in=rng.choice([1, 3, 8]))
    g = ops.dag_graph(deps, N, M)
    args = ops.dag_inputs(deps)
    plan = instantiate(g, {"N": len(deps), "M": int(args[1].numel())})
    grid = rng.choice([1, 4, 132])
    sched = StaticScheduler().build(plan, grid) if mode == "static" else None
    emu = Emulator(lower(plan, sched, grid), deps, grid, rng, max_epoch=3)
    run = emu.launch_static if mode == "static" else emu.launch_dynamic
    for launch in range(7):  # crosses the epoch wrap twice
        assert run() == expected(deps), f"launch {launch}"
    assert emu.epoch_state == 7 % 3


def test_records_and_csr_are_consistent():
    rng = random.Random(7)
    deps = random_dag(rng, 60)
    g = ops.dag_graph(deps, N, M)
    plan = instantiate(g, {"N": 60, "M": int(ops.dag_inputs(deps)[1].numel())})
    sched = StaticScheduler().build(plan, 5)
    low = lower(plan, sched, 8)
    rec = low.task_rec.reshape(-1, REC_WIDTH)
    consumers = plan.consumers()
    for t in range(plan.num_tasks):
        assert rec[t, R_TASK] == t and rec[t, R_NODE] == 0 and rec[t, R_C0] == t
        waits = low.wait_ev[rec[t, R_WLO] : rec[t, R_WHI]].tolist()
        assert waits == plan.waits[t]
        assert low.wait_target[rec[t, R_WLO] : rec[t, R_WHI]].tolist() == [
            plan.event_count[e] for e in plan.waits[t]
        ]
        # notifies of events nobody waits on are dropped
        assert low.notify_ev[rec[t, R_NLO] : rec[t, R_NHI]].tolist() == [
            e for e in plan.notifies[t] if consumers[e]
        ]
    qrec = low.queue_rec.reshape(-1, REC_WIDTH)
    order = [int(r[R_TASK]) for r in qrec]
    assert order == [t for q in sched.queues for t in q]
    assert low.queue_ptr.tolist()[-1] == plan.num_tasks and len(low.queue_ptr) == 9
    assert low.max_launches() * (plan.num_tasks + 1) < 2**31


def test_malformed_lowered_programs_are_refused():
    """The boundary check between lowering and the kernel: each way of corrupting a lowered
    program (that would hang or read out of bounds on the GPU) is a GraphError naming it."""
    import copy

    from cutemk.errors import GraphError

    rng = random.Random(8)
    deps = random_dag(rng, 40)
    plan = instantiate(
        ops.dag_graph(deps, N, M), {"N": 40, "M": int(ops.dag_inputs(deps)[1].numel())}
    )
    good = lower(plan, StaticScheduler().build(plan, 5), 8)
    good.validate(8, True)
    lower(plan, None, 8).validate(8, False)

    def corrupt(edit, match):
        low = copy.deepcopy(good)
        edit(low)
        with pytest.raises(GraphError, match=match):
            low.validate(8, True)

    def wait_range(low):
        low.task_rec.reshape(-1, REC_WIDTH)[3, R_WHI] = low.wait_ev.size + 1

    def event_id(low):
        low.wait_ev[0] = low.num_events

    def queue_twice(low):
        q = low.queue_rec.reshape(-1, REC_WIDTH)
        q[1, R_TASK] = q[0, R_TASK]

    def queue_ptr(low):
        low.queue_ptr[2] = low.queue_ptr[1] - 1

    def initial(low):
        low.num_init -= 1

    def head(low):  # CTA 1's second record in its head row
        low.queue_head.reshape(8, QHEAD_WIDTH)[1, REC_WIDTH + R_TASK] += 1

    corrupt(wait_range, "wait range")
    corrupt(event_id, "event id outside")
    corrupt(queue_twice, "exactly once")
    corrupt(queue_ptr, "queue_ptr is not a CSR pointer")
    corrupt(initial, "initial tasks")
    corrupt(head, "queue_head is not")
    with pytest.raises(GraphError, match="dynamic program has static queues"):
        good.validate(8, False)


def test_queue_head_rows_hold_each_queues_first_records_and_range():
    """Per CTA: its queue's first ``QUEUE_CHUNK`` records (zeros past a short queue's end) and
    its range in ``queue_rec``; CTAs past the schedule's queues have empty ones. Packed first,
    the rows sit at the fixed offset the kernel reads them at."""
    rng = random.Random(3)
    deps = random_dag(rng, 23)
    plan = instantiate(
        ops.dag_graph(deps, N, M), {"N": 23, "M": int(ops.dag_inputs(deps)[1].numel())}
    )
    low = lower(plan, StaticScheduler().build(plan, 5), 8)
    heads = low.queue_head.reshape(8, QHEAD_WIDTH)
    recs = low.queue_rec.reshape(-1, REC_WIDTH)
    lengths = np.diff(low.queue_ptr)
    assert lengths.max() > QUEUE_CHUNK and (lengths == 0).any()  # both kinds of queue
    for cta in range(8):
        begin, end = low.queue_ptr[cta], low.queue_ptr[cta + 1]
        assert (heads[cta, QHEAD_BEGIN], heads[cta, QHEAD_END]) == (begin, end)
        first = recs[begin : min(end, begin + QUEUE_CHUNK)].reshape(-1)
        assert np.array_equal(heads[cta, : first.size], first)
        assert not heads[cta, first.size : QHEAD_BEGIN].any()
    arrays = low.program_arrays()
    buf, spans = pack_int32([arrays[k] for k in PROGRAM])
    assert spans[0] == (first_offset(len(PROGRAM)), low.queue_head.size)
    assert np.array_equal(buf[spans[0][0] : spans[0][0] + spans[0][1]], low.queue_head)
    dynamic = lower(plan, None, 8).queue_head.reshape(8, QHEAD_WIDTH)
    assert not dynamic.any()


def test_pack_int32_header_and_alignment():
    arrays = [
        np.arange(5, dtype=np.int32),
        np.zeros(0, dtype=np.int32),
        np.full(3, 7, dtype=np.int32),
    ]
    buf, spans = pack_int32(arrays)
    for k, (a, (off, size)) in enumerate(zip(arrays, spans)):
        assert buf[2 * k] == off and buf[2 * k + 1] == size == a.size
        assert off % 4 == 0  # 16-byte aligned views
        assert np.array_equal(buf[off : off + size], a)


def test_interpreter_and_emulator_agree_on_moe_skips():
    """Single-wait consumers are marked -(c+1) and multi-wait ones keep their id."""
    from cutemk.layers import MoeConfig, moe_graph

    g = moe_graph(mk.sym("T", max=128), MoeConfig(32, 16, 4, 2, block_m=8, block_n=16))
    plan = instantiate(g, {"T": 9})
    low = lower(plan, None, 4)
    live = [len(w) for w in plan.waits]
    for e, cs in enumerate(plan.consumers()):
        got = low.cons_task[low.cons_ptr[e] : low.cons_ptr[e + 1]].tolist()
        assert got == [c if live[c] > 1 else -c - 1 for c in cs]
    assert torch.equal(torch.as_tensor(low.task_nwait[: plan.num_tasks]), torch.tensor(live))


def test_watchdog_diagnosis_names_the_event():
    """The host's reading of a watchdog record (``runtime._diagnose``), without a GPU."""
    from cutemk.codegen.lower import DEBUG_SIZE, KIND_EVENT_WAIT, KIND_QUEUE_IDLE
    from cutemk.runtime import _diagnose

    deps = [[], [0], [1]]
    plan = instantiate(ops.dag_graph(deps, N, M), {"N": 3, "M": 2})
    e = plan.waits[2][0]
    # launch 4: counters hold 3 full launches plus this one's progress (vertex 0 notified only)
    counters = np.array([4, 3, 3], dtype=np.int32)[: plan.num_events]
    dbg = [2, e, 4, 3, 17, KIND_EVENT_WAIT] + [0] * (DEBUG_SIZE - 6)
    msg = _diagnose(plan, dbg, counters, epoch=4)
    assert (
        "task synthetic_dag0[2] on SM 17 waits on event vertex[1]: expected count 1, seen 0" in msg
    )
    assert "(timed out in launch 4)" in msg
    idle = [-1, -1, 3, 1, 5, KIND_QUEUE_IDLE] + [0] * (DEBUG_SIZE - 6)
    msg = _diagnose(plan, idle, counters, epoch=4)
    assert "ready queue stayed empty on SM 5 with 1 of 3 tasks done" in msg
    assert "first stuck task synthetic_dag0[2] waits on event vertex[1]" in msg


def test_watchdog_diagnosis_of_the_rank_barrier_and_a_peer_abort():
    """Distributed launches: the rank barrier's deadline (4 ranks, launch 3: 8 earlier arrivals
    plus 2 of this one) and an abort another rank set in this rank's state."""
    from cutemk.codegen.lower import DEBUG_SIZE, KIND_RANK_BARRIER, PEER_ABORT
    from cutemk.runtime import _diagnose

    plan = instantiate(ops.dag_graph([[], [0]], N, M), {"N": 2, "M": 2})
    counters = np.zeros(plan.num_events, dtype=np.int32)
    dbg = [-1, 6, 12, 10, 3, KIND_RANK_BARRIER] + [0] * (DEBUG_SIZE - 6)
    msg = _diagnose(plan, dbg, counters, epoch=3)
    assert "rank barrier closing launch 3 timed out: 2 of 4 ranks arrived" in msg
    unset = [-1] * DEBUG_SIZE
    msg = _diagnose(plan, unset, counters, epoch=3, abort=PEER_ABORT)
    assert "another rank aborted launch 3" in msg


def test_one_kernel_key_for_same_structure_different_dags():
    from cutemk.runtime import kernel_spec

    a = ops.dag_graph([[], [0]], N, M)
    b = ops.dag_graph([[], [], [0, 1]], N, M)
    assert kernel_spec(a, dynamic=True) == kernel_spec(b, dynamic=True)
    assert kernel_spec(a, dynamic=True) != kernel_spec(a, dynamic=False)
    assert kernel_spec(a, dynamic=True) != kernel_spec(a, dynamic=True, watchdog=True)


def test_dump_writes_each_stage(tmp_path, monkeypatch):
    """CUTEMK_DUMP=dir: the plan, the static schedule and the lowered arrays of a launch, and
    the kernel spec of the graph's megakernel."""
    import json

    from cutemk.layers import mlp_graph
    from cutemk.plan import dump_stage

    monkeypatch.setenv("CUTEMK_DUMP", str(tmp_path))
    g = mlp_graph(mk.sym("T", max=64), 32, 48, block_m=16, block_n=16)
    c = g.compile("interpret", num_sms=3, scheduler="static")
    c(torch.randn(20, 32), torch.randn(96, 32), torch.randn(32, 48))
    plan_doc = json.loads((tmp_path / "qwen3_mlp_T20.plan.json").read_text())
    queues = json.loads((tmp_path / "qwen3_mlp_T20.schedule.json").read_text())["queues"]
    assert len(queues) == 3 and sorted(t for q in queues for t in q) == list(
        range(len(plan_doc["tasks"]))
    )
    plan = c.plan({"T": 20})
    low = lower(plan, c.schedule({"T": 20}), 3)
    path = dump_stage(plan, "lowered", low.program_arrays())
    with np.load(path) as z:
        assert np.array_equal(z["queue_rec"], low.queue_rec)
    # the kernel stage: the compile-cache key of the graph's megakernel (no GPU needed)
    from cutemk.runtime import kernel_spec

    spec = kernel_spec(g, dynamic=False)
    kernel = json.loads((tmp_path / "qwen3_mlp.static.kernel.json").read_text())
    assert [o["name"] for o in kernel["ops"]] == [n.op.name for n in g.nodes]
    assert kernel["worker"]["ring_stages"] == spec.worker.ring_stages and not kernel["dynamic"]
    monkeypatch.delenv("CUTEMK_DUMP")
    assert dump_stage(plan, "lowered", low.program_arrays()) is None


def _reference_arrays(plan):
    """Consumer lists, live wait counts, kept notifies and initial tasks, built task by task
    from the plan's lists (what the array-at-a-time lowering must reproduce)."""
    consumers = plan.consumers()
    live = [[e for e in w if plan.event_count[e] > 0] for w in plan.waits]
    keep = [bool(c) or e in plan.shared_events for e, c in enumerate(consumers)]
    cons = [
        [c if len(live[c]) > 1 else -c - 1 for c in cs] if plan.event_count[e] > 0 else []
        for e, cs in enumerate(consumers)
    ]
    return {
        "cons_ptr": np.cumsum([0] + [len(c) for c in cons]).tolist(),
        "cons_task": [v for c in cons for v in c],
        "task_nwait": [len(w) for w in live],
        "notify_ev": [e for ns in plan.notifies for e in ns if keep[e]],
        "init": sorted((t for t in range(plan.num_tasks) if not live[t]), key=plan.ready_key),
    }


@pytest.mark.parametrize("which", ["moe", "mlp", "dag"])
def test_lowering_matches_task_by_task_construction(which):
    from cutemk.layers import MoeConfig, mlp_graph, moe_graph

    T = mk.sym("T", max=4096)
    if which == "moe":
        cfg = MoeConfig(512, 256, 16, 4, block_m=64, block_n=64, route_chunk=32)
        plans = [instantiate(moe_graph(T, cfg, torch.bfloat16), {"T": t}) for t in (1, 77, 4096)]
    elif which == "mlp":
        g = mlp_graph(T, 256, 512, torch.bfloat16, 64, 64, fuse_silu=True)
        plans = [instantiate(g, {"T": t}) for t in (1, 300)]
    else:
        deps = random_dag(random.Random(3), 200, fan_in=6)
        g = ops.dag_graph(deps, N, M)
        plans = [instantiate(g, {"N": 200, "M": int(ops.dag_inputs(deps)[1].numel())})]
    for plan in plans:
        low = lower(plan, None, 132)
        ref = _reference_arrays(plan)
        n = plan.num_tasks
        assert low.cons_ptr.tolist() == ref["cons_ptr"]
        assert low.cons_task.tolist()[: len(ref["cons_task"])] == ref["cons_task"]
        assert low.task_nwait.tolist()[:n] == ref["task_nwait"]
        assert low.notify_ev.tolist()[: len(ref["notify_ev"])] == ref["notify_ev"]
        assert low.init_tasks.tolist()[: low.num_init] == ref["init"]
        rec = low.task_rec.reshape(-1, REC_WIDTH)
        for t in plan.tasks:
            assert rec[t.tid, R_NODE] == t.node.index
            assert rec[t.tid, R_C0 : R_C0 + len(t.coord)].tolist() == list(t.coord)


def test_dump_stays_in_its_directory(tmp_path, monkeypatch):
    """A graph named like a path writes its dump inside CUTEMK_DUMP, and a CUTEMK_DUMP that is
    a file is named in the error."""
    from cutemk import ops
    from cutemk.errors import CuteMKError

    dump = tmp_path / "dump"
    monkeypatch.setenv("CUTEMK_DUMP", str(dump))
    g = mk.Graph("../escape/x")
    x = g.input("x", (mk.sym("T", max=8), 16), torch.float32)
    g.output(g.call(ops.rmsnorm, x, block_m=1), "y")
    g.compile("interpret", num_sms=2)(torch.randn(3, 16))
    written = sorted(p.name for p in dump.iterdir())
    assert written and all(not n.startswith(".") and "/" not in n for n in written), written
    assert not (tmp_path / "escape").exists()
    monkeypatch.setenv("CUTEMK_DUMP", str(tmp_path / "a_file"))
    (tmp_path / "a_file").write_text("")
    with pytest.raises(CuteMKError, match="is a file, not a directory"):
        g.compile("interpret", num_sms=2)(torch.randn(3, 16))
