"""Triton's ``cag_llm`` over a pooled keep-alive HTTP session (KServe v2 JSON), ``cag_llm_stream`` over
gRPC streaming.

One ``requests.Session`` is shared by every request thread: connections are reused, so a call costs a
round trip, not a TCP handshake. Connection failures are retried ``retries`` times; a request that
reached the model is never repeated (an answer costs seconds of compute).
"""

from __future__ import annotations

import queue
import re
import time
from typing import Any, Iterator

import numpy as np
import requests
import tritonclient.grpc as grpcclient  # imported with the router, not by its first stream (~40 MiB of modules)
from requests.adapters import HTTPAdapter
from tritonclient.utils import InferenceServerException

from .. import tracing
from ..errors import CagflowError, split_code
from . import metrics

ANSWER_MODEL = "cag_llm"
STREAM_MODEL = "cag_llm_stream"
_INPUT_TYPES = {str: "BYTES", int: "INT32", bool: "BOOL"}


class TritonUnavailable(CagflowError):
    """Triton could not be reached (refused, timed out, or not serving the model)."""

    code = "triton_unavailable"


class TritonTimeout(TritonUnavailable):
    """Triton took longer than the timeout: the request may still be computing there, so it is not sent to
    another replica."""


class TritonRejected(CagflowError):
    """Triton answered with an error: ``status`` is its HTTP status (400, 404, 503, 500)."""

    code = "triton_error"

    def __init__(self, status: int, message: str):
        reason, message = split_code(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason  # the serving side's error code (``cagflow.errors``), when it sent one


def _inputs(values: dict[str, Any]) -> list[dict[str, Any]]:
    """One ``[1, 1]`` tensor per non-empty value; names are the upper-cased keywords."""
    return [{"name": name.upper(), "shape": [1, 1], "datatype": _INPUT_TYPES[type(value)], "data": [value]}
            for name, value in values.items() if value is not None and value != ""]


def _outputs(response: dict[str, Any]) -> dict[str, Any]:
    """Outputs as plain values (``TOKEN_IDS`` stays a list)."""
    return {output["name"]: output["data"] if output["name"] == "TOKEN_IDS" else output["data"][0]
            for output in response.get("outputs", [])}


class TritonClient:
    def __init__(self, http_url: str, grpc_url: str, timeout_s: float, retries: int, pool_size: int,
                 metrics_url: str | None = None):
        self.base = f"http://{http_url}"
        self.grpc_url = grpc_url
        self.metrics_url = metrics_url
        self.timeout_s = timeout_s
        self.retries = retries
        self._session = requests.Session()
        self._session.mount("http://", HTTPAdapter(pool_connections=2, pool_maxsize=pool_size))

    def close(self) -> None:
        self._session.close()

    def _post(self, path: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """POST ``body``; the current trace travels in its ``parameters`` (the model reads them; Triton's own
        HTTP front end drops unknown headers)."""
        parent = tracing.traceparent()
        if parent:
            body = {**body, "parameters": {tracing.TRACEPARENT: parent}}
        for attempt in range(self.retries + 1):
            try:
                reply = self._session.post(self.base + path, json=body, timeout=(min(timeout_s, 3.0), timeout_s))
                break
            except requests.ConnectionError as exc:
                if attempt == self.retries:
                    raise TritonUnavailable(f"Triton at {self.base} unreachable: {type(exc).__name__}") from None
            except requests.Timeout:
                raise TritonTimeout(f"Triton at {self.base} did not answer within {timeout_s:g} s") from None
            except requests.RequestException as exc:  # a broken or undecodable reply
                raise TritonUnavailable(f"Triton at {self.base} failed: {type(exc).__name__}") from None
        try:
            payload = reply.json()
        except ValueError:
            payload = {"error": reply.text[:500]}
        if reply.status_code != 200:
            message = str(payload.get("error", payload) if isinstance(payload, dict) else payload)
            if _server_failed(reply.status_code, message):
                raise TritonUnavailable(f"Triton at {self.base} failed: {message}")
            raise TritonRejected(reply.status_code, message)
        return payload

    def infer(self, model: str = ANSWER_MODEL, **values: Any) -> dict[str, Any]:
        """One request to ``model``; its outputs by name."""
        started = time.perf_counter()
        with tracing.TRACER.start_as_current_span(f"triton {model}", kind=tracing.SpanKind.CLIENT,
                                                  attributes={"server.address": self.base}):
            try:
                return _outputs(self._post(f"/v2/models/{model}/infer", {"inputs": _inputs(values)}, self.timeout_s))
            finally:
                metrics.BACKEND_SECONDS.labels("triton").observe(time.perf_counter() - started)

    def reload(self, release_id: str | None) -> dict[str, Any]:
        """``ACTION=reload`` to ``cag_llm`` and ``cag_llm_stream`` (separate processes, separate release state)."""
        result = self.infer(action="reload", release_id=release_id)
        for _ in self.stream(action="reload", release_id=release_id):
            pass
        return result

    def model_ready(self, model: str = ANSWER_MODEL, timeout_s: float = 2.0) -> bool:
        return self._answers_ok(f"/v2/models/{model}/ready", timeout_s)

    def server_ready(self, timeout_s: float = 1.0) -> bool:
        """Every model of the server is ready (``/v2/health/ready``)."""
        return self._answers_ok("/v2/health/ready", timeout_s)

    def _answers_ok(self, path: str, timeout_s: float) -> bool:
        try:
            return self._session.get(self.base + path, timeout=timeout_s).status_code == 200
        except requests.RequestException:
            return False

    def resident_snapshots(self, timeout_s: float = 2.0) -> int | None:
        """``cagflow_resident_states`` of ``cag_llm`` from Triton's metrics port; None when unknown."""
        if not self.metrics_url:
            return None
        try:
            text = self._session.get(self.metrics_url, timeout=timeout_s).text
        except requests.RequestException:
            return None
        found = re.search(rf'^cagflow_resident_states{{[^}}]*model="{ANSWER_MODEL}"[^}}]*}} (\S+)$', text, re.MULTILINE)
        return int(float(found.group(1))) if found else None

    def stream(self, model: str = STREAM_MODEL, **values: Any) -> Iterator[dict[str, Any]]:
        """Every response of one request to the decoupled ``model`` (``TEXT`` pieces, then the final outputs)."""
        inputs = []
        for name, value in values.items():
            if value is None or value == "":
                continue
            datatype = _INPUT_TYPES[type(value)]
            array = np.array([[value.encode() if isinstance(value, str) else value]],
                             dtype={"BYTES": np.object_, "INT32": np.int32, "BOOL": np.bool_}[datatype])
            tensor = grpcclient.InferInput(name.upper(), [1, 1], datatype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        client = grpcclient.InferenceServerClient(self.grpc_url)
        responses: queue.Queue = queue.Queue()
        finished = False
        # The span lasts until the final response; its context is the request's ``traceparent`` parameter.
        span = tracing.TRACER.start_span(f"triton {model}", kind=tracing.SpanKind.CLIENT,
                                         attributes={"server.address": self.grpc_url})
        parent = tracing.traceparent(span)
        try:
            client.start_stream(callback=lambda result, error: responses.put((result, error)))
            try:
                client.async_stream_infer(model, inputs, enable_empty_final_response=True,
                                          parameters={tracing.TRACEPARENT: parent} if parent else None)
            except InferenceServerException as exc:  # the stream broke; its cause went to the callback
                try:
                    _, cause = responses.get(timeout=1.0)
                except queue.Empty:
                    cause = None
                raise _stream_error(cause or exc, self.grpc_url) from None
            while True:
                try:
                    result, error = responses.get(timeout=self.timeout_s)
                except queue.Empty:
                    raise TritonTimeout(f"Triton stream gave nothing for {self.timeout_s:g} s") from None
                if error is not None:
                    raise _stream_error(error, self.grpc_url)
                response = result.get_response()
                if response.outputs:
                    yield {output.name: _stream_value(result, output.name) for output in response.outputs}
                if response.parameters["triton_final_response"].bool_param:
                    finished = True
                    return
        except InferenceServerException as exc:
            error = _stream_error(exc, self.grpc_url)
            tracing.failed(span, error)
            raise error from None
        except (TritonUnavailable, TritonRejected) as exc:
            tracing.failed(span, exc)
            raise
        finally:
            if not finished:
                span.set_attribute("cagflow.cancelled", True)
            span.end()
            # A timed-out or abandoned stream (the client went away) is cancelled, not waited for.
            stream = client._stream
            client.stop_stream(cancel_requests=not finished)
            if not finished:
                _end_request_feed(stream)
            client.close()


def _end_request_feed(stream) -> None:
    """tritonclient's ``stop_stream(cancel_requests=True)`` cancels the call but leaves the thread that feeds
    it requests waiting for one more, for ever: a thread and ~45 KB per cancelled stream (300 cancels left
    287 threads). The ``None`` a finished stream gets ends that thread too."""
    requests_waiting = getattr(stream, "_request_queue", None)
    if requests_waiting is not None:
        requests_waiting.put(None)


_GRPC_STATUS = {"StatusCode.INVALID_ARGUMENT": 400, "StatusCode.NOT_FOUND": 404, "StatusCode.UNAVAILABLE": 503,
                "StatusCode.INTERNAL": 500}


def _stream_error(error: Exception, grpc_url: str) -> Exception:
    """A gRPC failure as the same exceptions the HTTP path raises: unreachable, or rejected with a status.
    UNAVAILABLE or INTERNAL without the serving side's error code is the server failing (it went away
    mid-stream, or its stub died): the serving side always sends a code with its own refusals."""
    status = str(error.status()) if hasattr(error, "status") else ""
    message = error.message() if hasattr(error, "message") else str(error)
    if "failed to connect" in (message or "").lower() or "connection refused" in (message or "").lower():
        return TritonUnavailable(f"Triton gRPC at {grpc_url} unreachable: {message}")
    if _server_failed(_GRPC_STATUS.get(status, 500), message or ""):
        return TritonUnavailable(f"Triton gRPC at {grpc_url} failed: {message}")
    return TritonRejected(_GRPC_STATUS.get(status, 500), message or status)


def _server_failed(status: int, message: str) -> bool:
    """A server error the serving code did not send: the replica itself failed (e.g. its Python backend
    stub died: "Stub process ... is not healthy"; Triton restarts it). The model always prefixes its own
    refusals with a code, so an uncoded 5xx is the replica's, and another replica can answer."""
    return status >= 500 and split_code(message)[0] is None


def _stream_value(result, name: str) -> Any:
    flat = [item.decode() if isinstance(item, bytes) else item.item() for item in result.as_numpy(name).reshape(-1)]
    return flat if name == "TOKEN_IDS" else flat[0]
