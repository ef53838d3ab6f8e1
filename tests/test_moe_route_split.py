"""The routing spread over SMs (moe_route_count / _layout / _place) gives moe_route's layout
element for element, in one graph next to moe_route: on the interpreter (CPU, with its race
checker) and on the GPU (both schedulers), over random routings, one hot expert, empty experts,
-1 ("no expert") ids, repeated ids within a token, and ids out of range (the device drops them;
the interpreter refuses them). CPU CI also compiles the three ops for sm_90a."""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest
import torch

import cutemk as mk
from cutemk import ops
from cutemk.errors import DataError
from cutemk.runtime import compile_offline

OUTS = ("tile_info", "row_token", "slot_row", "exp_indptr")


def _graph(
    num_e: int, k: int, block_m: int, chunk: int, max_t: int, distinct: bool = False
) -> mk.Graph:
    g = mk.Graph("route_split")
    ids = g.input("ids", (mk.sym("T", min=1, max=max_t), k), torch.int32)
    single = g.call(ops.moe_route, ids, num_experts=num_e, block_m=block_m, distinct_ids=distinct)
    counts = g.call(ops.moe_route_count, ids, num_experts=num_e, chunk=chunk)
    tile_info, indptr, base = g.call(
        ops.moe_route_layout,
        counts,
        num_experts=num_e,
        block_m=block_m,
        tokens=ids.spec.shape[0],
        top_k=k,
    )
    row_token, slot_row = g.call(
        ops.moe_route_place, ids, base, tile_info, num_experts=num_e, block_m=block_m, chunk=chunk
    )
    for name, v in zip(OUTS, single):
        g.output(v, f"single_{name}")
    for name, v in zip(OUTS, (tile_info, row_token, slot_row, indptr)):
        g.output(v, f"split_{name}")
    return g


def _ids(t: int, k: int, num_e: int, kind: str, gen: torch.Generator, device="cpu"):
    if kind == "random":  # distinct per token, as top-k gives
        ids = torch.rand(t, num_e, generator=gen).argsort(dim=1)[:, :k]
    elif kind == "one_hot":  # every token's first pick is expert 3, the rest random
        ids = torch.rand(t, num_e, generator=gen).argsort(dim=1)[:, :k]
        ids[:, 0] = 3
        ids[:, 1:] = torch.where(ids[:, 1:] == 3, 0, ids[:, 1:])
    elif kind == "few_experts":  # most experts empty, ids repeated within a token
        ids = torch.randint(0, min(3, num_e), (t, k), generator=gen)
    elif kind == "none":  # some slots have no expert
        ids = torch.rand(t, num_e, generator=gen).argsort(dim=1)[:, :k]
        drop = torch.rand(t, k, generator=gen) < 0.3
        ids = torch.where(drop, -1, ids)
    else:
        raise ValueError(kind)
    return ids.to(torch.int32).to(device)


def _named(compiled, out: tuple) -> dict:
    return {v.name: o for v, o in zip(compiled.graph.outputs, out)}


def _check_same(out: dict, what: str) -> None:
    for name in OUTS:
        a, b = out[f"single_{name}"], out[f"split_{name}"]
        assert torch.equal(a.cpu(), b.cpu()), f"{what}: {name} differs"


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_split_route_matches_moe_route_interpreted(chunk):
    num_e, k, bm = 8, 3, 4
    c = _graph(num_e, k, bm, chunk, max_t=200).compile("interpret")
    gen = torch.Generator().manual_seed(chunk)
    for kind in ("random", "one_hot", "few_experts", "none"):
        for t in (1, 7, 64, 129, 200):
            out = c(_ids(t, k, num_e, kind, gen))
            out = _named(c, out)
            _check_same(out, f"{kind} T={t} chunk={chunk}")


def test_split_route_refuses_ids_out_of_range_interpreted():
    c = _graph(8, 2, 4, 16, max_t=64).compile("interpret")
    ids = _ids(40, 2, 8, "random", torch.Generator().manual_seed(0))
    ids[33, 1] = 8
    with pytest.raises(DataError, match=r"ids\[33, 1\]"):
        c(ids)


def test_split_route_parts_must_agree():
    """The layout's token count and top-k size tile_info, and the place op reads one chunk_base
    row per chunk: a mismatch with the counted ids would write or read past a buffer on the
    device, so the graph refuses it when built."""
    from cutemk.errors import ShapeError

    T = mk.sym("T", min=1, max=100)
    g = mk.Graph("mismatch")
    ids = g.input("ids", (T, 2), torch.int32)
    counts = g.call(ops.moe_route_count, ids, num_experts=8, chunk=16)
    layout = dict(num_experts=8, block_m=4, top_k=2)
    tile_info, _, base = g.call(ops.moe_route_layout, counts, tokens=T, **layout)
    with pytest.raises(ShapeError, match="chunk_base rows"):
        g.call(ops.moe_route_place, ids, base, tile_info, num_experts=8, block_m=4, chunk=8)
    for bad in (dict(tokens=T // 2, top_k=2), dict(tokens=T, top_k=1)):
        h = mk.Graph("mismatch2")
        ids2 = h.input("ids", (T, 2), torch.int32)
        c2 = h.call(ops.moe_route_count, ids2, num_experts=8, chunk=16)
        ti, _, b2 = h.call(ops.moe_route_layout, c2, num_experts=8, block_m=4, **bad)
        rt, sr = h.call(ops.moe_route_place, ids2, b2, ti, num_experts=8, block_m=4, chunk=16)
        h.output(rt, "row_token")
        h.output(sr, "slot_row")
        with pytest.raises(ShapeError, match="moe_route_layout"):
            h.validate()


def test_split_route_compiles_for_hopper(tmp_path):
    g = mk.Graph("route_split_only")
    ids = g.input("ids", (mk.sym("T", min=1, max=4096), 8), torch.int32)
    counts = g.call(ops.moe_route_count, ids, num_experts=128, chunk=128)
    tile_info, _, base = g.call(
        ops.moe_route_layout,
        counts,
        num_experts=128,
        block_m=128,
        tokens=ids.spec.shape[0],
        top_k=8,
    )
    row_token, slot_row = g.call(
        ops.moe_route_place, ids, base, tile_info, num_experts=128, block_m=128, chunk=128
    )
    g.output(row_token, "row_token")
    g.output(slot_row, "slot_row")
    compile_offline(g, "static", options=f"--keep-ptx --dump-dir={tmp_path}")
    (ptx_file,) = tmp_path.glob("*.ptx")
    ptx = ptx_file.read_text()
    assert "match.any.sync.b32" in ptx
    assert "atom.shared" not in ptx  # ranks come from the warp match, not atomics


@pytest.mark.gpu
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_split_route_matches_moe_route_on_the_gpu(scheduler):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gen = torch.Generator().manual_seed(7)
    # E=512 (Qwen3-Next): moe_route fits its shared memory only with 16-bit counters, which
    # need distinct ids, so that case leaves out the repeated ids
    for num_e, k, bm, chunk, distinct in (
        (128, 8, 128, 64, False),
        (512, 10, 64, 64, True),
        (16, 4, 64, 32, False),
    ):
        c = _graph(num_e, k, bm, chunk, 4096, distinct).compile("cute", scheduler=scheduler)
        kinds = ("random", "one_hot", "none") + (() if distinct else ("few_experts",))
        for kind in kinds:
            for t in (1, 7, 129, 1000, 4096):
                ids = _ids(t, k, num_e, kind, gen, "cuda")
                out = c(ids)
                out = _named(c, out)
                _check_same(out, f"E={num_e} {kind} T={t}")
        # ids out of range: both layouts drop them (slot_row -1), and agree
        ids = _ids(333, k, num_e, "random", gen, "cuda")
        ids[5, 0], ids[300, k - 1], ids[17, 1] = num_e, -7, 2**30
        out = c(ids)
        out = _named(c, out)
        _check_same(out, f"E={num_e} bad ids")
        assert int(out["split_slot_row"][5, 0]) == -1 and int(out["split_slot_row"][17, 1]) == -1
