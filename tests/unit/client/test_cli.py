"""The CLI reports user mistakes as one clear line and exit code 2, never a traceback."""

import json
import re
import stat
import subprocess
import sys

import pytest
from cagflow.cli import build_parser, main
from cagflow.router import apikeys
from cagflow.router.apikeys import ApiKeyStore
from cagflow.store.manifests import CorpusManifest


# The REST API's answer record, as the README documents it; ``ask --local --json`` prints the same.
ANSWER_FIELDS = {"answer", "answered", "decline_reason", "route", "route_reason", "cache_hit", "fallback_reason",
                 "snapshot", "citations", "suggestions", "unsupported_figures", "scope_score", "best_score", "relevance",
                 "answer_source", "release_id", "finish_reason", "timings_ms", "tokens", "request_id", "trace_id",
                 "rules_fired"}


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
    code, _, err = run(capsys, "ask", "What port?", "--doc-id", "skerry-admin-manual", "--local")
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
    made = re.search(r"(\d+) snapshots \((\d+) new, 0 kept\)", out)
    fixed = len(CorpusManifest.load(corpus_manifest_path).tier("fixed"))
    assert code == 0 and made and int(made[1]) == int(made[2]) >= fixed  # a document too long is split in parts
    snapshots = int(made[1])
    first_release = out.split()[1].rstrip(":")
    code, out, _ = run(capsys, "precompute", "--quiet")
    assert code == 0 and f"release {first_release} (unchanged): {snapshots} snapshots (0 new, {snapshots} kept)" in out

    code, out, _ = run(capsys, "ask", "Which port does the web console use?", "--doc-id", "skerry-admin-manual",
                       "--json", "--max-new-tokens", "8", "--local")
    cached = json.loads(out)
    assert code == 0 and cached["route"] == "cache" and cached["tokens"]["reused"] > 1000
    # the API's answer record (tests/integration/test_router.py); the tiny model's words, declined, kept too
    assert set(cached) - {"model_answer"} == ANSWER_FIELDS and ("model_answer" not in cached or not cached["answered"])
    assert cached["snapshot"]["doc_id"] == "skerry-admin-manual" and cached["release_id"] == first_release
    code, out, _ = run(capsys, "ask", "Which port does the web console use?", "--doc-id", "skerry-admin-manual",
                       "--json", "--no-cache", "--max-new-tokens", "8", "--local")
    full = json.loads(out)
    assert full["route"] == "full" and full["tokens"]["reused"] == 0
    assert (full["answer"], full["tokens"]["generated"]) == (cached["answer"], cached["tokens"]["generated"])

    code, _, err = run(capsys, "ask", "What?", "--doc-id", "no-such-doc", "--local")
    assert code == 2 and "not in the active release" in err

    code, out, _ = run(capsys, "precompute", "--quiet", "--doc-id", "support-faq")  # the others are kept
    assert code == 0 and f"release {first_release} (unchanged): {snapshots} snapshots (0 new, {snapshots} kept)" in out
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


@pytest.fixture
def key_files(tmp_path, monkeypatch):
    """The keys file, the audit log and the client credentials file, all in tmp_path."""
    monkeypatch.setenv("CAGFLOW__SERVICE__API_KEYS_FILE", str(tmp_path / "api-keys.json"))
    monkeypatch.setenv("CAGFLOW__SERVICE__AUDIT_LOG_FILE", str(tmp_path / "audit.jsonl"))
    monkeypatch.setattr(apikeys, "CREDENTIALS_FILE", tmp_path / "credentials.json")
    for name in ("CAGFLOW_API_KEY", "CAGFLOW_API_KEY_FILE", "CAGFLOW_ADMIN_KEY", "CAGFLOW_ADMIN_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    return ApiKeyStore(tmp_path / "api-keys.json"), tmp_path / "credentials.json"


def test_keys_create_list_revoke(capsys, key_files):
    store, _ = key_files
    code, _, err = run(capsys, "keys", "list")
    assert code == 0 and "no API keys in" in err
    code, out, err = run(capsys, "keys", "create", "--name", "billing-app", "--admin")
    plaintext = out.strip()
    record = store.verify(plaintext)
    assert code == 0 and record.admin and f"created admin key {record.key_id} (billing-app)" in err
    code, out, _ = run(capsys, "keys", "list")
    assert code == 0 and out.split()[:2] == [record.key_id, "admin"] and "billing-app" in out
    assert plaintext not in out and store.path.read_text() not in out
    code, out, _ = run(capsys, "keys", "revoke", record.key_id)
    assert code == 0 and f"revoked key {record.key_id}" in out and store.verify(plaintext) is None
    code, _, err = run(capsys, "keys", "revoke", record.key_id)
    assert code == 2 and "no API key with id" in err


def test_keys_rotate_overlaps_and_every_change_is_audited(capsys, key_files, tmp_path):
    store, _ = key_files
    code, out, _ = run(capsys, "keys", "create", "--name", "billing-app", "--expires", "30d")
    first = out.strip()
    code, out, err = run(capsys, "keys", "rotate", "billing-app", "--overlap", "2h")
    second = out.strip()
    old, new = store.verify(first), store.verify(second)
    assert code == 0 and old and new and (old.name, new.name) == ("billing-app", "billing-app")
    assert f"{old.key_id} until {old.expires}" in err and f"then `cagflow keys revoke {old.key_id}`" in err
    code, out, _ = run(capsys, "keys", "list")
    assert f"expires {old.expires}" in out and "no expiry" in out and second not in out
    code, _, err = run(capsys, "keys", "rotate", "billing-app")
    assert code == 2 and "2 keys are named 'billing-app'" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as refused:
        main(["keys", "rotate", old.key_id, "--overlap", "soon"])
    assert refused.value.code == 2 and "invalid duration 'soon'" in capsys.readouterr().err
    run(capsys, "keys", "revoke", old.key_id)
    code, out, _ = run(capsys, "keys", "init-local")
    local_keys = [out.split(label)[1].split()[0] for label in ("user key:", "admin key:")]
    audit = (tmp_path / "audit.jsonl").read_text()
    events = [json.loads(line) for line in audit.splitlines()]
    assert [(event["action"], event["result"], event["target"]) for event in events] == [
        ("keys.create", "ok", old.key_id), ("keys.rotate", "ok", old.key_id), ("keys.rotate", "error", "billing-app"),
        ("keys.revoke", "ok", old.key_id),
        ("keys.init-local", "ok", ", ".join(store.verify(key).key_id for key in local_keys))]
    assert events[1]["detail"] == {"name": "billing-app", "new_key_id": new.key_id, "old_expires": old.expires,
                                   "expires": None}
    assert "2 keys are named" in events[2]["reason"]
    assert all(event["via"] == "cli" and event["user"] and event["remote_addr"] is None for event in events)
    assert not [key for key in [first, second, *local_keys] if key.split("_", 2)[2] in audit]


def test_keys_init_local_prints_keys_once(capsys, key_files):
    store, credentials = key_files
    code, out, _ = run(capsys, "keys", "init-local")
    user_key = out.split("user key:")[1].split()[0]
    admin_key = out.split("admin key:")[1].split()[0]
    assert code == 0 and not store.verify(user_key).admin and store.verify(admin_key).admin
    assert stat.S_IMODE(credentials.stat().st_mode) == 0o600
    code, out, _ = run(capsys, "keys", "init-local")
    assert code == 0 and "already exist" in out and str(credentials) in out and user_key not in out


def test_a_corrupt_keys_file_is_a_clear_error(capsys, key_files):
    store, _ = key_files
    store.path.write_text("{oops")
    code, _, err = run(capsys, "keys", "list")
    assert code == 2 and "is not valid JSON" in err and "Traceback" not in err


def test_bench_without_opensearch_says_how_to_start_it(capsys, monkeypatch):
    from cagflow.devstack.process import free_port

    monkeypatch.setenv("CAGFLOW__RETRIEVAL__ENDPOINT", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("CAGFLOW__RETRIEVAL__TIMEOUT_S", "1")
    code, _, err = run(capsys, "bench", "routing")
    assert code == 2 and "`cagflow opensearch up`" in err and len(err.splitlines()) == 1


def test_bench_lists_its_benchmarks_and_each_has_only_its_own_options(capsys):
    with pytest.raises(SystemExit) as shown:
        main(["bench", "--help"])
    listed = capsys.readouterr().out
    assert shown.value.code == 0
    assert all(name in listed for name in ("retrieval", "routing", "engine", "answers", "load", "faults"))
    with pytest.raises(SystemExit):
        main(["bench", "answers", "--help"])
    answers = capsys.readouterr().out
    assert "--precisions" in answers and "--dataset" in answers and "--soak" not in answers and "--peer" not in answers
    with pytest.raises(SystemExit) as refused:
        main(["bench", "load", "--precisions"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "Traceback" not in err
    assert "cagflow bench load: error: unrecognized arguments: --precisions" in err
    with pytest.raises(SystemExit) as missing:
        main(["bench"])
    assert missing.value.code == 2 and "cagflow bench: error:" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "expected"), [
    (["engine", "--document-tokens", "2048", "7800"], {"model": None, "runs": 3, "peer": None,
                                                        "document_tokens": [2048, 7800]}),
    (["plot", "a.json", "b.json"], {"results": ["a.json", "b.json"], "out": "bench/ttft-per-route.png"}),
    (["load", "--soak", "600"], {"clients": None, "duration": 60, "soak": 600, "soak_clients": 4, "soak_pause": 1.0,
                                 "max_new_tokens": None, "stream_share": 0.2, "pid": None}),
    (["faults", "--scenario", "s3-outage"], {"scenario": ["s3-outage"], "fault_doc_id": None, "model": None,
                                             "clients": None, "max_new_tokens": None}),
    (["retrieval"], {}),
])
def test_each_benchmark_parses_its_options_with_their_defaults(argv, expected):
    args = vars(build_parser().parse_args(["bench", *argv]))
    assert {key: value for key, value in args.items() if key not in ("config", "command", "which", "run")} == expected


def test_the_command_runs_as_a_module():
    """`python -m cagflow.cli` is how the local router and the fault bench start `cagflow serve` and `precompute`."""
    shown = subprocess.run([sys.executable, "-m", "cagflow.cli", "bench", "faults", "--help"], capture_output=True,
                           text=True, timeout=60)
    assert shown.returncode == 0 and "--fault-doc-id" in shown.stdout
