"""Environment switches are parsed strictly: the accepted spellings, the default when unset or
empty, and a UserError naming the variable and the accepted values for anything else."""

import os

import pytest

from dsaspec import flags
from dsaspec.errors import UserError

SWITCHES = [("DSASPEC_BOUNDED_REPLAY_METADATA", flags.bounded_replay_metadata, True),
            ("DSASPEC_SPEC_DRAFT_ARGMAX_EXCHANGE", flags.spec_draft_argmax_exchange, True),
            ("DSASPEC_SPEC_VERIFY_ARGMAX_EXCHANGE", flags.spec_verify_argmax_exchange, True),
            ("DSASPEC_TOPK_SINGLE_LAUNCH", flags.topk_single_launch, True),
            ("DSASPEC_SPARSE_MLA_GLUON", flags.sparse_mla_gluon, True),
            ("DSASPEC_SPARSE_MLA_SLOT_MAJOR", flags.sparse_mla_slot_major, True),
            ("DSASPEC_FUSED_MOE", flags.fused_moe, True),
            ("DSASPEC_FP8_FAST_ACCUM", flags.fp8_fast_accum, False),
            ("TRITON_INTERPRET", flags.triton_interpret, False)]


@pytest.mark.parametrize("name,read,default", SWITCHES)
@pytest.mark.parametrize("value,expected", [
    ("1", True), ("true", True), ("TRUE", True), ("On", True), ("yes", True), (" yes ", True),
    ("0", False), ("false", False), ("OFF", False), ("No", False), ("no", False),
])
def test_accepted_values(monkeypatch, name, read, default, value, expected):
    monkeypatch.setenv(name, value)
    assert read() is expected


@pytest.mark.parametrize("name,read,default", SWITCHES)
def test_unset_or_empty_is_the_default(monkeypatch, name, read, default):
    monkeypatch.delenv(name, raising=False)
    assert read() is default
    for value in ("", "  "):
        monkeypatch.setenv(name, value)
        assert read() is default


@pytest.mark.parametrize("name,read,default", SWITCHES)
@pytest.mark.parametrize("value", ["maybe", "banana", "2", "y", "-1", "enabled"])
def test_other_values_are_refused(monkeypatch, name, read, default, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(UserError) as err:
        read()
    message = str(err.value)
    assert f"{name}={value!r}" in message and "1/0, true/false, on/off, yes/no" in message


def test_metadata_budget(monkeypatch):
    monkeypatch.delenv("DSASPEC_METADATA_BUDGET", raising=False)
    assert flags.metadata_program_budget() is None
    monkeypatch.setenv("DSASPEC_METADATA_BUDGET", " 16 ")
    assert flags.metadata_program_budget() == 16
    for bad in ("abc", "0", "-5", "1.5", "2e3"):
        monkeypatch.setenv("DSASPEC_METADATA_BUDGET", bad)
        with pytest.raises(UserError, match=rf"DSASPEC_METADATA_BUDGET={bad!r}: expected a positive integer"):
            flags.metadata_program_budget()


def test_check_all_reads_every_switch(monkeypatch):
    flags.check_all()
    for name, value in [("DSASPEC_METADATA_BUDGET", "x"), ("DSASPEC_BOUNDED_REPLAY_METADATA", "x"),
                        ("DSASPEC_SPEC_DRAFT_ARGMAX_EXCHANGE", "x"), ("DSASPEC_SPEC_VERIFY_ARGMAX_EXCHANGE", "x"),
                        ("DSASPEC_TOPK_SINGLE_LAUNCH", "x"), ("DSASPEC_SPARSE_MLA_GLUON", "x"),
                        ("DSASPEC_SIMULATE_ACCEPT_LEN", "x"),
                        ("TRITON_INTERPRET", "x")]:
        with monkeypatch.context() as m:
            m.setenv(name, value)
            with pytest.raises(UserError, match=name):
                flags.check_all()


@pytest.mark.parametrize("triton,numpy,problem", [
    ("3.6.0", "2.3.5", None),
    ("3.6.1", "1.26.4", None),
    ("3.8.0", "2.4.6", None),
    ("3.6.0", "2.4.0", "fails with numpy 2.4.0"),
    ("3.9.0", "2.3.5", "not a release it is tested with (3.6, 3.8)"),
    ("3.7.0", "2.3.5", "not a release it is tested with"),
    ("3.5.1", "2.3.5", "not a release it is tested with"),
    (None, "2.3.5", "triton is not installed"),
])
def test_interpreter_versions(triton, numpy, problem):
    found = flags.interpreter_version_problem(triton, numpy)
    assert found == problem if problem is None else problem in found


def test_select_interpreter_without_cuda(monkeypatch):
    monkeypatch.setattr(flags, "_installed_versions", lambda: ("3.6.0", "2.3.5"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert flags.select_triton_interpreter(cuda_available=False) is True
    assert os.environ["TRITON_INTERPRET"] == "1"
    monkeypatch.setenv("TRITON_INTERPRET", "off")
    with pytest.raises(UserError, match="TRITON_INTERPRET='off' needs a CUDA device"):
        flags.select_triton_interpreter(cuda_available=False)


def test_select_interpreter_with_cuda_leaves_it_off_and_skips_the_version_check(monkeypatch):
    def unexpected():
        raise AssertionError("versions are checked only when the interpreter is used")

    monkeypatch.setattr(flags, "_installed_versions", unexpected)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert flags.select_triton_interpreter(cuda_available=True) is False
    assert "TRITON_INTERPRET" not in os.environ


def test_select_interpreter_refuses_versions_it_fails_with(monkeypatch):
    monkeypatch.setattr(flags, "_installed_versions", lambda: ("3.6.0", "2.4.6"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(UserError, match=r"triton 3.6.0 fails with numpy 2.4.6.*pip install 'triton==3.6.0' 'numpy<2.4'"):
        flags.select_triton_interpreter(cuda_available=True)
