#!/usr/bin/env bash
# dsaspec serve measured with SGLang's serving benchmark client (docs/serving.md, "Measuring with
# SGLang's client"): random ids, input = output = LEN tokens, range ratio 1, num-prompts max(6C, 16),
# C warm-up requests first, at each concurrency C; loopback only. Writes
# benchmarks/results/$MACHINE/serving.{json,md}.
#   SGLANG_CLIENT=/tmp/sglang-client MACHINE=h200 PRESET=e2e scripts/bench_serving.sh [serve options...]
# Environment: SGLANG_CLIENT (the client's --target folder, put on PYTHONPATH), PYTHON, PRESET
# (default e2e), MACHINE (default h200), CONCURRENCY (default "1 2 4 8 16 32"), LEN (default 1024),
# PORT (default 30000), WORK (a folder to keep the server log, client outputs and e2e run in;
# default a temporary one, removed at exit), HEALTH_S (seconds to wait for /health, default 1800), CONTEXT (the
# served --context-len, default 1048576). E2E=1: then, with the server stopped, `dsaspec bench e2e`
# at the same preset, context, prompt length and concurrencies (NUM_STEPS draft steps, default 3;
# accept: $DSASPEC_SIMULATE_ACCEPT_LEN, which the server reads too, else the real acceptance), and
# the rows gain the in-process per-token latency and the server's overhead over it. The serve
# options given must decode as bench e2e does (e.g. --speculative-algorithm NEXTN
# --speculative-num-steps 3) for that comparison to mean anything.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
PRESET=${PRESET:-e2e}
MACHINE=${MACHINE:-h200}
CONCURRENCY=${CONCURRENCY:-"1 2 4 8 16 32"}
LEN=${LEN:-1024}
PORT=${PORT:-30000}
HEALTH_S=${HEALTH_S:-1800}
CONTEXT=${CONTEXT:-1048576}
E2E=${E2E:-0}
NUM_STEPS=${NUM_STEPS:-3}
CLIENT_PATH="${SGLANG_CLIENT:+$SGLANG_CLIENT:}$PWD"
if ! PYTHONPATH="$CLIENT_PATH" "$PYTHON" -c "import importlib.util as u, sys; sys.exit(u.find_spec('sglang') is None or u.find_spec('sglang.benchmark.serving') is None)" >/dev/null 2>&1; then
    echo "bench_serving.sh: SGLang's client is not importable (set SGLANG_CLIENT to its pip --target folder; docs/serving.md)" >&2
    exit 2
fi
keep=${WORK:+1}
work=${WORK:-$(mktemp -d)}
mkdir -p "$work"
server=
cleanup() { if [ -n "$server" ]; then kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; fi; [ -n "$keep" ] || rm -rf "$work"; }
trap cleanup EXIT
PYTHONPATH="$PWD" "$PYTHON" -c "
import sys
from dsaspec.configs.model_config import get_config
from dsaspec.testing.tokenizer import build_word_tokenizer
build_word_tokenizer(sys.argv[1], get_config(sys.argv[2]).vocab_size)" "$work/tokenizer" "$PRESET"
max_c=$(printf '%s\n' $CONCURRENCY | sort -n | tail -1)
PYTHONPATH="$PWD" "$PYTHON" -m dsaspec.commands.cli serve --preset "$PRESET" --tokenizer "$work/tokenizer" \
    --host 127.0.0.1 --port "$PORT" --max-batch "$max_c" --context-len "$CONTEXT" "$@" > "$work/server.log" 2>&1 &
server=$!
deadline=$((SECONDS + HEALTH_S))
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
    if ! kill -0 "$server" 2>/dev/null || [ $SECONDS -ge $deadline ]; then
        echo "bench_serving.sh: the server did not become healthy; its log:" >&2; tail -5 "$work/server.log" >&2; exit 1
    fi
    sleep 2
done
for c in $CONCURRENCY; do
    n=$((6 * c > 16 ? 6 * c : 16))
    HF_HUB_OFFLINE=1 PYTHONPATH="$CLIENT_PATH" timeout 3600 "$PYTHON" scripts/sglang_client.py \
        --backend sglang-oai --host 127.0.0.1 --port "$PORT" --tokenizer "$work/tokenizer" \
        --dataset-name random-ids --random-input-len "$LEN" --random-output-len "$LEN" --random-range-ratio 1 \
        --num-prompts "$n" --max-concurrency "$c" --warmup-requests "$c" --disable-tqdm \
        --output-file "$work/c$c.jsonl" > "$work/client-c$c.log" 2>&1 \
        || { echo "bench_serving.sh: the client failed at concurrency $c:" >&2; tail -5 "$work/client-c$c.log" >&2; exit 1; }
done
kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; server=
if [ "$E2E" = 1 ]; then
    PYTHONPATH="$PWD" timeout 3600 "$PYTHON" -m dsaspec.commands.cli bench e2e --presets "$PRESET" \
        --contexts "$CONTEXT" --concurrency "$(printf '%s\n' $CONCURRENCY | paste -sd,)" --prompt-len "$LEN" \
        --num-steps "$NUM_STEPS" --accept "${DSASPEC_SIMULATE_ACCEPT_LEN:-real}" --out "$work/e2e" \
        > "$work/e2e.log" 2>&1 || { echo "bench_serving.sh: bench e2e failed:" >&2; tail -5 "$work/e2e.log" >&2; exit 1; }
fi
mkdir -p "benchmarks/results/$MACHINE"
PYTHONPATH="$PWD" "$PYTHON" - "$work" "benchmarks/results/$MACHINE" "$PRESET" "$LEN" "$CONTEXT" $CONCURRENCY <<'PY'
import json, sys
work, out, preset, length, context, *cs = sys.argv[1:]
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
json.dump({"setup": setup, "rows": rows}, open(f"{out}/serving.json", "w"), indent=2)
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
open(f"{out}/serving.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
