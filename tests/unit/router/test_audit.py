"""The audit log: one whole JSON line per event, shared safely by writers, and never a reason to fail an action."""

import json
import logging
import stat
import threading

import pytest
from cagflow.router.audit import AuditLog

FIELDS = {"ts", "via", "action", "target", "result", "reason", "key_id", "key_name", "user", "remote_addr",
          "request_id", "trace_id", "detail"}


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def audit_caplog(caplog, monkeypatch):
    """What reaches the audit logger (its parent, the router's logger, stops propagation once an app exists)."""
    logger = logging.getLogger("cagflow.router.audit")
    monkeypatch.setattr(logger, "propagate", False)
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="cagflow.router.audit")
    yield caplog
    logger.removeHandler(caplog.handler)


def test_an_event_is_one_json_line_with_every_field(tmp_path):
    path = tmp_path / "audit" / "audit.jsonl"
    audit = AuditLog(path, clock=lambda: 1_800_000_000.25)
    audit.record("admin.reload", "denied", via="rest", reason="forbidden", key_id="0a1b2c3d4e5f", key_name="ops",
                 remote_addr="10.0.0.7", request_id="r-1")
    audit.record("keys.create", "ok", via="cli", target="0a1b2c3d4e5f", user="alice", detail={"name": "x\u2028y"})
    first, second = lines(path)
    assert set(first) == FIELDS and first["ts"] == "2027-01-15T08:00:00.250Z"
    assert (first["action"], first["result"], first["reason"], first["key_name"], first["remote_addr"]) == (
        "admin.reload", "denied", "forbidden", "ops", "10.0.0.7")
    assert second["user"] == "alice" and second["detail"] == {"name": "x\u2028y"}  # escaped: still one line
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_events_also_go_to_the_logger_and_a_missing_path_means_the_logger_only(audit_caplog):
    event = AuditLog(None).record("keys.revoke", "ok", via="cli", target="0a1b2c3d4e5f")
    [logged] = audit_caplog.records
    assert json.loads(logged.getMessage()) == event


def test_an_unwritable_audit_log_is_reported_not_raised(tmp_path, audit_caplog):
    (tmp_path / "a-file").write_text("")
    audit = AuditLog(tmp_path / "a-file" / "audit.jsonl")
    event = audit.record("keys.create", "ok", via="cli", target="0a1b2c3d4e5f")
    errors = [record.getMessage() for record in audit_caplog.records if record.levelno == logging.ERROR]
    assert len(errors) == 1 and "cannot write audit log" in errors[0] and json.dumps(event) in errors[0]


def test_concurrent_writers_leave_whole_lines(tmp_path):
    path = tmp_path / "audit.jsonl"
    writers = [AuditLog(path) for _ in range(4)]  # as separate processes would: a file each, one lock

    def write(audit, n):
        for i in range(50):
            audit.record("admin.reload", "ok", via="rest", target=f"{n}-{i}", detail={"padding": "x" * 2000})

    threads = [threading.Thread(target=write, args=(audit, n)) for n, audit in enumerate(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(event["target"] for event in lines(path)) == sorted(f"{n}-{i}" for n in range(4) for i in range(50))
