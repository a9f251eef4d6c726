"""pip install . -> `import strata`, and the `strata-topo` / `strata-ckpt` / `strata-trace` commands.

setup.py drives CMake. It configures a build directory (build/pip-py<version>
in the source tree, so that a second `pip install .` rebuilds only what
changed; STRATA_CMAKE_BUILD_DIR names another), builds the target
strata_python_package (everything the CMake component "python" installs:
the extension, libstrata, the Gloo plugin, the tools) and installs that
component into the package. Extra CMake arguments go in STRATA_CMAKE_ARGS.

pip builds in a fresh temporary environment each time (build isolation), so
nothing in the build directory may point into the previous one: CMake is
configured on every run, and pybind11's headers and CMake files are copied
from the build environment into the build directory (one copy per pybind11
version), which also keeps the compiler command lines, and so ccache's
hits, the same from one install to the next.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
CMAKE_MIN = (3, 25)


def _cmake_version():
    try:
        out = subprocess.run(["cmake", "--version"], capture_output=True, text=True).stdout
    except OSError:
        return None
    m = re.search(r"cmake version (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _build_requirements():
    """CMake and Ninja from PyPI, only where the machine lacks them (they come
    with tools/install_deps.sh, and the PyPI wheels are large)."""
    needed = []
    version = _cmake_version()
    if version is None or version < CMAKE_MIN:
        needed.append("cmake>=%d.%d" % CMAKE_MIN)
    if shutil.which("ninja") is None:
        needed.append("ninja")
    return needed


def _pybind11_dir(build_dir):
    """pybind11's CMake config, from a copy inside the build directory."""
    import pybind11

    src = os.path.dirname(os.path.abspath(pybind11.__file__))
    dst = os.path.join(build_dir, "_deps", "pybind11-" + pybind11.__version__)
    done = os.path.join(dst, ".copied")
    if not os.path.exists(done):
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        open(done, "w").close()
    return os.path.join(dst, "share", "cmake", "pybind11")


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build_dir = os.environ.get("STRATA_CMAKE_BUILD_DIR") or os.path.join(
            HERE, "build", f"pip-py{sys.version_info.major}{sys.version_info.minor}")
        build_dir = os.path.abspath(build_dir)
        version = _cmake_version()
        if version is None or version < CMAKE_MIN:
            raise RuntimeError(
                "building strata needs CMake >= %d.%d on PATH (found %s); tools/install_deps.sh "
                "installs it with the other build dependencies"
                % (CMAKE_MIN + (("%d.%d" % version) if version else "none",)))
        os.makedirs(build_dir, exist_ok=True)
        args = [
            "cmake", "-S", HERE, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={_pybind11_dir(build_dir)}",
            # The package needs the library, the extension and the tools; the
            # tests, benchmarks and the LibTorch adapter are for other uses.
            "-DSTRATA_BUILD_TESTS=OFF", "-DSTRATA_BUILD_BENCHMARKS=OFF", "-DSTRATA_WITH_TORCH=OFF",
        ]
        ninja = shutil.which("ninja")
        if not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")) and ninja:
            args += ["-G", "Ninja"]
        if ninja:
            # The ninja of the previous build environment may be gone.
            args.append(f"-DCMAKE_MAKE_PROGRAM={ninja}")
        args += shlex.split(os.environ.get("STRATA_CMAKE_ARGS", ""))
        subprocess.run(args, check=True)
        jobs = str(os.cpu_count() or 2)
        subprocess.run(["cmake", "--build", build_dir, "-j", jobs, "--target",
                        "strata_python_package"], check=True)
        # The component installs into <prefix>/strata/.
        prefix = os.path.abspath(os.path.dirname(os.path.dirname(self.get_ext_fullpath(ext.name))))
        subprocess.run(["cmake", "--install", build_dir, "--component", "python", "--prefix",
                        prefix], check=True)


setup(
    name="strata",
    version="0.1.0",
    description="Embeddable distributed-training runtime: meshes, communicators, "
                "tensor/pipeline parallelism, async checkpoints, in-process recovery",
    package_dir={"": "python"},
    packages=find_packages(where="python"),
    ext_modules=[CMakeExtension("strata._strata")],
    cmdclass={"build_ext": CMakeBuild},
    entry_points={"console_scripts": ["strata-topo=strata._tools:topo",
                                      "strata-ckpt=strata._tools:ckpt",
                                      "strata-trace=strata.trace:main"]},
    # Asked of pip's build environment by setuptools' PEP 517 backend.
    setup_requires=_build_requirements(),
    python_requires=">=3.9",
    install_requires=["numpy"],
    zip_safe=False,
)
