#!/usr/bin/env python3
"""Every GPU check of strata as one prepared run (tools/dev/gpu_checks.sh is
the entry point; docs/development.md says how to run it on the device
machine).

The checks are data: CHECKS below lists each one's name, command, time
limit and what it needs (a GPU, a number of NCCL ranks, files of the build).
A run builds what the checks need, decides for each check whether it can
run here (and why not), runs those that can, each under its own time limit,
and writes one JSON result per check to benchmarks/results/gpu_checks.json
(name, status pass/fail/skip, reason, seconds, figures) before printing a
one-screen summary. The benchmarks among the checks also write their own
benchmarks/results/<bench>.json and RESULTS.md sections.

Without a GPU (or with --dry-run) the same run is a dry run: it builds,
lists every check it would run with the reason it skips here, writes the
JSON into the build directory (never over the committed results) and exits
0, so the list cannot rot: a check whose program or script is missing from
a build that has CUDA and NCCL fails the dry run.

Several NCCL ranks on one GPU: NCCL refused that ("Duplicate GPU detected")
up to 2.29; from 2.30 it is an experimental opt-in, NCCL_MULTI_RANK_GPU_ENABLE=1
(NVLS must be off, and NCCL's guide guarantees 2 ranks per GPU with default
settings: more need fewer CTAs per rank, NCCL_MAX_CTAS). The NCCL in use is
strata's own report (strata.nccl.library() after importing torch: torch's
libnccl), and every check gets STRATA_NCCL_LIBRARY set to that file, so C++
programs use the same NCCL as Python. A check of N ranks on fewer GPUs runs
only on NCCL >= 2.30, with those variables set; below, it is skipped with
the reason, and the one-rank checks still run.
"""

import argparse
import datetime
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_checks_build import (ROOT, build_info, build_targets, carried_deps,  # noqa: E402
                              configure, machine_lacks_deps, ninja_targets, nvidia_smi_gpus,
                              pack, parse_version, probe, vstr)
from gpu_checks_run import (RESULTS_DIR, collect, expand, machine, one_line,  # noqa: E402,F401
                            parse_figures, run_check, verdict)

DEFAULT_BUDGET = 480  # seconds: the whole run on the device machine, the build included
RANK_COUNTS = (2, 4, 8)
MULTI_RANK_GPU_SINCE = (2, 30, 0)


# ---- the checks -------------------------------------------------------------------

def _check(name, what, command, timeout, estimate, *, ranks=1, gpu=True, targets=(),
           files=(), env=None, mpirun=False, torch=True, results=None, fallback=None):
    """One check. command: argv with {build} and {python} placeholders;
    timeout: its hard limit (s); estimate: the seconds it is expected to
    take on the device machine (for the run's budget); ranks: NCCL ranks it
    starts (more than the GPUs present needs NCCL's multi-rank mode);
    targets: (CMake target, file under the build directory) it runs; files:
    files of the tree it needs (a check of work not yet merged names its
    files and is skipped until they exist); mpirun / torch: whether it needs
    the Open MPI wheel's mpirun / torch (torchrun); results: the benchmark's
    results/<name>.json whose rows are its figures; fallback: the command on
    one rank, run (saying why) where `ranks` cannot."""
    return {"name": name, "what": what, "command": command, "timeout": timeout,
            "estimate": estimate, "ranks": ranks, "gpu": gpu, "targets": list(targets),
            "files": list(files), "env": dict(env or {}), "mpirun": mpirun, "torch": torch,
            "results": results, "fallback": fallback}


def _torchrun(n, timeout, args):
    """n processes under tests/tools/run_torchrun.sh (C++ programs get a file
    store through STRATA_STORE; Python ones torchrun's TCPStore)."""
    return (["tests/tools/run_torchrun.sh", "--python", "{python}", "--np", str(n),
             "--timeout", str(timeout - 15), "--"] + args)


NCCL_GPU_TEST = ("nccl_gpu_test", "tests/cpp/comm/nccl_gpu_test")
NCCL_FAULT_TEST = ("nccl_fault_test", "tests/cpp/comm/nccl_fault_test")
NCCL_CONFORMANCE_TEST = ("comm_conformance_nccl_test", "tests/cpp/comm/comm_conformance_nccl_test")
NCCL_PIPELINE_TEST = ("nccl_pipeline_test", "tests/multirank/nccl_pipeline_test")
TP_LINEAR_CUDA_TEST = ("tp_linear_cuda_test", "tests/cpp/parallel/tp_linear_cuda_test")
TP_GPU_BENCH = ("tp_gpu_bench", "benchmarks/tp_gpu_bench")
STAGING_GPU_BENCH = ("staging_gpu_bench", "benchmarks/staging_gpu_bench")
# The extension, libstrata, the Python files and the Gloo plugin.
PYTHON_PACKAGE = ("strata_demo", "python/strata/__init__.py")
PYTEST = ["-m", "pytest", "-q", "-p", "no:cacheprovider"]


def _checks():
    """Every check, in the order they run: the one-rank tests first, then
    the fault path and the smallest multi-rank runs, the benchmarks, and the
    larger rank counts last (the budget skips from the end)."""
    c = []
    c.append(_check(
        "nccl_gpu_test", "NCCL backend on the GPU: every collective and dtype, streams, a "
        "stuck collective's deadline, abort, split and shrink (ranks as threads, one per GPU)",
        ["{build}/tests/cpp/comm/nccl_gpu_test"], 180, 20, targets=[NCCL_GPU_TEST],
        torch=False))
    c.append(_check(
        "tp_linear_cuda_test", "tensor-parallel cuBLAS kernels on CUDA memory against the "
        "host kernels", ["{build}/tests/cpp/parallel/tp_linear_cuda_test"], 120, 10,
        targets=[TP_LINEAR_CUDA_TEST], torch=False))
    c.append(_check(
        "py_nccl", "Python: CUDA tensors on the current stream, one NCCL per process",
        ["{python}"] + PYTEST + ["tests/python/test_nccl.py"], 120, 15,
        targets=[PYTHON_PACKAGE]))
    c.append(_check(
        "py_checkpoint_cuda", "Python: checkpoint of CUDA tensors staged through pinned "
        "memory, loaded back onto the GPU",
        ["{python}"] + PYTEST + ["tests/python/test_checkpoint.py", "-k", "cuda"], 120, 15,
        targets=[PYTHON_PACKAGE]))
    c.append(_check(
        "py_data_parallel_cuda", "Python: strata.nn.DataParallel and ZeRO-1 on CUDA tensors "
        "(buckets on a side stream)",
        ["{python}"] + PYTEST + ["tests/python/test_data_parallel_cuda.py"], 180, 20,
        targets=[PYTHON_PACKAGE]))
    c.append(_check(
        "comm_conformance_nccl", "the conformance suite every backend passes, on NCCL (ranks "
        "as threads, one per GPU)", ["{build}/tests/cpp/comm/comm_conformance_nccl_test"], 300,
        40, targets=[NCCL_CONFORMANCE_TEST], torch=False))
    c.append(_check(
        "nccl_fault_np4", "NCCL fault path: rank 1 of 4 SIGKILLed inside an allreduce; the "
        "survivors' watchdog error, abort and re-init; revoke/shrink per NCCL version; a "
        "correct allreduce after each",
        ["{build}/tests/cpp/comm/nccl_fault_test", "--ranks", "4", "--victim", "1"], 300, 50,
        ranks=4, targets=[NCCL_FAULT_TEST], torch=False))
    c.append(_check(
        "nccl_gpu_test_np2", "nccl_gpu_test with 2 ranks as processes",
        _torchrun(2, 180, ["--no-python", "{build}/tests/cpp/comm/nccl_gpu_test"]), 180, 30,
        ranks=2, targets=[NCCL_GPU_TEST]))
    c.append(_check(
        "nccl_pipeline_np2", "pipeline runner over NCCL, stage functions on the GPU ordered "
        "by RunnerOptions::stream: GPipe, 1F1B, interleaved 1F1B against a plain loop",
        _torchrun(2, 180, ["--no-python", "{build}/tests/multirank/nccl_pipeline_test"]), 180,
        25, ranks=2, targets=[NCCL_PIPELINE_TEST], env={"STRATA_TEST_BACKEND": "nccl"}))
    c.append(_check(
        "py_nccl_np2", "test_nccl.py on 2 ranks",
        _torchrun(2, 150, PYTEST + ["tests/python/test_nccl.py"]), 150, 25, ranks=2,
        targets=[PYTHON_PACKAGE]))
    c.append(_check(
        "py_tp_layers_cuda_np2", "strata.nn tensor-parallel layers on CUDA over NCCL against "
        "torch on the same GPU (values), and the column-parallel backward's all-reduce "
        "overlapping the weight-gradient GEMM (kernel times)",
        _torchrun(2, 240, PYTEST + ["-x", "tests/python/mr_tp_layers.py"]), 240, 45, ranks=2,
        targets=[PYTHON_PACKAGE], env={"STRATA_TEST_DEVICE": "cuda"}))
    c.append(_check(
        "bench_staging_gpu", "checkpoint staging GPU -> pinned host against cudaMemcpy into "
        "cudaMallocHost memory", ["{python}", "benchmarks/run_staging_gpu.py", "--build",
                                  "{build}"], 180, 20, targets=[STAGING_GPU_BENCH],
        torch=False, results="staging_gpu"))
    c.append(_check(
        "bench_tp_gpu", "tensor-parallel kernels' throughput against torch.matmul on the same "
        "GPU; the layers on 2 ranks", ["{python}", "benchmarks/run_tp_gpu.py", "--build",
                                       "{build}", "--ranks", "2"], 300, 40, ranks=2,
        targets=[TP_GPU_BENCH], mpirun=True, results="tp_gpu",
        fallback=["{python}", "benchmarks/run_tp_gpu.py", "--build", "{build}", "--ranks", "1"]))
    c.append(_check(
        "bench_nccl_busbw", "NCCL bandwidth, strata against torch.distributed NCCL, same "
        "process, same GPU (one rank: algbw)",
        ["{python}", "benchmarks/run_nccl_busbw.py", "--build", "{build}", "--ranks", "1"], 240,
        30, targets=[PYTHON_PACKAGE], mpirun=True, results="nccl_busbw"))
    c.append(_check(
        "bench_pipeline_cpu", "pipeline bubble and step time against "
        "torch.distributed.pipelining on the machine's quiet cores (CPU, Gloo)",
        ["{python}", "benchmarks/run_pipeline.py", "--build", "{build}", "--rounds", "5",
         "--fixed-ms", "20"], 300, 110, gpu=False,
        targets=[PYTHON_PACKAGE], mpirun=True, results="pipeline"))
    c.append(_check(
        "bench_nccl_busbw_np4", "NCCL busbw on 4 ranks sharing the GPU, strata against "
        "torch.distributed NCCL", ["{python}", "benchmarks/run_nccl_busbw.py", "--build",
                                   "{build}", "--ranks", "4", "--sizes", "1M,16M,64M",
                                   "--name", "nccl_busbw_np4"], 240, 45, ranks=4,
        targets=[PYTHON_PACKAGE], mpirun=True, results="nccl_busbw_np4"))
    c.append(_check(
        "nccl_fault_np2", "NCCL fault path with rank 0 of 2 killed",
        ["{build}/tests/cpp/comm/nccl_fault_test", "--ranks", "2", "--victim", "0"], 240, 35,
        ranks=2, targets=[NCCL_FAULT_TEST], torch=False))
    for n in (4, 8):
        c.append(_check(
            f"nccl_gpu_test_np{n}", f"nccl_gpu_test with {n} ranks as processes",
            _torchrun(n, 240, ["--no-python", "{build}/tests/cpp/comm/nccl_gpu_test"]), 240,
            25 + 5 * n, ranks=n, targets=[NCCL_GPU_TEST]))
        c.append(_check(
            f"nccl_pipeline_np{n}", f"pipeline runner over NCCL on {n} ranks",
            _torchrun(n, 240, ["--no-python", "{build}/tests/multirank/nccl_pipeline_test"]),
            240, 20 + 5 * n, ranks=n, targets=[NCCL_PIPELINE_TEST],
            env={"STRATA_TEST_BACKEND": "nccl"}))
        c.append(_check(
            f"py_nccl_np{n}", f"test_nccl.py on {n} ranks",
            _torchrun(n, 180, PYTEST + ["tests/python/test_nccl.py"]), 180, 20 + 3 * n, ranks=n,
            targets=[PYTHON_PACKAGE]))
        c.append(_check(
            f"py_tp_layers_cuda_np{n}", f"strata.nn layers on CUDA, {n} ranks (tp up to {n})",
            _torchrun(n, 300, PYTEST + ["-x", "tests/python/mr_tp_layers.py"]), 300, 40 + 10 * n,
            ranks=n, targets=[PYTHON_PACKAGE], env={"STRATA_TEST_DEVICE": "cuda"}))
    c.append(_check(
        "bench_nccl_busbw_np8", "NCCL busbw on 8 ranks sharing the GPU",
        ["{python}", "benchmarks/run_nccl_busbw.py", "--build", "{build}", "--ranks", "8",
         "--sizes", "1M,16M,64M", "--name", "nccl_busbw_np8"], 240, 60, ranks=8,
        targets=[PYTHON_PACKAGE], mpirun=True, results="nccl_busbw_np8"))
    # Work of other issues, run here once it has landed (its files exist).
    # The elastic issue's demo on NCCL: its script takes --np and exits 0
    # when the survivors of a killed rank trained on (docs/development.md).
    c.append(_check(
        "elastic_demo_nccl", "the elastic demo on NCCL: a rank killed, the survivors shrink "
        "and keep training (once the elastic issue has landed)",
        ["examples/demo/elastic_nccl.sh", "--np", "4"], 300, 90, ranks=4,
        files=["examples/demo/elastic_nccl.sh"], targets=[PYTHON_PACKAGE]))
    return c


CHECKS = _checks()


# ---- what can run here -------------------------------------------------------------

def multi_rank(ranks, gpus, nccl):
    """How `ranks` NCCL ranks run on `gpus` GPUs: (environment, None), or
    (None, why not)."""
    if gpus <= 0:
        return None, "no GPU visible"
    if ranks <= gpus:
        return {}, None
    version = nccl["version"] if nccl else None
    if version is None:
        return None, (f"{ranks} ranks on {gpus} GPU(s) need NCCL >= 2.30 and the NCCL version "
                      "in use is unknown")
    if version < MULTI_RANK_GPU_SINCE:
        return None, (f"NCCL {vstr(version)} < 2.30: one rank per GPU only ({ranks} ranks need "
                      f"{ranks} GPUs, {gpus} visible)")
    per_gpu = -(-ranks // gpus)
    env = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "0"}
    # NCCL's guide: 2 ranks per GPU work with its defaults; more need fewer
    # channels per rank. A value set by the caller wins.
    if per_gpu > 2 and "NCCL_MAX_CTAS" not in os.environ:
        env["NCCL_MAX_CTAS"] = str(max(1, 16 // per_gpu))
    return env, None


def skip_reason(check, ctx):
    """Why `check` cannot run here, or None. Each need in turn, the first
    unmet one named."""
    for f in check["files"]:
        if not os.path.exists(os.path.join(ROOT, f)):
            return f"{f} is not in this tree yet"
    info = ctx["build_info"]
    for target, path in check["targets"]:
        if not os.path.exists(os.path.join(ctx["build"], path)):
            if info is not None and not (info.get("cuda") and info.get("nccl")):
                return (f"this build has no CUDA/NCCL (CUDA {info.get('cuda')}, NCCL "
                        f"{info.get('nccl')}): {target} is not built")
            return f"{path} is missing from {ctx['build']} (target {target})"
    if check["gpu"] and ctx["gpus"] == 0:
        return "no GPU visible"
    if check["gpu"] and check["ranks"] > 1 and not check["fallback"]:
        _, why = multi_rank(check["ranks"], ctx["gpus"], ctx["nccl"])
        if why:
            return why
    if check["mpirun"] and not ctx["mpirun"]:
        return "no mpirun in this build (install the Open MPI wheel: tools/install_deps.sh)"
    if check["torch"] and not ctx["torch"]:
        return "torch is not installed (torchrun, the reference)"
    return None


# ---- main -------------------------------------------------------------------------

def _base(check, build):
    return {"what": check["what"], "ranks": check["ranks"], "timeout": check["timeout"],
            "command": " ".join(expand(check["command"], os.path.relpath(build, ROOT),
                                       "python3"))}


def rot(check, ctx):
    """What of `check` is missing although it should exist: scripts of the
    tree, and targets of a build that has CUDA and NCCL. [] when sound."""
    if any(not os.path.exists(os.path.join(ROOT, f)) for f in check["files"]):
        return []  # work not merged yet: the check waits for it
    missing = [f"{a} does not exist" for a in check["command"]
               if a.endswith((".py", ".sh")) and not a.startswith("{")
               and not os.path.exists(os.path.join(ROOT, a))]
    info = ctx["build_info"] or {}
    if info.get("cuda") and info.get("nccl") and ctx["known_targets"] is not None:
        missing += [f"target {t} is not defined in {ctx['build']}" for t, _ in check["targets"]
                    if t not in ctx["known_targets"]]
    return missing


def import_results(folder, log):
    """The results of a device run (gpu_checks.json and the archive of
    results/*.json that --out copied) into benchmarks/results/, and
    RESULTS.md regenerated from them."""
    import tarfile
    archive = os.path.join(folder, "gpu_checks_files.tar.gz")
    if not os.path.exists(archive):
        log(f"--import: {archive} is missing")
        return 1
    with tarfile.open(archive) as tar:
        names = [m for m in tar.getmembers()
                 if m.name.startswith("results/") and m.name.endswith(".json") and m.isfile()
                 and "/" not in m.name[len("results/"):]]
        for m in names:
            with tar.extractfile(m) as src, open(os.path.join(RESULTS_DIR,
                                                              os.path.basename(m.name)), "wb") as f:
                f.write(src.read())
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_util
    bench_util.render_results_md()
    log(f"--import: {len(names)} results into {RESULTS_DIR}; RESULTS.md regenerated")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build", help="build directory (default: build)")
    ap.add_argument("--dry-run", action="store_true",
                    help="build, list the checks with why each skips here, run none")
    ap.add_argument("--no-build", action="store_true", help="use the build directory as it is")
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                    help=f"seconds for the whole run, build included (default {DEFAULT_BUDGET})")
    ap.add_argument("--only", help="run only the checks whose name matches this regex")
    ap.add_argument("--out", default=os.environ.get("OUT"),
                    help="copy the results here at the end (default: $OUT when set)")
    ap.add_argument("--json", help="where to write the results (default: "
                    "benchmarks/results/gpu_checks.json; a dry run: <build>/gpu_checks/)")
    ap.add_argument("--carry", default=os.path.join(ROOT, ".gpu-carry"),
                    help="folder of dependencies carried to a machine without registries")
    ap.add_argument("--pack", action="store_true",
                    help="fill --carry here (needs apt and PyPI) for the device machine, then exit")
    ap.add_argument("--device-python", default="3.12",
                    help="the device machine's Python version, for --pack (default 3.12)")
    ap.add_argument("--nccl-source",
                    help="with --pack: an NCCL source tree to build for --cuda-arch and carry "
                         "(for a device machine whose torch has NCCL < 2.30)")
    ap.add_argument("--cuda-arch", default="90",
                    help="with --pack --nccl-source: the GPU architecture (default 90: Hopper)")
    ap.add_argument("--assume-gpus", type=int, help="a dry run that pretends this many GPUs")
    ap.add_argument("--assume-nccl", help="a dry run that pretends this NCCL version is in use")
    ap.add_argument("--import", dest="import_dir", metavar="DIR",
                    help="put the results a device run copied to DIR (its $OUT) into "
                         "benchmarks/results/ and regenerate RESULTS.md, then exit")
    ap.add_argument("--python", default=os.environ.get("PYTHON", sys.executable))
    args = ap.parse_args()
    started = time.monotonic()

    def log(msg):
        print(f"gpu_checks: {msg}", flush=True)

    carry = os.path.abspath(args.carry)
    if args.import_dir:
        return import_results(os.path.abspath(args.import_dir), log)
    if args.pack:
        pack(carry, args.device_python, args.nccl_source, args.cuda_arch, log)
        return 0
    build = os.path.abspath(os.path.join(ROOT, args.build))
    python = args.python
    selected = [c for c in CHECKS if not args.only or re.search(args.only, c["name"])]
    dry = args.dry_run or args.assume_gpus is not None or bool(args.assume_nccl)
    seen = nvidia_smi_gpus()

    # A machine without the build's dependencies and without registries
    # (the device machine) uses what --pack carried there.
    dep_args = []
    if os.path.isdir(carry) and machine_lacks_deps(python):
        dep_args, dep_env = carried_deps(carry, log)
        os.environ.update(dep_env)

    # The build (in a dry run too: what the checks run must still build).
    build_result = {"status": "pass", "reason": "", "seconds": 0.0, "figures": {}}
    if not args.no_build:
        ok, msg = configure(build, python, dep_args, carry, 0 if dry else seen, log)
        build_result["figures"]["configure"] = msg
        if ok:
            known = ninja_targets(build)
            wanted = {t for c in selected for t, _ in c["targets"]}
            if wanted - known:
                build_result["figures"]["not_in_build"] = sorted(wanted - known)
            ok, seconds, msg = build_targets(build, wanted & known, os.cpu_count() or 2, log)
            build_result["seconds"] = round(seconds, 1)
            build_result["figures"]["targets"] = sorted(wanted & known)
        if not ok:
            build_result.update(status="fail", reason=msg)
    info = build_info(build)
    found = probe(python, build)
    nccl = found["nccl"]
    # An NCCL carried for its multi-rank mode replaces torch's older one in
    # every process of the checks (LD_PRELOAD: torch's libtorch_cuda.so then
    # binds to it, and strata uses the copy already loaded).
    carried_nccl = os.path.join(carry, "nccl", "lib", "libnccl.so.2")
    if os.path.exists(carried_nccl) and (nccl is None or nccl["version"] is None
                                         or nccl["version"] < MULTI_RANK_GPU_SINCE):
        before = vstr(nccl["version"]) if nccl else "unknown"
        os.environ["LD_PRELOAD"] = carried_nccl + (" " + os.environ["LD_PRELOAD"]
                                                   if os.environ.get("LD_PRELOAD") else "")
        found = probe(python, build)
        nccl = found["nccl"]
        if nccl:
            nccl["reason"] = (f"carried by --pack, preloaded (LD_PRELOAD) in every check: the "
                              f"NCCL torch brings is {before} < 2.30")
    gpus = found["gpus"]
    if gpus == 0 and not dry:
        log("no GPU visible: a dry run (every check listed with why it skips)")
        dry = True
    if args.assume_gpus is not None:
        gpus = args.assume_gpus
    if args.assume_nccl:
        nccl = {"version": parse_version(args.assume_nccl), "path": None,
                "reason": "--assume-nccl", "source": "--assume-nccl"}
    log(f"{'dry run' if dry else 'run'}: {gpus} GPU(s)"
        + (" (assumed)" if args.assume_gpus is not None else "") + f"; build {build}")
    if nccl:
        log(f"NCCL {vstr(nccl['version'])} from {nccl.get('path') or '-'} ({nccl['reason']})")
    else:
        log("NCCL: unknown (" + found.get("nccl_error", "no strata package or nccl.h") + ")")
    ctx = {"build": build, "python": python, "gpus": gpus, "nccl": nccl, "build_info": info,
           "torch": found["torch"], "env": {},
           "known_targets": ninja_targets(build) if os.path.exists(
               os.path.join(build, "build.ninja")) else None,
           "mpirun": bool(info and info.get("mpiexec") and os.path.exists(info["mpiexec"])),
           "logs": os.path.join(build, "gpu_checks", "logs")}
    if nccl and nccl.get("path"):
        ctx["env"]["STRATA_NCCL_LIBRARY"] = nccl["path"]  # C++ programs use torch's NCCL too
    os.makedirs(ctx["logs"], exist_ok=True)
    multi = {}
    for n in RANK_COUNTS:
        e, why = multi_rank(n, gpus, nccl)
        multi[str(n)] = {"runs": e is not None, "env": e, "why_not": why}
        log(f"{n} NCCL ranks on {gpus} GPU(s): "
            + (("yes" + (" with " + " ".join(f"{k}={v}" for k, v in e.items()) if e else ""))
               if e is not None else f"no: {why}"))

    # The checks.
    results = {"build": build_result}
    rotten = []
    for check in selected:
        name = check["name"]
        rotten += [f"{name}: {m}" for m in rot(check, ctx)]
        why = skip_reason(check, ctx)
        if dry:
            if why is None and check["fallback"] and check["gpu"]:
                _, short = multi_rank(check["ranks"], gpus, nccl)
                why = f"a dry run; would run on 1 rank: {short}" if short else None
            result = dict(_base(check, build), status="skip", seconds=None, figures={},
                          reason=why or "a dry run (--dry-run)")
        elif build_result["status"] != "pass":
            result = dict(_base(check, build), status="skip", seconds=None, figures={},
                          reason="the build failed")
        elif why:
            result = dict(_base(check, build), status="skip", seconds=None, figures={},
                          reason=why)
        else:
            left = args.budget - (time.monotonic() - started)
            if left < check["estimate"]:
                result = dict(_base(check, build), status="skip", seconds=None, figures={},
                              reason=f"the {args.budget:.0f} s budget: {left:.0f} s left, "
                                     f"this check takes about {check['estimate']} s")
            else:
                extra, short = ({}, None)
                if check["gpu"] and check["ranks"] > 1:
                    extra, short = multi_rank(check["ranks"], gpus, nccl)
                fell_back = f"on 1 rank: {short}" if short else None  # only with a fallback
                result = dict(_base(check, build),
                              **run_check(check, ctx, left, extra or {}, fell_back))
        results[name] = result
        if not dry:
            print(one_line(name, result), flush=True)

    total = time.monotonic() - started
    # The results file is also a benchmark results file (bench, machine,
    # command, date, rows: one per check), so RESULTS.md shows the run.
    rows = [{"case": name + (f" ({r['ranks']} ranks)" if r.get("ranks", 1) > 1 else ""),
             "metric": r["status"] + (": " + r["reason"].splitlines()[0][:120]
                                      if r["reason"] else ""),
             "unit": "s", "strata": r.get("seconds"), "peer": None, "peer_value": None,
             "ratio": None, "target": None, "met": None}
            for name, r in results.items()]
    doc = {"bench": "gpu_checks", "mode": "dry-run" if dry else "run",
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "machine": machine(), "command": "tools/dev/gpu_checks.sh " + " ".join(sys.argv[1:]),
           "notes": (f"The prepared GPU run ({'dry run' if dry else 'run'}): {gpus} GPU(s), NCCL "
                     f"{vstr(nccl['version']) if nccl else 'unknown'}"
                     + (f" ({nccl['reason']})" if nccl else "") + "; "
                     + "; ".join(f"{n} ranks on one GPU: "
                                 + ("yes" if m["runs"] else m["why_not"])
                                 for n, m in multi.items())
                     + f". {total:.0f} s of a {args.budget:.0f} s budget. Per check: its status "
                     "and the seconds it took; figures in the JSON (checks)."),
           "rows": rows, "gpus": gpus,
           "nccl": ({"version": vstr(nccl["version"]), "path": nccl.get("path"),
                     "reason": nccl["reason"]} if nccl else None),
           "multi_rank": multi, "budget_s": args.budget, "seconds": round(total, 1),
           "checks": results}
    json_path = os.path.abspath(args.json) if args.json else (
        os.path.join(build, "gpu_checks", "gpu_checks.json") if dry
        else os.path.join(RESULTS_DIR, "gpu_checks.json"))
    os.makedirs(os.path.dirname(json_path), exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")

    # One screen: a line per check.
    counts = {s: sum(1 for r in results.values() if r["status"] == s)
              for s in ("pass", "fail", "skip")}
    print()
    print(f"== gpu checks, {doc['mode']}: {gpus} GPU(s), NCCL "
          f"{vstr(nccl['version']) if nccl else 'unknown'}, {total:.0f} s (budget "
          f"{args.budget:.0f} s)")
    for name, r in results.items():
        print(one_line(name, r))
    print(f"== {counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped; "
          f"results in {os.path.relpath(json_path, ROOT)}, logs in "
          f"{os.path.relpath(ctx['logs'], ROOT)}")
    if args.out:
        collect(args.out, json_path, ctx["logs"], log)
    if rotten:
        print("gpu_checks: FAILED: checks name what does not exist:")
        for r in rotten:
            print("  " + r)
        return 1
    return 1 if counts["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
