"""API keys for the REST router: issue, verify, list, rotate and revoke.

A key reads ``cgf_<key_id>_<secret>``: the short hex id names the key in listings and logs, the secret
(32 random bytes) authenticates. The keys file (``service.api_keys_file``; in a deployment it may be a
mounted secret) holds only SHA-256 hashes, so a leaked file grants nothing; plain SHA-256 suffices
because the secrets are random, not passwords. The file is rewritten atomically with mode 0600 and
re-read whenever it changes on disk, so a key created while the router runs works at once.

A key may expire (``expires``, UTC). Rotating a key issues its replacement (same name and role) and sets
the old key to expire after an overlap, so clients can move to the new key without a moment when neither
works; an expired key is refused as such, not as unknown. Every change is a read-modify-write under an
exclusive lock on a lock file beside the keys file, so CLI runs, gunicorn workers and several routers can
share one keys file; readers need no lock, as each write replaces the whole file atomically.

For a local setup, ``ensure_local_keys`` issues one user and one admin key and keeps their plaintexts in
a 0600 client credentials file (like ``~/.netrc``), which ``cagflow ask`` reads; ``CAGFLOW_API_KEY`` and
``CAGFLOW_ADMIN_KEY`` (or ``*_FILE``) override it.
"""

from __future__ import annotations

import calendar
import fcntl
import hashlib
import hmac
import json
import os
import re
import secrets
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

from ..config import CACHE_HOME, Config, read_secret
from ..errors import CagflowError
from ..files import write_private_file

KEY_PREFIX = "cgf"
KEY_ID_BYTES = 6
SECRET_BYTES = 32
CREDENTIALS_FILE = CACHE_HOME / "credentials.json"
LOCAL_USER_KEY_NAME = "local-user"
LOCAL_ADMIN_KEY_NAME = "local-admin"
_FILE_FORMAT = '{"keys": [{"key_id", "name", "admin", "sha256", "created", "expires" (optional)}, ...]}'
_UTC_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_SPAN_DAYS = 36500  # expiries and overlaps: far enough, and the year keeps four digits


class ApiKeyError(CagflowError):
    """A keys file that cannot be read or written, or a request naming an unknown key."""

    code = "api_keys"


@dataclass(frozen=True)
class ApiKey:
    key_id: str
    name: str
    admin: bool
    created: str = ""
    expires: str = ""  # UTC, like ``created``; empty: never


@dataclass(frozen=True)
class LocalCredentials:
    api_key: str | None
    admin_key: str | None


def _digest(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode("utf-8", "surrogatepass")).hexdigest()  # any str, never an error


def _utc(epoch_s: float) -> str:
    return time.strftime(_UTC_FORMAT, time.gmtime(epoch_s))


def _epoch(utc: str) -> float:
    return calendar.timegm(time.strptime(utc, _UTC_FORMAT))


def parse_duration(text: str) -> float:
    """Seconds in ``90s``, ``15m``, ``24h`` or ``30d``: how ``--expires`` and ``--overlap`` are written."""
    match = _DURATION.fullmatch(text.strip())
    if not match:
        raise ValueError(f"invalid duration {text!r}: write a number and a unit, e.g. 90s, 15m, 24h or 30d")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def _valid_record(record: Any) -> bool:
    required = {"key_id": str, "name": str, "admin": bool, "sha256": str}
    if not isinstance(record, dict) or not all(isinstance(record.get(field), kind) for field, kind in required.items()):
        return False
    expires = record.get("expires")
    if expires is None:
        return True
    try:
        _epoch(expires)
    except (TypeError, ValueError):
        return False
    return True


class ApiKeyStore:
    """The hashed keys in one JSON file; safe to share between threads and processes. ``clock`` (epoch
    seconds) decides creation and expiry times, so tests need no sleeps."""

    def __init__(self, path: str | os.PathLike[str], clock=time.time) -> None:
        self.path = Path(path).expanduser()
        self._clock = clock
        self._lock = threading.Lock()
        self._signature: tuple[int, int, int] | None = None
        self._records: list[dict[str, Any]] = []

    # --- reading

    def _file_signature(self) -> tuple[int, int, int] | None:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ApiKeyError(f"cannot read API keys file {self.path}: {exc.strerror}") from None
        return stat.st_ino, stat.st_mtime_ns, stat.st_size

    def _parse(self) -> list[dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise ApiKeyError(f"cannot read API keys file {self.path}: {exc.strerror}") from None
        except ValueError as exc:
            raise ApiKeyError(f"API keys file {self.path} is not valid JSON ({exc}); expected {_FILE_FORMAT}") from None
        records = data.get("keys") if isinstance(data, dict) else None
        if not isinstance(records, list) or not all(_valid_record(record) for record in records):
            raise ApiKeyError(f"API keys file {self.path} is malformed; expected {_FILE_FORMAT}")
        return records

    def _current(self) -> list[dict[str, Any]]:
        """The records, re-read when the file changed since the last look (new inode, mtime or size)."""
        with self._lock:
            signature = self._file_signature()
            if signature != self._signature:
                self._records = self._parse()
                self._signature = signature
            return self._records

    def list(self) -> list[ApiKey]:
        return [_public(record) for record in self._current()]

    def identify(self, plaintext: str) -> ApiKey | None:
        """The key a request presents, expired or not, or None; hashes are compared in constant time."""
        presented = _digest(plaintext or "")
        match = None
        for record in self._current():  # every record is compared, so timing says nothing about which matched
            if hmac.compare_digest(presented, record["sha256"]):
                match = record
        return _public(match) if match else None

    def expired(self, key: ApiKey) -> bool:
        return bool(key.expires) and _epoch(key.expires) <= self._clock()

    def verify(self, plaintext: str) -> ApiKey | None:
        """The key a request presents when it works now (known and not expired), else None."""
        key = self.identify(plaintext)
        return key if key is not None and not self.expired(key) else None

    # --- writing

    @contextmanager
    def _exclusive(self) -> Iterator[list[dict[str, Any]]]:
        """Read-modify-write under an exclusive lock, so two ``cagflow keys`` runs never lose a key."""
        lock_path = self.path.with_name(f".{self.path.name}.lock")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with open(lock_path, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                records = [dict(record) for record in self._parse()]
                yield records
                write_private_file(self.path, json.dumps({"keys": records}, indent=2) + "\n")
        except OSError as exc:
            raise ApiKeyError(f"cannot write API keys file {self.path}: {exc.strerror or exc} "
                              "(a mounted secret is read-only: manage its keys where it is defined)") from None

    def _issue(self, records: list[dict[str, Any]], name: str, admin: bool,
               expires_in_s: float | None) -> tuple[dict[str, Any], str]:
        """Append a new key to ``records``; returns its record and its plaintext."""
        if expires_in_s is not None and not 0 < expires_in_s <= MAX_SPAN_DAYS * 86400:
            raise ApiKeyError(f"a key's expiry must be in the future, at most {MAX_SPAN_DAYS} days away")
        taken = {record["key_id"] for record in records}
        key_id = secrets.token_hex(KEY_ID_BYTES)
        while key_id in taken:
            key_id = secrets.token_hex(KEY_ID_BYTES)
        plaintext = f"{KEY_PREFIX}_{key_id}_{secrets.token_urlsafe(SECRET_BYTES)}"
        now = self._clock()
        record = {"key_id": key_id, "name": name, "admin": admin, "sha256": _digest(plaintext), "created": _utc(now)}
        if expires_in_s is not None:
            record["expires"] = _utc(now + expires_in_s)
        records.append(record)
        return record, plaintext

    def _find(self, records: list[dict[str, Any]], key: str) -> dict[str, Any]:
        """The record with id ``key``, else the only one named ``key``."""
        found = [record for record in records if record["key_id"] == key] or [
            record for record in records if record["name"] == key]
        if not found:
            raise ApiKeyError(f"no API key with id {key!r} in {self.path}, nor one named so (see `cagflow keys list`)")
        if len(found) > 1:
            raise ApiKeyError(f"{len(found)} keys are named {key!r} ({', '.join(r['key_id'] for r in found)}): "
                              "name one by its id")
        return found[0]

    def create(self, name: str, admin: bool = False, expires_in_s: float | None = None) -> tuple[ApiKey, str]:
        """Issue a key; returns its record and the plaintext, which is never stored and shown only now."""
        name = name.strip()
        if not name:
            raise ApiKeyError("an API key needs a non-empty name")
        with self._exclusive() as records:
            record, plaintext = self._issue(records, name, admin, expires_in_s)
        return _public(record), plaintext

    def rotate(self, key: str, overlap_s: float,
               expires_in_s: float | None = None) -> tuple[ApiKey, ApiKey, str]:
        """Replace the key with id (or only name) ``key`` by a new one with its name and role; the old key
        keeps working for ``overlap_s`` more (never longer than it already would). Returns the old key as
        it is now, the new key and the new plaintext."""
        if not 0 <= overlap_s <= MAX_SPAN_DAYS * 86400:
            raise ApiKeyError(f"the overlap must be between 0 and {MAX_SPAN_DAYS} days")
        with self._exclusive() as records:
            old = self._find(records, key)
            new, plaintext = self._issue(records, old["name"], old["admin"], expires_in_s)
            deadline = self._clock() + overlap_s
            if old.get("expires") is None or _epoch(old["expires"]) > deadline:
                old["expires"] = _utc(deadline)
        return _public(old), _public(new), plaintext

    def revoke(self, key: str) -> ApiKey:
        """Delete the key with id (or only name) ``key``: it stops working at once."""
        with self._exclusive() as records:
            record = self._find(records, key)
            records.remove(record)
        return _public(record)


def _public(record: dict[str, Any]) -> ApiKey:
    return ApiKey(record["key_id"], record["name"], record["admin"], record.get("created", ""),
                  record.get("expires") or "")


# --- local credentials -----------------------------------------------------------------------------


def read_local_credentials(path: str | os.PathLike[str] | None = None) -> LocalCredentials | None:
    """The client's keys: ``CAGFLOW_API_KEY`` / ``CAGFLOW_ADMIN_KEY`` (or ``*_FILE``) first, then the
    credentials file; None when neither holds any."""
    path = Path(path or CREDENTIALS_FILE)
    stored: dict[str, Any] = {}
    if path.is_file():
        try:
            stored = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ApiKeyError(f"cannot read credentials file {path}: {exc}; delete it and run "
                              "`cagflow keys init-local` to issue new local keys") from None
        if not isinstance(stored, dict):
            raise ApiKeyError(f"credentials file {path} must hold a JSON object")
    credentials = LocalCredentials(api_key=read_secret("CAGFLOW_API_KEY") or stored.get("api_key"),
                                   admin_key=read_secret("CAGFLOW_ADMIN_KEY") or stored.get("admin_key"))
    return credentials if credentials.api_key or credentials.admin_key else None


def ensure_local_keys(config: Config,
                      credentials_path: str | os.PathLike[str] | None = None) -> LocalCredentials | None:
    """Issue a local user key and admin key unless working ones exist; returns the new ones (print them
    once) or None.

    Earlier local keys whose plaintexts are no longer in the credentials file are revoked: nobody can use
    them any more.
    """
    store = ApiKeyStore(config.service.api_keys_file)
    path = Path(credentials_path or CREDENTIALS_FILE)
    current = read_local_credentials(path)
    user = store.verify(current.api_key) if current and current.api_key else None
    admin = store.verify(current.admin_key) if current and current.admin_key else None
    if user and admin and admin.admin:
        return None
    for record in store.list():
        if record.name in (LOCAL_USER_KEY_NAME, LOCAL_ADMIN_KEY_NAME):
            store.revoke(record.key_id)
    _, api_key = store.create(LOCAL_USER_KEY_NAME)
    _, admin_key = store.create(LOCAL_ADMIN_KEY_NAME, admin=True)
    credentials = LocalCredentials(api_key=api_key, admin_key=admin_key)
    write_private_file(path, json.dumps({**asdict(credentials), "api_keys_file": str(store.path)}, indent=2) + "\n")
    return credentials
