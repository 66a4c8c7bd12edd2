"""Phases of a profiled forward: kernels attributed to the module (or DSA op) that launched them.

:class:`PhaseMarkers` launches an empty kernel at module boundaries (forward hooks on the
attention, indexer, FFN and LM-head modules and on every leaf module) while installed;
:func:`attribute_kernels` cuts a CUPTI kernel list at those markers and puts each kernel in its
phase: DSA kernels by name (:data:`NAME_PHASES`, read from the op modules), every other kernel in
its region's. A kernel counts the part of its interval after the end of every earlier kernel, so
the phases of a step add up to its GPU busy time. :func:`kernel_table` ranks the kernels of each
phase. Used by bench decode (graph replays) and bench prefill (eager chunks).
"""

from __future__ import annotations

import contextlib
import re
import statistics
from collections import defaultdict
from typing import TYPE_CHECKING

import torch
from triton.runtime.jit import KernelInterface  # a jitted kernel, compiled or interpreted

from dsaspec.ops import dsa_metadata, indexer, indexer_schedule, sparse_mla, sparse_mla_gluon, topk
from dsaspec.ops.baseline import dsa_metadata as context_wide_metadata

if TYPE_CHECKING:
    from dsaspec.models.dsa_model import DSAModel

MARKER = "_empty_kernel"
TOP_KERNELS = 8                              # kernels a phase in the kernel table, the rest summed
KERNEL_NAME_WIDTH = 40
_LAYER_INDEX = re.compile(r"\blayers\.\d+(?=\.|$)")
_IDENTIFIER = re.compile(r"(?<!\w)([A-Za-z_]\w*)\s*(::|<)?")
_CPP_WORDS = frozenset({"bool", "char", "const", "double", "float", "half", "int", "long", "short", "signed",
                        "unsigned", "void", "operator", "lambda", "true", "false", "BFloat16", "Half"})

# DSA-op kernels land in a phase by name: every Triton and Gluon kernel of these modules (read from the modules,
# so a new kernel cannot be missed)
KERNEL_MODULE_PHASES = (
    ("metadata", (dsa_metadata, context_wide_metadata, indexer_schedule)),
    ("indexer_logits", (indexer,)),
    ("topk", (topk,)),
    ("sparse_mla", (sparse_mla, sparse_mla_gluon)),
)


def _kernel_names(modules) -> tuple[str, ...]:
    return tuple(name for module in modules for name, value in vars(module).items()
                 if isinstance(value, KernelInterface) and name.endswith("_kernel"))


NAME_PHASES = tuple((phase, _kernel_names(modules)) for phase, modules in KERNEL_MODULE_PHASES)
_KERNELS = dict(NAME_PHASES)
# phase -> what lands in it: the kernels named above first, then the module region (marker hooks)
PHASE_PATTERNS = {
    "metadata": f"kernels named {', '.join(_KERNELS['metadata'])}; and the input prep before the graph "
                "(the rows' positions and tokens from their carry, seq_lens = positions + 1, the out_cache_loc "
                "gather)",
    "indexer": "kernels of module self_attn.indexer (weights_proj GEMM, indexer RoPE, index-key cache write; "
               "its wq_b and wk run in attention_proj's fused GEMMs)",
    "indexer_logits": ", ".join(_KERNELS["indexer_logits"]),
    "topk": ", ".join(_KERNELS["topk"]),
    "sparse_mla": ", ".join(_KERNELS["sparse_mla"]),
    "attention_proj": "other kernels of module self_attn (the fused_input GEMM: q_a_proj + indexer wk + "
                      "kv_a_proj_with_mqa; the fused_latent GEMM: q_b_proj + indexer wq_b, or q_b_proj alone "
                      "where the indexer is skipped; norms, RoPE, MLA cache write, the W_UK / W_UV absorption "
                      "products, o_proj)",
    "ffn": "kernels of module mlp (gate/up/down GEMMs, SiLU*mul)",
    "lm_head": "kernels of module lm_head (the vocab GEMM)",
    "sampling": "kernels after lm_head in the graph (the greedy token from the bf16 logits and, in the same "
                "launch, the token and length written back to the rows' carry; TP 1: argmax_partials + "
                "draft_finalize)",
    "other": "everything else in the graph (RoPE cos/sin, embedding, layer norms, residual adds, final norm)",
    "feedback": "bench bookkeeping after the graph (the step's tokens copied out)",
}


class PhaseMarkers:
    """Launches an empty kernel at module boundaries of the model while installed, so a profile of
    the (captured) forward can be cut into regions; each label is ``(phase, module path or None)``."""

    def __init__(self, model: "DSAModel"):
        self.model = model
        self.labels: list[tuple[str, str | None]] = []
        self._dummy = torch.zeros(1, device=model.lm_head.weight.device)

    def mark(self, phase: str, module: str | None = None) -> None:
        """Launch one marker kernel and remember its label."""
        from dsaspec.ops.empty import empty_kernel

        self.labels.append((phase, module))
        empty_kernel(self._dummy)

    @contextlib.contextmanager
    def installed(self):
        """Forward hooks on the attention, indexer, FFN and LM-head modules (their phases), and on
        every leaf module (a GEMM, a norm, the rotary table): a leaf opens a region of its
        enclosing module's phase under its own path and returns to the enclosing module's region."""
        hooks = []
        paths = {module: path for path, module in self.model.named_modules()}

        def at(module, before: tuple, after: tuple) -> None:
            hooks.append(module.register_forward_pre_hook(lambda *_: self.mark(*before)))
            hooks.append(module.register_forward_hook(lambda *_: self.mark(*after)))

        other = ("other", None)
        regions = {}                          # phase module path -> its region's label
        for layer in self.model.model.layers:
            attn = regions[paths[layer.self_attn]] = ("attention_proj", paths[layer.self_attn])
            at(layer.self_attn, attn, other)
            if layer.self_attn.indexer is not None:
                index = regions[paths[layer.self_attn.indexer]] = ("indexer", paths[layer.self_attn.indexer])
                at(layer.self_attn.indexer, index, attn)
            ffn = regions[paths[layer.mlp]] = ("ffn", paths[layer.mlp])
            at(layer.mlp, ffn, other)
        head = regions[paths[self.model.lm_head]] = ("lm_head", paths[self.model.lm_head])
        at(self.model.lm_head, head, ("sampling", None))
        for module, path in paths.items():
            if path in regions or next(module.children(), None) is not None:
                continue
            enclosing = max((p for p in regions if path.startswith(p + ".")), key=len, default=None)
            outer = other if enclosing is None else regions[enclosing]
            at(module, (outer[0], path), outer)
        try:
            yield self
        finally:
            for hook in hooks:
                hook.remove()


def _phase_by_name(name: str) -> str | None:
    for phase, patterns in NAME_PHASES:
        if any(p in name for p in patterns):
            return phase
    return None


def attribute_kernels(events, sequence: list[tuple[str, str | None]], steps: int) -> list[dict]:
    """Per step, ``{(phase, module, name): [launches, µs]}`` from CUPTI events ``(name, start_ns,
    end_ns)`` sorted by start: marker ``k`` opens region ``sequence[k % len(sequence)]`` (a
    ``(phase, module path)`` label) of step ``k // len(sequence)``; a kernel goes to its name's
    phase, else to its region's, under its region's module (``layers.<i>`` read as ``layers.*``, so
    a kernel of every layer is one key), with the part of its interval after the end of every
    earlier kernel (time it adds; none when it lies within earlier ones). Raises if the markers do
    not match."""
    per_step = [defaultdict(lambda: [0, 0.0]) for _ in range(steps)]
    modules = [label[1] and _LAYER_INDEX.sub("layers.*", label[1]) for label in sequence]
    seen, region, step, busy_until = 0, None, 0, float("-inf")
    for name, start, end in events:
        if MARKER in name:
            region, step = seen % len(sequence), seen // len(sequence)
            seen += 1
            continue
        added = max(0, end - max(start, busy_until))
        busy_until = max(busy_until, end)
        if region is None or step >= steps:
            continue
        entry = per_step[step][(_phase_by_name(name) or sequence[region][0], modules[region], name)]
        entry[0] += 1
        entry[1] += added / 1e3
    if seen != steps * len(sequence):
        raise RuntimeError(f"phase markers: expected {steps * len(sequence)} in the profile, found {seen}")
    return [dict(s) for s in per_step]


def phase_sums(kernels: dict) -> dict[str, float]:
    """One step's µs per phase from its :func:`attribute_kernels` entry."""
    out: dict[str, float] = defaultdict(float)
    for (phase, _, _), (_, us) in kernels.items():
        out[phase] += us
    return dict(out)


def attribute_phases(events, sequence: list[tuple[str, str | None]], steps: int) -> list[dict]:
    """Per-step phase times (µs): :func:`attribute_kernels` summed by phase."""
    return [phase_sums(s) for s in attribute_kernels(events, sequence, steps)]


def short_kernel_name(name: str, width: int = KERNEL_NAME_WIDTH) -> str:
    """A readable stem of a CUPTI kernel name, at most ``width`` chars: a plain name (Triton's
    function name, cuBLAS' ``nvjet_...`` / ``sm90_xmma_...``) as it is; a demangled C++ signature as
    its function's unqualified name, and for a template ``<`` its first named argument ``>``: the
    first that is neither a namespace, a builtin type nor a template itself, else the first
    template (the functor of an ATen elementwise kernel, a CUTLASS kernel's stem; where the
    function's name does not fit beside it, the argument alone)."""
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    cut = min((i for i in (name.find("<"), name.find("(")) if i >= 0), default=len(name))
    short = name[:cut].rsplit("::", 1)[-1].strip()
    if cut < len(name) and name[cut] == "<":
        depth, end = 0, len(name)
        for end, char in enumerate(name[cut:], cut):
            depth += (char == "<") - (char == ">")
            if depth == 0:
                break
        named = [(m.group(1), m.group(2)) for m in _IDENTIFIER.finditer(name, cut + 1, end)
                 if m.group(2) != "::" and m.group(1) not in _CPP_WORDS and not m.group(1).startswith("__")]
        pick = next((n for n, follow in named if follow != "<"), None) or next((n for n, _ in named), None)
        if pick is not None:
            room = width - len(pick) - 2
            if room >= len(short):
                short = f"{short}<{pick}>"
            elif room >= 8:
                short = f"{short[:room - 1]}…<{pick}>"
            else:
                short = pick
    return short if len(short) <= width else short[:width - 1] + "…"


def kernel_table(per_step: list[dict], top: int = TOP_KERNELS) -> list[dict]:
    """Rows ``{phase, module, kernel (short name), name (full), count, us}`` from
    :func:`attribute_kernels`' steps: per key its median launches and median µs per step (0 in a
    step without it); per phase (in ``PHASE_PATTERNS`` order) the ``top`` largest by µs, the rest
    summed into one row ``kernel = "<n> others"`` (``name`` and ``module`` None)."""
    keys = sorted({key for step in per_step for key in step}, key=lambda k: (k[0], k[1] or "", k[2]))
    by_phase: dict[str, list[dict]] = defaultdict(list)
    for phase, module, name in keys:
        entries = [step.get((phase, module, name), (0, 0.0)) for step in per_step]
        by_phase[phase].append({"phase": phase, "module": module, "kernel": short_kernel_name(name), "name": name,
                                "count": statistics.median_low(e[0] for e in entries),
                                "us": statistics.median(e[1] for e in entries)})
    order = list(PHASE_PATTERNS)
    rows = []
    for phase in sorted(by_phase, key=lambda p: (order.index(p) if p in order else len(order), p)):
        ranked = sorted(by_phase[phase], key=lambda r: -r["us"])
        rows += ranked[:top]
        rest = ranked[top:]
        if rest:
            rows.append({"phase": phase, "module": None, "kernel": f"{len(rest)} others", "name": None,
                         "count": sum(r["count"] for r in rest), "us": sum(r["us"] for r in rest)})
    return rows
