"""The decode bench's kernel table (dsaspec/bench/decode.py): CUPTI names shortened, kernels of a
phase counted and ranked per step on synthetic CUPTI events, the leaf-module markers, the Markdown."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from dsaspec.bench import decode
from dsaspec.bench.results import markdown_table
from dsaspec.configs.model_config import get_config
from dsaspec.layers.attention.backend import BOUNDED, CONTEXT_WIDE
from dsaspec.models.dsa_model import DSAModel

from conftest import DEVICE, HAS_CUDA

SILU = ("void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::silu_kernel("
        "at::TensorIteratorBase&)::{lambda()#1}::operator()() const::{lambda(c10::BFloat16)#1}, "
        "at::detail::Array<char*, 2> >(int, at::detail::Array<char*, 2>)")
ADD = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
       "at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, at::detail::Array<char*, 3>)")
COPY = ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::"
        "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda(float)#1}>("
        "at::TensorIteratorBase&)::{lambda(int)#1}>(int, at::native::gpu_kernel_impl_nocast<float>)")
CUTLASS = ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>("
           "cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8::Params)")
INDEX = ("void at::native::(anonymous namespace)::indexSelectSmallIndex<c10::BFloat16, long, unsigned int, 2, 2, -2>("
         "at::cuda::detail::TensorInfo<c10::BFloat16, unsigned int>, int, long)")


@pytest.mark.parametrize("name, short", [
    ("_sparse_mla_decode_kernel", "_sparse_mla_decode_kernel"),                 # Triton: the function name
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_N…"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute",
     "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_…"),
    (CUTLASS, "cutlass_80_wmma_tensorop_bf16_s161616ge…"),                     # the argument alone
    (SILU, "vectorized_elementwise_ker…<silu_kernel>"),                         # the functor, not a namespace
    (ADD, "vectorized_elementwise…<CUDAFunctor_add>"),                          # no plain name: the template
    (COPY, "elementwise_ke…<direct_copy_kernel_cuda>"),                         # a plain name over a template
    (INDEX, "indexSelectSmallIndex"),                                           # builtin types only
    ("Memcpy DtoD (Device -> Device)", "Memcpy DtoD")])
def test_short_kernel_name(name, short):
    """A CUPTI name's readable stem, at most 40 chars."""
    assert decode.short_kernel_name(name) == short
    assert len(short) <= decode.KERNEL_NAME_WIDTH


M = decode.MARKER
SEQUENCE = [("attention_proj", "model.layers.0.self_attn"), ("attention_proj", "model.layers.0.self_attn.q_b_proj"),
            ("attention_proj", "model.layers.1.self_attn.q_b_proj"), ("other", None)]


def _step(t0: int, q_b_ns: int, with_norm: bool = False) -> list[tuple[str, int, int]]:
    """One step's events at ``t0`` (ns): marker, bmm + sparse MLA in the attention region, the q_b
    GEMM of layers 0 and 1 (``q_b_ns`` each), then a norm (when ``with_norm``) and a copy in "other"."""
    events = [(M, t0, t0 + 10), ("bmm", t0 + 100, t0 + 1_100), ("_sparse_mla_decode_kernel", t0 + 1_100, t0 + 4_100),
              (M, t0 + 4_200, t0 + 4_210), ("nvjet_q_b", t0 + 4_300, t0 + 4_300 + q_b_ns),
              (M, t0 + 9_000, t0 + 9_010), ("nvjet_q_b", t0 + 9_100, t0 + 9_100 + q_b_ns),
              (M, t0 + 14_000, t0 + 14_010), ("copy", t0 + 14_100, t0 + 14_600)]
    if with_norm:
        events.append(("norm", t0 + 14_600, t0 + 15_000))
    return events


def test_attribute_kernels_keys_counts_and_layer_collapse():
    """Per step: a kernel under its region's module with ``layers.<i>`` read as ``layers.*`` (so the
    two layers' q_b GEMMs are one key launched twice), a DSA kernel in its name's phase under the
    module that launched it, launches and µs summed."""
    events = _step(0, 2_000, True) + _step(100_000, 3_000)
    steps = decode.attribute_kernels(events, SEQUENCE, 2)
    assert steps[0] == {("attention_proj", "model.layers.*.self_attn", "bmm"): [1, 1.0],
                        ("sparse_mla", "model.layers.*.self_attn", "_sparse_mla_decode_kernel"): [1, 3.0],
                        ("attention_proj", "model.layers.*.self_attn.q_b_proj", "nvjet_q_b"): [2, 4.0],
                        ("other", None, "copy"): [1, 0.5], ("other", None, "norm"): [1, 0.4]}
    assert steps[1][("attention_proj", "model.layers.*.self_attn.q_b_proj", "nvjet_q_b")] == [2, 6.0]
    assert decode.attribute_phases(events, SEQUENCE, 2)[0] == pytest.approx(
        {"attention_proj": 5.0, "sparse_mla": 3.0, "other": 0.9})


def test_kernel_table_medians_top_and_others():
    """Median launches and µs per step (0 in a step without the kernel), the phases in their table
    order, each phase's kernels by µs, all but the top ``top`` summed into one row."""
    events = _step(0, 2_000, True) + _step(100_000, 3_000) + _step(200_000, 2_500)
    rows = decode.kernel_table(decode.attribute_kernels(events, SEQUENCE, 3), top=1)
    assert [(r["phase"], r["kernel"], r["count"], r["us"]) for r in rows] == [
        ("sparse_mla", "_sparse_mla_decode_kernel", 1, 3.0),
        ("attention_proj", "nvjet_q_b", 2, 5.0), ("attention_proj", "1 others", 1, 1.0),
        ("other", "copy", 1, 0.5), ("other", "1 others", 0, 0.0)]
    assert rows[1]["module"] == "model.layers.*.self_attn.q_b_proj" and rows[1]["name"] == "nvjet_q_b"
    assert rows[2]["module"] is None and rows[2]["name"] is None
    full = decode.kernel_table(decode.attribute_kernels(events, SEQUENCE, 3))
    assert full[-1]["kernel"] == "norm" and full[-1]["us"] == 0.0     # in 1 of 3 steps: the median is 0
    assert sum(r["kernel"].endswith("others") for r in full) == 0 and len(full) == 5
    assert set(full[0]) == {"phase", "module", "kernel", "name", "count", "us"}


def test_phase_markers_label_leaf_modules():
    """The markers of one eager forward of the tiny model: every called leaf (GEMM, norm) opens a
    region of its enclosing phase module under its own path and returns to that module's region;
    leaves outside the phase modules are "other", the LM head hands over to sampling."""
    model = DSAModel(get_config("tiny"), device=DEVICE, dtype=torch.float32, use_triton=HAS_CUDA).init_weights(0)
    args = argparse.Namespace(bs=[1], live=20, steps=1, budget=8)
    context = decode._build_context(model, 128, [torch.arange(20)], args, DEVICE)
    markers = decode.PhaseMarkers(model)
    backend = context.runners[BOUNDED].backend
    with markers.installed():
        runner = decode.DecodeWorker(model, context.kv, backend).capture()
        markers.labels.clear()
        runner.run(1, use_graph=False)
    labels = markers.labels
    attn = ("attention_proj", "model.layers.0.self_attn")
    q_b = labels.index(("attention_proj", "model.layers.0.self_attn.fused_latent.gemm"))
    assert labels[q_b - 1:q_b + 2] == [attn, labels[q_b], attn]   # q_a_layernorm's return, q_b + wq_b, back
    assert not any(path.endswith(("q_b_proj", "wq_b")) for _, path in labels if path)   # only through the fused GEMM
    assert labels.index(("indexer", "model.layers.0.self_attn.indexer")) > q_b + 1   # the indexer runs after it
    assert ("ffn", "model.layers.1.mlp.down_proj") in labels
    norm = labels.index(("other", "model.layers.0.input_layernorm"))
    assert labels[norm + 1] == ("other", None)
    assert labels[-2:] == [("lm_head", "lm_head"), ("sampling", None)]
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


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
