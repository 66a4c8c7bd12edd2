"""Every environment switch of dsaspec, read in one place.

Kill switches default to on; setting one to ``0`` (or ``false``/``off``/``no``) restores the
baseline path. They are read when called, so tests can flip them with ``monkeypatch.setenv``.
"""

import os

_FALSE = {"0", "false", "off", "no"}


def _switch(name: str, default: bool = True) -> bool:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    return value.strip().lower() not in _FALSE


def bounded_replay_metadata() -> bool:
    """``DSASPEC_BOUNDED_REPLAY_METADATA``: live-bounded replay metadata kernels and the one-launch
    MTP draft-decode metadata (default on). ``0`` restores the context-wide kernels and
    precompute + copies."""
    return _switch("DSASPEC_BOUNDED_REPLAY_METADATA")


def spec_draft_argmax_exchange() -> bool:
    """``DSASPEC_SPEC_DRAFT_ARGMAX_EXCHANGE``: greedy draft steps exchange vocab-shard argmax
    partials instead of gathering logits (default on). ``0`` keeps the logits gather."""
    return _switch("DSASPEC_SPEC_DRAFT_ARGMAX_EXCHANGE")


def metadata_program_budget() -> int:
    """``DSASPEC_METADATA_BUDGET``: program budget of the bounded metadata kernels (default 2048).
    The grid is ``1 + requests * max(1, min(budget // requests, 256))``."""
    value = int(os.environ.get("DSASPEC_METADATA_BUDGET", "2048"))
    if value < 1:
        raise ValueError(f"DSASPEC_METADATA_BUDGET must be >= 1, got {value}")
    return value


def triton_interpret() -> bool:
    """``TRITON_INTERPRET``: kernels run under the Triton interpreter (CPU tensors). Set it before
    anything imports triton; tests do this in conftest.py when no GPU is present."""
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
        raise ValueError(f"DSASPEC_SIMULATE_ACCEPT_LEN must be a number >= 1 (a mean accept length), "
                         f"got {value!r}") from None
    if not mean >= 1.0:
        raise ValueError(f"DSASPEC_SIMULATE_ACCEPT_LEN must be >= 1 (a mean accept length), got {value!r}")
    return mean
