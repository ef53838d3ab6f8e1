"""Device-side views of other ranks' copies of a symmetric value (distributed graphs)."""

from __future__ import annotations

from cutlass import Int32, cute


def peer_tensors(mPeers: cute.Tensor, like: cute.Tensor, world: int) -> tuple[Int32, list]:
    """``(rank, [rank q's copy of like for q in range(world)])`` from a peer table ``mPeers``
    (int64 ``[rank, addr_0, ..., addr_{W-1}]``); every copy has ``like``'s layout (symmetric
    values have the same shape on every rank). Plain Python: inlined where it is called."""
    views = [
        cute.make_tensor(
            cute.make_ptr(
                like.element_type, mPeers[1 + q], cute.AddressSpace.gmem, assumed_align=16
            ),
            like.layout,
        )
        for q in range(world)
    ]
    return Int32(mPeers[0]), views
