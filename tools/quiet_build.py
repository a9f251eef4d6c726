#!/usr/bin/env python3
"""Builds one CMake target quietly, for `make demo`.

It says up front what it builds and roughly how long that takes, shows the
build as one line that updates in place (on a terminal; elsewhere a line
every tenth of the way), and writes everything CMake and Ninja print to a
log file, whose path it prints; when the build fails it shows the failing
step (or the log's tail) and the path. A build with nothing to do says so
and takes a second.

    tools/quiet_build.py --build build --target strata_demo --jobs 2 \\
        --what "the library and the Python extension" [-- <cmake configure args>]

The estimate: Ninja's dry run counts the steps to run; each takes about
STEP_CORE_SECONDS of one core the first time (measured: a fresh `make build`
on a 2-core machine ran its 250 steps in about 13 minutes), or what the last
build here measured (kept in <build>/.quiet_build_rate).
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import time

STEP_CORE_SECONDS = 6.0
STEP = re.compile(r"^\[(\d+)/(\d+)\] (.*)$")
RATE_FILE = ".quiet_build_rate"


def count_steps(dry_run_output):
    """The compile and link steps a `ninja -n` listing would run: those take
    the time. Steps that run on every build (CMake's check of globbed
    directories, copying the Python files) do not count, so a build with
    only those is up to date."""
    return sum(1 for line in dry_run_output.splitlines()
               if (m := STEP.match(line)) and m.group(3).startswith(("Building ", "Linking ")))


def step_core_seconds(build_dir):
    """Core-seconds per step measured by the last build in `build_dir`
    (steps that took a while only: a no-op build says nothing), else the
    default."""
    try:
        with open(os.path.join(build_dir, RATE_FILE)) as f:
            rate = float(f.read().split()[0])
        if 0.05 < rate < 600:
            return rate
    except (OSError, ValueError, IndexError):
        pass
    return STEP_CORE_SECONDS


def record_rate(build_dir, steps, seconds, jobs):
    if steps >= 10 and seconds > 0:
        with open(os.path.join(build_dir, RATE_FILE), "w") as f:
            f.write(f"{seconds * jobs / steps:.3f}\n")


def minutes(seconds):
    if seconds < 90:
        return f"{max(10, int(round(seconds / 10.0)) * 10)} seconds"
    return f"{int(round(seconds / 60.0))} minutes"


def announce(what, steps, first, rate, jobs, label="build", log_path=None):
    """The lines printed before building `steps` steps."""
    eta = minutes(steps * rate / max(1, jobs))
    log = f"; log: {log_path}" if log_path else ""
    if first:
        return (f"{label}: building {what} ({steps} steps on {jobs} cores{log})\n"
                f"{label}: first build: about {eta} on this machine (less where ccache already "
                f"holds the objects); later runs only rebuild what changed")
    return f"{label}: rebuilding what changed in {what}: {steps} steps, about {eta}{log}"


def _clip(text, width):
    return text if len(text) <= width else text[: max(0, width - 3)] + "..."


def failure_excerpt(log_text, lines=60):
    """What to show of a failed build's log: from Ninja's first FAILED: on,
    else the tail."""
    all_lines = log_text.splitlines()
    for i, line in enumerate(all_lines):
        if line.startswith("FAILED:"):
            return "\n".join(all_lines[i:i + lines])
    return "\n".join(all_lines[-lines:])


def run_with_progress(cmd, log_path, out=sys.stdout, tty=None, width=None, label="build"):
    """Runs `cmd`, logging its output to `log_path` and showing Ninja's
    [k/N] lines as one updating line. Returns the command's exit status."""
    if tty is None:
        tty = out.isatty()
    if width is None:
        width = shutil.get_terminal_size((100, 20)).columns
    start = time.monotonic()
    shown_tenth = -1
    last = ""
    with open(log_path, "a") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", bufsize=1)
        for line in proc.stdout:
            log.write(line)
            m = STEP.match(line.rstrip("\n"))
            if not m:
                continue
            k, n, desc = int(m.group(1)), int(m.group(2)), m.group(3)
            elapsed = int(time.monotonic() - start)
            status = (f"[{k:>{len(str(n))}}/{n}] {100 * k // max(1, n):3d}% "
                      f"{elapsed // 60}:{elapsed % 60:02d}  {desc}")
            if tty:
                text = _clip(status, width - 1)
                out.write("\r" + text + " " * max(0, len(last) - len(text)))
                last = text
            elif 10 * k // max(1, n) > shown_tenth:
                shown_tenth = 10 * k // max(1, n)
                out.write(_clip(status, 160) + "\n")
            out.flush()
        rc = proc.wait()
    if tty and last:
        out.write("\r" + " " * len(last) + "\r")
    elapsed = int(time.monotonic() - start)
    if rc == 0:
        out.write(f"{label}: done in {elapsed // 60}:{elapsed % 60:02d} (log: {log_path})\n")
    else:
        with open(log_path, errors="replace") as f:
            excerpt = failure_excerpt(f.read())
        out.write(f"{label}: FAILED (exit status {rc}). From the log:\n{excerpt}\n"
                  f"{label}: the whole log is {log_path}\n")
    out.flush()
    return rc


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", required=True, help="CMake build directory (Ninja)")
    p.add_argument("--target", required=True)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    p.add_argument("--what", default=None, help="what the target is, for the message")
    p.add_argument("--source", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p.add_argument("--label", default="build")
    p.add_argument("configure", nargs="*", help="extra CMake configure arguments (after --)")
    a = p.parse_args(argv)
    what = a.what or f"target {a.target}"
    build = os.path.abspath(a.build)
    os.makedirs(build, exist_ok=True)
    log_path = os.path.join(build, f"{a.target}-build.log")
    open(log_path, "w").close()
    if not os.path.exists(os.path.join(build, "build.ninja")):
        print(f"{a.label}: configuring {a.build} with CMake (about a minute; log: {log_path})",
              flush=True)
        rc = run_with_progress(["cmake", "-S", a.source, "-B", build, "-G", "Ninja",
                                "-DCMAKE_BUILD_TYPE=RelWithDebInfo"] + a.configure,
                               log_path, tty=False, label=f"{a.label}: configure")
        if rc != 0:
            return rc
    # Re-run CMake first if a CMakeLists.txt changed: the dry run below can
    # only count the steps of an up-to-date build.ninja.
    with open(log_path, "a") as log:
        regen = subprocess.run(["ninja", "-C", build, "build.ninja"], stdout=log,
                               stderr=subprocess.STDOUT)
    if regen.returncode != 0:
        with open(log_path, errors="replace") as f:
            sys.stdout.write(f"{a.label}: re-running CMake failed:\n{failure_excerpt(f.read())}\n"
                             f"{a.label}: the whole log is {log_path}\n")
        return regen.returncode
    # The dry run reads a copy of build.ninja: Ninja stops a dry run as soon
    # as the manifest would be rebuilt, and CMake's check of CONFIGURE_DEPENDS
    # globs makes build.ninja look out of date to every dry run. The copy has
    # no rule that rebuilds it (build.ninja was brought up to date above).
    plan = os.path.join(build, ".quiet_build_plan.ninja")
    shutil.copyfile(os.path.join(build, "build.ninja"), plan)
    dry = subprocess.run(["ninja", "-C", build, "-f", plan, "-n", a.target], capture_output=True,
                         text=True)
    os.remove(plan)
    if dry.returncode != 0:
        with open(log_path, "a") as log:
            log.write(dry.stdout + dry.stderr)
        sys.stdout.write(f"{a.label}: ninja cannot plan {a.target}:\n"
                         f"{failure_excerpt(dry.stdout + dry.stderr)}\n"
                         f"{a.label}: the whole log is {log_path}\n")
        return dry.returncode
    steps = count_steps(dry.stdout)
    if steps == 0:
        rc = subprocess.run(["cmake", "--build", build, "--target", a.target],
                            stdout=open(log_path, "a"), stderr=subprocess.STDOUT).returncode
        if rc == 0:
            print(f"{a.label}: {what}: up to date", flush=True)
            return 0
        return run_with_progress(["cmake", "--build", build, "--target", a.target], log_path,
                                 label=a.label)
    # A first build (or one cut short early): most of the target's steps to do.
    every = subprocess.run(["ninja", "-C", build, "-t", "commands", a.target],
                           capture_output=True, text=True).stdout.count("\n")
    first = steps >= every // 2
    print(announce(what, steps, first, step_core_seconds(build), a.jobs, a.label, log_path),
          flush=True)
    start = time.monotonic()
    rc = run_with_progress(["cmake", "--build", build, "--target", a.target, "-j", str(a.jobs)],
                           log_path, label=a.label)
    if rc == 0:
        record_rate(build, steps, time.monotonic() - start, a.jobs)
    return rc


if __name__ == "__main__":
    sys.exit(main())
