"""Phases of a profiled forward (dsaspec/bench/phases.py): CUPTI names shortened, kernels attributed to
their marker regions and counted by the time each adds, ranked per phase, and the leaf-module
markers of the tiny model."""

from __future__ import annotations

import argparse

import pytest
import torch

from dsaspec.bench import decode, phases
from dsaspec.configs.model_config import get_config
from dsaspec.layers.attention.backend import BOUNDED
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
    assert phases.short_kernel_name(name) == short
    assert len(short) <= phases.KERNEL_NAME_WIDTH


M = phases.MARKER
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
    steps = phases.attribute_kernels(events, SEQUENCE, 2)
    assert steps[0] == {("attention_proj", "model.layers.*.self_attn", "bmm"): [1, 1.0],
                        ("sparse_mla", "model.layers.*.self_attn", "_sparse_mla_decode_kernel"): [1, 3.0],
                        ("attention_proj", "model.layers.*.self_attn.q_b_proj", "nvjet_q_b"): [2, 4.0],
                        ("other", None, "copy"): [1, 0.5], ("other", None, "norm"): [1, 0.4]}
    assert steps[1][("attention_proj", "model.layers.*.self_attn.q_b_proj", "nvjet_q_b")] == [2, 6.0]
    assert phases.attribute_phases(events, SEQUENCE, 2)[0] == pytest.approx(
        {"attention_proj": 5.0, "sparse_mla": 3.0, "other": 0.9})


def test_kernel_table_medians_top_and_others():
    """Median launches and µs per step (0 in a step without the kernel), the phases in their table
    order, each phase's kernels by µs, all but the top ``top`` summed into one row."""
    events = _step(0, 2_000, True) + _step(100_000, 3_000) + _step(200_000, 2_500)
    rows = phases.kernel_table(phases.attribute_kernels(events, SEQUENCE, 3), top=1)
    assert [(r["phase"], r["kernel"], r["count"], r["us"]) for r in rows] == [
        ("sparse_mla", "_sparse_mla_decode_kernel", 1, 3.0),
        ("attention_proj", "nvjet_q_b", 2, 5.0), ("attention_proj", "1 others", 1, 1.0),
        ("other", "copy", 1, 0.5), ("other", "1 others", 0, 0.0)]
    assert rows[1]["module"] == "model.layers.*.self_attn.q_b_proj" and rows[1]["name"] == "nvjet_q_b"
    assert rows[2]["module"] is None and rows[2]["name"] is None
    full = phases.kernel_table(phases.attribute_kernels(events, SEQUENCE, 3))
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
    markers = phases.PhaseMarkers(model)
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


def test_phases_count_the_time_each_kernel_adds():
    """Overlapping kernels (a programmatic dependent launch waits inside its predecessor's run) are
    counted once: each kernel from the later of its start and the end of every earlier one; the
    phases of a step add up to the union of its kernel intervals, markers excluded."""

    marker = phases.MARKER
    events = [  # (name, start_ns, end_ns), sorted by start
        (marker, 0, 1_000), ("gemm_a", 2_000, 10_000),                      # step 0, region "attn"
        (marker, 10_000, 11_000), ("_sparse_mla_decode_kernel", 12_000, 20_000),
        ("_sparse_mla_combine_kernel", 13_000, 23_000),                     # started early (PDL)
        ("gemm_b", 24_000, 26_000),
        (marker, 27_000, 28_000), ("inner", 29_000, 30_000), ("tail", 29_500, 31_000),   # step 1
        (marker, 32_000, 33_000), ("_sparse_mla_decode_kernel", 34_000, 35_000)]
    per_step = phases.attribute_phases(events, [("attn", None), ("ffn", None)], steps=2)
    assert per_step[0] == {"attn": 8.0, "sparse_mla": 11.0, "ffn": 2.0}
    assert per_step[1] == {"attn": 2.0, "sparse_mla": 1.0}
    # a kernel lying wholly inside an earlier one adds nothing
    inside = phases.attribute_phases([(marker, 0, 1), ("long", 2, 100), ("short", 10, 20)], [("r", None)], 1)
    assert inside == [{"r": 0.098}]


@pytest.mark.parametrize("name, phase", [
    ("_bounded_kernel", "metadata"), ("_context_wide_kernel", "metadata"), ("_indexer_schedule_kernel", "metadata"),
    ("_indexer_logits_kernel", "indexer_logits"), ("_topk_slots_kernel", "topk"), ("_topk_chunk_pass_kernel", "topk"),
    ("_topk_chunk_single_launch_kernel", "topk"), ("_topk_chunk_lists_kernel", "topk"),
    ("_sparse_mla_decode_kernel", "sparse_mla"),
    ("_sparse_mla_combine_kernel", "sparse_mla"), ("_sparse_mla_gluon_kernel", "sparse_mla"),
    # kernels of other ops fall to their module region, even where the name looks alike
    ("_topk_partials_kernel", None), ("_argmax_partials_kernel", None), ("ampere_bf16_gemm", None)])
def test_dsa_kernels_are_attributed_by_name(name, phase):
    """The phase of a CUPTI kernel name: the DSA-op kernels by name (read from the op
    modules, so the single-launch top-k, added later, is there too), everything else by region."""
    assert phases._phase_by_name(name) == phase
