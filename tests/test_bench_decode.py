"""The decode bench (dsaspec/bench/decode.py): its kernel Markdown, token agreement, KV pools per
dtype, runs on the CPU."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from dsaspec.bench import decode
from dsaspec.bench.presets import preset_config
from dsaspec.bench.results import markdown_table
from dsaspec.configs.model_config import get_config
from dsaspec.layers.attention.backend import BOUNDED, CONTEXT_WIDE

from conftest import HAS_CUDA


def _row(context_len, bs, us, kv_cache_dtype="bf16"):
    kernels = [{"phase": "ffn", "module": "model.layers.*.mlp.down_proj", "kernel": "nvjet_down", "name": "nvjet_down",
                "count": 2, "us": us}]
    return {"kv_cache_dtype": kv_cache_dtype, "context_len": context_len, "bs": bs,
            "phases": {BOUNDED: {"kernels": kernels}, CONTEXT_WIDE: {"kernels": [dict(kernels[0], us=-1.0)]}}}


def test_kernel_markdown_shows_bounded_bs_extremes_of_the_first_context():
    """One table: the bounded runs' kernels of each cache dtype at the smallest and largest bs of
    the first row's context."""
    rows = ([_row(4096, bs, float(bs), dtype) for dtype in ("bf16", "fp8_e4m3") for bs in (1, 4, 32)]
            + [_row(128, 1, 99.0)])
    text = decode._kernel_markdown(rows, markdown_table)
    assert "context 4096, bs 1 and 32" in text
    body = [line for line in text.splitlines() if line.startswith("| ") and "nvjet_down" in line]
    assert body == [f"| {dtype} | {bs} | ffn | model.layers.*.mlp.down_proj | nvjet_down | 2 | {bs}.00 |"
                    for dtype in ("bf16", "fp8_e4m3") for bs in (1, 32)]
    assert decode._kernel_markdown([dict(_row(4096, 1, 1.0), phases={BOUNDED: None})], markdown_table) == ""


def test_token_agreement_first_differing_step_and_fraction():
    """The first step where any request's token differs, the agreeing fraction; None when equal."""
    reference = torch.tensor([[1, 2], [3, 4], [5, 6]])
    other = reference.clone()
    assert decode.token_agreement(reference, other) == {"first_difference": None, "agreement": 1.0}
    other[1, 1], other[2, 0] = 0, 0
    assert decode.token_agreement(reference, other) == {"first_difference": 1, "agreement": 4 / 6}
    with pytest.raises(ValueError, match="shapes"):
        decode.token_agreement(reference, other[:2])


def test_kv_cache_dtype_option_refuses_a_bad_value(capsys):
    from test_cli import assert_one_line_error

    assert_one_line_error(capsys, ["bench", "decode", "--kv-cache-dtype", "bf16,fp8"], "--kv-cache-dtype", "fp8_e4m3")


@pytest.mark.parametrize("layers,wanted", [(24, 24), (78, 78), (None, 78)])
def test_layers_cut_the_preset(layers, wanted):
    args = argparse.Namespace(preset="glm5-fp8-tp8-rank", layers=layers)
    config = preset_config(args)
    assert config.num_hidden_layers == wanted
    assert config.replace(num_hidden_layers=78) == get_config("glm5-fp8-tp8-rank")   # nothing else changed


@pytest.mark.parametrize("layers,named", [(79, "has 78 layers"), (2, "no MoE decoder layer")])
def test_layers_refuse_more_than_the_preset_or_no_moe_layer(layers, named):
    from dsaspec.errors import UserError

    with pytest.raises(UserError, match=f"--layers {layers}: .*{named}"):
        preset_config(argparse.Namespace(preset="glm5-fp8-tp8-rank", layers=layers))


def _record_pools(monkeypatch) -> list:
    """KVPool.for_model records (dtype, a weak reference to the pool's MLA cache) of each pool it builds."""
    import weakref

    built, for_model = [], decode.KVPool.for_model.__func__

    def recording(cls, *args, **kwargs):
        pool = for_model(cls, *args, **kwargs)
        built.append((pool.kv_cache_dtype, weakref.ref(pool._mla)))
        return pool

    monkeypatch.setattr(decode.KVPool, "for_model", classmethod(recording))
    return built


@pytest.mark.skipif(HAS_CUDA, reason="the CPU run of bench decode")
def test_both_cache_dtypes_one_at_a_time_with_their_floors(tmp_path, monkeypatch):
    """--kv-cache-dtype fp8_e4m3,bf16,auto: each context's pool in its dtype, one dtype's pools
    gone before the next are built; rows of both (auto is bf16), bounded == context-wide within
    each, FP8 against bf16 tokens reported; each row's floors from its dtype's entry bytes (FP8:
    smaller sparse MLA and indexer-logit bytes)."""
    from dsaspec.bench.floors import FloorModel
    from dsaspec.commands import cli

    built = _record_pools(monkeypatch)
    freed_before_bf16 = []
    run_measure = decode._measure
    monkeypatch.setattr(decode, "_measure", lambda *a: freed_before_bf16.append(
        [ref() is None for _, ref in built]) or run_measure(*a))
    assert cli.main(["bench", "decode", "--kv-cache-dtype", "fp8_e4m3,bf16,auto", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "decode.json").read_text())
    contexts, bs = payload["params"]["contexts"], payload["params"]["bs"]
    assert payload["params"]["kv_cache_dtype"] == ["fp8_e4m3", "bf16"]
    assert [d for d, _ in built] == ["fp8_e4m3"] * len(contexts) + ["bf16"] * len(contexts)
    assert freed_before_bf16 == [[], [True] * len(contexts)]
    rows = payload["rows"]
    assert [(r["kv_cache_dtype"], r["context_len"], r["bs"]) for r in rows] == [
        (d, c, b) for d in ("fp8_e4m3", "bf16") for c in contexts for b in bs]
    assert all(r["tokens_identical"] and r["tokens_identical_to_reference_context"] for r in rows)
    assert all((r["vs_bf16"] is None) == (r["kv_cache_dtype"] == "bf16") for r in rows)
    config, live = get_config("tiny"), payload["params"]["live"] + payload["params"]["steps"] // 2
    by_key = {(r["kv_cache_dtype"], r["context_len"], r["bs"]): {t["phase"]: t["bytes"] for t in r["floor_table"]}
              for r in rows}
    for (dtype, context_len, b), floor_bytes in by_key.items():
        costs = FloorModel(config, act_bytes=4, kv_cache_dtype=dtype).decode_step(b, live)
        assert all(floor_bytes[phase] == cost.bytes for phase, cost in costs.items())
        if dtype == "fp8_e4m3":
            bf16 = by_key[("bf16", context_len, b)]
            assert all(floor_bytes[phase] < bf16[phase] for phase in ("sparse_mla", "indexer_logits"))
    text = (tmp_path / "decode.md").read_text()
    assert f"| fp8_e4m3 | {contexts[0]} | {bs[0]} | {payload['params']['live']} |" in text
    assert "first step != bf16" in text and "may differ from the bf16 cache's" in text


@pytest.mark.skipif(HAS_CUDA, reason="the CPU run of bench decode")
def test_tokens_are_compared_within_a_cache_dtype(tmp_path, monkeypatch, capsys):
    """FP8 tokens unlike bf16's do not fail a run; bounded != context-wide on the FP8 cache fails
    its rows only (exit 1, named), and the FP8 rows give the first step that differs from bf16."""
    from dsaspec.commands import cli

    run = decode.decode_run

    def fp8_differs(runner, context, bs, steps, **kwargs):
        tokens = run(runner, context, bs, steps, **kwargs)
        if context.kv.kv_cache_dtype == "fp8_e4m3":
            tokens[1:] += 1                       # from step 1 on
            if runner is context.runners[BOUNDED] and context.context_len == max(a.contexts):
                tokens[-1] += 1
        return tokens

    a = argparse.Namespace(contexts=None)
    apply_sizes = decode._apply_cpu_sizes
    monkeypatch.setattr(decode, "_apply_cpu_sizes",
                        lambda args: apply_sizes(args) or setattr(a, "contexts", args.contexts))
    monkeypatch.setattr(decode, "decode_run", fp8_differs)
    assert cli.main(["bench", "decode", "--kv-cache-dtype", "bf16,fp8_e4m3", "--out", str(tmp_path)]) == 1
    rows = json.loads((tmp_path / "decode.json").read_text())["rows"]
    longest = max(a.contexts)
    for r in rows:
        assert r["tokens_identical"] == (r["kv_cache_dtype"] == "bf16" or r["context_len"] != longest), r
        if r["kv_cache_dtype"] == "fp8_e4m3":
            assert r["vs_bf16"]["first_difference"] == 1
    assert f"('fp8_e4m3', {longest}, 1)" in capsys.readouterr().out


def test_context_ratios_use_the_reference_of_the_same_cache_dtype():
    """TPOT over the reference context's of the same cache dtype and bs."""
    def row(dtype, context_len, us):
        side = {"median_us": us, "run_medians_us": [us]}
        return {"kv_cache_dtype": dtype, "context_len": context_len, "bs": 1, "detail": {"baseline": side, "new": side}}

    rows = [row("bf16", 1024, 110.0), row("bf16", 128, 100.0), row("fp8_e4m3", 1024, 90.0), row("fp8_e4m3", 128, 60.0)]
    decode._add_context_ratios(rows, 128)
    assert [r["vs_reference_context"]["tpot_ratio"]["new"] for r in rows] == [1.1, 1.0, 1.5, 1.0]
    assert [r["vs_reference_context"]["new_within_target"] for r in rows] == [False, True, False, True]


@pytest.mark.skipif(HAS_CUDA, reason="the CPU run of bench decode")
def test_moe_floors_take_the_experts_counted_in_a_step(tmp_path, monkeypatch):
    """tiny-moe (8 experts, 3 a token, layer 1 MoE; on the CPU the shared expert runs apart from the
    routed ids): one request hits exactly its 3 experts, two hit 3 to 6; each row's floor bytes are
    the floor model's with those counts (uniform routing's 4.875 at two rows is never a count)."""
    from dsaspec.bench.floors import FloorModel
    from dsaspec.cli_parsing import use_cpu_sizes
    from dsaspec.commands import cli

    monkeypatch.setattr(decode, "_apply_cpu_sizes", lambda args: use_cpu_sizes(args, decode.add_arguments, {
        "preset": "tiny-moe", "contexts": [256], "live": 70, "bs": [1, 2], "steps": 2, "runs": 1, "budget": 8}))
    assert cli.main(["bench", "decode", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "decode.json").read_text())
    hits = {r["bs"]: r["experts_hit"] for r in payload["rows"]}
    assert hits[1] == 3 and 3 <= hits[2] <= 6
    live = payload["params"]["live"] + payload["params"]["steps"] // 2
    for row in payload["rows"]:
        costs = FloorModel(get_config("tiny-moe"), act_bytes=4, experts_hit=hits).decode_step(row["bs"], live)
        assert {t["phase"]: t["bytes"] for t in row["floor_table"]}["ffn"] == costs["ffn"].bytes
