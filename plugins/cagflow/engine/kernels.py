"""The int8 engine's machine side: its AVX-512-BF16 kernels (``fastlm_kernels.cpp``, compiled once per
source, flags and torch installation), whether the CPU adds AMX tiles for wide blocks, and MKL's strict
reproducible mode, which the torch backend's fp32 GEMMs need so that results do not depend on the thread
count. Importing this module sets that mode."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from pathlib import Path
from typing import Iterator

import torch

from ..config import CACHE_HOME
from ..files import prepare_lock

log = logging.getLogger("cagflow.engine")

_KERNEL_SOURCE = Path(__file__).with_name("fastlm_kernels.cpp")
_KERNEL_HEADERS = (Path(__file__).with_name("fastlm_q4k.h"),)  # included by the source: part of its hash
# -fopenmp: at::parallel_for is inlined into the extension; without it the kernels run on one thread. The
# extension then links libgomp.so.1, which resolves to the copy torch has already loaded (one runtime).
# -mamx-*: only mm_int8_amx uses tiles (the compiler never emits them on its own), so the library loads on any
# AVX-512-BF16 CPU and that kernel is called only where ``amx_ready`` says so.
_NATIVE_CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512bf16", "-mfma",
                  "-mamx-tile", "-mamx-bf16", "-fopenmp"]

_native = None
_native_error: str | None = None


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (empty where /proc/cpuinfo is unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


def cpu_has_avx512_bf16() -> bool:
    return {"avx512_bf16", "avx512bw"} <= cpu_flags()


def amx_ready() -> bool:
    """Whether wide blocks can run on AMX tiles: the CPU has AMX-BF16, the kernels are built and the OS grants
    this process the tile state. ``CAGFLOW_AMX=0`` says no, so that a fleet whose CPUs differ can run one
    recipe (a snapshot is reused only by the recipe that made it)."""
    if os.environ.get("CAGFLOW_AMX", "1") == "0" or not {"amx_bf16", "amx_tile"} <= cpu_flags():
        return False
    kernels = native_kernels()
    return kernels is not None and bool(kernels.amx_ready())


def kernel_build_dir() -> Path:
    """Where this kernel source, built with these flags against this torch installation, lives. Each torch
    installation (a virtual environment) gets its own folder: ninja rebuilds whenever the build command
    changes, so two environments sharing one folder would rebuild it back and forth. (Triton's stub
    environment uses the main environment's torch, so it shares that folder.)"""
    environment = f"{' '.join(_NATIVE_CFLAGS)} {torch.__version__} {Path(torch.__file__).parent}".encode()
    source = b"".join(path.read_bytes() for path in (_KERNEL_SOURCE, *_KERNEL_HEADERS))
    digest = hashlib.sha256(source + environment).hexdigest()[:12]
    return CACHE_HOME / "kernels" / f"fastlm_kernels_{digest}"


@contextlib.contextmanager
def _pinned_ninja() -> Iterator[None]:
    """The requirements' ninja first on PATH while building. ninja keeps a hash of each build command and
    versions hash differently: a process whose PATH finds another ninja (Triton's stub finds this
    environment's, a shell Debian's) would rebuild the kernels (~30 s) each time the other had built them."""
    try:
        import ninja
    except ImportError:  # torch's build then finds whichever ninja there is, or says none is
        yield
        return
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path])
    try:
        yield
    finally:
        os.environ["PATH"] = path


def native_kernels():
    """The compiled kernel module, or None (``native_error()`` says why). Compiled once per source hash."""
    global _native, _native_error
    if _native is not None or _native_error is not None:
        return _native
    if not cpu_has_avx512_bf16():
        _native_error = "CPU lacks avx512_bf16"
        return None
    try:
        from torch.utils.cpp_extension import load

        build = kernel_build_dir()
        name = build.name
        # Our flock, not only torch's lock file: torch waits forever on a lock file left by a build that was
        # killed; under the flock no other builder is alive, so such a file is stale and can go.
        with prepare_lock(build), _pinned_ninja():
            build.mkdir(parents=True, exist_ok=True)
            (build / "lock").unlink(missing_ok=True)
            if not any(build.glob("*.so")):
                log.warning("compiling the int8 engine's kernels into %s (once, under a minute)", build)
            _native = load(name=name, sources=[str(_KERNEL_SOURCE)], extra_cflags=_NATIVE_CFLAGS,
                           extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)
    except Exception as exc:  # no compiler, no headers, ...: fall back to the torch backend
        _native_error = f"{type(exc).__name__}: {exc}"
        log.warning("int8 engine: native kernels unavailable (%s); using the slower torch backend", _native_error)
    return _native


def native_error() -> str | None:
    return _native_error


_MKL_CBWR_AUTO, _MKL_CBWR_STRICT, _MKL_CBWR_ALL = 2, 0x10000, -1


def _strict_mkl() -> str | None:
    """Switch MKL to strict reproducibility (GEMM results independent of the thread count); None when it is
    on, else why not. Must run before the process's first MKL call, so it runs when this module is imported;
    children inherit it through MKL_CBWR."""
    import ctypes

    os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
    try:
        library = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        get, set_ = library.mkl_serv_cbwr_get, library.mkl_serv_cbwr_set
    except (OSError, AttributeError):
        return "torch's BLAS is not MKL"
    strict = _MKL_CBWR_AUTO | _MKL_CBWR_STRICT
    if get(ctypes.c_int(_MKL_CBWR_ALL)) & _MKL_CBWR_STRICT or set_(ctypes.c_int(strict)) == 0:
        return None
    return ("MKL ran before cagflow.engine.kernels was imported, so its strict reproducible mode could not be set "
            "(set MKL_CBWR=AUTO,STRICT in the environment, or import cagflow.engine.kernels first)")


MKL_STRICT_ERROR = _strict_mkl()  # None: MKL runs in strict reproducible mode
