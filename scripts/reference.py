#!/usr/bin/env python3
"""Writes, or checks, docs/reference.md: every option of every command, made from the tables the
programs parse their command lines with, and every option struct of the library's headers.

Usage:
    reference.py BIN_DIR [OUT.md]     write the reference (default docs/reference.md)
    reference.py --check BIN_DIR [DOC.md]
                                      fail, naming the difference, when DOC.md is not what
                                      BIN_DIR's programs and the headers give now

The commands come from the programs themselves: `paratrain --help` and `paratrain-bench --help`
list them (and `paratrain data --help` a command's subcommands), and each command's `--help` run
with PARATRAIN_HELP_FORMAT=markdown prints its option table as Markdown. A command whose option
has no help text fails there, naming the option. The library's options are the TORCH_ARG fields
of include/paratrain: each must have a comment (`///` lines above it, or `//` after it), or this
script fails naming the file and line.

Only the standard library; the output depends on nothing but the programs and the headers.
"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADERS = os.path.join(ROOT, "include", "paratrain")
ROW = re.compile(r"^  (\S+)(.*?)(?:\s{2,}(\S.*))?$")


class ReferenceError(Exception):
    pass


def run(command, markdown=False):
    env = dict(os.environ)
    env.pop("PARATRAIN_HELP_FORMAT", None)
    if markdown:
        env["PARATRAIN_HELP_FORMAT"] = "markdown"
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ReferenceError(f"`{' '.join(command[1:])}` failed ({done.returncode}): {last}")
    return done.stdout


def table_rows(help_text):
    """(name, synopsis) of each row of a command table's help (commands.h help_text)."""
    rows = []
    lines = help_text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.endswith(":") and i > 0), None)
    if start is None:
        raise ReferenceError("a command table's help has no heading line")
    for line in lines[start + 1:]:
        if not line.strip():
            break
        m = ROW.match(line)
        if m:
            rows.append((m.group(1), m.group(2).strip()))
    return rows


def command_sections(program, words, synopsis):
    """The Markdown sections of `program words...` and of its subcommands."""
    sections = []
    if synopsis.startswith("<command>"):  # a table of subcommands, no options of its own
        for name, _ in table_rows(run([program] + words + ["--help"])):
            sections.append(run([program] + words + [name, "--help"], markdown=True))
        return sections
    sections.append(run([program] + words + ["--help"], markdown=True))
    # "[opts] | report [opts] | serve [opts]": subcommands beside the command's own options
    for alternative in synopsis.split(" | ")[1:]:
        sections.append(run([program] + words + [alternative.split()[0], "--help"],
                            markdown=True))
    return sections


def cli_reference(bin_dir):
    paratrain = os.path.join(bin_dir, "paratrain")
    bench = os.path.join(bin_dir, "paratrain-bench")
    for p in (paratrain, bench):
        if not os.access(p, os.X_OK):
            raise ReferenceError(f"no program {p}: build first (ninja -C build)")
    out = ["## `paratrain`\n"]
    for name, synopsis in table_rows(run([paratrain, "--help"])):
        if name != "bench":  # the paratrain-bench program, below
            out += command_sections(paratrain, [name], synopsis)
    out.append("## `paratrain bench` (`paratrain-bench`)\n")
    out.append("Every benchmark also takes `--json` (one JSON row per line on stdout) and "
               "`--smoke` (the smallest run through every code path, for tests).\n")
    for name, _ in table_rows(run([bench, "--help"])):
        out.append(run([bench, name, "--help"], markdown=True))
    return out


def doc_above(lines, i):
    """The `///` lines right above line i, without the slashes."""
    text = []
    k = i - 1
    while k >= 0 and lines[k].strip().startswith("///"):
        text.insert(0, lines[k].strip()[3:].strip())
        k -= 1
    return text


def split_call(text):
    """(the arguments, what follows) of `text`, which starts after a call's opening parenthesis:
    the arguments end at the matching one (a type may hold parentheses: std::function<T(A)>)."""
    depth = 1
    for i, c in enumerate(text):
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth == 0:
            return text[:i], text[i + 1:]
    return None, None


def torch_args(path):
    """(line, struct, name, type, default, text) of each TORCH_ARG of the header `path`."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    found, struct, missing = [], None, []
    for i, line in enumerate(lines):
        m = re.match(r"^\s*(?:struct|class)\s+(?:PARATRAIN_\w+\s+)?(\w+)\b[^;]*$", line)
        if m:
            struct = m.group(1)
        if "TORCH_ARG(" not in line or line.lstrip().startswith("//") or "#define" in line:
            continue
        statement, j = line, i
        while ";" not in statement and j + 1 < len(lines):
            j += 1
            statement += " " + lines[j].strip()
        inside, rest = split_call(statement[statement.index("TORCH_ARG(") + len("TORCH_ARG("):])
        m = re.match(r"^\s*(?:=\s*(.*?))?;\s*(?://\s*(.*))?$", rest or "")
        type_, _, name = (inside or "").rpartition(",")
        if not m or not re.match(r"^\w+$", name.strip()):
            raise ReferenceError(f"{path}:{i + 1}: cannot read this TORCH_ARG")
        text = doc_above(lines, i)
        if m.group(2):
            text.append(m.group(2).strip())
        where = os.path.relpath(path, ROOT)
        if not text:
            missing.append(f"{where}:{i + 1}: {struct}::{name.strip()} has no comment")
        found.append((struct, name.strip(), type_.strip(), (m.group(1) or "").strip(),
                      " ".join(text)))
    return found, missing


def code_cell(text):
    """`text` for a code span in a table cell: only the pipes escaped."""
    return text.replace("|", "\\|")


def cell(text):
    """`text` for a table cell: pipes escaped, and outside code spans `<` too (`<rank>` would be
    read as HTML)."""
    out, code = [], False
    for c in text:
        code ^= c == "`"
        out.append("\\|" if c == "|" else "&lt;" if c == "<" and not code else c)
    return "".join(out)


def library_reference():
    out = ["## Library options\n",
           "The option structs of the C++ API, in libtorch's style: each field is set with a "
           "chained setter of its name (`DDPOptions().bucket_cap_mb(50)`) and read with the "
           "same name (`options.bucket_cap_mb()`).\n"]
    missing = []
    for folder, _, files in sorted(os.walk(HEADERS)):
        for file in sorted(files):
            if not file.endswith(".h"):
                continue
            path = os.path.join(folder, file)
            fields, lacking = torch_args(path)
            missing += lacking
            if not fields:
                continue
            out.append(f"### `{os.path.relpath(path, os.path.join(ROOT, 'include'))}`\n")
            struct = None
            for owner, name, type_, default, text in fields:
                if owner != struct:
                    if struct is not None:
                        out.append("")
                    struct = owner
                    out.append(f"`{owner}`\n\n| option | type | default | what it does |\n"
                               "| --- | --- | --- | --- |")
                value = f"`{code_cell(default)}`" if default else "(none)"
                out.append(f"| `{name}` | `{code_cell(type_)}` | {value} | {cell(text)} |")
            out.append("")
    if missing:
        raise ReferenceError("options without a comment (write what each does):\n  " +
                             "\n  ".join(missing))
    return out


def reference(bin_dir):
    head = ("# Reference\n\n"
            "Every option of the `paratrain` and `paratrain-bench` commands and of the library's "
            "option structs. This page is generated from the tables the programs read their "
            "command lines with and from the headers (`python3 scripts/reference.py build/bin`); "
            "a test fails when it differs from them, or when an option has no text. "
            "`paratrain COMMAND --help` prints the same for one command.\n")
    parts = [head] + cli_reference(bin_dir) + library_reference()
    return "\n".join(part.rstrip("\n") + "\n" for part in parts)


def main(argv):
    check = argv[:1] == ["--check"]
    args = argv[1:] if check else argv
    if len(args) not in (1, 2):
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        return 2
    doc = args[1] if len(args) == 2 else os.path.join(ROOT, "docs", "reference.md")
    try:
        text = reference(args[0])
    except (ReferenceError, OSError, subprocess.SubprocessError) as e:
        print(f"reference.py: {e}", file=sys.stderr)
        return 1
    if not check:
        with open(doc + ".tmp", "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(doc + ".tmp", doc)
        return 0
    try:
        with open(doc, encoding="utf-8") as f:
            current = f.read()
    except OSError as e:
        print(f"reference.py: cannot read {doc}: {e}", file=sys.stderr)
        return 1
    if current != text:
        old, new = current.splitlines(), text.splitlines()
        line = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
        print(f"reference.py: {doc} is not what the programs and headers give now (first "
              f"difference at line {line + 1}); regenerate it with "
              f"`python3 scripts/reference.py {args[0]}`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
