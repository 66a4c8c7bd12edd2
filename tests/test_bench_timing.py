"""How the kernel timer cuts CUPTI activities into graph replays (`dsaspec/bench/timing.py`); the
timing itself needs a GPU and runs in the benchmarks."""

import pytest

from dsaspec.bench.timing import split_replays

FLUSH = "fill_kernel"


def test_split_at_each_flush_and_drop_it():
    events = [(FLUSH, 0, 5), ("a", 6, 8), ("b", 7, 12),
              (FLUSH, 20, 25), ("a", 26, 30), ("b", 31, 33)]
    assert split_replays(events, 2, flushed=True) == [[("a", 6, 8), ("b", 7, 12)],
                                                      [("a", 26, 30), ("b", 31, 33)]]


def test_split_without_flush_into_equal_runs():
    events = [("a", 0, 1), ("b", 1, 2), ("a", 3, 4), ("b", 4, 6)]
    assert split_replays(events, 2, flushed=False) == [events[:2], events[2:]]


@pytest.mark.parametrize("events,iters,flushed", [
    ([(FLUSH, 0, 1), ("a", 1, 2)], 2, True),                    # one replay where two were timed
    ([(FLUSH, 0, 1), (FLUSH, 2, 3), ("a", 3, 4)], 2, True),     # a replay with no activity of fn
    ([("a", 0, 1), ("b", 1, 2), ("a", 3, 4)], 2, False),        # not a multiple of the replays
])
def test_a_count_that_does_not_match_the_replays_raises(events, iters, flushed):
    with pytest.raises(RuntimeError, match="replays"):
        split_replays(events, iters, flushed=flushed)
