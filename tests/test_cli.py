"""The ``dsaspec`` command: every user error is one line ``dsaspec: error: ...`` (exit status 2)
naming the option, variable or file; internal errors keep their traceback; options are validated,
documented with their defaults, and never silently ignored."""

import argparse
import importlib
import json
import os
import subprocess
import sys
import tracemalloc

import pytest
import torch
from safetensors.torch import load_file, save_file

import dsaspec
from dsaspec.bench import e2e, results
from dsaspec.commands import cli
from dsaspec.errors import UserError
from dsaspec.cli_parsing import (Parser, check_at_most, choice_list, format_value, nonnegative_int,
                             positive_int, positive_int_list, use_cpu_sizes)
from dsaspec.commands import generate
from dsaspec.configs.model_config import get_config
from dsaspec.models.loader import CONFIG_FILE, SINGLE_FILE, save_checkpoint
from dsaspec.memory import ReqToTokenPool
from dsaspec.models.dsa_model import DSAModel

HAS_CUDA = torch.cuda.is_available()


def run_cli(capsys, argv):
    """(exit status, stdout, stderr) of ``dsaspec argv`` run in-process."""
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def assert_one_line_error(capsys, argv, *named):
    status, _, err = run_cli(capsys, argv)
    lines = err.strip().splitlines()
    assert status == 2, err
    assert len(lines) == 1 and lines[0].startswith("dsaspec: error: "), err
    assert "Traceback" not in err
    for text in named:
        assert text in lines[0], (text, lines[0])
    return lines[0]


# ------------------------------------------------------------------------- generate options

@pytest.mark.parametrize("argv,named", [
    (["--max-batch", "-1"], ["--max-batch", "'-1'", "positive integer"]),
    (["--max-new-tokens", "0"], ["--max-new-tokens", "'0'"]),
    (["--context-len", "0"], ["--context-len", "'0'"]),
    (["--prompt-lens", "0"], ["--prompt-lens", "'0'"]),
    (["--prompt-lens", "-3"], ["--prompt-lens", "'-3'"]),
    (["--prompt-lens", "abc"], ["--prompt-lens", "'abc'", "comma-separated positive integers"]),
    (["--prompt-lens", "8,,x"], ["--prompt-lens", "'8,,x'"]),
    (["--num-slots", "1"], ["--num-slots 1", "multiple of 64"]),
    (["--num-slots", "128"], ["--num-slots 128", "at least 192"]),          # longest request: 95 positions
    (["--eos-token-id", "99999"], ["--eos-token-id 99999", "[0, 1031)"]),
    (["--eos-token-id", "-1"], ["--eos-token-id", "'-1'"]),
    (["--prompt-lens", "3000"], ["--prompt-lens 3000", "--context-len 2048"]),
    (["--checkpoint", "/nonexistent"], ["/nonexistent", "does not exist"]),
    (["--device", "banana"], ["--device", "'banana'", "cpu, cuda or cuda:N"]),
    (["--device", "cuda:99"], ["--device cuda:99"]),
    (["--preset", "nope"], ["--preset", "'nope'"]),
    (["--ops", "triton", "--dtype", "fp32"], ["--ops triton", "--dtype bf16"]),
])
def test_generate_option_errors(capsys, argv, named):
    assert_one_line_error(capsys, ["generate", "--no-progress", *argv], *named)


@pytest.mark.skipif(HAS_CUDA, reason="needs a machine without CUDA")
def test_generate_device_cuda_without_cuda(capsys):
    assert_one_line_error(capsys, ["generate", "--device", "cuda"], "--device cuda", "--device cpu")


def test_generate_refuses_a_model_that_does_not_fit(capsys, monkeypatch):
    monkeypatch.setattr(generate, "available_bytes", lambda device: (2 * 10**9, "this machine has"))
    line = assert_one_line_error(capsys, ["generate", "--preset", "glm5"], "--preset glm5 needs at least",
                                 "weights in bf16", "has 2.0 GB available")
    # The figure is the parameter bytes of the real model (about 33.6B parameters in bf16).
    need = float(line.split("needs at least ")[1].split(" GB")[0])
    assert 67 < need < 70


def test_required_bytes_counts_parameters_and_caches():
    config = get_config("tiny")
    need = generate.required_bytes(config, torch.float32, max_batch=2, context_len=100, num_slots=192)
    model = DSAModel(config, dtype=torch.float32)
    assert need["weights"] == sum(p.numel() for p in model.parameters()) * 4
    layers = config.num_hidden_layers
    assert need["kv"] == layers * 192 * (576 + 128) * 4
    assert need["total"] == need["weights"] + need["kv"] + need["table"]
    assert need["table"] == ReqToTokenPool(2, 100).req_to_token.nbytes     # counted, not built


@pytest.mark.skipif(HAS_CUDA, reason="the CPU note is printed on CPU runs")
def test_generate_on_cpu_says_its_times_mean_nothing(capsys):
    status, out, err = run_cli(capsys, ["generate", "--prompt-lens", "3", "--max-new-tokens", "2",
                                        "--context-len", "64", "--no-progress", "--dtype", "fp32"])
    assert status == 0, err
    assert "mean nothing for GPU performance" in out and "request 0: prompt 3 tokens, 2 generated" in out
    assert "prefill chunks of 4096 tokens" in out


def test_generate_prefills_in_chunks_of_the_given_size(capsys):
    """--chunked-prefill-size reaches the engine (its setup line) and, chunking being exact up to
    fp32 rounding, gives the default's tokens for a prompt of several chunks."""
    argv = ["generate", "--prompt-lens", "70", "--max-new-tokens", "3", "--context-len", "128", "--no-progress",
            "--dtype", "fp32"]
    status, default, err = run_cli(capsys, argv)
    assert status == 0, err
    status, chunked, err = run_cli(capsys, argv + ["--chunked-prefill-size", "16"])
    assert status == 0, err
    assert "prefill chunks of 16 tokens" in chunked
    ids = [line for line in default.splitlines() if line.strip().startswith("ids:")]
    assert ids and ids == [line for line in chunked.splitlines() if line.strip().startswith("ids:")]


def test_huge_max_batch_is_refused_before_any_host_list(capsys):
    # The memory check comes first: no per-row host list (10^6 rows: 36 MB of Python ints) is built.
    argv = ["generate", "--max-batch", 10**6]
    assert_one_line_error(capsys, argv, "needs at least")                  # imports done
    tracemalloc.start()
    try:
        assert_one_line_error(capsys, argv, "--preset tiny needs at least", "--max-batch")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, peak


@pytest.mark.parametrize("alias,argv,named", [("bfloat16", ["--max-batch", 10**6], "weights in bf16"),
                                              ("float32", ["--ops", "triton"], "got --dtype fp32")])
def test_dtype_aliases(capsys, alias, argv, named):
    # SGLang's and vLLM's spellings are taken as bf16 / fp32 (the errors that follow name those).
    assert_one_line_error(capsys, ["generate", "--dtype", alias, *argv], named)


def test_simulated_acceptance_without_speculation_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("DSASPEC_SIMULATE_ACCEPT_LEN", "2")
    assert_one_line_error(capsys, ["generate"], "DSASPEC_SIMULATE_ACCEPT_LEN", "--speculative-algorithm")


def test_fp8_fast_accumulation_with_the_row_invariant_mode_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("DSASPEC_FP8_FAST_ACCUM", "1")
    assert_one_line_error(capsys, ["generate", "--row-invariant"], "--row-invariant", "DSASPEC_FP8_FAST_ACCUM")


def test_simulated_acceptance_beyond_the_verified_tokens_names_the_variable(capsys, monkeypatch):
    monkeypatch.setenv("DSASPEC_SIMULATE_ACCEPT_LEN", "100")
    assert_one_line_error(capsys, ["generate", "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3"],
                          "DSASPEC_SIMULATE_ACCEPT_LEN=100", "[1, 4]")


@pytest.mark.skipif(HAS_CUDA, reason="a CPU run (seconds)")
def test_random_weights_accept_length_says_the_drafts_are_noise(capsys):
    status, out, err = run_cli(capsys, ["generate", "--speculative-algorithm", "NEXTN", "--prompt-lens", "3",
                                        "--max-new-tokens", "3", "--context-len", "64", "--no-progress",
                                        "--dtype", "fp32"])
    assert status == 0, err
    line = next(line for line in out.splitlines() if line.startswith("mean accept length"))
    assert "random weights: the MTP layer drafts noise" in line, line


def test_ops_help_says_why_triton_and_torch_tokens_differ(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    ops = text[text.index("DSA ops:"):text.rindex("--no-cuda-graph")]
    assert "sum in different orders" in ops and "bf16" in ops and "CPU" in ops, ops


# ------------------------------------------------------------------------- checkpoints

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A saved checkpoint of the tiny preset (one layer, so the files stay small)."""
    model = DSAModel(get_config("tiny", num_hidden_layers=1), dtype=torch.bfloat16).init_weights(0)
    return save_checkpoint(model, tmp_path_factory.mktemp("ckpt"))


def _copy(checkpoint, tmp_path):
    for file in checkpoint.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    return tmp_path


def test_malformed_config_names_the_file(capsys, checkpoint, tmp_path):
    path = _copy(checkpoint, tmp_path)
    (path / CONFIG_FILE).write_text('{"vocab_size": 1031,')
    assert_one_line_error(capsys, ["generate", "--checkpoint", path], str(path / CONFIG_FILE), "not valid JSON")


def test_config_with_a_bad_value_names_the_file(capsys, checkpoint, tmp_path):
    path = _copy(checkpoint, tmp_path)
    config = json.loads((path / CONFIG_FILE).read_text())
    config["hidden_size"] = -4
    (path / CONFIG_FILE).write_text(json.dumps(config))
    assert_one_line_error(capsys, ["generate", "--checkpoint", path], str(path / CONFIG_FILE), "hidden_size")


def test_corrupt_safetensors_names_the_file(capsys, checkpoint, tmp_path):
    path = _copy(checkpoint, tmp_path)
    (path / SINGLE_FILE).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    assert_one_line_error(capsys, ["generate", "--checkpoint", path], str(path / SINGLE_FILE),
                          "not a valid safetensors file")


def test_truncated_safetensors_names_the_file(capsys, checkpoint, tmp_path):
    path = _copy(checkpoint, tmp_path)
    data = (path / SINGLE_FILE).read_bytes()
    (path / SINGLE_FILE).write_bytes(data[: len(data) // 2])
    assert_one_line_error(capsys, ["generate", "--checkpoint", path], str(path / SINGLE_FILE))


def test_wrong_shape_tensor_names_file_and_tensor(capsys, checkpoint, tmp_path):
    path = _copy(checkpoint, tmp_path)
    tensors = load_file(str(path / SINGLE_FILE))
    tensors["model.norm.weight"] = torch.ones(7, dtype=torch.bfloat16)
    save_file(tensors, str(path / SINGLE_FILE))
    assert_one_line_error(capsys, ["generate", "--checkpoint", path], str(path / SINGLE_FILE),
                          "model.norm.weight has shape (7,)", "(256,)")


@pytest.mark.parametrize("fields,named", [
    ({"model_type": "llama"}, ["model_type", "'llama'", "DSA model type"]),
    ({"n_routed_experts": 8, "moe_intermediate_size": 64, "num_experts_per_tok": 2, "topk_method": "greedy",
      "mlp_layer_types": ["sparse"]}, ["topk_method", "only 'noaux_tc'", "'greedy'"]),
    ({"n_routed_experts": 8, "scoring_func": "softmax", "mlp_layer_types": ["sparse"]},
     ["scoring_func", "'softmax'"]),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, ["quantization_config", "unknown key", "'bits'"]),
    ({"quantization_config": {"quant_method": "gptq"}}, ["quantization_config.quant_method", "'gptq'"]),
    ({"n_routed_experts": 8, "moe_intermediate_size": 64, "num_experts_per_tok": 2, "mlp_layer_types": ["sparse"],
      "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}},
     ["moe_intermediate_size = 64", "FP8 routed experts", "need a multiple of 128"]),
])
def test_config_of_another_architecture_is_refused(capsys, checkpoint, tmp_path, fields, named):
    # The weights are the dense bf16 DSA model's: only config.json claims something else.
    path = _copy(checkpoint, tmp_path)
    config = json.loads((path / CONFIG_FILE).read_text())
    (path / CONFIG_FILE).write_text(json.dumps(config | fields))
    assert_one_line_error(capsys, ["generate", "--checkpoint", path, "--no-progress"], str(path / CONFIG_FILE),
                          *named)


def test_fp8_config_over_bf16_weights_names_the_tensor(capsys, checkpoint, tmp_path):
    path = _copy(checkpoint, tmp_path)
    config = json.loads((path / CONFIG_FILE).read_text())
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (path / CONFIG_FILE).write_text(json.dumps(config | {"quantization_config": fp8}))
    assert_one_line_error(capsys, ["generate", "--checkpoint", path, "--no-progress"], str(path / SINGLE_FILE),
                          "FP8 weight", "has no", "weight_scale_inv")


@pytest.mark.parametrize("fields", [
    {"n_routed_experts": 8, "moe_intermediate_size": 64, "first_k_dense_replace": 0, "mlp_layer_types": None},
    {"n_routed_experts": None, "num_local_experts": 8, "first_k_dense_replace": 0, "mlp_layer_types": None},
    {"n_routed_experts": 8, "mlp_layer_types": ["sparse"]},
])
def test_moe_config_over_dense_tensors_is_refused(capsys, checkpoint, tmp_path, fields):
    """A config.json that claims MoE layers over the dense model's tensors: the experts are missing
    and the dense FFN's tensors unexpected, named in one line."""
    path = _copy(checkpoint, tmp_path)
    config = json.loads((path / CONFIG_FILE).read_text())
    (path / CONFIG_FILE).write_text(json.dumps(config | fields))
    assert_one_line_error(capsys, ["generate", "--checkpoint", path, "--no-progress"], str(path),
                          "does not match the model", "model.layers.0.mlp.experts.0.down_proj.weight",
                          "unexpected ['model.layers.0.mlp.down_proj.weight'")


def test_missing_shard_names_the_file(capsys, checkpoint, tmp_path):
    path = _copy(checkpoint, tmp_path)
    names = list(load_file(str(path / SINGLE_FILE)))
    (path / SINGLE_FILE).unlink()
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: "shard-1.safetensors"
                                                                                 for n in names}}))
    assert_one_line_error(capsys, ["generate", "--checkpoint", path], str(path / "shard-1.safetensors"))


# ------------------------------------------------------------------------- environment

@pytest.mark.parametrize("name,value", [
    ("DSASPEC_METADATA_BUDGET", "abc"),
    ("DSASPEC_BOUNDED_REPLAY_METADATA", "maybe"),
    ("DSASPEC_SPEC_DRAFT_ARGMAX_EXCHANGE", "banana"),
])
def test_bad_environment_switch_is_named(capsys, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert_one_line_error(capsys, ["generate"], f"{name}='{value}'")


KILL_SWITCHES = ("DSASPEC_BOUNDED_REPLAY_METADATA", "DSASPEC_SPEC_DRAFT_ARGMAX_EXCHANGE",
                 "DSASPEC_SPEC_VERIFY_ARGMAX_EXCHANGE")


@pytest.mark.parametrize("off", [(), ("DSASPEC_BOUNDED_REPLAY_METADATA",), ("DSASPEC_SPEC_DRAFT_ARGMAX_EXCHANGE",),
                                 ("DSASPEC_SPEC_VERIFY_ARGMAX_EXCHANGE",), KILL_SWITCHES],
                         ids=["none", "bounded", "draft", "verify", "all"])
def test_kill_switches_work_from_the_command_line(capsys, monkeypatch, off):
    """The switches set in the environment reach what ``generate`` builds: the draft forwards and the
    verify tokens of its speculative worker take the exchange or the gather path, and the printed
    metadata kernel names the option that chose it."""
    from dsaspec.layers.logits_processor import LogitsProcessor

    for name in KILL_SWITCHES:
        monkeypatch.setenv(name, "0" if name in off else "1")
    paths = {"draft": set(), "verify": set()}
    forward, target_tokens = LogitsProcessor.forward, LogitsProcessor.target_tokens

    def watched_forward(self, hidden_states, sampling=None, **kwargs):
        out = forward(self, hidden_states, sampling, **kwargs)
        if sampling is not None:
            paths["draft"].add("gather" if out.next_token_logits is not None else "exchange")
        return out

    def watched_target_tokens(self, hidden_states):
        paths["verify"].add("exchange" if self.uses_verify_argmax_exchange() else "gather")
        return target_tokens(self, hidden_states)

    monkeypatch.setattr(LogitsProcessor, "forward", watched_forward)
    monkeypatch.setattr(LogitsProcessor, "target_tokens", watched_target_tokens)
    status, out, err = run_cli(capsys, ["generate", "--prompt-lens", "5", "--max-new-tokens", "4", "--context-len", "64",
                                        "--dtype", "fp32", "--no-progress", "--speculative-algorithm", "NEXTN",
                                        "--speculative-num-steps", "2"])
    assert status == 0, err
    draft_off = "DSASPEC_SPEC_DRAFT_ARGMAX_EXCHANGE" in off
    verify_off = "DSASPEC_SPEC_VERIFY_ARGMAX_EXCHANGE" in off
    assert paths == {"draft": {"gather" if draft_off else "exchange"}, "verify": {"gather" if verify_off else "exchange"}}
    kernel_line = next(line for line in out.splitlines() if line.startswith("model: "))
    assert ("bounded_metadata=False" in kernel_line) == ("DSASPEC_BOUNDED_REPLAY_METADATA" in off), kernel_line


@pytest.mark.skipif(HAS_CUDA, reason="needs a machine without CUDA")
def test_interpreter_off_without_cuda(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert_one_line_error(capsys, ["generate"], "TRITON_INTERPRET='0'", "CUDA")


def test_interpreter_with_untested_versions_says_what_to_install(capsys, monkeypatch):
    from dsaspec import flags

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(flags, "_installed_versions", lambda: ("3.9.0", "2.4.1"))
    assert_one_line_error(capsys, ["bench", "metadata"], "triton 3.9.0", "pip install 'triton==3.6.0' 'numpy<2.4'")


def test_internal_errors_keep_their_traceback(monkeypatch):
    def broken(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(generate, "run", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["generate"])


def test_python_m_dsaspec_prints_one_line():
    proc = subprocess.run([sys.executable, "-m", "dsaspec", "generate", "--max-batch", "-1"], capture_output=True,
                          text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("dsaspec: error: argument --max-batch"), proc.stderr


# ------------------------------------------------------------------------- bench options

@pytest.mark.parametrize("argv,named", [
    (["bench", "metadata", "--bs", "0"], "--bs"),
    (["bench", "metadata", "--bs", "-1"], "--bs"),
    (["bench", "metadata", "--bs", "1", "4"], "unrecognized arguments: 4"),  # one list syntax: commas
    (["bench", "metadata", "--ops", "decode,nope"], "--ops"),
    (["bench", "metadata", "--iters", "0"], "--iters"),
    (["bench", "draft-metadata", "--bs", "0"], "--bs"),
    (["bench", "draft-metadata", "--step-backends", "0"], "--step-backends"),
    (["bench", "draft-step", "--vocab", "0"], "--vocab"),
    (["bench", "draft-step", "--rows", "x"], "--rows"),
    (["bench", "draft-step", "--tp", "64"], "--tp 64"),
    (["bench", "decode", "--preset", "nope"], "--preset"),
    (["bench", "decode", "--bs", "0"], "--bs"),
    (["bench", "decode", "--steps", "0"], "--steps"),
    (["bench", "decode", "--profile-steps", "-1"], "--profile-steps"),
    (["bench", "dsa-ops", "--heads", "0"], "--heads"),
    (["bench", "dsa-ops", "--heads", "8,x"], "--heads"),
    (["bench", "nope"], "nope"),
    (["bench", "all", "--bs", "1"], "--bs"),
])
def test_bench_option_errors(capsys, argv, named):
    assert_one_line_error(capsys, argv, named)


@pytest.mark.parametrize("accept,named", [
    ("nan", ["--accept", "'nan'", "finite"]),
    ("inf", ["--accept", "'inf'", "finite"]),
    ("real,-inf", ["--accept", "'-inf'"]),
    ("9", ["--accept 9", "[1, 4]", "--num-steps 3"]),
    ("2,4.5", ["--accept 4.5", "[1, 4]"]),
])
def test_e2e_accept_modes_are_checked(capsys, accept, named):
    assert_one_line_error(capsys, ["bench", "e2e", "--accept", accept], *named)


class _Measuring(Exception):
    """Raised where a benchmark would start building and measuring."""


def _stop_at_measuring(monkeypatch):
    def stop(*args, **kwargs):
        raise _Measuring

    monkeypatch.setattr(e2e, "get_config", stop)


def test_e2e_accept_modes_up_to_num_steps_plus_one_pass(capsys, monkeypatch):
    _stop_at_measuring(monkeypatch)
    with pytest.raises(_Measuring):
        cli.main(["bench", "e2e", "--accept", "1,4,real"])
    assert_one_line_error(capsys, ["bench", "e2e", "--accept", "4", "--num-steps", "2"], "--accept 4", "[1, 3]")


def test_e2e_refuses_simulated_acceptance_from_the_environment(capsys, monkeypatch):
    _stop_at_measuring(monkeypatch)
    monkeypatch.setenv("DSASPEC_SIMULATE_ACCEPT_LEN", "100")
    assert_one_line_error(capsys, ["bench", "e2e"], "DSASPEC_SIMULATE_ACCEPT_LEN", "--accept")
    monkeypatch.setenv("DSASPEC_SIMULATE_ACCEPT_LEN", "2")     # in range, but bench e2e would ignore it
    assert_one_line_error(capsys, ["bench", "e2e"], "DSASPEC_SIMULATE_ACCEPT_LEN", "--accept")


@pytest.fixture
def bench_runs(monkeypatch):
    """Benchmark name -> the ``--out`` its ``run`` got; every ``run`` replaced by that record."""
    ran = {}
    for name, module in cli.BENCHMARKS.items():
        mod = importlib.import_module(f"dsaspec.bench.{module}")
        monkeypatch.setattr(mod, "run", lambda args, name=name: ran.setdefault(name, args.out) and 0)
    return ran


def _bad_out(kind, tmp_path, monkeypatch):
    file = tmp_path / "file"
    file.write_text("")
    if kind == "read-only folder":
        folder = tmp_path / "ro"
        folder.mkdir(mode=0o555)
        if os.geteuid() == 0:                       # root writes there anyway: the refusal is simulated

            def refuse(*args, **kwargs):
                raise PermissionError(13, "Permission denied")

            monkeypatch.setattr(results.tempfile, "TemporaryFile", refuse)
        return str(folder / "results"), "cannot write in"
    return {"empty": ("", "expected a folder"), "file": (str(file), "is not a folder"),
            "under a file": (str(file / "results"), "is not a folder")}[kind]


@pytest.mark.parametrize("bench", [*cli.BENCHMARKS, "all"])
@pytest.mark.parametrize("kind", ["empty", "file", "under a file", "read-only folder"])
def test_bench_out_is_checked_before_measuring(capsys, bench_runs, monkeypatch, tmp_path, bench, kind):
    out, why = _bad_out(kind, tmp_path, monkeypatch)
    assert_one_line_error(capsys, ["bench", bench, "--out", out], f"--out {out}", why)
    assert bench_runs == {}


def test_bench_default_results_folder_is_checked(capsys, bench_runs, monkeypatch, tmp_path):
    file = tmp_path / "file"
    file.write_text("")
    monkeypatch.setattr(results, "RESULTS_ROOT", file)
    assert_one_line_error(capsys, ["bench", "decode"], f"results folder {file}", "is not a folder", "--out")
    assert bench_runs == {}


def test_bench_out_check_creates_nothing(capsys, bench_runs, tmp_path):
    out = tmp_path / "new" / "results"
    status, _, err = run_cli(capsys, ["bench", "metadata", "--out", out])
    assert status == 0, err
    assert bench_runs == {"metadata": str(out)} and list(tmp_path.iterdir()) == []


def test_bench_all_passes_out_to_every_benchmark(capsys, bench_runs, tmp_path):
    status, out, _ = run_cli(capsys, ["bench", "all", "--out", tmp_path])
    assert status == 0
    assert bench_runs == {name: str(tmp_path) for name in cli.BENCHMARKS}


@pytest.mark.skipif(HAS_CUDA, reason="the CPU run's fixed sizes")
def test_cpu_bench_names_the_options_it_ignores(capsys, tmp_path):
    status, out, err = run_cli(capsys, ["bench", "draft-step", "--vocab", "5000", "--rows", "1,3", "--iters", "9",
                                        "--out", tmp_path])
    assert status == 0, err
    assert "--vocab 5000 (uses 1000)" in out and "--iters 9 (not used)" in out
    payload = json.loads((tmp_path / "draft_step.json").read_text())
    assert [r["rows"] for r in payload["rows"]] == [1, 3]          # --rows is honoured
    assert {r["vocab"] for r in payload["rows"]} == {1000}


def test_use_cpu_sizes_reports_replaced_and_unused_options():
    from dsaspec.bench import metadata

    parser = Parser()
    metadata.add_arguments(parser)
    args = parser.parse_args(["--live-kv", "999999", "--bs", "2,8", "--iters", "5", "--page-size", "1"])
    note = use_cpu_sizes(args, metadata.add_arguments, {"live_kv": [1000, 2000], "bs": [1, 4], "context_len": 2048},
                         unused=("iters",))
    assert args.live_kv == [1000, 2000] and args.bs == [1, 4] and args.context_len == 2048 and args.page_size == 1
    assert "--live-kv 999999 (uses 1000,2000)" in note and "--bs 2,8 (uses 1,4)" in note
    assert "--iters 5 (not used)" in note and "--context-len" not in note and "--page-size" not in note
    args = parser.parse_args([])
    assert use_cpu_sizes(args, metadata.add_arguments, {"bs": [1, 4]}, unused=("iters",)) is None


def test_live_kv_above_the_context_is_refused():
    with pytest.raises(UserError, match=r"--live-kv 5000,9000 exceeds --context-len 4096"):
        check_at_most([1024, 5000, 9000], "--live-kv", 4096, "--context-len")
    check_at_most([4096], "--live-kv", 4096, "--context-len")


# ------------------------------------------------------------------------- help and types

def _parsers(parser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_option_has_help_and_shows_its_default():
    checked = 0
    for parser in _parsers(cli.build_parser()):
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            name = f"{parser.prog} {action.option_strings[0]}"
            assert action.help, name
            assert action.nargs not in ("+", "*"), f"{name}: lists are comma-separated"
            if action.default is None or action.default is False:
                assert "default" in action.help, f"{name} must say its default"
            else:
                assert f"(default: {format_value(action.default)})" in text, name
            checked += 1
    assert checked > 40


def test_version(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["--version"])
    assert exit.value.code == 0 and capsys.readouterr().out == f"dsaspec {dsaspec.__version__}\n"


# Values that the full option would refuse at once, so a prefix taken by mistake fails fast.
@pytest.mark.parametrize("argv", [["generate", "--speculative-alg", "nope"], ["generate", "--max-b", "0"],
                                  ["bench", "e2e", "--acc", "nan"], ["bench", "all", "--o", ""]])
def test_options_are_not_taken_by_a_prefix(capsys, argv):
    assert_one_line_error(capsys, argv, f"unrecognized arguments: {argv[-2]}")


@pytest.mark.parametrize("argv,prog", [
    (["generate", "--bogus"], "dsaspec generate"),
    (["bench", "e2e", "--bogus"], "dsaspec bench e2e"),
    (["bench", "all", "--bogus"], "dsaspec bench all"),
    (["--bogus", "generate"], "dsaspec"),
])
def test_unknown_option_points_to_its_commands_help(capsys, argv, prog):
    line = assert_one_line_error(capsys, argv, "unrecognized arguments: --bogus")
    assert line.endswith(f"(see {prog} --help)"), line


def test_argument_types():
    assert positive_int(" 7 ") == 7 and nonnegative_int("0") == 0
    assert positive_int_list("1,4,16") == [1, 4, 16] and positive_int_list("3,") == [3]
    for bad in ("0", "-2", "1.5", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_int(bad)
    for bad in ("", ",", "1,0", "1;2", "1 2"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_int_list(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        nonnegative_int("-1")
    ops = choice_list(["a", "b"])
    assert ops("b,a") == ["b", "a"]
    with pytest.raises(argparse.ArgumentTypeError):
        ops("a,c")


def test_parser_errors_are_user_errors():
    parser = Parser(prog="x")
    parser.add_argument("--n", type=positive_int, default=1, help="n")
    with pytest.raises(UserError, match=r"argument --n: expected a positive integer, got '0' \(see x --help\)"):
        parser.parse_args(["--n", "0"])


def test_out_of_gpu_memory_is_one_line(capsys, monkeypatch):
    """A command that runs out of GPU memory (a preset too large for the device: the GLM-5 rank's
    prefill on an 80 GB H100) ends with one line naming what was asked and exit status 1, not a
    traceback."""
    from dsaspec.bench import prefill

    def out_of_memory(args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 768.00 MiB. GPU 0 has a total "
                                     "capacity of 79.18 GiB of which 154.19 MiB is free. Including non-PyTorch "
                                     "memory, this process has 79.02 GiB memory in use.")

    monkeypatch.setattr(prefill, "run", out_of_memory)
    status, _, err = run_cli(capsys, ["bench", "prefill"])
    assert status == 1
    assert err.splitlines() == ["dsaspec: error: out of GPU memory (CUDA out of memory. Tried to allocate "
                                "768.00 MiB. GPU 0 has a total capacity of 79.18 GiB of which 154.19 MiB is "
                                "free): take a smaller --preset, batch or context"]
