"""API keys: only hashes on disk, constant-time checks, live reload, clear errors on a broken file."""

import json
import stat
import threading

import pytest
from cagflow.config import load_config
from cagflow.router.apikeys import ApiKeyError, ApiKeyStore, ensure_local_keys, read_local_credentials


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
