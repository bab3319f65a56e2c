"""Least privilege on a real SeaweedFS: the pipeline's writer credentials may change the store, the serving
side's reader credentials may only read and list it, and the server itself refuses the rest.

A server of its own: its role grants are scoped to one bucket, which the shared session server's are not.
"""

from __future__ import annotations

import logging
import secrets
import stat
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from cagflow.config import S3Config, load_config
from cagflow.devstack.seaweedfs import LocalSeaweedFS
from cagflow.inference.service import AnswerRequest, CagService, ServedAnswer, ServingSettings
from cagflow.router.access import ApiError
from cagflow.router.routing import Router
from cagflow.store.backends import NotFound, S3Store, StoreForbidden, open_store
from cagflow.store.layout import heat_object

pytestmark = pytest.mark.integration

BUCKET = "cagflow-roles"
OTHER_BUCKET = "cagflow-elsewhere"
PREFIX = "states"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    with LocalSeaweedFS(tmp_path_factory.mktemp("seaweedfs-roles"), secrets.token_hex(10), secrets.token_hex(20),
                        buckets=[BUCKET]) as running:
        running.create_bucket(BUCKET)
        running.create_bucket(OTHER_BUCKET)
        yield running


@pytest.fixture
def role_env(server: LocalSeaweedFS, monkeypatch: pytest.MonkeyPatch):
    """Both roles' keys as the processes get them; no AWS_* keys, so nothing falls back to the admin's."""
    for variable in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    for role in ("writer", "reader"):
        for name, value in server.role_environment(role).items():
            monkeypatch.setenv(name, value)


def settings(server: LocalSeaweedFS) -> S3Config:
    return S3Config(endpoint_url=server.endpoint_url, max_attempts=1)


def role_store(server: LocalSeaweedFS, role: str, bucket: str = BUCKET) -> S3Store:
    store = open_store(f"s3://{bucket}/{PREFIX}", settings(server), role=role)
    assert isinstance(store, S3Store)
    return store


def fresh_name(stem: str) -> str:
    return f"{stem}-{uuid.uuid4().hex[:12]}"


def test_identities_file_is_private_and_keeps_role_keys_across_restarts(server: LocalSeaweedFS):
    assert stat.S_IMODE(server.identities_file.stat().st_mode) == 0o600
    assert server.role_keys["reader"] != server.role_keys["writer"]
    again = LocalSeaweedFS(server.data_dir, server.access_key, server.secret_key, buckets=[BUCKET])
    again._write_identities()
    assert again.role_keys == server.role_keys


def test_writer_puts_gets_lists_and_deletes(server: LocalSeaweedFS, role_env):
    writer = role_store(server, "writer")
    writer.ping()
    name = fresh_name("written")
    writer.put(name, b"payload")
    writer.put(name, b"replaced", overwrite=True)
    assert writer.get(name) == b"replaced"
    assert name in {info.name for info in writer.list()}
    writer.delete(name)
    assert writer.head(name) is None


def test_reader_reads_and_lists_but_the_server_refuses_its_writes(server: LocalSeaweedFS, role_env):
    writer, reader = role_store(server, "writer"), role_store(server, "reader")
    name = fresh_name("guarded")
    writer.put(name, b"published bytes")

    reader.ping()
    assert reader.get(name) == b"published bytes"
    assert reader.head(name).size == len(b"published bytes")
    assert name in {info.name for info in reader.list()}
    with pytest.raises(NotFound):
        reader.get(fresh_name("missing"))

    refused = {
        "put": lambda: reader.put(fresh_name("intruder"), b"data"),
        "overwrite": lambda: reader.put(name, b"tampered", overwrite=True),
        "delete": lambda: reader.delete(name),
    }
    for operation, attempt in refused.items():
        with pytest.raises(StoreForbidden, match="the reader credentials may not") as refusal:
            attempt()
        assert refusal.value.code == "store_forbidden", operation
    assert writer.get(name) == b"published bytes"


def test_role_grants_stop_at_their_bucket(server: LocalSeaweedFS, role_env):
    with pytest.raises(StoreForbidden, match="writer credentials may not write"):
        role_store(server, "writer", OTHER_BUCKET).put(fresh_name("elsewhere"), b"data")


def test_serving_answers_from_a_release_published_by_the_writer_with_reader_credentials(
        server: LocalSeaweedFS, role_env, publish_first_parts, tiny_model_dir: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture):
    prefix = fresh_name("served")
    writer = open_store(f"s3://{BUCKET}/{prefix}", settings(server), role="writer")
    _, release = publish_first_parts(writer, 8)

    config = tmp_path / "cagflow.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": str(tiny_model_dir), "max_context_tokens": 900, "max_new_tokens": 8,
                  "question_budget_tokens": 128},
        "cache": {"state_store": f"s3://{BUCKET}/{prefix}", "s3": {"endpoint_url": server.endpoint_url}},
    }))
    service = CagService.start(ServingSettings("cag_llm", "cag_llm_0", str(config), replica_id="replica-r",
                                               release_poll_s=0, heat_flush_s=0))
    try:
        assert service.store.role == "reader"
        assert service.resident.release.release_id == release.release_id
        entry = release.snapshots[0]
        *_, served = service.stream(AnswerRequest("Which port does the web console listen on?", entry.key))
        assert isinstance(served, ServedAnswer) and served.cache_hit
        assert served.release_id == release.release_id
    finally:
        with caplog.at_level(logging.WARNING, logger="cagflow.heat"):
            service.close()  # its heat counts cannot be saved: refused once, kept in memory, no error
    assert "heat counts kept in memory only" in caplog.text
    assert writer.head(heat_object("replica-r")) is None

    # A rollback through the router would move the release pointer: refused before Triton is asked.
    reader = open_store(f"s3://{BUCKET}/{prefix}", settings(server), role="reader")
    router = Router(load_config(environ={}), None, None, None, reader, SimpleNamespace(encode_query=str))
    with pytest.raises(ApiError) as refusal:
        router.reload(release.release_id)
    assert (refusal.value.status, refusal.value.code) == (503, "store_read_only")
    assert "cagflow releases --activate" in refusal.value.message
