"""BlockPool (vt/engine/kv_blocks.py): reference counts, cached prefixes, LRU eviction, and
the fence that keeps a released block from reuse until the step that may read it is seen
complete."""
import numpy as np

from vt.engine.kv_blocks import BlockPool, block_hashes, root_hash

BS = 4
ROOT = root_hash(0, BS)


def _named(pool, blocks, prompt):
    """Register the full blocks of `prompt` held as `blocks`; returns its hashes."""
    hs = block_hashes(prompt, BS, ROOT)
    for i, h in enumerate(hs):
        pool.register(blocks[i], h, prompt[i * BS:(i + 1) * BS].tobytes())
    return hs


def test_chained_hashes_depend_on_every_earlier_block_and_the_root():
    a = np.arange(12, dtype=np.int32)
    b = a.copy()
    b[0] = 99
    ha, hb = block_hashes(a, BS, ROOT), block_hashes(b, BS, ROOT)
    assert len(ha) == 3 and len(block_hashes(a[:11], BS, ROOT)) == 2   # the partial block: none
    assert all(x != y for x, y in zip(ha, hb))    # a change in block 0 renames every later one
    assert block_hashes(a, BS, root_hash(1, BS)) != ha   # another model: other names


def test_released_block_is_fenced_until_its_step_completes():
    pool = BlockPool(5, 0)
    got = pool.alloc(4)
    assert pool.available == 0
    pool.release(got[:2], step=7)
    assert pool.free_count == 2 and pool.available == 0 and pool.alloc(1) is None
    pool.complete(6)
    assert pool.available == 0
    pool.complete(7)
    assert pool.available == 2 and sorted(pool.alloc(2)) == sorted(got[:2])


def test_release_after_its_step_completed_is_reusable_at_once():
    pool = BlockPool(5, 0)
    pool.complete(3)
    got = pool.alloc(2)
    pool.release(got, step=3)
    assert pool.available == 4


def test_without_the_fence_a_released_block_is_reusable_at_once():
    pool = BlockPool(5, 0, fenced=False)
    got = pool.alloc(4)
    pool.release(got, step=7)
    assert pool.available == 4


def test_shared_block_is_reusable_only_when_its_last_holder_releases_it():
    pool = BlockPool(5, 0)
    prompt = np.arange(9, dtype=np.int32)
    a = pool.alloc(3)
    hs = _named(pool, a, prompt)
    hits = pool.match(hs, prompt, BS, limit=2)
    assert hits == a[:2]
    pool.take(hits)
    pool.release(a, step=0)
    pool.complete(0)
    assert pool.free_count == 4 - 2 and pool.evictable_count == 0   # still held by the second
    pool.release(hits, step=1)
    pool.complete(1)
    assert pool.free_count == 4 and pool.evictable_count == 2 and pool.cached_count == 2


def test_eviction_takes_free_blocks_first_then_the_least_recently_released():
    pool = BlockPool(7, 0)
    p1, p2 = np.arange(8, dtype=np.int32), np.arange(8, 16, dtype=np.int32)
    a, b = pool.alloc(2), pool.alloc(2)
    _named(pool, a, p1)
    _named(pool, b, p2)
    pool.release(a, step=0)
    pool.release(b, step=0)
    pool.complete(0)
    assert pool.evictable_count == 4 and pool.available == 6
    first = pool.alloc(2)            # the two never-cached blocks
    assert set(first).isdisjoint(a + b) and pool.stats.evictions == 0
    one = pool.alloc(1)              # then the LRU head: a's tail block (released first, tail first)
    assert one == [a[1]] and pool.stats.evictions == 1
    assert pool.match(block_hashes(p1, BS, ROOT), p1, BS, 2) == [a[0]]   # its chain now stops at a[0]
    assert pool.match(block_hashes(p2, BS, ROOT), p2, BS, 2) == b


def test_a_hit_moves_a_cached_block_out_of_eviction_order():
    pool = BlockPool(4, 0)
    p = np.arange(4, dtype=np.int32)
    a = pool.alloc(1)
    hs = _named(pool, a, p)
    pool.release(a, step=0)
    pool.complete(0)
    pool.take(pool.match(hs, p, BS, 1))
    assert pool.alloc(3) is None and pool.available == 2


def test_a_hash_collision_is_a_miss():
    pool = BlockPool(4, 0)
    p, q = np.arange(4, dtype=np.int32), np.arange(4, 8, dtype=np.int32)
    a = pool.alloc(1)
    hs = _named(pool, a, p)
    assert pool.match(hs, q, BS, 1) == []    # q's tokens under p's name: refused


def test_a_second_block_with_a_cached_name_stays_unnamed():
    pool = BlockPool(4, 0)
    p = np.arange(4, dtype=np.int32)
    a, b = pool.alloc(1), pool.alloc(1)
    _named(pool, a, p)
    _named(pool, b, p)
    assert pool.cached_count == 1
    pool.release(b, step=0)
    pool.complete(0)
    assert pool.evictable_count == 0 and pool.available == 2   # b went back free, unnamed


def test_a_fenced_block_hit_and_released_again_waits_for_the_later_fence():
    pool = BlockPool(3, 0)
    p = np.arange(4, dtype=np.int32)
    a = pool.alloc(1)
    hs = _named(pool, a, p)
    pool.release(a, step=5)
    pool.take(pool.match(hs, p, BS, 1))   # hit while fenced: held again
    pool.release(a, step=6)
    pool.complete(5)
    assert pool.evictable_count == 1 and pool.available == 1   # the other block only
    pool.complete(6)
    assert pool.available == 2


def test_on_reuse_sees_every_block_an_allocation_hands_out():
    seen = []
    pool = BlockPool(4, 0, on_reuse=seen.append)
    got = pool.alloc(2)
    assert seen == [got]


def test_a_fenced_block_named_after_release_becomes_evictable_with_its_name():
    """Decode blocks are named when their tokens are known, after the request released them:
    a fenced block takes the name and, once its fence lifts, is a cached prefix (evictable),
    not a free block."""
    pool = BlockPool(6, 0)
    got = pool.alloc(3)
    seq = np.arange(12, dtype=np.int32)
    pool.release(got, step=4)
    hs = _named(pool, got, seq)
    pool.complete(4)
    assert pool.cached_count == 3 and pool.evictable_count == 3
    assert pool.match(hs, seq, BS, 3) == got


def test_a_reusable_block_is_not_named():
    """Once a released block is reusable an allocation may hand it out and another sequence
    may write it: naming it then would serve that sequence's KV as this one's prefix."""
    pool = BlockPool(3, 0)
    got = pool.alloc(2)
    pool.release(got, step=1)
    pool.complete(1)
    seq = np.arange(8, dtype=np.int32)
    hs = _named(pool, got, seq)
    assert pool.cached_count == 0 and pool.match(hs, seq, BS, 2) == []
    again = pool.alloc(2)          # another owner now: the name must not point at them
    assert sorted(again) == sorted(got) and pool.match(hs, seq, BS, 2) == []


def test_block_hashes_of_a_longer_sequence_continue_the_prompts_chain():
    prompt = np.arange(9, dtype=np.int32)
    seq = np.arange(17, dtype=np.int32)
    hp = block_hashes(prompt, BS, ROOT)
    assert hp + block_hashes(seq, BS, hp[-1], first=len(hp)) == block_hashes(seq, BS, ROOT)
