import pytest
import torch
from cagflow.documents.keys import SnapshotFormatError, SnapshotKey, read_metadata
from cagflow.documents.snapshot import Snapshot
from cagflow.store.layout import snapshot_object

FP = "ab" * 32


def make_snapshot(n_tokens=5, part=None):
    torch.manual_seed(0)
    keys = [torch.randn(2, n_tokens, 8) for _ in range(3)]
    values = [torch.randn(2, n_tokens, 8) for _ in range(3)]
    return Snapshot("manual", "1.2.0", part, FP, list(range(100, 100 + n_tokens)), keys, values,
                    title="Manual", system_prompt="Document: Manual\n\nText ✓")


def test_key_format_round_trip():
    key = SnapshotKey.for_model("manual", "1.2.0", FP, part=2)
    assert str(key) == f"manual/1.2.0/{FP[:16]}#2"
    assert SnapshotKey.parse(str(key)) == key
    assert snapshot_object(key) == f"snapshots/manual/1.2.0/{FP[:16]}.part2.safetensors"
    assert str(SnapshotKey.for_model("manual", "1.2.0", FP)) == f"manual/1.2.0/{FP[:16]}"


@pytest.mark.parametrize("text", ["", "manual/1.2.0", "../etc/1.0/abababababababab", "Manual/1.0/abababababababab",
                                  "manual/1.0/ABABABABABABABAB", "manual/1.0/abababababababab#0",
                                  "manual/../abababababababab"])
def test_malformed_keys_are_rejected(text):
    with pytest.raises(ValueError):
        SnapshotKey.parse(text)


def test_bytes_round_trip_keeps_tensors_and_metadata():
    snapshot = make_snapshot(part=3)
    loaded = Snapshot.from_bytes(snapshot.to_bytes())
    assert loaded.key == snapshot.key
    assert loaded.prefix_token_ids == snapshot.prefix_token_ids
    assert loaded.system_prompt == snapshot.system_prompt and loaded.title == "Manual"
    assert loaded.n_tokens == 5 and loaded.dtype == torch.float32
    assert abs(loaded.created_at - snapshot.created_at) < 1e-5
    for a, b in zip(snapshot.keys + snapshot.values, loaded.keys + loaded.values):
        assert torch.equal(a, b)
    meta = read_metadata(snapshot.to_bytes())
    assert meta["doc_id"] == "manual" and meta["n_tokens"] == "5" and meta["dtype"] == "float32"


def test_foreign_or_damaged_bytes_are_rejected():
    from safetensors.torch import save

    with pytest.raises(SnapshotFormatError):
        Snapshot.from_bytes(b"not a snapshot at all")
    with pytest.raises(SnapshotFormatError, match="not a cagflow-kv"):
        Snapshot.from_bytes(save({"x": torch.zeros(2)}))
    data = bytearray(make_snapshot().to_bytes())
    with pytest.raises(SnapshotFormatError):
        Snapshot.from_bytes(bytes(data[: len(data) // 2]))
