#!/usr/bin/env python3
"""The include graph between paratrain's folders, and checks that it points one way and that no
folder reaches into another's private headers.

Usage: scripts/include-graph.py [--dot]

Reads every #include "..." of the library (include/paratrain/AREA, src/AREA), the CLI
(apps/paratrain), the benchmarks (bench) and the tests (tests/support, the rest of tests), maps
each to the folder it names, and prints one line per folder with the folders it includes. Exits 1
naming every include that points up the order below (and so every cycle), and every reach of a
library file (src/):
- a relative path out of the file's folder ("../util/errors.h");
- a private header of another folder (src/AREA/x.h) that is not one of the internal interfaces
  that folder offers (INTERNAL_INTERFACES below);
- a header whose code is built into a library (CMakeLists.txt's add_library and target_sources)
  that the including file's library does not link;
- a library folder whose sources are built into more than one library, or some into none.
Exits 0 otherwise.
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Lowest first; a folder may include only folders before it (and itself). The launcher's library
# (base, store, launch) comes first, since it needs no libtorch and so nothing that does;
# communication comes before io because a checkpoint is collective (ranks agree on the step they
# save).
ORDER = ["base", "store", "launch", "util", "optim", "comm", "io", "data", "amp", "parallel",
         "models", "train", "tune", "umbrella", "cli", "support", "bench", "tests"]
LIBRARY_AREAS = ORDER[:13]

# The private headers a folder offers the others (named from src/), and why they are not public.
INTERNAL_INTERFACES = {
    "base/errors.h": "one line for an error that wraps another (a replica's, a stage's)",
    "util/files.h": "file-system helpers for the library, the benchmarks and the tests",
    "util/strings.h": "starts_with and ends_with (C++17 has neither)",
    "util/copies.h": "a device copy from a thread that reads the tensor next",
    "util/batchnorm.h": "which modules are batch normalisation, for amp and SyncBatchNorm",
    "optim/param_state.h": "the key of a parameter's state in libtorch's optimizers, for the "
                           "fused optimizers and checkpoints",
    "amp/autocast_state.h": "autocast's per-thread flags over libtorch's two APIs",
    "launch/backend_routes.h": "a routed backend's syntax, which the launcher checks and comm "
                               "routes by",
    "store/socket_store.h": "the TCP store the launcher's rendezvous and c10d's backends share",
}

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


def library_targets():
    """{src/.../x.cpp: library} and {library: the libraries it links, itself included}, read
    from CMakeLists.txt's add_library, target_sources and target_link_libraries."""
    with open(os.path.join(ROOT, "CMakeLists.txt"), encoding="utf-8") as fh:
        text = re.sub(r"#[^\n]*", "", fh.read())
    sources, links, merged = {}, {}, {}
    for m in re.finditer(r"(add_library|target_sources|target_link_libraries)\(\s*([a-z_]+)([^)]*)\)",
                         text):
        kind, name, body = m.groups()
        if kind == "target_link_libraries":
            links.setdefault(name, set()).update(body.split())
            continue
        for word in body.split():
            if word.startswith("src/") and word.endswith(".cpp"):
                sources[word] = name
            objects = re.match(r"\$<TARGET_OBJECTS:([a-z_]+)>", word)
            if objects:  # an OBJECT library's code is built into the library that takes it
                merged[objects.group(1)] = name
    sources = {path: merged.get(lib, lib) for path, lib in sources.items()}
    libraries = set(sources.values())
    # A CMakeLists.txt this reading no longer understands must fail, not turn the check off.
    for needed in ("paratrain", "paratrain_launch"):
        if needed not in libraries:
            sys.exit("include-graph: found no sources of library %s in CMakeLists.txt; update "
                     "library_targets()" % needed)
    closure = {}
    for lib in libraries:
        seen, todo = {lib}, [lib]
        while todo:
            for dep in links.get(todo.pop(), ()):
                if dep in libraries and dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        closure[lib] = seen
    return sources, closure


def split_folders(sources):
    """Every library folder whose .cpp files are not all built into one library, and every folder
    of src/ that is not a library folder."""
    found = ["src/%s/ is not in the order of folders (ORDER); add it where its includes put it"
             % d for d in sorted(os.listdir(os.path.join(ROOT, "src")))
             if os.path.isdir(os.path.join(ROOT, "src", d)) and d not in LIBRARY_AREAS]
    for area in LIBRARY_AREAS:
        folder = os.path.join(ROOT, "src", area)
        if not os.path.isdir(folder):
            found.append("src/%s/ is in the order but does not exist" % area)
            continue
        libraries = {}
        for f in sorted(os.listdir(folder)):
            if f.endswith(".cpp"):
                path = "src/%s/%s" % (area, f)
                libraries.setdefault(sources.get(path, "no library"), []).append(path)
        if "no library" in libraries:
            found.append("src/%s/ has sources built into no library: %s"
                         % (area, ", ".join(libraries["no library"])))
        elif not libraries:
            found.append("src/%s/ has no sources to build into a library" % area)
        if len(libraries) > 1:
            found.append("src/%s/ is built into more than one library: %s" % (area, "; ".join(
                "%s (%s)" % (lib, ", ".join(paths)) for lib, paths in sorted(libraries.items()))))
    return found


def library_of(path, sources):
    """The library a src/ file is built into (a header: that of its .cpp); None if none."""
    return sources.get(os.path.splitext(path)[0] + ".cpp")


def reaches(sources, closure):
    """Every include of a src/ file that reaches into another folder's private header."""
    found = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "src")):
        for f in sorted(files):
            if not f.endswith((".h", ".cpp")):
                continue
            path = os.path.relpath(os.path.join(dirpath, f), ROOT)
            mine = library_of(path, sources)
            with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
                for line in fh:
                    m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
                    if not m:
                        continue
                    included = m.group(1)
                    if included.startswith("../") or "/../" in included:
                        found.append("%s: \"%s\" reaches out of its folder by a relative path; "
                                     "name it from src/" % (path, included))
                        continue
                    header = os.path.join("src", included)
                    if "/" not in included or not os.path.exists(os.path.join(ROOT, header)):
                        continue  # its own folder's, or a public header
                    if header.split("/")[1] == path.split("/")[1]:
                        continue
                    if included not in INTERNAL_INTERFACES:
                        found.append("%s: \"%s\" is a private header of %s/, not one it offers "
                                     "(INTERNAL_INTERFACES)" % (path, included,
                                                                header.split("/")[1]))
                        continue
                    theirs = library_of(header, sources)
                    if mine and theirs and theirs not in closure.get(mine, {mine}):
                        found.append("%s: \"%s\" is built into %s, which %s does not link"
                                     % (path, included, theirs, mine))
    return found


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
    sources, closure = library_targets()
    reached = reaches(sources, closure) + split_folders(sources)
    for line in reached:
        print("include-graph: " + line, file=sys.stderr)
    if upward or reached:
        return 1
    print("no include points up the order, so the graph has no cycle; no folder reaches into "
          "another's private headers; each library folder is built into one library")
    return 0


if __name__ == "__main__":
    sys.exit(main())
