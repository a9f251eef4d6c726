"""The code blocks of README.md and docs/*.md, and how each one is tested.

Every fenced block is run as a reader would run it, or it carries a reason
why not. The reason or the way to run it is an HTML comment (invisible on
the rendered page) on the line before the fence:

    <!-- test: skip: the test suite itself -->
    <!-- test: file=train.py -->                    written to train.py, run by a later block
    <!-- test: ranks=4 session=comm -->              python, under plain `mpirun -np 4`
    <!-- test: torchrun=4 -->                        python, under plain torchrun
    <!-- test: run -->                               python, in one process (`python3 x.py`)
    <!-- test: cwd=repo -->                          shell, in the repository root

A shell block (``sh``, ``bash``, ``shell`` or no language) without a comment
runs in bash, as one script, as a reader types it into a terminal. A
``python`` block needs a comment: it says how the reader runs it (``run``,
``ranks=N``, ``torchrun=N``, ``file=NAME``, ``session=S``) or why it is not
run; a new block without one fails the suite with that advice. Any other
language (cpp, cmake, json, text) needs ``file=`` or ``skip:``. Python
blocks of one page with the same ``session`` are joined, in page order, into
one script, as doctest joins the examples of one docstring: a page that
builds ``world`` in one block uses it in the next. One block of a session
(the last, by convention) carries the session's ``ranks``/``torchrun``.
A python block written as an interactive session (``>>>`` prompts) runs
as a doctest: its output must be what the page shows (whitespace
normalised, ``...`` matching anything). Blocks with the same ``file=`` are joined in page order into that file (a
program shown in parts).

Blocks run in a fresh directory (the files of ``file=`` blocks of the page
are written there; HOME is a fresh directory too, so that what a page
writes under ~ stays there), with the environment docs/getting-started.md tells a
reader to set: PYTHONPATH holding the build's Python package; as root, Open
MPI's consent through its environment variables (OMPI_ALLOW_RUN_AS_ROOT),
so that commands run as the page writes them.
"""

import dataclasses
import os
import re

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SHELL_LANGS = {"", "sh", "bash", "shell", "console"}

_FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
_DIRECTIVE = re.compile(r"^\s*<!--\s*test:\s*(.*?)\s*-->\s*$")


@dataclasses.dataclass
class Block:
    page: str           # path relative to the repository root
    line: int           # line of the opening fence (1-based)
    lang: str
    body: str
    skip: str = ""      # the reason, when the block is not run
    file: str = ""      # written to this file instead of being run
    ranks: int = 0      # python under mpirun -np ranks
    torchrun: int = 0   # python under torchrun --nproc-per-node
    session: str = ""
    cwd: str = ""       # "repo" or "" (a fresh directory)
    timeout: int = 600
    run: bool = False   # python in one process
    annotated: bool = False  # a `<!-- test: ... -->` comment precedes it

    @property
    def id(self):
        return f"{self.page}:{self.line}"

    @property
    def is_python(self):
        return self.lang in ("python", "py")

    @property
    def is_shell(self):
        return self.lang in SHELL_LANGS


def parse_directive(text, where):
    """Options of a `<!-- test: ... -->` comment; ValueError names `where`."""
    opts = {}
    if text.startswith("skip"):
        reason = text[4:].lstrip(" :").strip()
        if not reason:
            raise ValueError(f"{where}: 'test: skip' needs a reason ('test: skip: why')")
        return {"skip": reason}
    for word in text.split():
        if word == "run":
            opts["run"] = True
            continue
        if "=" not in word:
            raise ValueError(f"{where}: '{word}' in a test directive is not key=value")
        key, value = word.split("=", 1)
        if key in ("ranks", "torchrun", "timeout"):
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"{where}: {key}={value} must be a positive integer")
            opts[key] = int(value)
        elif key in ("file", "session", "cwd"):
            opts[key] = value
        else:
            raise ValueError(f"{where}: unknown test directive '{key}' (known: skip, run, "
                             "file, ranks, torchrun, session, cwd, timeout)")
    if opts.get("cwd", "repo") != "repo":
        raise ValueError(f"{where}: cwd={opts['cwd']}: only cwd=repo is known")
    return opts


def blocks_of(page):
    """The fenced blocks of one page (path relative to ROOT)."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        lines = f.read().splitlines()
    out = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.group(1), m.group(2).lower()
        start = i
        body = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"{page}:{start + 1}: code block is never closed")
        i += 1
        block = Block(page=page, line=start + 1, lang=lang, body="\n".join(body) + "\n")
        d = _DIRECTIVE.match(lines[start - 1]) if start > 0 else None
        if d:
            block.annotated = True
            for key, value in parse_directive(d.group(1), block.id).items():
                setattr(block, key, value)
        out.append(block)
    return out


def pages():
    docs = sorted(os.path.join("docs", p) for p in os.listdir(os.path.join(ROOT, "docs"))
                  if p.endswith(".md"))
    return ["README.md"] + docs


def all_blocks():
    return [b for p in pages() for b in blocks_of(p)]


def problems(block):
    """Why a block can be neither run nor skipped, or None."""
    if block.skip:
        return None
    if block.file:
        return None
    if not (block.is_python or block.is_shell):
        return (f"{block.id}: a ```{block.lang} block is not run: add '<!-- test: skip: "
                "why -->' on the line before it, or make it runnable")
    if block.is_shell and (block.ranks or block.torchrun or block.run):
        return (f"{block.id}: run/ranks/torchrun apply to python blocks; a shell block runs "
                "as written")
    if block.is_python and not (block.run or block.ranks or block.torchrun or block.session):
        return (f"{block.id}: a ```python block needs a test directive on the line before it "
                "saying how a reader runs it: '<!-- test: run -->' (one process), "
                "'<!-- test: ranks=N -->' (mpirun -np N), '<!-- test: torchrun=N -->', "
                "'<!-- test: file=NAME -->' (a file a later block runs), "
                "'<!-- test: session=S -->' (joined with the page's other blocks of session S), "
                "or '<!-- test: skip: why -->' (see tests/docs/doc_blocks.py)")
    if block.is_python and sum(map(bool, (block.run, block.ranks, block.torchrun))) > 1:
        return f"{block.id}: run, ranks= and torchrun= exclude each other"
    return None


def is_doctest(block):
    """A python block written as an interactive session (``>>>`` prompts):
    it runs as a doctest, its output compared with what the page shows."""
    return block.is_python and block.body.lstrip().startswith(">>> ")


def shell_commands(body):
    """The commands of a shell block: comments dropped, continuation lines
    joined, a leading '$ ' prompt removed."""
    cmds, current = [], ""
    for raw in body.splitlines():
        line = raw.rstrip()
        if line.startswith("$ "):
            line = line[2:]
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            current += line[:-1]  # as bash joins them: the backslash-newline goes
            continue
        cmds.append(current + line)
        current = ""
    if current:
        cmds.append(current)
    return cmds
