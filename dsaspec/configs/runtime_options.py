"""The runtime's switches and tunables as one value, built once where a program starts and passed down.

Commands and benchmarks build it from the environment (:meth:`RuntimeOptions.from_environment`,
which reads the ``DSASPEC_*`` variables through :mod:`dsaspec.flags`, strictly); library users and
tests build it directly. Nothing below the command line reads the environment. A benchmark that
compares the shipped path with what serving engines run today takes :meth:`RuntimeOptions.baseline`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dsaspec import flags

# the fields that are on/off switches (bools)
SWITCH_FIELDS = ("bounded_replay_metadata", "draft_argmax_exchange", "verify_argmax_exchange",
                 "topk_single_launch", "sparse_mla_gluon", "sparse_mla_slot_major", "fused_moe")
# the on/off choices that default to off (candidates and trade-offs the shipped path does not take)
OPT_IN_FIELDS = ("fp8_fast_accum",)


@dataclass(frozen=True)
class RuntimeOptions:
    """What the runtime may use; every field's default is the shipped path.

    Attributes
    ----------
    bounded_replay_metadata : live-bounded replay metadata kernels and the one-launch draft-decode
        metadata (``DSASPEC_BOUNDED_REPLAY_METADATA``); False: the context-wide kernels and
        precompute + copies.
    draft_argmax_exchange : greedy draft steps exchange vocab-shard argmax partials
        (``DSASPEC_SPEC_DRAFT_ARGMAX_EXCHANGE``); False: they gather the logits.
    verify_argmax_exchange : the greedy target-verify tokens come from exchanged partials
        (``DSASPEC_SPEC_VERIFY_ARGMAX_EXCHANGE``); False: from gathered logits.
    topk_single_launch : the chunked top-k runs as one cooperative launch where it fits
        (``DSASPEC_TOPK_SINGLE_LAUNCH``); False: its five launches.
    sparse_mla_gluon : sparse MLA takes the warp-specialized Gluon kernel where it runs
        (``DSASPEC_SPARSE_MLA_GLUON``); False: the Triton kernel everywhere.
    sparse_mla_slot_major : at 8 and 16 heads a rank, where sparse MLA takes the Gluon kernel, its
        slot-major form (``DSASPEC_SPARSE_MLA_SLOT_MAJOR``; ``sparse_mla_config``); False: the padded
        head-major form.
    fused_moe : MoE layers run the fused MoE kernel (``DSASPEC_FUSED_MOE``) where the model runs the
        Triton ops and is not row-invariant; False: the plain-torch experts (every expert on every
        token).
    fp8_fast_accum : the FP8 block-scaled GEMMs of :class:`~dsaspec.layers.fp8_linear.Fp8Linear` take
        64-row tiles from 32 rows (``DSASPEC_FP8_FAST_ACCUM``, default off: from
        ``PREFILL_MIN_ROWS`` rows outside the row-invariant mode, ``Fp8Linear.tall_tiles``): the
        e4m3 warpgroup MMA, faster at verify and prefill sizes, whose sum of each 128-column block
        keeps fewer bits than fp32 (:mod:`dsaspec.ops.fp8_gemm`); refused with the row-invariant
        mode.
    metadata_program_budget : program budget of the bounded metadata kernels
        (``DSASPEC_METADATA_BUDGET``), >= 1; None: the kernels' default (2048).
    simulate_accept_len : None for real acceptance, or a mean accept length >= 1 that every
        speculative iteration is forced to (``DSASPEC_SIMULATE_ACCEPT_LEN``).
    """

    bounded_replay_metadata: bool = True
    draft_argmax_exchange: bool = True
    verify_argmax_exchange: bool = True
    topk_single_launch: bool = True
    sparse_mla_gluon: bool = True
    sparse_mla_slot_major: bool = True
    fused_moe: bool = True
    fp8_fast_accum: bool = False
    metadata_program_budget: int | None = None
    simulate_accept_len: float | None = None

    def __post_init__(self):
        for name in SWITCH_FIELDS + OPT_IN_FIELDS:
            if not isinstance(getattr(self, name), bool):   # "0" would read as on
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        budget = self.metadata_program_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"metadata_program_budget must be None or a positive int, got {budget!r}")
        sim = self.simulate_accept_len
        if sim is not None and (isinstance(sim, bool) or not isinstance(sim, (int, float)) or not sim >= 1.0):
            raise ValueError(f"simulate_accept_len must be None or a number >= 1, got {sim!r}")

    @classmethod
    def from_environment(cls) -> "RuntimeOptions":
        """The options the ``DSASPEC_*`` variables set (unset: the default); raises
        :class:`~dsaspec.errors.UserError` naming a variable with a bad value."""
        return cls(bounded_replay_metadata=flags.bounded_replay_metadata(),
                   draft_argmax_exchange=flags.spec_draft_argmax_exchange(),
                   verify_argmax_exchange=flags.spec_verify_argmax_exchange(),
                   topk_single_launch=flags.topk_single_launch(),
                   sparse_mla_gluon=flags.sparse_mla_gluon(),
                   sparse_mla_slot_major=flags.sparse_mla_slot_major(),
                   fused_moe=flags.fused_moe(),
                   fp8_fast_accum=flags.fp8_fast_accum(),
                   metadata_program_budget=flags.metadata_program_budget(),
                   simulate_accept_len=flags.simulate_accept_len())

    def baseline(self) -> "RuntimeOptions":
        """These options with the three replacements this project makes turned off: context-wide
        replay metadata, precompute + copies for the draft steps, and logits gathers for draft and
        verify tokens (what serving engines run today). The kernels' own choices stay."""
        return self.replace(bounded_replay_metadata=False, draft_argmax_exchange=False,
                            verify_argmax_exchange=False)

    def replace(self, **changes) -> "RuntimeOptions":
        """A copy with ``changes`` applied (validated)."""
        return dataclasses.replace(self, **changes)
