"""The scripts' command lines: a bad option is one line ``<prog>: error: ...`` and exit status 2
(``cli_parsing.parse_or_exit``), never a usage block or a traceback."""

import subprocess
import sys
from pathlib import Path

import pytest

from dsaspec.cli_parsing import Parser, parse_or_exit, positive_int

ROOT = Path(__file__).resolve().parents[1]


def test_parse_or_exit_is_one_line_and_status_2(capsys):
    parser = Parser(prog="tool")
    parser.add_argument("--n", type=positive_int, default=1)
    assert parse_or_exit(parser, ["--n", "3"]).n == 3
    with pytest.raises(SystemExit) as exit_info:
        parse_or_exit(parser, ["--n", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tool: error: argument --n:"), err


@pytest.mark.parametrize("argv,named", [
    (["scripts/bench_fp8_linear.py", "out", "--rows", "4,0"], "--rows"),
    (["scripts/bench_fp8_linear.py", "out", "--iters", "0"], "--iters"),
    (["scripts/bench_fp8_linear.py", "out", "--preset", "tiny"], "--preset"),
    (["scripts/bench_fp8_linear.py", "out", "--programs-per-sm", "2,0"], "--programs-per-sm"),
    (["scripts/bench_fp8_linear.py", "out", "--block-m", "16,48"], "--block-m"),
    (["scripts/bench_router_gemm.py", "out", "--rows", "1,0"], "--rows"),
    (["scripts/bench_router_gemm.py", "out", "--weight-dtype", "bf16,fp8"], "--weight-dtype"),
    (["scripts/bench_moe_tiles.py", "out", "--tokens", "x"], "--tokens"),
    (["scripts/bench_moe_tiles.py", "out", "--preset", "tiny-moe"], "--preset"),
    (["scripts/bench_moe_tiles.py", "out", "--kernels", "gate_up,combine"], "--kernels"),
    (["scripts/bench_moe_tiles.py", "out", "--stages", "0"], "--stages"),
    (["scripts/bench_moe_tiles.py", "out", "--kernels", "down", "--splits", "2"], "--splits"),
    (["scripts/bench_read_chain.py", "out", "--tokens", "1,0"], "--tokens"),
    (["scripts/bench_read_chain.py", "out", "--live", "0"], "--live"),
    (["scripts/bench_read_chain.py", "out", "--preset", "glm5-moe"], "--preset"),   # bf16 MoE: neither form
    (["scripts/small_m_kernels.py", "--calls", "0"], "--calls"),
    (["scripts/bench_norms.py", "out", "--rows", "1,0"], "--rows"),
    (["scripts/bench_norms.py", "out", "--iters", "0"], "--iters"),
    (["scripts/bench_mla_query.py", "out", "--tiles", "64x64x4"], "--tiles"),
    (["scripts/bench_mla_query.py", "out", "--tiles", "64x48x4x3"], "--tiles"),
    (["scripts/bench_mla_query.py", "out", "--rows", "512,0"], "--rows"),
    (["scripts/sweep_fused_moe.py", "out", "--tokens", "16,x"], "--tokens"),
    (["scripts/sweep_fused_moe.py", "out", "--align", "1024x3"], "--align"),
    (["scripts/sweep_sparse_mla.py", "out", "--heads", "0"], "--heads"),
    (["scripts/sweep_sparse_mla.py", "out", "--timeline", "--heads", "8"], "--heads"),
    (["scripts/compile_sparse_mla_gluon.py", "--heads", "8,x"], "--heads"),
    (["scripts/compile_fp8_dsa.py", "--bogus"], "--bogus"),
    (["scripts/compile_decode_epilogues.py", "--bogus"], "--bogus"),
    (["scripts/compile_fused_moe.py", "--bogus"], "--bogus"),
    (["scripts/serving_overhead.py", "--accept", "0.5"], "--accept"),
    (["scripts/serving_overhead.py", "--switch-interval", "0"], "--switch-interval"),
    (["scripts/serving_report.py", "w", "o", "n", "e2e", "1024", "x", "1"], "context"),
])
def test_script_bad_options(argv, named):
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and ": error: " in lines[0] and named in lines[0], proc.stderr
