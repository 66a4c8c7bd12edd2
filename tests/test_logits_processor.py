"""LogitsProcessor: the opt-in protocol of the argmax exchange, the gather path, the greedy draft step.

Decisions at TP > 1 are checked with a stand-in group that carries a TP group's replicated facts
(size, rank, transport) without torch.distributed; forwards run at TP 1 here (CPU interpreter or one
GPU) and at TP 2 in tests/test_tp_group.py.
"""

import pytest
import torch

from dsaspec.distributed.tp_group import DEFAULT_SYMM_MEM_MAX_BYTES, LOCAL, NCCL, SYMM_MEM, TPGroup
from dsaspec.ops.argmax_exchange import TOPK_SPLIT_COLUMNS, exchange_layout
from dsaspec.reference.argmax_exchange import gathered_logits_reference
from dsaspec.speculative.draft_step import greedy_draft_step, topk_draft_step
from dsaspec.layers.vocab_parallel import VocabParallelLMHead, padded_vocab_size
from dsaspec.layers.logits_processor import GREEDY_TOPK1, DraftSampling, LogitsProcessor
from test_argmax_exchange import first_max_index, probability_errors, stable_topk_oracle

# the environment switches of the two options: set to the other value, they must change nothing
KILL_SWITCH = "DSASPEC_SPEC_DRAFT_ARGMAX_EXCHANGE"
VERIFY_SWITCH = "DSASPEC_SPEC_VERIFY_ARGMAX_EXCHANGE"


class FactsOnlyGroup(TPGroup):
    """A TP group's replicated facts (size, rank, transport) without torch.distributed: for decisions only."""

    def __init__(self, size, transport, rank=0, symm_mem_max_bytes=DEFAULT_SYMM_MEM_MAX_BYTES):
        self.size, self.rank, self.transport = size, rank, transport
        self.device = torch.device("cpu")
        self.process_group = self.group_name = None
        self.symm_mem_max_bytes = symm_mem_max_bytes
        self._symmetric_storages = set()

    def symmetric_empty(self, numel, dtype=torch.float32):
        return torch.empty(numel, dtype=dtype)


def make_processor(group, vocab=1000, hidden=32, dtype=torch.float32, opt_in=True, vocab_parallel=True, seed=0,
                   max_topk=1, **kwargs):
    head = VocabParallelLMHead(vocab, hidden, group, dtype=dtype, vocab_parallel=vocab_parallel)
    weight = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(seed))
    head.load_weight(weight)
    processor = LogitsProcessor(head, **kwargs)
    if opt_in:
        processor.enable_draft_argmax_exchange(max_topk=max_topk)
        processor.enable_verify_argmax_exchange()
    return processor, weight.to(group.device)


# -- protocol (decisions) -------------------------------------------------------------------------

def test_not_opted_in_always_gathers(device):
    processor, _ = make_processor(TPGroup.single(device), opt_in=False)
    assert "did not opt in" in processor.draft_argmax_exchange_declined(GREEDY_TOPK1)
    assert processor.verify_argmax_exchange_declined() == \
        "the processor did not opt in (enable_verify_argmax_exchange)"
    out = processor.forward(torch.randn(3, 32, device=device), GREEDY_TOPK1)
    assert out.next_token_logits is not None and out.next_token_argmax_partials is None and out.next_token_ids is None


@pytest.mark.parametrize("transport", [SYMM_MEM, LOCAL])
def test_opted_in_exchanges_when_eligible(transport):
    size = 1 if transport == LOCAL else 4
    processor, _ = make_processor(FactsOnlyGroup(size, transport, rank=size - 1))
    assert processor.draft_argmax_exchange_declined(GREEDY_TOPK1) is None
    assert processor.uses_draft_argmax_exchange(DraftSampling(topk=1, greedy=True))


@pytest.mark.parametrize("case,reason", [
    ("no_sampling", "not a greedy draft"),
    ("sampling", "not a greedy draft"),
    ("topk2", "topk is 2"),
    ("replicated_head", "replicated"),
    ("softcap", "softcapping"),
    ("dp_attention", "DP attention"),
    ("nccl", "NCCL"),
    ("too_big_for_symm_mem", "NCCL"),
    ("option_off", "draft_argmax_exchange=False (the processor's option)"),
])
def test_each_fallback_declines(case, reason):
    group = FactsOnlyGroup(2, NCCL if case == "nccl" else SYMM_MEM, rank=1,
                           symm_mem_max_bytes=64 if case == "too_big_for_symm_mem" else DEFAULT_SYMM_MEM_MAX_BYTES)
    kwargs = {"final_logit_softcapping": 30.0} if case == "softcap" else {}
    kwargs.update({"dp_attention": True} if case == "dp_attention" else {})
    kwargs.update({"draft_argmax_exchange": False} if case == "option_off" else {})
    processor, _ = make_processor(group, vocab_parallel=case != "replicated_head", **kwargs)
    sampling = {"no_sampling": None, "sampling": DraftSampling(topk=1, greedy=False),
                "topk2": DraftSampling(topk=2)}.get(case, GREEDY_TOPK1)
    declined = processor.draft_argmax_exchange_declined(sampling)
    assert declined is not None and reason in declined
    assert not processor.uses_draft_argmax_exchange(sampling)


@pytest.mark.parametrize("option", [None, True, False])
def test_draft_option_values(option, device):
    kwargs = {} if option is None else {"draft_argmax_exchange": option}
    processor, _ = make_processor(TPGroup.single(device), **kwargs)
    engaged = option is not False  # the default is the exchange
    out = processor.forward(torch.randn(2, 32, device=device), GREEDY_TOPK1)
    assert (out.next_token_logits is None) == engaged
    assert (out.next_token_argmax_partials is not None) == engaged


@pytest.mark.parametrize("built_with", [True, False])
def test_draft_option_given_at_construction_decides(built_with, monkeypatch, device):
    # A captured graph keeps the branch it was captured with, so the processor must too: the option it
    # was built with decides, the environment switch set to the other value changes nothing.
    monkeypatch.setenv(KILL_SWITCH, "0" if built_with else "1")
    processor, _ = make_processor(TPGroup.single(device), max_rows=4, split_columns=256,
                                  draft_argmax_exchange=built_with)
    assert processor.uses_draft_argmax_exchange(GREEDY_TOPK1) == built_with
    out = processor.forward(torch.randn(2, 32, device=device), GREEDY_TOPK1)
    assert (out.next_token_logits is None) == built_with
    other, _ = make_processor(TPGroup.single(device), max_rows=4, split_columns=256,
                              draft_argmax_exchange=not built_with)
    assert other.uses_draft_argmax_exchange(GREEDY_TOPK1) == (not built_with)
    out = other.forward(torch.randn(2, 32, device=device), GREEDY_TOPK1)
    assert (out.next_token_logits is None) == (not built_with)


def test_symm_mem_transport_choice():
    group = FactsOnlyGroup(2, SYMM_MEM, symm_mem_max_bytes=1024)
    assert group.all_reduce_transport(1024) == SYMM_MEM
    assert group.all_reduce_transport(1028) == NCCL  # above the one-shot size limit
    assert group.all_reduce_transport(6, torch.bfloat16) == NCCL  # not a multiple of 4 bytes
    assert group.all_reduce_transport(8, torch.int32) == NCCL
    assert FactsOnlyGroup(2, NCCL).all_reduce_transport(16) == NCCL


def test_enable_is_idempotent_and_sizes_the_buffer():
    processor, _ = make_processor(FactsOnlyGroup(2, SYMM_MEM), max_rows=16)
    first = processor._exchange
    processor.enable_draft_argmax_exchange()
    assert processor._exchange is first
    splits, _ = exchange_layout(padded_vocab_size(1000, 2) // 2)
    assert processor._slots == 2 * splits
    assert processor.exchange_nbytes == first.numel() * 4 == 16 * 2 * splits * 4 * 4


# -- forwards at TP 1 ----------------------------------------------------------------------------

@pytest.mark.parametrize("vocab_parallel", [True, False])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_gather_path_logits(vocab_parallel, softcap, device):
    processor, weight = make_processor(TPGroup.single(device), vocab=777, dtype=torch.float32, opt_in=False,
                                       vocab_parallel=vocab_parallel, final_logit_softcapping=softcap)
    hidden = torch.randn(5, 32, device=device)
    logits = processor.forward(hidden).next_token_logits
    local = hidden @ processor.lm_head.weight.t()
    expected = gathered_logits_reference([local], 777, softcap)
    assert logits.shape == (5, 777) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    torch.testing.assert_close(local[:, :777], hidden @ weight.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rows", [1, 7, 16])
def test_draft_step_paths_identical(dtype, rows, device):
    hidden = torch.randn(rows, 64, device=device).to(dtype)
    hidden[0] = 0  # an all-zero row: every logit ties, the first index must win
    positions = torch.arange(rows, device=device) + 100
    token_map = torch.randperm(1000, device=device)
    results = {}
    for path in ("exchange", "gather"):
        processor, _ = make_processor(TPGroup.single(device), vocab=1000, hidden=64, dtype=dtype, max_rows=16,
                                      split_columns=256, draft_argmax_exchange=path == "exchange")
        assert processor.uses_draft_argmax_exchange(GREEDY_TOPK1) == (path == "exchange")
        out = greedy_draft_step(processor, hidden, positions, token_map=token_map)
        results[path] = (out.tokens.clone(), out.topk_p.clone(), out.positions.clone())
    # The oracle: the first maximum of the fp32 logits, from the head's own GEMM.
    local = torch.mm(hidden, processor.lm_head.weight.t())
    expected = token_map[first_max_index(local[:, :1000]).to(device)]
    assert expected[0] == token_map[0]
    for path, (tokens, topk_p, positions_out) in results.items():
        assert tokens.dtype == torch.int64 and torch.equal(tokens, expected), path
        assert torch.equal(positions_out, positions + 1), path
        assert torch.equal(topk_p, torch.ones(rows, device=device)), path


def test_exchange_output_fields(device):
    processor, _ = make_processor(TPGroup.single(device), max_rows=8, split_columns=256)
    out = processor.forward(torch.randn(4, 32, device=device), GREEDY_TOPK1)
    assert out.next_token_logits is None and out.positions is None
    assert out.next_token_argmax_partials.shape == (4, processor._slots, 4)
    assert out.next_token_ids.shape == (4,) and out.topk_p.shape == (4,)


def test_argument_errors(device):
    processor, _ = make_processor(TPGroup.single(device), max_rows=4)
    with pytest.raises(ValueError, match="hidden_states has 5 rows, above max_rows=4"):
        processor.forward(torch.randn(5, 32, device=device))
    with pytest.raises(ValueError, match=r"positions must be int64 \[2\], got \(2,\) torch.int32"):
        processor.forward(torch.randn(2, 32, device=device), GREEDY_TOPK1,
                          positions=torch.zeros(2, dtype=torch.int32, device=device))
    for size in (999, 1001):
        with pytest.raises(ValueError, match=rf"token_map must be \[vocab_size=1000\], got \({size},\)"):
            processor.forward(torch.randn(2, 32, device=device), GREEDY_TOPK1,
                              token_map=torch.zeros(size, dtype=torch.int64, device=device))
    with pytest.raises(TypeError, match="hidden_states must be torch.float32 .the head's dtype., got torch.float64"):
        processor.forward(torch.randn(2, 32, device=device, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"hidden_states must be \[rows, 32\], got \(2, 31\)"):
        processor.forward(torch.randn(2, 31, device=device))
    with pytest.raises(ValueError, match="max_rows must be >= 1, got 0"):
        LogitsProcessor(processor.lm_head, max_rows=0)
    with pytest.raises(ValueError, match=r"topk_split_columns must be in \[1, TOPK_SPLIT_COLUMNS=8192\], got 8193"):
        LogitsProcessor(processor.lm_head, topk_split_columns=8193)


# -- target verify (target_tokens) --------------------------------------------------------------------

def target_tokens_traced(processor, hidden):
    """``target_tokens(hidden)`` with the exchange buffer poisoned: (tokens, whether the exchange wrote it)."""
    used = processor._exchange[:hidden.shape[0] * processor._slots * 4]
    processor._exchange.fill_(float("nan"))
    tokens = processor.target_tokens(hidden)
    return tokens, not used.isnan().any().item()


@pytest.mark.parametrize("transport", [SYMM_MEM, LOCAL])
def test_verify_exchanges_when_eligible(transport):
    size = 1 if transport == LOCAL else 2
    processor, _ = make_processor(FactsOnlyGroup(size, transport, rank=size - 1), max_rows=256)
    assert processor.verify_argmax_exchange_declined() is None and processor.uses_verify_argmax_exchange()


@pytest.mark.parametrize("case,reason", [
    ("not_opted_in", "the processor did not opt in (enable_verify_argmax_exchange)"),
    ("replicated_head", "the LM head is replicated"),
    ("softcap", "final-logit softcapping"),
    ("dp_attention", "DP attention"),
    ("nccl", "the all-reduce would run on NCCL"),
    ("too_big_for_symm_mem", "the all-reduce would run on NCCL"),
    ("option_off", "verify_argmax_exchange=False (the processor's option)"),
])
def test_verify_each_fallback_declines(case, reason):
    group = FactsOnlyGroup(2, NCCL if case == "nccl" else SYMM_MEM, rank=0,
                           symm_mem_max_bytes=64 if case == "too_big_for_symm_mem" else DEFAULT_SYMM_MEM_MAX_BYTES)
    kwargs = {"final_logit_softcapping": 30.0} if case == "softcap" else {}
    kwargs.update({"dp_attention": True} if case == "dp_attention" else {})
    kwargs.update({"verify_argmax_exchange": False} if case == "option_off" else {})
    processor, _ = make_processor(group, vocab_parallel=case != "replicated_head", opt_in=False, **kwargs)
    if case != "not_opted_in":
        processor.enable_verify_argmax_exchange()
    assert processor.verify_argmax_exchange_declined() == reason
    assert not processor.uses_verify_argmax_exchange()


def test_verify_and_draft_opt_ins_and_options_are_separate():
    group = FactsOnlyGroup(2, SYMM_MEM)
    processor, _ = make_processor(group, opt_in=False)
    processor.enable_verify_argmax_exchange()
    assert processor.uses_verify_argmax_exchange() and not processor.uses_draft_argmax_exchange(GREEDY_TOPK1)
    buffer = processor._exchange
    processor.enable_draft_argmax_exchange()
    assert processor._exchange is buffer  # one argmax exchange buffer for both
    draft_off, _ = make_processor(group, draft_argmax_exchange=False)
    assert draft_off.uses_verify_argmax_exchange() and not draft_off.uses_draft_argmax_exchange(GREEDY_TOPK1)
    verify_off, _ = make_processor(group, verify_argmax_exchange=False)
    assert not verify_off.uses_verify_argmax_exchange() and verify_off.uses_draft_argmax_exchange(GREEDY_TOPK1)


@pytest.mark.parametrize("built_with", [True, False])
def test_verify_option_given_at_construction_decides(built_with, monkeypatch, device):
    monkeypatch.setenv(VERIFY_SWITCH, "0" if built_with else "1")  # not read by the processor
    processor, _ = make_processor(TPGroup.single(device), max_rows=4, split_columns=1024,
                                  verify_argmax_exchange=built_with)
    hidden = torch.randn(3, 32, device=device)
    assert processor.uses_verify_argmax_exchange() == built_with
    assert target_tokens_traced(processor, hidden)[1] == built_with
    other, _ = make_processor(TPGroup.single(device), max_rows=4, split_columns=1024,
                              verify_argmax_exchange=not built_with)
    assert target_tokens_traced(other, hidden)[1] == (not built_with)


@pytest.mark.parametrize("exchange", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_target_tokens_both_paths(exchange, dtype, device):
    # bs x N verify rows, up to max_rows; the oracle is the first maximum of the head's own fp32 logits.
    processor, _ = make_processor(TPGroup.single(device), vocab=1000, hidden=64, dtype=dtype, max_rows=33,
                                  split_columns=512, verify_argmax_exchange=exchange)
    first = None
    for rows in (1, 7, 33):
        hidden = torch.randn(rows, 64, device=device).to(dtype)
        hidden[0] = 0  # every logit ties: the first index must win
        tokens, exchanged = target_tokens_traced(processor, hidden)
        assert exchanged == exchange
        local = torch.mm(hidden, processor.lm_head.weight.t())
        expected = first_max_index(local[:, :1000]).to(device)
        assert expected[0] == 0
        assert tokens.dtype == torch.int64 and tokens.shape == (rows,) and torch.equal(tokens, expected)
        assert torch.equal(tokens, torch.argmax(processor.forward(hidden).next_token_logits, dim=-1))
        first = tokens.data_ptr() if first is None else first
        assert tokens.data_ptr() == first  # a view of one static buffer
    assert processor.target_tokens(torch.randn(0, 64, device=device).to(dtype)).shape == (0,)


def test_target_tokens_gather_path_applies_softcap(device):
    processor, _ = make_processor(TPGroup.single(device), vocab=777, final_logit_softcapping=0.05, max_rows=8)
    assert processor.verify_argmax_exchange_declined() == "final-logit softcapping"
    hidden = torch.randn(8, 32, device=device) * 10
    local = hidden @ processor.lm_head.weight.t()
    expected = torch.argmax(gathered_logits_reference([local], 777, 0.05), dim=-1)
    assert torch.equal(processor.target_tokens(hidden), expected)


def test_target_tokens_argument_errors(device):
    processor, _ = make_processor(TPGroup.single(device), max_rows=4)
    with pytest.raises(ValueError, match="hidden_states has 5 rows, above max_rows=4"):
        processor.target_tokens(torch.randn(5, 32, device=device))
    with pytest.raises(ValueError, match=r"hidden_states must be \[rows, 32\], got \(2, 31\)"):
        processor.target_tokens(torch.randn(2, 31, device=device))
    with pytest.raises(TypeError, match="hidden_states must be torch.float32"):
        processor.target_tokens(torch.randn(2, 32, device=device).double())


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_verify_rows_up_to_256_fit_the_one_shot_all_reduce(tp):
    # bs 64 x N 4 verify rows at vocab 154880: the argmax buffer, and the top-4 buffer, stay on symmetric
    # memory; top-8 at 256 rows would not, and declines.
    processor, _ = make_processor(FactsOnlyGroup(tp, SYMM_MEM if tp > 1 else LOCAL), vocab=154880, hidden=8,
                                  dtype=torch.bfloat16, max_rows=256, max_topk=8)
    assert processor.exchange_nbytes <= DEFAULT_SYMM_MEM_MAX_BYTES
    assert processor.uses_verify_argmax_exchange()
    assert processor.uses_draft_argmax_exchange(DraftSampling(topk=4))
    if tp > 1:
        assert processor.draft_argmax_exchange_declined(DraftSampling(topk=8)) == "the all-reduce would run on NCCL"


# -- top-k drafts --------------------------------------------------------------------------------------

def test_topk_draft_decisions():
    processor, _ = make_processor(FactsOnlyGroup(2, SYMM_MEM), max_topk=4)
    for topk in (1, 2, 4):
        assert processor.uses_draft_argmax_exchange(DraftSampling(topk=topk))
    assert processor.draft_argmax_exchange_declined(DraftSampling(topk=5)) == \
        "topk is 5, not in [1, max_topk=4] (enable_draft_argmax_exchange)"
    assert processor.draft_argmax_exchange_declined(DraftSampling(topk=4, greedy=False)) == "not a greedy draft"
    splits, _ = exchange_layout(padded_vocab_size(1000, 2) // 2, TOPK_SPLIT_COLUMNS)
    assert processor.topk_exchange_nbytes(4) == processor._topk_exchange.numel() * 4 == 64 * 2 * splits * 17 * 4
    for bad in (0, 9):
        with pytest.raises(ValueError, match=rf"max_topk must be in \[1, min\(TOPK_MAX=8, vocab_size=1000\)\], got {bad}"):
            processor.enable_draft_argmax_exchange(max_topk=bad)
    small, _ = make_processor(FactsOnlyGroup(2, SYMM_MEM), vocab=3, opt_in=False)
    with pytest.raises(ValueError, match=r"max_topk must be in \[1, min\(TOPK_MAX=8, vocab_size=3\)\], got 4"):
        small.enable_draft_argmax_exchange(max_topk=4)


@pytest.mark.parametrize("exchange", [True, False])
def test_topk_draft_step_both_paths(exchange, device):
    processor, _ = make_processor(TPGroup.single(device), vocab=1000, hidden=64, max_rows=8, max_topk=4,
                                  topk_split_columns=512, draft_argmax_exchange=exchange)
    hidden = torch.randn(6, 64, device=device)
    hidden[0] = 0  # every logit ties: the lowest indices, in order, on the exchange path
    out = topk_draft_step(processor, hidden, 4)
    assert out.topk_p.shape == out.topk_index.shape == (6, 4) and out.topk_index.dtype == torch.int64
    logits = (hidden @ processor.lm_head.weight.t())[:, :1000]
    probs = torch.softmax(logits, dim=-1)
    if exchange:
        assert out.topk_index.data_ptr() == processor.topk_outputs(6, 4)[1].data_ptr()
        assert torch.equal(out.topk_index, stable_topk_oracle(logits, 4).to(device))
        probability_errors(out.topk_p, logits, out.topk_index)
    else:  # torch.topk: the same values, its own order among equal ones
        assert torch.equal(probs.gather(1, out.topk_index), torch.topk(probs, 4, dim=-1).values)
        assert torch.equal(out.topk_p, probs.gather(1, out.topk_index))


def test_topk_argument_errors(device):
    processor, _ = make_processor(TPGroup.single(device), max_rows=4, max_topk=4)
    hidden = torch.randn(2, 32, device=device)
    with pytest.raises(ValueError, match=r"topk must be in \[2, TOPK_MAX=8\] .a topk = 1 chain uses greedy_draft_step."):
        topk_draft_step(processor, hidden, 1)
    with pytest.raises(ValueError, match="positions and token_map apply to topk = 1 drafts only, got topk=4"):
        processor.forward(hidden, DraftSampling(topk=4), positions=torch.zeros(2, dtype=torch.int64, device=device))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run's fixed sizes")
def test_verify_step_benchmark_without_cuda(tmp_path, capsys):
    import json

    from dsaspec.commands import cli

    assert cli.main(["bench", "verify-step", "--rows", "1,3", "--topk", "3", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "verify_step.json").read_text())
    assert [r["rows"] for r in payload["rows"]] == [1, 3] and {r["topk"] for r in payload["rows"]} == {3}
    assert all(r["p_rel_error_exact"] <= 2.0**-18 for r in payload["rows"])
    assert cli.main(["bench", "verify-step", "--topk", "9"]) == 2
    assert "dsaspec: error: --topk 9: expected 2 to 8" in capsys.readouterr().err


def test_verify_step_benchmark_timed_functions(device):
    """Every function the verify-step benchmark times runs, and the yardstick pair measures what it
    says: the partials kernel's candidates pick torch.argmax of the local logits, the amax their max."""
    from dsaspec.bench import verify_step

    step = verify_step._Step(TPGroup.single(device), vocab=1000, hidden=64, max_rows=8, topk=3)
    hidden = step.hidden_states(5)
    for fn in step.functions(hidden).values():
        fn()
    shard = step.head.shard_size
    local = step.local[:5 * shard].view(5, shard).float()
    assert torch.equal(step.local_max[:5].float(), local.amax(dim=1))
    lanes = step.partials[:5].long()
    keys = lanes[..., 0] << 16 | lanes[..., 1]
    index = lanes[..., 2] << 16 | lanes[..., 3]
    picked = index.gather(1, keys.argmax(1, keepdim=True)).squeeze(1).cpu()
    assert torch.equal(picked, first_max_index(local[:, :1000]))  # columns past the vocabulary are padding


# -- LM head ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("vocab,tp,padded", [(154880, 1, 154880), (154880, 2, 154880), (154880, 8, 155136),
                                             (129280, 8, 129536), (151936, 4, 152064), (5, 3, 192)])
def test_padded_vocab_size(vocab, tp, padded):
    assert padded_vocab_size(vocab, tp) == padded
    assert padded % (64 * tp) == 0 and padded - vocab < 64 * tp


@pytest.mark.parametrize("vocab,tp", [(1000, 2), (1000, 3), (100, 4), (5, 8)])
def test_lm_head_shards(vocab, tp):
    weight = torch.randn(vocab, 16)
    shards = []
    for rank in range(tp):
        head = VocabParallelLMHead(vocab, 16, FactsOnlyGroup(tp, SYMM_MEM, rank=rank), dtype=torch.float32)
        head.load_weight(weight)
        assert head.weight.shape == (padded_vocab_size(vocab, tp) // tp, 16)
        assert torch.all(head.weight[head.valid_columns:] == 0)
        shards.append(head.weight)
    assert torch.equal(torch.cat(shards)[:vocab], weight)
    replicated = VocabParallelLMHead(vocab, 16, FactsOnlyGroup(tp, SYMM_MEM, rank=1), vocab_parallel=False)
    replicated.load_weight(weight)
    assert replicated.weight.dtype == torch.bfloat16 and torch.equal(replicated.weight[:vocab], weight.bfloat16())
    with pytest.raises(ValueError, match="full_weight"):
        replicated.load_weight(weight[:-1])


# -- CUDA graph (one GPU, TP 1) --------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_draft_step_in_cuda_graph(rows):
    group = TPGroup.single("cuda")
    vocab, hidden_size = 154880, 256
    tokens = {}
    hidden = torch.empty(rows, hidden_size, device="cuda", dtype=torch.bfloat16)
    positions = torch.zeros(rows, dtype=torch.int64, device="cuda")
    inputs = [torch.randn(rows, hidden_size, device="cuda").bfloat16() for _ in range(3)]
    for path in ("exchange", "gather"):
        processor, _ = make_processor(group, vocab=vocab, hidden=hidden_size, dtype=torch.bfloat16, max_rows=64,
                                      draft_argmax_exchange=path == "exchange")
        assert processor.uses_draft_argmax_exchange(GREEDY_TOPK1) == (path == "exchange")
        hidden.copy_(inputs[0])
        greedy_draft_step(processor, hidden, positions)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = greedy_draft_step(processor, hidden, positions)
        tokens[path] = []
        for i, x in enumerate(inputs):
            hidden.copy_(x)
            positions.fill_(i)
            graph.replay()
            torch.cuda.synchronize()
            eager = torch.argmax(processor.forward(hidden).next_token_logits, dim=-1)
            assert torch.equal(out.tokens, eager)
            assert torch.equal(out.positions, positions + 1)
            tokens[path].append(out.tokens.clone())
    for a, b in zip(tokens["exchange"], tokens["gather"]):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("exchange", [True, False])
def test_target_tokens_in_cuda_graph(exchange):
    # Verify rows up to bs 64 x N 4 = 256, replayed with new hidden states; both paths, TP 1.
    vocab, hidden_size, max_rows = 154880, 256, 256
    processor, _ = make_processor(TPGroup.single("cuda"), vocab=vocab, hidden=hidden_size, dtype=torch.bfloat16,
                                  max_rows=max_rows, verify_argmax_exchange=exchange)
    assert processor.uses_verify_argmax_exchange() == exchange
    for rows in (4, 129, 256):
        hidden = torch.randn(rows, hidden_size, device="cuda").bfloat16()
        processor.target_tokens(hidden)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            tokens = processor.target_tokens(hidden)
        for _ in range(3):
            hidden.copy_(torch.randn(rows, hidden_size, device="cuda").bfloat16())
            tokens.fill_(-1)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(tokens, torch.argmax(processor.forward(hidden).next_token_logits, dim=-1))


@pytest.mark.gpu
def test_topk_draft_step_in_cuda_graph():
    vocab, hidden_size, rows, topk = 154880, 256, 64, 4
    processor, _ = make_processor(TPGroup.single("cuda"), vocab=vocab, hidden=hidden_size, dtype=torch.bfloat16,
                                  max_rows=rows, max_topk=topk)
    hidden = torch.randn(rows, hidden_size, device="cuda").bfloat16()
    topk_draft_step(processor, hidden, topk)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = topk_draft_step(processor, hidden, topk)
    for _ in range(3):
        hidden.copy_(torch.randn(rows, hidden_size, device="cuda").bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        logits = processor.forward(hidden).next_token_logits
        assert torch.equal(out.topk_index, stable_topk_oracle(logits, topk).cuda())
        probability_errors(out.topk_p, logits, out.topk_index)
