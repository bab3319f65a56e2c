"""Preparing the model on an empty cache, as on a fresh machine: several processes at once (Triton's model
instances, `make run`'s own step) must neither crash nor leave half-written folders behind; that includes
compiling the int8 engine's kernels into the same empty cache."""

import os
import subprocess
import sys

import pytest
from cagflow.engine.kernels import cpu_has_avx512_bf16

pytestmark = pytest.mark.real_model


def test_two_preparers_at_once_on_an_empty_model_cache(tmp_path):
    home = tmp_path / "home"
    env = {**os.environ, "CAGFLOW_HOME": str(home), "CAGFLOW__MODEL__PATH": "smollm2-135m"}  # small: quick
    command = [sys.executable, "-m", "cagflow.cli", "model", "prepare"]
    preparers = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(2)]
    outputs = [preparer.communicate(timeout=900) for preparer in preparers]
    assert [preparer.returncode for preparer in preparers] == [0, 0], outputs
    fingerprints = {line for out, _ in outputs for line in out.splitlines() if line.startswith("fingerprint ")}
    assert len(fingerprints) == 1, outputs
    models = home / "models"
    assert (models / "smollm2-135m" / "config.json").exists()
    assert list((models / "smollm2-135m").glob("*.safetensors"))
    leftovers = [path.name for path in models.iterdir() if path.name.startswith(".smollm2-135m.")
                 and not path.name.endswith(".lock")]
    assert leftovers == []  # no staging folder of either preparer survives
    converted = sum("converted in" in err for _, err in outputs)
    assert converted == 1, outputs  # one converted, the other waited for it or found it done

    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and f"{fingerprints.pop()}\n" in again.stdout + "\n"
    assert "converting" not in again.stderr and "compiling" not in again.stderr
    kernels = list((home / "kernels").glob("fastlm_kernels_*/*.so"))
    # built once, by one of them, where the CPU runs them; elsewhere the engine's PyTorch recipe needs none
    assert bool(kernels) == cpu_has_avx512_bf16()
