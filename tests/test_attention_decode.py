"""Decode attention over a paged KV cache, split along the sequence (``ops.attention_decode``:
the last range of a sequence to finish merges the others), against an fp32 SDPA per sequence: random lengths (1, 7, 129,
4097), page sizes, GQA ratios, scattered pages; bad data (a page id outside the cache, a length
past the page table or zero) makes exactly that sequence NaN. CPU: the interpreter (race
checker on) and a compile of the kernel for sm_90a. GPU (``gpu``): the megakernel, both
schedulers, NaN-poisoned outputs, bit-identical reruns."""

import os
import re
from dataclasses import replace

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest
import torch

import cutemk as mk
from cutemk import ops
from cutemk.runtime import compile_offline
from cutemk.ops.attention_decode import decode_attention_reference


def _graph(hq, hkv, d, page, max_pages, align, dtype, max_b=8, target_tiles=264, merge=None):
    g = mk.Graph("decode_attention")
    B = mk.sym("B", min=1, max=max_b)
    q = g.input("q", (B, hq, d), dtype)
    k = g.input("k_cache", (mk.sym("P", min=1, max=1 << 16), page, hkv, d), dtype)
    v = g.input("v_cache", (k.spec.shape[0], page, hkv, d), dtype)
    pt = g.input("page_table", (B, max_pages), torch.int32)
    lens = g.input("seq_lens", (B,), torch.int32)
    out = g.call(
        ops.attention_decode,
        q,
        k,
        v,
        pt,
        lens,
        target_tiles=target_tiles,
        align=align,
        merge_batched=merge,
    )[0]
    g.output(out, "out")
    return g


def _inputs(lens, hq, hkv, d, page, max_pages, dtype, gen, device="cpu"):
    b = len(lens)
    pages_needed = [-(-n // page) for n in lens]
    total = sum(pages_needed) + 3
    perm = torch.randperm(total, generator=gen).tolist()  # pages scattered over the cache
    table = torch.zeros(b, max_pages, dtype=torch.int32)
    i = 0
    for r, n in enumerate(pages_needed):
        table[r, :n] = torch.tensor(perm[i : i + n], dtype=torch.int32)
        i += n
    args = {
        "q": torch.randn(b, hq, d, generator=gen).to(dtype),
        "k_cache": torch.randn(total, page, hkv, d, generator=gen).to(dtype),
        "v_cache": torch.randn(total, page, hkv, d, generator=gen).to(dtype),
        "page_table": table,
        "seq_lens": torch.tensor(lens, dtype=torch.int32),
    }
    # a last page's slots past the sequence are not its own: NaN there must reach no result
    for r, n in enumerate(lens):
        if 0 < n <= max_pages * page and n % page:
            last = int(table[r, n // page])
            args["k_cache"][last, n % page :] = float("nan")
            args["v_cache"][last, n % page :] = float("nan")
    return {k: v.to(device) for k, v in args.items()}


@pytest.mark.parametrize(
    "hq,hkv,page,align,target",
    # target 264: one sequence in 16 ranges; 6 / 3: fewer ranges as the batch grows, down to one
    [(4, 1, 16, 64, 264), (8, 2, 64, 128, 6), (8, 8, 16, 32, 264), (4, 2, 16, 16, 3)],
)
def test_decode_attention_interpreted(hq, hkv, page, align, target):
    d, max_pages = 64, 260
    g = _graph(hq, hkv, d, page, max_pages, align, torch.float32, target_tiles=target)
    c = g.compile("interpret", num_sms=8)
    gen = torch.Generator().manual_seed(hq * 10 + hkv)
    for lens in ([1], [7, 129], [4097, 1, 200]):
        if max(lens) > page * max_pages:
            continue
        a = _inputs(lens, hq, hkv, d, page, max_pages, torch.float32, gen)
        out = c(**a)
        ref = decode_attention_reference(**a)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_kv_split_ranges_cover_each_sequence_once():
    """Every length's ranges tile [0, length) in order, aligned, at most ``splits`` of them,
    and the symbolic count agrees with the int one at every batch."""
    from cutemk.ops import kv_split as kvs

    B = mk.sym("B", min=1, max=64)
    expr = kvs.split_count(B, 8, 16, 264)
    for b in range(1, 65):
        count = kvs.split_count(b, 8, 16, 264)
        assert expr.eval({"B": b}) == count and 1 <= count <= 16
        assert b * 8 * count <= 264 or count == 1
    assert [kvs.split_count(b, 8, 16, 264) for b in (1, 2, 3, 11, 12, 16, 64)] == [
        16,
        16,
        11,
        3,
        1,  # 264 // 96 = 2: two waves of half ranges are no faster than one of whole ones
        1,
        1,
    ]
    for count in (1, 2, 5, 16):
        for length in range(1, 700, 7):
            c = kvs.span(length, count, 64)
            n = kvs.ranges_of(length, count, 64)
            assert c % 64 == 0 and 1 <= n <= count
            assert (n - 1) * c < length <= n * c
    assert kvs.ranges_of(0, 4, 64) == 0 and kvs.ranges_of(-3, 4, 64) == 0


def test_decode_attention_bad_data_makes_that_sequence_nan():
    hq, hkv, d, page, max_pages, align = 4, 2, 32, 16, 8, 16
    c = _graph(hq, hkv, d, page, max_pages, align, torch.float32).compile("interpret", num_sms=4)
    gen = torch.Generator().manual_seed(0)
    a = _inputs([40, 50, 60, 70], hq, hkv, d, page, max_pages, torch.float32, gen)
    a["page_table"][1, 2] = 10_000  # a page outside the cache
    a["seq_lens"][2] = page * max_pages + 1  # past the page table
    a["seq_lens"][3] = 0
    out = c(**a)
    ref = decode_attention_reference(
        **{k: v[:1] if k != "k_cache" and k != "v_cache" else v for k, v in a.items()}
    )
    torch.testing.assert_close(out[0], ref[0], rtol=1e-4, atol=1e-4)
    for b in (1, 2, 3):
        assert torch.isnan(out[b]).all(), b


def test_decode_attention_compiles_for_hopper(tmp_path):
    g = _graph(32, 8, 128, 16, 2048, 64, torch.bfloat16, max_b=64)
    compile_offline(g, "static", options=f"--keep-ptx --dump-dir={tmp_path}")
    (ptx_file,) = tmp_path.glob("*.ptx")
    ptx = ptx_file.read_text()
    assert "shfl.sync.bfly" in ptx and "ex2.approx" in ptx
    # the Hopper tile: K / V by TMA into the ring, scores and P V on the tensor cores, no
    # local memory
    assert "cp.async.bulk.tensor" in ptx
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    assert "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32" in ptx
    assert ".local" not in ptx


@pytest.mark.parametrize("hq,hkv", [(32, 4), (32, 8), (16, 1)])
def test_batched_merge_loads_a_batch_of_partials_at_once(tmp_path, hq, hkv):
    """``merge_batched``: the last range reads each range's (m, l) once (a load per lane,
    reduced by shuffles) and an output vector's partials of every range as 16-byte loads with
    no branch between them (a chunk of ranges at a time), where the one-pass merge loads 4-byte
    words, a range's (m, l) again for each output."""
    from cutemk.ops.kv_split import MERGE_CHUNK

    def v4_runs(graph, d):
        compile_offline(graph, "static", options=f"--keep-ptx --dump-dir={d}")
        (ptx_file,) = d.glob("*.ptx")
        body = ptx_file.read_text()
        assert ".local" not in body
        runs, run = [], 0
        for line in body.splitlines():
            line = line.strip()
            if re.match(r"ld\.global\S*\.v4\.", line):
                run += 1
            elif re.match(r"(@\S+\s+)?bra\b", line):
                runs.append(run)
                run = 0
        return max(runs + [run])

    g = _graph(hq, hkv, 128, 16, 2048, 64, torch.bfloat16, max_b=64, merge=True)
    cfg = g.nodes[0].op.sm90()
    assert cfg is not None and cfg.merge_batched
    (tmp_path / "batched").mkdir()
    assert v4_runs(g, tmp_path / "batched") >= min(cfg.splits, MERGE_CHUNK)
    # the one-pass merge: 4-byte words
    plain = _graph(hq, hkv, 128, 16, 2048, 64, torch.bfloat16, max_b=64, merge=False)
    assert not plain.nodes[0].op.sm90().merge_batched
    (tmp_path / "plain").mkdir()
    assert v4_runs(plain, tmp_path / "plain") < min(cfg.splits, MERGE_CHUNK)


@pytest.mark.parametrize(
    "hq,hkv,page,align,d",
    [(32, 4, 8, 64, 128), (16, 16, 64, 512, 128), (8, 1, 256, 256, 128), (32, 2, 16, 64, 128)]
    + [(8, 2, 16, 64, 64), (8, 2, 32, 128, 256)],
)
def test_decode_attention_hopper_tile_shapes_compile(tmp_path, hq, hkv, page, align, d):
    """8-token pages (8 boxes a slice), pages wider than a slice, G = 8, 1 and 16, head dims
    64 and 256."""
    g = _graph(hq, hkv, d, page, 4096 // page, align, torch.bfloat16)
    assert g.nodes[0].op.ring_tile() is not None
    compile_offline(g, "dynamic", options=f"--keep-ptx --dump-dir={tmp_path}")


def test_batched_merge_refuses_splits_it_cannot_reduce():
    """``merge_batched`` with a split count that is not a power of two is refused when the op
    is built (the merge would otherwise fall back to the one-pass one unseen)."""
    from dataclasses import replace

    op = _graph(32, 4, 128, 16, 2048, 64, torch.bfloat16).nodes[0].op
    replace(op, splits=12)  # a split count the one-pass merge takes
    with pytest.raises(ValueError, match="merge_batched needs splits a power of two"):
        replace(op, splits=12, merge_batched=True)


@pytest.mark.parametrize("dtype, page", [(torch.float32, 16), (torch.bfloat16, 4)])
def test_batched_merge_refuses_shapes_without_the_hopper_tile(dtype, page):
    """``merge_batched`` is the Hopper tile's merge: where its shapes do not fit that tile (an
    fp32 cache, a page under 8 tokens) the portable tile would run its one-pass merge, so the
    switch is refused when the op is built, on any target arch."""
    with pytest.raises(ValueError, match="merge_batched is the Hopper tile's merge"):
        _graph(32, 8, 128, page, 2048, 64, dtype, merge=True)
    _graph(32, 8, 128, page, 2048, 64, dtype)  # the portable tile takes these shapes


@pytest.mark.parametrize(
    "dtype, page, splits, expect",
    [(torch.bfloat16, 16, 16, True), (torch.float16, 64, 32, True), (torch.bfloat16, 16, 12, False)]
    + [(torch.float32, 16, 16, False), (torch.bfloat16, 4, 16, False)],
)
def test_the_default_merge_is_the_batched_one_where_the_hopper_tile_takes_it(
    dtype, page, splits, expect
):
    """``merge_batched=None`` (the default) is the two-step merge wherever the Hopper tile runs
    and the split count fits it (a power of two up to 32), and the one-pass merge elsewhere (a
    split of 12, an fp32 cache, 4-token pages): never a refusal."""
    g = mk.Graph("decode_attention")
    B = mk.sym("B", min=1, max=8)
    q = g.input("q", (B, 32, 128), dtype)
    k = g.input("k_cache", (mk.sym("P", min=1, max=1 << 16), page, 8, 128), dtype)
    v = g.input("v_cache", (k.spec.shape[0], page, 8, 128), dtype)
    pt = g.input("page_table", (B, 4096 // page), torch.int32)
    lens = g.input("seq_lens", (B,), torch.int32)
    g.call(ops.attention_decode, q, k, v, pt, lens, splits=splits)
    op = g.nodes[0].op
    assert op.merge_batched is None and op.batched_merge is expect
    cfg = op._sm90_config()
    assert (cfg is not None and cfg.merge_batched) == expect
    # the field keeps None: a copy with a split the two-step merge cannot reduce decides again
    assert replace(op, splits=12).batched_merge is False


def test_hopper_tile_config():
    from cutemk.ops.attention_decode_sm90 import sm90_decode_config

    policy = (8, 16, 264, 64)  # kv heads, splits, target tiles, align
    cfg = sm90_decode_config(torch.bfloat16, 4, 128, 16, *policy, 8192, 128**-0.5)
    assert (cfg.slice_tokens, cfg.box_rows, cfg.boxes, cfg.slices) == (64, 16, 4, 128)
    assert cfg.tx_bytes == cfg.slot_bytes == 2 * 64 * 128 * 2  # K and V rows of a slice
    wide = sm90_decode_config(torch.bfloat16, 4, 128, 16, 8, 16, 264, 128, 8192, 1.0)
    assert (wide.slice_tokens, wide.boxes, wide.rows_per_warp, wide.halves) == (128, 8, 16, 2)
    # shapes the tile does not take fall back to the portable tile
    for args, align in [
        ((torch.float32, 4, 128, 16), 64),  # a 32-bit cache
        ((torch.bfloat16, 4, 96, 16), 64),  # head dim not a multiple of 64
        ((torch.bfloat16, 4, 128, 12), 64),  # page not a power of two
        ((torch.bfloat16, 4, 128, 16), 96),  # ranges not a multiple of the slice
        ((torch.bfloat16, 4, 128, 4), 64),  # a page below one 8-row swizzle atom
        ((torch.bfloat16, 32, 64, 16), 64),  # more query heads than the mma's 16 rows
        ((torch.bfloat16, 16, 256, 16), 64),  # o's accumulators past the registers
    ]:
        assert sm90_decode_config(*args, 8, 16, 264, align, 8192, 1.0) is None, args


@pytest.mark.gpu
@pytest.mark.parametrize(
    "scheduler,align,early,epi",
    [
        ("static", 64, "0", "0"),
        ("dynamic", 64, "0", "0"),
        ("static", 128, "1", "0"),
        ("static", 64, "1", "0"),
        ("dynamic", 64, "1", "0"),
        ("static", 64, "1", "1"),
        ("dynamic", 64, "1", "1"),
    ],
)
def test_decode_attention_on_the_gpu(scheduler, align, early, epi, monkeypatch):
    """align 128: ranges of 128-token slices (64 KB ring slots). early:
    ``CUTEMK_EARLY_HANDOVER`` (tasks without events handed over before their loads). epi:
    ``CUTEMK_EPI_MBARRIER`` (the staging buffer released by an mbarrier)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setenv("CUTEMK_EARLY_HANDOVER", early)
    monkeypatch.setenv("CUTEMK_EPI_MBARRIER", epi)
    hq, hkv, d, page, max_pages = 32, 8, 128, 16, 2048
    c = _graph(hq, hkv, d, page, max_pages, align, torch.bfloat16, max_b=64).compile(
        "cute", scheduler=scheduler, watchdog=True, poison_outputs=True
    )
    gen = torch.Generator().manual_seed(1)
    # one sequence (16 ranges), 3 (11), 16 (2), 40 of varied lengths (one range: no merge)
    varied = [1000 + 37 * i for i in range(40)]
    for lens in ([1], [7, 129, 4097], [8192], [32768], [4096] * 16, varied):
        a = _inputs(lens, hq, hkv, d, page, max_pages, torch.bfloat16, gen, "cuda")
        out = c(**a)
        ref = decode_attention_reference(**a)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (lens, err)
        assert torch.equal(c(**a), out)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "hq,hkv,d,page,align",
    [(16, 2, 128, 64, 64), (32, 2, 128, 8, 64), (8, 8, 128, 256, 256), (8, 2, 64, 16, 64)]
    + [(16, 4, 256, 32, 128), (12, 4, 128, 16, 64)],
)
def test_decode_attention_tile_shapes_on_the_gpu(hq, hkv, d, page, align):
    _tile_shapes_on_the_gpu(hq, hkv, d, page, align)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv", [(32, 4), (32, 8), (16, 1), (12, 4)])
def test_batched_merge_on_the_gpu(hq, hkv):
    """``merge_batched``: every case right against the fp32 reference and bit-identical to the
    one-pass merge (same factors, same order of the sums)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    d, page, max_pages = 128, 16, 2048
    one, two = (
        _graph(hq, hkv, d, page, max_pages, 64, torch.bfloat16, max_b=16, merge=m).compile(
            "cute", scheduler="static", watchdog=True, poison_outputs=True
        )
        for m in (False, True)
    )
    assert two.graph.nodes[0].op.sm90().merge_batched  # not the one-pass merge twice
    gen = torch.Generator().manual_seed(4)
    for lens in ([1], [4096], [7, 129, 4097], [8192], [32768], [2000] * 16):
        a = _inputs(lens, hq, hkv, d, page, max_pages, torch.bfloat16, gen, "cuda")
        out = two(**a)
        ref = decode_attention_reference(**a)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (lens, err)
        assert torch.equal(out, one(**a)), lens


def _tile_shapes_on_the_gpu(hq, hkv, d, page, align):
    """The tensor-core tile's other shapes: G = 8, 16, 1 and 3 query heads a KV head, head
    dims 64 and 256, pages of 8 to 256 tokens, 128-token slices."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    max_pages = 8192 // page
    g = _graph(hq, hkv, d, page, max_pages, align, torch.bfloat16, max_b=8)
    assert g.nodes[0].op.ring_tile() is not None  # the Hopper tile, not the portable one
    c = g.compile("cute", scheduler="static", watchdog=True, poison_outputs=True)
    gen = torch.Generator().manual_seed(2)
    for lens in ([1], [7, 129, 4097], [8192], [300] * 8):
        a = _inputs(lens, hq, hkv, d, page, max_pages, torch.bfloat16, gen, "cuda")
        out = c(**a)
        ref = decode_attention_reference(**a)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (lens, err)


def test_the_merge_count_is_the_ops_own():
    """``merges`` starts at zero and no other node may read it (its values are the op's)."""
    from cutemk.errors import GraphError

    g = _graph(4, 2, 32, 16, 8, 16, torch.float32)
    merges = g.nodes[0].results["merges"]
    with pytest.raises(GraphError, match="own counter"):
        g.call(ops.silu_mul, merges)


def test_a_counter_left_non_zero_is_reported():
    """The interpreter checks what the GPU relies on: an op's own counters end every launch at
    zero (here a stand-in whose last range forgets to reset it)."""
    from dataclasses import dataclass, fields

    from cutemk.errors import CuteMKError
    from cutemk.ops.attention_decode import AttentionDecodeTile
    from cutemk.tileop import register_op

    @register_op
    @dataclass(frozen=True)
    class NoReset(AttentionDecodeTile):
        name = "attention_no_reset"

        def reference(self, coord, env, t):
            before = t["merges"].clone()
            super().reference(coord, env, t)
            b, h = coord[0], self._heads(coord, env)[1]
            if t["merges"][b, h] == 0 and before[b, h] > 0:  # it merged: undo the reset
                t["merges"][b, h] = before[b, h] + 1

    g = _graph(4, 2, 32, 16, 8, 16, torch.float32)
    node = g.nodes[0]
    object.__setattr__(
        node, "op", NoReset(**{f.name: getattr(node.op, f.name) for f in fields(node.op)})
    )
    c = g.compile("interpret", num_sms=4)
    a = _inputs([100, 7], 4, 2, 32, 16, 8, torch.float32, torch.Generator().manual_seed(0))
    with pytest.raises(CuteMKError, match="non-zero"):
        c(**a)


@pytest.mark.gpu
@pytest.mark.parametrize("merge", [False, True], ids=["one_pass", "batched_merge"])
@pytest.mark.parametrize("lens", [[4096, 4096, 4096, 4096, 1000], [300, 300, 300, 300, 300]])
def test_decode_attention_bad_pages_on_the_gpu(lens, merge):
    """The Hopper tile's page checks (the consumer warps take turns, each checking a slice's
    page ids at its next turn or after the last slice): a page id outside the cache in a
    sequence's first, a middle and its last page makes that sequence NaN and leaves the
    others right; long ranges (4096 tokens in 6 ranges of 704: 11 slices, two turns for
    some warps) and short ones (300 tokens in 5 ranges of one slice: every check after the
    loop). Both merges: a poisoned range's NaN must survive either."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    hq, hkv, d, page, max_pages = 32, 8, 128, 16, 2048
    g = _graph(hq, hkv, d, page, max_pages, 64, torch.bfloat16, max_b=8, merge=merge)
    assert g.nodes[0].op.sm90().merge_batched == merge
    c = g.compile("cute", scheduler="static", watchdog=True, poison_outputs=True)
    gen = torch.Generator().manual_seed(7)
    a = _inputs(lens, hq, hkv, d, page, max_pages, torch.bfloat16, gen, "cuda")
    total = a["k_cache"].shape[0]
    a["page_table"][0, 0] = total  # past the cache
    a["page_table"][1, lens[1] // page // 2] = -5
    a["page_table"][2, (lens[2] - 1) // page] = 1 << 20
    out = c(**a)
    good = [3, 4]
    ref = decode_attention_reference(**{k: (v if "cache" in k else v[good]) for k, v in a.items()})
    err = ((out[good].float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err
    for b in (0, 1, 2):
        assert torch.isnan(out[b]).all(), b
