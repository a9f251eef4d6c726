"""Running one check of tools/dev/gpu_checks.py and reading its output:
the process under its time limit, its status (pass, fail, skip) and
figures, the summary line, and the copy of the results for the device
machine's $OUT."""

import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results")
SKIP_CODE = 77  # ctest's SKIP_RETURN_CODE, used by nccl_fault_test


def _pythonpath(build):
    return os.path.join(build, "python") + (os.pathsep + os.environ["PYTHONPATH"]
                                            if os.environ.get("PYTHONPATH") else "")


def _tail(text, lines):
    kept = [line for line in text.strip().splitlines() if line.strip()][-lines:]
    return "\n".join(kept)


def expand(command, build, python):
    return [a.replace("{build}", build).replace("{python}", python) for a in command]


def parse_figures(check, output):
    """Counts and numbers from a check's output or its results file."""
    figs = {}
    m = re.findall(r"\[  PASSED  \] (\d+) tests?", output)
    if m:
        figs["gtest_passed"] = sum(int(x) for x in m)
        figs["gtest_skipped"] = sum(int(x) for x in re.findall(r"\[  SKIPPED \] (\d+) tests?",
                                                                output))
        figs["gtest_failed"] = sum(int(x) for x in re.findall(r"\[  FAILED  \] (\d+) tests?",
                                                               output))
        figs["processes"] = len(m)
    for word in ("passed", "skipped", "failed", "error"):
        hits = re.findall(rf"(\d+) {word}", "\n".join(
            line for line in output.splitlines() if re.search(r"\d+ (passed|skipped|failed)",
                                                              line) and " in " in line))
        if hits:
            figs[f"pytest_{word}"] = sum(int(x) for x in hits)
    for line in reversed(output.strip().splitlines()):
        line = line.strip()
        if line.startswith("{") and '"test": "nccl_fault_test"' in line.replace('":"', '": "'):
            try:
                figs["fault"] = json.loads(line)
            except ValueError:
                pass
            break
    if check["results"]:
        path = os.path.join(RESULTS_DIR, check["results"] + ".json")
        if os.path.exists(path) and os.path.getmtime(path) >= check.get("_started", 0):
            with open(path) as f:
                doc = json.load(f)
            figs["rows"] = [{k: r.get(k) for k in ("case", "metric", "unit", "strata", "peer",
                                                   "peer_value", "ratio", "target", "met")}
                            for r in doc["rows"]]
            met = [r.get("met") for r in doc["rows"] if r.get("met") is not None]
            figs["targets_met"], figs["targets_missed"] = met.count(True), met.count(False)
    return figs


def verdict(rc, output, figs):
    """(status, reason) of a finished check."""
    if rc == SKIP_CODE:
        m = re.search(r"SKIPPED: (.*)", output)
        return "skip", m.group(1).strip() if m else "the program skipped"
    if rc != 0:
        return "fail", f"exit {rc}: " + _tail(output, 6)
    if "nothing written" in output:
        m = re.search(r"([^\n]*nothing written[^\n]*)", output)
        return "skip", m.group(1).strip()
    ran = figs.get("gtest_passed", 0) + figs.get("pytest_passed", 0)
    skipped = figs.get("gtest_skipped", 0) + figs.get("pytest_skipped", 0)
    if ran == 0 and skipped > 0 and "rows" not in figs and "fault" not in figs:
        m = re.search(r"(?:Skipped|SKIPPED \[\d+\])[^\n]*?:\s*([^\n]+)", output)
        return "skip", "every test skipped" + (f": {m.group(1).strip()}" if m else "")
    return "pass", ""


def run_check(check, ctx, budget_left, extra=None, fell_back=None):
    """Runs one check (its fallback command when `fell_back` says why), with
    `extra` in its environment besides ctx["env"] and its own, for at most
    its timeout or `budget_left` seconds; returns its result (status, reason,
    seconds, figures, log)."""
    extra = extra or {}
    env = dict(os.environ)
    env.update(ctx["env"])
    env.update(check["env"])
    env.update(extra)
    env["PYTHONPATH"] = _pythonpath(ctx["build"])
    env["PYTHONUNBUFFERED"] = "1"
    command = check["fallback"] if fell_back else check["command"]
    cmd = expand(command, ctx["build"], ctx["python"])
    timeout = min(check["timeout"], budget_left)
    logpath = os.path.join(ctx["logs"], check["name"] + ".log")
    check["_started"] = time.time()
    t0 = time.monotonic()
    with open(logpath, "w") as f:
        f.write("$ " + " ".join(f"{k}={v}" for k, v in sorted({**check["env"], **extra}.items()))
                + " " + " ".join(shlex.quote(a) for a in cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    seconds = time.monotonic() - t0
    with open(logpath) as f:
        output = f.read()
    figs = parse_figures(check, output)
    if rc is None:
        status, reason = "fail", (f"did not finish within {timeout:.0f} s (killed): "
                                  + _tail(output, 4))
    else:
        status, reason = verdict(rc, output, figs)
    if extra:
        figs["env"] = extra
    if fell_back:
        figs["fell_back"] = fell_back
        if status == "pass":
            reason = fell_back
    return {"status": status, "reason": reason, "seconds": round(seconds, 1), "figures": figs,
            "log": os.path.relpath(logpath, ROOT)}


def one_line(name, r):
    status = {"pass": "PASS", "fail": "FAIL", "skip": "skip"}[r["status"]]
    figs = r.get("figures", {})
    detail = r["reason"].splitlines()[0] if r["reason"] else ""
    if r["status"] == "pass":
        parts = [figs["fell_back"]] if figs.get("fell_back") else []
        if "gtest_passed" in figs:
            parts.append(f"{figs['gtest_passed']} passed, {figs['gtest_skipped']} skipped"
                         + (f" ({figs['processes']} processes)" if figs["processes"] > 1 else ""))
        if "pytest_passed" in figs:
            parts.append(f"{figs['pytest_passed']} passed, {figs.get('pytest_skipped', 0)} "
                         "skipped")
        if "targets_met" in figs:
            parts.append(f"targets {figs['targets_met']} met, {figs['targets_missed']} missed")
        if "fault" in figs:
            for s in figs["fault"].get("scenarios", []):
                parts.append(f"{s['scenario']}: " + ("skipped" if "skipped" in s else
                                                     "ok" if s.get("passed") else "failed"))
        detail = "; ".join(parts)
    secs = f"{r['seconds']:6.1f}s" if r.get("seconds") is not None else "       "
    return f"{status}  {name:24s} {secs}  {detail}"[:160]


def collect(out_dir, json_path, logs, log):
    """Copies the run's results to out_dir (the device machine's $OUT): the
    JSON, RESULTS.md and one archive of results/*.json and the logs (its
    files come back only if few and flat)."""
    os.makedirs(out_dir, exist_ok=True)
    shutil.copy(json_path, os.path.join(out_dir, "gpu_checks.json"))
    md = os.path.join(ROOT, "benchmarks", "RESULTS.md")
    if os.path.exists(md):
        shutil.copy(md, os.path.join(out_dir, "RESULTS.md"))
    with tarfile.open(os.path.join(out_dir, "gpu_checks_files.tar.gz"), "w:gz") as tar:
        for p in sorted(glob.glob(os.path.join(RESULTS_DIR, "*.json"))):
            tar.add(p, arcname=os.path.join("results", os.path.basename(p)))
        tar.add(logs, arcname="logs")
    log(f"copied gpu_checks.json, RESULTS.md, gpu_checks_files.tar.gz to {out_dir}")


def machine():
    try:
        sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
        import bench_util
        return bench_util.machine()
    except Exception:  # noqa: BLE001 - a description only
        return os.uname().nodename
