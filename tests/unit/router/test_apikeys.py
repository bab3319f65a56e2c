"""API keys: only hashes on disk, constant-time checks, live reload, clear errors on a broken file; expiry and
rotation with overlap, on a clock the tests move (no sleeps)."""

import json
import stat
import subprocess
import sys
import threading

import pytest
from cagflow.config import load_config
from cagflow.router.apikeys import (ApiKeyError, ApiKeyStore, ensure_local_keys, parse_duration,
                                    read_local_credentials)


@pytest.fixture(autouse=True)
def no_key_variables(monkeypatch):
    for name in ("CAGFLOW_API_KEY", "CAGFLOW_API_KEY_FILE", "CAGFLOW_ADMIN_KEY", "CAGFLOW_ADMIN_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def store(tmp_path):
    return ApiKeyStore(tmp_path / "keys" / "api-keys.json")


def test_created_key_verifies_and_only_its_hash_is_stored(store):
    record, plaintext = store.create("billing-app")
    prefix, key_id, secret = plaintext.split("_", 2)
    assert prefix == "cgf" and key_id == record.key_id and len(secret) >= 43  # 32 bytes, urlsafe base64
    assert store.verify(plaintext) == record and not record.admin
    text = store.path.read_text()
    assert secret not in text
    assert set(json.loads(text)["keys"][0]) == {"key_id", "name", "admin", "sha256", "created"}
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600


@pytest.mark.parametrize("presented", ["", "cgf", "cgf__", "Bearer x", "cgf_0000_wrong", "🔑" * 40, "a\x00b",
                                       "cgf_\ud800_x"])
def test_anything_else_is_rejected(store, presented):
    store.create("app")
    assert store.verify(presented) is None


def test_a_key_with_a_changed_secret_is_rejected(store):
    _, plaintext = store.create("app")
    assert store.verify(plaintext[:-1] + ("A" if plaintext[-1] != "A" else "B")) is None


def test_admin_flag_and_listing(store):
    admin, _ = store.create("ops", admin=True)
    user, _ = store.create("app")
    assert [(key.key_id, key.admin) for key in store.list()] == [(admin.key_id, True), (user.key_id, False)]
    assert all(key.created.endswith("Z") for key in store.list())


def test_keys_created_elsewhere_work_at_once_and_revoked_ones_stop(store):
    running = ApiKeyStore(store.path)  # the server's view, created before the key exists
    assert running.verify("cgf_abc_def") is None
    record, plaintext = store.create("new-app")
    assert running.verify(plaintext) == record
    store.revoke(record.key_id)
    assert running.verify(plaintext) is None


def test_revoking_an_unknown_key_says_so(store):
    store.create("app")
    with pytest.raises(ApiKeyError, match="no API key with id 'nope'"):
        store.revoke("nope")


def test_empty_name_is_refused(store):
    with pytest.raises(ApiKeyError, match="non-empty name"):
        store.create("  ")


def test_concurrent_creates_keep_every_key(store):
    created = []
    threads = [threading.Thread(target=lambda: created.append(store.create("app")[1])) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(store.list()) == 8 and all(store.verify(plaintext) for plaintext in created)


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    ('{"keys": {"a": 1}}', "malformed"),
    ('{"keys": [{"key_id": "a", "name": "n", "admin": "yes", "sha256": "x"}]}', "malformed"),
    ("[]", "malformed"),
])
def test_a_broken_keys_file_is_an_error_not_an_empty_one(store, content, message):
    _, plaintext = store.create("app")
    store.path.write_text(content)
    with pytest.raises(ApiKeyError, match=message):
        store.verify(plaintext)
    with pytest.raises(ApiKeyError, match=message):
        store.create("another")  # never overwrites what it cannot read


def test_a_missing_keys_file_holds_no_keys(store):
    assert store.list() == [] and store.verify("cgf_a_b") is None


def test_an_unwritable_keys_file_explains_itself(tmp_path):
    (tmp_path / "not-a-directory").write_text("")
    with pytest.raises(ApiKeyError, match="cannot write API keys file .*mounted secret is read-only"):
        ApiKeyStore(tmp_path / "not-a-directory" / "api-keys.json").create("app")


def test_local_keys_are_issued_once(tmp_path):
    config = load_config(environ={"CAGFLOW__SERVICE__API_KEYS_FILE": str(tmp_path / "api-keys.json")})
    credentials_path = tmp_path / "client" / "credentials.json"
    issued = ensure_local_keys(config, credentials_path)
    store = ApiKeyStore(config.service.api_keys_file)
    assert not store.verify(issued.api_key).admin and store.verify(issued.admin_key).admin
    assert stat.S_IMODE(credentials_path.stat().st_mode) == 0o600
    assert read_local_credentials(credentials_path) == issued
    assert ensure_local_keys(config, credentials_path) is None
    assert len(store.list()) == 2


def test_lost_local_credentials_are_replaced_and_the_old_keys_revoked(tmp_path):
    config = load_config(environ={"CAGFLOW__SERVICE__API_KEYS_FILE": str(tmp_path / "api-keys.json")})
    credentials_path = tmp_path / "credentials.json"
    first = ensure_local_keys(config, credentials_path)
    ApiKeyStore(config.service.api_keys_file).create("billing-app")
    credentials_path.unlink()
    second = ensure_local_keys(config, credentials_path)
    store = ApiKeyStore(config.service.api_keys_file)
    assert store.verify(first.api_key) is None and store.verify(second.api_key) is not None
    assert sorted(key.name for key in store.list()) == ["billing-app", "local-admin", "local-user"]


def test_environment_overrides_the_credentials_file(tmp_path, monkeypatch):
    credentials_path = tmp_path / "credentials.json"
    credentials_path.write_text(json.dumps({"api_key": "cgf_file_user", "admin_key": "cgf_file_admin"}))
    monkeypatch.setenv("CAGFLOW_API_KEY", "cgf_env_user")
    credentials = read_local_credentials(credentials_path)
    assert (credentials.api_key, credentials.admin_key) == ("cgf_env_user", "cgf_file_admin")
    secret_file = tmp_path / "admin-secret"
    secret_file.write_text("cgf_mounted_admin\n")
    monkeypatch.setenv("CAGFLOW_ADMIN_KEY_FILE", str(secret_file))
    assert read_local_credentials(credentials_path).admin_key == "cgf_mounted_admin"


def test_no_credentials_anywhere(tmp_path):
    assert read_local_credentials(tmp_path / "missing.json") is None


def test_a_corrupt_credentials_file_says_how_to_recover(tmp_path):
    credentials_path = tmp_path / "credentials.json"
    credentials_path.write_text("{")
    with pytest.raises(ApiKeyError, match="cagflow keys init-local"):
        read_local_credentials(credentials_path)


class Clock:
    """Epoch seconds that a test moves by hand."""

    def __init__(self, now: float = 1_800_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def timed_store(tmp_path, clock):
    return ApiKeyStore(tmp_path / "api-keys.json", clock=clock)


@pytest.mark.parametrize("text, seconds", [("90s", 90), ("15m", 900), ("24h", 86400), ("1.5d", 129600), ("0s", 0)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "24", "h", "-1h", "1w", "1 h", "1e3s"])
def test_a_bad_duration_says_how_to_write_one(text):
    with pytest.raises(ValueError, match="e.g. 90s, 15m, 24h or 30d"):
        parse_duration(text)


def test_a_key_works_until_its_expiry_and_is_then_known_but_expired(timed_store, clock):
    record, plaintext = timed_store.create("contractor", expires_in_s=60)
    assert record.expires == "2027-01-15T08:01:00Z" and json.loads(timed_store.path.read_text())["keys"][0]["expires"]
    clock.now += 59
    assert timed_store.verify(plaintext) == record
    clock.now += 1
    assert timed_store.verify(plaintext) is None
    assert timed_store.identify(plaintext) == record and timed_store.expired(record)
    assert timed_store.identify("cgf_000000000000_unknown") is None


def test_rotation_overlaps_the_old_key_with_the_new_one_in_every_process(timed_store, clock):
    old, old_plaintext = timed_store.create("billing-app", admin=True)
    other_router = ApiKeyStore(timed_store.path, clock=clock)  # another process on the same keys file
    assert other_router.verify(old_plaintext) == old
    before, new, new_plaintext = timed_store.rotate(old.key_id, overlap_s=3600)
    assert (new.name, new.admin, new.expires) == ("billing-app", True, "") and new.key_id != old.key_id
    assert before.key_id == old.key_id and before.expires == "2027-01-15T09:00:00Z"
    for store in (timed_store, other_router):
        assert store.verify(old_plaintext) and store.verify(new_plaintext) == new
    clock.now += 3599
    assert other_router.verify(old_plaintext) is not None
    clock.now += 1
    assert other_router.verify(old_plaintext) is None and other_router.expired(other_router.identify(old_plaintext))
    assert other_router.verify(new_plaintext) == new


def test_revoking_the_old_key_ends_the_overlap_at_once(timed_store):
    old, old_plaintext = timed_store.create("app")
    _, new, new_plaintext = timed_store.rotate("app", overlap_s=86400)  # by its name, while only one has it
    timed_store.revoke(old.key_id)
    assert timed_store.verify(old_plaintext) is None and timed_store.identify(old_plaintext) is None
    assert timed_store.verify(new_plaintext) == new
    timed_store.revoke("app")  # the name is unambiguous again
    assert timed_store.list() == []


def test_rotation_never_extends_an_expiry_and_can_end_the_old_key_now(timed_store, clock):
    old, _ = timed_store.create("app", expires_in_s=600)
    assert timed_store.rotate(old.key_id, overlap_s=86400)[0].expires == old.expires
    other, other_plaintext = timed_store.create("other")
    _, new, _ = timed_store.rotate(other.key_id, overlap_s=0, expires_in_s=30 * 86400)
    assert timed_store.verify(other_plaintext) is None and new.expires == "2027-02-14T08:00:00Z"


@pytest.mark.parametrize("call, message", [
    (lambda store: store.rotate("nope", 60), "no API key with id 'nope'"),
    (lambda store: store.rotate("app", 60), "2 keys are named 'app'"),
    (lambda store: store.revoke("app"), "name one by its id"),
    (lambda store: store.rotate("solo", -1), "overlap must be between 0 and"),
    (lambda store: store.rotate("solo", float("inf")), "overlap must be between 0 and"),
    (lambda store: store.rotate("solo", 60, expires_in_s=0), "must be in the future"),
    (lambda store: store.create("new", expires_in_s=-5), "must be in the future"),
    (lambda store: store.create("new", expires_in_s=parse_duration("99999999d")), "at most 36500 days"),
])
def test_bad_input_changes_nothing(timed_store, call, message):
    timed_store.create("app")
    timed_store.create("app")
    timed_store.create("solo")
    before = timed_store.path.read_bytes()
    with pytest.raises(ApiKeyError, match=message):
        call(timed_store)
    assert timed_store.path.read_bytes() == before


def test_a_malformed_expiry_is_a_broken_file(store):
    _, plaintext = store.create("app")
    data = json.loads(store.path.read_text())
    data["keys"][0]["expires"] = "tomorrow"
    store.path.write_text(json.dumps(data))
    with pytest.raises(ApiKeyError, match="malformed"):
        store.verify(plaintext)


WRITER = """
import sys
from cagflow.router.apikeys import ApiKeyStore
store = ApiKeyStore(sys.argv[1])
record, plaintext = store.create(sys.argv[2])
for _ in range(3):
    _, record, plaintext = store.rotate(record.key_id, overlap_s=3600)
print(plaintext)
"""


def test_writers_in_several_processes_never_lose_a_key(store):
    """CLI runs and routers on one keys file: every read-modify-write holds the file's lock."""
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(store.path), f"app-{n}"], stdout=subprocess.PIPE,
                                text=True) for n in range(4)]
    finals = [writer.communicate(timeout=120)[0].strip() for writer in writers]
    assert all(writer.returncode == 0 for writer in writers)
    assert len(store.list()) == 16 and all(store.verify(plaintext) for plaintext in finals)
