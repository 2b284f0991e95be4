"""dtl.flat: one buffer, a view per tensor, padding to the world size, and which rank owns what."""

import pytest
import torch

from dtl.flat import FlatBuffer, padded_size


def test_views_alias_the_flat_buffer_in_order():
    tensors = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 2, 2)]
    buf = FlatBuffer.of(tensors)
    assert buf.numel == 25 and buf.padding == 0 and buf.offsets == [0, 12, 17]
    for view, t in zip(buf.views, tensors):
        assert torch.equal(view, t) and view.data_ptr() >= buf.data.data_ptr()
    buf.data.zero_()  # writing the buffer writes every view: they share storage
    assert all(v.abs().sum() == 0 for v in buf.views)
    out = [torch.ones_like(t) for t in tensors]
    buf.views[1].fill_(7.0)
    buf.copy_to(out)
    assert torch.equal(out[1], torch.full((5,), 7.0)) and out[0].abs().sum() == 0


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_shards_are_equal_padded_slices_that_cover_every_element_once(world):
    shapes = [(7, 3), (5,), (11,), (2, 3)]  # 43 elements: never a multiple of 2, 3, 4 or 8
    buf = FlatBuffer(shapes, pad_to=world)
    assert buf.data.numel() == padded_size(43, world) and buf.data.numel() % world == 0
    owned = [torch.zeros(s).flatten() for s in shapes]
    for rank in range(world):
        shard = buf.shard(rank, world)
        assert shard.numel() == buf.data.numel() // world
        shard.fill_(rank + 1)  # a view: lands in the buffer
        for piece in buf.shard_ranges(rank, world):
            owned[piece.index][piece.start : piece.end] += 1
            got = shard[piece.offset : piece.offset + piece.end - piece.start]
            assert torch.equal(got, buf.views[piece.index].flatten()[piece.start : piece.end])
    assert all(torch.equal(o, torch.ones_like(o)) for o in owned)  # each element: one owner
    if world == 4:  # 44 elements, 11 per rank: tensor 0 (21 elements) straddles ranks 0 and 1
        assert [(p.index, p.start, p.end) for p in buf.shard_ranges(1, 4)] == [
            (0, 11, 21),
            (1, 0, 1),
        ]


def test_a_buffer_not_padded_for_the_world_size_refuses_to_shard():
    buf = FlatBuffer([(5,)], pad_to=1)
    with pytest.raises(
        ValueError, match="cannot be split evenly over 2 ranks: build it with pad_to=2"
    ):
        buf.shard(0, 2)
    assert padded_size(5, 4) == 8 and padded_size(8, 4) == 8
