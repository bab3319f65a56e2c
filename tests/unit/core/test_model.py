import json
import shutil

import pytest
from cagflow.core import model
from cagflow.core.model import ModelError, model_fingerprint, resolve_model_dir


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
