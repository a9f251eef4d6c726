"""`make demo` builds only what the demo runs, quietly (tools/quiet_build.py
and the CMake target strata_demo): the target holds no test or benchmark,
the filter turns Ninja's output into one updating line with the whole log in
a file, and shows the failing step and the log's path when the build fails.
The filter runs on canned Ninja output and on a tiny CMake project, not on a
fresh build of strata (that takes minutes)."""

import importlib.util
import io
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("STRATA_BUILD_DIR", os.path.join(ROOT, "build"))
SCRIPT = os.path.join(ROOT, "tools", "quiet_build.py")

spec = importlib.util.spec_from_file_location("quiet_build", SCRIPT)
qb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(qb)

NINJA_OK = textwrap.dedent("""\
    [1/5] Building CXX object src/CMakeFiles/strata_obj.dir/base/status.cc.o
    [2/5] Building CXX object src/CMakeFiles/strata_obj.dir/base/dtype.cc.o
    ../src/base/dtype.cc:12:3: warning: unused variable 'x' [-Wunused-variable]
    [3/5] Linking CXX shared library src/libstrata.so.0.1.0
    [4/5] Building CXX object python/CMakeFiles/_strata.dir/src/mesh_bindings.cc.o
    [5/5] Linking CXX shared module python/strata/_strata.cpython-311-x86_64-linux-gnu.so
    """)

NINJA_FAILED = textwrap.dedent("""\
    [1/3] Building CXX object src/CMakeFiles/strata_obj.dir/base/status.cc.o
    [2/3] Building CXX object src/CMakeFiles/strata_obj.dir/base/dtype.cc.o
    FAILED: src/CMakeFiles/strata_obj.dir/base/dtype.cc.o
    /usr/bin/c++ -O2 -c ../src/base/dtype.cc -o src/CMakeFiles/strata_obj.dir/base/dtype.cc.o
    ../src/base/dtype.cc:7:1: error: 'boom' does not name a type
    ninja: build stopped: subcommand failed.
    """)


def _canned(tmp_path, text, rc):
    f = tmp_path / "ninja.out"
    f.write_text(text)
    return ["sh", "-c", f'cat "{f}"; exit {rc}']


def test_ninja_output_becomes_one_updating_line(tmp_path):
    log = tmp_path / "build.log"
    out = io.StringIO()
    rc = qb.run_with_progress(_canned(tmp_path, NINJA_OK, 0), str(log), out=out, tty=True,
                              width=80, label="demo")
    assert rc == 0
    text = out.getvalue()
    progress, done = text.rsplit("\r", 1)
    # Everything up to the summary is one terminal line, rewritten in place.
    assert "\n" not in progress
    assert progress.count("\r") == 5 + 1  # each step, then the clearing of the line
    for k in range(1, 6):
        assert f"[{k}/5]" in progress
    assert all(len(piece) <= 80 for piece in progress.split("\r"))
    assert "warning" not in text  # compiler chatter goes to the log only
    assert re.fullmatch(r"demo: done in \d+:\d\d \(log: .*build\.log\)\n", done), done
    assert log.read_text() == NINJA_OK


def test_without_a_terminal_a_line_every_tenth(tmp_path):
    steps = "".join(f"[{k}/200] Building CXX object o{k}.o\n" for k in range(1, 201))
    out = io.StringIO()
    rc = qb.run_with_progress(_canned(tmp_path, steps, 0), str(tmp_path / "log"), out=out,
                              tty=False, label="demo")
    assert rc == 0
    lines = out.getvalue().splitlines()
    assert len(lines) == 11 + 1  # 0%, 10%, ..., 100%, and the summary
    assert "\r" not in out.getvalue()


def test_a_failed_build_shows_the_failing_step_and_the_log(tmp_path):
    log = tmp_path / "build.log"
    out = io.StringIO()
    rc = qb.run_with_progress(_canned(tmp_path, NINJA_FAILED, 1), str(log), out=out, tty=True,
                              width=100, label="demo")
    assert rc == 1
    text = out.getvalue()
    assert "demo: FAILED (exit status 1)" in text
    assert "FAILED: src/CMakeFiles/strata_obj.dir/base/dtype.cc.o" in text
    assert "error: 'boom' does not name a type" in text
    assert f"the whole log is {log}" in text
    assert log.read_text() == NINJA_FAILED
    # Output without Ninja's FAILED: marker (CMake failing): the log's tail.
    tail = "".join(f"-- line {i}\n" for i in range(100)) + "CMake Error: no compiler\n"
    out = io.StringIO()
    assert qb.run_with_progress(_canned(tmp_path, tail, 2), str(tmp_path / "l2"), out=out,
                                tty=False) == 2
    assert "CMake Error: no compiler" in out.getvalue()
    assert "-- line 0\n" not in out.getvalue()


def test_the_estimate_says_minutes_and_what_later_runs_do():
    dry = ("[0/132] Re-checking globbed directories...\n"
           + "".join(f"[{k}/132] Building CXX object o{k}.o\n" for k in range(1, 130))
           + "[130/132] Linking CXX shared library src/libstrata.so.0.1.0\n"
           + "[131/132] Copying the strata Python package into the build tree\n")
    steps = qb.count_steps(dry)
    assert steps == 130  # compiles and links; the steps that always run do not count
    msg = qb.announce("the library and the Python extension", steps, True, 6.0, 2, "demo")
    expected_minutes = round(130 * 6.0 / 2 / 60)
    assert msg.splitlines() == [
        "demo: building the library and the Python extension (130 steps on 2 cores)",
        f"demo: first build: about {expected_minutes} minutes on this machine (less where ccache "
        "already holds the objects); later runs only rebuild what changed"]
    assert qb.announce("x", 10, False, 6.0, 2, "demo") == (
        "demo: rebuilding what changed in x: 10 steps, about 30 seconds")


@pytest.mark.skipif(not os.path.exists(os.path.join(BUILD, "build.ninja")),
                    reason="needs a Ninja build directory (STRATA_BUILD_DIR)")
def test_the_demo_target_holds_no_test_or_benchmark():
    def inputs(target):
        r = subprocess.run(["ninja", "-C", BUILD, "-t", "inputs", target], capture_output=True,
                           text=True, check=True)
        return r.stdout.split()

    def commands(target):
        r = subprocess.run(["ninja", "-C", BUILD, "-t", "commands", target],
                           capture_output=True, text=True, check=True)
        return r.stdout.splitlines()

    demo = inputs("strata_demo")
    names = {os.path.basename(p) for p in demo}
    bad = [p for p in demo
           if {"tests", "benchmarks"} & set(os.path.normpath(p).split(os.sep))
           or re.match(r"lib(gtest|gmock|benchmark)", os.path.basename(p))]
    assert not bad, f"strata_demo builds tests or benchmarks: {bad[:10]}"
    # What the demo runs is in it: the extension over libstrata, the Python
    # files, and the Gloo plugin where this build has one (LAUNCHER=torchrun).
    assert any(n.startswith("_strata.") for n in names) or any(
        "_strata.dir" in p for p in demo), "no Python extension in strata_demo"
    assert any("strata_obj.dir" in p for p in demo), "no libstrata in strata_demo"
    all_cmds, demo_cmds = commands("all"), commands("strata_demo")
    if any("libstrata_gloo.so" in c for c in all_cmds):
        assert any("libstrata_gloo.so" in c for c in demo_cmds)
    assert not any("strata-topo" in c or "gtest" in c for c in demo_cmds)
    print(f"strata_demo: {len(demo_cmds)} commands, all: {len(all_cmds)}")
    assert len(demo_cmds) < len(all_cmds)


def test_a_real_build_first_then_up_to_date(tmp_path):
    """The whole script on a tiny CMake project: configure, announce, build
    with one progress line; then again, with nothing to do, quickly."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "CMakeLists.txt").write_text(textwrap.dedent("""\
        cmake_minimum_required(VERSION 3.20)
        project(tiny C)
        foreach(i RANGE 1 12)
          file(WRITE ${CMAKE_BINARY_DIR}/f${i}.c "int f${i}(void) { return ${i}; }\\n")
          list(APPEND srcs ${CMAKE_BINARY_DIR}/f${i}.c)
        endforeach()
        # As strata does: a glob CMake re-checks on every build, which makes
        # build.ninja look out of date to a plain `ninja -n`.
        file(GLOB extra CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/*.c)
        add_library(tiny SHARED ${srcs} ${extra})
        add_executable(unit_test_binary ${CMAKE_BINARY_DIR}/f1.c)
        add_custom_target(strata_demo)
        add_dependencies(strata_demo tiny)
        """))
    build = tmp_path / "build"
    cmd = [sys.executable, SCRIPT, "--build", str(build), "--target", "strata_demo", "--jobs", "2",
           "--source", str(src), "--label", "demo", "--what", "the tiny library"]
    first = subprocess.run(cmd, capture_output=True, text=True)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "demo: configuring" in first.stdout
    log = build / "strata_demo-build.log"
    assert f"demo: building the tiny library (13 steps on 2 cores; log: {log})" in first.stdout
    assert "demo: first build: about" in first.stdout
    assert "demo: done in" in first.stdout
    # Not a terminal here: at most a line per tenth of the way; the log has all.
    assert len(re.findall(r"^\[ *\d+/13\]", log.read_text(), re.M)) == 13
    assert len(re.findall(r"^\[ *\d+/13\]", first.stdout, re.M)) <= 11
    assert "-- Configuring done" not in first.stdout  # CMake's chatter: log only
    assert "-- Configuring done" in log.read_text()
    assert not (build / "unit_test_binary").exists()  # only the target was built
    start = time.monotonic()
    again = subprocess.run(cmd, capture_output=True, text=True)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout == "demo: the tiny library: up to date\n"
    assert time.monotonic() - start < 30
    # One source changed: the rebuild is announced as such.
    os.utime(build / "f3.c")
    third = subprocess.run(cmd, capture_output=True, text=True)
    assert third.returncode == 0, third.stdout + third.stderr
    assert "demo: rebuilding what changed in the tiny library: 2 steps" in third.stdout
