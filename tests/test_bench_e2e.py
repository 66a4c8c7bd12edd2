"""bench e2e: several chains in one run, the per-rank presets, and the upstream PR's table form
computed from the right pair of runs."""

import json
from types import SimpleNamespace

from dsaspec.bench import e2e
from dsaspec.bench.floors import FloorModel, Rates
from dsaspec.configs.model_config import get_config
from dsaspec.commands import cli
from dsaspec.speculative.spec_worker import PHASES


def runs(iter_ms_per_run: list[list[float]], accept_len: float) -> list[dict]:
    """Timed runs as ``e2e._run`` returns them: per-iteration wall ms, one accept length a request."""
    return [{"iter_ms": ms, "phase_ms": [dict.fromkeys(PHASES, 1.0)] * len(ms), "accept_lens": [accept_len] * len(ms),
             "tokens": []} for ms in iter_ms_per_run]


def row(concurrency: int, base: list, new: list, num_steps: int = 3, accept: str = "3.0",
        kv_cache_dtype: str = "bf16") -> dict:
    """A GPU row from baseline / new runs ``(iter_ms_per_run, accept_len)``."""
    args = SimpleNamespace(tp=1, prompt_len=1024, iterations=len(new[0][0]), row_invariant=False)
    floors = (FloorModel(get_config("glm5-fp8-tp8-rank"), act_bytes=2), Rates(4000.0, 2.0, 700.0, 1400.0))
    return e2e._row("glm5-fp8-tp8-rank", num_steps, 4096, accept, concurrency,
                    {"baseline": runs(*base), "new": runs(*new)}, True, SimpleNamespace(ttft_ms=47.6, capture_s={"baseline": 165.6, "new": 9.25}), True, args,
                    floors, kv_cache_dtype)


def test_upstream_table_rows_come_from_their_own_pair():
    """Each line: tok/s/user = 1000 x accept / median iteration ms of its own concurrency's runs,
    gain from that pair (not the ms ratio: the accept lengths differ), run spread, output tok/s
    = concurrency x tok/s/user, lines by concurrency, one table per chain."""
    rows = [row(2, ([[20.0] * 3, [20.0] * 3], 3.0), ([[16.0] * 3, [16.0] * 3], 3.0)),
            row(1, ([[10.0] * 3, [12.0] * 3], 2.0), ([[8.0] * 3, [8.0] * 3], 2.5)),
            row(1, ([[40.0] * 2], 4.0), ([[25.0] * 2], 4.0), num_steps=4)]
    three, four = e2e.upstream_tables(rows)
    assert three.splitlines() == [
        "## glm5-fp8-tp8-rank, S = 3 (EAGLE 3/1/4), KV cache bf16, accept 3.0, context 4096: tok/s/user, "
        "baseline → new", "",
        "| concurrency | tok/s/user baseline | new | gain | spread baseline / new | output tok/s baseline → new "
        "| median TTFT ms | accept length |",
        "|---|---|---|---|---|---|---|---|",
        # baseline: median 11 ms / 2.0 = 5.5 ms a token; new: 8 ms / 2.5 = 3.2 ms; spread (12 - 10) / 11
        "| 1 | 181.8 | 312.5 | +71.9% | 18.18% / 0.00% | 182 → 312 | 48 | 2.00 / 2.50 |",
        # baseline 20 / 3 ms, new 16 / 3 ms a token; 2 requests
        "| 2 | 150.0 | 187.5 | +25.0% | 0.00% / 0.00% | 300 → 375 | 48 | 3.00 |"]
    assert four.splitlines()[0].startswith("## glm5-fp8-tp8-rank, S = 4 (EAGLE 4/1/5), KV cache bf16, accept 3.0")
    assert four.splitlines()[4] == "| 1 | 100.0 | 160.0 | +60.0% | 0.00% / 0.00% | 100 → 160 | 48 | 4.00 |"


def test_all_columns_table_gives_each_paths_capture_seconds():
    """The per-chain table names the paths of the capture column in their order and gives each
    path's seconds of its setup."""
    from dsaspec.bench.results import markdown_table

    rows = [row(1, ([[10.0] * 3], 2.0), ([[8.0] * 3], 2.0))]
    args = SimpleNamespace(presets=["glm5-fp8-tp8-rank"], num_steps=[3], contexts=[4096], row_invariant=False)
    table = e2e._markdown(rows, True, args, markdown_table).split("all columns")[1]
    header, _, line = table.strip().splitlines()[2:5]
    column = header.split(" | ").index("graph capture s (baseline / new)")
    assert line.split(" | ")[column] == "165.6 / 9.2"


def test_several_chains_in_one_run_on_cpu(tmp_path):
    """The upstream PR's chains S = 4 (EAGLE 4/1/5) and 5 (5/1/6) in one invocation: rows for each,
    baseline == new tokens, S recorded."""
    assert cli.main(["bench", "e2e", "--num-steps", "5,4", "--accept", "3.0", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "e2e.json").read_text())
    assert payload["params"]["num_steps"] == [4, 5]
    assert sorted({r["num_steps"] for r in payload["rows"]}) == [4, 5]
    assert len(payload["rows"]) == 2 * 2 * 2 and all(r["tokens_identical"] for r in payload["rows"])
    assert "| tiny | 5 | 128 | bf16 | 3.0 | 2 | True |" in (tmp_path / "e2e.md").read_text()


def test_rank_presets_are_choices_and_an_unbuildable_preset_is_refused_first(capsys, monkeypatch):
    """--presets takes the per-rank presets; one the runtime cannot build is refused in one line with
    check_implemented's words before any preset is built."""
    built = []
    monkeypatch.setattr(e2e, "DSAModel", lambda *a, **k: built.append(a) or 1 / 0)

    def refuse(hf):
        if hf["num_attention_heads"] == 16:
            raise ValueError("quantized MoE experts are not implemented yet")

    monkeypatch.setattr(e2e, "check_implemented", refuse)
    status = cli.main(["bench", "e2e", "--presets", "glm5-fp8-tp8-rank,deepseek-v32-fp8-tp8-rank"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and not built
    assert err == ["dsaspec: error: --presets deepseek-v32-fp8-tp8-rank: quantized MoE experts are not "
                   "implemented yet"]


def test_each_cache_dtype_has_its_own_table_and_targets():
    """Rows of both cache dtypes at the same point: one upstream table each, and each row's context
    target against the reference context of its own dtype."""
    rows = [row(1, ([[10.0]], 1.0), ([[8.0]], 1.0)), row(1, ([[10.0]], 1.0), ([[5.0]], 1.0), kv_cache_dtype="fp8_e4m3")]
    bf16, fp8 = e2e.upstream_tables(rows)
    assert "KV cache bf16," in bf16.splitlines()[0] and "KV cache fp8_e4m3," in fp8.splitlines()[0]
    assert bf16.splitlines()[4].startswith("| 1 | 100.0 | 125.0 |") and fp8.splitlines()[4].startswith("| 1 | 100.0 | 200.0 |")
    e2e._add_targets(rows, 4096)
    assert [r["new_vs_reference_context"] for r in rows] == [1.0, 1.0]


def test_both_cache_dtypes_in_one_run_and_the_capacity_table(tmp_path, monkeypatch):
    """--kv-cache-dtype fp8_e4m3,bf16,auto: the pools of each run in their dtype (auto is bf16,
    once), rows carry it, tokens identical within each; capacity at a stated budget from the
    pools' bytes (tiny in fp32: 3 layers x (576 + 128) x 4 B against 3 x 788 B a token)."""
    def small(args):
        args.presets, args.contexts, args.concurrency, args.prompt_len, args.iterations = ["tiny"], [128], [2], 70, 3

    monkeypatch.setattr(e2e, "_apply_cpu_sizes", small)
    built, for_model = [], e2e.KVPool.for_model.__func__
    monkeypatch.setattr(e2e.KVPool, "for_model", classmethod(
        lambda cls, *a, **k: built.append((str(k["device"]), k.get("kv_cache_dtype", "bf16"))) or for_model(cls, *a, **k)))
    assert cli.main(["bench", "e2e", "--kv-cache-dtype", "fp8_e4m3,bf16,auto", "--accept", "3.0",
                     "--kv-budget-gb", "1", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "e2e.json").read_text())
    assert payload["params"]["kv_cache_dtype"] == ["fp8_e4m3", "bf16"]
    # the capacity table's byte counts (meta), then the target + MTP pools of each run
    assert built == [("meta", "fp8_e4m3")] * 2 + [("meta", "bf16")] * 2 + [("cpu", "fp8_e4m3")] * 2 + [("cpu", "bf16")] * 2
    assert [r["kv_cache_dtype"] for r in payload["rows"]] == ["fp8_e4m3", "bf16"]
    assert all(r["tokens_identical"] for r in payload["rows"])
    capacity = {r["kv_cache_dtype"]: r for r in payload["capacity"]}
    for dtype, per_token in (("bf16", 3 * 704 * 4), ("fp8_e4m3", 3 * 788)):
        tokens = 10 ** 9 // (64 * per_token) * 64
        assert capacity[dtype]["bytes_per_token"] == per_token and capacity[dtype]["tokens"] == tokens
        assert capacity[dtype]["requests_at_context"] == {"128": tokens // 128}
    text = (tmp_path / "e2e.md").read_text()
    assert f"| tiny | fp8_e4m3 | 788 | 3 | 2364 | 423012 | 1.00 (--kv-budget-gb) | {10 ** 9 // (64 * 2364) * 64} |" in text
    assert "| tiny | 3 | 128 | fp8_e4m3 | 3.0 | 2 | True |" in text


def test_cache_dtype_and_budget_options_are_checked(capsys):
    from test_cli import assert_one_line_error

    assert_one_line_error(capsys, ["bench", "e2e", "--kv-cache-dtype", "bf16,fp8"], "--kv-cache-dtype", "fp8_e4m3")
    assert_one_line_error(capsys, ["bench", "e2e", "--kv-budget-gb", "0"], "--kv-budget-gb", "positive number")


def test_moe_floors_take_the_experts_counted_in_an_iteration(tmp_path, monkeypatch):
    """tiny-moe (8 experts, 3 a token; the MTP layer is MoE too), S = 3: a draft step of one request
    hits exactly its 3 experts, the verify / extend's 4 rows 3 to 8; two requests 3 to 6 and 3 to
    8. Each phase's ffn floor bytes are the floor model's with those counts, not uniform routing's
    (6.78 experts at 4 rows, never a mean of counts)."""
    def small(args):
        args.presets, args.contexts, args.concurrency, args.prompt_len, args.iterations = \
            ["tiny-moe"], [128], [1, 2], 70, 2

    monkeypatch.setattr(e2e, "_apply_cpu_sizes", small)
    assert cli.main(["bench", "e2e", "--accept", "3.0", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "e2e.json").read_text())["rows"]
    for row in rows:
        hits = {int(k): v for k, v in row["experts_hit"].items()}
        c = row["concurrency"]
        assert sorted(hits) == [c, 4 * c]
        assert (hits[1] == 3) if c == 1 else (3 <= hits[c] <= 6)
        assert 3 <= hits[4 * c] <= 8
        counted = FloorModel(get_config("tiny-moe"), act_bytes=4, experts_hit=hits).spec_iteration(c, row["floor_live"], 3)
        uniform = FloorModel(get_config("tiny-moe"), act_bytes=4).spec_iteration(c, row["floor_live"], 3)
        for phase in ("draft", "verify", "extend"):
            ffn = {r["phase"]: r["bytes"] for r in row["floor_detail"][phase]}["ffn"]
            assert ffn == counted[phase]["ffn"].bytes
        assert counted["verify"]["ffn"].bytes != uniform["verify"]["ffn"].bytes


def test_row_invariant_mode_builds_that_model_and_says_so(monkeypatch, capsys):
    """--row-invariant: the model is built in that mode (the build is stopped there: the mode's GEMMs
    under the interpreter would take minutes), rows carry it and the tables' titles say it; with
    DSASPEC_FP8_FAST_ACCUM it is refused in one line before anything is built."""
    from test_cli import assert_one_line_error

    modes = []

    class Built(Exception):
        pass

    def recorded(*args, **kwargs):
        modes.append(kwargs["row_invariant"])
        raise Built

    monkeypatch.setattr(e2e, "DSAModel", recorded)
    try:
        cli.main(["bench", "e2e", "--row-invariant", "--accept", "3.0"])
    except Built:
        pass
    assert modes == [True]
    args = SimpleNamespace(tp=1, prompt_len=1024, iterations=1, row_invariant=True)
    on = e2e._row("e2e", 3, 4096, "3.0", 1, {"baseline": runs([[10.0]], 1.0), "new": runs([[8.0]], 1.0)}, True,
                  SimpleNamespace(ttft_ms=1.0, capture_s={"baseline": 1.0, "new": 1.0}), True, args,
                  (FloorModel(get_config("e2e"), act_bytes=2), Rates(4000.0, 2.0, 700.0, 1400.0)))
    assert on["row_invariant"] is True and not row(1, ([[10.0]], 1.0), ([[8.0]], 1.0))["row_invariant"]
    assert e2e.upstream_tables([on])[0].startswith("## e2e, row-invariant, S = 3 (EAGLE 3/1/4), KV cache bf16,")
    monkeypatch.setenv("DSASPEC_FP8_FAST_ACCUM", "1")
    assert_one_line_error(capsys, ["bench", "e2e", "--row-invariant"], "--row-invariant", "DSASPEC_FP8_FAST_ACCUM")
    assert modes == [True]
