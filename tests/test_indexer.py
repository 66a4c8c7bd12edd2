"""indexer_logits against the dense reference over ragged live lengths and a poisoned page table."""

import pytest
import torch

from dsaspec.ops.indexer import indexer_logits
from dsaspec.ops.indexer_schedule import indexer_schedule
from dsaspec.reference.indexer import random_indexer_inputs, reference_indexer_logits

EDGE_LENGTHS = [0, 1, 63, 64, 65, 127, 128, 129]
SENTINEL = 12345.0  # what `out` holds before the call


def _launch(inputs, num_sms, out_width, check=True):
    seqlens = inputs["seqlens"]
    schedule = torch.zeros(num_sms + 1, 2, dtype=torch.int32, device=seqlens.device)
    indexer_schedule(seqlens, num_sms, schedule)
    out = torch.full((seqlens.numel(), out_width), SENTINEL, device=seqlens.device)
    indexer_logits(**inputs, schedule=schedule, out=out, check_values=check)
    return out


def _assert_matches(out, inputs, rtol, atol):
    expected = reference_indexer_logits(**{name: value.cpu() for name, value in inputs.items()})
    out = out.cpu()
    for row, want in enumerate(expected):
        length = want.numel()
        edge = min(-(-length // 64) * 64, out.shape[1])
        torch.testing.assert_close(out[row, :length], want, rtol=rtol, atol=atol)
        assert torch.all(out[row, length:edge] == float("-inf")), row
        assert torch.all(out[row, edge:] == SENTINEL), row


@pytest.mark.parametrize("num_heads", [4, 8, 32])
@pytest.mark.parametrize("num_sms", [1, 3, 7])
def test_edge_lengths(num_heads, num_sms, device):
    seqlens = EDGE_LENGTHS + [5, 0]
    inputs = random_indexer_inputs(seqlens, num_heads, width=200, num_slots=300, device=device,
                                   seed=num_heads * 10 + num_sms)
    out = _launch(inputs, num_sms, out_width=256)
    _assert_matches(out, inputs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_random_rows_repeated_slots(seed, device):
    gen = torch.Generator().manual_seed(seed)
    seqlens = torch.randint(0, 300, (9,), generator=gen).tolist()
    inputs = random_indexer_inputs(seqlens, 8, width=333, num_slots=17, device=device, seed=seed)
    out = _launch(inputs, num_sms=5, out_width=320)
    _assert_matches(out, inputs, rtol=1e-5, atol=1e-5)


def test_out_narrower_than_block_edge(device):
    inputs = random_indexer_inputs([65, 70, 3], 4, width=80, num_slots=50, device=device)
    out = _launch(inputs, num_sms=2, out_width=70)
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
    out = _launch(views, num_sms=4, out_width=192)
    _assert_matches(out, inputs, rtol=1e-5, atol=1e-5)


def test_bad_arguments(device):
    inputs = random_indexer_inputs([10, 20], 4, width=32, num_slots=8, device=device)
    schedule = torch.zeros(3, 2, dtype=torch.int32, device=device)
    out = torch.zeros(2, 32, device=device)
    with pytest.raises(ValueError, match="q"):
        indexer_logits(**dict(inputs, q=inputs["q"].float()), schedule=schedule, out=out)
    with pytest.raises(ValueError, match="weights"):
        indexer_logits(**dict(inputs, weights=inputs["weights"][:1]), schedule=schedule, out=out)
    with pytest.raises(ValueError, match="out"):
        indexer_logits(**inputs, schedule=schedule, out=torch.zeros(2, 16, device=device))
    with pytest.raises(ValueError, match="page_table_1: width"):
        long_rows = dict(inputs, seqlens=torch.tensor([10, 40], dtype=torch.int32, device=device))
        indexer_logits(**long_rows, schedule=schedule, out=torch.zeros(2, 64, device=device))


GPU_WIDTH = 1_048_586  # 1M context + 4 + N with EAGLE 5/1/6


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows, longest", [(1, 65_536), (16, 4_097), (96, 65_536)])
def test_gpu_production_sizes(num_rows, longest):
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(num_rows)
    seqlens = torch.randint(0, longest + 1, (num_rows,), generator=gen)
    seqlens[0] = longest
    inputs = random_indexer_inputs(seqlens.tolist(), 32, width=GPU_WIDTH, num_slots=1 << 20,
                                   device=device, seed=1)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    out = _launch(inputs, num_sms, out_width=GPU_WIDTH)
    # bf16 products are exact in fp32; only the accumulation order differs from the reference.
    _assert_matches(out, inputs, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_new_lengths():
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
        indexer_schedule(seqlens, num_sms, schedule)
        indexer_logits(**inputs, schedule=schedule, out=out, check_values=False)

    step()  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    gen = torch.Generator().manual_seed(0)
    for high in (3, 2_000, 70_000):
        seqlens.copy_(torch.randint(0, high, (num_rows,), generator=gen, dtype=torch.int32))
        out.fill_(SENTINEL)
        graph.replay()
        torch.cuda.synchronize()
        _assert_matches(out, inputs, rtol=1e-4, atol=1e-4)
