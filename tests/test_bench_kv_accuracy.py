"""bench kv-accuracy: the overlap, logit-error and agreement helpers on hand-made inputs, and a CPU
run whose columns come from the lanes they name (bf16 against FP8, not a lane against itself; the
greedy tokens are the Engine's on each cache dtype)."""

import json

import pytest
import torch

from dsaspec.bench import kv_accuracy
from dsaspec.commands import cli
from dsaspec.configs.model_config import get_config
from dsaspec.engine.engine import Engine
from dsaspec.memory import PAGE_SIZE, KVPool, PageAllocator, ReqToTokenPool, RequestSlots
from dsaspec.models.dsa_model import DSAModel
from dsaspec.testing.spec_models import generated_tokens, random_prompts

from test_cli import assert_one_line_error


def test_selection_overlap_counts_common_valid_slots():
    reference = torch.tensor([[1, 2, 3, 4], [5, 6, -1, -1], [-1, -1, -1, -1], [7, 8, 9, 10]], dtype=torch.int32)
    other = torch.tensor([[4, 3, 9, -1], [6, 7, -1, -1], [-1, -1, -1, -1], [10, 9, 8, 7]], dtype=torch.int32)
    got = kv_accuracy.selection_overlap(reference, other)
    # row 1: the shared -1 padding is not a common slot; row 2: an empty selection overlaps fully
    assert got.tolist() == [0.5, 0.5, 1.0, 1.0]
    assert kv_accuracy.selection_overlap(torch.tensor([[1, 2]]), torch.tensor([[1, -1]])).item() == 0.5


def test_logit_error_and_greedy_agreement():
    reference = torch.tensor([[0.0, 2.0, -2.0, 0.0], [1.0, -1.0, 1.0, -1.0]])
    other = reference + torch.tensor([[0.0, 0.0, 5.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    err = kv_accuracy.logit_error(reference, other)
    # std: variances 2 and 1; squared differences sum to 26 over 8 values; step 0's argmax moves to index 2
    assert err["std"] == pytest.approx(1.5 ** 0.5) and err["max_abs"] == 5.0
    assert err["rms"] == pytest.approx((26 / 8) ** 0.5) and err["rms_rel"] == pytest.approx((26 / 8 / 1.5) ** 0.5)
    assert err["max_abs_rel"] == pytest.approx(5 / 1.5 ** 0.5) and err["top1_agreement"] == 0.5
    agree = kv_accuracy.greedy_agreement([1, 2, 3, 4], [1, 2, 5, 4], [0.1, 0.2, 0.3, 0.4])
    assert agree == {"first_difference": 2, "margin_at_first_difference": 0.3, "agreement": 0.75}
    assert kv_accuracy.greedy_agreement([1], [1], [0.5])["first_difference"] is None


def test_bf16_against_bf16_is_exact_and_the_recorder_keeps_the_tokens():
    """The forced and free lanes on bf16 caches: the same math as the reference lane, so overlap 1,
    no logit error, full agreement, and the recording model's tokens are the plain model's."""
    config = get_config("tiny")
    prompts = random_prompts([70, 75], config.vocab_size, seed=3)       # lengths may differ
    model = kv_accuracy.RecordingModel(config, dtype=torch.float32).init_weights(0)
    result = kv_accuracy.measure(model, prompts, 4, compare="bf16")
    assert result["layers"] == [0, 1]
    assert all(s == {"mean": 1.0, "min": 1.0, "rows": 2 * 3} for s in result["overlap"].values())
    assert result["logit_error"]["max_abs"] == 0.0
    assert all(r["agreement"] == 1.0 and r["first_difference"] is None for r in result["per_request"])
    plain = DSAModel(config, dtype=torch.float32).init_weights(0)
    engine = Engine(plain, context_len=96, max_batch=2, bucket_sizes=(1, 2), progress=False)
    assert result["tokens"]["bf16"] == generated_tokens(engine, prompts, 4)


def test_cpu_run_compares_fp8_with_bf16(tmp_path):
    """The CPU run: FP8 selections differ from the bf16 ones somewhere (overlap < 1; a lane compared
    with itself gives 1), the FP8 logits differ, the reference tokens are the Engine's on bf16 caches
    and the free lane's the Engine's on FP8 caches, speculative == plain, the Markdown shows the JSON's numbers."""
    assert cli.main(["bench", "kv-accuracy", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "kv_accuracy.json").read_text())
    overlap = payload["overlap"]
    assert [r["layer"] for r in overlap] == [0, 1] and all(r["rows"] == 2 * 11 for r in overlap)
    assert min(r["min"] for r in overlap) < 1 and all(0.5 < r["mean"] <= 1 for r in overlap)
    assert all(r["max_abs"] > 0 for r in payload["per_request"])
    config = get_config("tiny")
    prompts = random_prompts([80, 80], config.vocab_size, seed=1)
    model = DSAModel(config, dtype=torch.float32).init_weights(0)
    for lane, cache in (("bf16", "bf16"), ("free", "fp8_e4m3")):
        engine = Engine(model, context_len=96, max_batch=2, bucket_sizes=(1, 2), progress=False,
                        kv_cache_dtype=cache)
        assert payload["tokens"][lane] == generated_tokens(engine, prompts, 12), lane
    for r in payload["per_request"]:
        tokens = [payload["tokens"][lane][r["request"]] for lane in ("bf16", "free")]
        assert r["agreement"] == sum(a == b for a, b in zip(*tokens)) / 12
    assert payload["tokens"]["bf16"] != payload["tokens"]["free"]
    for r, prompt, reference in zip(payload["per_request"], prompts, payload["tokens"]["bf16"]):
        # teacher-forced: one prefill of the prompt and the reference tokens on each cache dtype
        exact, quant = (_logits_after(model, prompt, reference, cache) for cache in ("bf16", "fp8_e4m3"))
        assert r["max_abs"] == pytest.approx((quant - exact).abs().max().item(), rel=1e-3)
        assert r["rms_rel"] == pytest.approx(((quant - exact).square().mean().sqrt() / exact.std(1, False).square()
                                              .mean().sqrt()).item(), rel=1e-3)
        if r["first_difference"] is not None:
            top2 = exact[r["first_difference"]].topk(2).values
            assert r["margin_at_first_difference"] == pytest.approx((top2[0] - top2[1]).item(), rel=1e-3, abs=1e-5)
    assert payload["speculative"]["tokens_identical"] and payload["speculative"]["mean_accept_len"] > 1
    text = (tmp_path / "kv_accuracy.md").read_text()
    assert f"| 1 | {overlap[1]['mean']:.4f} | {overlap[1]['min']:.4f} | 22 |" in text


@torch.no_grad()
def _logits_after(model, prompt, generated, kv_cache_dtype):
    """Logits fp32 ``[len(generated), vocab]`` at the positions that produced ``generated``."""
    sequence = prompt + generated[:-1]
    table = ReqToTokenPool(1, len(sequence))
    slots = RequestSlots(table, PageAllocator(PAGE_SIZE * (2 + len(sequence) // PAGE_SIZE)))
    kv = KVPool.for_model(model.config, slots.allocator.num_slots, dtype=torch.float32, kv_cache_dtype=kv_cache_dtype)
    hidden = model.prefill(torch.tensor(sequence), table.req_to_token, slots.admit(len(sequence)), kv)
    return model.logits(hidden[len(prompt) - 1:])


def test_short_prompts_are_refused(capsys, monkeypatch):
    monkeypatch.setattr(kv_accuracy, "_apply_cpu_sizes", lambda args: None)      # keep --prompt-len on CPU
    assert_one_line_error(capsys, ["bench", "kv-accuracy", "--preset", "tiny", "--prompt-len", "64"],
                          "--prompt-len 64", "index_topk 64")
    assert_one_line_error(capsys, ["bench", "kv-accuracy", "--branch-scale", "1.5"], "--branch-scale", "(0, 1]")
