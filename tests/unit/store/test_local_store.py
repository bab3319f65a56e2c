"""LocalStore: write-once objects with a sha256 sidecar, verified reads, and safe concurrent writers."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import signal
import threading
from pathlib import Path

import pytest
from cagflow.store.backends import (AlreadyExists, ChecksumMismatch, LocalStore, NotFound, ObjectInfo,
                                     StoreUnavailable)

RACE_ROUNDS = 10


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def temp_files(root: Path) -> list[Path]:
    return list(root.rglob(".tmp-*"))


def flip_one_byte(path: Path, offset: int = 0) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        original = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([original[0] ^ 0x01]))


def writer_payload(writer: int, round_number: int) -> bytes:
    """Distinct, sizeable bytes per writer so a torn or mixed write would not verify."""
    return bytes([writer + 1]) * (256 * 1024) + f"writer {writer} round {round_number}".encode()


def race_name(round_number: int) -> str:
    return f"race/{round_number}.bin"


def race_as_process(root: str, writer: int, barrier, outcomes) -> None:
    """One competing writer in its own process: put every race name right after all writers line up."""
    store = LocalStore(root)
    for round_number in range(RACE_ROUNDS):
        barrier.wait()
        try:
            store.put(race_name(round_number), writer_payload(writer, round_number))
            outcomes.put((round_number, writer, "won"))
        except AlreadyExists:
            outcomes.put((round_number, writer, "lost"))


def assert_one_winner_per_round(store: LocalStore, outcomes: list[tuple[int, int, str]], writers: int) -> None:
    for round_number in range(RACE_ROUNDS):
        results = {writer: result for rnd, writer, result in outcomes if rnd == round_number}
        assert len(results) == writers
        winners = [writer for writer, result in results.items() if result == "won"]
        assert len(winners) == 1, f"round {round_number}: {results}"
        expected = writer_payload(winners[0], round_number)
        assert store.get(race_name(round_number)) == expected
        assert store.head(race_name(round_number)).sha256 == sha256(expected)
    assert temp_files(store.root) == []


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")


def test_round_trip_returns_the_bytes_and_their_checksum(store: LocalStore):
    data = b"kv-cache bytes \x00\xff" * 1000
    info = store.put("snapshots/doc/1/abc.safetensors", data)
    assert info.name == "snapshots/doc/1/abc.safetensors"
    assert info.size == len(data)
    assert info.sha256 == sha256(data)
    assert store.get("snapshots/doc/1/abc.safetensors") == data
    assert store.get("snapshots/doc/1/abc.safetensors", sha256=sha256(data)) == data
    assert store.exists_verified("snapshots/doc/1/abc.safetensors")


def test_head_list_and_delete(store: LocalStore):
    store.put("releases/r1.json", b"one")
    store.put("releases/r2.json", b"two!")
    store.put("snapshots/d/1/f.safetensors", b"three")

    head = store.head("releases/r2.json")
    assert isinstance(head, ObjectInfo)
    assert (head.name, head.size, head.sha256) == ("releases/r2.json", 4, sha256(b"two!"))
    assert store.head("releases/missing.json") is None

    assert [info.name for info in store.list("releases/")] == ["releases/r1.json", "releases/r2.json"]
    assert [info.name for info in store.list()] == ["releases/r1.json", "releases/r2.json",
                                                    "snapshots/d/1/f.safetensors"]
    assert [info.sha256 for info in store.list("releases/")] == [sha256(b"one"), sha256(b"two!")]

    store.delete("releases/r1.json")
    assert store.head("releases/r1.json") is None
    with pytest.raises(NotFound):
        store.get("releases/r1.json")
    assert [info.name for info in store.list("releases/")] == ["releases/r2.json"]
    store.delete("releases/r1.json")  # deleting a missing object is not an error


def test_list_of_a_store_that_was_never_written_is_empty(tmp_path: Path):
    assert list(LocalStore(tmp_path / "nothing-here").list()) == []


def test_flipped_byte_is_detected_with_the_stored_checksum(store: LocalStore):
    data = bytes(range(256)) * 64
    store.put("obj.bin", data)
    flip_one_byte(store.root / "obj.bin", offset=1000)
    with pytest.raises(ChecksumMismatch):
        store.get("obj.bin")
    assert not store.exists_verified("obj.bin")


def test_flipped_byte_is_detected_with_an_explicit_checksum(store: LocalStore):
    data = bytes(range(256)) * 64
    store.put("obj.bin", data)
    flip_one_byte(store.root / "obj.bin", offset=len(data) - 1)
    with pytest.raises(ChecksumMismatch):
        store.get("obj.bin", sha256=sha256(data))
    assert not store.exists_verified("obj.bin", sha256(data))


@pytest.mark.parametrize("offset", [0, 5000, 64 * 1024 - 1])
def test_a_mapped_read_is_verified_like_a_copy(store: LocalStore, offset: int):
    """``get_view`` maps the file instead of copying it: the same bytes, the same verdict on any flipped byte,
    and the mapping is private (writing to it never reaches the file)."""
    data = bytes(range(256)) * 256
    store.put("big.bin", data)
    view = store.get_view("big.bin", sha256=sha256(data))
    assert bytes(view) == data and store.get_view("big.bin")[:16] == data[:16]
    view[0] = (view[0] + 1) % 256
    assert store.get("big.bin") == data
    flip_one_byte(store.root / "big.bin", offset=offset)
    with pytest.raises(ChecksumMismatch):
        store.get_view("big.bin")
    with pytest.raises(ChecksumMismatch):
        store.get_view("big.bin", sha256=sha256(data))
    with pytest.raises(NotFound):
        store.get_view("missing.bin")


def test_explicit_checksum_takes_precedence_over_the_sidecar(store: LocalStore):
    store.put("obj.bin", b"payload")
    with pytest.raises(ChecksumMismatch):
        store.get("obj.bin", sha256=sha256(b"another payload"))


def test_existing_object_is_not_overwritten(store: LocalStore):
    store.put("obj.bin", b"original")
    with pytest.raises(AlreadyExists):
        store.put("obj.bin", b"replacement")
    assert store.get("obj.bin") == b"original"
    assert store.head("obj.bin").sha256 == sha256(b"original")
    assert temp_files(store.root) == []


def test_overwrite_replaces_bytes_and_checksum(store: LocalStore):
    store.put("releases/current.json", b'{"release": 1}')
    info = store.put("releases/current.json", b'{"release": 2}', overwrite=True)
    assert info.sha256 == sha256(b'{"release": 2}')
    assert store.get("releases/current.json") == b'{"release": 2}'
    assert store.head("releases/current.json").sha256 == sha256(b'{"release": 2}')
    assert [info.name for info in store.list("releases/")] == ["releases/current.json"]
    assert temp_files(store.root) == []


def test_two_threads_writing_one_name_have_exactly_one_winner(store: LocalStore):
    barrier = threading.Barrier(2)
    outcomes: list[tuple[int, int, str]] = []
    lock = threading.Lock()

    def compete(writer: int) -> None:
        for round_number in range(RACE_ROUNDS):
            barrier.wait()
            try:
                store.put(race_name(round_number), writer_payload(writer, round_number))
                result = "won"
            except AlreadyExists:
                result = "lost"
            with lock:
                outcomes.append((round_number, writer, result))

    threads = [threading.Thread(target=compete, args=(writer,)) for writer in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    assert_one_winner_per_round(store, outcomes, writers=2)


def test_two_processes_writing_one_name_have_exactly_one_winner(store: LocalStore):
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(2)
    results = context.Queue()
    processes = [context.Process(target=race_as_process, args=(str(store.root), writer, barrier, results))
                 for writer in range(2)]
    for process in processes:
        process.start()
    outcomes = [results.get(timeout=60) for _ in range(2 * RACE_ROUNDS)]
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    assert_one_winner_per_round(store, outcomes, writers=2)


def put_and_die_before_the_checksum(root: str, name: str) -> None:
    """A writer killed (SIGKILL) after its bytes are linked into place and before its checksum is written."""
    def killed(*_args) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    LocalStore._write_sidecar = killed
    LocalStore(root).put(name, b"the first writer's bytes")


def test_a_writer_killed_before_its_checksum_leaves_a_name_the_next_write_completes(store: LocalStore):
    """kill -9 between linking the bytes and writing their checksum: the rerun's write takes the name
    (no 'exists but does not verify' forever), and a completed object still has exactly one winner."""
    process = multiprocessing.get_context("spawn").Process(target=put_and_die_before_the_checksum,
                                                           args=(str(store.root), "snap/a.bin"))
    process.start()
    process.join(timeout=60)
    assert process.exitcode == -signal.SIGKILL
    assert store.head("snap/a.bin").sha256 is None  # the killed writer's bytes, without a checksum

    info = store.put("snap/a.bin", b"the rerun's bytes")
    assert info.sha256 == sha256(b"the rerun's bytes")
    assert store.get("snap/a.bin") == b"the rerun's bytes"
    assert store.head("snap/a.bin").sha256 == info.sha256
    with pytest.raises(AlreadyExists):
        store.put("snap/a.bin", b"a later writer's bytes")
    assert store.get("snap/a.bin") == b"the rerun's bytes"


@pytest.mark.parametrize("name", ["../x", "/abs", "a/./b", "obj.sha256", "a//b", "", "dir/", "x.lock",
                                  "dir/.tmp-partial"])
def test_invalid_names_are_rejected(store: LocalStore, name: str):
    with pytest.raises(ValueError):
        store.put(name, b"data")
    with pytest.raises(ValueError):
        store.get(name)
    with pytest.raises(ValueError):
        store.head(name)
    with pytest.raises(ValueError):
        store.delete(name)
    assert not (store.root.parent / "x").exists()


def test_get_of_a_missing_name_is_not_found(store: LocalStore):
    with pytest.raises(NotFound):
        store.get("missing.bin")
    with pytest.raises(NotFound):
        store.get("missing/dir/obj.bin")
    assert not store.exists_verified("missing.bin")


def test_get_below_an_object_is_not_found(store: LocalStore):
    store.put("obj.bin", b"payload")
    with pytest.raises(NotFound):
        store.get("obj.bin/inner")


def test_no_temp_files_after_successful_and_failed_puts(store: LocalStore):
    store.put("a/b/c.bin", b"first")
    store.put("a/b/c.bin", b"second", overwrite=True)
    with pytest.raises(AlreadyExists):
        store.put("a/b/c.bin", b"third")
    store.put("a/d.bin", b"other")
    assert temp_files(store.root) == []
    assert sorted(path.name for path in store.root.rglob("*") if path.is_file() and not path.name.endswith(".lock")) \
        == ["c.bin", "c.bin.sha256", "d.bin", "d.bin.sha256"]


def test_a_reader_ping_reports_a_vanished_store_and_never_recreates_it(tmp_path: Path):
    store = LocalStore(tmp_path / "store")
    with pytest.raises(StoreUnavailable, match="no such folder"):
        store.ping()
    assert not store.root.exists()
    store.ping(create=True)  # a writer about to fill it
    assert store.root.is_dir()
    store.ping()


@pytest.mark.parametrize("failing", ["data", "checksum"])
def test_a_full_disk_leaves_no_partial_file_and_no_object(store: LocalStore, monkeypatch, failing: str):
    """ENOSPC while the bytes or the checksum sidecar are written: a clear error, no object that could be
    listed or read, and no temp file keeping the space."""
    import os

    real_fsync = os.fsync
    written = []

    def fsync_until_full(fd: int) -> None:
        written.append(fd)
        if failing == "data" or len(written) > 1:  # the second fsync is the sidecar's
            raise OSError(28, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_until_full)
    with pytest.raises(StoreUnavailable, match="No space left on device"):
        store.put("snapshots/doc/1/abc.safetensors", b"x" * 4096)
    monkeypatch.undo()
    assert store.head("snapshots/doc/1/abc.safetensors") is None
    assert list(store.list()) == [] and temp_files(store.root) == []
    assert [path for path in store.root.rglob("*") if path.is_file()] == []
    store.put("snapshots/doc/1/abc.safetensors", b"x" * 4096)  # the name is free for the rerun
