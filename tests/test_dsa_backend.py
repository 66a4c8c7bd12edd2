"""DSAAttnBackend: kernel selection, static buffers, replay / eager against the reference, schedule.

CPU runs use small tables (W ~ 500) and force the bounded kernels with ``force_kernel`` so they run
under the interpreter; the gpu-marked tests add CUDA-graph replay and a 1M-token table.
"""

import pytest
import torch

from dsaspec.layers.attention.backend import BOUNDED, CONTEXT_WIDE, DSAAttnBackend, select_kernel
from dsaspec.ops.dsa_metadata import DEFAULT_BUDGET
from dsaspec.layers.attention.inputs import AttentionScratch
from dsaspec.forward_mode import Mode
from dsaspec.reference.dsa_metadata import assert_contract_equal, reference_metadata
from dsaspec.reference.indexer_schedule import reference_indexer_schedule

HAS_CUDA = torch.cuda.is_available()
FLAG = "DSASPEC_BOUNDED_REPLAY_METADATA"  # the environment switch of ``bounded_metadata``: not read here
K, P, N = 100, 64, 3
W_CPU = 523  # odd, not a multiple of 64 or 128
POOL = 11
KERNELS = [BOUNDED, CONTEXT_WIDE]


def make_table(pool: int, width: int, device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**31 - 1, (pool, width), dtype=torch.int32, generator=g).to(device)


def lengths_for(mode: Mode, width: int, bs: int, seed: int) -> torch.Tensor:
    """Edge lengths first (0, 1, 63, 64, 65, 127, 128, 129, max), then random, padded rows = 1."""
    top = width - (N if mode is Mode.TARGET_VERIFY else 0)
    edges = [0, 1, 63, 64, 65, 127, 128, 129, top]
    g = torch.Generator().manual_seed(seed)
    values = [edges[(seed + i) % len(edges)] if i % 2 == 0 else int(torch.randint(0, top + 1, (1,), generator=g))
              for i in range(bs)]
    if bs > 2:
        values[-1] = 1  # a padded row
    if mode is Mode.DRAFT_EXTEND:
        values = [v if v >= N else 1 for v in values]  # s includes the N new tokens (padded: 1)
    return torch.tensor(values, dtype=torch.int32)


def pool_indices(bs: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + seed)
    idx = torch.randint(0, POOL, (bs,), generator=g, dtype=torch.int32)
    if bs > 1:
        idx[1] = idx[0]  # a repeated index
    return idx


def backend(table, kernel=None, **kwargs) -> DSAAttnBackend:
    kwargs.setdefault("index_topk", K)
    kwargs.setdefault("page_size", P)
    kwargs.setdefault("num_draft_tokens", N)
    kwargs.setdefault("num_sms", 7)
    kwargs.setdefault("group_num_sms", 5)  # the grouped verify rows' own program count
    kwargs.setdefault("budget", 16)
    return DSAAttnBackend(table, force_kernel=kernel, **kwargs)


# ---------------------------------------------------------------- kernel selection

@pytest.mark.parametrize("on_cuda", [True, False])
@pytest.mark.parametrize("enabled", [True, False])
def test_select_kernel_truth_table(on_cuda, enabled):
    kernel, reason = select_kernel(on_cuda=on_cuda, bounded_enabled=enabled)
    assert kernel == (BOUNDED if on_cuda and enabled else CONTEXT_WIDE)
    if not enabled:
        assert reason == f"bounded_metadata=False ({FLAG}=0)"
    elif not on_cuda:
        assert "CUDA" in reason


@pytest.mark.parametrize("enabled", [True, False])
def test_backend_selection_cpu(monkeypatch, enabled):
    monkeypatch.setenv(FLAG, "0" if enabled else "1")  # the option decides, not the environment
    be = DSAAttnBackend(make_table(2, 64, "cpu"), index_topk=K, bounded_metadata=enabled)
    assert be.kernel == CONTEXT_WIDE
    assert ("CUDA" in be.kernel_reason) if enabled else ("bounded_metadata=False" in be.kernel_reason)


@pytest.mark.gpu
@pytest.mark.parametrize("enabled", [None, True, False])
def test_backend_selection_cuda(monkeypatch, enabled):
    monkeypatch.setenv(FLAG, "0" if enabled is not False else "1")  # the option decides, not the environment
    kwargs = {} if enabled is None else {"bounded_metadata": enabled}
    be = DSAAttnBackend(make_table(2, 64, "cuda"), index_topk=K, **kwargs)
    assert be.kernel == (CONTEXT_WIDE if enabled is False else BOUNDED), be.kernel_reason


def test_budget_is_the_argument_or_the_kernels_default(monkeypatch):
    monkeypatch.setenv("DSASPEC_METADATA_BUDGET", "16")  # the environment is not read here
    table = make_table(2, 64, "cpu")
    assert DSAAttnBackend(table, index_topk=K).budget == DEFAULT_BUDGET == 2048
    assert DSAAttnBackend(table, index_topk=K, budget=24).budget == 24
    with pytest.raises(ValueError, match="budget must be >= 1, got 0"):
        DSAAttnBackend(table, index_topk=K, budget=0)


def test_kpool_is_rejected_until_implemented():
    """The metadata here is not kpool-aware (dsa = min(L, K)): asking for kpool raises, in the
    step backends of the multi-step backend too."""
    from dsaspec.layers.attention.multi_step import DSAMultiStepDraftBackend

    table = make_table(2, 64, "cpu")
    with pytest.raises(ValueError, match="^index_kpool=2: kpool-aware metadata is not implemented"):
        DSAAttnBackend(table, index_topk=K, index_kpool=2)
    with pytest.raises(ValueError, match="^kpool_metadata_fusion=True: kpool metadata fusion is not implemented$"):
        DSAAttnBackend(table, index_topk=K, kpool_metadata_fusion=True)
    with pytest.raises(ValueError, match="^index_kpool=4: kpool-aware metadata is not implemented"):
        DSAMultiStepDraftBackend.create(table, num_steps=3, index_topk=K, index_kpool=4)


def test_force_kernel_overrides_selection():
    be = backend(make_table(2, 64, "cpu"), BOUNDED, bounded_metadata=False)
    assert be.kernel == BOUNDED and "force_kernel" in be.kernel_reason


# ---------------------------------------------------------------- replay

@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", list(Mode))
def test_replay_matches_reference_and_keeps_buffers(kernel, mode):
    table = make_table(POOL, W_CPU, "cpu")
    be = backend(table, kernel, bucket_sizes=(1, 4, 9))
    for bs in (1, 9):
        out = be.capture(bs, mode)
        assert be.capture(bs, mode) is out
        schedule = be.schedule(bs, mode)
        assert schedule.shape == (be.programs(mode) + 1, 2)
        ptrs = [t.data_ptr() for t in out.tensors()] + [schedule.data_ptr()]
        assert out.page_table_1.shape == (out.rows, W_CPU)
        assert out.real_page_table.shape == (out.rows, -(-W_CPU // P))
        # several replays with new lengths (longer, then shorter: the stale tail must not matter)
        for seed in range(2):
            rpi, sl = pool_indices(bs, seed), lengths_for(mode, W_CPU, bs, seed)
            got = be.replay(bs, rpi, sl, mode, check_values=True)
            assert got is out
            want = reference_metadata(mode, table, rpi, sl, index_topk=K, page_size=P, num_draft_tokens=N)
            assert_contract_equal(got, want, mode, sl, N)
            assert torch.equal(schedule, reference_indexer_schedule(out.seqlens_expanded, be.programs(mode), skip_len=be.index_topk,
                                                                    rows_per_group=be.rows_per_group(mode)))
        assert [t.data_ptr() for t in out.tensors()] + [schedule.data_ptr()] == ptrs


def test_replay_without_schedule_refresh_leaves_schedule():
    table = make_table(POOL, W_CPU, "cpu")
    be = backend(table, BOUNDED, bucket_sizes=(2,))
    be.capture(2, Mode.DECODE)
    be.replay(2, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([300, 5], dtype=torch.int32), Mode.DECODE)
    before = be.schedule(2, Mode.DECODE).clone()
    sl = torch.tensor([7, 9], dtype=torch.int32)
    be.replay(2, torch.tensor([0, 1], dtype=torch.int32), sl, Mode.DECODE, refresh_schedule=False)
    assert torch.equal(be.schedule(2, Mode.DECODE), before)
    assert not torch.equal(before, reference_indexer_schedule(sl, be.num_sms, skip_len=be.index_topk))


@pytest.mark.parametrize("kernel", KERNELS)
def test_replay_variable_draft_extend(kernel):
    table = make_table(POOL, W_CPU, "cpu")
    be = backend(table, kernel, bucket_sizes=(3,))
    be.capture(3, Mode.DRAFT_EXTEND)
    rpi = torch.tensor([4, 2, 9], dtype=torch.int32)
    sl = torch.tensor([200, 2, 129], dtype=torch.int32)
    ext = torch.tensor([4, 1, 4], dtype=torch.int64)  # sums to bs * N = 9
    out = be.replay(3, rpi, sl, Mode.DRAFT_EXTEND, ext, check_values=True)
    want = reference_metadata(Mode.DRAFT_EXTEND, table, rpi, sl, index_topk=K, page_size=P,
                              num_draft_tokens=N, extend_seq_lens=ext)
    assert_contract_equal(out, want, Mode.DRAFT_EXTEND, sl, N, ext)
    with pytest.raises(ValueError, match="sum"):
        be.replay(3, rpi, sl, Mode.DRAFT_EXTEND, torch.tensor([1, 1, 1]), check_values=True)


def test_page_size_one_has_no_real_table():
    table = make_table(POOL, 200, "cpu")
    be = backend(table, BOUNDED, page_size=1, bucket_sizes=(2,))
    out = be.capture(2, Mode.TARGET_VERIFY)
    assert out.real_page_table is None
    rpi, sl = torch.tensor([3, 5], dtype=torch.int32), torch.tensor([130, 0], dtype=torch.int32)
    be.replay(2, rpi, sl, Mode.TARGET_VERIFY, check_values=True)
    want = reference_metadata(Mode.TARGET_VERIFY, table, rpi, sl, index_topk=K, page_size=1, num_draft_tokens=N)
    assert_contract_equal(out, want, Mode.TARGET_VERIFY, sl, N)


# ---------------------------------------------------------------- eager

@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", list(Mode))
def test_eager_width_is_live_max(kernel, mode):
    table = make_table(POOL, W_CPU, "cpu")
    be = backend(table, kernel, bucket_sizes=(1, 2))
    rpi = torch.tensor([1, 6, 6, 0, 10], dtype=torch.int64)
    sl = torch.tensor([5, 190, 64, 1, 129], dtype=torch.int64)
    out, schedule = be.eager(rpi, sl, mode)
    live_max = 190 + (N if mode is Mode.TARGET_VERIFY else 0)
    assert out.width == live_max and out.batch == 5
    want = reference_metadata(mode, table[:, :live_max], rpi, sl, index_topk=K, page_size=P, num_draft_tokens=N)
    assert_contract_equal(out, want, mode, sl, N)
    assert schedule.shape == ((5 if mode is Mode.TARGET_VERIFY else 7) + 1, 2)
    assert torch.equal(schedule, reference_indexer_schedule(out.seqlens_expanded, be.programs(mode), skip_len=be.index_topk,
                                                                    rows_per_group=be.rows_per_group(mode)))


def test_eager_variable_draft_extend():
    table = make_table(POOL, W_CPU, "cpu")
    be = backend(table, BOUNDED)
    rpi, sl = torch.tensor([2, 3], dtype=torch.int32), torch.tensor([70, 300], dtype=torch.int32)
    ext = torch.tensor([2, 5], dtype=torch.int32)
    out, _ = be.eager(rpi, sl, Mode.DRAFT_EXTEND, ext)
    assert out.rows == 7 and out.width == 300
    want = reference_metadata(Mode.DRAFT_EXTEND, table[:, :300], rpi, sl, index_topk=K, page_size=P,
                              num_draft_tokens=N, extend_seq_lens=ext)
    assert_contract_equal(out, want, Mode.DRAFT_EXTEND, sl, N, ext)


# ---------------------------------------------------------------- attention inputs

@pytest.mark.parametrize("mode", list(Mode))
def test_attention_inputs_over_the_buffers(mode):
    """Captured: views of the buffers and schedule of (bs, mode), the mode's row groups, a scratch
    of every row (or the leading rows of a shared one). Eager: the same over fresh metadata."""
    table = make_table(POOL, W_CPU, "cpu")
    be = backend(table, CONTEXT_WIDE, bucket_sizes=(2, 4))
    with pytest.raises(ValueError, match="bs=4 was not captured"):
        be.attention_inputs(4, mode)
    buffers = be.capture(4, mode)
    attn = be.attention_inputs(4, mode)
    rows, width = buffers.page_table_1.shape
    groups = N if mode is Mode.TARGET_VERIFY else 1
    assert attn.page_table_1 is buffers.page_table_1 and attn.seqlens is buffers.seqlens_expanded
    assert attn.schedule is be.schedule(4, mode) and attn.rows_per_group == groups
    assert attn.index_logits.shape == (rows, width) and attn.topk_slots.shape == (rows, K)
    scratch = AttentionScratch.allocate(4 * N + 5, width, K, "cpu")
    shared = be.attention_inputs(4, mode, scratch=scratch)
    assert shared.topk_slots.data_ptr() == scratch.topk_slots.data_ptr() and shared.topk_slots.shape == (rows, K)
    rpi, sl = torch.tensor([1, 6, 0]), torch.tensor([5, 190, 64])
    eager = be.eager_attention_inputs(rpi, sl, mode)
    metadata, schedule = be.eager(rpi, sl, mode)
    assert torch.equal(eager.page_table_1, metadata.page_table_1)
    assert torch.equal(eager.seqlens, metadata.seqlens_expanded)
    assert torch.equal(eager.schedule, schedule) and eager.rows_per_group == groups


# ---------------------------------------------------------------- bad input

def test_grouped_verify_rows_have_their_own_program_count():
    """Target verify with row groups sizes its schedule by group_num_sms, every other mode (and
    verify without groups, the row-invariant mode) by num_sms; None means num_sms."""
    table = make_table(POOL, W_CPU, "cpu")
    grouped = backend(table, BOUNDED, bucket_sizes=(2,))
    ungrouped = backend(table, BOUNDED, bucket_sizes=(2,), group_verify_rows=False)
    assert [grouped.programs(m) for m in Mode] == [5 if m is Mode.TARGET_VERIFY else 7 for m in Mode]
    assert [ungrouped.programs(m) for m in Mode] == [7] * len(Mode)
    assert backend(table, BOUNDED, group_num_sms=None).programs(Mode.TARGET_VERIFY) == 7
    for be in (grouped, ungrouped):
        be.capture(2, Mode.TARGET_VERIFY)
        assert be.schedule(2, Mode.TARGET_VERIFY).shape == (be.programs(Mode.TARGET_VERIFY) + 1, 2)
    for bad in (0, 2.5):
        with pytest.raises(ValueError, match="group_num_sms must be an integer >= 1"):
            backend(table, BOUNDED, group_num_sms=bad)
    other = backend(table, BOUNDED, bucket_sizes=(2,), group_num_sms=6)
    with pytest.raises(ValueError, match="share_from has group_num_sms=5, this backend 6"):
        other.capture(2, Mode.TARGET_VERIFY, share_from=grouped)


def test_bad_input_errors():
    table = make_table(POOL, W_CPU, "cpu")
    be = backend(table, BOUNDED, bucket_sizes=(1, 4))
    be.capture(4, Mode.DECODE)
    rpi, sl = torch.zeros(4, dtype=torch.int32), torch.ones(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="bs=3 is not a batch bucket"):
        be.capture(3, Mode.DECODE)
    with pytest.raises(ValueError, match="above the largest bucket 4: use eager"):
        be.replay(8, torch.zeros(8, dtype=torch.int32), torch.ones(8, dtype=torch.int32), Mode.DECODE)
    with pytest.raises(ValueError, match="bs=1 was not captured for decode"):
        be.replay(1, rpi[:1], sl[:1], Mode.DECODE)
    with pytest.raises(ValueError, match="not captured for target_verify"):
        be.replay(4, rpi, sl, Mode.TARGET_VERIFY)
    with pytest.raises(ValueError, match="mode must be one of decode, target_verify, draft_extend; got 'prefill'"):
        be.replay(4, rpi, sl, "prefill")
    with pytest.raises(ValueError, match="mode must be one of"):
        be.capture(4, "prefill")
    with pytest.raises(ValueError, match="seq_lens has 3 entries, expected 4"):
        be.replay(4, rpi, sl[:3], Mode.DECODE)
    with pytest.raises(ValueError, match="req_pool_indices must be an int32/int64 tensor"):
        be.replay(4, rpi.float(), sl, Mode.DECODE)
    with pytest.raises(ValueError, match="exceeds the page-table width"):
        be.replay(4, rpi, torch.full((4,), W_CPU + 1, dtype=torch.int32), Mode.DECODE, check_values=True)
    with pytest.raises(ValueError, match="exceeds the page-table width"):
        be.eager(rpi, torch.full((4,), W_CPU - 1, dtype=torch.int32), Mode.TARGET_VERIFY)
    with pytest.raises(ValueError, match="req_pool_indices must lie in"):
        be.replay(4, torch.full((4,), POOL, dtype=torch.int32), sl, Mode.DECODE, check_values=True)
    with pytest.raises(ValueError, match="req_to_token must be an int32 tensor"):
        DSAAttnBackend(table.long(), index_topk=K)
    with pytest.raises(ValueError, match="force_kernel"):
        DSAAttnBackend(table, index_topk=K, force_kernel="fast")
    with pytest.raises(ValueError, match="index_kpool must be an integer >= 1"):
        DSAAttnBackend(table, index_topk=K, index_kpool=0)
    with pytest.raises(ValueError, match="bucket_sizes"):
        DSAAttnBackend(table, index_topk=K, bucket_sizes=())
    with pytest.raises(ValueError, match="^row_align must be an integer >= 1, got 0$"):
        DSAAttnBackend(table, index_topk=K, row_align=0)
    with pytest.raises(ValueError, match="share_from reads a different req_to_token"):
        backend(table.clone(), BOUNDED, bucket_sizes=(4,)).capture(4, Mode.DECODE, share_from=be)
    with pytest.raises(ValueError, match="share_from has page_size=64"):
        backend(table, BOUNDED, bucket_sizes=(4,), page_size=16).capture(4, Mode.DECODE, share_from=be)
    assert be.bucket_for(3) == 4 and be.bucket_for(5) is None


# ---------------------------------------------------------------- GPU

def _graph_replay_case(width: int, bs: int, lengths_list, kernel=None):
    table = make_table(POOL, width, "cuda")
    be = DSAAttnBackend(table, index_topk=2048, page_size=P, num_draft_tokens=N, bucket_sizes=(bs,),
                        force_kernel=kernel)
    rpi = torch.zeros(bs, dtype=torch.int32, device="cuda")
    sl = torch.ones(bs, dtype=torch.int32, device="cuda")
    for mode in Mode:
        out = be.capture(bs, mode)
        ptrs = [t.data_ptr() for t in out.tensors()]
        be.replay(bs, rpi, sl, mode)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            be.replay(bs, rpi, sl, mode)
        for seed, lengths in enumerate(lengths_list):
            new_sl = torch.tensor(lengths, dtype=torch.int32)
            if mode is Mode.TARGET_VERIFY:
                new_sl = new_sl.clamp(max=width - N)
            if mode is Mode.DRAFT_EXTEND:
                new_sl = torch.where(new_sl >= N, new_sl, torch.ones_like(new_sl))
            sl.copy_(new_sl)
            rpi.copy_(pool_indices(bs, seed))
            graph.replay()
            torch.cuda.synchronize()
            want = reference_metadata(mode, table, rpi, sl, index_topk=2048, page_size=P, num_draft_tokens=N)
            assert_contract_equal(out, want, mode, sl, N)
            assert torch.equal(be.schedule(bs, mode).cpu(),
                               reference_indexer_schedule(out.seqlens_expanded.cpu(), be.programs(mode),
                                                          skip_len=be.index_topk,
                                                          rows_per_group=be.rows_per_group(mode)))
        assert [t.data_ptr() for t in out.tensors()] == ptrs


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [None, CONTEXT_WIDE])
def test_cuda_graph_replay_new_lengths(kernel):
    _graph_replay_case(4099, 5, [[0, 1, 63, 4096, 1], [129, 4099, 2000, 64, 1], [7, 7, 7, 7, 1]], kernel)


@pytest.mark.gpu
def test_cuda_graph_replay_1m_table():
    width = 1_048_576 + 4 + 6
    _graph_replay_case(width, 4, [[1024, 65536, 1, 1], [width, 0, 129, 1], [300_000, 1_000_000, 65, 2]])
