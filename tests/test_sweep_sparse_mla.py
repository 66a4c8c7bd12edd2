"""scripts/sweep_sparse_mla.py: the Markdown it writes beside its JSON."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import sweep_sparse_mla as sweep  # noqa: E402


def _variant(point, name, total, kernels, splits=8):
    return dict(part="variant", point=point, heads=8, variant=name, splits=splits, total_us=total,
                kernels_us=kernels)


def test_sweep_markdown_lists_each_points_variants_from_fastest():
    """A table per point under its copy floor, the variants sorted by op time with op / copy, the
    split kernel's and the combine's µs ('–' for a launch without a combine); failed variants and
    the other point's rows left out."""
    results = [dict(part="empty_kernel", us=0.8),
               dict(part="copy_floor", point="a", heads=8, bytes=1000, us=2.0),
               _variant("a", "slow", 9.0, {"_sparse_mla_decode_kernel": 6.0, "_sparse_mla_combine_kernel": 8.0}),
               _variant("a", "fast", 5.0, {"_sparse_mla_gluon_kernel": 5.0}, splits=1),
               dict(part="variant", point="a", heads=8, variant="broken", error="OutOfResources"),
               dict(part="copy_floor", point="b", heads=8, bytes=2000, us=4.0),
               _variant("b", "only", 6.0, {"_sparse_mla_decode_kernel": 4.0, "_sparse_mla_combine_kernel": 5.5})]
    text = sweep.sweep_markdown(results)
    sections = text.split("## ")[1:]
    assert [s.splitlines()[0] for s in sections] == [
        "a, 8 heads: copy of the gathered bytes 2.00 µs (1000 B)",
        "b, 8 heads: copy of the gathered bytes 4.00 µs (2000 B)"]
    rows_a = [line for line in sections[0].splitlines() if line.startswith("| ") and "variant" not in line]
    assert rows_a == ["| fast | 1 | 5.00 | 2.50 | 5.00 | – |", "| slow | 8 | 9.00 | 4.50 | 6.00 | 8.00 |"]
    assert "broken" not in text and "only" not in sections[0]
    assert "| only | 8 | 6.00 | 1.50 | 4.00 | 5.50 |" in sections[1]
