import hashlib
import json
import shutil

import pytest
from cagflow.engine import model
from cagflow.engine.engine import Engine
from cagflow.engine.model import (ModelError, Preset, find_preset, identify_model, load_model, model_fingerprint,
                                resolve_model_dir)
from cagflow.answering.prompt import Passage


def test_fingerprint_follows_everything_that_shapes_the_cache(tiny_model_dir, tmp_path, monkeypatch):
    base = model_fingerprint(tiny_model_dir)
    assert model_fingerprint(tiny_model_dir) == base  # stable (and memoised weight hashes agree)

    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    assert model_fingerprint(copy) == base
    config = json.loads((copy / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (copy / "config.json").write_text(json.dumps(config))
    assert model_fingerprint(copy) != base

    monkeypatch.setattr(model, "TEMPLATE_VERSION", "another-template")
    assert model_fingerprint(tiny_model_dir) != base
    monkeypatch.undo()
    monkeypatch.setattr(model, "PARSER_VERSION", "another-parser")
    assert model_fingerprint(tiny_model_dir) != base


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelError, match="not a preset"):
        resolve_model_dir(str(tmp_path / "missing"))
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model_dir(str(tmp_path))


def test_earlier_preset_names_resolve_to_the_renamed_preset_and_its_folder(tiny_model_dir, tmp_path, monkeypatch):
    """A deployment configured with an earlier name keeps its prepared folder, hence its fingerprint and
    snapshots: the folder is named by the preset, not by the name in the configuration."""
    monkeypatch.setattr(model, "CACHE_HOME", tmp_path)
    for earlier, name in (("qwen2.5-1.5b", "qwen2.5-coder-1.5b"), ("qwen2.5-0.5b", "qwen2.5-coder-0.5b")):
        assert find_preset(earlier) is find_preset(name) is model.PRESETS[name]
        prepared = tmp_path / "models" / earlier  # the folder a deployment of the earlier name already has
        prepared.parent.mkdir(exist_ok=True)
        prepared.symlink_to(tiny_model_dir)
        assert resolve_model_dir(earlier) == resolve_model_dir(name) == prepared
        assert model_fingerprint(resolve_model_dir(earlier)) == model_fingerprint(resolve_model_dir(name))
    assert find_preset("smollm2-135m").folder == "smollm2-135m"
    assert find_preset(str(tiny_model_dir)) is None


def _write_part_packages(root, parts: list[bytes]) -> tuple[str, ...]:
    """Packages shaped like the GGUF part packages: each module's ``get_part_path()`` names its part."""
    names = []
    for number, data in enumerate(parts, 1):
        package = root / f"gguf_test_part{number}"
        package.mkdir()
        (package / "part.bin").write_bytes(data)
        (package / "__init__.py").write_text(
            "from pathlib import Path\n\ndef get_part_path():\n    return Path(__file__).with_name('part.bin')\n")
        names.append(package.name)
    return tuple(names)


def test_a_preset_gguf_is_used_only_with_its_pinned_sha256(tmp_path, monkeypatch):
    parts = [b"GGUF first part ", b"second part"]
    names = _write_part_packages(tmp_path, parts)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(model, "CACHE_HOME", tmp_path / "home")
    (tmp_path / "home" / "models").mkdir(parents=True)
    pinned = hashlib.sha256(b"".join(parts)).hexdigest()
    joined = Preset("test-joined", "two parts", names[0], names, pinned, folder="test-joined")
    assert model._preset_gguf(joined).read_bytes() == b"".join(parts)

    wrong = Preset("test-wrong", "two parts", names[0], names, "0" * 64, folder="test-wrong")
    with pytest.raises(ModelError, match="sha256") as error:
        model._preset_gguf(wrong)
    assert "\n" not in str(error.value) and "reinstall gguf-test-part1" in str(error.value)
    assert sorted(path.name for path in (tmp_path / "home" / "models").iterdir()) == ["test-joined.gguf"]

    single = Preset("test-single", "one file", names[1], ("part.bin",), "0" * 64, folder="test-single")
    with pytest.raises(ModelError, match="sha256 .*not the pinned"):
        model._preset_gguf(single)


def test_every_preset_pins_a_sha256_and_smollm2s_file_matches_it():
    assert all(len(preset.sha256) == 64 for preset in model.PRESETS.values())
    smollm2 = model.PRESETS["smollm2-135m"]
    assert model._preset_gguf(smollm2).name == "SmolLM2-135M-Instruct.Q4_1.gguf"  # the installed file passes


@pytest.mark.real_model
def test_a_local_gguf_file_loads_and_answers_with_the_fingerprint_of_the_same_model(tmp_path, monkeypatch):
    """``model.path`` naming a .gguf file of any name: converted once, loaded by the service's loader, and
    known by its content: the same GGUF as a preset has the preset's fingerprint (so its snapshots)."""
    preset_fingerprint = identify_model("smollm2-135m", "fp32")[2]
    gguf = tmp_path / "my-assistant-model.gguf"
    gguf.symlink_to(model._preset_gguf(model.PRESETS["smollm2-135m"]))
    monkeypatch.setattr(model, "CACHE_HOME", tmp_path / "home")  # converted here, not in the user's cache

    loaded = load_model(str(gguf), precision="fp32")
    assert loaded.path.parent == tmp_path / "home" / "models" and loaded.path.name.startswith("my-assistant-model-")
    assert loaded.fingerprint == preset_fingerprint
    engine = Engine(loaded, max_context_tokens=512, max_new_tokens=12, question_budget_tokens=64)
    passage = Passage("The Skerry web console listens on port 8443.", "Skerry manual", "Console")
    answer = engine.answer("Which port does the web console use?", context=[passage])
    assert answer.text.strip()
