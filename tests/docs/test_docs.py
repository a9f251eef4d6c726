"""Every code block of README.md and docs/*.md runs as written, or says why not.

Python blocks run as scripts (joined per session, see doc_blocks.py) in one
process or under the launchers with their default flags: plain
`mpirun -np N` (plus --allow-run-as-root when the test runs as root, which
mpirun requires, and --oversubscribe when N exceeds the cores, as the pages
say) and plain `torchrun --standalone --nproc-per-node N`. Shell blocks run
command by command in bash. A failure shows the page and line of the block.
"""

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import doc_blocks as D  # noqa: E402

BUILD_PYTHON = os.environ.get("STRATA_DOCS_PYTHONPATH",
                              os.path.join(D.ROOT, "build", "python"))


def _units():
    """(id, page, blocks) of what runs: a standalone python or shell block,
    or all python blocks of a session."""
    units = []
    for page in D.pages():
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
    return env


def _mpirun_flags(n):
    flags = []
    if os.geteuid() == 0:
        flags.append("--allow-run-as-root")
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
    for b in D.blocks_of(page):
        if b.file:
            with open(os.path.join(where, b.file), "w", encoding="utf-8") as f:
                f.write(b.body)


def test_every_block_runs_or_says_why():
    found = [p for p in (D.problems(b) for b in D.all_blocks()) if p]
    assert not found, "\n".join(found)


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
    first = blocks[0]
    if first.is_python:
        launcher = next((b for b in blocks if b.ranks or b.torchrun), first)
        script = tmp_path / "doc_block.py"
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


def test_readme_script_is_the_quickstart_example():
    block = next(b for b in D.blocks_of("README.md") if b.file == "train.py")
    with open(os.path.join(D.ROOT, "examples", "quickstart", "train.py"), encoding="utf-8") as f:
        assert block.body == f.read(), ("README.md's train.py and examples/quickstart/train.py "
                                        "differ: keep them the same")
