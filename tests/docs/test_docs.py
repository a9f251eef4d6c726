"""Every code block of README.md and docs/*.md runs as written, or says why not.

Python blocks run as scripts (joined per session, see doc_blocks.py) in one
process or under the launchers with their default flags: plain
`mpirun -np N` (plus --oversubscribe when N exceeds the cores, as the pages
say) and plain `torchrun --standalone --nproc-per-node N`. As root, Open MPI's
consent comes from its environment variables, not from a flag, so that
mpirun lines of the pages run as written. Shell blocks run command by
command in bash. A failure shows the page and line of the block.

$STRATA_DOCS_PAGES (page paths separated by spaces, e.g. "README.md
docs/getting-started.md") limits the blocks run to those pages; CTest runs
one test per page that way (tests/docs/CMakeLists.txt). The checks of the
annotations and of the parser always cover every page.
"""

import os
import re
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import doc_blocks as D  # noqa: E402

BUILD_PYTHON = os.environ.get("STRATA_DOCS_PYTHONPATH",
                              os.path.join(D.ROOT, "build", "python"))


def _selected_pages():
    wanted = os.environ.get("STRATA_DOCS_PAGES", "").split()
    known = D.pages()
    unknown = [p for p in wanted if p not in known]
    if unknown:
        raise ValueError(f"STRATA_DOCS_PAGES names {unknown}, which are not pages "
                         f"(pages: {known})")
    return wanted or known


def _units():
    """(id, page, blocks) of what runs: a standalone python or shell block,
    or all python blocks of a session."""
    units = []
    for page in _selected_pages():
        sessions = {}
        for b in D.blocks_of(page):
            if b.skip or b.file or D.problems(b):
                continue
            if b.is_python and b.session:
                if b.session not in sessions:
                    sessions[b.session] = []
                    units.append((f"{page}#{b.session}", page, sessions[b.session]))
                sessions[b.session].append(b)
            else:
                units.append((b.id, page, [b]))
    return units


UNITS = _units()


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = BUILD_PYTHON + (os.pathsep + env["PYTHONPATH"]
                                        if env.get("PYTHONPATH") else "")
    env.pop("MAKEFLAGS", None)  # a make the page shows is not a sub-make of ctest's caller
    env.pop("MFLAGS", None)
    if os.geteuid() == 0:
        # Open MPI's consent to run as root, as its environment variables:
        # the pages' mpirun lines stay as a (non-root) reader types them.
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def _mpirun_flags(n):
    flags = []
    if n > (os.cpu_count() or 1):
        flags.append("--oversubscribe")
    return flags


def _launch(block, script):
    if block.ranks:
        return ["mpirun", *_mpirun_flags(block.ranks), "-np", str(block.ranks), sys.executable,
                script]
    if block.torchrun:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(block.torchrun), script]
    return [sys.executable, script]


def _run(cmd, cwd, env, timeout, what):
    try:
        r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                           timeout=timeout, shell=isinstance(cmd, str),
                           executable="/bin/bash" if isinstance(cmd, str) else None)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"")[-4000:] if isinstance(e.stdout, bytes) else (e.stdout or "")[-4000:]
        pytest.fail(f"{what}: did not finish within {timeout} s (a hang?); output so far:\n{out}")
    out = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, f"{what}: exit {r.returncode}:\n{out}"
    return r


def _write_files(page, where):
    """The page's file= blocks, those naming one file joined in page order."""
    files = {}
    for b in D.blocks_of(page):
        if b.file and not b.skip:
            files[b.file] = files.get(b.file, "") + b.body
    for name, text in files.items():
        path = os.path.join(where, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


def test_selected_pages_have_blocks_to_run():
    # A page's test that runs nothing would pass without testing anything.
    if os.environ.get("STRATA_DOCS_PAGES"):
        assert UNITS, (f"STRATA_DOCS_PAGES={os.environ['STRATA_DOCS_PAGES']}: these pages have "
                       "no block to run (all skipped or file=); drop the test or the skips")


def test_every_block_runs_or_says_why():
    found = [p for p in (D.problems(b) for b in D.all_blocks()) if p]
    assert not found, "\n".join(found)


def test_skips_that_point_to_a_tested_block_point_to_one():
    # "same commands as docs/x.md:46, tested there": that block must exist and run.
    blocks = {b.id: b for b in D.all_blocks()}
    for b in blocks.values():
        for ref in re.findall(r"\b((?:README\.md|docs/[\w.-]+\.md):\d+)\b", b.skip):
            other = blocks.get(ref)
            assert other is not None, f"{b.id}: its skip reason names {ref}, which is not a block"
            assert not other.skip, f"{b.id}: its skip reason names {ref}, which is skipped too"


def test_sessions_declare_their_launcher_once():
    for page in D.pages():
        launchers = {}
        for b in D.blocks_of(page):
            if b.is_python and b.session and not b.skip and (b.ranks or b.torchrun):
                launchers.setdefault(b.session, []).append(b.id)
        for session, ids in launchers.items():
            assert len(ids) == 1, f"{page} session {session}: ranks/torchrun given at {ids}"


@pytest.mark.parametrize("uid,page,blocks", UNITS, ids=[u[0] for u in UNITS])
def test_block_runs_as_written(tmp_path, uid, page, blocks):
    _write_files(page, tmp_path)
    env = _env()
    # What a page puts under ~ (`mkdir -p ~/first-job`) stays in the test's directory.
    env["HOME"] = str(tmp_path / "home")
    os.makedirs(env["HOME"])
    first = blocks[0]
    if first.is_python:
        launcher = next((b for b in blocks if b.ranks or b.torchrun), first)
        script = tmp_path / "doc_block.py"
        if D.is_doctest(first):
            # An interactive session (`>>>` lines): its output is compared, as doctest does.
            script.write_text(_DOCTEST.format(text=repr(first.body), name=repr(first.id)),
                              encoding="utf-8")
        else:
            script.write_text("".join(
                f"# ---- {b.id}\n{b.body}" for b in blocks), encoding="utf-8")
        _run(_launch(launcher, str(script)), str(tmp_path), env,
             max(b.timeout for b in blocks), f"{uid} ({' + '.join(b.id for b in blocks)})")
        return
    cwd = D.ROOT if first.cwd == "repo" else str(tmp_path)
    # One bash for the block, so that `export`, `cd` and variables carry from
    # line to line as in the reader's terminal; each command is echoed so a
    # failure names it.
    lines = ["set -e"]
    for cmd in D.shell_commands(first.body):
        lines.append(f"echo {_quote('+ ' + cmd)} >&2")
        lines.append(cmd)
    _run("\n".join(lines), cwd, env, first.timeout, f"{uid}")


_DOCTEST = """import doctest, sys
test = doctest.DocTestParser().get_doctest({text}, {{}}, {name}, {name}, 0)
runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
runner.run(test)
sys.exit(1 if runner.failures else 0)
"""


def _quote(s):
    return "'" + s.replace("'", "'\"'\"'") + "'"


# ---- the parser itself ------------------------------------------------------


def test_directives_parse_and_reject_what_they_do_not_know():
    assert D.parse_directive("skip: the suite itself", "x") == {"skip": "the suite itself"}
    assert D.parse_directive("ranks=4 session=a", "x") == {"ranks": 4, "session": "a"}
    with pytest.raises(ValueError, match="needs a reason"):
        D.parse_directive("skip", "p:3")
    with pytest.raises(ValueError, match="unknown test directive 'rank'"):
        D.parse_directive("rank=4", "p:3")
    with pytest.raises(ValueError, match="ranks=0 must be a positive integer"):
        D.parse_directive("ranks=0", "p:3")
    with pytest.raises(ValueError, match="only cwd=repo"):
        D.parse_directive("cwd=/tmp", "p:3")


def test_shell_commands_join_continuations_and_drop_comments():
    body = "# a comment\n$ echo a \\\n  b\n\nmake demo   # trailing comment stays\n"
    assert D.shell_commands(body) == ["echo a   b", "make demo   # trailing comment stays"]


def test_a_block_without_a_way_to_run_it_is_reported(tmp_path, monkeypatch):
    page = tmp_path / "p.md"
    page.write_text("text\n```cpp\nint x;\n```\n<!-- test: skip: shown only -->\n```json\n{}\n"
                    "```\n", encoding="utf-8")
    monkeypatch.setattr(D, "ROOT", str(tmp_path))
    blocks = D.blocks_of("p.md")
    assert [b.lang for b in blocks] == ["cpp", "json"]
    assert "p.md:2" in D.problems(blocks[0])
    assert D.problems(blocks[1]) is None


def test_a_python_block_must_say_how_it_runs(tmp_path, monkeypatch):
    # A new example without a directive fails the suite, saying what to add:
    # it may be code for several ranks, which one process would not show.
    page = tmp_path / "p.md"
    page.write_text("```python\nimport strata\n```\n\n<!-- test: run -->\n```python\nx = 1\n```\n"
                    "<!-- test: ranks=2 session=s -->\n```python\nx = 1\n```\n"
                    "<!-- test: run ranks=2 -->\n```python\nx = 1\n```\n"
                    "<!-- test: run -->\n```sh\nls\n```\n", encoding="utf-8")
    monkeypatch.setattr(D, "ROOT", str(tmp_path))
    blocks = D.blocks_of("p.md")
    first = D.problems(blocks[0])
    assert first.startswith("p.md:1: a ```python block needs a test directive")
    for advice in ("<!-- test: run -->", "ranks=N", "torchrun=N", "file=NAME", "session=S",
                   "skip: why"):
        assert advice in first
    assert blocks[1].run and D.problems(blocks[1]) is None
    assert D.problems(blocks[2]) is None
    assert "exclude each other" in D.problems(blocks[3])
    assert "apply to python blocks" in D.problems(blocks[4])


def test_file_blocks_of_one_name_are_joined_in_page_order(tmp_path, monkeypatch):
    page = tmp_path / "p.md"
    page.write_text("<!-- test: file=main.cc -->\n```cpp\nint a;\n```\ntext\n"
                    "<!-- test: file=CMakeLists.txt -->\n```cmake\nproject(x)\n```\n"
                    "<!-- test: file=main.cc -->\n```cpp\nint b;\n```\n", encoding="utf-8")
    monkeypatch.setattr(D, "ROOT", str(tmp_path))
    out = tmp_path / "out"
    out.mkdir()
    _write_files("p.md", str(out))
    assert (out / "main.cc").read_text() == "int a;\nint b;\n"
    assert (out / "CMakeLists.txt").read_text() == "project(x)\n"


def test_an_interactive_session_is_compared_with_its_output(tmp_path):
    good = D.Block(page="p.md", line=1, lang="python", run=True,
                   body=">>> sorted({'b': 1, 'a': 2})\n['a',\n 'b']\n")
    bad = D.Block(page="p.md", line=9, lang="python", run=True, body=">>> 1 + 1\n3\n")
    assert D.is_doctest(good) and not D.is_doctest(D.Block("p.md", 1, "python", "x = 1\n"))
    test_block_runs_as_written(tmp_path / "good", "p.md:1", "README.md", [good])
    with pytest.raises(AssertionError, match="p.md:9"):
        test_block_runs_as_written(tmp_path / "bad", "p.md:9", "README.md", [bad])


def test_pages_are_selected_by_name(monkeypatch):
    monkeypatch.setenv("STRATA_DOCS_PAGES", "README.md")
    assert _selected_pages() == ["README.md"]
    monkeypatch.setenv("STRATA_DOCS_PAGES", "docs/nope.md")
    with pytest.raises(ValueError, match="docs/nope.md"):
        _selected_pages()


def test_readme_script_is_the_quickstart_example():
    block = next(b for b in D.blocks_of("README.md") if b.file == "train.py")
    with open(os.path.join(D.ROOT, "examples", "quickstart", "train.py"), encoding="utf-8") as f:
        assert block.body == f.read(), ("README.md's train.py and examples/quickstart/train.py "
                                        "differ: keep them the same")
