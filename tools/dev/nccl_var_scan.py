#!/usr/bin/env python3
"""Reproduces the since/removed columns of strata's NCCL variable table
(src/comm/nccl_tuning/nccl_vars.tsv) from a checkout of github.com/NVIDIA/nccl.

For every release tag v2.X.Y-Z it lists the environment variables NCCL's
source reads: NCCL_PARAM(name, "ENV", default), DEFINE_NCCL_PARAM (2.30+),
ncclGetEnv("NCCL_..."), getenv("NCCL_..."), ncclGetLevel(...) and
getNthreads("NCCL_..."). A variable is "introduced" in the first tag that
reads it and "removed" in the first later tag that no longer does.

    python3 tools/dev/nccl_var_scan.py /path/to/nccl > scan.tsv

Output: name, first tag, removed-in tag (empty if still read), default as
written in the source, and the file that reads it in the newest tag. The
table in strata also takes facts from NCCL's documentation (ranges,
"Debugging" section, deprecations); this script covers the source side only.
"""

import re
import subprocess
import sys

PATTERNS = [
    re.compile(r'NCCL_PARAM\(\s*\w+\s*,\s*"([A-Z0-9_]+)"\s*,\s*([^;\n]*)\)'),
    re.compile(r'DEFINE_NCCL_PARAM\(\s*\w+\s*,\s*[^,]+,\s*(NCCL_[A-Z0-9_]+)\s*,'),
    re.compile(r'(?:ncclGetEnv|getenv|getEnvFunc)\(\s*"(NCCL_[A-Z0-9_]+)"'),
    re.compile(r'ncclGetLevel\(\s*&\w+\s*,\s*(?:"(NCCL_[A-Z0-9_]+)"|NULL)\s*,\s*"(NCCL_[A-Z0-9_]+)"'),
    re.compile(r'getNthreads\(\s*"(NCCL_[A-Z0-9_]+)"'),
]
GREP = r'NCCL_PARAM\(|ncclGetEnv\("|getenv\("NCCL|getEnvFunc\("|ncclGetLevel\(|getNthreads\("'


def tags(repo):
    out = subprocess.check_output(["git", "-C", repo, "tag"], text=True).split()
    rel = [t for t in out if re.match(r"v2\.\d+\.\d+-\d+$", t)]
    return sorted(rel, key=lambda t: tuple(map(int, re.findall(r"\d+", t))))


def scan(repo, tag):
    out = subprocess.run(["git", "-C", repo, "grep", "-nE", GREP, tag, "--", "src"],
                         capture_output=True, text=True).stdout
    found = {}
    for line in out.splitlines():
        _, path, _, code = line.split(":", 3)
        m = PATTERNS[0].search(code)
        if m:
            found.setdefault("NCCL_" + m.group(1), (m.group(2).strip(), path))
            continue
        for p in PATTERNS[1:]:
            for m in p.finditer(code):
                for g in m.groups():
                    if g:
                        found.setdefault(g, ("", path))
    return found


def main():
    repo = sys.argv[1]
    ts = tags(repo)
    per_tag = {t: scan(repo, t) for t in ts}
    names = sorted(set().union(*per_tag.values()))
    for n in names:
        present = [i for i, t in enumerate(ts) if n in per_tag[t]]
        first, last = present[0], present[-1]
        removed = ts[last + 1] if last + 1 < len(ts) else ""
        default, path = per_tag[ts[last]][n]
        print("\t".join([n, ts[first], removed, default, path]))


if __name__ == "__main__":
    main()
