"""indexer_logits against the dense reference over ragged live lengths and a poisoned page table;
rows the schedule skips (live <= skip_len) are never written."""

import pytest
import torch

from dsa_inputs import SENTINEL, launch_indexer, random_indexer_inputs, to_cpu
from dsaspec.ops.indexer import (INDEXER_BASELINE_CONFIG, INDEXER_CONFIG, MAX_GROUP_COLUMNS, group_fits,
                                 indexer_logits)
from dsaspec.ops.indexer_schedule import indexer_schedule
from dsaspec.reference.indexer import reference_indexer_logits

EDGE_LENGTHS = [0, 1, 63, 64, 65, 127, 128, 129]
CONFIGS = {"new": INDEXER_CONFIG, "baseline": INDEXER_BASELINE_CONFIG}


def _assert_matches(out, inputs, rtol, atol, skip_len=0):
    """Rows longer than skip_len: the reference logits, -inf to the 64-token block edge, the
    sentinel beyond. Other rows: the sentinel everywhere (never written)."""
    expected = reference_indexer_logits(**to_cpu(inputs))
    out = out.cpu()
    for row, want in enumerate(expected):
        length = want.numel()
        if length <= skip_len:
            assert torch.all(out[row] == SENTINEL), row
            continue
        edge = min(-(-length // 64) * 64, out.shape[1])
        torch.testing.assert_close(out[row, :length], want, rtol=rtol, atol=atol)
        assert torch.all(out[row, length:edge] == float("-inf")), row
        assert torch.all(out[row, edge:] == SENTINEL), row


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("num_heads", [4, 8, 32])
@pytest.mark.parametrize("num_sms", [1, 3, 7])
def test_edge_lengths(config, num_heads, num_sms, device):
    seqlens = EDGE_LENGTHS + [5, 0]
    inputs = random_indexer_inputs(seqlens, num_heads, width=200, num_slots=300, device=device,
                                   seed=num_heads * 10 + num_sms)
    out = launch_indexer(inputs, num_sms, out_width=256, config=CONFIGS[config])
    _assert_matches(out, inputs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("skip_len", [1, 64, 65, 128])
@pytest.mark.parametrize("num_sms", [1, 4])
def test_skipped_rows_untouched(skip_len, num_sms, device):
    """Rows with live <= skip_len are neither read nor written; the others are exact."""
    seqlens = EDGE_LENGTHS + [skip_len, skip_len + 1, 200, 2]
    inputs = random_indexer_inputs(seqlens, 8, width=210, num_slots=150, device=device,
                                   seed=skip_len)
    out = launch_indexer(inputs, num_sms, out_width=256, skip_len=skip_len)
    _assert_matches(out, inputs, rtol=1e-5, atol=1e-5, skip_len=skip_len)


def test_skipped_rows_never_read(device):
    """A skipped row whose page table holds only out-of-range slots and whose query is NaN:
    reading either would fault or poison; its logits stay unwritten and the others are exact."""
    seqlens = [100, 60, 130]
    inputs = random_indexer_inputs(seqlens, 8, width=140, num_slots=90, device=device, seed=4)
    expected = reference_indexer_logits(**to_cpu(inputs))
    inputs["page_table_1"][1] = 2**30
    inputs["q"][1] = float("nan")
    out = launch_indexer(inputs, num_sms=3, out_width=192, skip_len=64, check_values=False)
    assert torch.all(out[1].cpu() == SENTINEL)
    for row in (0, 2):
        torch.testing.assert_close(out[row, :seqlens[row]].cpu(), expected[row], rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("skip_len", [0, 64])
@pytest.mark.parametrize("rows_per_group,num_heads", [(2, 8), (4, 8), (3, 5), (4, 3)])
def test_row_groups(rows_per_group, num_heads, skip_len, device):
    """Groups of rows sharing a page table (target verify): one key read per group, every row's
    logits exact up to its own length, -inf to its own block edge, nothing else written; the
    other members' page-table tails are poisoned, so only the first row's table is read. Odd
    group sizes and head counts leave padding members and heads in the dot's columns."""
    lengths = [0, 1, 63, 64, 65, 127, 128, 129, 130, 2, 64, 200, 197, 198, 199, 200]
    seqlens = lengths[:len(lengths) // rows_per_group * rows_per_group]
    inputs = random_indexer_inputs(seqlens, num_heads, width=210, num_slots=300, device=device,
                                   seed=rows_per_group + skip_len, rows_per_group=rows_per_group)
    for num_sms in (1, 3):
        out = launch_indexer(inputs, num_sms, out_width=256, skip_len=skip_len,
                      rows_per_group=rows_per_group, check_values=False)
        _assert_matches(out, inputs, rtol=1e-5, atol=1e-5, skip_len=skip_len)


def test_row_groups_checked(device):
    """check_values: a schedule built for other units, or group rows whose live page tables
    differ, are errors."""
    inputs = random_indexer_inputs([70, 71, 5, 9], 4, width=80, num_slots=90, device=device,
                                   rows_per_group=2)
    with pytest.raises(ValueError, match=r"schedule: built for 4 units, expected R / "
                                         r"rows_per_group = 2; pass the schedule's rows_per_group"):
        schedule = torch.zeros(3, 2, dtype=torch.int32, device=device)
        indexer_schedule(inputs["seqlens"], 2, schedule)
        indexer_logits(**inputs, schedule=schedule, out=torch.zeros(4, 80, device=device),
                       rows_per_group=2)
    inputs["page_table_1"][1, 70] = (inputs["page_table_1"][0, 70] + 1) % 90
    with pytest.raises(ValueError, match=r"page_table_1: rows 0..1 form a group \(rows_per_group"
                                         r"=2\) but their live prefixes differ"):
        launch_indexer(inputs, 2, out_width=80, rows_per_group=2)
    with pytest.raises(ValueError, match="rows_per_group: expected a divisor >= 1 of the 4 rows, "
                                         "got 3"):
        indexer_logits(**inputs, schedule=torch.zeros(3, 2, dtype=torch.int32, device=device),
                       out=torch.zeros(4, 80, device=device), rows_per_group=3)


@pytest.mark.parametrize("rows_per_group", [1, 2])
@pytest.mark.parametrize("bad_slot", ["num_slots", -1])
def test_out_of_range_slots_checked(bad_slot, rows_per_group, device):
    """check_values: a slot outside k_cache (== num_slots, or -1, which would read the last row)
    inside a scheduled row's live length is an error naming the row and position. Beyond the live
    length, in rows the schedule skips and (groups) in members other than the first it is never
    read, so it is allowed and the logits are exact."""
    num_slots, skip_len = 90, 8
    inputs = random_indexer_inputs([75, 70, 5, 6], 4, width=80, num_slots=num_slots,
                                   device=device, seed=1, rows_per_group=rows_per_group)
    expected = reference_indexer_logits(**to_cpu(inputs))
    bad = num_slots if bad_slot == "num_slots" else -1
    table = inputs["page_table_1"]
    table[0, 75:] = bad
    table[1, 70:] = bad  # beyond row 1's live length, inside its group's (read from row 0)
    table[2:] = bad  # rows the schedule skips (live <= skip_len)
    out = launch_indexer(inputs, num_sms=3, out_width=128, skip_len=skip_len,
                  rows_per_group=rows_per_group)
    for row in (0, 1):
        torch.testing.assert_close(out[row, :len(expected[row])].cpu(), expected[row],
                                   rtol=1e-5, atol=1e-5)
    table[0, 74] = bad
    with pytest.raises(ValueError, match=rf"page_table_1: slot {bad} at row 0, position 74 "
                                         rf"\(within the live length\) is out of range for a "
                                         rf"k_cache of 90 slots; expected 0 <= slot < 90"):
        launch_indexer(inputs, num_sms=3, out_width=128, skip_len=skip_len,
                rows_per_group=rows_per_group)


@pytest.mark.parametrize("seed", range(3))
def test_random_rows_repeated_slots(seed, device):
    gen = torch.Generator().manual_seed(seed)
    seqlens = torch.randint(0, 300, (9,), generator=gen).tolist()
    inputs = random_indexer_inputs(seqlens, 8, width=333, num_slots=17, device=device, seed=seed)
    out = launch_indexer(inputs, num_sms=5, out_width=320, skip_len=[0, 100, 64][seed])
    _assert_matches(out, inputs, rtol=1e-5, atol=1e-5, skip_len=[0, 100, 64][seed])


def test_out_narrower_than_block_edge(device):
    inputs = random_indexer_inputs([65, 70, 3], 4, width=80, num_slots=50, device=device)
    out = launch_indexer(inputs, num_sms=2, out_width=70)
    _assert_matches(out, inputs, rtol=1e-5, atol=1e-5)


def test_strided_views(device):
    inputs = random_indexer_inputs([130, 1, 64], 8, width=140, num_slots=64, device=device)
    q_big = torch.zeros(3, 10, 128, dtype=torch.bfloat16, device=device)
    q_big[:, 1:9] = inputs["q"]
    k_big = torch.zeros(64, 256, dtype=torch.bfloat16, device=device)
    k_big[:, 128:] = inputs["k_cache"]
    w_big = torch.zeros(3, 16, device=device)
    w_big[:, :8] = inputs["weights"]
    views = dict(inputs, q=q_big[:, 1:9], k_cache=k_big[:, 128:], weights=w_big[:, :8])
    out = launch_indexer(views, num_sms=4, out_width=192)
    _assert_matches(out, inputs, rtol=1e-5, atol=1e-5)


def test_bad_arguments(device):
    inputs = random_indexer_inputs([10, 20], 4, width=32, num_slots=8, device=device)
    schedule = torch.zeros(3, 2, dtype=torch.int32, device=device)
    out = torch.zeros(2, 32, device=device)
    with pytest.raises(ValueError, match="q: expected dtype torch.bfloat16, got torch.float32"):
        indexer_logits(**dict(inputs, q=inputs["q"].float()), schedule=schedule, out=out)
    with pytest.raises(ValueError, match=r"weights: expected shape \(2, 4\), got \(1, 4\)"):
        indexer_logits(**dict(inputs, weights=inputs["weights"][:1]), schedule=schedule, out=out)
    with pytest.raises(ValueError, match=r"schedule: expected a contiguous \[num_sms \+ 1, 2\]"):
        indexer_logits(**inputs, schedule=schedule[:1], out=out)
    with pytest.raises(ValueError, match=r"out: width 16 is smaller than the longest row "
                                         r"\(20 live tokens\)"):
        indexer_logits(**inputs, schedule=schedule, out=torch.zeros(2, 16, device=device))
    with pytest.raises(ValueError, match=r"page_table_1: width 32 is smaller than the longest "
                                         r"row \(40 live tokens\)"):
        long_rows = dict(inputs, seqlens=torch.tensor([10, 40], dtype=torch.int32, device=device))
        indexer_logits(**long_rows, schedule=schedule, out=torch.zeros(2, 64, device=device))
    # check_values=False skips only the checks that read device data
    with pytest.raises(ValueError, match="k_cache: expected dtype torch.bfloat16"):
        indexer_logits(**dict(inputs, k_cache=inputs["k_cache"].float()), schedule=schedule,
                       out=out, check_values=False)


GPU_WIDTH = 1_048_586  # 1M context + 4 + N with EAGLE 5/1/6


@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("num_rows, longest, skip_len",
                         [(1, 65_536, 0), (16, 4_097, 2048), (96, 65_536, 2048), (64, 8_192, 0)])
def test_gpu_production_sizes(config, num_rows, longest, skip_len):
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(num_rows)
    seqlens = torch.randint(0, longest + 1, (num_rows,), generator=gen)
    seqlens[0] = longest
    seqlens[-1] = 2048  # exactly the top-k: skipped when skip_len = 2048
    inputs = random_indexer_inputs(seqlens.tolist(), 32, width=GPU_WIDTH, num_slots=1 << 20,
                                   device=device, seed=1)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    out = launch_indexer(inputs, num_sms, out_width=GPU_WIDTH, skip_len=skip_len,
                  config=CONFIGS[config])
    # bf16 products are exact in fp32; only the accumulation order differs from the reference.
    _assert_matches(out, inputs, rtol=1e-4, atol=1e-4, skip_len=skip_len)


@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("rows_per_group", [4, 6])
def test_gpu_row_groups(config, rows_per_group):
    """Target verify at production sizes: 16 requests x N rows sharing their page tables."""
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(rows_per_group)
    seqlens = []
    for live in torch.randint(1, 70_000, (16,), generator=gen).tolist() + [2048, 2050]:
        seqlens += [live + j for j in range(rows_per_group)]
    inputs = random_indexer_inputs(seqlens, 32, width=GPU_WIDTH, num_slots=1 << 20, device=device,
                                   seed=2, rows_per_group=rows_per_group)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    out = launch_indexer(inputs, num_sms, out_width=GPU_WIDTH, skip_len=2048,
                  rows_per_group=rows_per_group, config=CONFIGS[config])
    _assert_matches(out, inputs, rtol=1e-4, atol=1e-4, skip_len=2048)


@pytest.mark.gpu
@pytest.mark.parametrize("skip_len", [0, 2048])
def test_gpu_cuda_graph_replay_with_new_lengths(skip_len):
    device = torch.device("cuda")
    num_rows, width, num_slots = 24, GPU_WIDTH, 1 << 18
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    inputs = random_indexer_inputs([width - 10] * num_rows, 32, width=width, num_slots=num_slots,
                                   device=device, seed=3)
    seqlens = inputs["seqlens"]
    seqlens.fill_(1)
    schedule = torch.zeros(num_sms + 1, 2, dtype=torch.int32, device=device)
    out = torch.zeros(num_rows, width, device=device)

    def step():
        indexer_schedule(seqlens, num_sms, schedule, skip_len=skip_len)
        indexer_logits(**inputs, schedule=schedule, out=out, skip_len=skip_len,
                       check_values=False)

    step()  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    gen = torch.Generator().manual_seed(0)
    for high in (3, 2_000, 4_100, 70_000):
        seqlens.copy_(torch.randint(0, high, (num_rows,), generator=gen, dtype=torch.int32))
        out.fill_(SENTINEL)
        graph.replay()
        torch.cuda.synchronize()
        _assert_matches(out, inputs, rtol=1e-4, atol=1e-4, skip_len=skip_len)


def test_group_width_bounded(device):
    """A row group holds at most MAX_GROUP_COLUMNS = 512 dot columns (powers of two of G and H):
    group_fits at the edges, and indexer_logits refuses a wider group naming rows_per_group (wider
    groups need more shared memory than an sm_90 block holds, or spill kilobytes)."""
    assert MAX_GROUP_COLUMNS == 512
    for rows, heads, fits in ((1, 1024, True), (8, 64, True), (5, 64, True), (9, 64, False), (16, 32, True),
                              (17, 32, False), (4, 128, True), (4, 129, False), (2, 256, True), (3, 256, False)):
        assert group_fits(rows, heads) is fits, (rows, heads)
    inputs = random_indexer_inputs([70] * 9, 64, width=80, num_slots=90, device=device, rows_per_group=9)
    with pytest.raises(ValueError, match="rows_per_group: a group of 9 rows of 64 index heads holds 1024 dot "
                                         "columns .*, more than MAX_GROUP_COLUMNS = 512"):
        launch_indexer(inputs, 2, out_width=80, rows_per_group=9)
