"""The trace helpers and the Triton adapter's spans, with spans kept in memory; the whole path through real
servers and a real collector is tests/integration/test_router.py."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
from cagflow import tracing
from cagflow.config import Config, ConfigError, TracingConfig, load_config
from cagflow.engine.answers import Answer
from cagflow.inference import triton as adapter
from cagflow.inference.service import ServedAnswer
from opentelemetry.trace import SpanKind, StatusCode

CALLER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_tracing_is_off_unless_an_endpoint_is_configured():
    assert tracing.setup("cagflow-test", TracingConfig()) is False
    assert load_config(environ={"CAGFLOW__TRACING__ENDPOINT": "http://127.0.0.1:4318"}).tracing.endpoint
    with pytest.raises(ConfigError, match="tracing.endpoint"):
        load_config(environ={"CAGFLOW__TRACING__ENDPOINT": "127.0.0.1:4318"})
    with pytest.raises(ValueError):
        Config.model_validate({"tracing": {"sample_ratio": 2}})


@pytest.mark.parametrize("carrier", [None, "", "garbage", "00-zz-yy-01", {"traceparent": "00-0-0-00"}])
def test_a_missing_or_malformed_traceparent_starts_a_new_trace(finished_spans, carrier):
    with tracing.TRACER.start_as_current_span("request", context=tracing.context_from(carrier)) as span:
        assert tracing.trace_id() == tracing.trace_id(span) and len(tracing.trace_id()) == 32
    [finished] = finished_spans()
    assert finished.parent is None


def test_a_callers_traceparent_is_joined_and_passed_on(finished_spans):
    with tracing.TRACER.start_as_current_span("request", context=tracing.context_from({"traceparent": CALLER})):
        assert tracing.trace_id() == "0af7651916cd43dd8448eb211c80319c"
        sent = tracing.traceparent()
    [finished] = finished_spans()
    assert finished.parent.span_id == 0xb7ad6b7169203331
    assert sent == f"00-0af7651916cd43dd8448eb211c80319c-{finished.context.span_id:016x}-01"


def test_a_step_timed_before_its_span_gets_its_measured_start_and_end(finished_spans):
    with tracing.TRACER.start_as_current_span("request"):
        started = time.perf_counter()
        time.sleep(0.05)
        ended = time.perf_counter()
        time.sleep(0.05)
        tracing.record_span("search", started, ended, **{"cagflow.backend": "opensearch", "skipped": None})
    search, request = finished_spans()
    assert search.parent.span_id == request.context.span_id
    assert abs((search.end_time - search.start_time) / 1e9 - (ended - started)) < 0.002
    assert request.end_time - search.end_time > 40e6  # ended when measured, not when recorded
    assert dict(search.attributes) == {"cagflow.backend": "opensearch"}


def _request(parameters: str | Exception):
    def read():
        if isinstance(parameters, Exception):
            raise parameters
        return parameters
    return SimpleNamespace(parameters=read)


def test_the_model_reads_the_trace_from_the_request_parameters(finished_spans):
    assert tracing.trace_id(_span_in(adapter.trace_parent(_request(json.dumps({"traceparent": CALLER}))))) \
        == "0af7651916cd43dd8448eb211c80319c"
    for unusable in ("", "not json", json.dumps([1]), json.dumps({"traceparent": 7}), TypeError("no parameters")):
        assert _span_in(adapter.trace_parent(_request(unusable))).parent is None


def _span_in(context):
    span = tracing.TRACER.start_span("probe", context=context)
    span.end()
    return span


def test_an_answer_span_holds_the_engine_stages_in_order(finished_spans):
    received = time.perf_counter()
    laps, mark = [], received + 0.001
    for stage, seconds in (("prefix", 0.01), ("answer", 0.03), ("relevance", 0.005)):
        laps.append((stage, mark, mark + seconds))
        mark += seconds
    time.sleep(mark - received)  # the answer is sent once its stages are done
    answer = Answer(text="Port 8443.", route="cache", prompt_tokens=900, reused_tokens=850, ttft_s=0.02, total_s=0.045,
                    finish_reason="eos", token_ids=[1, 2, 3], snapshot_key="doc/1/abc", stage_laps=laps)
    served = ServedAnswer(answer, release_id="R1", resident_hit=True, load_ms=0.0, request_id="r1")
    adapter.trace_answer("cag_llm", tracing.context_from(CALLER), received, served)
    *stages, span = finished_spans()
    assert span.name == "cag_llm answer" and span.kind == SpanKind.SERVER and span.parent.span_id == 0xb7ad6b7169203331
    assert span.attributes["cagflow.prompt_tokens"] == 900 and span.attributes["cagflow.generated_tokens"] == 3
    assert [stage.name for stage in stages] == ["engine prefix", "engine answer", "engine relevance"]
    assert all(stage.parent.span_id == span.context.span_id for stage in stages)
    assert all(earlier.end_time <= later.start_time + 1000 for earlier, later in zip(stages, stages[1:]))
    assert span.start_time <= stages[0].start_time and stages[-1].end_time <= span.end_time
    assert "stage_laps" not in answer.to_dict()


def test_a_failed_answer_is_a_failed_span(finished_spans):
    adapter.trace_answer("cag_llm_stream", tracing.context_from(None), time.perf_counter(), KeyError("doc/9"))
    [span] = finished_spans()
    assert span.status.status_code == StatusCode.ERROR and span.attributes["error.type"] == "KeyError"
