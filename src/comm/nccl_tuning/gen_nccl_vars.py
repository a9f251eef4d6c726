#!/usr/bin/env python3
"""Turns nccl_vars.tsv (the table of NCCL's variables) into C++.

    gen_nccl_vars.py --input nccl_vars.tsv --output nccl_vars_table.cc

The build runs it (src/comm/nccl_tuning/CMakeLists.txt); the output goes to
the build directory, never into the source tree. Every row is checked, and
the first problems are printed as `nccl_vars.tsv:LINE: NAME: problem` with a
non-zero exit, which fails the build. The columns are described at the top of
nccl_vars.tsv.
"""

import argparse
import re
import sys

COLUMNS = ["name", "type", "range", "values", "case_sensitive", "default", "since", "removed",
           "deprecated", "replacement", "debug", "documented", "out_of_range", "meaning", "source"]
TYPES = {"int": "kInt", "bool": "kBool", "enum": "kEnum", "level": "kLevel", "list": "kList",
         "string": "kString"}
NAME = re.compile(r"^NCCL_[A-Z0-9_]+$")
VERSION = re.compile(r"^2\.(\d{1,2})\.(\d{1,2})$")
BOUND = re.compile(r"^(-?max|-?\d+)$")
INT64_MAX = (1 << 63) - 1


class RowError(Exception):
    pass


def version(text, column):
    """NCCL_VERSION_CODE of "2.MINOR.PATCH"; 0 for an empty field."""
    if text == "":
        return 0
    m = VERSION.match(text)
    if not m:
        raise RowError(f"{column} '{text}' is not a version like 2.18.3")
    return 20000 + int(m.group(1)) * 100 + int(m.group(2))


def bound(text):
    if not BOUND.match(text):
        raise RowError(f"range bound '{text}' is not an integer, max or -max")
    if text.lstrip("-") == "max":
        return -INT64_MAX if text.startswith("-") else INT64_MAX
    value = int(text)
    if abs(value) > INT64_MAX:
        raise RowError(f"range bound {text} does not fit in 64 bits")
    return value


def yes_no(text, column):
    if text not in ("yes", "no"):
        raise RowError(f"{column} '{text}' is not yes or no")
    return text == "yes"


def parse_row(fields):
    """A dict of the row's C++ values; raises RowError."""
    row = dict(zip(COLUMNS, fields))
    if not NAME.match(row["name"]):
        raise RowError(f"name '{row['name']}' is not NCCL_ followed by A-Z, 0-9 and _")
    if row["type"] not in TYPES:
        raise RowError(f"type '{row['type']}' is not one of {', '.join(TYPES)}")
    lo, hi = 1, 0  # min > max: no range
    if row["range"]:
        parts = row["range"].split("..")
        if len(parts) != 2:
            raise RowError(f"range '{row['range']}' is not LO..HI")
        lo, hi = bound(parts[0]), bound(parts[1])
        if lo > hi:
            raise RowError(f"range '{row['range']}' is empty (LO > HI)")
    if row["type"] in ("enum", "level") and not row["values"]:
        raise RowError(f"a {row['type']} needs its values (tokens separated by '|')")
    since = version(row["since"], "since")
    if since == 0:
        raise RowError("since is empty: the first release that reads the variable")
    removed = version(row["removed"], "removed")
    if removed and removed <= since:
        raise RowError(f"removed {row['removed']} is not after since {row['since']}")
    for column in ("meaning", "source"):
        if not row[column]:
            raise RowError(f"{column} is empty")
    return {
        "name": row["name"], "type": TYPES[row["type"]], "min": lo, "max": hi,
        "values": row["values"], "case_sensitive": yes_no(row["case_sensitive"], "case_sensitive"),
        "default": row["default"], "since": since, "removed": removed,
        "deprecated": version(row["deprecated"], "deprecated"), "replacement": row["replacement"],
        "debug": yes_no(row["debug"], "debug"), "documented": yes_no(row["documented"], "documented"),
        "out_of_range": row["out_of_range"], "meaning": row["meaning"], "source": row["source"],
    }


def read_table(path):
    """[(line, row)] of the table, or SystemExit naming every bad line."""
    rows, problems, seen = [], [], {}
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    header_seen = False
    for number, line in enumerate(lines, 1):
        if line.startswith("#") or (line.strip() == "" and not header_seen):
            continue
        fields = line.split("\t")
        name = fields[0] or "(no name)"
        if not header_seen:
            if fields != COLUMNS:
                problems.append(f"{path}:{number}: the header is not the columns "
                                f"{' '.join(COLUMNS)} (tab-separated)")
                break
            header_seen = True
            continue
        try:
            if len(fields) != len(COLUMNS):
                raise RowError(f"{len(fields)} tab-separated fields, expected {len(COLUMNS)}")
            row = parse_row(fields)
            if row["name"] in seen:
                raise RowError(f"listed again (first on line {seen[row['name']]})")
            seen[row["name"]] = number
            rows.append((number, row))
        except RowError as e:
            problems.append(f"{path}:{number}: {name}: {e}")
    if not header_seen and not problems:
        problems.append(f"{path}: no header line")
    for number, row in rows:
        if row["replacement"] and row["replacement"] not in seen:
            problems.append(f"{path}:{number}: {row['name']}: replacement "
                            f"{row['replacement']} is not a row of the table")
    if problems:
        raise SystemExit("\n".join(problems[:20]) + ("\n..." if len(problems) > 20 else ""))
    return rows


def cxx_string(text):
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def cxx_int(value):
    if value == INT64_MAX:
        return "INT64_MAX"
    if value == -INT64_MAX:
        return "-INT64_MAX"
    return f"int64_t{{{value}}}"


def render(rows, source_name):
    out = [f"// Generated from {source_name} by gen_nccl_vars.py at build time; do not edit.",
           "#include <cstdint>", "", '#include "comm/nccl_tuning/nccl_vars.h"', "",
           "namespace strata::nccl_tuning_internal {", "namespace {", "",
           "const NcclVarInfo kTable[] = {"]
    b = lambda v: "true" if v else "false"  # noqa: E731
    for number, r in rows:
        out.append(
            f"    {{{cxx_string(r['name'])}, NcclVarType::{r['type']}, {cxx_int(r['min'])}, "
            f"{cxx_int(r['max'])}, {cxx_string(r['values'])}, {b(r['case_sensitive'])}, "
            f"{cxx_string(r['default'])}, {r['since']}, {r['removed']}, {r['deprecated']}, "
            f"{cxx_string(r['replacement'])}, {b(r['debug'])}, {b(r['documented'])}, "
            f"{cxx_string(r['out_of_range'])}, {cxx_string(r['meaning'])}, "
            f"{cxx_string(r['source'])}}},  // line {number}")
    out += ["};", "", "}  // namespace", "",
            "absl::Span<const NcclVarInfo> NcclVarTable() { return kTable; }", "",
            "}  // namespace strata::nccl_tuning_internal", ""]
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    args = ap.parse_args()
    text = render(read_table(args.input), "nccl_vars.tsv")
    # Rewrite only on change, so that a touched table recompiles nothing.
    try:
        with open(args.output, encoding="utf-8") as f:
            if f.read() == text:
                return
    except FileNotFoundError:
        pass
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(text)


if __name__ == "__main__":
    main()
