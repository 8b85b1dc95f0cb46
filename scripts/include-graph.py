#!/usr/bin/env python3
"""The include graph between paratrain's folders, and a check that it points one way.

Usage: scripts/include-graph.py [--dot]

Reads every #include "..." of the library (include/paratrain/AREA, src/AREA), the CLI
(apps/paratrain), the benchmarks (bench) and the tests (tests/support, the rest of tests), maps
each to the folder it names, and prints one line per folder with the folders it includes. Exits 1
naming every include that points up the order below (and so every cycle), 0 otherwise.
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Lowest first; a folder may include only folders before it (and itself). Communication comes
# before io because a checkpoint is collective (ranks agree on the step they save); launching
# sits right above communication, since it needs only the store, and below everything that
# trains, so that the launcher library needs no libtorch.
ORDER = ["util", "comm", "launch", "io", "data", "amp", "parallel", "models", "train", "tune",
         "umbrella", "cli", "support", "bench", "tests"]
LIBRARY_AREAS = ORDER[:10]

# Headers of the CLI that its own folder's files name without a path.
CLI_HEADERS = {"args.h", "commands.h", "json_line.h", "train_options.h"}
SUPPORT_HEADERS = {"test_util.h", "fake_hosts.h"}
BENCH_HEADERS = {"bench_util.h", "benchmarks.h", "harness.h"}


def folder_of(path):
    """The ORDER entry a source file belongs to; None for files outside the graph."""
    parts = path.split("/")
    if path == "include/paratrain/paratrain.h":  # includes every area but tune/
        return "umbrella"
    if path == "include/paratrain/version.h":
        return "util"
    if parts[0] == "include" and len(parts) > 2 and parts[2] in LIBRARY_AREAS:
        return parts[2]
    if parts[0] == "src" and parts[1] in LIBRARY_AREAS:
        return parts[1]
    if parts[:2] == ["apps", "paratrain"]:
        return "cli"
    if parts[0] == "bench":
        return "bench"
    if parts[:2] == ["tests", "support"]:
        return "support"
    if parts[0] == "tests" and parts[1] not in ("fuzz", "consumer"):
        return "tests"
    return None


def target_of(source_folder, source_path, included):
    """The ORDER entry an #include "included" in source_path names; None if outside."""
    if included == "paratrain/paratrain.h":
        return "umbrella"
    if included == "paratrain/version.h":
        return "util"
    m = re.match(r"paratrain/([a-z_]+)/", included)
    if m and m.group(1) in LIBRARY_AREAS:
        return m.group(1)
    name = os.path.basename(included)
    if name in SUPPORT_HEADERS:
        return "support"
    if name in CLI_HEADERS and source_folder != "cli":
        return "cli"
    if name in BENCH_HEADERS:
        return "bench"
    # A path relative to the file ("../util/errors.h") or to src/ ("util/files.h").
    for base in (os.path.dirname(source_path), "src"):
        candidate = os.path.normpath(os.path.join(base, included))
        if os.path.exists(os.path.join(ROOT, candidate)):
            return folder_of(candidate)
    return None


def edges():
    found = {}
    for top in ("include", "src", "apps", "bench", "tests"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if not f.endswith((".h", ".cpp")):
                    continue
                path = os.path.relpath(os.path.join(dirpath, f), ROOT)
                source = folder_of(path)
                if source is None:
                    continue
                with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
                    for line in fh:
                        m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
                        if not m:
                            continue
                        target = target_of(source, path, m.group(1))
                        if target and target != source:
                            found.setdefault((source, target), []).append(
                                "%s: %s" % (path, m.group(1)))
    return found


def main():
    found = edges()
    if "--dot" in sys.argv:
        print("digraph includes {")
        for (a, b) in sorted(found):
            print('  "%s" -> "%s";' % (a, b))
        print("}")
        return 0
    for folder in ORDER:
        targets = sorted({b for (a, b) in found if a == folder}, key=ORDER.index)
        print("%-9s -> %s" % (folder, ", ".join(targets) if targets else "(nothing)"))
    upward = [(a, b) for (a, b) in found if ORDER.index(b) > ORDER.index(a)]
    for a, b in sorted(upward):
        print("include-graph: %s includes %s, which comes after it in the order (%s): %s"
              % (a, b, " < ".join(ORDER), "; ".join(found[(a, b)][:3])), file=sys.stderr)
    if upward:
        return 1
    print("no include points up the order, so the graph has no cycle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
