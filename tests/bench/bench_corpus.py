"""Agreement of `slurm-medic diagnose --log F --json` with the real corpus's labels, per field.

Runs the product in-process on every sample of `tests/data/real/oom` (146 OOM messages) and
`tests/data/real/logs` (78 multi-rank log excerpts) and prints a markdown table: field,
agree/total, percent. A field the label leaves out counts as agreement only when the product
says nothing there too. `BENCH_CORPUS_DETAIL=1` adds one line per disagreement (file, field,
label, product), e.g. `make bench BENCH=corpus BENCH_CORPUS_DETAIL=1`. `BENCH_CORPUS_DIR=D`
measures another set laid out the same way (`D/oom` and `D/logs`, each with its `labels.toml`):
a held-out set kept outside the tree.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from tests.corpus import Comparison, Measurement, measure, scores

DETAIL_VARIABLE = "BENCH_CORPUS_DETAIL"
DIRECTORY_VARIABLE = "BENCH_CORPUS_DIR"


def table(measurement: Measurement) -> list[str]:
    """The agreement table as markdown lines, with the samples that got no verdict last."""
    answered = measurement.samples - len(measurement.failures)
    lines = [
        "| corpus | field | agree/total | percent | where the text shows it | false claims |",
        "|---|---|---|---|---|---|",
        f"| all | verdict printed (exit 0) | {answered}/{measurement.samples}"
        f" | {100.0 * answered / measurement.samples:.1f}% | | |",
    ]
    for score in scores(measurement.comparisons):
        lines.append(
            f"| {score.corpus} | {score.field} | {score.agree}/{score.total}"
            f" | {score.percent:.1f}% | {score.labelled_agree}/{score.labelled_total}"
            f" ({score.labelled_percent:.1f}%) | {score.false_claims} |"
        )
    return lines


def disagreement(row: Comparison) -> str:
    return f"{row.corpus}/{row.file}  {row.field}  label={row.label!r}  product={row.product!r}"


def main() -> None:
    started = time.perf_counter()
    other = os.environ.get(DIRECTORY_VARIABLE)
    if other:
        root = Path(other)
        measurement = measure(messages_dir=root / "oom", logs_dir=root / "logs")
    else:
        measurement = measure()
    elapsed = time.perf_counter() - started
    print("\n".join(table(measurement)))
    print(f"\n{measurement.samples} samples in {elapsed:.2f} s")
    for file, answer in measurement.failures:
        print(f"no verdict: {file}: exit {answer.exit_code}: {answer.error}")
    if os.environ.get(DETAIL_VARIABLE):
        print("\ndisagreements:")
        for row in measurement.comparisons:
            if not row.agrees:
                print(disagreement(row))


if __name__ == "__main__":
    main()
