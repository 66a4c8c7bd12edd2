"""The decode step's input kernel (dsaspec.ops.decode_inputs) against the plain torch ops, exactly:
row counts 1 .. 300 around the 128-row programs, int32 and int64 tables, repeated rows and the
padded rows of a bucket (the dummy row), outputs that are rows of one wider ``[6, max]`` buffer
poisoned first (every element of the batch written, nothing past it), range checks naming the
argument, DecodeWorker choosing it with the Triton ops, the sm_90 compile; on the GPU the same
against torch on CUDA.
"""

import pytest
import torch

from compile_scripts import run_in_scripts
from dsaspec.ops.decode_inputs import decode_inputs

ROWS = (1, 2, 63, 64, 65, 127, 128, 129, 300)
POISON = -(2 ** 62) + 17
NAMES = ("positions", "input_ids", "seq_lens", "out_cache_loc")


def reference(rows, carry_lens, carry_tokens, req_to_token) -> dict:
    """The five torch launches of ``DecodeWorker._gather``: int64 ``[n]`` each."""
    positions = torch.index_select(carry_lens, 0, rows)
    out_cache_loc = torch.empty_like(positions)
    out_cache_loc.copy_(req_to_token[rows, positions])
    return dict(positions=positions, input_ids=torch.index_select(carry_tokens, 0, rows),
                seq_lens=torch.add(positions, 1), out_cache_loc=out_cache_loc)


def _table(table_rows: int, width: int, dtype, seed: int, device):
    """Random carry (lengths in [0, width), tokens up to 2**40) and slots (int32 range), the last row
    the dummy row: length 0, token 0, every slot 0 (the sink)."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, width, (table_rows,), generator=gen)
    tokens = torch.randint(0, 2 ** 40, (table_rows,), generator=gen)
    table = torch.randint(-2 ** 31, 2 ** 31, (table_rows, width), generator=gen).to(dtype)
    lens[-1], tokens[-1], table[-1] = 0, 0, 0
    return lens.to(device), tokens.to(device), table.to(device)


def _outputs(n: int, capacity: int, device):
    """Rows of one ``[6, capacity]`` int64 buffer, poisoned, as ``_DecodeBatch`` views them."""
    data = torch.full((6, capacity), POISON, dtype=torch.int64, device=device)
    return data, {name: data[1 + i, :n] for i, name in enumerate(NAMES)}


@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("n", ROWS)
def test_bit_for_bit_with_padding_and_repeats(n, table_dtype, device):
    """Random rows with repeats and the last quarter padding (the dummy row), at the start of a
    wider poisoned buffer: every output element equal to the torch ops', columns past ``n`` left
    poisoned, the inputs untouched."""
    table_rows = 37
    lens, tokens, table = _table(table_rows, 300, table_dtype, seed=n, device=device)
    gen = torch.Generator().manual_seed(1000 + n)
    rows = torch.randint(0, table_rows - 1, (n,), generator=gen)
    rows[n - n // 4:] = table_rows - 1
    rows = rows.to(device)
    inputs = [t.clone() for t in (rows, lens, tokens, table)]
    data, outs = _outputs(n, n + 20, device)
    decode_inputs(rows, lens, tokens, table, **outs)
    want = reference(rows, lens, tokens, table)
    for name in NAMES:
        assert outs[name].dtype == torch.int64 and torch.equal(outs[name], want[name]), name
    assert (data[1:5, n:] == POISON).all() and (data[0] == POISON).all() and (data[5] == POISON).all()
    assert all(torch.equal(a, b) for a, b in zip(inputs, (rows, lens, tokens, table)))


def test_every_row_of_a_large_table(device):
    """Every row of a 1000-row table once (out of order), each position the last column of its row:
    the table's stride and the far end of each row."""
    lens, tokens, table = _table(1000, 2051, torch.int32, seed=3, device=device)
    lens.fill_(2050)
    rows = torch.randperm(1000, generator=torch.Generator().manual_seed(4)).to(device)
    _, outs = _outputs(1000, 1000, device)
    decode_inputs(rows, lens, tokens, table, **outs)
    want = reference(rows, lens, tokens, table)
    assert all(torch.equal(outs[name], want[name]) for name in NAMES)


def test_value_checks_name_the_argument(device):
    lens, tokens, table = _table(9, 16, torch.int32, seed=0, device=device)
    _, outs = _outputs(2, 2, device)
    with pytest.raises(ValueError, match=r"rows: every row must lie in \[0, 9\)"):
        decode_inputs(torch.tensor([0, 9], device=device), lens, tokens, table, **outs, check_values=True)
    with pytest.raises(ValueError, match=r"rows: every row must lie"):
        decode_inputs(torch.tensor([-1, 0], device=device), lens, tokens, table, **outs, check_values=True)
    lens[3] = 16
    with pytest.raises(ValueError, match=r"carry_lens: the rows' positions must lie in \[0, 16\)"):
        decode_inputs(torch.tensor([3, 0], device=device), lens, tokens, table, **outs, check_values=True)
    decode_inputs(torch.tensor([4, 0], device=device), lens, tokens, table, **outs, check_values=True)


def test_bad_arguments(device):
    lens, tokens, table = _table(9, 16, torch.int32, seed=0, device=device)
    rows = torch.tensor([0, 1], device=device)
    _, outs = _outputs(2, 2, device)
    with pytest.raises(ValueError, match="rows: expected dtype torch.int64"):
        decode_inputs(rows.int(), lens, tokens, table, **outs)
    with pytest.raises(ValueError, match="req_to_token: expected dtype"):
        decode_inputs(rows, lens, tokens, table.float(), **outs)
    with pytest.raises(ValueError, match="carry_lens: expected shape"):
        decode_inputs(rows, lens[:8], tokens, table, **outs)
    with pytest.raises(ValueError, match="carry_tokens: expected dtype"):
        decode_inputs(rows, lens, tokens.int(), table, **outs)
    with pytest.raises(ValueError, match="out_cache_loc: expected shape"):
        decode_inputs(rows, lens, tokens, table, **(outs | dict(out_cache_loc=outs["out_cache_loc"][:1])))
    with pytest.raises(ValueError, match="seq_lens: the last dimension must be contiguous"):
        decode_inputs(rows, lens, tokens, table, **(outs | dict(seq_lens=torch.zeros(2, 2, dtype=torch.int64,
                                                                                     device=device)[:, 0])))
    decode_inputs(rows[:0], lens, tokens, table, *(t[:0] for t in outs.values()))   # nothing to do


@pytest.mark.interpreter
def test_decode_worker_chooses_the_kernel(monkeypatch):
    """DecodeWorker's step inputs come from the kernel with the model's Triton ops and from the torch
    ops without; both write the same values into the static batch, padded rows included."""
    import dsaspec.executor.decode_worker as module
    from dsaspec.configs.model_config import get_config
    from dsaspec.configs.runtime_options import RuntimeOptions
    from dsaspec.engine.engine import Engine
    from dsaspec.models.dsa_model import DSAModel

    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return decode_inputs(*args, **kwargs)

    monkeypatch.setattr(module, "decode_inputs", counted)
    model = DSAModel(get_config("tiny"), use_triton=True, options=RuntimeOptions(metadata_program_budget=8))
    model.init_weights(0)
    engine = Engine(model, context_len=128, max_batch=3, bucket_sizes=(4,), progress=False)
    worker = engine.worker
    assert isinstance(worker, module.DecodeWorker)
    worker.state.seq_lens[:3] = torch.tensor([5, 17, 9])
    worker.state.bonus[:3] = torch.tensor([11, 12, 13])
    calls.clear()
    worker.load([2, 0, 1], 4)
    worker.prepare(4)
    assert calls == [dict(check_values=False)]
    batch = worker._static.view(4)
    got = {name: getattr(batch, name).clone() for name in NAMES}
    model.use_triton = False
    worker.prepare(4)
    assert len(calls) == 1
    for name in NAMES:
        assert torch.equal(got[name], getattr(batch, name)), name
    assert got["positions"].tolist() == [9, 5, 17, 0] and got["input_ids"].tolist() == [13, 11, 12, 0]


@pytest.mark.gpu
def test_gpu_bit_for_bit_with_torch_cuda():
    device = torch.device("cuda")
    for table_dtype in (torch.int32, torch.int64):
        for n in ROWS + (512,):
            test_bit_for_bit_with_padding_and_repeats(n, table_dtype, device)
    test_every_row_of_a_large_table(device)


def test_compiles_for_sm90():
    """Without a GPU: the kernel compiles for sm_90 without spilled registers
    (scripts/compile_decode_epilogues.py's compile, in a subprocess)."""
    out = run_in_scripts("compile_decode_epilogues",
                         "r = c.compile_decode_inputs()\nprint(r['regs'], r['spill'])")
    regs, spilled = map(int, out.split()[-2:])
    assert 0 < regs <= 255 and spilled == 0, out
