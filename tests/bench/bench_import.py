"""How well the importer's analysis reads the real sbatch corpus, and what it costs.

Over `tests/data/real/sbatch` (65 scripts, 355 labelled knob values) it prints, per knob and in
all: values read right / labelled, the labelled line among the lines the reading names,
"runtime" labels reported as runtime, checkpoint directories found right where the script
determines them, the claims made where the labels say nothing (a value the script does not
set would be a default in disguise), and the scripts whose analysis failed, with the reason.
The first table reads the scripts as a new user would (no mappings); the second adds the
mappings of a script's own flags that the labels' notes name (`--knob K=FLAG`).

Then the cost: the whole corpus, and synthetic scripts of growing size up to the 1 MB cap (the
reader is linear: the time per KB should stay flat).
`BENCH_IMPORT_DETAIL=1` adds one line per miss. `BENCH_IMPORT_DIR=D` measures another set laid
out the same way (`D/labels.toml` beside the scripts): a held-out set kept outside the tree, read
without mappings (the noted ones name this corpus's files).
"""

from __future__ import annotations

import os
import statistics
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from daemon.importer import Knob, Status, analyse
from daemon.importer.records import MAX_INPUT_CHARS
from tests.importer_corpus import (
    NOTED_MAPPINGS,
    RUNTIME,
    SBATCH_DIR,
    Result,
    ScriptLabel,
    analyse_script,
    line_right,
    load_labels,
    value_right,
)

DETAIL_VARIABLE = "BENCH_IMPORT_DETAIL"
DIRECTORY_VARIABLE = "BENCH_IMPORT_DIR"


@dataclass
class Tally:
    right: Counter[Knob]
    lines: Counter[Knob]
    labelled: Counter[Knob]
    runtime_right: int = 0
    runtime_labelled: int = 0
    checkpoint_right: int = 0
    checkpoint_labelled: int = 0
    extra: int = 0
    extra_runtime: int = 0


def measure(
    labels: tuple[ScriptLabel, ...], mappings: Mapping[str, Mapping[str, Knob]]
) -> tuple[Tally, list[Result], list[str]]:
    tally = Tally(Counter(), Counter(), Counter())
    results = []
    misses = []
    for label in labels:
        result = analyse_script(label, mappings.get(label.file))
        results.append(result)
        if result.analysis is None:
            continue
        labelled = {knob.knob for knob in label.knobs}
        for knob in label.knobs:
            reading = result.analysis.reading(knob.knob)
            tally.labelled[knob.knob] += 1
            right = value_right(knob, reading)
            tally.right[knob.knob] += right
            tally.lines[knob.knob] += line_right(knob, reading, result)
            if knob.value == RUNTIME:
                tally.runtime_labelled += 1
                tally.runtime_right += right
            elif knob.knob is Knob.CHECKPOINT_DIR:
                tally.checkpoint_labelled += 1
                tally.checkpoint_right += right
            if not right:
                misses.append(
                    f"{label.file}  {knob.knob.value}  label={knob.value!r}  "
                    f"read={reading.status.value}:{reading.value!r}"
                )
        for reading in result.analysis.knobs:
            if reading.knob in labelled:
                continue
            if reading.status is Status.FOUND:
                tally.extra += 1
                misses.append(
                    f"{label.file}  {reading.knob.value}  unlabelled, read "
                    f"{reading.value!r} from {reading.reason}"
                )
            elif reading.status is Status.RUNTIME:
                tally.extra_runtime += 1
    return tally, results, misses


def percent(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def table(tally: Tally) -> list[str]:
    lines = ["| knob | values right / labelled | percent | line right |", "|---|---|---|---|"]
    for knob in Knob:
        whole = tally.labelled[knob]
        if whole:
            lines.append(
                f"| {knob.value} | {tally.right[knob]}/{whole} | "
                f"{percent(tally.right[knob], whole)} | {tally.lines[knob]}/{whole} |"
            )
    right, whole = sum(tally.right.values()), sum(tally.labelled.values())
    lines.append(
        f"| **all** | {right}/{whole} | {percent(right, whole)} | "
        f"{sum(tally.lines.values())}/{whole} |"
    )
    lines.append("")
    lines.append(
        f"runtime labels reported as runtime: {tally.runtime_right}/{tally.runtime_labelled}"
    )
    checkpoints = percent(tally.checkpoint_right, tally.checkpoint_labelled)
    lines.append(
        f"checkpoint dirs found right (script determines it): {tally.checkpoint_right}/"
        f"{tally.checkpoint_labelled} ({checkpoints})"
    )
    lines.append(
        f"values claimed where the labels have none: {tally.extra} found, "
        f"{tally.extra_runtime} said to be set at run time"
    )
    return lines


def synthetic(size: int) -> str:
    """A script of about `size` characters: a header, many assignments and flags, one launch."""
    header = "#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --gres=gpu:8\n"
    padding = "--lr 1e-4 --weight_decay 0.01 --warmup 100 " * 4
    block = (
        'V{0}="--flag_{0} {0} ' + padding + '"  # a comment about this flag\n'
        'A{0}=( --x=$V{0} "${{V{0}}}" )\nif [ -n "$V{0}" ]; then W{0}=1; fi\n'
    )
    parts, length, index = [header], len(header), 0
    while length < size - 200:
        piece = block.format(index)
        parts.append(piece)
        length += len(piece)
        index += 1
    parts.append(
        'MBS=4\nexport CMD="train.py --per_device_train_batch_size $MBS"\n'
        'srun bash -c "torchrun $CMD" 2>&1 | tee log\n'
    )
    return "".join(parts)


def timing() -> list[str]:
    lines = []
    for size in (10_000, 100_000, MAX_INPUT_CHARS - 1000):
        script = synthetic(size)
        runs = []
        for _ in range(3):
            started = time.perf_counter()
            analysis = analyse(script)
            runs.append(time.perf_counter() - started)
        median = statistics.median(runs)
        micro = analysis.reading(Knob.MICRO_BATCH).value
        lines.append(
            f"synthetic script {len(script) / 1000:8.0f} KB: {median * 1000:9.1f} ms"
            f"  ({median * 1e6 / len(script) * 1000:.1f} ms/MB, micro-batch read: {micro})"
        )
    return lines


def main() -> None:
    directory = Path(os.environ.get(DIRECTORY_VARIABLE) or SBATCH_DIR)
    noted = NOTED_MAPPINGS if directory == SBATCH_DIR else {}
    labels = load_labels(directory)
    print(f"corpus: {directory}\n")
    started = time.perf_counter()
    tally, results, misses = measure(labels, {})
    elapsed = time.perf_counter() - started
    print("Read as a new user would (no mappings):\n")
    print("\n".join(table(tally)))
    failures = [result for result in results if result.failure is not None]
    print(f"\nanalysis failed: {len(failures)}/{len(results)} scripts")
    for result in failures:
        print(f"  {result.label.file}: {result.failure}")
    mapped, _, mapped_misses = measure(labels, noted)
    print(f"\nWith the mappings the labels' notes name ({len(noted)} script):\n")
    print("\n".join(table(mapped)))
    print(
        f"\n{len(results)} scripts (with the files they name) in {elapsed * 1000:.0f} ms, "
        f"{elapsed * 1000 / len(results):.1f} ms per script"
    )
    print("\n".join(timing()))
    if os.environ.get(DETAIL_VARIABLE):
        print("\nmisses without mappings:")
        print("\n".join(misses) or "  none")
        print("misses with mappings:")
        print("\n".join(mapped_misses) or "  none")


if __name__ == "__main__":
    main()
