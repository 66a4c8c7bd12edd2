"""``python3 -m dsaspec.bench.summary``: the READMEs' tables are generated from the committed JSON
(never typed), and a bad option, a missing folder or a folder of CPU runs is one line, exit 2."""

import json
import subprocess
import sys

import pytest

from dsaspec.bench import summary


def run(capsys, argv):
    """(exit status, stdout, stderr) of the command run in-process."""
    status = summary.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def assert_one_line_error(capsys, argv, *named):
    status, out, err = run(capsys, argv)
    lines = err.strip().splitlines()
    assert status == 2 and not out, (status, out, err)
    assert len(lines) == 1 and lines[0].startswith("summary: error: "), err
    for text in named:
        assert text in lines[0], (text, lines[0])


def cpu_run(folder, name="metadata"):
    """A results JSON as a CPU run writes it: the interpreter, no GPU, rows without times."""
    folder.mkdir(exist_ok=True)
    payload = {"benchmark": name, "machine": {"gpu": None, "gpus": 0, "interpreter": True, "date": "x"},
               "method": "Triton interpreter on CPU: bit-identity only, no times.",
               "params": {"context_len": 2048, "num_draft_tokens": 5},
               "rows": [{"op": "decode", "live_kv": 1000, "bs": 1, "rows": 1, "width": 2057, "bit_identical": True}]}
    (folder / f"{name}.json").write_text(json.dumps(payload))
    return folder


def test_help_describes_the_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        summary.main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    for text in ("usage: python3 -m dsaspec.bench.summary", "FOLDER", "--all", "--write", "--check"):
        assert text in out


@pytest.mark.parametrize("argv,named", [
    (["--bogus"], ["unrecognized arguments: --bogus"]),
    (["--wri"], ["unrecognized arguments: --wri"]),                       # no abbreviations
    (["--write", "--check"], ["--check", "not allowed with argument --write"]),
    (["--write", "benchmarks/results/h200"], ["--write and --check take no FOLDER"]),
    (["/nonexistent/results"], ["FOLDER /nonexistent/results: no such folder"]),
])
def test_bad_arguments_are_one_line(capsys, argv, named):
    assert_one_line_error(capsys, argv, *named)


def test_a_file_is_not_a_folder(capsys, tmp_path):
    path = tmp_path / "e2e.json"
    path.write_text("{}")
    assert_one_line_error(capsys, [path], f"FOLDER {path}: not a folder")


@pytest.mark.parametrize("all_tables", [False, True])
def test_cpu_results_are_refused_by_name(capsys, tmp_path, all_tables):
    """A CPU (interpreter) run has no times: refused naming its file, not a KeyError."""
    folder = cpu_run(tmp_path / "cpu-interpreter")
    assert_one_line_error(capsys, (["--all"] if all_tables else []) + [folder],
                          f"{folder / 'metadata.json'}: a Triton-interpreter (CPU) run", "benchmarks/results/h200")


@pytest.mark.parametrize("text,named", [("{not json", "not a readable results JSON"),
                                        ('{"rows": []}', "not a results JSON (expected the keys")])
def test_unreadable_json_is_named(capsys, tmp_path, text, named):
    (tmp_path / "metadata.json").write_text(text)
    assert_one_line_error(capsys, [tmp_path], f"{tmp_path / 'metadata.json'}: {named}")


def test_a_folder_without_results(capsys, tmp_path):
    assert_one_line_error(capsys, [tmp_path], f"FOLDER {tmp_path}: none of e2e.json")
    assert_one_line_error(capsys, ["--all", tmp_path], f"FOLDER {tmp_path}: no benchmark results JSON")


def test_entry_point_errors_are_one_line():
    """The module run as a program: a bad option is one line and exit status 2."""
    proc = subprocess.run([sys.executable, "-m", "dsaspec.bench.summary", "--bogus"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and not proc.stdout, proc
    assert proc.stderr.strip().splitlines() == [
        "summary: error: unrecognized arguments: --bogus (see python3 -m dsaspec.bench.summary --help)"]


def test_headline_tables_print(capsys):
    status, out, err = run(capsys, [])
    assert status == 0, err
    assert "MTP speculative decoding end to end, TP 1, `e2e` preset" in out
    assert "Full table: [e2e.md](benchmarks/results/h200/e2e.md)" in out


def test_committed_readmes_are_generated():
    """README.md's tables and benchmarks/results/README.md are exactly what ``--write`` writes from
    the committed JSON: a number edited by hand, or JSON rerun without ``--write``, fails here."""
    assert summary.results_readme() == summary.RESULTS_README.read_text()
    text = summary.README.read_text()
    assert summary.readme_with_tables(text, summary.headline()) == text
    assert summary.main(["--check"]) == 0


def test_readme_needs_its_markers():
    with pytest.raises(summary.UserError, match="README.md: expected one line"):
        summary.readme_with_tables("# dsaspec\n", "table")
    text = f"a\n{summary.BEGIN}\nold\n{summary.END}\nb\n"
    assert summary.readme_with_tables(text, "new") == f"a\n{summary.BEGIN}\n\nnew\n\n{summary.END}\nb\n"


def test_decode_tables_take_the_bf16_rows_and_name_the_others():
    """A decode run over both cache dtypes: the generated tables are the bf16 rows' (the FP8 rows
    would otherwise overwrite the same context x bs cells) and say which dtypes the file adds."""
    payload = json.loads((summary.RESULTS_ROOT / "h200" / "decode.json").read_text())
    bf16 = [dict(r, kv_cache_dtype="bf16") for r in payload["rows"]]
    fp8 = [dict(r, kv_cache_dtype="fp8_e4m3", baseline_us=r["baseline_us"] * 7, new_us=r["new_us"] * 7)
           for r in payload["rows"]]
    alone = "\n".join(summary._decode(dict(payload, rows=bf16)))
    assert "fp8_e4m3" not in alone
    for rows in (fp8 + bf16, bf16 + fp8):
        both = "\n".join(summary._decode(dict(payload, rows=rows)))
        assert "fp8_e4m3 rows in the file" in both
        assert both.replace(", bf16 KV caches (fp8_e4m3 rows in the file)", "") == alone
