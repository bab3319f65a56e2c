"""Answering a Triton batch in-process (no server): questions on one snapshot share a batched pass and
get the same tokens as one at a time, identical questions are computed once, repeats come from the
answer cache until the release changes, and a bad question fails alone."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
from cagflow.config import load_config
from cagflow.documents.parsing import parse_file
from cagflow.engine.engine import Engine
from cagflow.answering.prompt import Passage
from cagflow.inference.answer_cache import ANSWER_CACHE, COMPUTED, MERGED
from cagflow.inference.concurrency import answer_requests
from cagflow.inference.resident import NoActiveRelease, ResidentSet, load_snapshot
from cagflow.inference.service import AnswerRequest, CagService, Runtime, ServingListener
from cagflow.offline.precompute import precompute_part
from cagflow.store.backends import LocalStore
from cagflow.store.manifests import Release, publish_release

BUDGET = 12
QUESTIONS = ["Which port does the web console use?", "How long are backups kept?",
             "Who can reset a password?", "What does the status page show?"]


class Batches(ServingListener):
    def __init__(self):
        self.sizes: list[int] = []

    def on_batch(self, size):
        self.sizes.append(size)


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return Engine(tiny_engine.loaded, max_context_tokens=512, max_new_tokens=BUDGET, question_budget_tokens=64)


@pytest.fixture(scope="module")
def releases(engine, corpus, tmp_path_factory):
    """Two documents at two versions: the first release is current, the second only stored."""
    store = LocalStore(tmp_path_factory.mktemp("batch-store"))
    made = []
    for suffix in ("", "-2"):
        entries = []
        for document in corpus.tier("fixed")[:2]:
            parsed = parse_file(corpus.file(document), document.title)
            part = engine.split(document.doc_id, document.version + suffix, parsed)[0]
            entries.append(precompute_part(engine, store, part).entry)
        made.append(Release.build(engine.fingerprint, entries))
    store.put(made[1].object_name, made[1].model_dump_json().encode())
    publish_release(store, made[0])
    return store, made


def make_service(engine, store, answer_cache_entries=64, activate=True):
    listener = Batches()
    resident = ResidentSet(store, engine.fingerprint, 8, 1 << 30, listener=listener)
    service = CagService(Runtime(load_config(environ={}), engine, store), resident,
                         answer_cache_entries=answer_cache_entries, listener=listener)
    if activate:
        service.reload(None, preload=False)
    return service, listener


def answer_all(service, requests):
    with ThreadPoolExecutor(4) as pool:
        return asyncio.run(answer_requests(service, pool, requests))


def test_a_batch_is_answered_in_one_pass_per_snapshot_with_one_at_a_time_tokens(engine, releases):
    store, (first, _) = releases
    service, listener = make_service(engine, store)
    key_a, key_b = (entry.key for entry in first.snapshots)
    context = (Passage("The web console listens on port 8443.", "Admin manual"),)
    requests = [AnswerRequest(question, key_a, request_id=f"a{n}") for n, question in enumerate(QUESTIONS)]
    requests += [AnswerRequest(f"  {QUESTIONS[0]}\n", key_a, request_id="dup"),
                 AnswerRequest(QUESTIONS[0], key_b, request_id="b"),
                 AnswerRequest(QUESTIONS[0], context=context, request_id="ctx"),
                 AnswerRequest(QUESTIONS[1], key_a, max_new_tokens=3, request_id="short")]
    results = answer_all(service, requests)

    snapshots = {key: load_snapshot(store, entry) for key, entry in ((e.key, e) for e in first.snapshots)}
    for request, served in zip(requests, results):
        snapshot = snapshots.get(request.snapshot_key)
        expected = engine.answer(request.question if request.request_id != "dup" else QUESTIONS[0],
                                 snapshot=snapshot, context=request.context, max_new_tokens=request.max_new_tokens)
        assert served.answer.token_ids == expected.token_ids, request.request_id
        assert served.request_id == request.request_id
    assert [served.source for served in results] == [COMPUTED] * 4 + [MERGED] + [COMPUTED] * 3
    assert results[-2].answer.route == "retrieval" and results[0].release_id == first.release_id
    assert listener.sizes == [4]  # key_a with the default budget; the other requests were alone

    again = answer_all(service, requests)
    assert [served.source for served in again] == [ANSWER_CACHE] * 8
    assert [served.answer.token_ids for served in again] == [served.answer.token_ids for served in results]
    assert [served.request_id for served in again] == [request.request_id for request in requests]


def test_a_bad_question_in_a_batch_fails_alone(engine, releases):
    store, (first, _) = releases
    service, listener = make_service(engine, store)
    key = first.snapshots[0].key
    too_long = "why " * 100  # over the 64-token question budget, within the context
    requests = [AnswerRequest(QUESTIONS[0], key), AnswerRequest(too_long, key), AnswerRequest(QUESTIONS[1], key)]
    results = answer_all(service, requests)
    assert isinstance(results[1], ValueError) and "question is" in str(results[1])
    assert [results[0].source, results[2].source] == [COMPUTED, COMPUTED]
    alone = engine.answer(QUESTIONS[1], snapshot=load_snapshot(store, first.snapshots[0]))
    assert results[2].answer.token_ids == alone.token_ids
    assert isinstance(answer_all(service, [requests[1]])[0], ValueError)  # errors are not kept


def test_a_release_switch_stops_serving_old_answers(engine, releases):
    store, (first, second) = releases
    service, _ = make_service(engine, store)
    doc_id = first.snapshots[0].doc_id
    request = AnswerRequest(QUESTIONS[0], doc_id)
    before = answer_all(service, [request])[0]
    assert before.release_id == first.release_id and before.source == COMPUTED
    assert answer_all(service, [request])[0].source == ANSWER_CACHE
    service.reload(second.release_id, preload=False)
    assert len(service.answers) == 0
    after = answer_all(service, [request])[0]
    assert after.source == COMPUTED and after.release_id == second.release_id
    assert after.answer.snapshot_key == second.snapshots[0].key


def test_streams_serve_kept_answers_as_one_piece(engine, releases):
    store, (first, _) = releases
    service, _ = make_service(engine, store)
    request = AnswerRequest(QUESTIONS[2], first.snapshots[1].key, request_id="s1")
    streamed = list(service.stream(request))
    assert len(streamed) > 2 and streamed[-1].source == COMPUTED
    repeat = list(service.stream(AnswerRequest(QUESTIONS[2], first.snapshots[1].key, request_id="s2")))
    assert repeat[:-1] == [streamed[-1].answer.text] and repeat[-1].source == ANSWER_CACHE
    assert repeat[-1].request_id == "s2" and repeat[-1].answer.token_ids == streamed[-1].answer.token_ids
    assert answer_all(service, [request])[0].source == ANSWER_CACHE  # both paths share the cache


def test_without_a_release_every_request_gets_the_error(engine, releases):
    store, (first, _) = releases
    service, _ = make_service(engine, store, activate=False)
    results = answer_all(service, [AnswerRequest(QUESTIONS[0], first.snapshots[0].key), AnswerRequest(QUESTIONS[1])])
    assert isinstance(results[0], NoActiveRelease)
    assert results[1].answer.route == "question-only"
