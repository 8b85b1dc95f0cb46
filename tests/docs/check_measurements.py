#!/usr/bin/env python3
"""Checks that every table of measurements in the given Markdown files names the command that
reproduces it.

Usage:
    check_measurements.py FILE.md...

A table of measurements is a Markdown table with a cell that holds a measured quantity: a number
with a unit of time, size, rate or ratio ("8.4 ms", "2.41 GiB", "1012 images/s", "0.84x",
"+0.54 points"), a bare number under a header that names the quantity ("seconds", "accuracy"),
or a grid of fractions (0.8685 per seed and setting). It names its command when the text under the same heading as the table (the table
included) holds one: a ```sh block, or a code span that runs something (`build/bin/...`,
`paratrain ...`, `bash ...`, `python3 ...`, `perf ...`, an environment assignment before one).
Prints each table that has none as FILE:LINE and exits 1; exits 0 when every table has one.
"""

import re
import sys

UNIT = (r"(?:ns|us|µs|ms|s|seconds|min|minutes|B|KB|KiB|MB|MiB|GB|GiB|TB|images/s|samples/s|"
        r"tokens/s|steps/s|it/s|GB/s|Gbit/s|x|×|%|points|CPU-seconds)")
MEASURE = re.compile(r"(?<![\w.])[-+~]?\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?\s?" + UNIT + r"(?![\w])")
COMMAND = re.compile(r"`(?:[A-Z_]+=\S+\s+)*(?:build(?:-official)?/bin/|paratrain[ -]|bash |"
                     r"python3 |perf |/usr/bin/time |ctest |ninja |cmake |OMP_NUM_THREADS=)")
FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})\s*(\S*)")
# A header cell that names what its column measures; its body cells may then be bare numbers.
MEASURED_HEADER = re.compile(r"\b(?:seconds|ms|GiB|GB|MB|MiB|accuracy|loss|images/s|speed|"
                             r"time|ratio|throughput|bandwidth|memory)\b", re.IGNORECASE)
NUMBER = re.compile(r"^\s*[-+~]?\d+(?:\.\d+)?(?:[-–]\d+(?:\.\d+)?)?(?:\s*\(.*\))?\s*$")
HEADING = re.compile(r"^#{1,6}\s")


def tables(lines):
    """(first line index, rows, section) of each table outside code blocks, where section is the
    text under the same heading as the table (code blocks included, with their info string)."""
    sections, found, fence, i = [[]], [], None, 0
    while i < len(lines):
        line = lines[i]
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            sections[-1].append(f"```{m.group(2)}")
        elif fence is not None:
            if re.match(r"^\s{0,3}" + re.escape(fence[0]) + "{" + str(len(fence)) + r",}\s*$", line):
                fence = None
            sections[-1].append(line)
        elif HEADING.match(line):
            sections.append([])
        elif line.lstrip().startswith("|"):
            start, rows = i, []
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                rows.append(lines[i])
                i += 1
            found.append((start, rows, sections[-1]))  # filled up to the next heading
            sections[-1].append("\n".join(rows))
            continue
        else:
            sections[-1].append(line)
        i += 1
    return found


def names_command(section):
    text = "\n".join(section)
    return "```sh" in text or COMMAND.search(text) is not None


def cells(row):
    """The cells of a table row; an escaped pipe (\\|) stays inside its cell."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


def measured(rows):
    """Whether a body cell holds a quantity with its unit, or a bare number under a header that
    names what is measured ("seconds", "accuracy")."""
    header, body = cells(rows[0]), [cells(r) for r in rows[2:]]
    for row in body:
        for i, cell in enumerate(row):
            if MEASURE.search(cell):
                return True
            if i > 0 and i < len(header) and MEASURED_HEADER.search(header[i]) and NUMBER.match(cell):
                return True
    # A grid of fractions (accuracies per seed and setting) measures too.
    values = [cell for row in body for cell in row[1:]]
    return bool(values) and all(re.match(r"^[-+]?\d*\.\d+$", v) for v in values)


def main(paths):
    if not paths:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        return 2
    missing = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            print(f"check_measurements.py: cannot read {path}: {e}", file=sys.stderr)
            return 1
        for start, rows, section in tables(lines):
            if measured(rows) and not names_command(section):
                missing.append(f"{path}:{start + 1}: a table of measurements names no command "
                               "that reproduces it (a ```sh block or `build/bin/...` under the "
                               "same heading)")
    for m in missing:
        print(m, file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
