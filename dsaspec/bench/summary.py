"""Print the README's result tables from the committed JSON results (no number is typed by hand).

    python3 -m dsaspec.bench.summary [benchmarks/results/h200]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dsaspec.bench.results import RESULTS_ROOT


def _pivot(rows: list[dict], row_keys: tuple[str, ...], col_key: str, cell) -> tuple[list, list, dict]:
    cols = sorted({r[col_key] for r in rows})
    groups: dict = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in row_keys), {})[r[col_key]] = cell(r)
    return list(groups), cols, groups


def _table(title: str, headers: list[str], cols: list, keys: list, groups: dict, col_label: str) -> str:
    lines = [title, "", "| " + " | ".join(headers + [f"{col_label} {c}" for c in cols]) + " |",
             "|" + "---|" * (len(headers) + len(cols))]
    for key in keys:
        lines.append("| " + " | ".join([str(k) for k in key] + [groups[key].get(c, "–") for c in cols]) + " |")
    return "\n".join(lines)


def arrow(r: dict) -> str:
    return f"{r['baseline_us']:.1f} → {r['new_us']:.1f}"


def summarize(folder: Path) -> str:
    """Markdown tables (seed format: baseline → new, µs) for every result JSON in ``folder``."""
    parts = []
    path = folder / "metadata.json"
    if path.exists():
        rows = json.loads(path.read_text())["rows"]
        keys, cols, groups = _pivot(rows, ("op", "live_kv"), "bs", arrow)
        parts.append(_table("Replay metadata, 1M-token table, 5 verify rows per request: context-wide → bounded (µs)",
                            ["op", "live KV"], cols, keys, groups, "bs"))
    path = folder / "draft_metadata.json"
    if path.exists():
        rows = json.loads(path.read_text())["rows"]
        keys, cols, groups = _pivot(rows, ("step_backends", "live_kv"), "bs",
                                    lambda r: f"{arrow(r)} ({r['shared_us']:.1f})")
        parts.append(_table("MTP draft-decode metadata: precompute + copies → one launch (shared buffer set) (µs)",
                            ["step backends", "live KV"], cols, keys, groups, "bs"))
    path = folder / "draft_step.json"
    if path.exists():
        rows = json.loads(path.read_text())["rows"]
        keys, cols, groups = _pivot(rows, ("tp", "transport"), "rows", arrow)
        parts.append(_table("Draft step (LM head + top-1), vocab 154880, hidden 6144: logits gather → partials exchange "
                            "(µs, max over ranks)", ["TP", "transport"], cols, keys, groups, "rows"))
    path = folder / "decode.json"
    if path.exists():
        rows = json.loads(path.read_text())["rows"]
        keys, cols, groups = _pivot(rows, ("context_len",), "bs",
                                    lambda r: f"{r['baseline_us'] / 1e3:.2f} → {r['new_us'] / 1e3:.2f}")
        parts.append(_table("Runtime decode TPOT (ms), bench preset (GLM-5 attention and vocab, 2 layers), 1k live "
                            "tokens: context-wide → bounded metadata", ["context configured"], cols, keys, groups, "bs"))
        short = min(r["context_len"] for r in rows)
        ref = {r["bs"]: r for r in rows if r["context_len"] == short}
        ratio_rows = [dict(r, ratio=f"{r['baseline_us'] / ref[r['bs']]['baseline_us']:.2f} / "
                                    f"{r['new_us'] / ref[r['bs']]['new_us']:.2f}")
                      for r in rows if r["context_len"] != short]
        keys, cols, groups = _pivot(ratio_rows, ("context_len",), "bs", lambda r: r["ratio"])
        parts.append(_table(f"TPOT with a larger context configured over TPOT with {short} configured "
                            "(context-wide / bounded)", ["context configured"], cols, keys, groups, "bs"))
    for name, tp in (("e2e", 1), ("e2e_tp2", 2)):
        path = folder / f"{name}.json"
        if not path.exists():
            continue
        rows = json.loads(path.read_text())["rows"]
        for preset in dict.fromkeys(r["preset"] for r in rows):
            mine = [r for r in rows if r["preset"] == preset]
            keys, cols, groups = _pivot(mine, ("context", "accept"), "concurrency",
                                        lambda r: f"{r['baseline_tok_s_user']:.0f} → {r['new_tok_s_user']:.0f} "
                                                  f"({r['speedup']:.2f}x)")
            parts.append(_table(f"MTP speculative decoding end to end, TP {tp}, `{preset}` preset, S = 3: tok/s/user, "
                                "baseline (kill switches off) → new", ["context configured", "accept length"],
                                cols, keys, groups, "concurrency"))
    path = folder / "verify_step.json"
    if path.exists():
        rows = json.loads(path.read_text())["rows"]
        keys, cols, groups = _pivot(rows, ("tp", "step"), "rows", arrow)
        parts.append(_table("Target verify (LM head + greedy token per row) and top-4 + probabilities, vocab 154880, "
                            "hidden 6144: logits gather → partials exchange (µs, max over ranks)", ["TP", "step"],
                            cols, keys, groups, "rows"))
    path = folder / "dsa_ops.json"
    if path.exists():
        rows = [r for r in json.loads(path.read_text())["rows"] if r["op"] != "layer"]
        keys, cols, groups = _pivot(rows, ("op", "mode", "live_kv"), "bs",
                                    lambda r: f"{r['baseline_us']:.1f} → {r['new_us']:.1f}")
        parts.append(_table("DSA decode ops per layer, GLM-5 shapes: previous kernels → new (µs)",
                            ["op", "mode", "live KV"], cols, keys, groups, "bs"))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    folder = Path(argv[0]) if argv else RESULTS_ROOT / "h200"
    print(summarize(folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
