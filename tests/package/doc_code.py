#!/usr/bin/env python3
"""Writes the code of one section of a Markdown page into a project folder,
so a test can build exactly what the page shows:

    doc_code.py docs/getting-started.md "5. Use it from C++" <dir>

The section runs from its heading to the next heading of the same or a
higher level. Its ```cmake blocks, in order, become <dir>/CMakeLists.txt and
its ```cpp blocks <dir>/main.cc. Fails when the section or either kind of
block is missing, so a renamed heading cannot turn the test into a no-op."""

import os
import re
import sys


def section(text, heading):
    lines = text.splitlines()
    start = level = None
    for i, line in enumerate(lines):
        m = re.match(r"^(#+)\s+(.*?)\s*$", line)
        if not m:
            continue
        if start is None and m.group(2) == heading:
            start, level = i + 1, len(m.group(1))
        elif start is not None and len(m.group(1)) <= level:
            return lines[start:i]
    if start is None:
        sys.exit(f"doc_code.py: no heading '{heading}'")
    return lines[start:]


def blocks(lines, lang):
    out, current, fence = [], None, None
    for line in lines:
        if current is None:
            m = re.match(r"^(```+)\s*(\S*)\s*$", line)
            if m:
                fence, current = m.group(1), ([] if m.group(2) == lang else False)
        elif line.strip() == fence:
            if current is not False:
                out.append("\n".join(current) + "\n")
            current = None
        elif current is not False:
            current.append(line)
    return out


def main():
    page, heading, outdir = sys.argv[1:4]
    with open(page) as f:
        lines = section(f.read(), heading)
    os.makedirs(outdir, exist_ok=True)
    for lang, name in (("cmake", "CMakeLists.txt"), ("cpp", "main.cc")):
        code = blocks(lines, lang)
        if not code:
            sys.exit(f"doc_code.py: section '{heading}' of {page} has no ```{lang} block")
        with open(os.path.join(outdir, name), "w") as f:
            f.write(f"// From {page}, section '{heading}'.\n" if lang == "cpp" else
                    f"# From {page}, section '{heading}'.\n")
            f.write("\n".join(code))
        print(f"{name}: {len(code)} block(s) from {page}")


if __name__ == "__main__":
    main()
