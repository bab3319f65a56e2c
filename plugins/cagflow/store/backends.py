"""Where snapshots and release manifests live: one small blob interface, two backends.

Every object is written once under its name (never overwritten unless the caller asks, as a release
pointer does), carries its sha256, and is verified on every read. ``LocalStore`` is the embedded default
(a directory; atomic temp + link writes); ``S3Store`` talks to any S3-compatible service with boto3.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import mmap
import os
import tempfile
import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Iterator, Literal
from urllib.parse import urlparse

import boto3
from botocore.config import Config as BotoConfig
from botocore.exceptions import BotoCoreError, ClientError

from ..config import ConfigError, S3Config, read_secret
from ..errors import CagflowError

_S3_ERRORS = (BotoCoreError, ClientError)

# Which S3 credentials a process uses: serving only reads the store, the pipeline and admin commands write it.
StoreRole = Literal["reader", "writer"]


class StoreError(CagflowError):
    """Base class of snapshot-store failures."""

    code = "store_failed"


class NotFound(StoreError):
    """No object of that name."""

    code = "not_found"


class AlreadyExists(StoreError):
    """An object of that name exists; objects are written once."""

    code = "already_exists"


class ChecksumMismatch(StoreError):
    """The bytes read do not match the recorded sha256."""

    code = "checksum_mismatch"


class StoreUnavailable(StoreError):
    """The store cannot be reached or refused the credentials: callers degrade instead of failing hard."""

    code = "store_unavailable"


class StoreForbidden(StoreUnavailable):
    """The store refused the operation to these credentials (S3 AccessDenied), e.g. a write with the
    serving side's read-only ones."""

    code = "store_forbidden"


@dataclass(frozen=True)
class ObjectInfo:
    name: str
    size: int
    sha256: str | None
    modified: float


def _check_name(name: str) -> str:
    path = PurePosixPath(name)
    if not name or path.is_absolute() or any(p in ("", ".", "..") for p in name.split("/")):
        raise ValueError(f"invalid object name {name!r}")
    if name.endswith((".sha256", ".lock")) or path.name.startswith(".tmp-"):
        raise ValueError(f"object name {name!r} uses a reserved suffix or prefix")
    return name


def _verify(name: str, data: bytes | mmap.mmap, expected: str | None) -> bytes | mmap.mmap:
    if expected is not None:
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected:
            raise ChecksumMismatch(f"{name}: sha256 {actual[:16]}… does not match expected {expected[:16]}…")
    return data


class SnapshotStore(ABC):
    """The storage backend interface: put once, verified get, head, list, delete."""

    url: str

    @abstractmethod
    def put(self, name: str, data: bytes, *, overwrite: bool = False) -> ObjectInfo:
        """Store ``data``; raise ``AlreadyExists`` if ``name`` exists and ``overwrite`` is false."""

    @abstractmethod
    def get(self, name: str, *, sha256: str | None = None) -> bytes:
        """Read and verify against ``sha256`` (or the checksum stored with the object)."""

    def get_view(self, name: str, *, sha256: str | None = None) -> bytes | mmap.mmap:
        """``get`` for large immutable objects (snapshots), verified the same way; a store that can
        (``LocalStore``) maps the file instead of copying it, so every process shares the page cache."""
        return self.get(name, sha256=sha256)

    @abstractmethod
    def head(self, name: str) -> ObjectInfo | None:
        """Size and checksum of ``name``, or None when it does not exist."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Objects whose names start with ``prefix``."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove ``name``; a missing object is not an error."""

    @abstractmethod
    def ping(self, *, create: bool = False) -> None:
        """Raise ``StoreUnavailable`` unless the store answers. ``create``: a writer about to fill a new store
        may create its root (a local folder); a reader never does, so a store that vanished is reported."""

    def exists_verified(self, name: str, sha256: str | None = None) -> bool:
        """True when ``name`` exists and its bytes match its checksum: the 'skip, already done' test."""
        try:
            self.get(name, sha256=sha256)
            return True
        except (NotFound, ChecksumMismatch):
            return False


class LocalStore(SnapshotStore):
    """A directory. Writes go to a temp file and are linked into place, so readers never see a partial
    object and two writers of one name cannot both win."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).expanduser().resolve()
        self.url = f"file://{self.root}"

    def _path(self, name: str) -> Path:
        return self.root / _check_name(name)

    @staticmethod
    def _sidecar(path: Path) -> Path:
        return path.with_name(path.name + ".sha256")

    @contextmanager
    def _directory_lock(self, directory: Path) -> Iterator[None]:
        """Serialises the writers of one directory's names; the kernel drops it when its holder dies, and it
        leaves no file behind (a full disk keeps no lock file)."""
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _write_temp(self, directory: Path, data: bytes) -> Path:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        except BaseException:
            os.unlink(tmp)  # a full disk keeps no partial file taking the space
            raise
        return Path(tmp)

    def put(self, name: str, data: bytes, *, overwrite: bool = False) -> ObjectInfo:
        path = self._path(name)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            digest = hashlib.sha256(data).hexdigest()
            tmp = self._write_temp(path.parent, data)
            try:
                with self._directory_lock(path.parent):  # held until the checksum is written, released if killed
                    if overwrite:
                        os.replace(tmp, path)
                        self._write_sidecar(path, digest)
                    else:
                        self._link_new(tmp, path)
                        try:
                            self._write_sidecar(path, digest)
                        except OSError:
                            path.unlink()  # no object without its checksum (a full disk, say)
                            raise
            finally:
                tmp.unlink(missing_ok=True)
        except FileExistsError:
            raise AlreadyExists(f"{name} already exists in {self.url}") from None
        except OSError as exc:
            raise StoreUnavailable(f"{self.url}: cannot write {name}: {exc.strerror}") from None
        return ObjectInfo(name, len(data), digest, path.stat().st_mtime)

    def _link_new(self, tmp: Path, path: Path) -> None:
        """Link the written bytes into place unless another writer's object is there: first writer wins.

        Called under the directory's lock, so an object without its checksum here was left by a writer killed
        between linking and writing the checksum: this write finishes in its place.
        """
        try:
            os.link(tmp, path)
        except FileExistsError:
            if self._stored_sha(path) is not None:
                raise
            os.replace(tmp, path)

    def _write_sidecar(self, path: Path, digest: str) -> None:
        tmp = self._write_temp(path.parent, digest.encode())
        os.replace(tmp, self._sidecar(path))

    def _stored_sha(self, path: Path) -> str | None:
        try:
            return self._sidecar(path).read_text().strip() or None
        except FileNotFoundError:
            return None

    def get(self, name: str, *, sha256: str | None = None) -> bytes:
        path = self._path(name)
        try:
            data = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(f"{name} not found in {self.url}") from None
        except OSError as exc:
            raise StoreUnavailable(f"{self.url}: cannot read {name}: {exc.strerror}") from None
        return _verify(name, data, sha256 or self._stored_sha(path))

    def get_view(self, name: str, *, sha256: str | None = None) -> bytes | mmap.mmap:
        path = self._path(name)
        try:
            expected = sha256 or self._stored_sha(path)
            with open(path, "rb") as handle:
                if os.fstat(handle.fileno()).st_size == 0:  # nothing to map
                    return _verify(name, b"", expected)
                # private (copy-on-write) mapping: writable for torch, never written back to the file
                view = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(f"{name} not found in {self.url}") from None
        except OSError as exc:
            raise StoreUnavailable(f"{self.url}: cannot read {name}: {exc.strerror}") from None
        return _verify(name, view, expected)

    def head(self, name: str) -> ObjectInfo | None:
        path = self._path(name)
        try:
            stat = path.stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        return ObjectInfo(name, stat.st_size, self._stored_sha(path), stat.st_mtime)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if not self.root.is_dir():
            return
        for path in sorted(self.root.rglob("*")):
            name = path.relative_to(self.root).as_posix()
            # .lock: the per-name lock files that stores written by earlier versions hold
            if not path.is_file() or path.name.startswith(".tmp-") or name.endswith((".sha256", ".lock")):
                continue
            if name.startswith(prefix):
                info = self.head(name)
                if info is not None:
                    yield info

    def delete(self, name: str) -> None:
        path = self._path(name)
        for victim in (path, self._sidecar(path), path.with_name(path.name + ".lock")):
            victim.unlink(missing_ok=True)

    def ping(self, *, create: bool = False) -> None:
        try:
            if create:
                self.root.mkdir(parents=True, exist_ok=True)
            elif not self.root.is_dir():
                raise StoreUnavailable(f"{self.url}: no such folder (moved, unmounted, or never written)")
            if not os.access(self.root, os.R_OK | os.W_OK):
                raise StoreUnavailable(f"{self.url}: not readable and writable")
        except OSError as exc:
            raise StoreUnavailable(f"{self.url}: {exc.strerror}") from None


class S3Store(SnapshotStore):
    """An S3 bucket (AWS, SeaweedFS, MinIO...). Credentials are the ``role``'s (``s3_credentials``), else
    boto3's usual chain (environment variables, shared credential files, instance roles), never the config."""

    def __init__(self, bucket: str, prefix: str = "", settings: S3Config | None = None, client=None,
                 role: StoreRole = "reader"):
        self.settings = settings or S3Config()
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.role = role
        self.client = client or s3_client(self.settings, *s3_credentials(role))

    def _key(self, name: str) -> str:
        _check_name(name)
        return f"{self.prefix}/{name}" if self.prefix else name

    def _name(self, key: str) -> str:
        return key[len(self.prefix) + 1:] if self.prefix else key

    def _translate(self, exc: BotoCoreError | ClientError, name: str, action: str = "read") -> StoreError:
        if isinstance(exc, ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code == "AccessDenied":
                return StoreForbidden(f"{self.url}: the {self.role} credentials may not {action} {name} (AccessDenied)")
            if code in ("NoSuchKey", "404", "NotFound") or status == 404 and code != "NoSuchBucket":
                return NotFound(f"{name} not found in {self.url}")
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                return AlreadyExists(f"{name} already exists in {self.url}")
            if code in ("BadDigest", "XAmzContentSHA256Mismatch", "InvalidDigest"):
                return ChecksumMismatch(f"{name}: upload rejected by {self.url}: {code}")
            return StoreUnavailable(f"{self.url}: {code or status} on {name}: {exc.response.get('Error', {}).get('Message', '')}")
        return StoreUnavailable(f"{self.url} unreachable: {exc}")

    def put(self, name: str, data: bytes, *, overwrite: bool = False) -> ObjectInfo:
        key = self._key(name)
        digest = hashlib.sha256(data).hexdigest()
        condition = {} if overwrite else {"IfNoneMatch": "*"}
        try:
            if len(data) < self.settings.multipart_threshold_bytes:
                self.client.put_object(Bucket=self.bucket, Key=key, Body=data, ChecksumAlgorithm="SHA256",
                                       Metadata={"sha256": digest}, **condition)
            else:
                self._put_multipart(key, data, digest, condition)
        except _S3_ERRORS as exc:
            raise self._translate(exc, name, "write") from None
        return ObjectInfo(name, len(data), digest, time.time())

    def _put_multipart(self, key: str, data: bytes, digest: str, condition: dict) -> None:
        """Parts are invisible until completion, so a crash leaves no partial object; abort on error."""
        part_size = self.settings.multipart_threshold_bytes
        upload = self.client.create_multipart_upload(Bucket=self.bucket, Key=key, ChecksumAlgorithm="SHA256",
                                                     Metadata={"sha256": digest})
        upload_id = upload["UploadId"]
        try:
            parts = []
            for number, start in enumerate(range(0, len(data), part_size), start=1):
                chunk = data[start:start + part_size]
                checksum = base64.b64encode(hashlib.sha256(chunk).digest()).decode()
                reply = self.client.upload_part(Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number,
                                                Body=chunk, ChecksumAlgorithm="SHA256", ChecksumSHA256=checksum)
                parts.append({"PartNumber": number, "ETag": reply["ETag"], "ChecksumSHA256": checksum})
            self.client.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                                  MultipartUpload={"Parts": parts}, **condition)
        except BaseException:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            raise
        if condition:
            # Some S3-compatible servers check IfNoneMatch before, not atomically with, completing: two
            # racing uploads can both complete. The one whose bytes are not there lost.
            stored = self.client.head_object(Bucket=self.bucket, Key=key).get("Metadata", {}).get("sha256")
            if stored != digest:
                raise AlreadyExists(f"{self._name(key)} already exists in {self.url}")

    def get(self, name: str, *, sha256: str | None = None) -> bytes:
        try:
            reply = self.client.get_object(Bucket=self.bucket, Key=self._key(name))
            data = reply["Body"].read()
        except _S3_ERRORS as exc:
            raise self._translate(exc, name) from None
        return _verify(name, data, sha256 or reply.get("Metadata", {}).get("sha256"))

    def head(self, name: str) -> ObjectInfo | None:
        try:
            reply = self.client.head_object(Bucket=self.bucket, Key=self._key(name))
        except _S3_ERRORS as exc:
            error = self._translate(exc, name)
            if isinstance(error, NotFound):
                return None
            raise error from None
        return ObjectInfo(name, reply["ContentLength"], reply.get("Metadata", {}).get("sha256"),
                          reply["LastModified"].timestamp())

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix  # a prefix such as "releases/" is no object name
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
                for item in page.get("Contents", []):
                    name = self._name(item["Key"])
                    yield ObjectInfo(name, item["Size"], None, item["LastModified"].timestamp())
        except _S3_ERRORS as exc:
            raise self._translate(exc, prefix or "<list>", "list") from None

    def delete(self, name: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(name))
        except _S3_ERRORS as exc:
            error = self._translate(exc, name, "delete")
            if not isinstance(error, NotFound):
                raise error from None

    def ping(self, *, create: bool = False) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except _S3_ERRORS as exc:
            raise StoreUnavailable(str(self._translate(exc, "<bucket>"))) from None


def credential_variables(role: StoreRole) -> tuple[str, str]:
    """The environment variables (each also as ``<NAME>_FILE``) holding ``role``'s access key id and secret."""
    return f"CAGFLOW_S3_{role.upper()}_ACCESS_KEY_ID", f"CAGFLOW_S3_{role.upper()}_SECRET_ACCESS_KEY"


def s3_credentials(role: StoreRole, environ: dict[str, str] | None = None) -> tuple[str | None, str | None]:
    """``role``'s S3 key pair from the environment or secret files; (None, None) when not set, so boto3's
    usual chain (``AWS_*`` variables, credential files, instance roles) applies."""
    names = credential_variables(role)
    access_key_id, secret_access_key = (read_secret(name, environ) for name in names)
    if (access_key_id is None) != (secret_access_key is None):
        raise ConfigError(f"{role} S3 credentials: set both {names[0]} and {names[1]} (or their _FILE forms), "
                          "or neither")
    return access_key_id, secret_access_key


def s3_client(settings: S3Config, access_key_id: str | None = None, secret_access_key: str | None = None):
    """The boto3 S3 client every S3 store uses. Credentials default to boto3's usual chain. A session of its
    own: boto3's shared default session caches the first credentials it resolves."""
    session = boto3.session.Session(aws_access_key_id=access_key_id, aws_secret_access_key=secret_access_key,
                                    region_name=settings.region)
    return session.client("s3", endpoint_url=settings.endpoint_url, config=BotoConfig(
        connect_timeout=settings.connect_timeout_s,
        read_timeout=settings.read_timeout_s,
        # total_max_attempts counts the first request too; botocore reads "max_attempts" here as retries
        retries={"total_max_attempts": settings.max_attempts, "mode": "standard"},
        s3={"addressing_style": "path"},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    ))


def open_store(url: str, s3: S3Config | None = None, client=None, *, role: StoreRole = "reader") -> SnapshotStore:
    """``file:///path`` (or a plain path) → LocalStore; ``s3://bucket/prefix`` → S3Store (with ``client``,
    when given, instead of one built from ``s3`` and ``role``'s credentials). Only code that writes the store
    (pipeline, admin commands) asks for the ``writer`` role."""
    parsed = urlparse(url)
    if parsed.scheme in ("", "file"):
        return LocalStore(parsed.path if parsed.scheme else url)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"store URL {url!r} names no bucket")
        return S3Store(parsed.netloc, parsed.path, s3, client=client, role=role)
    raise ValueError(f"store URL {url!r}: unsupported scheme {parsed.scheme!r} (use file:// or s3://)")
