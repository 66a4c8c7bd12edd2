#!/usr/bin/env bash
# dsaspec serve measured with SGLang's serving benchmark client (docs/serving.md, "Measuring with
# SGLang's client"): random ids, input = output = LEN tokens, range ratio 1, num-prompts max(6C, 16),
# C warm-up requests first, at each concurrency C; loopback only. Writes
# benchmarks/results/$MACHINE/$NAME.{json,md} (NAME default serving).
#   SGLANG_CLIENT=/tmp/sglang-client MACHINE=h200 PRESET=e2e scripts/bench_serving.sh [serve options...]
# Environment: SGLANG_CLIENT (the client's --target folder, put on PYTHONPATH), PYTHON, PRESET
# (default e2e), MACHINE (default h200), CONCURRENCY (default "1 2 4 8 16 32"), LEN (default 1024),
# PORT (default 30000), WORK (a folder to keep the server log, client outputs and e2e run in;
# default a temporary one, removed at exit), HEALTH_S (seconds to wait for /health, default 1800), CONTEXT (the
# served --context-len, default 1048576), BASELINE (an earlier run's report JSON, the kill switches off: its
# tok/s/user and the speedup join the table). The server's /metrics before and after each client run give
# the engine's side (prefill time a request, TTFT from submission). E2E=1: then, with the server stopped, `dsaspec bench e2e`
# at the same preset, context and concurrencies, prompt E2E_PROMPT_LEN (default LEN + LEN / 2, the mean
# live length over a served request's decode) (NUM_STEPS draft steps, default 3;
# accept: $DSASPEC_SIMULATE_ACCEPT_LEN, which the server reads too, else the real acceptance), and
# the rows gain the in-process per-token latency and the server's overhead over it. The serve
# options given must decode as bench e2e does (e.g. --speculative-algorithm NEXTN
# --speculative-num-steps 3) for that comparison to mean anything.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
PRESET=${PRESET:-e2e}
MACHINE=${MACHINE:-h200}
NAME=${NAME:-serving}
CONCURRENCY=${CONCURRENCY:-"1 2 4 8 16 32"}
LEN=${LEN:-1024}
PORT=${PORT:-30000}
HEALTH_S=${HEALTH_S:-1800}
CONTEXT=${CONTEXT:-1048576}
E2E=${E2E:-0}
NUM_STEPS=${NUM_STEPS:-3}
E2E_PROMPT_LEN=${E2E_PROMPT_LEN:-$((LEN + LEN / 2))}
CLIENT_PATH="${SGLANG_CLIENT:+$SGLANG_CLIENT:}$PWD"
if ! client_error=$(HF_HUB_OFFLINE=1 PYTHONPATH="$CLIENT_PATH" "$PYTHON" scripts/sglang_client.py --help 2>&1 >/dev/null); then
    echo "bench_serving.sh: SGLang's client does not start (set SGLANG_CLIENT to its pip --target folder;" \
         "docs/serving.md): $(printf '%s\n' "$client_error" | tail -n 1)" >&2
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
# the KV pool: max_c requests of LEN + LEN tokens and 64 positions of speculative slack each, in pages
# of 64, plus the reserved page (the default pool, every row at the context's full width, would need
# ~800 GB for 32 rows of 1M); a --num-slots among the serve options wins (the last one given)
num_slots=$((64 * (1 + max_c * ((2 * LEN + 64 + 63) / 64))))
PYTHONPATH="$PWD" "$PYTHON" -m dsaspec.commands.cli serve --preset "$PRESET" --tokenizer "$work/tokenizer" \
    --host 127.0.0.1 --port "$PORT" --max-batch "$max_c" --context-len "$CONTEXT" --num-slots "$num_slots" "$@" > "$work/server.log" 2>&1 &
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
    curl -sf "http://127.0.0.1:$PORT/metrics" > "$work/metrics-c$c-before.txt" || rm -f "$work/metrics-c$c-before.txt"
    HF_HUB_OFFLINE=1 PYTHONPATH="$CLIENT_PATH" timeout 3600 "$PYTHON" scripts/sglang_client.py \
        --backend sglang-oai --host 127.0.0.1 --port "$PORT" --tokenizer "$work/tokenizer" \
        --dataset-name random-ids --random-input-len "$LEN" --random-output-len "$LEN" --random-range-ratio 1 \
        --num-prompts "$n" --max-concurrency "$c" --warmup-requests "$c" --disable-tqdm \
        --output-file "$work/c$c.jsonl" > "$work/client-c$c.log" 2>&1 \
        || { echo "bench_serving.sh: the client failed at concurrency $c:" >&2; tail -5 "$work/client-c$c.log" >&2; exit 1; }
    curl -sf "http://127.0.0.1:$PORT/metrics" > "$work/metrics-c$c-after.txt" || rm -f "$work/metrics-c$c-after.txt"
done
kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; server=
if [ "$E2E" = 1 ]; then
    PYTHONPATH="$PWD" timeout 3600 env -u DSASPEC_SIMULATE_ACCEPT_LEN "$PYTHON" -m dsaspec.commands.cli bench e2e --presets "$PRESET" \
        --contexts "$CONTEXT" --concurrency "$(printf '%s\n' $CONCURRENCY | paste -sd,)" --prompt-len "$E2E_PROMPT_LEN" \
        --num-steps "$NUM_STEPS" --accept "${DSASPEC_SIMULATE_ACCEPT_LEN:-real}" --out "$work/e2e" \
        > "$work/e2e.log" 2>&1 || { echo "bench_serving.sh: bench e2e failed:" >&2; tail -5 "$work/e2e.log" >&2; exit 1; }
fi
mkdir -p "benchmarks/results/$MACHINE"
PYTHONPATH="$PWD" "$PYTHON" scripts/serving_report.py "$work" "benchmarks/results/$MACHINE" "$NAME" "$PRESET" "$LEN" "$CONTEXT" $CONCURRENCY \
    ${BASELINE:+--baseline "$BASELINE"}
