"""The answer service of one serving process: the engine, the store, the resident snapshot set and the
answers it has given. It runs without Triton (tests, benchmarks, ``cagflow ask --local``); the Triton
models reach it through ``cagflow.inference.triton``.

Answering a batch (``concurrency.answer_requests``): a repeat of an answered question is served from the
answer cache, a question already being computed waits for that computation (``answer_cache``), and the
rest are computed, those on the same snapshot with the same budget in one batched pass.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from ..config import Config, load_config
from ..engine.answers import Answer
from ..engine.engine import Engine
from ..documents.keys import SnapshotFormatError
from ..documents.snapshot import passage_state_from_bytes
from ..documents.text import best_part
from ..answering.prompt import Passage, clean_question
from ..errors import CagflowError
from ..store.backends import NotFound, SnapshotStore, StoreError, StoreRole, open_store
from ..store.heat import HeatLog
from ..store.layout import CURRENT_POINTER, passage_object
from ..store.manifests import load_release
from .answer_cache import ANSWER_CACHE, COMPUTED, AnswerCache, AnswerCacheListener, AnswerKey, Claim, context_digest
from .resident import Acquired, ResidentListener, ResidentSet, UnknownSnapshot

log = logging.getLogger("cagflow.serving")


class InvalidRequest(CagflowError, ValueError):
    """A request whose inputs are missing, malformed or contradictory."""

    code = "invalid_request"


# ---- settings and start-up --------------------------------------------------------------------------

@dataclass(frozen=True)
class ServingSettings:
    """How one serving process runs (Triton takes them from config.pbtxt's parameters); everything else comes
    from the CAGFlow config."""

    model_name: str
    instance_name: str
    config_file: str | None = None
    replica_id: str = ""
    worker_threads: int = 4
    release_poll_s: float = 30.0
    heat_flush_s: float = 60.0
    answer_cache_entries: int = 1024


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 1e6


@dataclass
class Runtime:
    config: Config
    engine: Engine
    store: SnapshotStore

    @classmethod
    def load(cls, settings: ServingSettings, role: StoreRole = "reader") -> "Runtime":
        """``role``: answering only reads the store; ``cag_precompute`` writes snapshots and asks for ``writer``."""
        config = load_config(settings.config_file)
        store = open_store(config.cache.state_store, config.cache.s3, role=role)
        engine = Engine.from_config(config.model, config.rules.disabled, stored_passage=_passage_reader(store))
        return cls(config, engine, store)


def _passage_reader(store: SnapshotStore):
    """A passage's K/V from the store (written by the ingest DAG), or None: missing, unreadable or not this
    model's, it is computed on first use instead."""

    def read(model_fingerprint: str, content_key: str):
        name = passage_object(model_fingerprint, content_key)
        try:
            return passage_state_from_bytes(store.get(name), model_fingerprint, content_key)
        except NotFound:
            return None
        except (StoreError, SnapshotFormatError) as exc:
            log.warning("passage state %s unusable, computing it: %s", name, exc)
            return None

    return read


# ---- requests and answers ---------------------------------------------------------------------------

@dataclass(frozen=True)
class AnswerRequest:
    question: str
    snapshot_key: str = ""  # a snapshot key of the active release, or a doc_id of it, or empty
    context: tuple[Passage, ...] | None = None  # passages; with a snapshot: newer passages after the document
    max_new_tokens: int | None = None
    request_id: str = ""

    def __post_init__(self) -> None:
        clean_question(self.question)
        if self.max_new_tokens is not None and not 1 <= self.max_new_tokens <= 4096:
            raise InvalidRequest(f"MAX_NEW_TOKENS must be between 1 and 4096, got {self.max_new_tokens}")


def parse_context(text: str) -> tuple[Passage, ...]:
    """CONTEXT is a JSON list of passages: strings, or objects with "text" and optional "title", "section" and
    "published" (an ISO date)."""
    try:
        items = json.loads(text)
    except ValueError as exc:
        raise InvalidRequest(f"CONTEXT is not valid JSON: {exc}") from None
    if not isinstance(items, list) or not items:
        raise InvalidRequest("CONTEXT must be a non-empty JSON list of passages")
    passages = []
    for number, item in enumerate(items, start=1):
        if isinstance(item, str):
            item = {"text": item}
        if not isinstance(item, dict) or not isinstance(item.get("text"), str) or not item["text"].strip():
            raise InvalidRequest(f"CONTEXT passage {number} must be a string or an object with a non-empty \"text\"")
        extra = set(item) - {"text", "title", "section", "published"}
        if extra:
            raise InvalidRequest(f"CONTEXT passage {number}: unknown fields {', '.join(sorted(extra))}")
        passages.append(Passage(item["text"], str(item.get("title", "")), str(item.get("section", "")),
                                str(item.get("published", ""))))
    return tuple(passages)


@dataclass(frozen=True)
class ServedAnswer:
    """An answer with how it was served. A merged or answer-cache answer carries the timings and snapshot
    facts of the computation that produced it."""

    answer: Answer
    release_id: str  # the release the snapshot came from; empty without a snapshot
    resident_hit: bool
    load_ms: float
    request_id: str = ""
    source: str = COMPUTED  # "computed" | "merged" | "answer-cache"

    @property
    def cache_hit(self) -> bool:
        return self.answer.route in ("cache", "cache+retrieval")


@dataclass(frozen=True)
class ReloadResult:
    previous: str | None
    current: str
    kept: int
    dropped: int
    preloaded: int
    seconds: float

    def to_json(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)


class ServingListener(ResidentListener, AnswerCacheListener):
    """Everything a serving process reports (metrics); the default ignores it."""

    def on_batch(self, size: int) -> None: ...


def _matches(key: AnswerKey, served: "ServedAnswer") -> bool:
    """Whether an answer was computed on the release its key names: a release switch between keying and
    computing must not file a new release's answer under the old one (a rollback would serve it)."""
    return served.release_id == key.release_id


class CagService:
    """One process's answering state: the engine, the store, the resident snapshot set and the answers."""

    def __init__(self, runtime: Runtime, resident: ResidentSet, release_poll_s: float = 0.0,
                 answer_cache_entries: int = 0, listener: ServingListener | None = None):
        self.runtime = runtime
        self.engine = runtime.engine
        self.store = runtime.store
        self.resident = resident
        self.listener = listener or ServingListener()
        self.answers: AnswerCache[ServedAnswer] = AnswerCache(answer_cache_entries, self.listener)
        self._reload_lock = threading.Lock()
        self._pointer_seen: str | None = None
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        if release_poll_s > 0:
            self._watcher = threading.Thread(target=self._watch_releases, args=(release_poll_s,),
                                             name="cagflow-release-watch", daemon=True)

    @classmethod
    def start(cls, settings: ServingSettings, listener: ServingListener | None = None) -> "CagService":
        """Load the model, activate the store's current release, preload it if configured; log what it cost."""
        started = time.perf_counter()
        runtime = Runtime.load(settings)
        cache = runtime.config.cache
        heat = HeatLog(runtime.store, settings.replica_id, settings.heat_flush_s,
                       stale_after_days=runtime.config.maintenance.unused_days)
        heat.load()
        heat.start()
        resident = ResidentSet(runtime.store, runtime.engine.fingerprint, cache.max_resident_states,
                               cache.max_resident_bytes, heat, listener)
        service = cls(runtime, resident, settings.release_poll_s, settings.answer_cache_entries, listener)
        runtime.engine.answer("Hello?", max_new_tokens=1)  # one-off kernel set-up: not on the first user's time
        model_s = time.perf_counter() - started
        try:
            service.reload(None, preload=cache.preload_on_startup)
        except (StoreError, ValueError, KeyError) as exc:  # no release yet, store down, bad or foreign release
            log.error("serving without a release (cache path unavailable): %s", exc)
        state = resident.state()
        log.info("ready in %.1f s (model %.1f s); release %s; %d resident snapshots, %.1f MB; process RSS %.0f MB; "
                 "preload %s; torch threads %d; answer cache %d entries", time.perf_counter() - started, model_s,
                 state.release_id, len(state.keys), state.nbytes / 1e6, _rss_mb(),
                 "on" if cache.preload_on_startup else "off", torch.get_num_threads(), settings.answer_cache_entries)
        if service._watcher is not None:
            service._watcher.start()
        return service

    # ---- answering -----------------------------------------------------------------------------------

    def _snapshot_for(self, request: AnswerRequest) -> Acquired | None:
        """A full key names one snapshot; a doc_id means that document's snapshot in the active release
        (for a split document, the part sharing the most words with the question)."""
        if not request.snapshot_key:
            return None
        view = self.resident.pin()
        if "/" in request.snapshot_key:
            return view.acquire(request.snapshot_key)
        entries = view.entries_for_doc(request.snapshot_key)
        if not entries:
            raise UnknownSnapshot(f"document {request.snapshot_key!r} has no snapshot in release "
                                  f"{view.release.release_id}")
        parts = [view.acquire(entry.key) for entry in entries]
        if len(parts) == 1:
            return parts[0]
        return parts[best_part(request.question, [part.snapshot.system_prompt for part in parts])]

    def _budget(self, request: AnswerRequest) -> int:
        return self.engine.max_new_tokens if request.max_new_tokens is None else request.max_new_tokens

    def answer_key(self, request: AnswerRequest) -> AnswerKey | None:
        """What determines the answer: the active release and snapshot (or the passages), the normalised
        question and the budget. None for questions alone, which are not kept."""
        if request.snapshot_key:
            release_id = self.resident.pin().release.release_id
            scope = request.snapshot_key
            if request.context is not None:
                scope = f"{scope}+{context_digest(request.context)}"
            return AnswerKey.of(release_id, scope, request.question, self._budget(request))
        if request.context is not None:
            return AnswerKey.of("", context_digest(request.context), request.question, self._budget(request))
        return None

    def stream(self, request: AnswerRequest) -> Iterator[str | ServedAnswer]:
        """Text pieces as they are decoded, then the ``ServedAnswer``. A kept answer comes as one piece;
        a streamed answer is kept for later requests (streams are not merged: each shows its own progress)."""
        key = self.answer_key(request)
        kept = self.answers.get(key) if key is not None else None
        if kept is not None:
            yield kept.answer.text
            yield dataclasses.replace(kept, request_id=request.request_id, source=ANSWER_CACHE)
            return
        acquired = self._snapshot_for(request)
        snapshot = acquired.snapshot if acquired is not None else None
        for item in self.engine.stream(request.question, snapshot=snapshot, context=request.context,
                                       max_new_tokens=request.max_new_tokens):
            if isinstance(item, Answer):
                served = self._served(item, acquired, request)
                if key is not None and _matches(key, served):
                    self.answers.store(key, served)
                yield served
            else:
                yield item

    @staticmethod
    def _served(answer: Answer, acquired: Acquired | None, request: AnswerRequest) -> ServedAnswer:
        return ServedAnswer(answer, acquired.release_id if acquired else "", bool(acquired and acquired.resident_hit),
                            acquired.load_s * 1000 if acquired else 0.0, request.request_id)

    # ---- answering a batch ---------------------------------------------------------------------------

    def claim(self, request: AnswerRequest) -> Claim[ServedAnswer]:
        return self.answers.claim(self.answer_key(request))

    def groups(self, leading: Sequence[tuple[AnswerRequest, Claim]]) -> list[list[tuple[AnswerRequest, Claim]]]:
        """Requests to compute together: same requested snapshot and budget, no passages. Passages (with a
        snapshot or not) and questions alone are computed one by one."""
        groups: dict[tuple, list[tuple[AnswerRequest, Claim]]] = {}
        for position, (request, claim) in enumerate(leading):
            batched = request.snapshot_key and request.context is None
            together = (request.snapshot_key, self._budget(request)) if batched else (position,)
            groups.setdefault(together, []).append((request, claim))
        return list(groups.values())

    def compute(self, group: Sequence[tuple[AnswerRequest, Claim]]) -> None:
        """Answer the leading requests of one group and finish their claims (never raises). Requests that
        resolve to the same snapshot (a doc_id may resolve to different parts) share one batched pass."""
        try:
            by_snapshot: dict[int, list[tuple[AnswerRequest, Claim, Acquired | None]]] = {}
            for request, claim in group:
                try:
                    acquired = self._snapshot_for(request)
                except Exception as exc:
                    self.answers.finish(claim, error=exc)
                    continue
                together = id(acquired.snapshot) if acquired is not None else id(claim)
                by_snapshot.setdefault(together, []).append((request, claim, acquired))
            for members in by_snapshot.values():
                self._compute_together(members)
        finally:
            for _, claim in group:
                if not claim.future.done():
                    self.answers.finish(claim, error=RuntimeError("the answer was not computed"))

    def _compute_together(self, members: Sequence[tuple[AnswerRequest, Claim, Acquired | None]]) -> None:
        request, _, acquired = members[0]
        try:
            if len(members) == 1:
                answers = [self.engine.answer(request.question, snapshot=acquired.snapshot if acquired else None,
                                              context=request.context, max_new_tokens=request.max_new_tokens)]
            else:
                answers = self.engine.answer_batch([member[0].question for member in members], acquired.snapshot,
                                                   self._budget(request))
                self.listener.on_batch(len(members))
        except ValueError as exc:
            if len(members) == 1:
                self.answers.finish(members[0][1], error=exc)
                return
            for member in members:  # bad input (a question too long...): only that request fails
                self._compute_together([member])
            return
        except Exception as exc:
            for _, claim, _ in members:
                self.answers.finish(claim, error=exc)
            return
        for (request, claim, acquired), answer in zip(members, answers):
            served = self._served(answer, acquired, request)
            self.answers.finish(claim, served, keep=claim.key is None or _matches(claim.key, served))

    # ---- releases ------------------------------------------------------------------------------------

    def _pointer(self) -> str:
        return str(json.loads(self.store.get(CURRENT_POINTER))["release_id"])

    def reload(self, release_id: str | None, preload: bool | None = None) -> ReloadResult:
        """Switch to ``release_id`` (default: the store's current release) atomically, then preload it.

        Requests already running finish on the release they started with.
        """
        with self._reload_lock:
            started = time.perf_counter()
            release = load_release(self.store, release_id)
            if release_id is None:
                self._pointer_seen = release.release_id
            switch = self.resident.activate(release)
            if switch.changed:
                self.answers.clear()
            if preload is None:
                preload = self.runtime.config.cache.preload_on_startup
            report = self.resident.preload() if preload else None
            if report is not None and report.failed:
                log.warning("preload of %s: %d snapshots unusable: %s", release.release_id, len(report.failed),
                            "; ".join(report.failed.values()))
            result = ReloadResult(switch.previous, switch.current, switch.kept, switch.dropped,
                                  len(report.loaded) if report else 0, time.perf_counter() - started)
            log.info("release %s -> %s: kept %d, dropped %d, preloaded %d in %.2f s", result.previous,
                     result.current, result.kept, result.dropped, result.preloaded, result.seconds)
            return result

    def _watch_releases(self, interval_s: float) -> None:
        """Follow the store's ``current`` pointer, so every process (and every replica) converges on an
        activated release even though a reload request reaches only one of them. An explicit reload to
        another release holds until the pointer moves again."""
        while not self._stop.wait(interval_s):
            try:
                pointer = self._pointer()
                if pointer != self._pointer_seen:
                    self.reload(None)
            except NotFound:
                continue
            except (StoreError, ValueError, KeyError) as exc:
                log.warning("release watch: %s", exc)

    def close(self) -> None:
        self._stop.set()
        if self._watcher is not None and self._watcher.is_alive():
            self._watcher.join(timeout=5)
        self.resident.close()
