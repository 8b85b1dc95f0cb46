#!/usr/bin/env python3
"""Compiles each given .cpp file on its own, with its target's flags, as a build without
CMAKE_UNITY_BUILD (an IDE, or a user's own CMake) would: a file that compiles only because another
file of its unity batch included a header for it fails here.

usage: compile-alone.py [--no-pch] BUILD_DIR FILE.cpp...|--all

--no-pch leaves out the precompiled libtorch header that the build forces into every file, so
that a file must include even libtorch's and the standard library's headers itself; --all checks
every source of the build.

The flags come from BUILD_DIR/compile_commands.json: the file's own entry in a build without unity
batches, else the entry of the unity source that includes it (CMake writes unity_N_cxx.cxx files
of #include lines). Each file is checked with -fsyntax-only (what it includes, not code
generation), two at a time. Exit 1 naming the files that failed, with the compiler's errors.
"""
import concurrent.futures
import json
import os
import re
import shlex
import subprocess
import sys


def unity_members(path):
    """The sources a CMake unity source includes, as absolute paths."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return []
    return [os.path.realpath(m) for m in re.findall(r'#include\s+"([^"]+\.(?:cpp|cc|cxx))"', text)]


def commands_by_source(build_dir):
    with open(os.path.join(build_dir, "compile_commands.json")) as f:
        entries = json.load(f)
    by_source = {}
    for e in entries:
        source = os.path.realpath(os.path.join(e["directory"], e["file"]))
        members = unity_members(source) if re.search(r"unity_\d+_cxx\.cxx$", source) else [source]
        for m in members:
            by_source.setdefault(m, (e, source))
    return by_source


def alone_command(entry, unity_source, source, pch):
    """The entry's command for `source` alone, checking syntax only, with no output file."""
    args = shlex.split(entry["command"]) if "command" in entry else list(entry["arguments"])
    out = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a == "-o" or (not pch and a == "-include"):
            skip = True
            continue
        if not pch and a == "-Winvalid-pch":
            continue
        if a in ("-c",) or os.path.realpath(os.path.join(entry["directory"], a)) == unity_source:
            continue
        out.append(a)
    return out + ["-fsyntax-only", source]


def main():
    args = sys.argv[1:]
    pch = "--no-pch" not in args
    args = [a for a in args if a != "--no-pch"]
    if not args:
        print(__doc__, file=sys.stderr)
        return 2
    build_dir = args[0]
    by_source = commands_by_source(build_dir)
    if args[1:] == ["--all"]:
        files = sorted(f for f in by_source if not f.startswith(os.path.realpath(build_dir)))
    else:
        files = [os.path.realpath(f) for f in args[1:]]
    if not files:
        return 0
    jobs = []
    for f in files:
        if f not in by_source:
            print(f"compile-alone: {os.path.relpath(f)} is in no target of {build_dir}: skipped",
                  file=sys.stderr)
            continue
        entry, unity_source = by_source[f]
        jobs.append((f, entry["directory"], alone_command(entry, unity_source, f, pch)))

    def run(job):
        f, directory, cmd = job
        r = subprocess.run(cmd, cwd=directory, capture_output=True, text=True)
        return f, r.returncode, r.stdout + r.stderr

    failed = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        for f, rc, output in pool.map(run, jobs):
            if rc != 0:
                failed.append(os.path.relpath(f))
                sys.stderr.write(output)
    if failed:
        print("compile-alone: these files do not compile on their own (outside a unity batch): "
              + ", ".join(failed) + "; include what each uses", file=sys.stderr)
        return 1
    print(f"compile-alone: {len(jobs)} file(s) compile on their own")
    return 0


if __name__ == "__main__":
    sys.exit(main())
