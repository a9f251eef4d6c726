"""tools/dev/gpu_checks.py, the prepared GPU run, without a GPU: which NCCL
rank counts run on how many GPUs and with which settings, the table of
checks, how a check's output becomes its status and figures, time limits,
and a dry run that pretends a GPU and an NCCL version."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPEC = importlib.util.spec_from_file_location("gpu_checks",
                                              os.path.join(ROOT, "tools", "dev", "gpu_checks.py"))
gc = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(gc)


def nccl(version):
    return {"version": gc.parse_version(version), "path": "/x/libnccl.so.2", "reason": "test"}


def test_versions_parse_from_text_and_tuples():
    assert gc.parse_version("2.30.7") == (2, 30, 7)
    assert gc.parse_version("2.28") == (2, 28, 0)
    assert gc.parse_version([2, 29, 3]) == (2, 29, 3)
    assert gc.parse_version("unknown") is None
    assert gc.vstr((2, 30, 7)) == "2.30.7"


def test_ranks_within_the_gpus_need_nothing(monkeypatch):
    monkeypatch.delenv("NCCL_MAX_CTAS", raising=False)
    assert gc.multi_rank(4, 8, nccl("2.26.5")) == ({}, None)
    assert gc.multi_rank(8, 8, None) == ({}, None)


def test_no_gpu_says_so():
    env, why = gc.multi_rank(2, 0, nccl("2.30.7"))
    assert env is None and why == "no GPU visible"


@pytest.mark.parametrize("version", ["2.28.9", "2.29.7", "2.21.5"])
def test_nccl_before_2_30_runs_one_rank_per_gpu(version):
    env, why = gc.multi_rank(4, 1, nccl(version))
    assert env is None
    assert why == (f"NCCL {version} < 2.30: one rank per GPU only (4 ranks need 4 GPUs, "
                   "1 visible)")


def test_unknown_nccl_version_is_named():
    env, why = gc.multi_rank(2, 1, None)
    assert env is None and "version in use is unknown" in why


def test_nccl_2_30_shares_a_gpu_with_nvls_off(monkeypatch):
    monkeypatch.delenv("NCCL_MAX_CTAS", raising=False)
    env, why = gc.multi_rank(2, 1, nccl("2.30.7"))
    assert why is None
    assert env == {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "0"}
    # More than NCCL's guaranteed 2 ranks per GPU: fewer CTAs per rank.
    assert gc.multi_rank(4, 1, nccl("2.30.7"))[0]["NCCL_MAX_CTAS"] == "4"
    assert gc.multi_rank(8, 1, nccl("2.31.0"))[0]["NCCL_MAX_CTAS"] == "2"
    assert "NCCL_MAX_CTAS" not in gc.multi_rank(8, 4, nccl("2.30.7"))[0]  # 2 per GPU
    # The caller's own setting wins.
    monkeypatch.setenv("NCCL_MAX_CTAS", "8")
    assert "NCCL_MAX_CTAS" not in gc.multi_rank(8, 1, nccl("2.30.7"))[0]


def test_the_table_is_sound():
    names = [c["name"] for c in gc.CHECKS]
    assert len(names) == len(set(names)), "check names repeat"
    for c in gc.CHECKS:
        assert c["timeout"] > c["estimate"] > 0, c["name"]
        if c["ranks"] > 1 and not c["fallback"]:
            cmd = " ".join(c["command"])
            assert f"--np {c['ranks']}" in cmd or f"--ranks {c['ranks']}" in cmd, c["name"]
        if not c["files"]:  # checks of merged work name only what exists
            ctx = {"build_info": None, "known_targets": None, "build": "build"}
            assert gc.rot(c, ctx) == [], c["name"]
    # Every rank count of the issue has a C++ and a Python test.
    for n in gc.RANK_COUNTS:
        assert f"nccl_gpu_test_np{n}" in names and f"py_nccl_np{n}" in names


def test_a_missing_script_is_rot(tmp_path):
    check = gc._check("x", "x", ["{python}", "benchmarks/run_nothing.py"], 10, 5, gpu=False)
    ctx = {"build_info": {"cuda": True, "nccl": True}, "known_targets": set(), "build": "b"}
    assert gc.rot(check, ctx) == ["benchmarks/run_nothing.py does not exist"]
    check = gc._check("y", "y", ["{build}/t"], 10, 5, targets=[("t", "t")])
    assert gc.rot(check, ctx) == ["target t is not defined in b"]
    # Work not merged yet waits for its files.
    check = gc._check("z", "z", ["{python}", "benchmarks/run_nothing.py"], 10, 5,
                      files=["examples/nowhere.py"])
    assert gc.rot(check, ctx) == []


def test_skip_reasons_come_in_order(tmp_path):
    (tmp_path / "t").write_text("")
    check = gc._check("c", "c", ["{build}/t"], 10, 5, ranks=2, targets=[("t", "t")],
                      mpirun=True)
    ctx = {"build": str(tmp_path), "build_info": {"cuda": True, "nccl": True}, "gpus": 1,
           "nccl": nccl("2.28.9"), "mpirun": False, "torch": True}
    assert gc.skip_reason(check, ctx).startswith("NCCL 2.28.9 < 2.30")
    ctx["nccl"] = nccl("2.30.7")
    assert gc.skip_reason(check, ctx).startswith("no mpirun")
    ctx["mpirun"] = True
    assert gc.skip_reason(check, ctx) is None
    ctx["gpus"] = 0
    assert gc.skip_reason(check, ctx) == "no GPU visible"
    (tmp_path / "t").unlink()
    assert gc.skip_reason(check, ctx) == f"t is missing from {tmp_path} (target t)"
    ctx["build_info"] = {"cuda": False, "nccl": False}
    assert "this build has no CUDA/NCCL" in gc.skip_reason(check, ctx)


GTEST_ALL_SKIPPED = """[==========] 6 tests from 1 test suite ran. (3 ms total)
[  PASSED  ] 0 tests.
[  SKIPPED ] 6 tests, listed below:
[  SKIPPED ] NcclGpu.InitReportsRankSizeAndBackend
"""
GTEST_TWO_RANKS = """[  PASSED  ] 6 tests.
[  PASSED  ] 5 tests.
[  SKIPPED ] 1 test, listed below:
"""


def test_outputs_become_status_and_figures():
    check = gc._check("c", "c", ["x"], 10, 5)
    figs = gc.parse_figures(check, GTEST_ALL_SKIPPED)
    assert figs["gtest_passed"] == 0 and figs["gtest_skipped"] == 6
    assert gc.verdict(0, GTEST_ALL_SKIPPED, figs)[0] == "skip"
    figs = gc.parse_figures(check, GTEST_TWO_RANKS)
    assert (figs["gtest_passed"], figs["gtest_skipped"], figs["processes"]) == (11, 1, 2)
    assert gc.verdict(0, GTEST_TWO_RANKS, figs) == ("pass", "")
    out = "....s\n4 passed, 1 skipped in 3.20s\n"
    figs = gc.parse_figures(check, out)
    assert (figs["pytest_passed"], figs["pytest_skipped"]) == (4, 1)
    assert gc.verdict(0, out, figs) == ("pass", "")
    status, reason = gc.verdict(1, "a\nb\nboom\n", {})
    assert status == "fail" and reason.endswith("boom")
    assert gc.verdict(77, "SKIPPED: no CUDA device visible\n{}", {}) == (
        "skip", "no CUDA device visible")
    assert gc.verdict(0, "run_x: no GPU: not measured, nothing written\n", {}) == (
        "skip", "run_x: no GPU: not measured, nothing written")
    fault = '{"passed":true,"scenarios":[{"scenario":"abort","passed":true}],' \
            '"test":"nccl_fault_test"}'
    assert gc.parse_figures(check, "abort scenario: passed\n" + fault)["fault"]["passed"]


def _ctx(tmp_path):
    return {"build": str(tmp_path), "python": sys.executable, "gpus": 0, "nccl": None,
            "env": {}, "logs": str(tmp_path), "build_info": None}


def test_a_check_past_its_limit_is_killed_and_failed(tmp_path):
    check = gc._check("sleeper", "s", ["{python}", "-c", "import time; print('started', "
                                       "flush=True); time.sleep(60)"], 60, 1, gpu=False)
    r = gc.run_check(check, _ctx(tmp_path), budget_left=2)
    assert r["status"] == "fail"
    assert r["reason"].startswith("did not finish within 2 s (killed)")
    assert r["seconds"] < 30
    assert "started" in open(tmp_path / "sleeper.log").read()


def test_a_check_gets_its_environment_and_the_build_on_pythonpath(tmp_path):
    check = gc._check("env", "e", ["{python}", "-c", "import os; print(os.environ['A'], "
                                   "os.environ['PYTHONPATH'].split(os.pathsep)[0])"], 30, 1,
                      gpu=False, env={"A": "from-the-check"})
    r = gc.run_check(check, _ctx(tmp_path), budget_left=30)
    assert r["status"] == "pass", r
    assert f"from-the-check {tmp_path}/python" in open(tmp_path / "env.log").read()


def test_a_dry_run_pretending_a_gpu_lists_why_each_check_skips(tmp_path):
    out = tmp_path / "gpu_checks.json"
    build = os.environ.get("STRATA_BUILD_DIR", os.path.join(ROOT, "build"))
    if not os.path.exists(os.path.join(build, "CMakeCache.txt")):
        pytest.skip(f"needs a configured build directory ({build})")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "dev", "gpu_checks.py"),
                    "--no-build", "--build", build, "--assume-gpus", "1", "--assume-nccl",
                    "2.28.9", "--json", str(out)], check=True, capture_output=True, text=True,
                   timeout=240)
    doc = json.loads(out.read_text())
    assert doc["mode"] == "dry-run" and doc["gpus"] == 1
    assert doc["nccl"]["version"] == "2.28.9"
    assert doc["multi_rank"]["2"]["runs"] is False
    checks = doc["checks"]
    assert set(checks) == {"build"} | {c["name"] for c in gc.CHECKS}
    assert all(r["status"] == "skip" for n, r in checks.items() if n != "build")
    assert checks["nccl_gpu_test_np4"]["reason"] == (
        "NCCL 2.28.9 < 2.30: one rank per GPU only (4 ranks need 4 GPUs, 1 visible)")
    assert checks["bench_tp_gpu"]["reason"].startswith("a dry run; would run on 1 rank: NCCL")
    assert checks["nccl_gpu_test"]["reason"] == "a dry run (--dry-run)"


def test_import_puts_a_device_runs_results_into_place(tmp_path, monkeypatch):
    import io
    import tarfile
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_util
    results = tmp_path / "results"
    results.mkdir()
    monkeypatch.setattr(gc, "RESULTS_DIR", str(results))
    monkeypatch.setattr(bench_util, "RESULTS_DIR", str(results))
    monkeypatch.setattr(bench_util, "RESULTS_MD", str(tmp_path / "RESULTS.md"))
    out = tmp_path / "out"
    out.mkdir()
    doc = {"bench": "staging_gpu", "machine": "m", "command": "c", "rows": [
        {"case": "2 GiB", "metric": "copy bandwidth", "unit": "GB/s", "strata": 50.0,
         "peer": "cudaMemcpy", "peer_value": 51.0, "ratio": 0.98, "target": ">= 0.95",
         "met": True}]}
    with tarfile.open(out / "gpu_checks_files.tar.gz", "w:gz") as tar:
        for name, data in (("results/staging_gpu.json", json.dumps(doc)),
                           ("logs/x.log", "log"), ("results/../../evil.json", "{}")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data.encode()))
    assert gc.import_results(str(out), print) == 0
    assert sorted(os.listdir(results)) == ["staging_gpu.json"]
    assert "| 2 GiB | copy bandwidth | GB/s |" in (tmp_path / "RESULTS.md").read_text()
    assert gc.import_results(str(tmp_path), print) == 1  # no archive there


def test_sonames_are_read_from_the_elf_files(tmp_path):
    import glob as g
    libc = [p for p in g.glob("/lib/x86_64-linux-gnu/libc.so.6") + g.glob("/lib64/libc.so.6")]
    if not libc:
        pytest.skip("no x86-64 libc.so.6 here")
    build = importlib.import_module("gpu_checks_build")
    assert build.elf_soname(libc[0]) == "libc.so.6"
    (tmp_path / "libfake.so.1").write_text("not an ELF file")
    assert build.elf_soname(str(tmp_path / "libfake.so.1")) is None
    assert build._sonames([str(tmp_path)]) == {}
