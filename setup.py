"""pip install . -> `import strata`.

setup.py drives CMake: it configures a build directory (by default
build/pip-<python version>; STRATA_CMAKE_BUILD_DIR reuses an existing one,
as `make test` does), builds the extension and libstrata, and installs the
CMake component "python" (the extension and libstrata.so) into the package.
Extra CMake arguments go in STRATA_CMAKE_ARGS.
"""

import os
import shlex
import subprocess
import sys
import sysconfig

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build_dir = os.environ.get("STRATA_CMAKE_BUILD_DIR") or os.path.join(
            HERE, "build", f"pip-py{sys.version_info.major}{sys.version_info.minor}")
        build_dir = os.path.abspath(build_dir)
        if not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
            os.makedirs(build_dir, exist_ok=True)
            args = [
                "cmake", "-S", HERE, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release",
                f"-DPython3_EXECUTABLE={sys.executable}",
                "-DSTRATA_BUILD_TESTS=OFF", "-DSTRATA_BUILD_BENCHMARKS=OFF",
            ]
            if subprocess.run(["ninja", "--version"], capture_output=True).returncode == 0:
                args += ["-G", "Ninja"]
            args += shlex.split(os.environ.get("STRATA_CMAKE_ARGS", ""))
            subprocess.run(args, check=True)
        jobs = str(os.cpu_count() or 2)
        subprocess.run(["cmake", "--build", build_dir, "-j", jobs, "--target", "_strata", "strata"],
                       check=True)
        # The component installs into <prefix>/strata/.
        prefix = os.path.abspath(os.path.dirname(os.path.dirname(self.get_ext_fullpath(ext.name))))
        subprocess.run(["cmake", "--install", build_dir, "--component", "python", "--prefix", prefix],
                       check=True)


setup(
    name="strata",
    version="0.1.0",
    description="Embeddable distributed-training runtime: meshes, communicators, "
                "tensor/pipeline parallelism, async checkpoints, in-process recovery",
    package_dir={"": "python"},
    packages=find_packages(where="python"),
    ext_modules=[CMakeExtension("strata._strata")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.9",
    install_requires=["numpy"],
    zip_safe=False,
)
