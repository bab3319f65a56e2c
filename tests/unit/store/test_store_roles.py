"""Which S3 credentials each role's store is opened with; the server's refusals are in
tests/integration/test_s3_roles.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from cagflow.config import ConfigError, S3Config
from cagflow.store.backends import S3Store, open_store, s3_credentials

READER = {"CAGFLOW_S3_READER_ACCESS_KEY_ID": "reader-id", "CAGFLOW_S3_READER_SECRET_ACCESS_KEY": "reader-secret"}


def test_each_role_reads_its_own_variables():
    environ = {**READER, "CAGFLOW_S3_WRITER_ACCESS_KEY_ID": "writer-id",
               "CAGFLOW_S3_WRITER_SECRET_ACCESS_KEY": "writer-secret"}
    assert s3_credentials("reader", environ) == ("reader-id", "reader-secret")
    assert s3_credentials("writer", environ) == ("writer-id", "writer-secret")


def test_unset_role_falls_back_to_the_standard_chain():
    assert s3_credentials("writer", READER) == (None, None)


def test_secret_files_are_read(tmp_path: Path):
    secret = tmp_path / "secret"
    secret.write_text("from-a-file\n")
    environ = {"CAGFLOW_S3_READER_ACCESS_KEY_ID": "reader-id", "CAGFLOW_S3_READER_SECRET_ACCESS_KEY_FILE": str(secret)}
    assert s3_credentials("reader", environ) == ("reader-id", "from-a-file")


def test_half_a_key_pair_is_a_config_error():
    with pytest.raises(ConfigError, match="CAGFLOW_S3_READER_SECRET_ACCESS_KEY"):
        s3_credentials("reader", {"CAGFLOW_S3_READER_ACCESS_KEY_ID": "reader-id"})


def test_open_store_signs_with_the_roles_keys(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "chain-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "chain-secret")
    for name, value in READER.items():
        monkeypatch.setenv(name, value)
    settings = S3Config(endpoint_url="http://127.0.0.1:9")
    reader, writer = (open_store("s3://bucket/prefix", settings, role=role) for role in ("reader", "writer"))
    assert isinstance(reader, S3Store) and reader.role == "reader"
    assert reader.client._request_signer._credentials.access_key == "reader-id"
    assert writer.client._request_signer._credentials.access_key == "chain-id"
    assert open_store("s3://bucket/prefix", settings).role == "reader"  # least privilege unless asked
