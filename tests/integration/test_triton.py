"""The Triton models on a real ``tritonserver`` (started here on 127.0.0.1, free ports), through the
example client: answers identical to the in-process engine, errors, quarantine, LRU, reload under load,
metrics, streaming, precompute, request merging, the answer cache and batching on one snapshot. Most
tests use the tiny random model; one uses the real one."""

from __future__ import annotations

import importlib.util
import copy
import itertools
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from cagflow.documents.parsing import parse_file
from cagflow.engine.engine import Engine
from cagflow.engine.passage_kv import PassageStates
from cagflow.answering.prompt import Passage
from cagflow.devstack.triton import DEFAULT_MODEL_REPOSITORY, LocalTriton
from cagflow.inference.resident import load_snapshot
from cagflow.offline.precompute import precompute_part
from cagflow.router.triton_client import TritonClient
from cagflow.store.backends import LocalStore
from cagflow.store.manifests import Release, ReleaseEntry, publish_release
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.integration

QUESTION = "Which port does the web console use?"
MAX_NEW_TOKENS = 24


def _load_client():
    spec = importlib.util.spec_from_file_location("client_example", DEFAULT_MODEL_REPOSITORY / "client_example.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


client = _load_client()


DECLINE_BELOW = 0.5  # the relevance check's decline threshold for the tiny model's English answers


def server_environment(model_path, store_root, max_resident_states: int, max_context_tokens: int) -> dict[str, str]:
    return {
        "CAGFLOW__MODEL__PATH": str(model_path),
        "CAGFLOW__MODEL__MAX_CONTEXT_TOKENS": str(max_context_tokens),
        "CAGFLOW__MODEL__MAX_NEW_TOKENS": str(MAX_NEW_TOKENS),
        "CAGFLOW__MODEL__QUESTION_BUDGET_TOKENS": "128",
        "CAGFLOW__CACHE__STATE_STORE": f"file://{store_root}",
        "CAGFLOW__CACHE__MAX_RESIDENT_STATES": str(max_resident_states),
        "CAGFLOW__CACHE__PRELOAD_ON_STARTUP": "true",
        "CAGFLOW__MODEL__RELEVANCE__DECLINE_BELOW_EN": str(DECLINE_BELOW),  # off by default: exercised here
    }


@pytest.fixture(scope="module")
def tiny(publish_first_parts, tmp_path_factory):
    """An engine and a store with a published release: the first part (~600 tokens) of each fixed document."""
    store = LocalStore(tmp_path_factory.mktemp("triton-store"))
    engine, release = publish_first_parts(store, MAX_NEW_TOKENS)
    return engine, store, release


@pytest.fixture(scope="module")
def server(tiny, tiny_model_dir, tmp_path_factory):
    _, store, _ = tiny
    environment = server_environment(tiny_model_dir, store.root, max_resident_states=2, max_context_tokens=2048)
    with LocalTriton(tmp_path_factory.mktemp("triton-run"), environment=environment) as triton:
        yield triton


def error_of(call, *args, **kwargs) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        result = call(*args, **kwargs)
        if hasattr(result, "__next__"):
            list(result)
    return caught.value


def metric(text: str, name: str, model: str) -> float:
    match = re.search(rf'^{name}{{[^}}]*model="{model}"[^}}]*}} (\S+)$', text, re.MULTILINE)
    assert match, f"{name} for {model} not on the metrics port"
    return float(match.group(1))


def test_server_is_ready_with_every_model_and_logs_its_start(server):
    assert server.is_ready()
    log = server.console_log.read_text()
    for model in ("cag_llm", "cag_llm_stream"):
        assert re.search(rf"\[cagflow {model}_0_0\] INFO ready in [\d.]+ s .*resident snapshots.*RSS", log)
    assert "[cagflow cag_precompute_0_0] INFO ready" in log


def test_cache_path_is_token_identical_to_the_full_prompt(server, tiny):
    engine, store, release = tiny
    entry = release.snapshots[0]
    reply = client.ask(server.http_url, QUESTION, entry.key, request_id="exact-1")
    expected = engine.answer(QUESTION, snapshot=load_snapshot(store, entry), reuse_cache=False,
                             max_new_tokens=MAX_NEW_TOKENS)
    assert reply["TOKEN_IDS"] == expected.token_ids and reply["ANSWER"] == expected.text
    assert reply["CACHE_HIT"] is True and reply["ROUTE"] == "cache"
    assert reply["REUSED_TOKENS"] == entry.n_tokens and reply["PROMPT_TOKENS"] == expected.prompt_tokens
    # the answer check read the same snapshot in place, asked about the answer's own words
    if expected.answered:
        threshold = DECLINE_BELOW
        relevance = engine.relevance(QUESTION, load_snapshot(store, entry), answer=expected.text)
        assert reply["RELEVANCE"] == pytest.approx(relevance, abs=1e-3)
        assert reply["ANSWERED"] is (relevance >= threshold)
        assert reply["DECLINE_REASON"] == ("" if relevance >= threshold else "not_in_documents")
    else:
        assert reply["RELEVANCE"] == -1.0 and reply["ANSWERED"] is False and reply["DECLINE_REASON"]
    assert reply["SNAPSHOT_KEY"] == entry.key and reply["RELEASE_ID"] == release.release_id
    assert reply["REQUEST_ID"] == "exact-1" and reply["TTFT_MS"] > 0 and reply["GEN_MS"] >= reply["TTFT_MS"]
    stages = json.loads(reply["STAGES_MS"])  # where GEN_MS went: the snapshot prefix, the answer, the check
    assert {"prefix", "answer", "relevance"} <= set(stages)
    assert sum(stages.values()) == pytest.approx(reply["GEN_MS"], abs=5)


def test_a_doc_id_selects_that_documents_snapshot(server, tiny):
    _, _, release = tiny
    entry = release.snapshots[0]
    reply = client.ask(server.http_url, QUESTION, entry.doc_id)
    assert reply["SNAPSHOT_KEY"] == entry.key and reply["CACHE_HIT"] is True


def test_retrieval_path_answers_from_the_context(server, tiny):
    engine, _, _ = tiny
    passages = [{"text": "The web console listens on port 8443.", "title": "Admin manual", "section": "Ports"},
                "Backups are kept for 35 days."]
    reply = client.ask(server.http_url, QUESTION, context=json.dumps(passages))
    # serving computes the passages' states on first use (model.passage_kv: reuse): the same here
    reusing = copy.copy(engine)
    reusing.passage_states = PassageStates(engine.fast, engine.fingerprint, 1 << 30)
    expected = reusing.answer(QUESTION, context=[Passage(**passages[0]), Passage(passages[1])],
                              max_new_tokens=MAX_NEW_TOKENS)
    assert reply["ROUTE"] == "retrieval" and reply["CACHE_HIT"] is False and reply["REUSED_TOKENS"] == 0
    assert reply["TOKEN_IDS"] == expected.token_ids and reply["SNAPSHOT_KEY"] == ""
    again = client.ask(server.http_url, "When are backups deleted?", context=json.dumps(passages))
    assert again["REUSED_TOKENS"] == reusing.prompts.passage_layout(
        [Passage(**passages[0]), Passage(passages[1])], QUESTION).n_tokens  # every passage kept from the first


def test_snapshot_with_newer_passages_is_token_identical_to_the_full_prompt(server, tiny):
    engine, store, release = tiny
    entry = release.snapshots[0]
    passages = [{"text": "Since 5.4.0 the web console listens on port 9443.", "title": "Skerry 5.4.0 Release Notes",
                 "section": "Changes", "published": "2025-03-10"}]
    reply = client.ask(server.http_url, QUESTION, entry.key, context=json.dumps(passages))
    updates = [Passage(**passages[0])]
    expected = engine.answer(QUESTION, snapshot=load_snapshot(store, entry), context=updates, reuse_cache=False,
                             max_new_tokens=MAX_NEW_TOKENS)
    assert reply["ROUTE"] == "cache+retrieval" and reply["CACHE_HIT"] is True
    assert reply["TOKEN_IDS"] == expected.token_ids and reply["REUSED_TOKENS"] == entry.n_tokens
    assert reply["PROMPT_TOKENS"] == expected.prompt_tokens


def test_unknown_key_and_bad_inputs_are_clear_errors(server, tiny):
    _, _, release = tiny
    unknown = error_of(client.ask, server.http_url, QUESTION, "no-such-doc/1/0123456789abcdef", request_id="r-404")
    assert unknown.status() == "404"
    assert "request r-404: snapshot 'no-such-doc/1/0123456789abcdef' is not in release" in unknown.message()
    assert error_of(client.ask, server.http_url, QUESTION, "no-such-doc").status() == "404"
    assert "not valid JSON" in error_of(client.ask, server.http_url, QUESTION, context="{").message()
    assert "question is empty" in error_of(client.ask, server.http_url, "   ").message()
    assert "MAX_NEW_TOKENS" in error_of(client.ask, server.http_url, QUESTION, max_new_tokens=0).message()
    assert server.is_ready()  # nothing above hurt the stub


def test_lru_eviction_at_max_resident_states(server, tiny):
    _, _, release = tiny
    k1, k2, k3 = (entry.key for entry in release.snapshots[1:4])
    asked = itertools.count()

    def resident_hit(key: str) -> bool:  # a new question each time, so no answer comes from the answer cache
        reply = client.ask(server.http_url, f"{QUESTION} ({next(asked)})", key, max_new_tokens=1)
        assert reply["ANSWER_SOURCE"] == "computed"
        return reply["RESIDENT_HIT"]

    resident_hit(k2)
    resident_hit(k3)  # whatever was resident before, now exactly k2 and k3 are (max_resident_states=2)
    assert [resident_hit(key) for key in (k2, k1, k3, k1)] == [True, False, False, True]
    metrics = server.metrics_text()
    assert metric(metrics, "cagflow_resident_states", "cag_llm") == 2
    assert metric(metrics, "cagflow_snapshot_evictions_total", "cag_llm") >= 2


def test_corrupt_snapshot_is_an_error_and_quarantined_without_retries(server, tiny):
    _, store, release = tiny
    victim = release.snapshots[4]
    path = store.root / victim.object_name
    path.write_bytes(path.read_bytes()[:-128] + b"\xff" * 128)
    first = error_of(client.ask, server.http_url, QUESTION, victim.key)
    assert first.status() == "503" and "is corrupt" in first.message() and "quarantined" in first.message()
    for _ in range(3):
        again = error_of(client.ask, server.http_url, QUESTION, victim.key)
        assert again.status() == "503" and "quarantined until the release changes" in again.message()
    log = server.console_log.read_text()
    assert len(re.findall(rf"\[cagflow cag_llm_0_0\] ERROR snapshot {re.escape(victim.key)} is corrupt", log)) == 1
    assert metric(server.metrics_text(), "cagflow_quarantined_snapshots", "cag_llm") == 1
    assert server.is_ready()


def test_custom_metrics_on_the_metrics_port(server):
    text = server.metrics_text()
    assert metric(text, "cagflow_snapshot_hits_total", "cag_llm") >= 2
    assert metric(text, "cagflow_snapshot_misses_total", "cag_llm") >= 2
    assert 0 < metric(text, "cagflow_resident_bytes", "cag_llm") < 2 * 1024 ** 2
    assert metric(text, "cagflow_snapshot_load_seconds_count", "cag_llm") >= 2
    assert metric(text, "cagflow_store_errors_total", "cag_llm") == 0
    assert metric(text, "cagflow_resident_states", "cag_llm_stream") == 2


def test_streaming_yields_the_same_tokens_as_the_plain_answer(server, tiny):
    _, _, release = tiny
    key = release.snapshots[0].key
    plain = client.ask(server.http_url, QUESTION, key)
    items = list(client.stream(server.grpc_url, QUESTION, key))
    pieces, final = items[:-1], items[-1]
    assert len(pieces) > 1 and all(isinstance(piece, str) for piece in pieces)
    assert "".join(pieces).strip() == final["ANSWER"] == plain["ANSWER"]
    assert final["TOKEN_IDS"] == plain["TOKEN_IDS"] and final["CACHE_HIT"] is True
    unknown = error_of(client.stream, server.grpc_url, QUESTION, "no-such-doc/1/0123456789abcdef")
    assert "is not in release" in unknown.message()


def test_an_abandoned_stream_is_cancelled_and_leaves_no_thread_behind(server, tiny):
    """The router's client cancels a stream nobody reads any more (the caller went away) and ends every
    thread it started for it; tritonclient alone leaves one waiting for ever per cancelled stream."""
    _, _, release = tiny
    router_client = TritonClient(server.http_url, server.grpc_url, timeout_s=60, retries=0, pool_size=2)
    before = threading.active_count()
    for number in range(5):
        pieces = router_client.stream(question=f"{QUESTION} ({number})", snapshot_key=release.snapshots[0].key,
                                      max_new_tokens=64)
        assert isinstance(next(pieces)["TEXT"], str)
        pieces.close()  # abandoned after its first piece
    deadline = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert threading.active_count() <= before
    final = list(router_client.stream(question=QUESTION, snapshot_key=release.snapshots[0].key))[-1]
    assert final["ANSWER"]  # the server is fine after the cancellations
    router_client.close()


@pytest.fixture(scope="module")
def second_release(tiny, corpus):
    """Four of the documents at a new version (new keys): written to the store but not activated."""
    engine, store, _ = tiny
    entries = []
    for document in corpus.tier("fixed")[:4]:
        parsed = parse_file(corpus.file(document), document.title)
        part = engine.split(document.doc_id, document.version + "-2", parsed)[0]
        entries.append(precompute_part(engine, store, part).entry)
    second = Release.build(engine.fingerprint, entries)
    second = second.model_copy(update={"release_id": second.release_id + "-second"})
    store.put(second.object_name, second.model_dump_json(indent=2).encode())
    return second


def test_reload_switches_atomically_while_requests_are_in_flight(server, tiny, second_release):
    """A reload lands while a long answer streams: that answer ends on the release it began on, the next
    requests use the new one. Whatever fails here, both models go back to the store's current release so
    the later tests see the release they expect."""
    _, _, first = tiny
    try:
        switch_while_streaming(server, first, second_release)
    finally:
        assert client.reload(server.http_url)["RELEASE_ID"] == first.release_id  # back to the store's current
        assert client.reload_streaming(server.grpc_url)["RELEASE_ID"] == first.release_id
    assert client.ask(server.http_url, QUESTION, first.snapshots[0].key)["RELEASE_ID"] == first.release_id


def switch_while_streaming(server, first: Release, second_release: Release) -> None:
    old_key, new_key = first.snapshots[0].key, second_release.snapshots[0].key
    pieces_after_reload: list[str] = []
    reloaded = threading.Event()
    final: dict = {}

    # ~1,300 tokens fill the context and take about five times the reload's time on an idle machine, so the
    # reload lands mid-answer even when parallel tests slow it down.
    items = client.stream(server.grpc_url, QUESTION, old_key, max_new_tokens=1300)
    first_piece = next(items)  # the request is now in flight on the first release
    assert isinstance(first_piece, str)

    def reload_meanwhile():
        result = client.reload_streaming(server.grpc_url, second_release.release_id)
        assert result["RELEASE_ID"] == second_release.release_id
        reloaded.set()

    reloader = threading.Thread(target=reload_meanwhile)
    reloader.start()
    for item in items:
        if isinstance(item, dict):
            final = item
        elif reloaded.is_set():
            pieces_after_reload.append(item)
    reloader.join()
    assert reloaded.is_set() and pieces_after_reload, "the reload did not land while the answer was streaming"
    assert final["RELEASE_ID"] == first.release_id and final["SNAPSHOT_KEY"] == old_key

    assert "is not in release" in error_of(client.stream, server.grpc_url, QUESTION, old_key).message()
    after = list(client.stream(server.grpc_url, QUESTION, new_key))[-1]
    assert after["RELEASE_ID"] == second_release.release_id

    status = json.loads(client.reload(server.http_url, second_release.release_id)["STATUS"])  # cag_llm too
    assert status["previous"] == first.release_id and status["current"] == second_release.release_id
    assert client.ask(server.http_url, QUESTION, new_key)["RELEASE_ID"] == second_release.release_id
    assert error_of(client.ask, server.http_url, QUESTION, old_key).status() == "404"


def test_precompute_entry_writes_a_snapshot_that_verifies(server, tiny, corpus):
    _, store, _ = tiny
    document = next(d for d in corpus.tier("variable"))
    path = corpus.file(document)
    entries = client.precompute(server.http_url, document.doc_id, document.version, path.read_text(),
                                path.suffix.lstrip("."), document.title)
    assert entries and all(not entry["skipped"] for entry in entries)
    for fields in entries:
        entry = ReleaseEntry(**{key: value for key, value in fields.items() if key not in ("skipped", "seconds")})
        snapshot = load_snapshot(store, entry)  # verifies the sha256 and the key in the header
        assert snapshot.n_tokens == entry.n_tokens and snapshot.doc_id == document.doc_id
    again = client.precompute(server.http_url, document.doc_id, document.version, path.read_text(),
                              path.suffix.lstrip("."), document.title)
    assert [e["sha256"] for e in again] == [e["sha256"] for e in entries] and all(e["skipped"] for e in again)
    bad = error_of(client.precompute, server.http_url, document.doc_id, document.version, "text", "pdf")
    assert bad.status() == "400" and "FORMAT 'pdf' is not supported" in bad.message()


def ask_together(server, questions: list[str], key: str) -> list[dict]:
    """Every question sent at the same moment from its own connection."""
    start = threading.Barrier(len(questions))

    def ask(question: str) -> dict:
        start.wait()
        return client.ask(server.http_url, question, key)

    with ThreadPoolExecutor(len(questions)) as pool:
        return list(pool.map(ask, questions))


def test_identical_concurrent_questions_are_computed_once_then_kept(server, tiny):
    engine, store, release = tiny
    entry = release.snapshots[0]
    question = "How do I rotate the signing keys?"
    before = server.metrics_text()
    replies = ask_together(server, [question] * 8, entry.key)
    after = server.metrics_text()
    expected = engine.answer(question, snapshot=load_snapshot(store, entry), max_new_tokens=MAX_NEW_TOKENS)
    assert all(reply["TOKEN_IDS"] == expected.token_ids for reply in replies)
    sources = sorted(reply["ANSWER_SOURCE"] for reply in replies)
    assert sources.count("computed") == 1 and set(sources) <= {"computed", "merged", "answer-cache"}

    def grew(name: str, text_after: str, text_before: str) -> float:
        return metric(text_after, name, "cag_llm") - metric(text_before, name, "cag_llm")

    assert grew("cagflow_merged_requests_total", after, before) + \
        grew("cagflow_answer_cache_hits_total", after, before) == 7
    assert grew("cagflow_answer_requests_total", after, before) == 8
    assert grew("cagflow_answer_cache_lookups_total", after, before) == 8

    repeat = client.ask(server.http_url, "  How do I rotate the signing keys?\n", entry.key, request_id="again")
    assert repeat["ANSWER_SOURCE"] == "answer-cache" and repeat["TOKEN_IDS"] == expected.token_ids
    assert repeat["REQUEST_ID"] == "again"
    assert grew("cagflow_answer_cache_hits_total", server.metrics_text(), after) == 1


def test_different_questions_on_one_snapshot_are_batched_with_unbatched_answers(server, tiny):
    engine, store, release = tiny
    entry = release.snapshots[1]
    snapshot = load_snapshot(store, entry)
    topics = ["backups", "ports", "passwords", "logs"]
    for attempt in range(5):  # a burst usually lands in one 5 ms batching window; retry when it did not
        questions = [f"Where are the {topic} configured? ({attempt})" for topic in topics]
        before = metric(server.metrics_text(), "cagflow_batched_requests_total", "cag_llm")
        replies = ask_together(server, questions, entry.key)
        for question, reply in zip(questions, replies):
            expected = engine.answer(question, snapshot=snapshot, max_new_tokens=MAX_NEW_TOKENS)
            assert reply["TOKEN_IDS"] == expected.token_ids and reply["ANSWER"] == expected.text
            assert reply["ANSWER_SOURCE"] == "computed" and reply["CACHE_HIT"] is True
        if metric(server.metrics_text(), "cagflow_batched_requests_total", "cag_llm") - before >= 2:
            break
    else:
        pytest.fail("no two of the concurrent questions were ever answered in one batched pass")
    assert metric(server.metrics_text(), "cagflow_batches_total", "cag_llm") >= 1


def test_answer_cache_does_not_outlive_a_release(server, tiny, second_release):
    _, _, first = tiny
    doc_id = second_release.snapshots[1].doc_id
    question = "What is the maintenance window?"
    assert client.ask(server.http_url, question, doc_id)["RELEASE_ID"] == first.release_id
    assert client.ask(server.http_url, question, doc_id)["ANSWER_SOURCE"] == "answer-cache"
    try:
        client.reload(server.http_url, second_release.release_id)
        reply = client.ask(server.http_url, question, doc_id)
        assert reply["ANSWER_SOURCE"] == "computed" and reply["RELEASE_ID"] == second_release.release_id
        assert reply["SNAPSHOT_KEY"] == second_release.snapshots[1].key
    finally:
        client.reload(server.http_url)
    assert client.ask(server.http_url, question, doc_id)["ANSWER_SOURCE"] == "computed"  # cleared again


def test_streams_serve_a_kept_answer_in_one_piece(server, tiny):
    _, _, release = tiny
    key = release.snapshots[2].key
    question = "Which ports must the firewall open?"
    first = list(client.stream(server.grpc_url, question, key))
    again = list(client.stream(server.grpc_url, question, key))
    assert len(first) > 2 and first[-1]["ANSWER_SOURCE"] == "computed"
    assert again[:-1] == [first[-1]["ANSWER"]] and again[-1]["ANSWER_SOURCE"] == "answer-cache"
    assert again[-1]["TOKEN_IDS"] == first[-1]["TOKEN_IDS"]
    text = server.metrics_text()
    assert metric(text, "cagflow_answer_cache_hits_total", "cag_llm_stream") >= 1
    assert metric(text, "cagflow_evicted_in_use_bytes", "cag_llm") >= 0


@pytest.mark.real_model
def test_real_model_cache_path_is_token_identical_through_triton(real_model, corpus, tmp_path):
    engine = Engine(real_model, max_context_tokens=900, max_new_tokens=MAX_NEW_TOKENS, question_budget_tokens=128)
    store = LocalStore(tmp_path / "store")
    document = next(d for d in corpus.tier("fixed") if d.doc_id == "skerry-admin-manual")
    part = engine.split(document.doc_id, document.version, parse_file(corpus.file(document), document.title))[0]
    entry = precompute_part(engine, store, part).entry
    publish_release(store, Release.build(engine.fingerprint, [entry]))
    environment = server_environment("smollm2-135m", store.root, max_resident_states=2, max_context_tokens=900)
    with LocalTriton(tmp_path / "run", models=["cag_llm"], environment=environment) as triton:
        reply = client.ask(triton.http_url, QUESTION, entry.key)
    expected = engine.answer(QUESTION, snapshot=load_snapshot(store, entry), reuse_cache=False)
    assert reply["TOKEN_IDS"] == expected.token_ids and reply["ANSWER"] == expected.text
    assert reply["CACHE_HIT"] is True and reply["RESIDENT_HIT"] is True and reply["REUSED_TOKENS"] == entry.n_tokens
    heat = [json.loads(store.get(info.name)) for info in store.list("heat/")]  # saved when the model unloaded
    assert [h["counts"] for h in heat] == [{entry.key: 1}] and heat[0]["replica"].endswith("cag_llm_0_0")
