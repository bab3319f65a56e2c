"""S3Store against a real SeaweedFS: checksums, write-once semantics and failure mapping.

The server enforces request signatures, so credential and checksum behaviour is the server's own, not a
stand-in's.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import threading
import uuid
from pathlib import Path

import boto3
import pytest
from cagflow.config import S3Config
from cagflow.devstack.seaweedfs import LocalSeaweedFS
from cagflow.store.backends import AlreadyExists, ChecksumMismatch, NotFound, S3Store, StoreUnavailable, open_store

pytestmark = pytest.mark.integration

BUCKET = "cagflow-test"
PREFIX = "states"
MULTIPART_THRESHOLD = 5 * 1024 * 1024
SIZES = {"single-put": 4096, "multipart": 11 * 1024 * 1024}


def s3_settings(endpoint_url: str, **overrides) -> S3Config:
    return S3Config(endpoint_url=endpoint_url, multipart_threshold_bytes=MULTIPART_THRESHOLD, **overrides)


def fresh_name(stem: str) -> str:
    """Objects outlive a test in the shared bucket, so every test writes names of its own."""
    return f"{stem}-{uuid.uuid4().hex[:12]}"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def raw_key(name: str) -> str:
    return f"{PREFIX}/{name}"


@pytest.fixture(scope="session")
def store(s3_server: LocalSeaweedFS) -> S3Store:
    s3_server.create_bucket(BUCKET)
    opened = open_store(f"s3://{BUCKET}/{PREFIX}", s3_settings(s3_server.endpoint_url))
    assert isinstance(opened, S3Store)
    return opened


def test_ping_asks_for_the_bucket_and_a_missing_one_is_unavailable(s3_server: LocalSeaweedFS, store: S3Store):
    """ping is the readiness check: one HeadBucket that the server answers, and StoreUnavailable naming the
    store when the bucket is not there."""
    pinged = open_store(store.url, s3_settings(s3_server.endpoint_url))
    statuses = []
    pinged.client.meta.events.register("after-call.s3.HeadBucket",
                                       lambda http_response, **_: statuses.append(http_response.status_code))
    pinged.ping()
    assert statuses == [200]
    missing = open_store(f"s3://{fresh_name('missing')}/{PREFIX}", s3_settings(s3_server.endpoint_url))
    with pytest.raises(StoreUnavailable, match=missing.url):
        missing.ping()


@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
def test_round_trip_keeps_bytes_and_stores_their_sha256(store: S3Store, size: int):
    name = fresh_name("round-trip")
    data = os.urandom(size)
    info = store.put(name, data)
    assert (info.name, info.size, info.sha256) == (name, size, sha256(data))

    assert store.get(name) == data
    assert store.get(name, sha256=sha256(data)) == data
    head = store.head(name)
    assert (head.name, head.size, head.sha256) == (name, size, sha256(data))
    assert store.exists_verified(name, sha256(data))


def test_object_replaced_behind_the_store_is_detected(store: S3Store):
    name = fresh_name("corrupted")
    original = os.urandom(2048)
    store.put(name, original)
    tampered = bytearray(original)
    tampered[100] ^= 0x01
    store.client.put_object(Bucket=BUCKET, Key=raw_key(name), Body=bytes(tampered),
                            Metadata={"sha256": sha256(original)})

    assert store.head(name).sha256 == sha256(original)
    with pytest.raises(ChecksumMismatch):
        store.get(name)
    assert not store.exists_verified(name)


def test_wrong_expected_sha256_is_a_mismatch(store: S3Store):
    name = fresh_name("expected-sha")
    store.put(name, b"payload")
    with pytest.raises(ChecksumMismatch):
        store.get(name, sha256=sha256(b"another payload"))


@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
def test_existing_object_is_not_overwritten(store: S3Store, size: int):
    name = fresh_name("write-once")
    original = os.urandom(size)
    store.put(name, original)
    with pytest.raises(AlreadyExists):
        store.put(name, os.urandom(size))

    assert store.get(name) == original
    assert store.head(name).sha256 == sha256(original)
    pending = store.client.list_multipart_uploads(Bucket=BUCKET, Prefix=raw_key(name)).get("Uploads", [])
    assert pending == [], "a refused multipart upload must be aborted"


@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
def test_overwrite_replaces_bytes_and_checksum(store: S3Store, size: int):
    name = fresh_name("overwrite")
    store.put(name, os.urandom(size))
    replacement = os.urandom(size)
    store.put(name, replacement, overwrite=True)
    assert store.get(name) == replacement
    assert store.head(name).sha256 == sha256(replacement)


@pytest.mark.parametrize(("size", "rounds"), [(SIZES["single-put"], 10), (SIZES["multipart"], 3)],
                         ids=SIZES.keys())
def test_two_concurrent_writers_of_one_name_have_exactly_one_winner(store: S3Store, size: int, rounds: int):
    for _ in range(rounds):
        name = fresh_name("race")
        payloads = [os.urandom(size), os.urandom(size)]
        barrier = threading.Barrier(2)
        outcomes: dict[int, str] = {}

        def compete(writer: int) -> None:
            barrier.wait()
            try:
                store.put(name, payloads[writer])
                outcomes[writer] = "won"
            except AlreadyExists:
                outcomes[writer] = "lost"

        writers = [threading.Thread(target=compete, args=(writer,)) for writer in range(2)]
        for thread in writers:
            thread.start()
        for thread in writers:
            thread.join(timeout=60)
        assert sorted(outcomes.values()) == ["lost", "won"], outcomes
        winner = next(writer for writer, result in outcomes.items() if result == "won")
        assert store.get(name) == payloads[winner]
        assert store.head(name).sha256 == sha256(payloads[winner])


def test_list_returns_only_names_under_the_prefix(store: S3Store):
    root = fresh_name("listing")
    for name, data in [(f"{root}/a.json", b"a"), (f"{root}/nested/b.json", b"bb"), (f"{root}x/c.json", b"ccc")]:
        store.put(name, data)

    listed = {info.name: info.size for info in store.list(f"{root}/")}
    assert listed == {f"{root}/a.json": 1, f"{root}/nested/b.json": 2}
    assert {info.name for info in store.list(root)} == {f"{root}/a.json", f"{root}/nested/b.json", f"{root}x/c.json"}
    assert {f"{root}/a.json", f"{root}x/c.json"} <= {info.name for info in store.list()}
    assert list(store.list(fresh_name("nothing-here"))) == []


def test_delete_removes_the_object_and_tolerates_a_missing_one(store: S3Store):
    name = fresh_name("delete")
    store.put(name, b"short-lived")
    store.delete(name)
    assert store.head(name) is None
    with pytest.raises(NotFound):
        store.get(name)
    store.delete(name)
    store.put(name, b"written again after delete")
    assert store.get(name) == b"written again after delete"


def test_missing_object_is_not_found(store: S3Store):
    name = fresh_name("missing")
    assert store.head(name) is None
    with pytest.raises(NotFound):
        store.get(name)
    assert not store.exists_verified(name)


@pytest.mark.parametrize("name", ["../x", "/abs", "a/./b", "obj.sha256"])
def test_invalid_names_are_rejected_before_any_request(store: S3Store, name: str):
    with pytest.raises(ValueError):
        store.put(name, b"data")
    with pytest.raises(ValueError):
        store.get(name)


@pytest.mark.parametrize("wrong", ["access_key", "secret_key"])
def test_wrong_credentials_make_the_store_unavailable(s3_server: LocalSeaweedFS, store: S3Store,
                                                      monkeypatch: pytest.MonkeyPatch, wrong: str):
    name = fresh_name("guarded")
    store.put(name, b"secret bytes")
    variable = {"access_key": "AWS_ACCESS_KEY_ID", "secret_key": "AWS_SECRET_ACCESS_KEY"}[wrong]
    monkeypatch.setenv(variable, secrets.token_hex(16))
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)
    intruder = open_store(f"s3://{BUCKET}/{PREFIX}", s3_settings(s3_server.endpoint_url, max_attempts=1))

    with pytest.raises(StoreUnavailable):
        intruder.ping()
    with pytest.raises(StoreUnavailable):
        intruder.get(name)
    with pytest.raises(StoreUnavailable):
        intruder.head(name)
    with pytest.raises(StoreUnavailable):
        intruder.put(fresh_name("intruder"), b"data")
    with pytest.raises(StoreUnavailable):
        list(intruder.list())
    with pytest.raises(StoreUnavailable):
        intruder.delete(name)
    assert store.get(name) == b"secret bytes"


def test_stopped_server_makes_the_store_unavailable_quickly(s3_server: LocalSeaweedFS, tmp_path: Path):
    server = LocalSeaweedFS(tmp_path / "short-lived", s3_server.access_key, s3_server.secret_key)
    with server:
        server.create_bucket(BUCKET)
        doomed = open_store(f"s3://{BUCKET}/{PREFIX}",
                            s3_settings(server.endpoint_url, connect_timeout_s=1, max_attempts=1))
        doomed.put("kept.bin", b"payload")
        doomed.ping()
    assert not server.is_running()

    operations = {
        "ping": doomed.ping,
        "get": lambda: doomed.get("kept.bin"),
        "head": lambda: doomed.head("kept.bin"),
        "put": lambda: doomed.put(fresh_name("after-stop"), b"data"),
        "list": lambda: list(doomed.list()),
        "delete": lambda: doomed.delete("kept.bin"),
    }
    sent: list[str] = []  # every request botocore sends, so a retry or a second wait would show
    doomed.client.meta.events.register("before-send", lambda request, **_: sent.append(request.url))
    for operation_name, operation in operations.items():
        sent.clear()
        with pytest.raises(StoreUnavailable):
            operation()
        assert len(sent) == 1, (operation_name, sent)  # refused once, given up at once (max_attempts=1)
