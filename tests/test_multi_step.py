"""Multi-step MTP draft decode backend: one launch vs precompute + copies, path gate, schedules.

CPU runs use a small table (W ~ 600) with the kernels forced (``force_kernel``) so the bounded one
launch runs under the interpreter; the gpu-marked tests use a 1M-token table and CUDA graphs.
"""

import pytest
import torch

from dsaspec.layers.attention import backend as dsa_backend
from dsaspec.layers.attention.backend import BOUNDED, CONTEXT_WIDE, DSAAttnBackend
from dsaspec.layers.attention.multi_step import (ONE_LAUNCH, PER_STEP, PRECOMPUTE_AND_COPY,
                                          DSAMultiStepDraftBackend, steps_running_indexer)
from dsaspec.forward_mode import Mode
from dsaspec.reference.dsa_metadata import assert_contract_equal, reference_metadata
from dsaspec.reference.indexer_schedule import reference_indexer_schedule

FLAG = "DSASPEC_BOUNDED_REPLAY_METADATA"  # the environment switch of ``bounded_metadata``: not read here
K, P = 100, 64
W_CPU = 611
POOL = 9


def make_table(pool: int, width: int, device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**31 - 1, (pool, width), dtype=torch.int32, generator=g).to(device)


def multi(table, num_steps, kernel, **kwargs) -> DSAMultiStepDraftBackend:
    kwargs.setdefault("num_sms", 5)
    kwargs.setdefault("budget", 16)
    kwargs.setdefault("bucket_sizes", (1, 4))
    return DSAMultiStepDraftBackend.create(table, num_steps=num_steps, index_topk=K, page_size=P,
                                           force_kernel=kernel, **kwargs)


def batch(lengths, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    rpi = torch.randint(0, POOL, (len(lengths),), generator=g, dtype=torch.int32)
    return rpi.to(device), torch.tensor(lengths, dtype=torch.int32, device=device)


@pytest.fixture
def schedule_calls(monkeypatch):
    """data_ptr of every schedule buffer the backends refresh, in call order."""
    calls = []
    real = dsa_backend.indexer_schedule

    def recording(seqlens, num_sms, out, **kwargs):
        calls.append(out.data_ptr())
        return real(seqlens, num_sms, out, **kwargs)

    monkeypatch.setattr(dsa_backend, "indexer_schedule", recording)
    return calls


# ---------------------------------------------------------------- one launch == precompute + copies

@pytest.mark.parametrize("num_step_backends", [2, 3, 4, 5])
def test_one_launch_matches_precompute_and_copies(num_step_backends):
    table = make_table(POOL, W_CPU, "cpu")
    new = multi(table, num_step_backends + 1, BOUNDED)
    old = multi(table, num_step_backends + 1, CONTEXT_WIDE)
    bs = 4
    new.capture(bs)
    old.capture(bs)
    assert (new.path(bs), old.path(bs)) == (ONE_LAUNCH, PRECOMPUTE_AND_COPY)
    ptrs = [[t.data_ptr() for t in b.tensors()] for b in new.capture(bs)]
    for seed, lengths in enumerate([[611, 129, 0, 1], [64, 65, 300, 1], [128, 127, 63, 1]]):
        rpi, sl = batch(lengths, seed)
        got = new.replay(bs, rpi, sl, check_values=True)
        base = old.replay(bs, rpi, sl, check_values=True)
        want = reference_metadata(Mode.DECODE, table, rpi, sl, index_topk=K, page_size=P)
        assert len(got) == len(base) == num_step_backends
        assert len({id(b) for b in got}) == num_step_backends  # distinct buffer sets
        for g, b in zip(got, base):
            assert_contract_equal(g, b, Mode.DECODE, sl)
            assert_contract_equal(g, want, Mode.DECODE, sl)
    assert [[t.data_ptr() for t in b.tensors()] for b in new.capture(bs)] == ptrs


@pytest.fixture
def launches():
    """(kernel name, NUM_DEST) of every real launch of a metadata kernel, through Triton's
    pre-run hooks (called by the JIT launcher on GPU and by the interpreter on CPU)."""
    from dsaspec.ops import dsa_metadata
    from dsaspec.ops.baseline import dsa_metadata as baseline_metadata, draft_decode_metadata as baseline_draft

    kernels = [dsa_metadata._bounded_kernel, baseline_metadata._context_wide_kernel, baseline_draft._copy_kernel]
    seen = []
    hooks = []
    for kernel in kernels:
        def hook(*args, _name=kernel.__name__, **kwargs):
            seen.append((_name, kwargs.get("NUM_DEST")))
        kernel.pre_run_hooks.append(hook)
        hooks.append((kernel, hook))
    yield seen
    for kernel, hook in hooks:
        kernel.pre_run_hooks.remove(hook)


@pytest.mark.parametrize("num_step_backends,want", [
    (2, [("_bounded_kernel", 2)]),
    (4, [("_bounded_kernel", 4)]),
    (5, [("_bounded_kernel", 4), ("_bounded_kernel", 1)]),
])
def test_one_launch_is_one_kernel_launch_per_four_step_backends(launches, num_step_backends, want):
    table = make_table(POOL, W_CPU, "cpu")
    m = multi(table, num_step_backends + 1, BOUNDED)
    m.capture(4)
    m.replay(4, *batch([5, 6, 7, 1]), seeded=True)
    assert launches == want


def test_precompute_and_copy_launches(launches):
    """The baseline: one context-wide kernel, one 3-destination copy, one copy per further backend."""
    table = make_table(POOL, W_CPU, "cpu")
    m = multi(table, 6, CONTEXT_WIDE)
    m.capture(4)
    m.replay(4, *batch([5, 6, 7, 1]), seeded=True)
    assert launches == [("_context_wide_kernel", None), ("_copy_kernel", 3), ("_copy_kernel", 1),
                        ("_copy_kernel", 1)]


# ---------------------------------------------------------------- the gate

def test_gate_option_off_restores_precompute(monkeypatch):
    monkeypatch.setenv(FLAG, "1")
    m = DSAMultiStepDraftBackend.create(make_table(POOL, W_CPU, "cpu"), num_steps=4, index_topk=K,
                                        bucket_sizes=(4,), num_sms=5, bounded_metadata=False)
    m.capture(4)
    assert m.path(4) == PRECOMPUTE_AND_COPY and "bounded_metadata=False" in m.path_reason(4)
    assert all(s.kernel == CONTEXT_WIDE for s in m.step_backends)
    assert m.schedule_refresh_steps(seeded=True) == (0, 1, 2)


@pytest.mark.parametrize("mismatch", ["index_topk", "page_size", "req_to_token"])
def test_gate_mismatched_tables_fall_back_per_step(mismatch):
    table = make_table(POOL, W_CPU, "cpu")
    kwargs = [dict(index_topk=K, page_size=P) for _ in range(3)]
    tables = [table] * 3
    if mismatch == "req_to_token":
        tables[2] = table.clone()
    else:
        kwargs[2][mismatch] = {"index_topk": 7, "page_size": 16}[mismatch]
    steps = [DSAAttnBackend(t, bucket_sizes=(4,), num_sms=5, budget=16, force_kernel=BOUNDED, **kw)
             for t, kw in zip(tables, kwargs)]
    m = DSAMultiStepDraftBackend(steps)
    m.capture(4)
    assert m.path(4) == PER_STEP and "step backend 2" in m.path_reason(4)
    rpi, sl = batch([300, 2, 129, 1])
    for step, out in zip(steps, m.replay(4, rpi, sl, check_values=True)):
        want = reference_metadata(Mode.DECODE, step.req_to_token, rpi, sl, index_topk=step.index_topk,
                                  page_size=step.page_size)
        assert_contract_equal(out, want, Mode.DECODE, sl)


def test_gate_mixed_kernels_use_precompute():
    table = make_table(POOL, W_CPU, "cpu")
    steps = [DSAAttnBackend(table, index_topk=K, bucket_sizes=(4,), num_sms=5, force_kernel=k)
             for k in (BOUNDED, CONTEXT_WIDE, BOUNDED)]
    m = DSAMultiStepDraftBackend(steps)
    m.capture(4)
    assert m.path(4) == PRECOMPUTE_AND_COPY and "step backend 1" in m.path_reason(4)


@pytest.mark.parametrize("kernel,path", [(BOUNDED, ONE_LAUNCH), (CONTEXT_WIDE, PER_STEP)])
def test_padded_rows(kernel, path):
    """row_align pads the page-table rows: the bounded one launch writes them; the baseline's
    whole-buffer copy cannot, so the context-wide backends write per step."""
    table = make_table(POOL, W_CPU, "cpu")
    m = multi(table, 3, kernel, row_align=4)
    outs = m.capture(4)
    assert m.path(4) == path and outs[0].page_table_1.stride(0) % 4 == 0
    rpi, sl = batch([611, 3, 200, 1])
    want = reference_metadata(Mode.DECODE, table, rpi, sl, index_topk=K, page_size=P)
    for out in m.replay(4, rpi, sl, check_values=True):
        assert_contract_equal(out, want, Mode.DECODE, sl)


@pytest.mark.gpu
@pytest.mark.parametrize("enabled", [None, True, False])
def test_gate_on_cuda_follows_the_option(monkeypatch, enabled):
    monkeypatch.setenv(FLAG, "0" if enabled is not False else "1")  # the option decides, not the environment
    kwargs = {} if enabled is None else {"bounded_metadata": enabled}
    m = DSAMultiStepDraftBackend.create(make_table(POOL, 4096, "cuda"), num_steps=5, index_topk=2048,
                                        bucket_sizes=(1, 16), **kwargs)
    for bs in (1, 16):
        m.capture(bs)
        assert m.path(bs) == (PRECOMPUTE_AND_COPY if enabled is False else ONE_LAUNCH)


# ---------------------------------------------------------------- schedule refresh

def test_steps_running_indexer():
    assert steps_running_indexer(4, index_share=True, seeded=True) == ()
    assert steps_running_indexer(4, index_share=True, seeded=False) == (0,)
    assert steps_running_indexer(4, index_share=False, seeded=True) == (0, 1, 2, 3)
    assert steps_running_indexer(3, index_share=False, seeded=False) == (0, 1, 2)


@pytest.mark.parametrize("kernel,bounded,index_share,seeded,want", [
    (BOUNDED, True, True, True, ()),
    (BOUNDED, True, True, False, (0,)),
    (BOUNDED, True, False, True, (0, 1, 2)),
    (BOUNDED, False, True, True, (0, 1, 2)),
    (CONTEXT_WIDE, False, True, False, (0, 1, 2)),
])
def test_which_steps_refresh_schedule(monkeypatch, schedule_calls, kernel, bounded, index_share, seeded, want):
    monkeypatch.setenv(FLAG, "0" if bounded else "1")  # the option decides, not the environment
    table = make_table(POOL, W_CPU, "cpu")
    m = multi(table, 4, kernel, index_share=index_share, bounded_metadata=bounded)
    m.capture(4)
    schedules = [s.schedule(4, Mode.DECODE) for s in m.step_backends]
    for s in schedules:
        s.fill_(-1)
    rpi, sl = batch([500, 64, 65, 1])
    m.replay(4, rpi, sl, seeded=seeded)
    assert m.schedule_refresh_steps(seeded) == want
    assert schedule_calls == [schedules[i].data_ptr() for i in want]
    expected = reference_indexer_schedule(sl, 5, skip_len=m.step_backends[0].index_topk)
    for i, s in enumerate(schedules):
        assert torch.equal(s, expected) if i in want else bool((s == -1).all())


# ---------------------------------------------------------------- shared buffer set

@pytest.mark.parametrize("kernel,want", [
    (BOUNDED, [("_bounded_kernel", 1)]),
    (CONTEXT_WIDE, [("_context_wide_kernel", None), ("_copy_kernel", 1)]),
])
def test_shared_buffers_single_destination(schedule_calls, launches, kernel, want):
    table = make_table(POOL, W_CPU, "cpu")
    m = multi(table, 5, kernel, share_buffers=True, index_share=False)
    outs = m.capture(4)
    assert all(o is outs[0] for o in outs)
    assert all(s.schedule(4, Mode.DECODE) is m.step_backends[0].schedule(4, Mode.DECODE) for s in m.step_backends)
    rpi, sl = batch([611, 3, 200, 1])
    got = m.replay(4, rpi, sl, check_values=True)
    assert launches == want
    assert len(schedule_calls) == 1  # one shared schedule, refreshed once
    assert_contract_equal(got[0], reference_metadata(Mode.DECODE, table, rpi, sl, index_topk=K, page_size=P),
                          Mode.DECODE, sl)


# ---------------------------------------------------------------- bad input

def test_bad_input_errors():
    table = make_table(POOL, W_CPU, "cpu")
    m = multi(table, 3, BOUNDED)
    m.capture(4)
    rpi, sl = batch([1, 2, 3, 4])
    with pytest.raises(ValueError, match="bs=1 was not captured by the multi-step backend"):
        m.replay(1, rpi[:1], sl[:1])
    with pytest.raises(ValueError, match="bs=1 was not captured"):
        m.path(1)
    with pytest.raises(ValueError, match="bs=16 is not a batch bucket"):
        m.capture(16)
    with pytest.raises(ValueError, match="seq_lens has 2 entries, expected 4"):
        m.replay(4, rpi, sl[:2])
    with pytest.raises(ValueError, match="num_steps must be >= 2"):
        DSAMultiStepDraftBackend.create(table, num_steps=1, index_topk=K)
    with pytest.raises(ValueError, match="at least one step backend"):
        DSAMultiStepDraftBackend([])
    with pytest.raises(ValueError, match="seq_len = 700 exceeds the page-table width"):
        m.replay(4, rpi, torch.tensor([700, 1, 1, 1], dtype=torch.int32), check_values=True)


# ---------------------------------------------------------------- GPU, 1M-token table

W_1M = 1_048_576 + 4 + 6


@pytest.mark.gpu
@pytest.mark.parametrize("num_step_backends", [2, 3, 4, 5])
def test_one_launch_matches_precompute_1m(num_step_backends):
    table = make_table(POOL, W_1M, "cuda")
    new = DSAMultiStepDraftBackend.create(table, num_steps=num_step_backends + 1, index_topk=2048,
                                          bucket_sizes=(4, 16), force_kernel=BOUNDED)
    old = DSAMultiStepDraftBackend.create(table, num_steps=num_step_backends + 1, index_topk=2048,
                                          bucket_sizes=(4, 16), force_kernel=CONTEXT_WIDE)
    cases = {4: [1024, W_1M, 0, 1], 16: [65536, 1, 129, 1_000_000, 128, 127, 64, 63] * 2}
    for bs, lengths in cases.items():
        new.capture(bs)
        old.capture(bs)
        rpi, sl = batch(lengths, bs, "cuda")
        got = new.replay(bs, rpi, sl, check_values=True)
        base = old.replay(bs, rpi, sl, check_values=True)
        torch.cuda.synchronize()
        for g, b in zip(got, base):
            assert_contract_equal(g, b, Mode.DECODE, sl)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [BOUNDED, CONTEXT_WIDE])
@pytest.mark.parametrize("share_buffers", [False, True])
def test_cuda_graph_replay_new_lengths_1m(kernel, share_buffers):
    table = make_table(POOL, W_1M, "cuda")
    m = DSAMultiStepDraftBackend.create(table, num_steps=5, index_topk=2048, bucket_sizes=(4,),
                                        force_kernel=kernel, share_buffers=share_buffers, index_share=False)
    outs = m.capture(4)
    ptrs = [[t.data_ptr() for t in o.tensors()] for o in outs]
    rpi = torch.zeros(4, dtype=torch.int32, device="cuda")
    sl = torch.ones(4, dtype=torch.int32, device="cuda")
    m.replay(4, rpi, sl)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        m.replay(4, rpi, sl)
    for seed, lengths in enumerate([[1024, 65536, 0, 1], [W_1M, 129, 64, 1], [5, 500_000, 63, 2]]):
        new_rpi, new_sl = batch(lengths, seed, "cuda")
        rpi.copy_(new_rpi)
        sl.copy_(new_sl)
        graph.replay()
        torch.cuda.synchronize()
        want = reference_metadata(Mode.DECODE, table, rpi, sl, index_topk=2048, page_size=P)
        for step, out in zip(m.step_backends, outs):
            assert_contract_equal(out, want, Mode.DECODE, sl)
            assert torch.equal(step.schedule(4, Mode.DECODE).cpu(),
                               reference_indexer_schedule(sl.cpu(), step.num_sms, skip_len=step.index_topk))
    assert [[t.data_ptr() for t in o.tensors()] for o in outs] == ptrs


# ---------------------------------------------------------------- benchmark smoke test

@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU this is the full benchmark: run `dsaspec bench draft-metadata`")
def test_bench_draft_metadata_cpu_checks_identity(tmp_path):
    import argparse
    import json

    from dsaspec.bench import draft_metadata

    parser = argparse.ArgumentParser()
    draft_metadata.add_arguments(parser)
    assert draft_metadata.run(parser.parse_args(["--step-backends", "2", "--out", str(tmp_path)])) == 0
    rows = json.loads((tmp_path / "draft_metadata.json").read_text())["rows"]
    assert len(rows) == 4 and all(r["bit_identical"] for r in rows)
