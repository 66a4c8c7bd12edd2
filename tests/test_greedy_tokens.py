"""greedy_tokens (one replicated head's argmax without the fp32 copy) and draft_finalize's fused carry
write-back against plain torch: ``torch.argmax(logits[:, :vocab].float())`` and index assignments.

The logits are ``adversarial_logits`` of test_argmax_exchange at TP 1 (ties, ±0, NaNs of every sign and
payload, ±inf, all -inf / all NaN rows, denormals; padding columns past the vocab poisoned with NaN,
+inf and huge values), checked against its numpy oracle ``first_max_index`` and torch.argmax.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsaspec.ops.argmax_exchange import CarryWrite, draft_finalize, greedy_tokens
from test_argmax_exchange import adversarial_logits, assert_margins_intact, between_nan_columns, first_max_index, \
    poisoned

# (vocab, width): odd vocabs, one column, a vocab of several 1024-column blocks (multi-split with
# split_columns 1024), and buffers padded past the vocab (padding poisoned)
CASES = [(1, 1), (5, 64), (63, 63), (129, 192), (777, 777), (3000, 3000), (5000, 5184)]


def check_greedy(logits, vocab, device, split_columns):
    rows = logits.shape[0]
    tokens, storage = poisoned((rows,), torch.int64, device, -7)
    greedy_tokens(logits, tokens, vocab_size=vocab, split_columns=split_columns)
    expected = first_max_index(logits[:, :vocab])
    assert torch.equal(torch.argmax(logits[:, :vocab].float(), dim=-1).cpu(), expected)
    assert torch.equal(tokens.cpu(), expected)
    assert_margins_intact(storage, -7, "tokens")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("vocab,width", CASES, ids=[f"{v}-w{w}" for v, w in CASES])
def test_greedy_tokens_match_torch_argmax(vocab, width, dtype, device):
    logits = adversarial_logits(18, vocab, width, 1, dtype, seed=vocab).to(device)
    if vocab == width:  # nothing past the vocab in the buffer: NaN columns just outside it
        logits = between_nan_columns(logits)
    check_greedy(logits, vocab, device, split_columns=1024)


@pytest.mark.parametrize("rows", [1, 2, 65])
def test_greedy_tokens_rows(rows, device):
    logits = adversarial_logits(rows, 700, 768, 1, torch.bfloat16, seed=rows).to(device)
    check_greedy(logits, 700, device, split_columns=256)


@pytest.mark.parametrize("vocab,dtype", [(154880, torch.bfloat16), (129280, torch.float32)])
def test_greedy_tokens_full_vocab_cpu_sized(vocab, dtype, device):
    logits = adversarial_logits(3, vocab, vocab + 64, 1, dtype, seed=vocab).to(device)
    check_greedy(logits, vocab, device, split_columns=4096)


@pytest.mark.parametrize("pad_len", [0, 1, 5])
@pytest.mark.parametrize("named", [True, False], ids=["padded", "unpadded"])
def test_carry_write_matches_index_assignments(pad_len, named, device):
    # The dummy row starts dirty: it is reset whether or not a (padded) row names it.
    table, dummy = 10, 9
    table_rows = torch.tensor([3, 7, 0] + [dummy] * (3 if named else 0), dtype=torch.int64, device=device)
    n = table_rows.shape[0]
    lens = torch.arange(100, 100 + n, dtype=torch.int64, device=device)
    logits = adversarial_logits(n, 300, 320, 1, torch.bfloat16, seed=n).to(device)
    carry_lens = torch.arange(-table, 0, dtype=torch.int64, device=device)
    carry_tokens = torch.arange(-2 * table, -table, dtype=torch.int64, device=device)
    expected_lens, expected_tokens = carry_lens.clone(), carry_tokens.clone()
    tokens = torch.empty(n, dtype=torch.int64, device=device)
    greedy_tokens(logits, tokens, vocab_size=300,
                  carry=CarryWrite(table_rows, lens, carry_lens, carry_tokens, dummy, pad_len))
    expected = torch.argmax(logits[:, :300].float(), dim=-1)
    assert torch.equal(tokens, expected)
    expected_lens[table_rows] = lens
    expected_tokens[table_rows] = expected
    expected_lens[dummy], expected_tokens[dummy] = pad_len, 0
    assert torch.equal(carry_lens, expected_lens)
    assert torch.equal(carry_tokens, expected_tokens)


def test_carry_write_from_argmax_tokens(device):
    # The gather path (TP > 1 without a processor) writes the same carry from torch.argmax's tokens.
    table_rows = torch.tensor([4, 1, 5, 5], dtype=torch.int64, device=device)
    lens = torch.tensor([8, 9, 10, 11], dtype=torch.int64, device=device)
    argmax = torch.tensor([11, 22, 33, 44], dtype=torch.int64, device=device)
    carry_lens = torch.full((6,), -1, dtype=torch.int64, device=device)
    carry_tokens = torch.full((6,), -1, dtype=torch.int64, device=device)
    tokens = torch.empty(4, dtype=torch.int64, device=device)
    carry = CarryWrite(table_rows, lens, carry_lens, carry_tokens, 5, 2)
    draft_finalize(tokens=tokens, argmax_tokens=argmax, carry=carry)
    assert torch.equal(tokens, argmax)
    assert carry_lens.tolist() == [-1, 9, -1, -1, 8, 2]
    assert carry_tokens.tolist() == [-1, 22, -1, -1, 11, 0]


def test_greedy_tokens_argument_errors(device):
    logits = torch.zeros(2, 64, dtype=torch.bfloat16, device=device)
    tokens = torch.empty(2, dtype=torch.int64, device=device)
    rows64 = torch.zeros(2, dtype=torch.int64, device=device)
    carry = torch.zeros(8, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match=r"logits must be \[rows, >= vocab_size=65\]"):
        greedy_tokens(logits, tokens, vocab_size=65)
    with pytest.raises(ValueError, match=r"logits must be \[rows, >= vocab_size=0\]"):
        greedy_tokens(logits, tokens, vocab_size=0)
    with pytest.raises(ValueError, match=r"tokens must be a contiguous int64 \[2\]"):
        greedy_tokens(logits, tokens.int(), vocab_size=64)
    with pytest.raises(TypeError, match="local_logits must be bf16 or fp32"):
        greedy_tokens(logits.half(), tokens, vocab_size=64)
    with pytest.raises(ValueError, match=r"tokens must be a contiguous int64 \[2\] .one entry per row of "
                                         r"logits., got \(1,\)"):
        greedy_tokens(logits, tokens[:1], vocab_size=64)
    cases = [
        (CarryWrite(rows64.int(), rows64, carry, carry, 7, 0), r"carry.table_rows must be a contiguous 1-D int64"),
        (CarryWrite(rows64, rows64[:1], carry, carry, 7, 0),
         r"carry.lens must be .* one entry per row of tokens \(2\)"),
        (CarryWrite(rows64, rows64, carry[::2], carry, 7, 0), r"carry.carry_lens must be a contiguous 1-D int64"),
        (CarryWrite(rows64, rows64, carry, carry[:7], 7, 0), r"carry.carry_tokens must have carry.carry_lens' 8"),
        (CarryWrite(rows64, rows64, carry, carry, 8, 0), r"carry.dummy_row must be in \[0, 8\), got 8"),
        (CarryWrite(rows64, rows64, carry, carry, 7, -1), r"carry.pad_len must be in \[0, 2\*\*62\), got -1"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            greedy_tokens(logits, tokens, vocab_size=64, carry=bad)


# Compiles (instead of launching) the two kernels of a bs-64 greedy_tokens at vocab 154,880, the finalize
# with its carry write at pad_len 0 and 1 and dummy row 1 (the JIT passes an int argument equal to 1
# as a constant, which the interpreter never does); prints "regs spill_stores" per compile.
COMPILE_SM90 = """
from dsaspec.testing.offline_compile import compile_instead_of_launch, compile_only_environment, fresh_cache_dir
compile_only_environment()
import torch
from triton import knobs
from dsaspec.ops import argmax_exchange as a
knobs.nvidia.dump_ptxas_log = True
rows, vocab = 64, 154880
splits, _ = a.exchange_layout(vocab)
reduced = torch.zeros(rows, splits, 4)
tokens, table_rows, lens = (torch.zeros(rows, dtype=torch.int64) for _ in range(3))
launches = [(a._argmax_partials_kernel, lambda: a.argmax_partials(torch.zeros(rows, vocab, dtype=torch.bfloat16),
                                                                  reduced, rank=0, tp_size=1, vocab_size=vocab))]
for pad_len, dummy in ((0, 7), (1, 1)):
    carry = a.CarryWrite(table_rows, lens, torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int64),
                         dummy, pad_len)
    launches.append((a._draft_finalize_kernel, lambda carry=carry: a.draft_finalize(tokens=tokens, reduced=reduced,
                                                                                    carry=carry)))
for kernel, launch in launches:
    record = {}
    fresh_cache_dir()
    with compile_instead_of_launch(kernel, record):
        launch()
    print(record["regs"], record["spill_stores"] or 0)
"""


def test_kernels_compile_for_sm90_without_spills():
    """Without a GPU: greedy_tokens' partials and its finalize with the carry write compile for sm_90
    without register spills (in a subprocess: it compiles instead of interpreting)."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", COMPILE_SM90], capture_output=True, text=True, timeout=600,
                          env=env, cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [tuple(map(int, line.split())) for line in proc.stdout.split("\n") if line.strip()]
    assert len(results) == 3 and all(0 < regs <= 255 and spilled == 0 for regs, spilled in results), proc.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [154880, 129280, 151936])
def test_greedy_tokens_full_vocab_gpu(vocab):
    for rows, dtype in ((1, torch.bfloat16), (32, torch.float32), (64, torch.bfloat16)):
        logits = adversarial_logits(rows, vocab, vocab, 1, dtype, seed=rows).to("cuda")
        check_greedy(logits, vocab, "cuda", split_columns=4096)
    logits = (torch.randn(512, vocab, device="cuda") * 3).to(torch.bfloat16)  # a few rows with tied maxima
    full = logits.float()
    assert ((full == full.max(dim=1, keepdim=True).values).sum(dim=1) > 1).any()
    tokens = torch.empty(512, dtype=torch.int64, device="cuda")
    assert torch.equal(greedy_tokens(logits, tokens, vocab_size=vocab), torch.argmax(full, dim=-1))


@pytest.mark.gpu
def test_greedy_tokens_with_carry_in_cuda_graph():
    vocab, rows, table = 154880, 32, 40
    logits = torch.empty(rows, vocab, dtype=torch.bfloat16, device="cuda")
    tokens = torch.empty(rows, dtype=torch.int64, device="cuda")
    table_rows = torch.empty(rows, dtype=torch.int64, device="cuda")
    lens = torch.empty(rows, dtype=torch.int64, device="cuda")
    carry_lens = torch.zeros(table, dtype=torch.int64, device="cuda")
    carry_tokens = torch.zeros(table, dtype=torch.int64, device="cuda")
    carry = CarryWrite(table_rows, lens, carry_lens, carry_tokens, table - 1, 0)

    def step():
        greedy_tokens(logits, tokens, vocab_size=vocab, carry=carry)

    logits.copy_(adversarial_logits(rows, vocab, vocab, 1, torch.bfloat16, seed=0))
    table_rows.copy_(torch.arange(rows))
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(3):
        logits.copy_(adversarial_logits(rows, vocab, vocab, 1, torch.bfloat16, seed=seed + 1))
        live = rows - 4 * seed
        table_rows.copy_(torch.tensor(list(range(seed, seed + live)) + [table - 1] * (rows - live)))
        lens.copy_(torch.randint(1, 1000, (rows,)))
        expected_lens, expected_tokens = carry_lens.clone(), carry_tokens.clone()
        graph.replay()
        torch.cuda.synchronize()
        expected = torch.argmax(logits.float(), dim=-1)
        assert torch.equal(tokens, expected)
        expected_lens[table_rows[:live]] = lens[:live]
        expected_tokens[table_rows[:live]] = expected[:live]
        expected_lens[table - 1], expected_tokens[table - 1] = 0, 0
        assert torch.equal(carry_lens, expected_lens) and torch.equal(carry_tokens, expected_tokens)
