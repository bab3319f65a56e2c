"""The llama.cpp peer of `cagflow bench engine --peer llama-cpp`: the alternative a CPU user would pick,
run in the same benchmark on the same GGUF file, prompts and thread count.

llama-cpp-python is installed on demand into a virtual environment of its own (it is not a dependency of
CAGFlow, and its wheel is built from source here, with the machine's native instruction set), and runs
``llama_cpp_runner.py`` there; the two processes never share an interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import venv
from pathlib import Path

from ..config import CACHE_HOME
from ..engine.kernels import cpu_flags
from ..errors import CagflowError

PEER_PACKAGE = "llama-cpp-python==0.3.36"
PEER_VENV = CACHE_HOME / "llama-cpp-venv"
RUNNER = Path(__file__).with_name("llama_cpp_runner.py")
BUILT_WITH = PEER_VENV / ".cmake-args"
# Its AMX matmul stops with an illegal instruction (``tilezero`` in a worker thread, tile permission granted) on
# an AMX CPU here, so there it is built for the CPU's AVX-512 features without AMX: llama.cpp's usual CPU path.
AVX512_WITHOUT_AMX = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON "
                      "-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON")


class PeerUnavailable(CagflowError, RuntimeError):
    """llama-cpp-python could not be installed or run; the benchmark reports it and goes on without it."""

    code = "peer_unavailable"


def _peer_python() -> Path:
    return PEER_VENV / "bin" / "python"


def cmake_args(flags: set[str]) -> str:
    """How the peer is built for a CPU with these flags: natively, except on AMX CPUs (see ``AVX512_WITHOUT_AMX``)."""
    return AVX512_WITHOUT_AMX if "amx_tile" in flags else "-DGGML_NATIVE=ON"


def _installed() -> bool:
    python = _peer_python()
    if not python.exists() or not BUILT_WITH.exists() or BUILT_WITH.read_text() != cmake_args(cpu_flags()):
        return False
    probe = subprocess.run([str(python), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                           capture_output=True, text=True)
    return probe.returncode == 0 and probe.stdout.strip() == PEER_PACKAGE.split("==")[1]


def ensure_peer() -> Path:
    """The peer's interpreter, installing llama-cpp-python from source first when needed (minutes, once)."""
    if _installed():
        return _peer_python()
    print(f"installing {PEER_PACKAGE} into {PEER_VENV}, built from source for this CPU (several minutes, once)...",
          file=sys.stderr, flush=True)
    started = time.perf_counter()
    if not _peer_python().exists():
        venv.EnvBuilder(with_pip=True, clear=True).create(PEER_VENV)
    args = cmake_args(cpu_flags())
    env = {**os.environ, "CMAKE_ARGS": args, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)}
    install = subprocess.run([str(_peer_python()), "-m", "pip", "install", "-q", "--force-reinstall", "--no-cache-dir",
                              "--no-binary", "llama-cpp-python", PEER_PACKAGE, "numpy"],
                             env=env, capture_output=True, text=True)
    if install.returncode == 0:
        BUILT_WITH.write_text(args)
    if install.returncode != 0 or not _installed():
        tail = (install.stderr or install.stdout).strip().splitlines()[-5:]
        raise PeerUnavailable(f"could not build {PEER_PACKAGE}: {' / '.join(tail) or 'unknown error'}")
    print(f"  built in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return _peer_python()


def run_peer(gguf: Path, threads: int, n_ctx: int, cases: list[dict], new_tokens: int, stop_ids: list[int],
             state_dir: Path) -> dict:
    """Time one run of each of ``cases`` (``name``, ``prefix_ids``, ``question_ids``) on llama.cpp; see
    ``llama_cpp_runner``.
    ``stop_ids`` end an answer (the time to the first of them is reported; decoding goes on past it); the
    prefix states are kept in ``state_dir`` for the next call with the same cases."""
    python = ensure_peer()
    job = {"gguf": str(gguf), "threads": threads, "n_ctx": n_ctx, "cases": cases, "new_tokens": new_tokens,
           "stop_ids": stop_ids, "state_dir": str(state_dir)}
    result = subprocess.run([str(python), str(RUNNER)], input=json.dumps(job), capture_output=True, text=True)
    if result.returncode != 0:
        raise PeerUnavailable(f"llama.cpp run failed: {result.stderr.strip()[-500:]}")
    return json.loads(result.stdout)
