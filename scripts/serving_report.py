"""The serving table of scripts/bench_serving.sh: SGLang's client outputs (``WORK/c<C>.jsonl``), the
server's /metrics around each client run where kept (``WORK/metrics-c<C>-{before,after}.txt``) and,
where ``WORK/e2e/e2e.json`` exists, the in-process ``bench e2e`` figures at the same points and the
server's overhead over them; with ``--baseline`` (an earlier report's JSON, the kill switches off)
the baseline's tok/s/user and the speedup (and both runs' trees). Writes ``OUT/NAME.{json,md,png}`` and prints the Markdown.

    PYTHONPATH=$PWD python3 scripts/serving_report.py WORK OUT NAME PRESET LEN CONTEXT C [C ...] [--baseline FILE]

Per token, the server's median TPOT is compared with bench e2e's new-path latency per token (median
iteration / accept length). So is the median ITL: SGLang's client splits a streamed chunk's gap
evenly over the chunk's tokens when the server reports an accept length, so its ITL is per token;
without an accept length it is per chunk and is compared with the median iteration.
"""
import json
import os

from dsaspec.bench.results import source_commit
from dsaspec.cli_parsing import Parser, parse_or_exit, positive_int


def _parser() -> Parser:
    p = Parser(prog="serving_report.py", description="The serving table of scripts/bench_serving.sh.")
    p.add_argument("work", help="the run's folder: c<C>.jsonl per concurrency, e2e/e2e.json with E2E=1")
    p.add_argument("out", help="the folder NAME.{json,md,png} are written to")
    p.add_argument("name")
    p.add_argument("preset")
    p.add_argument("length", type=positive_int, help="input = output tokens per request")
    p.add_argument("context", type=positive_int, help="the served --context-len")
    p.add_argument("concurrency", type=positive_int, nargs="+")
    p.add_argument("--baseline", default=None, help="the baseline run's report JSON (kill switches off)")
    return p


def _client_row(path: str, concurrency: int) -> dict:
    r = json.loads(open(path).read().splitlines()[-1])
    return {"concurrency": concurrency, "num_prompts": r["completed"],
            "tok_s_user": 1000 / r["median_tpot_ms"], "output_tok_s": r["output_throughput"],
            "median_ttft_ms": r["median_ttft_ms"], "mean_ttft_ms": r["mean_ttft_ms"], "p99_ttft_ms": r["p99_ttft_ms"],
            "median_tpot_ms": r["median_tpot_ms"], "median_itl_ms": r["median_itl_ms"],
            "mean_itl_ms": r["mean_itl_ms"], "p99_itl_ms": r["p99_itl_ms"],
            "accept_length": r.get("accept_length")}


def _metric_values(path: str) -> dict[str, float] | None:
    """The unlabelled samples of a Prometheus text file (name -> value), None if it is missing."""
    if not os.path.exists(path):
        return None
    values = {}
    for line in open(path).read().splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.split()[:2]
            values[name] = float(value)
    return values


def _with_engine_side(row: dict, work: str, concurrency: int) -> None:
    """From the server's /metrics before and after the client run at ``concurrency`` (warm-up
    requests included): the engine's mean prefill time and TTFT (submission to first token) a request."""
    before = _metric_values(f"{work}/metrics-c{concurrency}-before.txt")
    after = _metric_values(f"{work}/metrics-c{concurrency}-after.txt")
    count = "dsaspec_time_to_first_token_seconds_count"
    if before is None or after is None or after[count] == before[count]:
        return
    requests = after[count] - before[count]
    delta = lambda name: after[name] - before[name]   # noqa: E731
    row.update(engine_requests=int(requests),
               engine_prefill_ms=1000 * delta("dsaspec_prefill_seconds_total") / requests,
               engine_ttft_ms=1000 * delta("dsaspec_time_to_first_token_seconds_sum") / requests)


def _with_e2e(row: dict, point: dict) -> None:
    """Adds the in-process figures of ``point`` (a bench e2e row) and the server's overhead."""
    if not point.get("new_tok_s_user"):
        row.update(e2e_ms_per_token=None, e2e_ms_per_iter=None, overhead_tpot=None, overhead_itl=None)
        return
    per_token = 1000 / point["new_tok_s_user"]
    per_itl = per_token if row["accept_length"] else point["new_ms_per_iter"]
    row.update(e2e_ms_per_token=per_token, e2e_ms_per_iter=point["new_ms_per_iter"],
               overhead_tpot=row["median_tpot_ms"] / per_token - 1,
               overhead_itl=row["median_itl_ms"] / per_itl - 1)


def _plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    cs = [r["concurrency"] for r in rows]
    ax.plot(cs, [r["tok_s_user"] for r in rows], "o-", label="dsaspec serve (new)")
    base = [(r["concurrency"], r["baseline_tok_s_user"]) for r in rows if r.get("baseline_tok_s_user")]
    if base:
        ax.plot(*zip(*base), "s--", label="dsaspec serve (baseline)")
    e2e = [(r["concurrency"], 1000 / r["e2e_ms_per_token"]) for r in rows if r.get("e2e_ms_per_token")]
    if e2e:
        ax.plot(*zip(*e2e), "^:", label="in-process bench e2e (new)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(cs, [str(c) for c in cs])
    ax.set_xlabel("concurrency")
    ax.set_ylabel("tok/s/user (1000 / median TPOT)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _markdown(rows: list[dict], preset: str, length: int, e2e_prompt_len, commit=None, baseline_commit=None) -> str:
    lines = [f"# dsaspec serve, {preset}: SGLang's client, input {length} / output {length}", "",
             "| C | tok/s/user | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | accept |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        acc = "-" if r["accept_length"] is None else f"{r['accept_length']:.2f}"
        lines.append(f"| {r['concurrency']} | {r['tok_s_user']:.1f} | {r['output_tok_s']:.1f} | "
                     f"{r['median_ttft_ms']:.1f} | {r['p99_ttft_ms']:.1f} | {r['median_itl_ms']:.2f} | "
                     f"{r['p99_itl_ms']:.2f} | {acc} |")
    pct = lambda v: "-" if v is None else f"{100 * v:+.1f}%"   # noqa: E731
    ms = lambda v: "-" if v is None else f"{v:.2f}"            # noqa: E731
    if any("baseline_tok_s_user" in r for r in rows):
        trees = (f" (baseline tree {baseline_commit or 'not recorded'}, this run's {commit or 'not recorded'}"
                 + ("" if commit and commit == baseline_commit else
                    ": not the same tree, so the speedup also holds what changed between them") + ")")
        lines += ["", f"Baseline (kill switches off) vs new, the same client and method{trees}:", "",
                  "| C | baseline tok/s/user | new tok/s/user | speedup | baseline ITL p50 ms | new ITL p50 ms | "
                  "ITL speedup |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {r['concurrency']} | {r['baseline_tok_s_user']:.1f} | {r['tok_s_user']:.1f} | "
                  f"{r['speedup']:.3f} | {ms(r.get('baseline_median_itl_ms'))} | {r['median_itl_ms']:.2f} | "
                  f"{'-' if r.get('itl_speedup') is None else format(r['itl_speedup'], '.3f')} |"
                  for r in rows if "baseline_tok_s_user" in r]
    if any("overhead_itl" in r for r in rows):
        mean = ", the mean live length over a served request's decode" if e2e_prompt_len == length + length // 2 else ""
        lines += ["", f"In-process (`dsaspec bench e2e`, new path, prompt {e2e_prompt_len} tokens{mean}) at the same "
                  "points, and the server's overhead per token:", "",
                  "| C | e2e ms/token | e2e ms/iteration | server TPOT p50 / e2e - 1 | server ITL p50 / e2e - 1 | "
                  "stalls ms/token (ITL mean - p50) |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {r['concurrency']} | {ms(r.get('e2e_ms_per_token'))} | {ms(r.get('e2e_ms_per_iter'))} | "
                  f"{pct(r.get('overhead_tpot'))} | {pct(r.get('overhead_itl'))} | "
                  f"{r['mean_itl_ms'] - r['median_itl_ms']:.2f} |"
                  for r in rows if "overhead_itl" in r]
        lines += ["", "TPOT holds every gap of a request's decode, the other requests' prefills among them (an "
                  "admitted request is prefilled before the next iteration, whole, eagerly); the in-process loop "
                  "prefills its rows before it times them. The median ITL is the steady iteration, so the server's "
                  "own overhead is the ITL column; the stalls column is what the prefills add to a token on average."]
    if any("engine_ttft_ms" in r for r in rows):
        lines += ["", "The engine's side (the server's /metrics over each client run, its warm-up requests included): "
                  "prefill time a request (every running request waits for it) and TTFT from the request's "
                  "submission to the engine, against the client's mean TTFT (the difference: HTTP, text and the "
                  "handoff to the engine):", "",
                  "| C | requests | engine prefill ms a request | engine TTFT mean ms | client TTFT mean ms |",
                  "| ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {r['concurrency']} | {r['engine_requests']} | {r['engine_prefill_ms']:.1f} | "
                  f"{r['engine_ttft_ms']:.1f} | {r['mean_ttft_ms']:.1f} |" for r in rows if "engine_ttft_ms" in r]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = parse_or_exit(_parser(), argv)
    e2e, e2e_prompt_len = {}, None
    try:
        report = json.load(open(f"{args.work}/e2e/e2e.json"))
        e2e = {r["concurrency"]: r for r in report["rows"]
               if r["preset"] == args.preset and r["context"] == args.context}
        e2e_prompt_len = report["params"].get("prompt_len")
    except FileNotFoundError:
        pass
    baseline, baseline_commit = {}, None
    if args.baseline is not None:
        report = json.load(open(args.baseline))
        baseline = {r["concurrency"]: r for r in report["rows"]}
        baseline_commit = report["setup"].get("commit")
    commit = source_commit()
    rows = []
    for c in args.concurrency:
        row = _client_row(f"{args.work}/c{c}.jsonl", c)
        _with_engine_side(row, args.work, c)
        if c in e2e:
            _with_e2e(row, e2e[c])
        if c in baseline:
            base_itl = baseline[c].get("median_itl_ms")
            row.update(baseline_tok_s_user=baseline[c]["tok_s_user"],
                       speedup=row["tok_s_user"] / baseline[c]["tok_s_user"], baseline_median_itl_ms=base_itl,
                       itl_speedup=None if base_itl is None else base_itl / row["median_itl_ms"])
        rows.append(row)
    setup = {"preset": args.preset, "input_len": args.length, "output_len": args.length,
             "context": args.context, "e2e_prompt_len": e2e_prompt_len, "commit": commit,
             "baseline": args.baseline, "baseline_commit": baseline_commit,
             "client": "sglang 0.5.23 bench_serving, backend sglang-oai, dataset random-ids, range ratio 1, "
                       "num-prompts max(6C, 16), C warm-up requests",
             "overhead": "with E2E=1: overhead_tpot = median TPOT / bench e2e's new ms per token - 1 (includes "
                         "the stalls of other requests' prefills); overhead_itl = median ITL / the same - 1 (the "
                         "client's ITL is per token when the server reports an accept length, else per chunk: "
                         "then against the median iteration)"}
    os.makedirs(args.out, exist_ok=True)
    json.dump({"setup": setup, "rows": rows}, open(f"{args.out}/{args.name}.json", "w"), indent=2)
    text = _markdown(rows, args.preset, args.length, e2e_prompt_len, commit, baseline_commit)
    open(f"{args.out}/{args.name}.md", "w").write(text)
    _plot(rows, f"{args.out}/{args.name}.png", f"dsaspec serve, {args.preset}, {args.length} in / out")
    print(text, end="")


if __name__ == "__main__":
    main()
