"""The megakernel: CPU compile checks for sm_90a, and GPU runs of the synthetic-DAG graph.

GPU tests compare the megakernel with the interpreter on the same graph (random DAGs with random
fan-in/fan-out and random tile costs), check launches without any host reset (1,000 launches,
CUDA-graph replay), and the watchdog naming a missing notify's event.
"""

import random
import re
import time

import pytest
import torch

import cutemk as mk
from cutemk import ops, runtime
from cutemk.plan import instantiate

N = mk.sym("N", max=1 << 16)
M = mk.sym("M", max=1 << 20)


def random_dag(rng: random.Random, n: int, max_fan_in: int = 8, window: int | None = None):
    """Each vertex depends on up to max_fan_in earlier vertices (within a window, if given)."""
    deps = []
    for t in range(n):
        lo = 0 if window is None else max(0, t - window)
        k = rng.randint(0, min(max_fan_in, t - lo))
        deps.append(sorted(rng.sample(range(lo, t), k)))
    return deps


def wrap32(v: int) -> int:
    return ((v + 2**31) % 2**32) - 2**31


def dag_expected(deps):
    out = []
    for t, ds in enumerate(deps):
        out.append(
            wrap32(t * ops.synthetic.SEED_MUL + ops.synthetic.SEED_ADD + sum(out[d] for d in ds))
        )
    return torch.tensor(out, dtype=torch.int32)


def _captured(c, args):
    """``(graph, out)``: one call of ``c`` captured in a CUDA graph after a warm call."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        c(*args)  # warm
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = c(*args)
    return graph, out


def _assert_replays(graph, out, expected, times: int):
    for _ in range(times):
        out.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


def test_interpreter_matches_direct_dag_evaluation():
    rng = random.Random(0)
    for sched in ("static", "dynamic"):
        deps = random_dag(rng, 60)
        out = ops.dag_graph(deps, N, M).compile("interpret", num_sms=7, scheduler=sched)(
            *ops.dag_inputs(deps)
        )
        assert torch.equal(out, dag_expected(deps))


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
@pytest.mark.parametrize("watchdog", [False, True])
def test_megakernel_compiles_for_sm90a(scheduler, watchdog, tmp_path):
    g = ops.dag_graph([[], [0]], N, M)
    t0 = time.perf_counter()
    ptx = runtime.compile_offline(
        g,
        scheduler=scheduler,
        watchdog=watchdog,
        profile=watchdog,
        options=f"--keep-ptx --dump-dir={tmp_path}",
    ).__ptx__
    assert time.perf_counter() - t0 < 60
    entries = re.findall(r"\.entry\s+(\w+)", ptx)
    assert len(entries) == 1 and "cutemk_megakernel" in entries[0]
    assert "cutlass" not in entries[0]
    assert re.search(r"\.target\s+sm_90a", ptx)
    assert re.search(r"ld\.acquire\.gpu", ptx)  # waits / pops acquire
    if scheduler == "static":
        assert re.search(r"red\.release\.gpu\.global\.add", ptx)  # notify
    else:
        assert re.search(r"atom\.global\.acq_rel\.add", ptx)  # notify that may complete an event
        assert re.search(r"st\.release\.gpu\.global", ptx)  # ring slot publish
    # the watchdog's abort flag is raised with a CAS; without the watchdog there is none
    assert bool(re.search(r"atom\.global\.acq_rel\.cas", ptx)) == watchdog
    # with it, the consumer threads agree on leaving once a record (barrier 8, all of them)
    assert bool(re.search(r"barrier(\.cta)?\.red\.or\.pred\s+%p\d+, 8, 256, ", ptx)) == watchdog


# -------------------------------------------------------------------------------------- GPU
def _run_dag(compiled, deps, work=0):
    return compiled(*ops.dag_inputs(deps, work, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_random_dags_match_interpreter(scheduler):
    rng = random.Random(1 if scheduler == "static" else 2)
    before = runtime.compile_count
    compiled = None
    for i in range(200):
        n = rng.choice([1, 2, 5, 17, 64, 132, 200, 300, 700])
        deps = random_dag(
            rng, n, max_fan_in=rng.choice([1, 2, 8]), window=rng.choice([None, 4, 140])
        )
        work = [rng.choice([0, 0, 200, 2000]) for _ in range(n)]
        g = ops.dag_graph(deps, N, M)
        compiled = g.compile(
            "cute",
            scheduler=scheduler,
            watchdog=True,
            timeout_s=2.0,
            num_sms=rng.choice([132, 132, 7, 1]),
        )
        out = _run_dag(compiled, deps, work)
        ref = g.compile("interpret", num_sms=8, scheduler=scheduler, check_races=False)(
            *ops.dag_inputs(deps, work)
        )
        assert torch.equal(out.cpu(), ref), f"DAG {i} (n={n}) differs"
    # same symbolic op instances: one megakernel for all 200 DAGs of this scheduler
    assert runtime.compile_count - before <= 1


@pytest.mark.gpu
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_thousand_launches_and_graph_replay_without_reset(scheduler):
    rng = random.Random(3)
    deps_a = random_dag(rng, 300, window=140)
    deps_b = random_dag(rng, 77)
    ga, gb = ops.dag_graph(deps_a, N, M), ops.dag_graph(deps_b, N, M)
    ca = ga.compile("cute", scheduler=scheduler, watchdog=False)
    cb = gb.compile("cute", scheduler=scheduler, watchdog=False)
    ia, ib = ops.dag_inputs(deps_a, device="cuda"), ops.dag_inputs(deps_b, device="cuda")
    ea, eb = dag_expected(deps_a).cuda(), dag_expected(deps_b).cuda()
    bad = 0
    for i in range(1000):
        out = ca(*ia) if i % 3 else cb(*ib)
        bad += int(not torch.equal(out, ea if i % 3 else eb))
    assert bad == 0
    state = ca._bufs({"N": 300, "M": int(ia[1].numel())}).torch_dev["state"]
    assert int(state[0]) == len([i for i in range(1000) if i % 3])  # epochs advanced on device
    # CUDA-graph replay: the epoch lives on the device, so replays need no host work at all
    _assert_replays(*_captured(ca, ia), ea, 200)


@pytest.mark.gpu
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_missing_notify_is_reported_within_seconds(scheduler):
    deps = [[], [0], [1], [0, 2], [3]]
    g = ops.dag_graph(deps, N, M)
    c = g.compile("cute", scheduler=scheduler, watchdog=True, timeout_s=0.5)
    args = ops.dag_inputs(deps, device="cuda")
    assert torch.equal(c(*args).cpu(), dag_expected(deps))
    plan = instantiate(g, {"N": 5, "M": int(args[1].numel())})
    plan.notifies[2].clear()  # vertex 2 never notifies: vertex 3 waits forever
    c.load_plan(plan)
    t0 = time.perf_counter()
    with pytest.raises(
        mk.DeadlockError,
        match=r"synthetic_dag0\[3\] waits on event vertex\[2\]: "
        r"expected count 1, seen 0",
    ):
        c(*args)
    assert time.perf_counter() - t0 < 10
    # the buffers were reset: the repaired plan runs again in the same process
    c.load_plan(instantiate(g, {"N": 5, "M": int(args[1].numel())}))
    assert torch.equal(c(*args).cpu(), dag_expected(deps))


@pytest.mark.gpu
def test_load_plan_keeps_the_state_a_captured_graph_replays():
    """A CUDA graph captured before ``load_plan`` replaced the plan of its dims still reads the
    old plan's device state: that state must stay allocated (else the replay reads memory
    that new tensors own)."""
    deps = [[], [0], [1], [0, 2], [3]]
    g = ops.dag_graph(deps, N, M)
    c = g.compile("cute", scheduler="static")
    args = ops.dag_inputs(deps, device="cuda")
    expected = dag_expected(deps).cuda()
    graph, out = _captured(c, args)
    c.load_plan(instantiate(g, {"N": 5, "M": int(args[1].numel())}))
    junk = [torch.full((1 << 20,), -1, dtype=torch.int32, device="cuda") for _ in range(8)]
    _assert_replays(graph, out, expected, 5)
    assert torch.equal(c(*args), expected)  # the new plan runs too
    del junk


@pytest.mark.gpu
def test_a_kept_runner_launches_what_a_call_would():
    """``CuteGraph.runner``: the launch alone, for callers that check their own leaves. It
    launches on the caller's stream (a capture on a side stream records it), binds again
    after ``load_plan`` and poisons outputs once ``poison_outputs`` is switched on."""
    deps = [[], [0], [1], [0, 2], [3]]
    g = ops.dag_graph(deps, N, M)
    c = g.compile("cute", scheduler="static")
    args = tuple(ops.dag_inputs(deps, device="cuda"))
    expected = dag_expected(deps).cuda()
    assert c.runner(*args) is None  # nothing like it launched yet
    assert torch.equal(c(*args), expected)
    run = c.runner(*args)
    assert run is not None and c.runner(args[0], args[1].float(), args[2]) is None
    outs = [run(args) for _ in range(50)]
    assert len({o.data_ptr() for o in outs[-2:]}) == 2  # a fresh output a call
    assert all(torch.equal(o, expected) for o in outs)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = run(args)
    _assert_replays(graph, out, expected, 5)
    c.load_plan(instantiate(g, {"N": 5, "M": int(args[1].numel())}))
    assert torch.equal(run(args), expected)  # bound again: the new plan
    c.poison_outputs = True
    assert torch.equal(run(args), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("kept", [False, True])
def test_a_launch_on_a_second_stream_waits_for_the_first(kept):
    """Launches of one graph share its counters and intermediates: a launch on another stream
    is ordered after the work queued on the stream of the last launch (through the full call
    path and through a kept runner)."""
    deps = [[], [0], [1], [0, 2], [3]]
    g = ops.dag_graph(deps, N, M)
    c = g.compile("cute", scheduler="static")
    c.poison_outputs = not kept  # poisoned outputs: every call takes the full path
    args = tuple(ops.dag_inputs(deps, device="cuda"))
    expected = dag_expected(deps).cuda()
    assert torch.equal(c(*args), expected)
    launch = c.runner(*args) if kept else (lambda a: c(*a))
    assert launch is not None and (c.runner(*args) is None) == (not kept)
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    done = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    torch.cuda.synchronize()
    with torch.cuda.stream(first):
        torch.cuda._sleep(50_000_000)  # tens of milliseconds before the first launch
        out1 = launch(args)
        done[0].record()
    with torch.cuda.stream(second):
        out2 = launch(args)
        done[1].record()
    torch.cuda.synchronize()
    assert done[0].elapsed_time(done[1]) > 0  # the second launch ended after the first
    assert torch.equal(out1, expected) and torch.equal(out2, expected)


@pytest.mark.multigpu
def test_one_graph_lives_on_the_gpu_of_its_first_call():
    """A graph's plans are built on its first call's GPU, whichever GPU is current; leaves on
    another GPU later are refused by name instead of mixing two devices' pointers."""
    from cutemk.errors import DeviceError

    deps = [[], [0], [1]]
    g = ops.dag_graph(deps, N, M)
    c = g.compile("cute", scheduler="static")
    expected = dag_expected(deps)
    on1 = tuple(t.to("cuda:1") for t in ops.dag_inputs(deps, device="cpu"))
    with torch.cuda.device(0):
        out = c(*on1)
    assert out.device == torch.device("cuda:1") and torch.equal(out.cpu(), expected)
    on0 = tuple(t.to("cuda:0") for t in on1)
    with pytest.raises(DeviceError, match="cuda:0 but the graph's state lives on cuda:1"):
        c(*on0)


@pytest.mark.parametrize("layer,scheduler", [("mlp", "static"), ("moe", "dynamic")])
def test_layer_megakernels_compile_for_sm90a(layer, scheduler, tmp_path):
    from cutemk.layers import MoeConfig, mlp_graph, moe_graph

    T = mk.sym("T", max=4096)
    if layer == "mlp":
        g = mlp_graph(T, 2048, 6144, torch.bfloat16, block_m=64, block_n=64)
    else:
        g = moe_graph(T, MoeConfig(2048, 768, 128, 8, block_m=64, block_n=64), torch.bfloat16)
    ptx = runtime.compile_offline(
        g, scheduler=scheduler, watchdog=True, options=f"--keep-ptx --dump-dir={tmp_path}"
    ).__ptx__
    assert len(re.findall(r"\.entry\s+\w*cutemk_megakernel", ptx)) == 1
    assert not re.search(r"ld\.global\.nc", ptx)  # data written in the launch is never read
    # through the non-coherent path


@pytest.mark.gpu
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_counters_wrap_on_the_device(scheduler):
    """Once count * epoch would pass int32 the last CTA zeroes the counters and restarts at
    epoch 0; here the limit is forced to 3 launches, also under CUDA-graph replay."""
    rng = random.Random(5)
    deps = random_dag(rng, 150, window=20)
    g = ops.dag_graph(deps, N, M)
    c = g.compile("cute", scheduler=scheduler)
    inputs = ops.dag_inputs(deps, device="cuda")
    expected = dag_expected(deps).cuda()
    b = c._bufs({"N": 150, "M": int(inputs[1].numel())})
    b.max_epoch = 3
    for _ in range(10):
        assert torch.equal(c(*inputs), expected)
    assert int(b.torch_dev["state"][0]) == 10 % 3
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = c(*inputs)
    for _ in range(20):
        out.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


@pytest.mark.gpu
def test_watchdog_refuses_graph_capture():
    deps = [[], [0]]
    c = ops.dag_graph(deps, N, M).compile("cute", watchdog=True)
    inputs = ops.dag_inputs(deps, device="cuda")
    c(*inputs)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), pytest.raises(mk.CuteMKError, match="cannot be captured"):
        with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream):
            c(*inputs)


@pytest.mark.gpu
def test_grid_larger_than_the_gpu_is_refused():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = ops.dag_graph([[]], N, M)
    with pytest.raises(ValueError, match=f"num_sms must be in \\[1, {sms}\\]"):
        g.compile("cute", num_sms=sms + 1)


def test_the_cooperative_launch_is_part_of_the_kernel_spec(monkeypatch):
    g = ops.dag_graph([[], [0]], N, M)
    on = runtime.kernel_spec(g, False)
    assert on.cooperative
    monkeypatch.setenv("CUTEMK_COOPERATIVE", "0")
    off = runtime.kernel_spec(g, False)
    assert not off.cooperative and off != on  # another kernel, another cache key
    assert callable(runtime.compile_offline(g))  # its host code compiles too


def test_the_epi_mbarrier_is_part_of_the_kernel_spec(monkeypatch, tmp_path):
    """The staging buffer's hand-overs are mbarriers by default: its release (every storer lane
    arrives, the consumers wait on its phase) and the staged record's (every consumer thread
    arrives, the storer waits), so no named barrier 4 or 3 is left; ``CUTEMK_EPI_MBARRIER=0``
    turns both off (named barrier 3 and 4 again)."""
    g = ops.dag_graph([[], [0]], N, M)
    on = runtime.kernel_spec(g, False)
    assert on.epi_mbarrier  # on by default
    monkeypatch.setenv("CUTEMK_EPI_MBARRIER", "0")
    off = runtime.kernel_spec(g, False)
    assert not off.epi_mbarrier and on != off and on.describe()["epi_mbarrier"]
    monkeypatch.delenv("CUTEMK_EPI_MBARRIER")
    from cutemk.layers import mlp_graph

    mlp = mlp_graph(mk.sym("T", max=64), 256, 256, torch.bfloat16, 64, 64, fuse_silu=True)
    runtime.compile_offline(mlp, "static", options=f"--keep-ptx --dump-dir={tmp_path}")
    (ptx_file,) = tmp_path.glob("*.ptx")
    ptx = ptx_file.read_text()
    assert not re.search(r"\b(bar|barrier)(\.cta)?\.(arrive|sync)\s+[34],", ptx)
    # the release (one arrival a storer lane) and the staged record (one a consumer thread)
    inits_on = len(re.findall(r"\bmbarrier\.init\.", ptx))
    # every named barrier is the unaligned form (``device.config.named_sync``): its participants
    # run different code; only the whole-CTA barriers (one instruction for all) are aligned
    assert not re.search(r"\bbar(\.cta)?\.(sync|arrive)\s+\d+,", ptx)
    assert not re.search(r"\bbarrier(\.cta)?\.(sync|arrive)\.aligned", ptx)
    monkeypatch.setenv("CUTEMK_EPI_MBARRIER", "0")
    off_dir = tmp_path / "off"
    off_dir.mkdir()
    runtime.compile_offline(mlp, "static", options=f"--keep-ptx --dump-dir={off_dir}")
    (ptx_file,) = off_dir.glob("*.ptx")
    ptx = ptx_file.read_text()
    assert re.search(r"\bbarrier\.sync\s+3,", ptx)  # the record's hand-over: a sync on both sides
    assert re.search(r"\bbarrier\.arrive\s+4,", ptx)  # the storer's release
    assert inits_on == len(re.findall(r"\bmbarrier\.init\.", ptx)) + 2


def test_the_early_handover_is_part_of_the_kernel_spec(monkeypatch):
    g = ops.dag_graph([[], [0]], N, M)
    on = runtime.kernel_spec(g, False)
    assert on.early_handover  # on by default
    monkeypatch.setenv("CUTEMK_EARLY_HANDOVER", "0")
    off = runtime.kernel_spec(g, False)
    assert not off.early_handover
    assert on.early_handover and on != off and on.describe()["early_handover"]


@pytest.fixture
def fake_gpu(monkeypatch):
    """The cute backend's constructor on a machine without a GPU (it checks its options and
    builds no device state): a stand-in device of 132 SMs."""

    class Props:
        multi_processor_count = 132

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: Props())


@pytest.mark.parametrize(
    "options, error, match",
    [
        (dict(num_sms=2.7), TypeError, "num_sms must be an int"),
        (dict(num_sms="4"), TypeError, "num_sms must be an int"),
        (dict(num_sms=True), TypeError, "num_sms must be an int"),
        (dict(num_sms=0), ValueError, r"num_sms must be in \[1, 132\]"),
        (dict(watchdog="no"), TypeError, "watchdog must be True or False"),
        (dict(poison_outputs=1), TypeError, "poison_outputs must be True or False"),
        (dict(watchdog=True, timeout_s=0), ValueError, "timeout_s must be in"),
        (dict(timeout_s=-1.0), ValueError, "timeout_s must be in"),
        (dict(timeout_s=float("nan")), ValueError, "timeout_s must be in"),
        (dict(timeout_s=float("inf")), ValueError, "timeout_s must be in"),
        (dict(timeout_s=1e12), ValueError, "timeout_s must be in"),
        (dict(timeout_s="1"), TypeError, "timeout_s must be a number"),
        (dict(profile=1), ValueError, "profile must be False, True or 'slices'"),
    ],
)
def test_the_cute_backends_options_are_checked(fake_gpu, options, error, match):
    """Options were coerced (num_sms 2.7 -> 2, watchdog "no" -> on) or reached the launch as
    raw errors (timeout_s NaN / inf / 0: every wait aborting at once). A refused option leaves
    the graph open for more edits."""
    g = ops.dag_graph([[], [0]], N, M)
    with pytest.raises(error, match=match):
        g.compile("cute", **options)
    g.input("more", (4,), torch.float32)  # not frozen by the failed compile


def test_load_plan_takes_only_a_plan_of_its_graph_within_its_dims(fake_gpu):
    """load_plan installed another graph's plan (its kernel would run that task grid) or one
    past the dims' maxima (the buffers sized for them) without a word."""
    from cutemk.errors import GraphError, ShapeError

    g = ops.dag_graph([[], [0]], N, M)
    other = ops.dag_graph([[], [0], [1]], N, M)
    c = g.compile("cute", scheduler="static")
    with pytest.raises(TypeError, match="load_plan takes a Plan, got str"):
        c.load_plan("plan.json")
    with pytest.raises(GraphError, match="a plan of graph"):
        c.load_plan(instantiate(other, {"N": 3, "M": 64}))
    plan = instantiate(g, {"N": 2, "M": 64})
    plan.env["M"] = (1 << 20) + 1
    with pytest.raises(ShapeError, match="exceeds its declared max"):
        c.load_plan(plan)
