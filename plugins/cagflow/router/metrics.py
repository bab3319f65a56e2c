"""The router's Prometheus metrics, in the default registry (which also carries the process collector:
``process_resident_memory_bytes``, CPU, open files).

Ratios are left to PromQL so they stay correct across restarts and replicas:
cache hit rate = ``rate(cagflow_router_cache_hits_total[5m]) / rate(cagflow_router_cache_attempts_total[5m])``,
fallback ratio = ``sum(rate(cagflow_router_fallbacks_total[5m])) / sum(rate(cagflow_router_answers_total[5m]))``,
P95 = ``histogram_quantile(0.95, sum by (le) (rate(cagflow_router_request_seconds_bucket[5m])))``.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# 5 ms .. 60 s, dense where answers and cache hits land.
LATENCY_BUCKETS = (0.005, 0.01, 0.015, 0.025, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0,
                   3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0)
# 1 ms .. 1 s: calls that should stay small (routing, searches, the store, the router's own overhead).
SHORT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25,
                 0.5, 1.0)

REQUESTS = Counter("cagflow_router_requests_total", "HTTP requests by endpoint and status code",
                   ["endpoint", "status"])
REQUEST_SECONDS = Histogram("cagflow_router_request_seconds", "HTTP request latency by endpoint",
                            ["endpoint"], buckets=LATENCY_BUCKETS)
ANSWERS = Counter("cagflow_router_answers_total", "answers given, by the route that produced them", ["route"])
ANSWER_SECONDS = Histogram("cagflow_router_answer_seconds", "whole answer latency by route",
                           ["route"], buckets=LATENCY_BUCKETS)
OVERHEAD_SECONDS = Histogram("cagflow_router_overhead_seconds",
                             "answer latency outside the model's own compute (total minus Triton's GEN_MS, or "
                             "minus the whole Triton call when it returned an earlier answer)",
                             ["route"], buckets=SHORT_BUCKETS)
CACHE_ATTEMPTS = Counter("cagflow_router_cache_attempts_total", "answers that tried the cache route")
CACHE_HITS = Counter("cagflow_router_cache_hits_total", "answers that reused a snapshot's KV cache")
FALLBACKS = Counter("cagflow_router_fallbacks_total", "cache-route failures answered by retrieval", ["reason"])
ANSWER_SOURCES = Counter("cagflow_router_answer_source_total", "Triton's ANSWER_SOURCE when it reports one",
                         ["source"])
DECLINED = Counter("cagflow_router_declined_total", "answers declined: no_relevant_passage (below "
                   "service.answerable_threshold), model_declined, unsupported_figures, off_topic_figures, "
                   "question_name_absent, question_terms_absent, not_in_documents", ["reason"])
RULES_FIRED = Counter("cagflow_router_rules_fired_total", "answer rules (cagflow.rules) that held for an answer, "
                      "whether they decided it or are switched off (rules.disabled)", ["rule"])
ERRORS = Counter("cagflow_router_errors_total", "error responses by error code", ["code"])
BACKEND_SECONDS = Histogram("cagflow_router_backend_seconds",
                            "calls to dependencies: triton, triton_stream_first_piece, opensearch, embedding, store",
                            ["backend"], buckets=LATENCY_BUCKETS)
RATE_LIMIT_STORE_ERRORS = Counter("cagflow_router_rate_limit_store_errors_total",
                                  "calls to the shared rate-limit store (Redis) that failed; meanwhile this "
                                  "router limits keys with its own in-memory buckets")
IN_FLIGHT = Gauge("cagflow_router_in_flight_requests", "requests holding a concurrency slot")
RESIDENT_SNAPSHOTS = Gauge("cagflow_router_triton_resident_snapshots",
                           "snapshots resident in Triton's cag_llm, as last seen by a readiness check "
                           "(summed over the ready replicas)")
# Per Triton replica (``replica``: its name in service.triton_replicas, else its HTTP address).
TRITON_REPLICA_REQUESTS = Counter("cagflow_router_triton_replica_requests_total",
                                  "answer and stream calls to each Triton replica by outcome: ok, rejected (the "
                                  "model refused), unavailable (connection failed), timeout", ["replica", "outcome"])
TRITON_FAILOVERS = Counter("cagflow_router_triton_failovers_total",
                           "requests sent on to the next replica after this replica failed to connect", ["replica"])
TRITON_REPLICA_UP = Gauge("cagflow_router_triton_replica_up",
                          "1 while requests go to this replica, 0 while it is marked down and probed", ["replica"])
TRITON_REPLICA_RESIDENT = Gauge("cagflow_router_triton_replica_resident_snapshots",
                                "snapshots resident in this replica's cag_llm, as last seen by a readiness check",
                                ["replica"])
RELEASE_SNAPSHOTS = Gauge("cagflow_router_release_snapshots", "snapshots in the active release")
READY = Gauge("cagflow_router_ready", "1 when the last readiness check passed")
DEGRADED = Gauge("cagflow_router_degraded", "1 when the last readiness check found a part missing (see /readyz)")
