"""sparse_mla_decode against the fp32 reference: ragged counts, holes, repeats, poisoned cache."""

import pytest
import torch

from dsaspec.ops.indexer import indexer_logits
from dsaspec.ops.indexer_schedule import indexer_schedule
from dsaspec.ops.sparse_mla import sparse_mla_decode, sparse_mla_workspace
from dsaspec.ops.topk import topk_slots
from dsaspec.reference.indexer import random_indexer_inputs, reference_indexer_logits
from dsaspec.reference.sparse_mla import random_sparse_mla_inputs, reference_sparse_mla_decode
from dsaspec.reference.topk import reference_topk_slots


def _poison_unselected(inputs):
    """NaN in every cache row no slot points at: reading one would poison the output."""
    kv_cache = inputs["kv_cache"].clone()
    selected = torch.zeros(kv_cache.shape[0], dtype=torch.bool, device=kv_cache.device)
    chosen = inputs["slots"][inputs["slots"] >= 0].long()
    selected[chosen] = True
    kv_cache[~selected] = float("nan")
    return dict(inputs, kv_cache=kv_cache)


def _run_and_compare(inputs, atol, rtol, workspace=None):
    q = inputs["q"]
    out = torch.full((q.shape[0], q.shape[1], 512), 7.0, dtype=torch.bfloat16, device=q.device)
    sparse_mla_decode(**inputs, out=out, workspace=workspace)
    expected = reference_sparse_mla_decode(**{name: value.cpu() if torch.is_tensor(value) else value
                                              for name, value in inputs.items()})
    torch.testing.assert_close(out.float().cpu(), expected, atol=atol, rtol=rtol)


EDGE_COUNTS = [0, 1, 31, 32, 33, 63, 64]


@pytest.mark.parametrize("num_heads", [4, 16, 20])
def test_edge_valid_counts(num_heads, device):
    inputs = random_sparse_mla_inputs(len(EDGE_COUNTS), num_heads, num_slots=200, k=64,
                                      valid_counts=EDGE_COUNTS, device=device, seed=num_heads)
    _run_and_compare(_poison_unselected(inputs), atol=1e-3, rtol=1e-2)


def test_holes_and_repeats(device):
    """-1 entries anywhere in a row are skipped; a repeated slot counts once per occurrence."""
    gen = torch.Generator().manual_seed(1)
    inputs = random_sparse_mla_inputs(5, 8, num_slots=6, k=100, valid_counts=[100] * 5,
                                      device=device, seed=1)
    slots = inputs["slots"].cpu()
    slots[torch.rand(slots.shape, generator=gen) < 0.4] = -1
    slots[1] = -1
    slots[2, -1] = 3  # only the very last entry valid
    slots[2, :-1] = -1
    inputs["slots"] = slots.to(device)
    _run_and_compare(_poison_unselected(inputs), atol=1e-3, rtol=1e-2)


def test_peaked_scores(device):
    """Large scale: softmax is nearly one-hot, so the running max and rescaling must be right."""
    inputs = random_sparse_mla_inputs(3, 8, num_slots=300, k=96, valid_counts=[96, 50, 70],
                                      device=device, seed=2)
    inputs["sm_scale"] = 0.5
    _run_and_compare(inputs, atol=1e-3, rtol=1e-2)


def test_strided_views(device):
    inputs = random_sparse_mla_inputs(3, 8, num_slots=40, k=48, valid_counts=[48, 7, 0],
                                      device=device, seed=3)
    q_big = torch.zeros(3, 9, 640, dtype=torch.bfloat16, device=device)
    q_big[:, 1:, :576] = inputs["q"]
    kv_big = torch.zeros(40, 1152, dtype=torch.bfloat16, device=device)
    kv_big[:, 576:] = inputs["kv_cache"]
    slots_big = torch.full((3, 64), 999, dtype=torch.int32, device=device)
    slots_big[:, :48] = inputs["slots"]
    views = dict(inputs, q=q_big[:, 1:, :576], kv_cache=kv_big[:, 576:], slots=slots_big[:, :48])
    out_big = torch.zeros(3, 8, 1024, dtype=torch.bfloat16, device=device)
    sparse_mla_decode(**views, out=out_big[:, :, 256:768])
    expected = reference_sparse_mla_decode(**{name: value.cpu() if torch.is_tensor(value) else value
                                              for name, value in inputs.items()})
    torch.testing.assert_close(out_big[:, :, 256:768].float().cpu(), expected, atol=1e-3, rtol=1e-2)
    assert torch.all(out_big[:, :, :256] == 0) and torch.all(out_big[:, :, 768:] == 0)


def test_bad_arguments(device):
    inputs = random_sparse_mla_inputs(2, 4, num_slots=10, k=8, valid_counts=[8, 8], device=device)
    out = torch.zeros(2, 4, 512, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="q"):
        sparse_mla_decode(**dict(inputs, q=inputs["q"][..., :512]), out=out)
    with pytest.raises(ValueError, match="out"):
        sparse_mla_decode(**inputs, out=out.float())
    with pytest.raises(ValueError, match="slots"):
        bad = inputs["slots"].clone()
        bad[0, 0] = 10
        sparse_mla_decode(**dict(inputs, slots=bad), out=out)
    with pytest.raises(ValueError, match="workspace"):
        sparse_mla_decode(**inputs, out=out, workspace=torch.zeros(2, 4, 2, 512, device=device))


# On the GPU the kernel multiplies bf16 probabilities with the bf16 cache on the tensor cores
# (fp32 accumulation over up to 2048 slots) and rounds the output to bf16: measured on an H200,
# up to 2.1e-3 absolute error against the fp32 reference at k = 2048.
GPU_ATOL = 3e-3


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("num_heads", [64, 128])
@pytest.mark.parametrize("num_rows", [1, 16, 96])
def test_gpu_production_sizes(num_heads, num_rows, split):
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(num_rows)
    counts = torch.randint(0, 2049, (num_rows,), generator=gen)
    counts[0] = 2048
    inputs = random_sparse_mla_inputs(num_rows, num_heads, num_slots=1 << 20, k=2048,
                                      valid_counts=counts.tolist(), device=device, seed=num_heads)
    workspace = sparse_mla_workspace(num_rows, num_heads, device) if split else None
    _run_and_compare(inputs, atol=GPU_ATOL, rtol=1e-2, workspace=workspace)


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True])
def test_gpu_cuda_graph_replay_with_new_slots(split):
    device = torch.device("cuda")
    num_rows, num_heads, k, num_slots = 24, 64, 2048, 1 << 18
    inputs = random_sparse_mla_inputs(num_rows, num_heads, num_slots, k, [0] * num_rows, device)
    out = torch.zeros(num_rows, num_heads, 512, dtype=torch.bfloat16, device=device)
    workspace = sparse_mla_workspace(num_rows, num_heads, device) if split else None
    sparse_mla_decode(**inputs, out=out, workspace=workspace)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sparse_mla_decode(**inputs, out=out, check_values=False, workspace=workspace)
    gen = torch.Generator().manual_seed(0)
    for high in (1, 100, k):
        counts = torch.randint(0, high + 1, (num_rows,), generator=gen).tolist()
        fresh = random_sparse_mla_inputs(num_rows, num_heads, num_slots, k, counts, "cpu",
                                         seed=high)
        inputs["slots"].copy_(fresh["slots"])
        graph.replay()
        torch.cuda.synchronize()
        expected = reference_sparse_mla_decode(inputs["q"].cpu(), inputs["kv_cache"].cpu(),
                                               fresh["slots"], inputs["sm_scale"])
        torch.testing.assert_close(out.float().cpu(), expected, atol=GPU_ATOL, rtol=1e-2)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 5])
def test_split_workspace(num_splits, device):
    """Split runs (some empty: fewer blocks than splits) combine to the single-pass answer."""
    counts = [0, 1, 33, 100, 128, 64]
    inputs = random_sparse_mla_inputs(len(counts), 8, num_slots=500, k=128, valid_counts=counts,
                                      device=device, seed=num_splits)
    slots = inputs["slots"].cpu()
    slots[3, 5:40] = -1  # a hole spanning a whole split
    inputs = _poison_unselected(dict(inputs, slots=slots.to(device)))
    workspace = sparse_mla_workspace(len(counts), 8, device, num_splits=num_splits)
    workspace.fill_(float("nan"))
    _run_and_compare(inputs, atol=1e-3, rtol=1e-2, workspace=workspace)


def test_decode_chain_indexer_topk_attention(device):
    """Schedule -> indexer logits -> top-k slots -> sparse attention, each stage checked against
    its reference on the previous stage's output (mixed decode / verify-style ragged rows)."""
    seqlens = [0, 1, 64, 65, 130, 131, 132, 200]
    k, width, num_slots = 64, 224, 400
    indexer_inputs = random_indexer_inputs(seqlens, 8, width=width, num_slots=num_slots,
                                           device=device, seed=11)
    schedule = torch.zeros(5, 2, dtype=torch.int32, device=device)
    indexer_schedule(indexer_inputs["seqlens"], 4, schedule)
    logits = torch.full((len(seqlens), width), float("nan"), device=device)
    indexer_logits(**indexer_inputs, schedule=schedule, out=logits)
    cpu = {name: value.cpu() for name, value in indexer_inputs.items()}
    for row, want in enumerate(reference_indexer_logits(**cpu)):
        torch.testing.assert_close(logits[row, :want.numel()].cpu(), want, rtol=1e-5, atol=1e-5)

    slots = torch.empty(len(seqlens), k, dtype=torch.int32, device=device)
    topk_slots(logits, indexer_inputs["seqlens"], indexer_inputs["page_table_1"], k, slots)
    assert torch.equal(slots.cpu(), reference_topk_slots(logits.cpu(), cpu["seqlens"],
                                                          cpu["page_table_1"], k))

    attention = random_sparse_mla_inputs(len(seqlens), 16, num_slots=num_slots, k=k,
                                         valid_counts=[0] * len(seqlens), device=device, seed=12)
    _run_and_compare(dict(attention, slots=slots), atol=1e-3, rtol=1e-2)
