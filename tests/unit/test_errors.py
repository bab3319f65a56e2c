"""One base exception with a stable code, and the code's trip across the Triton boundary."""

import importlib
import inspect
import pkgutil

import pytest

import cagflow
from cagflow.errors import INTERNAL, CagflowError, error_code, split_code, with_code
from cagflow.inference.resident import SnapshotQuarantined
from cagflow.inference.triton import describe, triton_status
from cagflow.router.failures import fallback_reason
from cagflow.router.triton_client import TritonRejected
from cagflow.store.backends import StoreUnavailable
from cagflow.store.manifests import SnapshotUnusable

AIRFLOW_ONLY = {"cagflow.offline.dag_tasks"}  # imports Airflow at module level; defines no exceptions


def _exception_classes():
    for info in pkgutil.walk_packages(cagflow.__path__, "cagflow."):
        if info.name in AIRFLOW_ONLY:
            continue
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == info.name and issubclass(cls, BaseException):
                yield cls


def test_every_error_the_package_defines_has_the_one_base_and_a_code():
    classes = list(_exception_classes())
    assert len(classes) >= 30
    assert [cls.__qualname__ for cls in classes if not issubclass(cls, CagflowError)] == []
    assert all(cls.code and cls.code.islower() for cls in classes)


def test_codes_survive_a_text_only_boundary():
    assert split_code(with_code("snapshot_corrupt", "bytes differ: [x] y")) == ("snapshot_corrupt", "bytes differ: [x] y")
    assert split_code("plain text from elsewhere") == (None, "plain text from elsewhere")
    assert error_code(KeyError("k")) == INTERNAL
    assert error_code(CagflowError("x", code="custom_reason")) == "custom_reason"


@pytest.mark.parametrize("error, status, reason", [
    (SnapshotQuarantined("snapshot a/1/0123456789abcdef is corrupt; quarantined", code="snapshot_corrupt"),
     "UNAVAILABLE", "snapshot_corrupt"),
    (SnapshotUnusable("snapshot a/1/0123456789abcdef is missing", code="snapshot_missing"), "UNAVAILABLE",
     "snapshot_unavailable"),
    (StoreUnavailable("store down"), "UNAVAILABLE", "snapshot_unavailable"),
    (RuntimeError("a bug"), "INTERNAL", "triton_error"),
])
def test_the_router_reads_the_reason_the_serving_side_sent(error, status, reason):
    """What the Triton adapter writes is what the router maps: code first, then the words."""
    message = describe(error, "req-1")
    assert triton_status(error) == status
    assert message.startswith(f"[{error_code(error)}] request req-1: ")
    assert fallback_reason(TritonRejected(503 if status == "UNAVAILABLE" else 500, message)) == reason
