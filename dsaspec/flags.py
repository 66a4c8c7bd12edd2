"""Every environment switch of dsaspec, read in one place, strictly.

Switches accept ``1``/``0``, ``true``/``false``, ``on``/``off``, ``yes``/``no`` (any case); unset
or empty means the default; anything else raises :class:`~dsaspec.errors.UserError` naming the
variable. Kill switches default to on; turning one off restores the baseline path. They are read
when called, so tests can flip them with ``monkeypatch.setenv``.
"""

from __future__ import annotations

import os
from importlib import metadata

from dsaspec.errors import UserError

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")
ACCEPTED = "1/0, true/false, on/off, yes/no"

# Triton interpreter (no CUDA): the versions the CPU suite passes with. triton 3.6 needs numpy < 2.4
# (numpy 2.4 breaks its interpreter); triton 3.8 also passes with numpy 2.4.
INTERPRETER_PINS = ("triton==3.6.0", "numpy<2.4")
_INTERPRETER_TESTED = {(3, 6): (2, 4), (3, 8): None}  # triton (major, minor) -> numpy bound (exclusive)


def _switch(name: str, default: bool = True) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise UserError(f"{name}={os.environ[name]!r} is not a switch value: expected one of {ACCEPTED} "
                    "(any case), or unset for the default")


def bounded_replay_metadata() -> bool:
    """``DSASPEC_BOUNDED_REPLAY_METADATA``: live-bounded replay metadata kernels and the one-launch
    MTP draft-decode metadata (default on). Off restores the context-wide kernels and
    precompute + copies."""
    return _switch("DSASPEC_BOUNDED_REPLAY_METADATA")


def spec_draft_argmax_exchange() -> bool:
    """``DSASPEC_SPEC_DRAFT_ARGMAX_EXCHANGE``: greedy draft steps exchange vocab-shard argmax
    partials instead of gathering logits (default on). Off keeps the logits gather."""
    return _switch("DSASPEC_SPEC_DRAFT_ARGMAX_EXCHANGE")


def spec_verify_argmax_exchange() -> bool:
    """``DSASPEC_SPEC_VERIFY_ARGMAX_EXCHANGE``: the greedy target-verify step takes each row's token from
    exchanged vocab-shard argmax partials instead of gathering logits (default on). Off keeps the logits
    gather."""
    return _switch("DSASPEC_SPEC_VERIFY_ARGMAX_EXCHANGE")


def topk_single_launch() -> bool:
    """``DSASPEC_TOPK_SINGLE_LAUNCH``: the chunked top-k runs as one cooperative launch where it
    fits (default on). Off keeps its five launches: for deployments that run other kernels beside it
    on other streams, where a grid that must be resident all at once may wait for room."""
    return _switch("DSASPEC_TOPK_SINGLE_LAUNCH")


def sparse_mla_gluon() -> bool:
    """``DSASPEC_SPARSE_MLA_GLUON``: the runtime's sparse MLA takes the warp-specialized Gluon
    kernel where it runs (compute capability 9.x, 8, 16, 32 or a multiple of 64 heads) and is faster, per
    ``sparse_mla_config`` (default on). Off keeps the Triton kernel everywhere: its summation
    order, for comparing tokens against it. Read when the model is built."""
    return _switch("DSASPEC_SPARSE_MLA_GLUON")


def sparse_mla_slot_major() -> bool:
    """``DSASPEC_SPARSE_MLA_SLOT_MAJOR``: at 8 and 16 heads a rank (tensor parallel), where sparse
    MLA takes the Gluon kernel, it takes its slot-major form (the heads as the MMA's N dimension, no
    padding to a 64-row tile; ``sparse_mla_config``) (default on). Off keeps the padded form."""
    return _switch("DSASPEC_SPARSE_MLA_SLOT_MAJOR")


def fused_moe() -> bool:
    """``DSASPEC_FUSED_MOE``: MoE layers run the fused MoE kernel where the model runs the Triton ops
    and is not row-invariant (default on). Off keeps the plain-torch experts, which loop over every
    expert on every token: for comparing against them, not for serving."""
    return _switch("DSASPEC_FUSED_MOE")


def fp8_fast_accum() -> bool:
    """``DSASPEC_FP8_FAST_ACCUM``: the FP8 block-scaled GEMMs take 64-row tiles from 32 rows outside
    the row-invariant mode, on the e4m3 warpgroup MMA, which sums each 128-column block at reduced
    precision (default off: 16-row tiles, exact fp32 accumulation)."""
    return _switch("DSASPEC_FP8_FAST_ACCUM", default=False)


def metadata_program_budget() -> int | None:
    """``DSASPEC_METADATA_BUDGET``: program budget of the bounded metadata kernels, a positive
    integer (None when unset: the kernels' default, 2048). The grid is
    ``1 + requests * max(1, min(budget // requests, 256))``."""
    text = os.environ.get("DSASPEC_METADATA_BUDGET", "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise UserError(f"DSASPEC_METADATA_BUDGET={os.environ['DSASPEC_METADATA_BUDGET']!r}: expected a "
                        "positive integer (program budget of the bounded metadata kernels), or unset for 2048")
    return value


def triton_interpret() -> bool:
    """``TRITON_INTERPRET``: kernels run under the Triton interpreter (CPU tensors). Set it before
    anything imports triton (see :func:`select_triton_interpreter`)."""
    return _switch("TRITON_INTERPRET", default=False)


def simulate_accept_len() -> float | None:
    """``DSASPEC_SIMULATE_ACCEPT_LEN``: unset (default) for real acceptance; a mean accept length
    (>= 1, bonus token included) forces every speculative iteration to accept about that many
    tokens, for controlled benchmarks. Output tokens are then not the model's greedy output."""
    value = os.environ.get("DSASPEC_SIMULATE_ACCEPT_LEN", "").strip()
    if not value:
        return None
    try:
        mean = float(value)
    except ValueError:
        raise UserError(f"DSASPEC_SIMULATE_ACCEPT_LEN={value!r}: expected a number >= 1 (a mean accept "
                        "length), or unset for real acceptance") from None
    if not mean >= 1.0:
        raise UserError(f"DSASPEC_SIMULATE_ACCEPT_LEN={value!r}: expected a number >= 1 (a mean accept "
                        "length), or unset for real acceptance")
    return mean


def check_all() -> None:
    """Read every switch once, so a bad value fails before any work starts (raises UserError)."""
    bounded_replay_metadata()
    spec_draft_argmax_exchange()
    spec_verify_argmax_exchange()
    topk_single_launch()
    sparse_mla_gluon()
    sparse_mla_slot_major()
    fused_moe()
    metadata_program_budget()
    simulate_accept_len()
    triton_interpret()


def _installed_versions() -> tuple[str | None, str | None]:
    """(triton, numpy) versions (None: not installed), read without importing either."""
    found = []
    for name in ("triton", "numpy"):
        try:
            found.append(metadata.version(name))
        except metadata.PackageNotFoundError:
            found.append(None)
    return found[0], found[1]


def _major_minor(version: str) -> tuple[int, int]:
    parts = (version.split("+")[0].split(".") + ["0"])[:2]
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


def interpreter_version_problem(triton_version: str | None, numpy_version: str | None) -> str | None:
    """Why the Triton interpreter cannot be trusted with these versions (None if it can): the
    triton minor release must be one the CPU suite passes with, numpy below its bound."""
    if triton_version is None or numpy_version is None:
        return f"{'triton' if triton_version is None else 'numpy'} is not installed"
    tested = _major_minor(triton_version)
    if tested not in _INTERPRETER_TESTED:
        tested_with = ", ".join(f"{a}.{b}" for a, b in _INTERPRETER_TESTED)
        return f"triton {triton_version} is not a release it is tested with ({tested_with})"
    bound = _INTERPRETER_TESTED[tested]
    if bound is not None and _major_minor(numpy_version) >= bound:
        return f"triton {triton_version} fails with numpy {numpy_version}"
    return None


def select_triton_interpreter(cuda_available: bool) -> bool:
    """Decide whether the Triton kernels run under the interpreter, before anything imports triton.

    Without CUDA, ``TRITON_INTERPRET`` defaults to 1 (set in ``os.environ``). When the interpreter
    is in use, the installed triton and numpy must be versions it works with. Returns whether the
    interpreter is used. Raises UserError: ``TRITON_INTERPRET`` off without CUDA, a bad switch
    value, or triton / numpy versions the interpreter fails with (the message says what to install).
    """
    if not cuda_available:
        if not os.environ.get("TRITON_INTERPRET", "").strip():
            os.environ["TRITON_INTERPRET"] = "1"
        if not triton_interpret():
            raise UserError(f"TRITON_INTERPRET={os.environ['TRITON_INTERPRET']!r} needs a CUDA device and "
                            "none is available: unset it (without CUDA the kernels run under the interpreter)")
    if not triton_interpret():
        return False
    triton_version, numpy_version = _installed_versions()
    problem = interpreter_version_problem(triton_version, numpy_version)
    if problem:
        pins = " ".join(f"'{pin}'" for pin in INTERPRETER_PINS)
        raise UserError(f"the Triton interpreter (used without CUDA) cannot run here: {problem}; "
                        f"install the tested versions: pip install {pins} (or pip install -e '.[cpu]')")
    return True
