"""contract.chunks: the recycled buffers chunk reads and decodes go through."""

import numpy as np

from dspark_precompute.contract.chunks import BufferPool


def test_a_buffer_still_referenced_through_any_view_is_never_handed_out_again():
    pool = BufferPool()
    a = pool.take(1000)
    a[:] = 7
    held = a.view(np.uint16).reshape(10, 50)  # a decoded chunk is a view of a view
    del a
    b = pool.take(1000)
    b[:] = 9
    assert (held == 0x0707).all()
    assert not np.shares_memory(held, b)


def test_a_buffer_let_go_is_reused_for_the_next_read_of_its_size_class():
    pool = BufferPool()
    a = pool.take(3000)
    address = a.__array_interface__["data"][0]
    del a
    b = pool.take(4096)  # the same power-of-two class
    assert b.__array_interface__["data"][0] == address and len(b) == 4096
    c = pool.take(3000)  # b is still held: a fresh buffer
    assert c.__array_interface__["data"][0] != address


def test_the_pool_keeps_no_more_than_its_budget_and_still_hands_out_fresh_buffers_beyond_it():
    pool = BufferPool(max_bytes=8192)
    held = [pool.take(4096) for _ in range(5)]
    assert pool.nbytes == 8192 and all(len(h) == 4096 for h in held)
    assert len({h.__array_interface__["data"][0] for h in held}) == 5
    pool.clear()
    assert pool.nbytes == 0
