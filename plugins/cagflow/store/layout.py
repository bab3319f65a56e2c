"""The store's layout, named in this one place:

```
snapshots/{doc_id}/{doc_version}/{fingerprint16}[.part{n}].safetensors   immutable snapshot objects
releases/{release_id}.json                                               immutable release manifests
releases/current.json                                                    the active release (the only overwritten object)
heat/{replica_id}.json                                                   access counts, one object per serving replica
passages/{fingerprint16}/{content_key}.safetensors                       retrieved passages' K/V, content-addressed
```
"""

from __future__ import annotations

from ..documents.keys import SnapshotKey

SNAPSHOTS_PREFIX = "snapshots/"
RELEASES_PREFIX = "releases/"
CURRENT_POINTER = f"{RELEASES_PREFIX}current.json"
HEAT_PREFIX = "heat/"
PASSAGES_PREFIX = "passages/"
_RELEASE_SUFFIX = ".json"


def snapshot_object(key: SnapshotKey | str) -> str:
    """Where a snapshot's file lives; '#' is avoided in object names."""
    key = SnapshotKey.parse(key) if isinstance(key, str) else key
    suffix = f".part{key.part}" if key.part is not None else ""
    return f"{SNAPSHOTS_PREFIX}{key.doc_id}/{key.doc_version}/{key.fingerprint16}{suffix}.safetensors"


def release_object(release_id: str) -> str:
    return f"{RELEASES_PREFIX}{release_id}{_RELEASE_SUFFIX}"


def release_id_of(object_name: str) -> str | None:
    """The release id a release object holds; None for the pointer or anything else."""
    if object_name == CURRENT_POINTER or not object_name.startswith(RELEASES_PREFIX) \
            or not object_name.endswith(_RELEASE_SUFFIX):
        return None
    return object_name[len(RELEASES_PREFIX):-len(_RELEASE_SUFFIX)]


def heat_object(replica_id: str) -> str:
    return f"{HEAT_PREFIX}{replica_id}.json"


def passage_object(model_fingerprint: str, content_key: str) -> str:
    """Where one passage's K/V lives (``engine.passage_kv``): content-addressed, per model."""
    return f"{PASSAGES_PREFIX}{model_fingerprint[:16]}/{content_key}.safetensors"
