"""An in-place KV-cache append (``ops.kv_append``, ``TileOp.updates``) feeding decode attention
in one graph: the step's key and value rows land in the caller's cache tensors at each
sequence's new position, and attention (which reads the updated caches) sees them. Graph
checks: the cache must be a graph input, read by no other node. Bad positions or pages are not
written. CPU: the interpreter with its race checker, and a compile for sm_90a."""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest
import torch

import cutemk as mk
from cutemk import ops
from cutemk.errors import GraphError
from cutemk.ops.attention_decode import decode_attention_reference
from cutemk.runtime import compile_offline

HQ, HKV, D, PAGE, MAXP, ALIGN = 8, 2, 64, 16, 32, 64


def _graph(dtype=torch.float32):
    g = mk.Graph("decode_step")
    B = mk.sym("B", min=1, max=16)
    P = mk.sym("P", min=1, max=4096)
    q = g.input("q", (B, HQ, D), dtype)
    kn = g.input("k_new", (B, HKV, D), dtype)
    vn = g.input("v_new", (B, HKV, D), dtype)
    kc = g.input("k_cache", (P, PAGE, HKV, D), dtype)
    vc = g.input("v_cache", (P, PAGE, HKV, D), dtype)
    pt = g.input("page_table", (B, MAXP), torch.int32)
    lens = g.input("seq_lens", (B,), torch.int32)
    k2, v2 = g.call(ops.kv_append, kn, vn, kc, vc, pt, lens)
    out = g.call(ops.attention_decode, q, k2, v2, pt, lens, align=ALIGN)[0]
    g.output(out, "out")
    return g


def _step(lens, gen):
    b = len(lens)
    pages = [-(-n // PAGE) for n in lens]
    total = sum(pages) + 2
    perm = torch.randperm(total, generator=gen).tolist()
    table = torch.zeros(b, MAXP, dtype=torch.int32)
    i = 0
    for r, n in enumerate(pages):
        table[r, :n] = torch.tensor(perm[i : i + n], dtype=torch.int32)
        i += n
    return {
        "q": torch.randn(b, HQ, D, generator=gen),
        "k_new": torch.randn(b, HKV, D, generator=gen),
        "v_new": torch.randn(b, HKV, D, generator=gen),
        "k_cache": torch.randn(total, PAGE, HKV, D, generator=gen),
        "v_cache": torch.randn(total, PAGE, HKV, D, generator=gen),
        "page_table": table,
        "seq_lens": torch.tensor(lens, dtype=torch.int32),
    }


def _expected(a):
    kc, vc = a["k_cache"].clone(), a["v_cache"].clone()
    for b, n in enumerate(a["seq_lens"].tolist()):
        pg, slot = int(a["page_table"][b, (n - 1) // PAGE]), (n - 1) % PAGE
        kc[pg, slot], vc[pg, slot] = a["k_new"][b], a["v_new"][b]
    return kc, vc, decode_attention_reference(a["q"], kc, vc, a["page_table"], a["seq_lens"])


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_append_then_attend_interpreted(scheduler):
    c = _graph().compile("interpret", num_sms=4, scheduler=scheduler)
    gen = torch.Generator().manual_seed(0)
    for lens in ([1], [17, 64, 65], [PAGE * MAXP, 3]):
        a = _step(lens, gen)
        kc, vc, ref = _expected(a)
        out = c(**a)
        torch.testing.assert_close(a["k_cache"], kc, rtol=0, atol=0)  # updated in place
        torch.testing.assert_close(a["v_cache"], vc, rtol=0, atol=0)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_caches_that_share_memory_are_refused():
    """A cache updated in place shares no memory with another input: one tensor passed as both
    caches had its k rows overwritten by the v rows, silently; a cache overlapping q too."""
    from cutemk.errors import LayoutError

    run = _graph().compile("interpret")
    a = _step([5, 17], torch.Generator().manual_seed(3))
    with pytest.raises(
        LayoutError, match="k_cache is updated in place but shares memory with v_cache"
    ):
        run(**{**a, "v_cache": a["k_cache"]})
    both = torch.randn(2, *a["k_cache"].shape)
    with pytest.raises(LayoutError, match="shares memory"):  # two views of one buffer
        run(
            **{
                **a,
                "k_cache": both[0],
                "v_cache": both[0].view(-1)[: a["v_cache"].numel()].view(a["v_cache"].shape),
            }
        )
    run(**{**a, "k_cache": both[0], "v_cache": both[1]})  # side by side: fine


def test_bad_position_is_not_written():
    c = _graph().compile("interpret", num_sms=2)
    a = _step([20, 30], torch.Generator().manual_seed(1))
    before = a["k_cache"].clone()
    a["page_table"][0, 1] = 10_000  # sequence 0's new row falls on a page outside the cache
    out = c(**a)
    pg, slot = int(a["page_table"][1, 29 // PAGE]), 29 % PAGE
    changed = (a["k_cache"] != before).any(dim=(2, 3)).nonzero().tolist()
    assert changed == [[pg, slot]]  # only sequence 1's row
    assert torch.isnan(out[0]).all() and not torch.isnan(out[1]).any()


def test_the_updated_input_has_one_reader():
    g = _graph()
    kc = next(v for v in g.values if v.name == "k_cache")
    q = next(v for v in g.values if v.name == "q")
    lens = next(v for v in g.values if v.name == "seq_lens")
    pt = next(v for v in g.values if v.name == "page_table")
    vc = next(v for v in g.values if v.name == "v_cache")
    g.call(ops.attention_decode, q, kc, vc, pt, lens, align=ALIGN, name="stale_reader")
    with pytest.raises(GraphError, match="updates in place"):
        g.validate()


def test_a_reader_that_skips_the_update_is_a_race():
    """An attention whose reads of the updated caches declare no dependency on the append
    (so nothing orders it after the update) is refused by the race checker whichever runs
    first: it either reads before the update or the update lands after its read."""
    from dataclasses import dataclass, fields

    from cutemk.errors import RaceError
    from cutemk.ops.attention_decode import AttentionDecodeTile
    from cutemk.tileop import register_op

    @register_op
    @dataclass(frozen=True)
    class CarelessAttention(AttentionDecodeTile):
        name = "careless_attention"

        def reads(self, coord, env, data=None):
            r = super().reads(coord, env, data)
            if data is None:  # no event on the append
                r["k_cache"], r["v_cache"] = [], []
            return r

    g = _graph()
    node = next(n for n in g.nodes if n.op.name == "attention_decode")
    careless = CarelessAttention(**{f.name: getattr(node.op, f.name) for f in fields(node.op)})
    object.__setattr__(node, "op", careless)
    for seed in range(6):
        c = g.compile("interpret", num_sms=4, scheduler="dynamic", seed=seed)
        with pytest.raises(RaceError):
            c(**_step([20, 30, 5], torch.Generator().manual_seed(seed)))


def test_world_simulation_updates_the_callers_cache():
    from cutemk.world import simulate_world

    a = _step([9, 17], torch.Generator().manual_seed(3))
    kc, vc, ref = _expected(a)
    outs, _ = simulate_world(_graph(), 1, [a])
    torch.testing.assert_close(a["k_cache"], kc, rtol=0, atol=0)
    torch.testing.assert_close(outs[0][0], ref, rtol=1e-4, atol=1e-4)


def test_compiles_for_hopper(tmp_path):
    compile_offline(_graph(torch.bfloat16), "static", options=f"--keep-ptx --dump-dir={tmp_path}")
    assert list(tmp_path.glob("*.ptx"))


def test_cache_loads_precede_the_events_only_behind_kv_append():
    """Attention's keys and values are launch input but for each sequence's appended row: the
    kernel loads them before the tile's events where the only writer of the cache is a
    ``kv_append`` (and the lengths and pages are launch inputs), and after them otherwise."""
    from cutemk.runtime import kernel_spec

    def prefetches(g):
        spec = kernel_spec(g, dynamic=False)
        return {n.op.name: p for n, p in zip(g.nodes, spec.prefetch)}

    assert prefetches(_graph(torch.bfloat16))["attention_decode"]
    # a cache another op writes (a stand-in of another name) is loaded after the events
    from dataclasses import dataclass, fields

    from cutemk.ops.kv_append import KvAppendTile
    from cutemk.tileop import register_op

    @register_op
    @dataclass(frozen=True)
    class OtherWriter(KvAppendTile):
        name = "other_cache_writer"

    g = _graph(torch.bfloat16)
    node = next(n for n in g.nodes if n.op.name == "kv_append")
    other = OtherWriter(**{f.name: getattr(node.op, f.name) for f in fields(node.op)})
    object.__setattr__(node, "op", other)
    assert not prefetches(g)["attention_decode"]


def test_nested_sparse_and_meta_inputs_are_named():
    from cutemk.errors import DeviceError, LayoutError

    run = _graph().compile("interpret")
    a = _step([5, 17], torch.Generator().manual_seed(4))
    with pytest.raises(LayoutError, match="q must be a dense"):
        run(**{**a, "q": a["q"].to_sparse()})
    with pytest.raises(DeviceError, match="q is a meta tensor"):
        run(**{**a, "q": a["q"].to("meta")})


def test_a_repeated_call_with_caches_that_share_memory_binds_again():
    """A compiled graph's (or live graph's) later call with the shapes of an earlier one skips
    ``bind``: it must not reuse that launch when an updated cache now shares memory with
    another leaf (the full bind then refuses it). Checked once per set of addresses."""
    from cutemk.binding import LeavesApart

    g = _graph()
    a = _step([5, 17], torch.Generator().manual_seed(3))
    names = [v.name for v in g.leaves]
    leaves = [a[n] for n in names]
    apart = LeavesApart(g, leaves)
    assert [names[i] for i in apart.updated] == ["k_cache", "v_cache"]
    ptrs = [t.data_ptr() for t in leaves]
    assert apart(tuple(ptrs)) and apart.seen == tuple(ptrs)
    k, v = names.index("k_cache"), names.index("v_cache")
    same = list(ptrs)
    same[v] = ptrs[k]  # one tensor for both caches
    assert not apart(tuple(same))
    inside = list(ptrs)
    inside[names.index("q")] = ptrs[k] + 64  # q inside the k cache
    assert not apart(tuple(inside))
    assert apart(tuple(ptrs))  # the first set again
