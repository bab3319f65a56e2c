"""``cagflow trace TRACE_ID``: one request's trace from the collector's query API, drawn as a tree in the
terminal (each span's service, start after the trace's first span, and duration), for where no trace UI runs.

It reads Jaeger's HTTP query API (``GET /api/traces/<id>``, the one the Jaeger UI uses), which Jaeger v2
serves on its UI port (``tracing.query_url``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import requests

from ..devstack.jaeger import query_trace
from ..errors import CagflowError


class TraceUnavailable(CagflowError):
    """The collector could not be asked, or holds no such trace."""

    code = "trace_unavailable"


@dataclass
class SpanNode:
    name: str
    service: str
    start_us: int
    duration_us: int
    attributes: dict[str, Any]
    error: bool
    children: list["SpanNode"] = field(default_factory=list)


def fetch_trace(query_url: str, trace_id: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """The trace as Jaeger's query API returns it (``spans`` and ``processes``); what went wrong, in words."""
    try:
        found = query_trace(query_url, trace_id, timeout_s)
    except requests.HTTPError as exc:
        raise TraceUnavailable(f"the collector at {query_url} answered {exc.response.status_code}: "
                               f"{exc.response.text[:200]}") from None
    except (ValueError, AttributeError):  # requests' JSONDecodeError is a ValueError too
        raise TraceUnavailable(f"{query_url} is not a Jaeger query API (its reply is not the expected JSON)") from None
    except requests.RequestException as exc:
        raise TraceUnavailable(f"cannot reach the trace collector at {query_url} ({type(exc).__name__}); "
                               "is it running (`cagflow jaeger up`) and is tracing.query_url right?") from None
    if found is None:
        raise TraceUnavailable(f"the collector at {query_url} holds no trace {trace_id} (not sampled, not sent "
                               "yet, or older than what it keeps)")
    return found


def span_tree(trace: dict[str, Any]) -> list[SpanNode]:
    """The spans as trees (roots first, children by start time); a span whose parent the collector lacks
    (the caller's, outside this system) is a root."""
    nodes: dict[str, SpanNode] = {}
    parents: dict[str, str | None] = {}
    for span in trace["spans"]:
        tags = {tag["key"]: tag["value"] for tag in span.get("tags", [])}
        nodes[span["spanID"]] = SpanNode(span["operationName"], trace["processes"][span["processID"]]["serviceName"],
                                         span["startTime"], span["duration"],
                                         {key: value for key, value in tags.items() if key.startswith("cagflow.")},
                                         tags.get("otel.status_code") == "ERROR" or tags.get("error") is True)
        parents[span["spanID"]] = next((ref["spanID"] for ref in span.get("references", [])
                                        if ref["refType"] == "CHILD_OF"), None)
    roots = []
    for span_id, node in nodes.items():
        parent = nodes.get(parents[span_id] or "")
        (parent.children if parent is not None else roots).append(node)
    for node in nodes.values():
        node.children.sort(key=lambda child: child.start_us)
    return sorted(roots, key=lambda root: root.start_us)


def render(trace_id: str, roots: list[SpanNode], attributes: bool = False) -> str:
    """A tree, one span a line: name, service, start (ms after the first span) and duration."""
    if not roots:
        return f"trace {trace_id}: no spans"
    origin = min(root.start_us for root in roots)
    end = max(root.start_us + root.duration_us for root in roots)
    lines = [f"trace {trace_id}: {(end - origin) / 1000:.1f} ms"]

    def walk(node: SpanNode, prefix: str, last: bool, depth: int) -> None:
        branch = "" if depth == 0 else ("└─ " if last else "├─ ")
        label = f"{prefix}{branch}{node.name}"
        flag = "  ERROR" if node.error else ""
        lines.append(f"{label:<48} {node.service:<16} +{(node.start_us - origin) / 1000:>9.1f} ms "
                     f"{node.duration_us / 1000:>9.1f} ms{flag}")
        inner = prefix + ("" if depth == 0 else ("   " if last else "│  "))
        if attributes and node.attributes:
            lines.append(f"{inner}   " + ", ".join(f"{key[8:]}={value}" for key, value in node.attributes.items()))
        for position, child in enumerate(node.children):
            walk(child, inner, position == len(node.children) - 1, depth + 1)

    for root in roots:
        walk(root, "", True, 0)
    return "\n".join(lines)
