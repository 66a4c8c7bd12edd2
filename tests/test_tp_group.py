"""TP group: TP 1 without torch.distributed (CPU), and a real TP 2 group on two GPUs (multigpu).

The multigpu tests run under torchrun, one pytest process per GPU, in the same order on every rank:

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        torchrun --nproc-per-node 2 -m pytest tests/test_tp_group.py -q -m multigpu -p no:cacheprovider

They cover the symmetric-memory and NCCL transports, eager and CUDA-graph replay, the argmax and top-k
exchanges over both, and the LogitsProcessor both ways for greedy drafts, target verify (``target_tokens``,
up to 256 rows) and top-k drafts (exchange on symmetric memory; on NCCL the exchange is declined, which is
asserted), each against torch.argmax / the stable top-k and softmax of the gathered fp32 logits.
"""

import os

import pytest
import torch

from dsaspec.distributed.tp_group import LOCAL, NCCL, SYMM_MEM, TPGroup, init_tp_group

# -- TP 1 (no torch.distributed) ---------------------------------------------------------------

def test_single_group_collectives(device):
    group = TPGroup.single(device)
    assert (group.size, group.rank, group.transport) == (1, 0, LOCAL)
    assert group.all_reduce_transport(1 << 30) == LOCAL
    x = torch.arange(6.0, device=device).view(2, 3)
    assert group.all_reduce(x) is x and torch.equal(x, torch.arange(6.0, device=device).view(2, 3))
    out = torch.empty_like(x)
    assert group.all_reduce(x, out=out) is out and torch.equal(out, x)
    gathered = torch.empty(1, 2, 3, device=device)
    assert torch.equal(group.all_gather(x, gathered)[0], x)
    buf = group.symmetric_empty(10)
    assert buf.shape == (10,) and buf.dtype == torch.float32 and not group.is_symmetric(buf)
    group.barrier()


def test_single_group_argument_errors(device):
    group = TPGroup.single(device)
    x = torch.zeros(2, 3, device=device)
    with pytest.raises(ValueError, match="out must be"):
        group.all_reduce(x, out=torch.zeros(3, 2, device=device))
    with pytest.raises(ValueError, match="contiguous"):
        group.all_reduce(x.t())
    with pytest.raises(ValueError, match="out must be contiguous"):
        group.all_gather(x, torch.zeros(2, 2, 3, device=device))
    with pytest.raises(ValueError, match="transport"):
        TPGroup(None, transport="nvls")


def test_init_tp_group_without_torchrun(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("torch.distributed already initialised in this process")
    assert init_tp_group().transport == LOCAL


# -- TP 2 on two GPUs, under torchrun ---------------------------------------------------------------

@pytest.fixture(scope="module")
def groups():
    from dsaspec.distributed.tp_group import init_distributed

    assert init_distributed(timeout_s=180)
    import torch.distributed as dist

    assert os.environ["NCCL_NVLS_ENABLE"] == "0" and os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    symm = TPGroup(dist.group.WORLD, transport="auto")
    nccl = TPGroup(dist.group.WORLD, transport="nccl")
    return {SYMM_MEM: symm, NCCL: nccl}


def _graph(fn):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _same_on_all_ranks(group, tensor):
    gathered = torch.empty(group.size, *tensor.shape, dtype=tensor.dtype, device=tensor.device)
    group.all_gather(tensor.contiguous(), gathered)
    return all(torch.equal(gathered[0], gathered[r]) for r in range(group.size))


@pytest.mark.multigpu
def test_transports(groups):
    assert groups[SYMM_MEM].transport == SYMM_MEM, "symmetric-memory one-shot all-reduce unavailable"
    assert groups[NCCL].transport == NCCL
    assert groups[SYMM_MEM].all_reduce_transport(groups[SYMM_MEM].symm_mem_max_bytes + 4) == NCCL


@pytest.mark.multigpu
@pytest.mark.parametrize("transport", [SYMM_MEM, NCCL])
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_all_reduce_exact_lanes(groups, transport, mode):
    # Own slots hold exact integers in [0, 65535], foreign slots +0.0: the sum is an exact exchange.
    group = groups[transport]
    rows, slots = 16, group.size * 5
    values = torch.randint(0, 65536, (rows, slots, 4), generator=torch.Generator().manual_seed(1)).float().cuda()
    owner = torch.arange(slots, device="cuda") // 5
    local = torch.where((owner == group.rank)[None, :, None], values, torch.zeros_like(values))
    symmetric = group.symmetric_empty(local.numel()).view(rows, slots, 4)
    staged_in = torch.empty_like(local)
    out_sym, out_staged = torch.empty_like(local), torch.empty_like(local)

    def step():
        symmetric.copy_(local)
        staged_in.copy_(local)
        group.all_reduce(symmetric, out=out_sym)
        group.all_reduce(staged_in, out=out_staged)

    if mode == "eager":
        step()
    else:
        graph = _graph(step)
        out_sym.zero_()
        out_staged.zero_()
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_sym.view(torch.int32), values.view(torch.int32))
    assert torch.equal(out_staged.view(torch.int32), values.view(torch.int32))
    if transport == SYMM_MEM:
        assert group.is_symmetric(symmetric)
        with pytest.raises(ValueError, match="different out"):
            group.all_reduce(symmetric)


@pytest.mark.multigpu
@pytest.mark.parametrize("transport", [SYMM_MEM, NCCL])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 256), (3, 257)])  # (3, 257) bf16 is not 4-byte sized: NCCL
def test_all_reduce_in_place_and_all_gather(groups, transport, dtype, shape):
    group = groups[transport]
    x = torch.full(shape, float(group.rank + 1), dtype=dtype, device="cuda")
    gathered = torch.empty(group.size, *shape, dtype=dtype, device="cuda")
    nbytes = x.numel() * x.element_size()
    assert group.all_reduce_transport(nbytes, dtype) == (NCCL if transport == NCCL or nbytes % 4 else SYMM_MEM)

    def step():
        x.fill_(float(group.rank + 1))
        group.all_reduce(x)
        group.all_gather(x, gathered)

    graph = _graph(step)
    x.zero_()
    graph.replay()
    torch.cuda.synchronize()
    total = float(sum(range(1, group.size + 1)))
    assert torch.all(x == total) and torch.all(gathered == total)


@pytest.mark.multigpu
@pytest.mark.parametrize("transport", [SYMM_MEM, NCCL])
@pytest.mark.parametrize("vocab", [154880, 129280, 151936, 1001])
def test_exchange_over_real_transport(groups, transport, vocab):
    from test_argmax_exchange import adversarial_logits

    from dsaspec.ops.argmax_exchange import draft_finalize, exchange_layout
    from dsaspec.layers.vocab_parallel import padded_vocab_size
    from dsaspec.layers.logits_processor import exchange_argmax_partials

    group = groups[transport]
    rows = 64
    shard = padded_vocab_size(vocab, group.size) // group.size
    slots = group.size * exchange_layout(shard)[0]
    local = torch.empty(rows, shard, dtype=torch.bfloat16, device="cuda")
    exchange = group.symmetric_empty(rows * slots * 4).view(rows, slots, 4)
    reduced = torch.empty_like(exchange)
    tokens = torch.empty(rows, dtype=torch.int64, device="cuda")
    topk_p = torch.empty(rows, device="cuda")

    def step():
        result = exchange_argmax_partials(group, local, vocab_size=vocab, exchange=exchange, reduced=reduced)
        draft_finalize(tokens=tokens, topk_p=topk_p, reduced=result)

    full = adversarial_logits(rows, vocab, shard, group.size, torch.bfloat16, seed=vocab).cuda()
    local.copy_(full[:, group.rank * shard:(group.rank + 1) * shard])
    step()
    torch.cuda.synchronize()
    expected = torch.argmax(full[:, :vocab].float(), dim=-1)
    assert torch.equal(tokens, expected)
    graph = _graph(step)
    for seed in range(3):
        full = adversarial_logits(rows, vocab, shard, group.size, torch.bfloat16, seed=seed + 7).cuda()
        local.copy_(full[:, group.rank * shard:(group.rank + 1) * shard])
        tokens.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(tokens, torch.argmax(full[:, :vocab].float(), dim=-1))
    assert _same_on_all_ranks(group, tokens)


def _gathered_argmax(group, head, hidden):
    """The oracle: torch.argmax of the gathered fp32 logits, built here with the head's GEMM and an
    all-gather (none of the LogitsProcessor's code)."""
    local = torch.mm(hidden, head.weight.t())
    gathered = torch.empty(group.size, *local.shape, dtype=local.dtype, device=local.device)
    group.all_gather(local, gathered)
    full = gathered.permute(1, 0, 2).reshape(local.shape[0], -1)[:, :head.vocab_size]
    return torch.argmax(full.float(), dim=-1)


@pytest.mark.multigpu
@pytest.mark.parametrize("transport", [SYMM_MEM, NCCL])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_logits_processor_both_ways(groups, transport, dtype):
    # Two processors over one head, built with draft_argmax_exchange on and off. On symmetric memory they take
    # the exchange and the gather path; on NCCL both decline the exchange (asserted) and gather. Every
    # path, eager and graph-replayed, must give torch.argmax of the gathered fp32 logits.
    from dsaspec.speculative.draft_step import greedy_draft_step
    from dsaspec.layers.vocab_parallel import VocabParallelLMHead
    from dsaspec.layers.logits_processor import GREEDY_TOPK1, LogitsProcessor

    group = groups[transport]
    vocab, hidden_size, max_rows = 154880, 256, 64
    head = VocabParallelLMHead(vocab, hidden_size, group, dtype=dtype)
    head.load_weight(torch.randn(vocab, hidden_size, generator=torch.Generator().manual_seed(0)))
    processors = {}
    for switch in (True, False):
        processors[switch] = LogitsProcessor(head, max_rows=max_rows, draft_argmax_exchange=switch)
        processors[switch].enable_draft_argmax_exchange()  # collective: same order on every rank
    declined = {switch: p.draft_argmax_exchange_declined(GREEDY_TOPK1) for switch, p in processors.items()}
    if transport == NCCL:
        assert all(reason == "the all-reduce would run on NCCL" for reason in declined.values()), declined
    else:
        assert declined[True] is None, declined
        assert declined[False] == "draft_argmax_exchange=False (the processor's option)", declined
    for rows in (1, 5, 16, 64):
        hidden = torch.empty(rows, hidden_size, dtype=dtype, device="cuda")
        positions = torch.empty(rows, dtype=torch.int64, device="cuda")
        inputs = [torch.randn(rows, hidden_size, generator=torch.Generator().manual_seed(rows * 10 + i)).to(dtype)
                  for i in range(3)]
        for switch, processor in processors.items():
            exchanges = declined[switch] is None
            hidden.copy_(inputs[0].cuda())
            positions.fill_(0)
            out = processor.forward(hidden, GREEDY_TOPK1)
            assert (out.next_token_logits is None) == exchanges
            eager = greedy_draft_step(processor, hidden, positions)
            assert torch.equal(eager.tokens, _gathered_argmax(group, head, hidden)), f"exchange option {switch}, rows {rows}"
            graph = _graph(lambda: greedy_draft_step(processor, hidden, positions))
            for i, x in enumerate(inputs):
                hidden.copy_(x.cuda())
                positions.fill_(i)
                eager.tokens.fill_(-1)
                graph.replay()
                torch.cuda.synchronize()
                expected = _gathered_argmax(group, head, hidden)
                assert torch.equal(eager.tokens, expected), \
                    f"exchange option {switch}, rows {rows}: {eager.tokens.tolist()} != {expected.tolist()}"
                assert torch.equal(eager.positions, positions + 1)
                assert torch.equal(eager.topk_p, torch.ones_like(eager.topk_p))
            assert _same_on_all_ranks(group, eager.tokens)



@pytest.mark.multigpu
@pytest.mark.parametrize("transport", [SYMM_MEM, NCCL])
@pytest.mark.parametrize("k", [2, 8])
@pytest.mark.parametrize("vocab", [154880, 1001])
def test_topk_exchange_over_real_transport(groups, transport, k, vocab):
    from test_argmax_exchange import adversarial_logits, probability_errors, stable_topk_oracle

    from dsaspec.ops.argmax_exchange import TOPK_SPLIT_COLUMNS, exchange_layout, topk_finalize, topk_slot_lanes
    from dsaspec.layers.vocab_parallel import padded_vocab_size
    from dsaspec.layers.logits_processor import exchange_topk_partials

    group = groups[transport]
    rows = 64
    shard = padded_vocab_size(vocab, group.size) // group.size
    slots = group.size * exchange_layout(shard, TOPK_SPLIT_COLUMNS)[0]
    lanes = topk_slot_lanes(k)
    local = torch.empty(rows, shard, dtype=torch.bfloat16, device="cuda")
    exchange = group.symmetric_empty(rows * slots * lanes).view(rows, slots, lanes)
    reduced = torch.empty_like(exchange)
    index = torch.empty(rows, k, dtype=torch.int64, device="cuda")
    topk_p = torch.empty(rows, k, device="cuda")
    lse = torch.empty(rows, device="cuda")

    def step():
        result = exchange_topk_partials(group, local, k=k, vocab_size=vocab, exchange=exchange, reduced=reduced)
        topk_finalize(result, k=k, topk_index=index, topk_p=topk_p, lse=lse)

    graph = None
    for seed in range(4):
        full = adversarial_logits(rows, vocab, shard, group.size, torch.bfloat16, seed=seed + vocab).cuda()
        local.copy_(full[:, group.rank * shard:(group.rank + 1) * shard])
        index.fill_(-1)
        if graph is None:
            step()
            graph = _graph(step)
        else:
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(index, stable_topk_oracle(full[:, :vocab], k).cuda())
        probability_errors(topk_p, full[:, :vocab].float(), index, lse)
    for t in (index, topk_p.view(torch.int32), lse.view(torch.int32)):  # bits: NaN rows compare equal
        assert _same_on_all_ranks(group, t)


@pytest.mark.multigpu
@pytest.mark.parametrize("transport", [SYMM_MEM, NCCL])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_target_tokens_both_ways(groups, transport, dtype):
    # Target verify over bs x N rows (up to 256): processors built with verify_argmax_exchange on and off. On
    # symmetric memory they take the exchange and the gather path; on NCCL both decline (asserted). Every
    # path, eager and graph-replayed, gives torch.argmax of the gathered fp32 logits, on every rank.
    from dsaspec.layers.vocab_parallel import VocabParallelLMHead
    from dsaspec.layers.logits_processor import LogitsProcessor

    group = groups[transport]
    vocab, hidden_size, max_rows = 154880, 256, 256
    head = VocabParallelLMHead(vocab, hidden_size, group, dtype=dtype)
    head.load_weight(torch.randn(vocab, hidden_size, generator=torch.Generator().manual_seed(0)))
    processors = {}
    for switch in (True, False):
        processors[switch] = LogitsProcessor(head, max_rows=max_rows, verify_argmax_exchange=switch)
        processors[switch].enable_verify_argmax_exchange()  # collective: same order on every rank
    declined = {switch: p.verify_argmax_exchange_declined() for switch, p in processors.items()}
    if transport == NCCL:
        assert all(reason == "the all-reduce would run on NCCL" for reason in declined.values()), declined
    else:
        assert declined[True] is None, declined
        assert declined[False] == "verify_argmax_exchange=False (the processor's option)", declined
    for rows in (4, 16, 128, 256):
        hidden = torch.empty(rows, hidden_size, dtype=dtype, device="cuda")
        inputs = [torch.randn(rows, hidden_size, generator=torch.Generator().manual_seed(rows * 10 + i)).to(dtype)
                  for i in range(3)]
        inputs[1][0] = 0  # a row where every logit ties
        for switch, processor in processors.items():
            hidden.copy_(inputs[0].cuda())
            tokens = processor.target_tokens(hidden)
            assert torch.equal(tokens, _gathered_argmax(group, head, hidden)), f"exchange option {switch}, rows {rows}"
            graph = _graph(lambda: processor.target_tokens(hidden))
            for x in inputs:
                hidden.copy_(x.cuda())
                tokens.fill_(-1)
                graph.replay()
                torch.cuda.synchronize()
                expected = _gathered_argmax(group, head, hidden)
                assert torch.equal(tokens, expected), f"exchange option {switch}, rows {rows}"
            assert _same_on_all_ranks(group, tokens)


@pytest.mark.multigpu
@pytest.mark.parametrize("transport", [SYMM_MEM, NCCL])
def test_topk_draft_step_both_ways(groups, transport):
    from test_argmax_exchange import probability_errors, stable_topk_oracle

    from dsaspec.speculative.draft_step import topk_draft_step
    from dsaspec.layers.vocab_parallel import VocabParallelLMHead
    from dsaspec.layers.logits_processor import DraftSampling, LogitsProcessor

    group = groups[transport]
    vocab, hidden_size, max_rows, topk = 154880, 256, 64, 4
    head = VocabParallelLMHead(vocab, hidden_size, group, dtype=torch.bfloat16)
    head.load_weight(torch.randn(vocab, hidden_size, generator=torch.Generator().manual_seed(1)))
    processors = {}
    for switch in (True, False):
        processors[switch] = LogitsProcessor(head, max_rows=max_rows, draft_argmax_exchange=switch)
        processors[switch].enable_draft_argmax_exchange(max_topk=topk)
    exchanges = {switch: p.uses_draft_argmax_exchange(DraftSampling(topk=topk)) for switch, p in processors.items()}
    assert exchanges == ({True: False, False: False} if transport == NCCL else {True: True, False: False})
    for rows in (1, 16, 64):
        hidden = torch.randn(rows, hidden_size, generator=torch.Generator().manual_seed(rows)).bfloat16().cuda()
        logits = torch.empty(group.size, rows, head.shard_size, dtype=torch.bfloat16, device="cuda")
        group.all_gather(torch.mm(hidden, head.weight.t()), logits)
        full = logits.permute(1, 0, 2).reshape(rows, -1)[:, :vocab].float()
        probs = torch.softmax(full, dim=-1)
        for switch, processor in processors.items():
            graph = _graph(lambda: topk_draft_step(processor, hidden, topk))
            out = topk_draft_step(processor, hidden, topk)
            out.topk_index.fill_(-1)
            graph.replay()
            torch.cuda.synchronize()
            if exchanges[switch]:
                assert torch.equal(out.topk_index, stable_topk_oracle(full, topk).cuda())
                probability_errors(out.topk_p, full, out.topk_index)
            else:
                assert torch.equal(probs.gather(1, out.topk_index), torch.topk(probs, topk, dim=-1).values)
            assert _same_on_all_ranks(group, out.topk_index)
