"""The serving table of scripts/bench_serving.sh: SGLang's client outputs (``WORK/c<C>.jsonl``) and,
where ``WORK/e2e/e2e.json`` exists, the in-process ``bench e2e`` figures at the same points and the
server's overhead over them; writes ``OUT/NAME.{json,md}`` and prints the Markdown.

    python3 scripts/serving_report.py WORK OUT NAME PRESET LEN CONTEXT C [C ...]
"""
import json
import sys

work, out, name, preset, length, context, *cs = sys.argv[1:]
e2e = {}
try:
    e2e = {r["concurrency"]: r for r in json.load(open(f"{work}/e2e/e2e.json"))["rows"]
           if r["preset"] == preset and r["context"] == int(context)}
except FileNotFoundError:
    pass
rows = []
for c in cs:
    r = json.loads(open(f"{work}/c{c}.jsonl").read().splitlines()[-1])
    rows.append({"concurrency": int(c), "num_prompts": r["completed"],
                 "tok_s_user": 1000 / r["median_tpot_ms"], "output_tok_s": r["output_throughput"],
                 "median_ttft_ms": r["median_ttft_ms"], "p99_ttft_ms": r["p99_ttft_ms"],
                 "median_tpot_ms": r["median_tpot_ms"], "median_itl_ms": r["median_itl_ms"],
                 "p99_itl_ms": r["p99_itl_ms"], "accept_length": r.get("accept_length")})
    point = e2e.get(int(c)) or {}
    if point.get("new_tok_s_user"):   # in-process: per token = median iteration / accept; one chunk per iteration
        e2e_token_ms = 1000 / point["new_tok_s_user"]
        rows[-1].update(e2e_ms_per_token=e2e_token_ms, e2e_ms_per_iter=point["new_ms_per_iter"],
                        overhead_tpot=r["median_tpot_ms"] / e2e_token_ms - 1,
                        overhead_itl=r["median_itl_ms"] / point["new_ms_per_iter"] - 1)
    elif point:
        rows[-1].update(e2e_ms_per_token=None, e2e_ms_per_iter=None, overhead_tpot=None, overhead_itl=None)
setup = {"preset": preset, "input_len": int(length), "output_len": int(length), "client": "sglang 0.5.23 bench_serving, "
         "backend sglang-oai, dataset random-ids, range ratio 1, num-prompts max(6C, 16), C warm-up requests",
         "overhead": "with E2E=1: overhead_tpot = median TPOT / (1000 / bench e2e's new tok/s/user) - 1 (includes "
         "the stalls of other requests' prefills); overhead_itl = median ITL / bench e2e's median iteration - 1 "
         "(a streamed chunk per iteration)"}
json.dump({"setup": setup, "rows": rows}, open(f"{out}/{name}.json", "w"), indent=2)
lines = [f"# dsaspec serve, {preset}: SGLang's client, input {length} / output {length}", "",
         "| C | tok/s/user | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | accept |",
         "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
for r in rows:
    acc = "-" if r["accept_length"] is None else f"{r['accept_length']:.2f}"
    lines.append(f"| {r['concurrency']} | {r['tok_s_user']:.1f} | {r['output_tok_s']:.1f} | {r['median_ttft_ms']:.1f} | "
                 f"{r['p99_ttft_ms']:.1f} | {r['median_itl_ms']:.2f} | {r['p99_itl_ms']:.2f} | {acc} |")
if any("overhead_itl" in r for r in rows):
    pct = lambda v: "-" if v is None else f"{100 * v:+.1f}%"
    ms = lambda v: "-" if v is None else f"{v:.2f}"
    lines += ["", "In-process (`dsaspec bench e2e`, new path) at the same points, and the server's overhead:", "",
              "| C | e2e ms/token | e2e ms/iteration | server TPOT p50 / e2e - 1 | server ITL p50 / e2e iteration - 1 |",
              "| ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['concurrency']} | {ms(r.get('e2e_ms_per_token'))} | {ms(r.get('e2e_ms_per_iter'))} | "
              f"{pct(r.get('overhead_tpot'))} | {pct(r.get('overhead_itl'))} |" for r in rows if "overhead_itl" in r]
open(f"{out}/{name}.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
