"""The Engine (continuous batching, bucket padding, the plain decode worker) against one-request-at-a-time
greedy decoding through the model's own step path, metadata kernels against each other, bad
inputs and requests that can never fit, the ``dsaspec generate`` command and the ``dsaspec bench
decode`` smoke run.

CPU: fp32 tiny model with the torch reference ops (the metadata kernels run under the Triton
interpreter), plus one short bf16 run through the Triton ops. GPU (``-m gpu``): graph vs eager
decode, bounded vs context-wide metadata, and a 1M-token context against a 4k one, token for token.
"""

import argparse
import json

import numpy as np
import pytest
import torch

from dsaspec.configs.model_config import get_config
from dsaspec.configs.runtime_options import RuntimeOptions
from dsaspec.engine.engine import Engine, EngineCore, GenerationResult, RequestRefused
from dsaspec.executor.decode_worker import DecodeWorker
from dsaspec.memory import PAGE_SIZE, KVPool, PageAllocator, ReqToTokenPool, RequestSlots
from dsaspec.layers.attention.inputs import build_extend_inputs
from dsaspec.models.dsa_model import DSAModel
from dsaspec.testing.spec_models import random_prompts

CONTEXT = 256
PROMPT_LENS = (5, 70, 33)           # 70 > top-k 64: sparse selection during decode
MAX_NEW = [6, 4, 8]                 # different lengths: requests finish and join at different steps


@torch.no_grad()
def sequential_greedy(model: DSAModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """One request alone: prefill, then one single-row decode step per token through
    ``build_extend_inputs`` (no backend, no buckets, no padding)."""
    device = model.lm_head.weight.device
    pool = ReqToTokenPool(1, len(prompt) + max_new_tokens, device=device)
    slots = RequestSlots(pool, PageAllocator(PAGE_SIZE * (2 + (len(prompt) + max_new_tokens) // PAGE_SIZE)))
    kv = KVPool.for_model(model.config, slots.allocator.num_slots, dtype=model.lm_head.weight.dtype,
                          device=device)
    row = slots.admit(len(prompt), reserve=max_new_tokens)
    hidden = model.prefill(torch.tensor(prompt, device=device), pool.req_to_token, row, kv)
    tokens = [int(model.logits(hidden[-1:]).argmax())]
    while len(tokens) < max_new_tokens:
        position = len(prompt) + len(tokens) - 1
        positions, loc, attn = build_extend_inputs(pool.req_to_token, [row], [position], [1])
        hidden = model(torch.tensor(tokens[-1:], device=device), positions, loc, kv, attn)
        tokens.append(int(model.logits(hidden).argmax()))
    return tokens


@pytest.fixture(scope="module")
def fp32_model():
    return DSAModel(get_config("tiny"), dtype=torch.float32).init_weights(0)


@pytest.fixture(scope="module")
def prompts(fp32_model):
    return random_prompts(PROMPT_LENS, fp32_model.config.vocab_size)


@pytest.fixture(scope="module")
def expected(fp32_model, prompts):
    return [sequential_greedy(fp32_model, p, n) for p, n in zip(prompts, MAX_NEW)]


def _engine(model, **kwargs):
    kwargs.setdefault("context_len", CONTEXT)
    kwargs.setdefault("progress", False)
    return Engine(model, **kwargs)


def _all_rows_free(engine):
    return engine.req_pool.num_free == engine.max_batch and \
        engine.allocator.num_free_pages == engine.allocator.num_pages - 1


# ---------------------------------------------------------------------------------------------
# CPU


def test_continuous_batching_matches_one_request_at_a_time(fp32_model, prompts, expected):
    """Two rows, three requests: the third is admitted (and prefilled) while the first decodes."""
    engine = _engine(fp32_model, max_batch=2, bucket_sizes=(1, 2))
    results = engine.generate(prompts, MAX_NEW)
    assert [r.token_ids for r in results] == expected
    assert [r.prompt_len for r in results] == list(PROMPT_LENS)
    assert all(r.finish_reason == "length" for r in results)
    # request 1 finishes after 3 steps, request 2 joins request 0 for 2 steps, then runs alone
    assert engine.stats.step_batches == [2] * 5 + [1] * 5
    assert engine.stats.step_buckets == [2] * 5 + [1] * 5
    assert engine.stats.prefill_tokens == sum(PROMPT_LENS)
    assert _all_rows_free(engine)


def test_engine_core_admits_between_steps_cancels_and_stops(fp32_model, prompts, expected):
    """Requests added while others decode give generate's tokens; a cancelled running request frees
    its row and pages at once; a stop token ends a request (kept); one that never fits is refused."""
    engine = _engine(fp32_model, max_batch=2, bucket_sizes=(1, 2))
    core = EngineCore(engine)
    first = core.add_request(prompts[0], MAX_NEW[0])
    tokens: dict[int, list[int]] = {}
    finished = {}

    def run_step():
        out = core.step()
        for rid, new in out.new_tokens.items():
            tokens.setdefault(rid, []).extend(new)
        finished.update(out.finished)
        return out

    assert run_step().batch == 1
    late = core.add_request(prompts[2], MAX_NEW[2], stop_token_ids=[expected[2][3]])
    doomed = core.add_request(prompts[1], MAX_NEW[1])
    assert run_step().batch == 2 and len(core.waiting) == 1       # one row left: doomed waits
    assert core.cancel(doomed) and not core.cancel(doomed)        # dropped from the queue
    while core.has_work:
        run_step()
    assert tokens[first] == expected[0] and finished[first] == "length"
    assert tokens[late] == expected[2][:4] and finished[late] == "eos"
    assert doomed not in tokens and _all_rows_free(engine)
    running = core.add_request(prompts[1], MAX_NEW[1])
    run_step()
    assert engine.req_pool.num_free == 1 and core.cancel(running)
    assert _all_rows_free(engine) and not core.has_work
    with pytest.raises(RequestRefused, match="more than context_len=256"):
        core.add_request([1] * 250, 10)
    with pytest.raises(ValueError, match=r"stop_token_ids must be in \[0, 1031\)"):
        core.add_request([1], 2, stop_token_ids=[1031])
    with pytest.raises(ValueError, match="prompt is empty"):
        core.add_request([], 2)
    assert not core.has_work


FEW_PROGRAMS = RuntimeOptions(metadata_program_budget=8)  # few bounded programs under the interpreter


@pytest.mark.parametrize("kernel, buckets, max_batch", [
    ("context_wide", (1, 2, 4), 3),   # bs 3 padded to bucket 4 (one padding row)
    ("bounded", (1, 2, 4), 3),
    ("context_wide", (1,), 3),        # above the largest bucket: eager metadata and forward
], ids=["context-wide-padded", "bounded-padded", "eager-above-buckets"])
def test_metadata_kernels_padding_and_eager_path_match(fp32_model, prompts, expected, kernel, buckets,
                                                       max_batch):
    engine = _engine(fp32_model, max_batch=max_batch, bucket_sizes=buckets, force_kernel=kernel,
                     options=FEW_PROGRAMS)
    assert engine.backend.kernel == kernel and engine.backend.budget == 8
    results = engine.generate(prompts, MAX_NEW)
    assert [r.token_ids for r in results] == expected
    assert engine.stats.step_batches[0] == 3
    assert engine.stats.step_buckets[0] == (4 if 4 in buckets else None)
    assert _all_rows_free(engine)


def test_triton_ops_bounded_and_context_wide_token_identical():
    """bf16 through the Triton kernels (interpreter on CPU): bounded and context-wide metadata give
    the same tokens, and both match the one-request-at-a-time loop."""
    model = DSAModel(get_config("tiny"), use_triton=True, options=FEW_PROGRAMS).init_weights(1)
    prompts = random_prompts((6, 9), model.config.vocab_size, seed=2)
    outputs = []
    for kernel in ("bounded", "context_wide"):
        engine = _engine(model, context_len=128, max_batch=2, bucket_sizes=(2,), force_kernel=kernel)
        assert engine.backend.budget == 8                  # the model's options
        outputs.append([r.token_ids for r in engine.generate(prompts, 3)])
    assert outputs[0] == outputs[1]
    assert outputs[0][1] == sequential_greedy(model, prompts[1], 3)


def test_admission_waits_for_kv_pages(fp32_model, prompts, expected):
    """Two free rows but pages for one request at a time: the others wait, nothing is refused."""
    engine = _engine(fp32_model, max_batch=2, bucket_sizes=(1, 2), num_slots=3 * PAGE_SIZE)
    results = engine.generate(prompts, MAX_NEW)
    assert [r.token_ids for r in results] == expected
    assert set(engine.stats.step_batches) == {1}
    assert _all_rows_free(engine)


def test_eos_stops_a_request_and_single_prompt_form(fp32_model, prompts, expected):
    eos = expected[0][2]
    assert eos not in expected[0][:2]
    engine = _engine(fp32_model, max_batch=3, bucket_sizes=(4,))
    results = engine.generate(prompts, MAX_NEW, eos_token_id=eos)
    for result, tokens in zip(results, expected):
        stop = tokens.index(eos) + 1 if eos in tokens else len(tokens)
        assert result.token_ids == tokens[:stop]
        assert result.finish_reason == ("eos" if eos in tokens else "length")
    single = engine.generate(torch.tensor(prompts[2]), MAX_NEW[2])
    assert isinstance(single, GenerationResult)
    assert single.token_ids == expected[2]
    assert single.tpot_s is not None and single.ttft_s >= 0
    one = engine.generate(prompts[0], 1)
    assert one.token_ids == expected[0][:1] and one.tpot_s is None and engine.stats.decode_steps == 0


def test_malformed_calls_raise_before_any_work(fp32_model):
    engine = _engine(fp32_model, context_len=100, max_batch=2, bucket_sizes=(1, 2), num_slots=3 * PAGE_SIZE)
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        engine.generate([], 4)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1, 2], []], 4)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1, got 0"):
        engine.generate([1, 2], 0)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        engine.generate([[1, 2], [3]], [2, -1])
    with pytest.raises(ValueError, match="max_new_tokens has 1 entries for 2 prompts"):
        engine.generate([[1, 2], [3]], [2])
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1 or a list of one per prompt"):
        engine.generate([1, 2], 2.0)
    with pytest.raises(ValueError, match=r"token id\(s\) \[1031\] outside the vocabulary \[0, 1031\)"):
        engine.generate([1, 1031], 2)
    with pytest.raises(ValueError, match="eos_token_id must be in"):
        engine.generate([1, 2], 2, eos_token_id=-1)
    with pytest.raises(ValueError, match="must be 1-D"):
        engine.generate(torch.zeros(2, 2, dtype=torch.long), 2)
    assert _all_rows_free(engine)
    assert engine.generate([1, 2, 3], 2).token_ids == sequential_greedy(fp32_model, [1, 2, 3], 2)
    with pytest.raises(ValueError, match="max_batch must be a positive int"):
        _engine(fp32_model, max_batch=0)


def test_token_ids_must_be_integers(fp32_model):
    """Python ints, numpy integers, 0-d integer tensors and 1-D tensors of any integer dtype are
    token ids; floats (never truncated), bools and other types raise, naming the prompt and the
    value."""
    engine = _engine(fp32_model, context_len=64, max_batch=2, bucket_sizes=(1, 2))
    want = sequential_greedy(fp32_model, [1, 2, 3], 2)
    scalars = [[np.int64(1), np.int32(2), np.uint8(3)],
               [torch.tensor(1), torch.tensor(2, dtype=torch.int32), torch.tensor(3, dtype=torch.uint8)]]
    tensors = [torch.tensor([1, 2, 3], dtype=dtype) for dtype in (torch.int16, torch.int32, torch.uint8)]
    for prompt in scalars + tensors:
        assert engine.generate(prompt, 2).token_ids == want
    assert [r.token_ids for r in engine.generate(scalars + tensors, 2)] == [want] * 5
    assert engine.generate([1, 2, 3], 2, eos_token_id=torch.tensor(want[0])).finish_reason == "eos"
    for prompt, error, message in [
        ([1.7, 2.2], TypeError, r"prompt 0, token 0: expected an integer token id, got 1.7 \(float\)"),
        ([[1, 2], [3, 2.0]], TypeError, r"prompt 1, token 1: expected an integer token id, got 2.0 "),
        ([1, True], TypeError, r"prompt 0, token 1: expected an integer token id, got True \(bool\)"),
        ([np.float32(1.5)], TypeError, r"prompt 0, token 0: .*1\.5\)? \(float32\)"),
        ([torch.tensor(1), torch.tensor(2.0)], TypeError, r"prompt 0, token 1: .* got tensor\(2\.\) "),
        (torch.tensor([1.0, 2.0]), TypeError,
         "prompt 0: a prompt tensor must have an integer dtype, got torch.float32"),
        ([[1], torch.tensor([True])], TypeError,
         "prompt 1: a prompt tensor must have an integer dtype, got torch.bool"),
        ([[1], torch.zeros(2, 2, dtype=torch.long)], ValueError,
         r"prompt 1: a prompt tensor must be 1-D, got shape \(2, 2\)"),
        ([[1, 2], 3], TypeError,
         r"prompt 1: expected a sequence of token ids or a 1-D integer tensor, got 3 \(int\)"),
        (["ab"], TypeError, r"prompt 0, token 0: expected an integer token id, got 'ab' \(str\)"),
    ]:
        with pytest.raises(error, match=message):
            engine.generate(prompt, 2)
    with pytest.raises(TypeError, match=r"eos_token_id: expected an integer token id, got 2.5 \(float\)"):
        engine.generate([1, 2], 2, eos_token_id=2.5)
    assert _all_rows_free(engine)


def test_requests_that_can_never_fit_are_refused_and_the_others_run(fp32_model, prompts, expected, capsys):
    """A request beyond the context or needing more KV pages than the pool has gets a "refused"
    result saying why (no tokens, no work); the others in the call run as they would alone, and
    ``dsaspec generate`` prints one line for each refused request."""
    from dsaspec.commands import generate

    engine = _engine(fp32_model, context_len=100, max_batch=2, bucket_sizes=(1, 2), num_slots=2 * PAGE_SIZE)
    results = engine.generate([prompts[0], [1] * 101, prompts[1], prompts[2], [1] * 95], [6, 1, 4, 8, 10])
    assert [r.finish_reason for r in results] == ["length", "refused", "refused", "length", "refused"]
    assert results[0].token_ids == expected[0] and results[3].token_ids == expected[2]
    assert results[1].error == ("101 prompt tokens + max_new_tokens=1 need 101 positions, more than "
                                "context_len=100")
    assert results[2].error == ("73 positions need 2 KV pages of 64 slots, the pool has 1 (num_slots=128); "
                                "raise num_slots")
    assert results[4].error.startswith("95 prompt tokens + max_new_tokens=10 need 104 positions")
    for refused in (results[1], results[2], results[4]):
        assert refused.token_ids == [] and refused.ttft_s is None and refused.tpot_s is None
    assert [r.prompt_len for r in results] == [5, 101, 70, 33, 95]
    assert results[0].error is None and results[3].error is None
    assert engine.stats.prefill_tokens == 5 + 33
    assert _all_rows_free(engine)
    generate._print_results(results, engine.stats, None, random_weights=False)
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == f"request 1: prompt 101 tokens, refused: {results[1].error}"
    assert lines[3] == f"request 2: prompt 70 tokens, refused: {results[2].error}"
    assert lines[0].startswith("request 0: prompt 5 tokens, 6 generated (length)")
    assert sum("refused" in line for line in lines) == 3
    single = engine.generate([1] * 101, 1)
    assert isinstance(single, GenerationResult) and single.finish_reason == "refused"
    assert engine.stats.decode_steps == 0 and engine.stats.prefill_tokens == 0


def test_decode_worker_refuses_bad_batches(fp32_model):
    engine = _engine(fp32_model, context_len=64, max_batch=2, bucket_sizes=(1, 2))
    worker = engine.worker
    with pytest.raises(ValueError, match="rows is empty"):
        worker.step([])
    with pytest.raises(ValueError, match="rows: 2 do not fit bucket 1"):
        worker.load([0, 1], 1)
    with pytest.raises(ValueError, match="use_cuda_graph=True needs"):
        DecodeWorker(fp32_model, engine.kv, engine.backend, use_cuda_graph=True)
    assert not worker.use_cuda_graph


def test_generate_command_runs_on_cpu(capsys):
    from dsaspec.commands import generate

    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    args = parser.parse_args(["--prompt-lens", "3,70", "--max-new-tokens", "3", "--context-len", "128",
                              "--no-progress", "--dtype", "fp32"])
    assert generate.run(args) == 0
    out = capsys.readouterr().out
    assert "request 1: prompt 70 tokens, 3 generated (length)" in out
    assert "ids: [" in out and "median step" in out


def test_bench_decode_smoke_on_cpu(tmp_path):
    """Without CUDA the decode bench runs tiny sizes, checks token identity, reports no times."""
    from dsaspec.bench import decode

    parser = argparse.ArgumentParser()
    decode.add_arguments(parser)
    assert decode.run(parser.parse_args(["--out", str(tmp_path)])) == 0
    payload = json.loads((tmp_path / "decode.json").read_text())
    assert payload["rows"] and all(r["tokens_identical"] for r in payload["rows"])
    assert all(r["new_us"] is None for r in payload["rows"])


# ---------------------------------------------------------------------------------------------
# GPU: `python -m pytest -q -m gpu tests/test_engine.py`

GPU_PROMPTS = {"tiny": (100, 7, 300, 64), "bench": (2100, 7, 300, 2048)}   # sparse and dense rows


@pytest.fixture(scope="module")
def gpu_models():
    cache = {}

    def get(preset):
        if preset not in cache:
            cache[preset] = DSAModel(get_config(preset), device="cuda", use_triton=True).init_weights(0)
        return cache[preset]
    return get


def _gpu_generate(model, preset, max_new=(12, 20, 9, 16), **kwargs):
    kwargs.setdefault("max_batch", 3)
    kwargs.setdefault("context_len", 4096)
    engine = _engine(model, **kwargs)
    results = engine.generate(random_prompts(GPU_PROMPTS[preset], model.config.vocab_size, seed=3), list(max_new))
    return [r.token_ids for r in results], engine


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny", "bench"])
def test_gpu_graph_decode_matches_eager_decode(gpu_models, preset):
    model = gpu_models(preset)
    graph_tokens, graph_engine = _gpu_generate(model, preset, use_cuda_graph=True)
    eager_tokens, eager_engine = _gpu_generate(model, preset, use_cuda_graph=False)
    assert graph_engine.worker.use_cuda_graph and not eager_engine.worker.use_cuda_graph
    assert graph_engine.backend.kernel == "bounded"
    assert set(graph_engine.stats.step_batches) == {1, 2, 3}          # joins and departures
    assert graph_tokens == eager_tokens


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny", "bench"])
def test_gpu_bounded_and_context_wide_metadata_token_identical(gpu_models, preset):
    model = gpu_models(preset)
    outputs = {}
    for bounded, kernel in ((True, "bounded"), (False, "context_wide")):
        outputs[kernel], engine = _gpu_generate(model, preset, options=RuntimeOptions(bounded_replay_metadata=bounded))
        assert engine.backend.kernel == kernel
    assert outputs["bounded"] == outputs["context_wide"]


@pytest.mark.gpu
def test_gpu_one_million_context_matches_4k_context(gpu_models):
    """bench preset, 1M-token context configured (KV pool sized for the live tokens only, large
    enough that admission never waits, so the batches match): the same tokens as a 4k context,
    with either metadata kernel."""
    model = gpu_models("bench")
    reference, _ = _gpu_generate(model, "bench", context_len=4096)
    for kernel in ("bounded", "context_wide"):
        tokens, engine = _gpu_generate(model, "bench", context_len=1 << 20, num_slots=128 * PAGE_SIZE,
                                       force_kernel=kernel)
        assert engine.backend.width == (1 << 20) + 5
        assert tokens == reference, kernel
