"""Builds qspec_ext._C with CMake + ninja (the build definition is CMakeLists.txt).

Environment:
  QSPEC_CUDA=0|1       force the CUDA kernels off / on (default: on when nvcc and a
                       CUDA build of torch are present; a visible GPU is not needed)
  QSPEC_CUDA_ARCHS     arch list, TORCH_CUDA_ARCH_LIST syntax (default 8.0;9.0;10.0;12.0+PTX)
  CUDA_HOME            CUDA prefix (default: /usr/local/cuda, else found from nvcc)
  MAX_JOBS             parallel compile jobs
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
DEFAULT_CUDA_ARCHS = "8.0;9.0;10.0;12.0+PTX"


def find_cuda_home() -> Path | None:
    if os.environ.get("CUDA_HOME"):
        return Path(os.environ["CUDA_HOME"])
    if Path("/usr/local/cuda/bin/nvcc").exists():
        return Path("/usr/local/cuda")
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    # nvcc may be a wrapper script: ask it where the toolkit really is.
    out = subprocess.run([nvcc, "--dryrun", "--version"], capture_output=True, text=True)
    for line in (out.stdout + out.stderr).splitlines():
        if "TOP=" in line:
            return Path(line.split("TOP=", 1)[1].strip())
    return Path(nvcc).resolve().parent.parent


def cuda_choice() -> tuple[bool, Path | None]:
    import torch

    cuda_home = find_cuda_home()
    possible = torch.version.cuda is not None and cuda_home is not None and (cuda_home / "bin" / "nvcc").exists()
    forced = os.environ.get("QSPEC_CUDA")
    if forced not in (None, "", "0", "1"):
        sys.exit(f"qspec_ext setup: QSPEC_CUDA must be 0 or 1, got {forced!r}")
    if forced == "1" and not possible:
        sys.exit(
            "qspec_ext setup: QSPEC_CUDA=1 but the CUDA kernels cannot be built: "
            f"torch.version.cuda={torch.version.cuda!r}, nvcc under CUDA_HOME={cuda_home}"
        )
    want = possible if forced in (None, "") else forced == "1"
    return want, cuda_home


def build_tool(name: str) -> str:
    """The build environment's own cmake / ninja (the pip packages' binaries, or the scripts next to
    this Python) before anything on PATH: a system cmake may be older than the 3.26 we need."""
    candidates = []
    try:
        module = __import__(name)
        candidates.append(Path(getattr(module, "CMAKE_BIN_DIR" if name == "cmake" else "BIN_DIR")) / name)
    except (ImportError, AttributeError):
        pass
    candidates.append(Path(sys.executable).parent / name)
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(name)
    if found is None:
        sys.exit(f"qspec_ext setup: {name} not found: pip install \"cmake>=3.26\" ninja")
    return found


class CMakeExtension(Extension):
    def __init__(self, name: str):
        # _C is an abi3 module (Python's stable ABI from 3.10) on torch's stable ABI: one wheel for
        # every CPython >= 3.10 and every torch >= 2.10.
        super().__init__(name, sources=[], py_limited_api=True)


class CMakeBuild(build_ext):
    def build_extension(self, ext: CMakeExtension) -> None:
        with_cuda, cuda_home = cuda_choice()
        archs = os.environ.get("QSPEC_CUDA_ARCHS") or DEFAULT_CUDA_ARCHS
        extdir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_temp = Path(self.build_temp) / ext.name
        build_temp.mkdir(parents=True, exist_ok=True)
        args = [
            f"-S{ROOT}",
            f"-B{build_temp}",
            "-GNinja",
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={extdir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DQSPEC_VERSION={self.distribution.get_version()}",
            f"-DQSPEC_CUDA={'ON' if with_cuda else 'OFF'}",
            f"-DQSPEC_CUDA_ARCHS={archs}",
            f"-DCMAKE_MAKE_PROGRAM={build_tool('ninja')}",
        ]
        if with_cuda:
            args += [
                f"-DCUDAToolkit_ROOT={cuda_home}",
                f"-DCUDA_TOOLKIT_ROOT_DIR={cuda_home}",
                f"-DCMAKE_CUDA_COMPILER={cuda_home / 'bin' / 'nvcc'}",
            ]
        print(f"qspec_ext setup: CUDA kernels {'ON, archs ' + archs if with_cuda else 'OFF'}", flush=True)
        if not with_cuda:  # CMake builds no _C_cuda.so: an earlier build's must not ship or load
            (extdir / "_C_cuda.so").unlink(missing_ok=True)
        cmake = build_tool("cmake")
        subprocess.run([cmake, *args], check=True)
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        subprocess.run([cmake, "--build", str(build_temp), "-j", jobs], check=True)

    def copy_extensions_to_source(self) -> None:
        """In-place and editable builds: _C, and beside it the CUDA kernels' library CMake built."""
        super().copy_extensions_to_source()
        built = Path(self.build_lib) / "qspec_ext" / "_C_cuda.so"
        package = Path(self.get_finalized_command("build_py").get_package_dir("qspec_ext"))
        for stale in package.glob("_C.cpython-*.so"):  # an older, version-specific build: Python would import it first
            stale.unlink()
        if built.exists():
            shutil.copy2(built, package / built.name)
        else:  # a build without CUDA kernels must not leave an older build's library to load
            (package / built.name).unlink(missing_ok=True)


setup(
    ext_modules=[CMakeExtension("qspec_ext._C")],
    cmdclass={"build_ext": CMakeBuild},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
