"""Speculative decoding (speculative/spec_worker.py through the Engine) against plain greedy decoding.

Every emitted token of a greedy chain is a target argmax, so speculative output must equal the
plain engine's output token for token whatever the drafts are; the drafts decide only how many
tokens an iteration commits. CPU: the tiny model in fp32 with the runtime's torch ops (metadata
and draft-argmax kernels under the Triton interpreter). Three models: seeded random weights (the
MTP layer drafts noise: accept length 1), a "predictable" variant whose residual branches are
scaled down so the next token mostly follows the current one and the MTP layer mostly guesses it
from the token (accept lengths 1..N), and a "hidden-drafting" one whose MTP layer reads only the
hidden states, along a map an oracle knows (exact accept lengths). A test double in place of the
draft phase gives oracle drafts.
GPU (``-m gpu``): bf16 from CUDA graphs, batches up to 32, 256 new tokens, 1M context configured.
"""

import statistics
import types

import pytest
import torch

from dsaspec.configs.model_config import get_config
from dsaspec.configs.quantization import Fp8Quantization
from dsaspec.configs.runtime_options import RuntimeOptions
from dsaspec.engine.engine import Engine
from dsaspec.memory import PAGE_SIZE
from dsaspec.layers.linear import Linear
from dsaspec.layers.norm import LayerNorm, RMSNorm
from dsaspec.layers.row_invariant import RowInvariant
from dsaspec.layers.vocab_parallel import LMHead
from dsaspec.models.dsa_model import DSAModel
from dsaspec.speculative.spec_worker import SpecConfig
from dsaspec.testing.spec_models import (generated_tokens, gpu_engine, gpu_model, gpu_prompts, predictable,
                                         random_prompts)

CONTEXT = 192
PROMPT_LENS = (5, 70, 62)           # 70 > top-k 64 (sparse rows); 62: verify blocks cross a page
MAX_NEW = [9, 7, 12]


def _engine(model, spec=None, **kwargs):
    kwargs.setdefault("context_len", CONTEXT)
    kwargs.setdefault("max_batch", 2)
    kwargs.setdefault("bucket_sizes", (1, 2))
    kwargs.setdefault("progress", False)
    return Engine(model, speculative=spec, **kwargs)


@torch.no_grad()
def drafting_from_hidden(model: DSAModel, seed: int, follow: float = 0.7) -> list[int]:
    """Make the MTP layer draft from its hidden input alone, along a successor map ``succ`` (a
    permutation of the vocabulary, returned): the drafts after bonus ``b`` are ``succ^j(b)``.

    Needs ``vocab_size == hidden_size``. The LM head is the identity, so the target's token after
    position p is ``argmax_j h_p[j]``. The MTP layer: ``eh_proj = [0 | Q]`` (Q moves coordinate j to
    ``succ[j]``; the token half is zero), ``hnorm = shared_head.norm = 1`` and its residual branches
    zero (``o_proj``, ``down_proj``), so it outputs a positive multiple of ``Q hidden``, whose argmax
    is ``succ[argmax hidden]``. The draft extend's row before the bonus b holds the hidden whose
    argmax is b and drafts ``succ[b]``; each draft step, fed the previous step's output, drafts the
    successor of the previous draft. A zero hidden drafts token 0 instead.
    The target embeds token t as ``sqrt(H) e_peak(t)``, ``peak(t) = succ[t]`` for a seeded fraction
    ``follow`` of the vocabulary and another token otherwise (its other weights stay seeded-random):
    its greedy chain mixes runs that the drafts follow and tokens where they break."""
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    if vocab != hidden:
        raise ValueError(f"drafting_from_hidden needs vocab_size == hidden_size, got {vocab} and {hidden}")
    generator = torch.Generator().manual_seed(seed)
    succ = torch.randperm(vocab, generator=generator)
    followed = torch.rand(vocab, generator=generator) < follow
    other = (succ + torch.randint(1, vocab, (vocab,), generator=generator)) % vocab
    peak = torch.where(followed, succ, other)
    device = model.lm_head.weight.device
    columns = torch.arange(vocab)
    embedding = model.model.embed_tokens.weight
    embedding.zero_()
    embedding[columns.to(device), peak.to(device)] = hidden ** 0.5
    model.lm_head.weight.copy_(torch.eye(vocab))
    mtp = model.mtp_layer
    mtp.eh_proj.weight.zero_()
    mtp.eh_proj.weight[succ.to(device), (hidden + columns).to(device)] = 1.0
    mtp.hnorm.weight.fill_(1.0)
    mtp.shared_head.norm.weight.fill_(1.0)
    mtp.self_attn.o_proj.weight.zero_()
    mtp.mlp.down_proj.weight.zero_()
    return succ.tolist()


def _chain_accept_lens(continuations, max_new, steps: int, succ, eos=None) -> list[list[int]]:
    """Each request's accept lengths, iteration by iteration, when the drafts after bonus b are
    ``succ^j(b)`` (j = 1..S): one plus the leading drafts that equal its greedy continuation
    (``continuations``: at least ``max_new + S`` tokens). A request stops where the engine stops
    it: ``max_new`` tokens, or the first ``eos``."""
    out = []
    for tokens, limit in zip(continuations, max_new):
        lens, produced = [], 1
        while produced < limit and eos not in tokens[:produced]:
            draft, accepted = tokens[produced - 1], 1
            while accepted <= steps:
                draft = succ[draft]
                if draft != tokens[produced + accepted - 1]:
                    break
                accepted += 1
            lens.append(accepted)
            produced += accepted
        out.append(lens)
    return out


def _in_step_order(per_request: list[list[int]], max_batch: int) -> list[int]:
    """``Engine.stats.accept_lens`` for these per-request accept lengths: the engine admits
    requests first come first served while a row is free (pages never wait here) and every step
    lists its running requests in admission order."""
    waiting, running, done, order = list(range(len(per_request))), [], [0] * len(per_request), []
    while waiting or running:
        while waiting and len(running) < max_batch:
            request = waiting.pop(0)
            if per_request[request]:                       # else it ended at its first token
                running.append(request)
        for request in running:
            order.append(per_request[request][done[request]])
            done[request] += 1
        running = [r for r in running if done[r] < len(per_request[r])]
    return order


@pytest.fixture(scope="module")
def random_model():
    return DSAModel(get_config("tiny"), dtype=torch.float32).init_weights(0)


@pytest.fixture(scope="module")
def guessing_model():
    return predictable(DSAModel(get_config("tiny"), dtype=torch.float32).init_weights(1), 0.5)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(PROMPT_LENS, get_config("tiny").vocab_size)


@pytest.fixture(scope="module")
def plain_random(random_model, prompts):
    return generated_tokens(_engine(random_model), prompts, MAX_NEW)


@pytest.fixture(scope="module")
def plain_guessing(guessing_model, prompts):
    return generated_tokens(_engine(guessing_model), prompts, MAX_NEW)


# ---------------------------------------------------------------------------------------------
# CPU


@pytest.mark.parametrize("steps", [1, 3])
def test_speculative_equals_plain_greedy(guessing_model, prompts, plain_guessing, steps):
    """Two rows for three requests (joins and departures mid-run), accept lengths 1..N (how many
    drafts each iteration must accept is asserted where an oracle knows the drafts:
    ``test_drafts_from_the_hidden_states_accept_what_the_oracle_says``)."""
    engine = _engine(guessing_model, SpecConfig(num_steps=steps))
    assert generated_tokens(engine, prompts, MAX_NEW) == plain_guessing
    stats = engine.stats
    assert set(stats.step_batches) == {1, 2}
    assert max(stats.accept_lens) <= steps + 1
    if steps > 1:
        assert max(stats.accept_lens) > 1 and 1 in stats.accept_lens   # both cases occur
    assert stats.decode_tokens == sum(MAX_NEW) - len(MAX_NEW)
    assert engine.req_pool.num_free == 2 and engine.allocator.num_free_pages == engine.allocator.num_pages - 1


def test_random_mtp_accepts_only_the_bonus(random_model, prompts, plain_random):
    engine = _engine(random_model, SpecConfig(num_steps=2))
    assert generated_tokens(engine, prompts, MAX_NEW) == plain_random
    assert set(engine.stats.accept_lens) == {1}


def _oracle(engine, continuation: dict, right) -> None:
    """Replace the draft phase: request row r at committed length L drafts ``continuation[r][L + j]``
    for ``j = 1 .. S`` (the plain engine's tokens), or a wrong token where ``right(r, L, j)`` is
    False. The rows are mapped to their request at prefill."""
    worker = engine.worker
    prefill = worker.prefill
    owner = {}

    def recording_prefill(self, row, prompt, **kwargs):
        owner[row] = continuation[tuple(prompt)]
        return prefill(row, prompt, **kwargs)

    def oracle_draft(self, batch, attns, check_values):
        for i, (row, length) in enumerate(zip(batch.rows.tolist(), batch.seq_lens.tolist())):
            if row == self.dummy_row:
                continue
            for j in range(1, self.spec.num_steps + 1):
                token = owner[row][length + j]
                batch.drafts[i, j - 1] = token if right(row, length, j) else (token + 1) % 1031

    worker.prefill = types.MethodType(recording_prefill, worker)
    worker._draft = types.MethodType(oracle_draft, worker)


@pytest.mark.parametrize("case", ["all-right", "all-wrong", "right-with-p"])
def test_oracle_drafts_accept_what_they_should(random_model, prompts, case):
    steps, max_new = 3, [9, 7, 12]
    longer = generated_tokens(_engine(random_model), prompts, [m + steps for m in max_new])   # drafts past the end
    continuation = {tuple(p): p + t for p, t in zip(prompts, longer)}
    rng = torch.Generator().manual_seed(7)
    decided = {}

    def right(row, length, j):
        if case != "right-with-p":
            return case == "all-right"
        key = (row, length, j)
        if key not in decided:
            decided[key] = bool(torch.rand((), generator=rng) < 0.6)
        return decided[key]

    engine = _engine(random_model, SpecConfig(num_steps=steps), max_batch=3, bucket_sizes=(4,))
    _oracle(engine, continuation, right)
    assert generated_tokens(engine, prompts, max_new) == [t[:m] for t, m in zip(longer, max_new)]
    lens = engine.stats.accept_lens
    if case == "all-right":
        assert set(lens) == {steps + 1}
    elif case == "all-wrong":
        assert set(lens) == {1}
    else:
        # each iteration accepts the leading right drafts and the bonus, nothing more
        expected = []
        for (row, length, _), _ in sorted(decided.items())[::steps]:
            leading = 0
            while leading < steps and decided[row, length, leading + 1]:
                leading += 1
            expected.append(leading + 1)
        assert sorted(lens) == sorted(expected) and len(set(lens)) > 1


def _mid_block(lens: list[int], index: int) -> bool:
    """Whether generated token ``index`` lies inside a committed block and is not its last token
    (blocks: the prefill's first token, then one of each accept length)."""
    end = 1
    for accepted in lens:
        if end > index:
            break
        end += accepted
    return end > index + 1


def test_drafts_from_the_hidden_states_accept_what_the_oracle_says():
    """The MTP layer reads only the hidden states (``drafting_from_hidden``): the verify hidden
    states the draft extend takes and the hidden each draft step hands the next decide every draft,
    so the accept lengths are exactly the oracle's (in the engine's step order: two rows, joins and
    departures). Requests end mid-block at max_new_tokens, and at an eos inside a block."""
    model = DSAModel(get_config("tiny", vocab_size=256), dtype=torch.float32).init_weights(5)
    succ = drafting_from_hidden(model, 0)
    steps, max_new = 3, [12, 9, 14]
    prompts = random_prompts(PROMPT_LENS, model.config.vocab_size)
    longer = generated_tokens(_engine(model), prompts, [m + steps for m in max_new])        # drafts past the end
    engine = _engine(model, SpecConfig(num_steps=steps))
    assert generated_tokens(engine, prompts, max_new) == [t[:m] for t, m in zip(longer, max_new)]
    expected = _chain_accept_lens(longer, max_new, steps, succ)
    assert engine.stats.accept_lens == _in_step_order(expected, max_batch=2)
    assert set(engine.stats.accept_lens) == set(range(1, steps + 2))     # step drafts accepted too
    assert any(1 + sum(lens) > limit for lens, limit in zip(expected, max_new))

    # an eos that stops a request inside an accepted block: the block's later tokens are dropped
    request, index = next((r, i) for r, lens in enumerate(expected) for i in range(1, max_new[r] - 1)
                          if longer[r][i] not in longer[r][:i] and _mid_block(lens, i))
    eos = longer[request][index]
    results = engine.generate(prompts, max_new, eos_token_id=eos)
    for result, tokens, limit in zip(results, longer, max_new):
        stop = tokens.index(eos) + 1 if eos in tokens[:limit] else limit
        assert result.token_ids == tokens[:stop]
        assert result.finish_reason == ("eos" if eos in tokens[:limit] else "length")
    assert results[request].finish_reason == "eos" and len(results[request].token_ids) == index + 1
    expected = _chain_accept_lens(longer, max_new, steps, succ, eos)
    assert _mid_block(expected[request], index)
    assert engine.stats.accept_lens == _in_step_order(expected, max_batch=2)


def test_rejected_kv_is_never_read(guessing_model, prompts, plain_guessing):
    """After every iteration, NaN into both pools at the rejected positions ``L + A .. L + N - 1``:
    nothing reads them before the next verify / draft extend overwrites them."""
    spec = SpecConfig(num_steps=3)
    engine = _engine(guessing_model, spec)
    worker = engine.worker
    step = worker.step
    poisoned = []

    def poisoning_step(self, rows, **kwargs):
        result = step(rows, **kwargs)
        for row, accepted in zip(rows, result.accept_lens):
            committed = int(self.state.seq_lens[row])
            stale = self.req_pool.req_to_token[row, committed:committed - accepted + spec.num_draft_tokens].long()
            for pool in (self.target_kv, self.mtp_kv):
                for cache in pool.mla_cache + pool.index_k_cache:
                    cache[stale] = float("nan")
            poisoned.append(stale.numel())
        return result

    worker.step = types.MethodType(poisoning_step, worker)
    assert generated_tokens(engine, prompts, MAX_NEW) == plain_guessing
    assert sum(poisoned) > 0


def test_page_boundaries_eos_and_eager_batches(guessing_model):
    """Verify blocks across page boundaries (prompts 61..64, 127, 128), requests ending at
    max_new_tokens and at eos, three requests above the largest bucket (eager phases). Where in a
    block a request ends is not known here; the mid-block ends are asserted in
    ``test_drafts_from_the_hidden_states_accept_what_the_oracle_says``."""
    prompts = random_prompts((61, 62, 63, 64, 127, 128), 1031, seed=5)
    max_new = [5, 6, 7, 8, 9, 10]
    plain = _engine(guessing_model, max_batch=3, bucket_sizes=(1,))
    expected = generated_tokens(plain, prompts, max_new)
    engine = _engine(guessing_model, SpecConfig(num_steps=3), max_batch=3, bucket_sizes=(1,))
    assert generated_tokens(engine, prompts, max_new) == expected
    assert None in engine.stats.step_buckets and 1 in engine.stats.step_buckets
    assert engine.stats.mean_accept_len > 1
    eos = expected[4][3]
    first = {i: t.index(eos) for i, t in enumerate(expected) if eos in t}
    results = engine.generate(prompts, max_new, eos_token_id=eos)
    for i, (result, tokens) in enumerate(zip(results, expected)):
        assert result.token_ids == (tokens[:first[i] + 1] if i in first else tokens)
        assert result.finish_reason == ("eos" if i in first else "length")


def test_context_end(guessing_model):
    """A request that fills the context exactly runs (its last verify block writes past it, inside
    the table's headroom); one more token is refused (its result says why)."""
    spec = SpecConfig(num_steps=3)
    context = 80
    prompt = random_prompts((72,), 1031, seed=9)[0]
    expected = generated_tokens(_engine(guessing_model, context_len=context), [prompt], [9])
    engine = _engine(guessing_model, spec, context_len=context)
    assert engine.req_pool.width == context + 4 + spec.num_draft_tokens
    assert generated_tokens(engine, [prompt], [9]) == expected
    refused = engine.generate(prompt, 10)
    assert refused.finish_reason == "refused" and refused.token_ids == []
    assert "need 81 positions, more than context_len=80" in refused.error


def test_simulated_accept_length(random_model, prompts, monkeypatch):
    monkeypatch.setenv("DSASPEC_SIMULATE_ACCEPT_LEN", "2.5")   # the commands' business: SpecConfig does not read it
    assert SpecConfig(num_steps=3).simulate_accept_len is None and not SpecConfig(num_steps=3).simulated
    spec = SpecConfig(num_steps=3, simulate_accept_len=2.5)
    assert spec.simulate_accept_len == 2.5 and spec.simulated
    engine = _engine(random_model, spec)
    results = engine.generate(prompts, [20, 20, 20])
    assert [len(r.token_ids) for r in results] == [20, 20, 20]          # lengths stay exact
    lens = engine.stats.accept_lens
    assert set(lens) == {2, 3} and abs(statistics.fmean(lens) - 2.5) < 0.5


def test_spec_config_is_validated():
    with pytest.raises(ValueError, match="eagle_topk=2: only 1"):
        SpecConfig(num_steps=3, eagle_topk=2)
    with pytest.raises(ValueError, match="num_draft_tokens must be num_steps \\+ 1 = 4"):
        SpecConfig(num_steps=3, num_draft_tokens=6)
    with pytest.raises(ValueError, match="num_steps must be a positive int"):
        SpecConfig(num_steps=0)
    with pytest.raises(ValueError, match=r"simulated accept length must lie in \[1, 4\]"):
        SpecConfig(num_steps=3, simulate_accept_len=4.5)
    with pytest.raises(ValueError, match=r"simulated accept length must lie in \[1, 3\]"):
        SpecConfig(num_steps=2, simulate_accept_len=0.5)


def test_argmax_exchange_option_keeps_tokens_and_acceptance(guessing_model, prompts):
    from dsaspec.layers.logits_processor import GREEDY_TOPK1

    outputs = {}
    for exchange in (True, False):
        engine = _engine(guessing_model, SpecConfig(num_steps=3),
                         options=RuntimeOptions(draft_argmax_exchange=exchange))
        assert engine.worker.processor.uses_draft_argmax_exchange(GREEDY_TOPK1) == exchange
        assert engine.worker.processor.uses_verify_argmax_exchange()
        outputs[exchange] = (generated_tokens(engine, prompts, MAX_NEW), engine.stats.accept_lens)
    assert outputs[True] == outputs[False]


def test_engine_takes_the_options_of_its_model_unless_given_its_own():
    from dsaspec.layers.attention.backend import CONTEXT_WIDE
    from dsaspec.layers.logits_processor import GREEDY_TOPK1

    off = RuntimeOptions().baseline()
    model = DSAModel(get_config("tiny"), dtype=torch.float32, options=off).init_weights(0)
    inherited = _engine(model, SpecConfig(num_steps=2)).worker
    assert not inherited.processor.uses_draft_argmax_exchange(GREEDY_TOPK1)
    assert not inherited.processor.uses_verify_argmax_exchange()
    assert not inherited.multi_step.skip_unused_schedules
    assert inherited.backend.kernel == CONTEXT_WIDE and "bounded_metadata=False" in inherited.backend.kernel_reason
    own = _engine(model, SpecConfig(num_steps=2), options=RuntimeOptions(metadata_program_budget=24)).worker
    assert own.processor.uses_draft_argmax_exchange(GREEDY_TOPK1) and own.processor.uses_verify_argmax_exchange()
    assert own.multi_step.skip_unused_schedules and "CUDA" in own.backend.kernel_reason
    assert own.backend.budget == 24 and all(s.budget == 24 for s in own.multi_step.step_backends)
    plain = _engine(model, options=RuntimeOptions(metadata_program_budget=24))
    assert plain.backend.budget == 24 and plain.backend.kernel == CONTEXT_WIDE
    assert "CUDA" in plain.backend.kernel_reason
    assert "bounded_metadata=False" in _engine(model).backend.kernel_reason


def test_index_share_layers_and_seeded_draft_steps(prompts):
    """GLM-5.2 style: shared-indexer target layers and draft steps seeded with the draft extend's
    top-k: the MTP indexer never runs in a draft step, whose seed holds min(L, K) slots, nor does
    its fused ``q_b_proj`` + ``wq_b`` GEMM (``q_b_proj`` alone); tokens are plain decoding's, and
    the same weights unfused decode the same tokens."""
    config = get_config("tiny", num_hidden_layers=3, indexer_types=("full", "shared", "full"),
                        index_share_for_mtp_iteration=True)
    model = predictable(DSAModel(config, dtype=torch.float32).init_weights(3), 0.5)
    assert model.model.layers[1].self_attn.indexer is None
    expected = generated_tokens(_engine(model), prompts, MAX_NEW)
    engine = _engine(model, SpecConfig(num_steps=3))
    worker = engine.worker
    indexer_calls = {"draft": 0, "other": 0}
    latent_calls = {"draft": 0, "other": 0}
    phase = {"now": "other"}
    model.mtp_layer.self_attn.indexer.register_forward_hook(
        lambda *_: indexer_calls.__setitem__(phase["now"], indexer_calls[phase["now"]] + 1))
    model.mtp_layer.self_attn.fused_latent.register_forward_hook(
        lambda *_: latent_calls.__setitem__(phase["now"], latent_calls[phase["now"]] + 1))
    draft = worker._draft
    seeds = []

    def watched_draft(self, batch, attns, check_values):
        phase["now"] = "draft"
        real = batch.rows != self.dummy_row
        seed = self.state.seed[batch.rows[real]]
        seeds.append(((seed >= 0).sum(1).tolist(), batch.seq_lens[real].tolist()))
        draft(batch, attns, check_values)
        phase["now"] = "other"

    worker._draft = types.MethodType(watched_draft, worker)
    assert generated_tokens(engine, prompts, MAX_NEW) == expected
    assert indexer_calls["draft"] == 0 and indexer_calls["other"] > 0
    assert latent_calls == indexer_calls
    k = config.index_topk
    assert seeds and all(count == min(length, k) for counts, lengths in seeds
                         for count, length in zip(counts, lengths))
    assert max(length for _, lengths in seeds for length in lengths) > k      # sparse seeds too
    for attn in (layer.self_attn for layer in model.model.layers):
        attn.fused_input = attn.fused_latent = None
    assert generated_tokens(_engine(model), prompts, MAX_NEW) == expected


def test_kv_reservation_covers_the_last_verify_block(random_model):
    spec = SpecConfig(num_steps=3)
    engine = _engine(random_model, spec, num_slots=3 * PAGE_SIZE)
    # 60 + 5 - 1 = 64 positions (one page) plus 3 verified past the last: two pages per request
    results = engine.generate(random_prompts((60, 60), 1031, seed=2), 5)
    assert set(engine.stats.step_batches) == {1}                 # the second waited for pages
    assert [len(r.token_ids) for r in results] == [5, 5]


SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=64, q_lora_rank=32, num_attention_heads=2,
             index_n_heads=2, num_hidden_layers=1)    # a one-layer model: quick under the interpreter


def test_row_invariant_model_runs_the_row_invariant_kernels():
    """The model's row-invariant mode sets every GEMM and norm module's switch, and decodes what the
    default mode does (whether a row's bits depend on the other rows:
    ``test_row_invariant_layers_compute_each_row_alone``)."""
    config = get_config("tiny", **SMALL)
    default = DSAModel(config, dtype=torch.float32).init_weights(4)
    invariant = DSAModel(config, dtype=torch.float32, row_invariant=True).init_weights(4)
    switched = [m for m in invariant.modules() if isinstance(m, RowInvariant)]
    assert all(m.row_invariant for m in switched)
    assert {type(m).__name__ for m in switched} == {"Linear", "RMSNorm", "LayerNorm", "Indexer", "MLAAttention",
                                                    "LMHead"}
    prompt = [3, 1, 4, 1, 5]
    outs = [generated_tokens(_engine(model, max_batch=1, bucket_sizes=(1,)), [prompt], [3]) for model in (default, invariant)]
    assert outs[0] == outs[1]


def _row_dependent_modules(model: DSAModel, rows: int, device) -> list[str]:
    """The Linear, norm and LM-head modules of the model (the first of each type and weight shape)
    whose output row differs in some bit between the row alone (M = 1: the first and the last
    row), among the first 7 rows, and among all ``rows`` rows (random inputs in the model's dtype,
    one draw per input width)."""
    dtype = model.lm_head.weight.dtype
    generator = torch.Generator().manual_seed(0)
    inputs, seen, differing = {}, set(), []
    for name, module in model.named_modules():
        key = (type(module), getattr(getattr(module, "weight", None), "shape", None))
        if not isinstance(module, (Linear, RMSNorm, LayerNorm, LMHead)) or key in seen:
            continue
        seen.add(key)
        width = module.weight.shape[-1]
        if width not in inputs:
            inputs[width] = torch.randn(rows, width, generator=generator).to(device, dtype)
        x = inputs[width]
        with torch.no_grad():
            full = module(x)
            same = (torch.equal(module(x[:1])[0], full[0]) and torch.equal(module(x[-1:])[0], full[-1])
                    and torch.equal(module(x[:7]), full[:7]))
        if not same:
            differing.append(name)
    return differing


def test_row_invariant_layers_compute_each_row_alone():
    """In row-invariant mode every Linear, norm and the LM head give a row the same bits at M = 1,
    7 and 32 (what makes a verify row equal the decode step's). fp32 on CPU (the row-invariant
    kernels under the interpreter): torch's own CPU GEMM gives other bits at M = 1 than at M = 32,
    so the default mode's Linears fail here; torch's CPU norms happen to be row-invariant, so a
    norm bypassing its kernel is caught by the GPU variant only."""
    config = get_config("tiny", **SMALL)
    invariant = DSAModel(config, dtype=torch.float32, row_invariant=True).init_weights(4)
    assert _row_dependent_modules(invariant, 32, "cpu") == []
    default = DSAModel(config, dtype=torch.float32).init_weights(4)
    differing = _row_dependent_modules(default, 32, "cpu")
    assert differing and all(isinstance(default.get_submodule(n), (Linear, LMHead)) for n in differing)


SMALL_MOE = dict(SMALL, n_routed_experts=8, moe_intermediate_size=32, num_experts_per_tok=3, n_shared_experts=1,
                 first_k_dense_replace=0, n_group=4, topk_group=2, routed_scaling_factor=2.5)


def _moe_row_dependent(model: DSAModel, rows: int, device) -> bool:
    """Whether an MoE layer's output row differs in some bit between M = 1, 7 and ``rows``."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(rows, model.config.hidden_size, generator=generator).to(device, model.lm_head.weight.dtype)
    moe = model.model.layers[0].mlp
    with torch.no_grad():
        full = moe(x)
        return not (torch.equal(moe(x[:1])[0], full[0]) and torch.equal(moe(x[-1:])[0], full[-1])
                    and torch.equal(moe(x[:7]), full[:7]))


def test_row_invariant_moe_computes_each_token_alone():
    """Row-invariant mode: the MoE layer (router, routed experts, shared expert) gives a token the
    same bits whatever the other tokens; the default mode's CPU GEMMs do not (so the check bites)."""
    config = get_config("tiny", **SMALL_MOE)
    invariant = DSAModel(config, dtype=torch.float32, row_invariant=True).init_weights(4)
    assert {type(m).__name__ for m in invariant.modules() if isinstance(m, RowInvariant) and m.row_invariant} >= \
        {"Router", "RoutedExperts"}
    assert not _moe_row_dependent(invariant, 32, "cpu")
    assert _moe_row_dependent(DSAModel(config, dtype=torch.float32).init_weights(4), 32, "cpu")


def test_row_invariant_moe_speculative_equals_plain():
    """A one-layer MoE model (the decoder layer and the MTP layer MoE) in row-invariant mode, torch
    DSA ops: speculative output equals plain greedy output, drafts accepted."""
    config = get_config("tiny", **SMALL_MOE)
    model = predictable(DSAModel(config, dtype=torch.float32, row_invariant=True).init_weights(6), 0.5)
    assert hasattr(model.model.layers[0].mlp, "experts") and hasattr(model.mtp_layer.mlp, "experts")
    prompts = random_prompts((5, 70), config.vocab_size, seed=4)                  # 70 > top-k 64: sparse rows
    expected = generated_tokens(_engine(model, context_len=96), prompts, [6, 5])
    engine = _engine(model, SpecConfig(num_steps=2), context_len=96)
    assert generated_tokens(engine, prompts, [6, 5]) == expected
    assert max(engine.stats.accept_lens) > 1


def test_row_invariant_fp8_moe_speculative_equals_plain():
    """The one-layer MoE model with FP8 block-scaled weights (projections, routed and shared
    experts; dims multiples of 128) in row-invariant mode, torch ops: speculative output equals
    plain greedy output, drafts accepted. Short prompts (the row-invariant GEMMs of the wider model
    are slow under the interpreter; the sparse rows are the bf16 MoE test's)."""
    config = get_config("tiny", **SMALL_MOE | dict(hidden_size=128, q_lora_rank=128, moe_intermediate_size=128,
                                                   n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1),
                        quantization=Fp8Quantization())
    model = predictable(DSAModel(config, dtype=torch.float32, row_invariant=True).init_weights(6), 0.5)
    experts = model.model.layers[0].mlp.experts
    assert experts.fp8 and experts.row_invariant and model.mtp_layer.mlp.experts.fp8
    prompts = random_prompts((5, 12), config.vocab_size, seed=4)
    expected = generated_tokens(_engine(model, context_len=96), prompts, [6, 5])
    engine = _engine(model, SpecConfig(num_steps=2), context_len=96)
    assert generated_tokens(engine, prompts, [6, 5]) == expected
    assert max(engine.stats.accept_lens) > 1


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny", "bench"])
def test_gpu_row_invariant_layers_compute_each_row_alone(preset):
    """bf16 on the GPU at the preset's shapes: every Linear, norm and the LM head of a row-invariant
    model give a row the same bits at M = 1, 7 and 32 (cuBLAS and torch's norms pick kernels by M)."""
    model = DSAModel(get_config(preset, num_hidden_layers=1), device="cuda", use_triton=True,
                     row_invariant=True).init_weights(4)
    assert _row_dependent_modules(model, 32, "cuda") == []


# ---------------------------------------------------------------------------------------------
# GPU: `python -m pytest -q -m gpu tests/test_spec_engine.py`


@pytest.mark.gpu
@pytest.mark.parametrize("preset, batch, max_new", [("tiny", 32, 256), ("bench", 8, 64), ("tiny-moe", 16, 64)])
def test_gpu_speculative_equals_plain_row_invariant(preset, batch, max_new):
    """bf16, CUDA graphs, 1M context configured, row-invariant GEMMs and norms: speculative output
    equals plain greedy output token for token; the batch shrinks as requests finish (tiny-moe:
    the MoE layers' torch expert path inside the graphs)."""
    model = gpu_model(preset, row_invariant=True,
                      branch_scale={"tiny": 0.5, "bench": 0.2, "tiny-moe": 0.5}[preset])
    requests = gpu_prompts(batch, preset)
    limits = [max_new - 3 * (i % 4) for i in range(batch)]
    plain = gpu_engine(model, max_batch=batch, requests=requests, max_new=max_new)
    spec = gpu_engine(model, SpecConfig(num_steps=3), max_batch=batch, requests=requests, max_new=max_new)
    assert spec.use_cuda_graph and spec.backend.kernel == "bounded"
    want = generated_tokens(plain, requests, limits)
    got = generated_tokens(spec, requests, limits)
    mismatched = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
    assert not mismatched, f"requests {mismatched} differ; first at token " \
        f"{next(j for j, (x, y) in enumerate(zip(got[mismatched[0]], want[mismatched[0]])) if x != y)}"
    # Drafts are accepted (random tiny-moe weights: 1.19 measured on the H200).
    assert {"tiny": 1.2, "bench": 1.2, "tiny-moe": 1.1}[preset] < spec.stats.mean_accept_len < 4
    assert max(spec.stats.step_batches) == batch and min(spec.stats.step_batches) < batch


@pytest.mark.gpu
def test_gpu_drafts_from_the_hidden_states_accept_what_the_oracle_says():
    """bf16 from CUDA graphs (cuBLAS GEMMs), 32 requests finishing at different lengths, 1M context
    configured: the hidden-drafting model's accept lengths are exactly the oracle's (a hidden
    state's largest coordinate leads the next by about half its value, far above bf16 rounding)."""
    config = get_config("tiny", vocab_size=256)
    model = DSAModel(config, device="cuda", use_triton=True).init_weights(5)
    succ = drafting_from_hidden(model, 0)
    batch, steps = 32, 3
    requests = [[t % config.vocab_size for t in p] for p in gpu_prompts(batch, "tiny")]
    limits = [96 - 5 * (i % 7) for i in range(batch)]
    plain = gpu_engine(model, max_batch=batch, requests=requests, max_new=96 + steps)
    longer = generated_tokens(plain, requests, [m + steps for m in limits])
    spec = gpu_engine(model, SpecConfig(num_steps=steps), max_batch=batch, requests=requests, max_new=96)
    assert spec.use_cuda_graph
    assert generated_tokens(spec, requests, limits) == [t[:m] for t, m in zip(longer, limits)]
    expected = _chain_accept_lens(longer, limits, steps, succ)
    assert spec.stats.accept_lens == _in_step_order(expected, max_batch=batch)
    assert set(spec.stats.accept_lens) == set(range(1, steps + 2))


@pytest.mark.gpu
def test_gpu_kill_switches_keep_tokens_and_acceptance():
    """Bounded metadata + one-launch draft metadata + argmax exchanges (RuntimeOptions()) against
    context-wide + precompute-and-copy + logits gathers (its baseline()): identical tokens and accept
    lengths."""
    from dsaspec.layers.attention.multi_step import ONE_LAUNCH, PRECOMPUTE_AND_COPY
    from dsaspec.layers.logits_processor import GREEDY_TOPK1

    model = gpu_model("bench", row_invariant=False)
    requests = gpu_prompts(6, "bench", seed=12)
    outputs = {}
    for new in (True, False):
        options = RuntimeOptions() if new else RuntimeOptions().baseline()
        engine = gpu_engine(model, SpecConfig(num_steps=3), max_batch=6, requests=requests, max_new=48,
                             options=options)
        worker = engine.worker
        assert worker.backend.kernel == ("bounded" if new else "context_wide")
        assert worker.multi_step.path(8) == (ONE_LAUNCH if new else PRECOMPUTE_AND_COPY)
        assert worker.processor.uses_draft_argmax_exchange(GREEDY_TOPK1) == new
        assert worker.processor.uses_verify_argmax_exchange() == new
        outputs[new] = (generated_tokens(engine, requests, 48), engine.stats.accept_lens)
    assert outputs[True] == outputs[False]
    assert statistics.fmean(outputs[True][1]) > 1.2


@pytest.mark.gpu
def test_gpu_graph_and_eager_phases_agree():
    """The same iterations from CUDA graphs and eagerly (static buffers, no capture), and with the
    batch above the largest bucket (eager metadata sized to the live lengths, 5 rows instead of a
    bucket of 8: row-invariant numerics, since cuBLAS gives a row other bits at another M)."""
    model = gpu_model("tiny", row_invariant=True)
    requests = gpu_prompts(5, "tiny", seed=13)
    runs = []
    for graphs, buckets in ((True, (1, 2, 4, 8)), (False, (1, 2, 4, 8)), (True, (1, 2))):
        engine = Engine(model, speculative=SpecConfig(num_steps=3), max_batch=5, context_len=4096,
                        bucket_sizes=buckets, use_cuda_graph=graphs, progress=False)
        runs.append((generated_tokens(engine, requests, 40), engine.stats.accept_lens))
    assert runs[0] == runs[1] == runs[2]


def test_generate_command_speculative(capsys, monkeypatch):
    from dsaspec.commands import cli

    args = ["generate", "--prompt-lens", "5,70", "--max-new-tokens", "6", "--context-len", "128", "--dtype", "fp32",
            "--no-progress", "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "speculative decoding: NEXTN, 2 draft steps, topk 1, 3 tokens verified" in out
    assert "mean accept length 1.00 of 3" in out and "request 1: prompt 70 tokens, 6 generated" in out
    monkeypatch.setenv("DSASPEC_SIMULATE_ACCEPT_LEN", "2")
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "NOT the model's greedy output" in out and "mean accept length 2.00 of 3 (simulated)" in out


@pytest.mark.parametrize("argv, message", [
    (["--speculative-num-steps", "3"], "--speculative-num-steps needs --speculative-algorithm"),
    (["--speculative-algorithm", "NEXTN", "--speculative-eagle-topk", "4"], "eagle_topk=4: only 1"),
    (["--speculative-algorithm", "NEXTN", "--speculative-num-draft-tokens", "7"],
     "num_draft_tokens must be num_steps + 1 = 4"),
    (["--speculative-algorithm", "MEDUSA"], "--speculative-algorithm: invalid choice"),
])
def test_generate_speculative_option_errors(capsys, argv, message):
    from dsaspec.commands import cli

    assert cli.main(["generate", "--no-progress", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dsaspec: error:") and message in err[0]


def test_bench_e2e_smoke_on_cpu(tmp_path):
    """Without CUDA the end-to-end bench runs tiny sizes, checks baseline == new tokens, reports no times."""
    import json

    from dsaspec.commands import cli

    assert cli.main(["bench", "e2e", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "e2e.json").read_text())
    assert payload["rows"] and all(r["tokens_identical"] for r in payload["rows"])
    assert all(r["new_tok_s_user"] is None for r in payload["rows"])
    assert {r["accept"] for r in payload["rows"]} == {"3.0", "real"}


def test_triton_ops_speculative_equals_plain():
    """bf16 through the Triton kernels (interpreter on CPU) and the row-invariant GEMMs and norms,
    on a small one-layer model: speculative output equals plain greedy output."""
    config = get_config("tiny", vocab_size=97, hidden_size=64, intermediate_size=64, q_lora_rank=32,
                        num_attention_heads=2, index_n_heads=2, num_hidden_layers=1)
    model = predictable(DSAModel(config, use_triton=True, row_invariant=True).init_weights(6), 0.5)
    prompts = random_prompts((5, 70), config.vocab_size, seed=4)                  # 70 > top-k 64: sparse rows
    expected = generated_tokens(_engine(model, context_len=96), prompts, [5, 4])
    engine = _engine(model, SpecConfig(num_steps=2), context_len=96)
    assert generated_tokens(engine, prompts, [5, 4]) == expected
    assert max(engine.stats.accept_lens) > 1


def test_verify_rows_grouped_where_the_group_fits():
    """The indexer groups a request's N verify rows only where the group fits
    (``group_fits``: next_pow2(N) x next_pow2(index heads) <= 512 dot columns): with 64 index heads
    N = 8 (S = 7) is one group, N = 9 (S = 8) would hold 1,024 columns and stays ungrouped, as
    does every N in the row-invariant mode."""
    model = DSAModel(get_config("tiny", index_n_heads=64), dtype=torch.float32).init_weights(0)
    for steps, rows_per_group in ((3, 4), (7, 8), (8, 1)):
        backend = _engine(model, SpecConfig(num_steps=steps)).backend
        assert backend.rows_per_group("target_verify") == rows_per_group, steps
    row_invariant = DSAModel(get_config("tiny", index_n_heads=64), dtype=torch.float32,
                             row_invariant=True).init_weights(0)
    assert _engine(row_invariant, SpecConfig(num_steps=3)).backend.rows_per_group("target_verify") == 1
