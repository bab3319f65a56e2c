"""The CLI reports user mistakes as one clear line and exit code 2, never a traceback."""

import json

import pytest

from cagflow.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_missing_manifest(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("CAGFLOW__CACHE__STATE_STORE", f"file://{tmp_path}/store")
    code, _, err = run(capsys, "precompute", "--manifest", str(tmp_path / "nope.yaml"))
    assert code == 2
    assert "manifest not found" in err and "Traceback" not in err


def test_invalid_config_names_the_key(capsys, monkeypatch):
    monkeypatch.setenv("CAGFLOW__CACHE__MAX_RESIDENT_STATES", "-3")
    code, _, err = run(capsys, "config")
    assert code == 2 and "cache.max_resident_states" in err


def test_manifest_errors_are_readable(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("CAGFLOW__CACHE__STATE_STORE", f"file://{tmp_path}/store")
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text("documents:\n  - doc_id: Bad Id\n    version: 1.0\n    tier: fixed\n    title: T\n    path: x.md\n")
    code, _, err = run(capsys, "precompute", "--manifest", str(manifest))
    assert code == 2
    assert "documents.0.doc_id" in err and "documents.0.version" in err


def test_ask_before_any_release(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("CAGFLOW__CACHE__STATE_STORE", f"file://{tmp_path}/store")
    code, _, err = run(capsys, "ask", "What port?", "--doc-id", "skerry-admin-manual")
    assert code == 2 and "no release published" in err


def test_config_prints_effective_values(capsys, monkeypatch):
    monkeypatch.setenv("CAGFLOW__RETRIEVAL__TOP_K", "7")
    code, out, _ = run(capsys, "config")
    assert code == 0 and json.loads(out)["retrieval"]["top_k"] == 7


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["frobnicate"])
    assert exit_info.value.code == 2


def test_precompute_ask_and_rollback(capsys, tmp_path, monkeypatch, tiny_model_dir, corpus_manifest_path):
    monkeypatch.setenv("CAGFLOW__CACHE__STATE_STORE", f"file://{tmp_path}/store")
    monkeypatch.setenv("CAGFLOW__MODEL__PATH", str(tiny_model_dir))
    monkeypatch.setenv("CAGFLOW__CORPUS__MANIFEST", str(corpus_manifest_path))
    code, out, _ = run(capsys, "precompute", "--quiet")
    assert code == 0 and "5 snapshots (5 new, 0 kept)" in out
    first_release = out.split()[1].rstrip(":")
    code, out, _ = run(capsys, "precompute", "--quiet")
    assert code == 0 and f"release {first_release} (unchanged): 5 snapshots (0 new, 5 kept)" in out

    code, out, _ = run(capsys, "ask", "Which port does the web console use?", "--doc-id", "skerry-admin-manual",
                       "--json", "--max-new-tokens", "8")
    cached = json.loads(out)
    assert code == 0 and cached["route"] == "cache" and cached["reused_tokens"] > 1000
    code, out, _ = run(capsys, "ask", "Which port does the web console use?", "--doc-id", "skerry-admin-manual",
                       "--json", "--no-cache", "--max-new-tokens", "8")
    full = json.loads(out)
    assert full["route"] == "full" and full["token_ids"] == cached["token_ids"]

    code, _, err = run(capsys, "ask", "What?", "--doc-id", "no-such-doc")
    assert code == 2 and "not in the active release" in err

    code, out, _ = run(capsys, "precompute", "--quiet", "--doc-id", "support-faq")  # the others are kept
    assert code == 0 and f"release {first_release} (unchanged): 5 snapshots (0 new, 5 kept)" in out
    subset = tmp_path / "subset.yaml"
    subset.write_text(corpus_manifest_path.read_text().split("  - doc_id: operations-incident-policy")[0])
    (tmp_path / "fixed").symlink_to(corpus_manifest_path.parent / "fixed")
    code, out, _ = run(capsys, "precompute", "--quiet", "--manifest", str(subset))  # a different release
    assert code == 0 and "1 snapshots (0 new, 1 kept)" in out and "unchanged" not in out
    code, out, _ = run(capsys, "releases")
    lines = out.splitlines()
    assert len(lines) == 2 and lines[-1].startswith("*")
    code, out, _ = run(capsys, "releases", "--activate", first_release)
    assert code == 0
    code, out, _ = run(capsys, "releases")
    assert out.splitlines()[0] == f"* {first_release}"
    code, _, err = run(capsys, "releases", "--activate", "19990101T000000Z-deadbeef")
    assert code == 2 and "not found" in err
