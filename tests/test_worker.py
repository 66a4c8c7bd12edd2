"""The worker protocol, for the plain (DecodeWorker) and the speculative (SpecWorker) worker alike:
the rows a step takes are checked before any work, and padded rows never advance their carry.

CPU: the tiny model in fp32 with the torch ops (metadata kernels under the Triton interpreter).
"""

import pytest
import torch

from dsaspec.configs.model_config import get_config
from dsaspec.engine.engine import Engine
from dsaspec.executor.worker import Worker
from dsaspec.models.dsa_model import DSAModel
from dsaspec.speculative.spec_worker import SpecConfig

WORKERS = [None, SpecConfig(num_steps=2)]
IDS = ["plain", "speculative"]


@pytest.fixture(scope="module")
def model():
    return DSAModel(get_config("tiny"), dtype=torch.float32).init_weights(0)


def _engine(model, spec, **kwargs):
    kwargs.setdefault("context_len", 64)
    return Engine(model, speculative=spec, progress=False, **kwargs)


def _carry(worker):
    return {name: getattr(worker.state, name).clone() for name in worker.state.FIELDS}


@pytest.mark.parametrize("spec", WORKERS, ids=IDS)
def test_step_refuses_bad_rows_before_any_work(model, spec):
    engine = _engine(model, spec, max_batch=3, bucket_sizes=(1, 2))
    worker = engine.worker
    assert isinstance(worker, Worker)
    row = engine.slots.admit(5, reserve=8)
    worker.prefill(row, [1, 2, 3, 4, 5])
    before = _carry(worker)
    dummy = worker.dummy_row
    for rows, message in (([], r"rows is empty"),
                          ([row, dummy], rf"rows \[{dummy}\] are not request rows .*\[0, {dummy}\)"),
                          ([-1], r"rows \[-1\] are not request rows"),
                          ([row, 10], r"rows \[10\] are not request rows"),
                          ([True], r"rows \[True\] are not request rows"),
                          ([row, row], rf"rows \[{row}\] appear more than once"),
                          ([row, 1], r"rows \[1\] hold no prefilled request")):
        with pytest.raises(ValueError, match=message):
            worker.step(rows)
    after = _carry(worker)
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert len(worker.step([row]).committed) == 1
    worker.release(row)
    with pytest.raises(ValueError, match=rf"rows \[{row}\] hold no prefilled request"):
        worker.step([row])
    with pytest.raises(ValueError, match="row must be a request row"):
        worker.prefill(dummy, [1, 2])


@pytest.mark.parametrize("spec", WORKERS, ids=IDS)
def test_padded_rows_carry_stays_at_its_reset_value(model, spec):
    """One request in a bucket of two for many steps (every step pads one row onto the dummy row):
    after each step the dummy row's carry is back at its reset value, so padding never advances a
    position (unreset, it would walk off the end of a small table)."""
    engine = _engine(model, spec, context_len=24, max_batch=1, bucket_sizes=(2,))
    worker, state = engine.worker, engine.worker.state
    dummy, step = worker.dummy_row, worker.step
    steps = []

    def watched(rows, **kwargs):
        result = step(rows, **kwargs)
        steps.append(rows)
        carry = (int(state.seq_lens[dummy]), int(state.bonus[dummy]))
        assert carry == (state.pad_len, 0), f"dummy row's (length, token) {carry} after step {len(steps)}"
        return result

    worker.step = watched
    for _ in range(2):                        # the dummy row's carry outlives a generate call
        engine.generate([3, 1, 4, 1, 5], 20)
    assert len(steps) >= 2 * 19 // (spec.num_draft_tokens if spec else 1)
    assert set(engine.stats.step_buckets) == {2}
