"""RuntimeOptions: the defaults are the shipped path, ``from_environment`` maps each DSASPEC_*
variable to its field (strictly: a bad value is a UserError naming the variable), the fields are
validated, and the end-to-end benchmark builds its paths from option sets."""

import dataclasses
import re

import pytest

from dsaspec.configs.runtime_options import OPT_IN_FIELDS, SWITCH_FIELDS, RuntimeOptions
from dsaspec.errors import UserError

VARIABLES = ("DSASPEC_BOUNDED_REPLAY_METADATA", "DSASPEC_SPEC_DRAFT_ARGMAX_EXCHANGE",
             "DSASPEC_SPEC_VERIFY_ARGMAX_EXCHANGE", "DSASPEC_TOPK_SINGLE_LAUNCH", "DSASPEC_SPARSE_MLA_GLUON",
             "DSASPEC_SPARSE_MLA_SLOT_MAJOR", "DSASPEC_FUSED_MOE", "DSASPEC_FP8_FAST_ACCUM", "DSASPEC_METADATA_BUDGET", "DSASPEC_SIMULATE_ACCEPT_LEN")
# variable -> (field, a value to set, the field's value then)
MAPPING = {"DSASPEC_BOUNDED_REPLAY_METADATA": ("bounded_replay_metadata", "0", False),
           "DSASPEC_SPEC_DRAFT_ARGMAX_EXCHANGE": ("draft_argmax_exchange", "off", False),
           "DSASPEC_SPEC_VERIFY_ARGMAX_EXCHANGE": ("verify_argmax_exchange", "false", False),
           "DSASPEC_TOPK_SINGLE_LAUNCH": ("topk_single_launch", "no", False),
           "DSASPEC_SPARSE_MLA_GLUON": ("sparse_mla_gluon", "0", False),
           "DSASPEC_SPARSE_MLA_SLOT_MAJOR": ("sparse_mla_slot_major", "no", False),
           "DSASPEC_FUSED_MOE": ("fused_moe", "0", False),
           "DSASPEC_FP8_FAST_ACCUM": ("fp8_fast_accum", "on", True),
           "DSASPEC_METADATA_BUDGET": ("metadata_program_budget", " 96 ", 96),
           "DSASPEC_SIMULATE_ACCEPT_LEN": ("simulate_accept_len", "2.5", 2.5)}


@pytest.fixture(autouse=True)
def _unset(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_defaults_are_the_shipped_path():
    options = RuntimeOptions()
    assert all(getattr(options, name) is True for name in SWITCH_FIELDS)
    assert options.metadata_program_budget is None and options.simulate_accept_len is None
    assert all(getattr(options, name) is False for name in OPT_IN_FIELDS)
    assert RuntimeOptions.from_environment() == options
    assert set(SWITCH_FIELDS + OPT_IN_FIELDS) | {"metadata_program_budget", "simulate_accept_len"} == \
        {f.name for f in dataclasses.fields(RuntimeOptions)}
    assert {field for field, _, _ in MAPPING.values()} == {f.name for f in dataclasses.fields(RuntimeOptions)}


@pytest.mark.parametrize("name", VARIABLES)
def test_each_variable_sets_its_field_only(monkeypatch, name):
    field, value, expected = MAPPING[name]
    monkeypatch.setenv(name, value)
    options = RuntimeOptions.from_environment()
    assert getattr(options, field) == expected and type(getattr(options, field)) is type(expected)
    assert options == RuntimeOptions().replace(**{field: expected})   # every other field at its default


@pytest.mark.parametrize("name", VARIABLES[:6])
def test_switch_variables_on(monkeypatch, name):
    field = MAPPING[name][0]
    for value in ("1", "on", "TRUE"):
        monkeypatch.setenv(name, value)
        assert getattr(RuntimeOptions.from_environment(), field) is True


@pytest.mark.parametrize("name,value", [
    ("DSASPEC_BOUNDED_REPLAY_METADATA", "maybe"),
    ("DSASPEC_SPEC_DRAFT_ARGMAX_EXCHANGE", "banana"),
    ("DSASPEC_SPEC_VERIFY_ARGMAX_EXCHANGE", "2"),
    ("DSASPEC_TOPK_SINGLE_LAUNCH", "y"),
    ("DSASPEC_SPARSE_MLA_GLUON", "enabled"),
    ("DSASPEC_FUSED_MOE", "sometimes"),
    ("DSASPEC_FP8_FAST_ACCUM", "fast"),
    ("DSASPEC_METADATA_BUDGET", "0"),
    ("DSASPEC_METADATA_BUDGET", "1.5"),
    ("DSASPEC_SIMULATE_ACCEPT_LEN", "fast"),
    ("DSASPEC_SIMULATE_ACCEPT_LEN", "0.5"),
])
def test_a_bad_value_is_a_user_error_naming_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(UserError, match="^" + re.escape(f"{name}={value!r}")):
        RuntimeOptions.from_environment()


@pytest.mark.parametrize("budget", [0, -3, 1.5, "16", True])
def test_metadata_program_budget_is_validated(budget):
    with pytest.raises(ValueError, match=re.escape(f"metadata_program_budget must be None or a positive int, got {budget!r}")):
        RuntimeOptions(metadata_program_budget=budget)


@pytest.mark.parametrize("sim", [0.5, 0, -1.0, float("nan"), "2", True])
def test_simulate_accept_len_is_validated(sim):
    with pytest.raises(ValueError, match="simulate_accept_len must be None or a number >= 1"):
        RuntimeOptions(simulate_accept_len=sim)


@pytest.mark.parametrize("field", SWITCH_FIELDS + OPT_IN_FIELDS)
@pytest.mark.parametrize("value", ["0", 0, 1, None])
def test_switches_must_be_bools(field, value):
    with pytest.raises(TypeError, match=f"^{field} must be a bool, got {value!r}$"):
        RuntimeOptions(**{field: value})


def test_valid_values_are_kept():
    options = RuntimeOptions(metadata_program_budget=1, simulate_accept_len=1)
    assert (options.metadata_program_budget, options.simulate_accept_len) == (1, 1)
    assert RuntimeOptions(simulate_accept_len=3.25).simulate_accept_len == 3.25


def test_replace_validates_and_keeps_the_rest():
    options = RuntimeOptions(topk_single_launch=False, metadata_program_budget=8)
    changed = options.replace(draft_argmax_exchange=False)
    assert changed == RuntimeOptions(topk_single_launch=False, metadata_program_budget=8, draft_argmax_exchange=False)
    assert options.draft_argmax_exchange                    # frozen: the original is unchanged
    with pytest.raises(ValueError, match="metadata_program_budget"):
        options.replace(metadata_program_budget=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.draft_argmax_exchange = False


def test_baseline_turns_off_the_three_replacements_only():
    options = RuntimeOptions(topk_single_launch=False, sparse_mla_gluon=False, metadata_program_budget=8,
                             simulate_accept_len=2.0)
    assert options.baseline() == dataclasses.replace(options, bounded_replay_metadata=False,
                                                     draft_argmax_exchange=False, verify_argmax_exchange=False)
    assert RuntimeOptions().baseline() == RuntimeOptions(bounded_replay_metadata=False, draft_argmax_exchange=False,
                                                         verify_argmax_exchange=False)


# -- the end-to-end benchmark's paths --------------------------------------------------------------

REPLACEMENTS = ("bounded_replay_metadata", "draft_argmax_exchange", "verify_argmax_exchange")


@pytest.mark.parametrize("environment", [RuntimeOptions(),
                                         RuntimeOptions(topk_single_launch=False, sparse_mla_gluon=False,
                                                        metadata_program_budget=8, simulate_accept_len=2.0),
                                         RuntimeOptions().baseline()])
def test_e2e_paths_are_option_sets(environment):
    """baseline: the three replacements off; new: on; gather: only the draft exchange off; whatever the
    environment's options, whose other fields every path keeps."""
    from dsaspec.bench.e2e import PATHS, path_options

    assert PATHS == ("baseline", "new")
    baseline, new, gather = (path_options(environment, path) for path in ("baseline", "new", "gather"))
    assert baseline == environment.baseline()
    assert all(getattr(baseline, f) is False for f in REPLACEMENTS)
    assert all(getattr(new, f) is True for f in REPLACEMENTS)
    assert (gather.bounded_replay_metadata, gather.draft_argmax_exchange, gather.verify_argmax_exchange) == \
        (True, False, True)
    for options in (baseline, new, gather):
        kept = {f.name for f in dataclasses.fields(RuntimeOptions)} - set(REPLACEMENTS)
        assert {f: getattr(options, f) for f in kept} == {f: getattr(environment, f) for f in kept}
