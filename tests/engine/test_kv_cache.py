"""Paged KV cache: block accounting, and a batched forward through the paged view equals plain
full-sequence forwards, whatever mix of cached and new tokens each row has."""

import pytest
import torch

from reclaim.engine.kv_cache import BlockManager, KVPool


def test_block_manager_allocates_grows_and_frees():
    bm = BlockManager(num_blocks=5, block_size=4)
    assert bm.allocate("a", 5) and bm.tables["a"].__len__() == 2
    assert bm.allocate("a", 8) and len(bm.tables["a"]) == 2  # still fits
    assert bm.allocate("b", 9) and bm.num_used == 5 and bm.num_free == 0
    assert not bm.allocate("a", 9)  # needs one more block: refused without side effects
    assert len(bm.tables["a"]) == 2 and bm.num_free == 0
    assert len(set(bm.tables["a"]) | set(bm.tables["b"])) == 5  # no block handed out twice
    bm.free("a")
    assert bm.num_free == 2 and "a" not in bm.tables
    bm.free("a")  # freeing twice is harmless and does not duplicate blocks
    assert bm.num_free == 2
    bm.free("b")
    assert bm.num_free == 5


def test_block_manager_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks=0"):
        BlockManager(0, 16)


def _pool_for(model, num_blocks, block_size):
    c = model.config
    return KVPool(c.num_hidden_layers, num_blocks, block_size, c.num_key_value_heads, c.head_dim)


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_mixed_batch_through_paged_view_equals_full_forward(tiny, block_size):
    ours, _ = tiny
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(2, 96, (n,), generator=g).tolist() for n in (7, 12, 4)]
    cached = [5, 0, 3]  # tokens already in the cache per row; the rest are new this forward
    pool = _pool_for(ours, 64, block_size)
    bm = BlockManager(64, block_size)
    with torch.inference_mode():
        for i, (s, c) in enumerate(zip(seqs, cached)):  # prefill each row's cached part on its own
            bm.allocate(str(i), len(s))
            if c:
                view = pool.view([bm.tables[str(i)]], [0], [c])
                ours(view.pack([s[:c]]), view.positions, view)
        new = [len(s) - c for s, c in zip(seqs, cached)]
        view = pool.view([bm.tables[str(i)] for i in range(3)], cached, new)
        got = view.split(ours(view.pack([s[c:] for s, c in zip(seqs, cached)]), view.positions, view).logits)
        for i, (s, c) in enumerate(zip(seqs, cached)):
            want = ours(torch.tensor([s])).logits[0, c:]
            torch.testing.assert_close(got[i], want, atol=1e-5, rtol=1e-5)


def test_view_rejects_tables_too_short(tiny):
    pool = _pool_for(tiny[0], 4, 4)
    with pytest.raises(ValueError, match="too short"):
        pool.view([[0]], [3], [2])
