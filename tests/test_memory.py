"""KV memory: page-granular slots in req_to_token, reuse after release, refusals never corrupt."""

import pytest
import torch

from dsaspec.configs.model_config import get_config
from dsaspec.memory import (PAGE_SIZE, SINK_SLOT, ContextLengthError, KVPool, PageAllocator,
                                    PoolExhaustedError, ReqToTokenPool, RequestSlots)


def test_table_shape_and_dummy_row():
    pool = ReqToTokenPool(5, 1000, num_draft_tokens=6)
    assert pool.req_to_token.shape == (6, 1000 + 4 + 6) and pool.req_to_token.dtype == torch.int32
    assert pool.width == 1010 and pool.dummy_row == 5
    assert (pool.req_to_token == SINK_SLOT).all()


@pytest.mark.parametrize("prompt_len", [1, 63, 64, 65, 127, 128, 129])
def test_slots_follow_positions_within_pages(prompt_len):
    pool = ReqToTokenPool(2, 300, 1)
    slots = RequestSlots(pool, PageAllocator(8 * PAGE_SIZE))
    row = slots.admit(prompt_len)
    pages = -(-prompt_len // PAGE_SIZE)
    assert slots.allocated_len(row) == pages * PAGE_SIZE
    table = pool.req_to_token[row, : pages * PAGE_SIZE].long()
    positions = torch.arange(pages * PAGE_SIZE)
    assert (table % PAGE_SIZE == positions % PAGE_SIZE).all()
    assert (table // PAGE_SIZE != 0).all()                      # the sink page is never handed out
    page_starts = table[::PAGE_SIZE] // PAGE_SIZE
    assert (table // PAGE_SIZE == page_starts.repeat_interleave(PAGE_SIZE)).all()
    assert (pool.req_to_token[row, pages * PAGE_SIZE:] == SINK_SLOT).all()


def test_extend_adds_whole_pages_and_requests_do_not_share_slots():
    pool = ReqToTokenPool(3, 400, 1)
    slots = RequestSlots(pool, PageAllocator(10 * PAGE_SIZE))
    a, b = slots.admit(10), slots.admit(70)
    slots.extend(a, 64)                      # still one page
    assert slots.allocated_len(a) == 64
    slots.extend(a, 65)
    assert slots.allocated_len(a) == 128
    used_a = set(pool.req_to_token[a, :128].tolist())
    used_b = set(pool.req_to_token[b, :128].tolist())
    assert len(used_a) == 128 and len(used_b) == 128 and not used_a & used_b


def test_release_frees_pages_and_row_for_reuse():
    pool = ReqToTokenPool(1, 300, 1)
    allocator = PageAllocator(4 * PAGE_SIZE)
    slots = RequestSlots(pool, allocator)
    row = slots.admit(150)
    assert allocator.num_free_pages == 0 and pool.num_free == 0
    slots.release(row)
    assert allocator.num_free_pages == 3 and pool.num_free == 1
    assert (pool.req_to_token[row] == SINK_SLOT).all()
    assert slots.admit(190) == row
    with pytest.raises(ValueError, match="not an admitted request"):
        slots.release(row + 1 if row == 0 else 0)


def test_full_pool_is_a_clear_error_and_changes_nothing():
    pool = ReqToTokenPool(4, 1000, 1)
    allocator = PageAllocator(4 * PAGE_SIZE)            # 3 usable pages
    slots = RequestSlots(pool, allocator)
    row = slots.admit(100)                              # 2 pages
    table_before = pool.req_to_token.clone()
    with pytest.raises(PoolExhaustedError, match="KV pool full"):
        slots.admit(129)                                # needs 3 pages, 1 free
    with pytest.raises(PoolExhaustedError, match="KV pool full"):
        slots.extend(row, 193)                          # needs 2 more pages
    assert torch.equal(pool.req_to_token, table_before)
    assert allocator.num_free_pages == 1 and pool.num_free == 3
    slots.extend(row, 192)                              # exactly the last page still works
    assert allocator.num_free_pages == 0


def test_no_free_request_row_is_a_clear_error():
    pool = ReqToTokenPool(1, 100, 1)
    slots = RequestSlots(pool, PageAllocator(8 * PAGE_SIZE))
    slots.admit(5)
    with pytest.raises(PoolExhaustedError, match="request rows are in use"):
        slots.admit(5)
    assert slots.allocator.num_free_pages == 6


def test_prompt_longer_than_context_is_refused():
    pool = ReqToTokenPool(2, 100, num_draft_tokens=4)
    slots = RequestSlots(pool, PageAllocator(8 * PAGE_SIZE))
    with pytest.raises(ContextLengthError, match="prompt of 101 tokens exceeds context_len=100"):
        slots.admit(101)
    assert pool.num_free == 2 and slots.allocator.num_free_pages == 7
    row = slots.admit(100, reserve=50)                  # reserve is capped at the table width
    assert slots.allocated_len(row) == pool.width == 108
    with pytest.raises(ContextLengthError, match="exceed the req_to_token width 108"):
        slots.extend(row, 109)


def test_allocator_rejects_bad_frees_and_sizes():
    allocator = PageAllocator(3 * PAGE_SIZE)
    pages = allocator.alloc(2)
    allocator.free(pages[:1])
    for bad in ([0], [pages[0]], [3]):
        with pytest.raises(ValueError, match="not an allocated page"):
            allocator.free(bad)
    with pytest.raises(ValueError, match="multiple of page_size"):
        PageAllocator(100)
    with pytest.raises(ValueError, match="ReqToTokenPool max_reqs: expected >= 1, got 0"):
        ReqToTokenPool(0, 100)


@pytest.mark.parametrize("call, error, message", [
    (lambda: ReqToTokenPool(2, 100.0), TypeError, r"ReqToTokenPool context_len: expected an int, got 100.0"),
    (lambda: ReqToTokenPool(2, 100, num_draft_tokens=-1), ValueError, "num_draft_tokens: expected >= 1, got -1"),
    (lambda: PageAllocator(-128), ValueError, "PageAllocator num_slots: expected >= 1, got -128"),
    (lambda: PageAllocator(128.0), TypeError, r"PageAllocator num_slots: expected an int, got 128.0 \(float\)"),
    (lambda: PageAllocator(128, page_size=64.0), TypeError, "PageAllocator page_size: expected an int"),
    (lambda: PageAllocator(128, page_size=0), ValueError, "PageAllocator page_size: expected >= 1, got 0"),
    (lambda: KVPool(1, 128.0), TypeError, "KVPool num_slots: expected an int, got 128.0"),
    (lambda: KVPool(-1, 128), ValueError, "KVPool num_layers: expected >= 1, got -1"),
    (lambda: KVPool(1, 128, kv_cache_dim=-576), ValueError, "KVPool kv_cache_dim: expected >= 1, got -576"),
    (lambda: KVPool(1, 128, index_head_dim=0), ValueError, "KVPool index_head_dim: expected >= 1, got 0"),
])
def test_pools_refuse_bad_sizes(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_admission_refuses_a_negative_reservation():
    """A negative ``reserve`` would give a prompt fewer pages than its own tokens need."""
    pool = ReqToTokenPool(2, 200)
    slots = RequestSlots(pool, PageAllocator(4 * PAGE_SIZE))
    with pytest.raises(ValueError, match="admit reserve: expected >= 0, got -90"):
        slots.admit(100, reserve=-90)
    with pytest.raises(TypeError, match="admit prompt_len: expected an int, got 5.0"):
        slots.admit(5.0)
    assert pool.num_free == 2 and slots.allocator.num_free_pages == 3
    row = slots.admit(100, reserve=0)
    assert slots.allocated_len(row) == 2 * PAGE_SIZE


def test_kv_pool_shapes_per_layer():
    config = get_config("tiny")
    target = KVPool.for_model(config, 4 * PAGE_SIZE)
    draft = KVPool.for_model(config, 4 * PAGE_SIZE, mtp=True)
    assert len(target.mla_cache) == config.num_hidden_layers and len(draft.mla_cache) == 1
    assert target.mla_cache[0].shape == (256, 576) and target.index_k_cache[1].shape == (256, 128)
    assert target.mla_cache[0].dtype == torch.bfloat16
    target.mla_cache[1][5] = 1.0
    assert target.mla_cache[0][5].abs().sum() == 0 and draft.mla_cache[0][5].abs().sum() == 0
    assert target.nbytes() == 2 * 256 * (576 + 128) * 2
