"""What the Triton models in ``triton_models/`` share: the serving state, request parsing, responses,
errors and metrics. The model files only wire these into Triton's ``initialize / execute / finalize``.

Threading: the Python backend's calls (tensors, responses, metrics) are made only on the thread that runs
``execute`` (the stub's event loop); model work runs in a thread pool and talks back through asyncio.
Metrics are therefore collected from any thread and published from ``execute``.

Answering a Triton batch (``answer_requests``): a repeat of an answered question is served from the
answer cache, a question already being computed waits for that computation (``cagflow.answer_cache``),
and the rest are computed, those on the same snapshot with the same budget in one batched pass.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import socket
import sys
import threading
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterator, Sequence

import torch

from .answer_cache import (ANSWER_CACHE, COMPUTED, MERGED, AnswerCache, AnswerCacheListener, AnswerKey, Claim,
                           context_digest)
from .catalog import PrecomputeResult, SnapshotUnusable, precompute_part
from .config import Config, ConfigError, load_config
from .documents import PARSERS, DocumentError, ParsedDocument
from .engine import Answer, Engine, SnapshotMismatch, best_part
from .manifest import CURRENT_POINTER, ManifestError, load_release
from .prompt import Passage, clean_question
from .resident import Acquired, HeatLog, NoActiveRelease, ResidentListener, ResidentSet, UnknownSnapshot
from .stores import NotFound, SnapshotStore, StoreError, open_store

log = logging.getLogger("cagflow.serving")

ACTIONS = ("answer", "reload")
LOAD_SECONDS_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


class InvalidRequest(ValueError):
    """A request whose inputs are missing, malformed or contradictory."""


# ---- settings and start-up --------------------------------------------------------------------------

@dataclass(frozen=True)
class ServingSettings:
    """The model's ``parameters`` from config.pbtxt; everything else comes from the CAGFlow config."""

    model_name: str
    instance_name: str
    config_file: str | None = None
    replica_id: str = ""
    worker_threads: int = 4
    release_poll_s: float = 30.0
    heat_flush_s: float = 60.0
    answer_cache_entries: int = 1024

    @classmethod
    def from_triton(cls, args: dict[str, str]) -> "ServingSettings":
        config = json.loads(args["model_config"])
        raw = {key: value.get("string_value", "") for key, value in (config.get("parameters") or {}).items()}
        known = {"config_file", "replica_id", "worker_threads", "release_poll_s", "heat_flush_s",
                 "answer_cache_entries"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"{args['model_name']}/config.pbtxt: unknown parameters {', '.join(unknown)} "
                              f"(known: {', '.join(sorted(known))})")

        def number(name: str, kind: type, default: float, minimum: float) -> Any:
            text = raw.get(name, "").strip()
            where = f"{args['model_name']}/config.pbtxt: parameter {name}"
            try:
                value = kind(text) if text else default
            except ValueError:
                raise ConfigError(f"{where} must be a number, got {text!r}") from None
            if value < minimum:
                raise ConfigError(f"{where} must be >= {minimum}, got {value}")
            return value

        instance = args.get("model_instance_name", args["model_name"])
        return cls(
            model_name=args["model_name"],
            instance_name=instance,
            config_file=raw.get("config_file") or None,
            replica_id=raw.get("replica_id") or f"{socket.gethostname()}-{instance}",
            worker_threads=number("worker_threads", int, 4, 1),
            release_poll_s=number("release_poll_s", float, 30.0, 0.0),
            heat_flush_s=number("heat_flush_s", float, 60.0, 0.0),
            answer_cache_entries=number("answer_cache_entries", int, 1024, 0),
        )


def configure_logging(instance_name: str) -> None:
    """CAGFlow's log lines go to the stub's stderr, which Triton writes to its own log; writing there
    directly is safe from any thread."""
    logger = logging.getLogger("cagflow")
    if not any(getattr(handler, "cagflow_triton", False) for handler in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[cagflow {instance_name}] %(levelname)s %(message)s"))
        handler.cagflow_triton = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 1e6


@dataclass
class Runtime:
    config: Config
    engine: Engine
    store: SnapshotStore

    @classmethod
    def load(cls, settings: ServingSettings) -> "Runtime":
        config = load_config(settings.config_file)
        engine = Engine.from_config(config.model)
        store = open_store(config.cache.state_store, config.cache.s3)
        return cls(config, engine, store)


# ---- requests and answers ---------------------------------------------------------------------------

@dataclass(frozen=True)
class AnswerRequest:
    question: str
    snapshot_key: str = ""  # a snapshot key of the active release, or a doc_id of it, or empty
    context: tuple[Passage, ...] | None = None
    max_new_tokens: int | None = None
    request_id: str = ""

    def __post_init__(self) -> None:
        clean_question(self.question)
        if self.snapshot_key and self.context is not None:
            raise InvalidRequest("give SNAPSHOT_KEY or CONTEXT, not both")
        if self.max_new_tokens is not None and not 1 <= self.max_new_tokens <= 4096:
            raise InvalidRequest(f"MAX_NEW_TOKENS must be between 1 and 4096, got {self.max_new_tokens}")


def parse_context(text: str) -> tuple[Passage, ...]:
    """CONTEXT is a JSON list of passages: strings, or objects with "text" and optional "title"/"section"."""
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
        extra = set(item) - {"text", "title", "section"}
        if extra:
            raise InvalidRequest(f"CONTEXT passage {number}: unknown fields {', '.join(sorted(extra))}")
        passages.append(Passage(item["text"], str(item.get("title", "")), str(item.get("section", ""))))
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
        return self.answer.route == "cache"


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
            return AnswerKey.of(release_id, request.snapshot_key, request.question, self._budget(request))
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
        """Requests to compute together: same requested snapshot and budget. Passages and questions alone
        are computed one by one."""
        groups: dict[tuple, list[tuple[AnswerRequest, Claim]]] = {}
        for position, (request, claim) in enumerate(leading):
            together = (request.snapshot_key, self._budget(request)) if request.snapshot_key else (position,)
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


@dataclass
class Serving:
    """What an answering model holds from ``initialize`` to ``finalize``."""

    settings: ServingSettings
    metrics: "TritonMetrics"
    service: CagService
    pool: ThreadPoolExecutor

    @classmethod
    def start(cls, pb_utils, args: dict[str, str]) -> "Serving":
        settings = ServingSettings.from_triton(args)
        configure_logging(settings.instance_name)
        metrics = TritonMetrics(pb_utils, settings.model_name, settings.instance_name)
        service = CagService.start(settings, listener=metrics)
        pool = ThreadPoolExecutor(settings.worker_threads, thread_name_prefix=settings.model_name)
        metrics.publish()
        return cls(settings, metrics, service, pool)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.service.close()
        self.metrics.close()


# ---- precompute -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DocumentRequest:
    doc_id: str
    doc_version: str
    text: str
    format: str = "md"
    title: str = ""
    force: bool = False


def precompute_document(engine: Engine, store: SnapshotStore, document: DocumentRequest) -> list[PrecomputeResult]:
    """Parse, split and store every part's snapshot (idempotent: verified parts are kept, not redone)."""
    parser = PARSERS.get("." + document.format.lower().lstrip("."))
    if parser is None:
        formats = sorted({suffix.lstrip(".") for suffix in PARSERS})
        raise DocumentError(f"FORMAT {document.format!r} is not supported (use one of: {', '.join(formats)})")
    parsed = parser(document.text)
    if not any(section.text.strip() for section in parsed.sections):
        raise DocumentError(f"document {document.doc_id} has no text")
    whole = ParsedDocument(document.title or parsed.title or document.doc_id, parsed.sections)
    parts = engine.split(document.doc_id, document.doc_version, whole)
    store.ping()
    return [precompute_part(engine, store, part, document.force) for part in parts]


def entries_json(results: list[PrecomputeResult]) -> str:
    return json.dumps([{**r.entry.model_dump(), "skipped": r.skipped, "seconds": round(r.seconds, 4)} for r in results])


# ---- errors -----------------------------------------------------------------------------------------

def error_code(exc: BaseException) -> str:
    """The Triton error code for an exception: what a client (or router) should do about it."""
    if isinstance(exc, (UnknownSnapshot, NotFound)):
        return "NOT_FOUND"
    if isinstance(exc, (SnapshotUnusable, StoreError, NoActiveRelease, ManifestError)):
        return "UNAVAILABLE"
    if isinstance(exc, ValueError) and not isinstance(exc, SnapshotMismatch):
        return "INVALID_ARG"  # bad inputs: InvalidRequest, PromptError, DocumentError, ReleaseMismatch...
    return "INTERNAL"


def describe(exc: BaseException, request_id: str = "") -> str:
    message = str(exc) or type(exc).__name__
    if error_code(exc) == "INTERNAL":
        message = f"internal error ({type(exc).__name__}): {message}"
    return f"request {request_id}: {message}" if request_id else message


# ---- Triton tensors ---------------------------------------------------------------------------------

def _single(pb_utils, request, name: str):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    values = tensor.as_numpy().reshape(-1)
    if values.size != 1:
        raise InvalidRequest(f"{name} must hold exactly one value, got {values.size}")
    return values[0]


def input_text(pb_utils, request, name: str) -> str | None:
    value = _single(pb_utils, request, name)
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequest(f"{name} is not UTF-8 text") from None
    return str(value)


def input_int(pb_utils, request, name: str) -> int | None:
    value = _single(pb_utils, request, name)
    return None if value is None else int(value)


def input_bool(pb_utils, request, name: str) -> bool:
    value = _single(pb_utils, request, name)
    return bool(value) if value is not None else False


def read_action(pb_utils, request) -> str:
    action = (input_text(pb_utils, request, "ACTION") or "answer").strip().lower()
    if action not in ACTIONS:
        raise InvalidRequest(f"ACTION must be one of {', '.join(ACTIONS)}, got {action!r}")
    return action


def read_answer_request(pb_utils, request) -> AnswerRequest:
    question = input_text(pb_utils, request, "QUESTION")
    if question is None:
        raise InvalidRequest("QUESTION is required")
    context = input_text(pb_utils, request, "CONTEXT")
    return AnswerRequest(
        question=question,
        snapshot_key=(input_text(pb_utils, request, "SNAPSHOT_KEY") or "").strip(),
        context=parse_context(context) if context and context.strip() else None,
        max_new_tokens=input_int(pb_utils, request, "MAX_NEW_TOKENS"),
        request_id=input_text(pb_utils, request, "REQUEST_ID") or request.request_id() or "",
    )


def read_document_request(pb_utils, request) -> DocumentRequest:
    fields = {}
    for name in ("DOC_ID", "DOC_VERSION", "DOCUMENT"):
        value = input_text(pb_utils, request, name)
        if not value:
            raise InvalidRequest(f"{name} is required")
        fields[name] = value
    return DocumentRequest(fields["DOC_ID"], fields["DOC_VERSION"], fields["DOCUMENT"],
                           input_text(pb_utils, request, "FORMAT") or "md",
                           input_text(pb_utils, request, "TITLE") or "", input_bool(pb_utils, request, "FORCE"))


def _text(pb_utils, name: str, value: str):
    import numpy as np

    return pb_utils.Tensor(name, np.array([[value.encode("utf-8")]], dtype=np.object_))


def _number(pb_utils, name: str, value, dtype):
    import numpy as np

    return pb_utils.Tensor(name, np.array([[value]], dtype=dtype))


def answer_outputs(pb_utils, served: ServedAnswer) -> list:
    import numpy as np

    answer = served.answer
    return [
        _text(pb_utils, "ANSWER", answer.text),
        _number(pb_utils, "CACHE_HIT", served.cache_hit, np.bool_),
        _number(pb_utils, "RESIDENT_HIT", served.resident_hit, np.bool_),
        _number(pb_utils, "PROMPT_TOKENS", answer.prompt_tokens, np.int32),
        _number(pb_utils, "REUSED_TOKENS", answer.reused_tokens, np.int32),
        _number(pb_utils, "TTFT_MS", answer.ttft_s * 1000, np.float32),
        _number(pb_utils, "GEN_MS", answer.total_s * 1000, np.float32),
        _number(pb_utils, "SNAPSHOT_LOAD_MS", served.load_ms, np.float32),
        _text(pb_utils, "SNAPSHOT_KEY", answer.snapshot_key or ""),
        _text(pb_utils, "RELEASE_ID", served.release_id),
        _text(pb_utils, "ROUTE", answer.route),
        _text(pb_utils, "FINISH_REASON", answer.finish_reason),
        _text(pb_utils, "REQUEST_ID", served.request_id),
        pb_utils.Tensor("TOKEN_IDS", np.array([answer.token_ids], dtype=np.int32).reshape(1, -1)),
        _text(pb_utils, "ANSWER_SOURCE", served.source),
    ]


def reload_outputs(pb_utils, result: ReloadResult) -> list:
    return [_text(pb_utils, "RELEASE_ID", result.current), _text(pb_utils, "STATUS", result.to_json())]


def text_piece_outputs(pb_utils, piece: str) -> list:
    return [_text(pb_utils, "TEXT", piece)]


def precompute_outputs(pb_utils, results: list[PrecomputeResult], seconds: float) -> list:
    import numpy as np

    keys = np.array([[r.entry.key.encode() for r in results]], dtype=np.object_)
    return [_text(pb_utils, "ENTRIES", entries_json(results)), pb_utils.Tensor("SNAPSHOT_KEYS", keys),
            _number(pb_utils, "PRECOMPUTE_MS", seconds * 1000, np.float32)]


def error_response(pb_utils, exc: BaseException, request_id: str = ""):
    code = error_code(exc)
    if code == "INTERNAL":
        log.exception("request %s failed", request_id or "?", exc_info=exc)
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(describe(exc, request_id),
                                                                 getattr(pb_utils.TritonError, code)))


# ---- threads and asyncio ----------------------------------------------------------------------------

async def in_thread(pool: Executor, function: Callable, *args):
    return await asyncio.get_running_loop().run_in_executor(pool, function, *args)


async def answer_requests(service: CagService, pool: Executor,
                          requests: Sequence[AnswerRequest]) -> list[ServedAnswer | Exception]:
    """Answer one Triton batch, in order: repeats from the answer cache, questions already in flight by
    waiting for them, the rest computed in ``pool`` (one batched pass per snapshot and budget)."""
    claims: list[Claim | Exception] = []
    for request in requests:
        try:
            claims.append(service.claim(request))
        except Exception as exc:  # no active release...
            claims.append(exc)
    leading = [(request, claim) for request, claim in zip(requests, claims) if isinstance(claim, Claim) and claim.leads]
    await asyncio.gather(*(in_thread(pool, service.compute, group) for group in service.groups(leading)))
    results: list[ServedAnswer | Exception] = []
    for request, claim in zip(requests, claims):
        if isinstance(claim, Exception):
            results.append(claim)
            continue
        try:
            served = await asyncio.wrap_future(claim.future)
        except Exception as exc:
            results.append(exc)
            continue
        results.append(dataclasses.replace(served, request_id=request.request_id, source=claim.source))
    return results


async def respond(pb_utils, serving: "Serving", requests) -> list:
    """``cag_llm``'s responses, one per request: reloads on their own, answers through ``answer_requests``."""
    responses: list = [None] * len(requests)
    questions: dict[int, AnswerRequest] = {}
    reloads = []
    for position, request in enumerate(requests):
        try:
            if read_action(pb_utils, request) == "reload":
                reloads.append((position, input_text(pb_utils, request, "RELEASE_ID") or None))
            else:
                questions[position] = read_answer_request(pb_utils, request)
        except Exception as exc:
            responses[position] = error_response(pb_utils, exc, request.request_id())

    async def reload(position: int, release_id: str | None) -> None:
        try:
            result = await in_thread(serving.pool, serving.service.reload, release_id)
            responses[position] = pb_utils.InferenceResponse(output_tensors=reload_outputs(pb_utils, result))
        except Exception as exc:
            responses[position] = error_response(pb_utils, exc, requests[position].request_id())

    await asyncio.gather(*(reload(position, release_id) for position, release_id in reloads))
    answers = await answer_requests(serving.service, serving.pool, list(questions.values()))
    for (position, question), result in zip(questions.items(), answers):
        responses[position] = (error_response(pb_utils, result, question.request_id) if isinstance(result, Exception)
                               else pb_utils.InferenceResponse(output_tensors=answer_outputs(pb_utils, result)))
    return responses


async def iterate_in_thread(pool: Executor, make_iterator: Callable[[], Iterator]) -> AsyncIterator:
    """Run a blocking iterator in ``pool`` and yield its items on the event loop. Leaving the loop early
    (a cancelled stream) stops the iterator at its next item."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    stop = threading.Event()
    finished = object()

    def produce() -> None:
        try:
            iterator = make_iterator()
            try:
                for item in iterator:
                    loop.call_soon_threadsafe(queue.put_nowait, (item, None))
                    if stop.is_set():
                        break
            finally:
                close = getattr(iterator, "close", None)
                if close is not None:
                    close()
        except Exception as exc:
            loop.call_soon_threadsafe(queue.put_nowait, (None, exc))
            return
        loop.call_soon_threadsafe(queue.put_nowait, (finished, None))

    producer = loop.run_in_executor(pool, produce)
    try:
        while True:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is finished:
                return
            yield item
    finally:
        stop.set()
        await producer


# ---- metrics ----------------------------------------------------------------------------------------

class TritonMetrics(ServingListener):
    """Custom metrics on Triton's metrics port (``pb_utils.MetricFamily``).

    The service reports from request threads; the counts are buffered here and published by
    ``publish()``, which the model calls from ``execute``, the only thread allowed to talk to Triton.
    """

    def __init__(self, pb_utils, model: str, instance: str):
        labels = {"model": model, "instance": instance}
        family = pb_utils.MetricFamily
        specs = {
            "hits": ("cagflow_snapshot_hits_total", "Requests whose snapshot was already resident", family.COUNTER),
            "misses": ("cagflow_snapshot_misses_total", "Requests that had to load (or wait for) their snapshot",
                       family.COUNTER),
            "evictions": ("cagflow_snapshot_evictions_total", "Snapshots evicted from the resident set",
                          family.COUNTER),
            "store_errors": ("cagflow_store_errors_total",
                             "Snapshot loads that failed because the store did not answer", family.COUNTER),
            "states": ("cagflow_resident_states", "Snapshots resident in memory", family.GAUGE),
            "bytes": ("cagflow_resident_bytes", "Bytes of KV tensors resident in memory", family.GAUGE),
            "quarantined": ("cagflow_quarantined_snapshots", "Snapshots of the active release that failed verification",
                            family.GAUGE),
            "evicted_in_use": ("cagflow_evicted_in_use_bytes",
                               "Bytes of evicted snapshots still held by running requests (count toward the budget)",
                               family.GAUGE),
            "answer_requests": ("cagflow_answer_requests_total", "Answer requests (not reloads)", family.COUNTER),
            "answer_cache_lookups": ("cagflow_answer_cache_lookups_total",
                                     "Answer requests that looked in the answer cache", family.COUNTER),
            "answer_cache_hits": ("cagflow_answer_cache_hits_total", "Answers served from the answer cache",
                                  family.COUNTER),
            "merged": ("cagflow_merged_requests_total",
                       "Answer requests that waited for an identical request already being computed", family.COUNTER),
            "batched": ("cagflow_batched_requests_total",
                        "Requests computed in a batched pass with others on the same snapshot", family.COUNTER),
            "batches": ("cagflow_batches_total", "Batched passes (two or more requests on one snapshot)",
                        family.COUNTER),
        }
        self._families = {}
        self._metrics = {}
        for name, (metric_name, description, kind) in specs.items():
            self._families[name] = family(name=metric_name, description=description, kind=kind)
            self._metrics[name] = self._families[name].Metric(labels=labels)
        self._families["load"] = family(name="cagflow_snapshot_load_seconds",
                                        description="Time to read, verify and deserialize a snapshot",
                                        kind=family.HISTOGRAM)
        self._metrics["load"] = self._families["load"].Metric(labels=labels, buckets=LOAD_SECONDS_BUCKETS)
        self._lock = threading.Lock()
        self._increments = dict.fromkeys((name for name, spec in specs.items() if spec[2] == family.COUNTER), 0)
        self._gauges: dict[str, float] = {}
        self._load_seconds: list[float] = []

    def _add(self, name: str) -> None:
        with self._lock:
            self._increments[name] += 1

    def on_hit(self) -> None:
        self._add("hits")

    def on_miss(self) -> None:
        self._add("misses")

    def on_evict(self) -> None:
        self._add("evictions")

    def on_store_error(self) -> None:
        self._add("store_errors")

    def on_load(self, seconds: float, nbytes: int) -> None:
        with self._lock:
            self._load_seconds.append(seconds)

    def on_quarantine(self, quarantined: int) -> None:
        with self._lock:
            self._gauges["quarantined"] = quarantined

    def on_resident(self, states: int, nbytes: int) -> None:
        with self._lock:
            self._gauges["states"] = states
            self._gauges["bytes"] = nbytes

    def on_evicted_in_use(self, nbytes: int) -> None:
        with self._lock:
            self._gauges["evicted_in_use"] = nbytes

    def on_answer(self, source: str, looked_up: bool) -> None:
        with self._lock:
            self._increments["answer_requests"] += 1
            self._increments["answer_cache_lookups"] += looked_up
            self._increments["answer_cache_hits"] += source == ANSWER_CACHE
            self._increments["merged"] += source == MERGED

    def on_batch(self, size: int) -> None:
        with self._lock:
            self._increments["batched"] += size
            self._increments["batches"] += 1

    def publish(self) -> None:
        with self._lock:
            increments = {name: count for name, count in self._increments.items() if count}
            self._increments = dict.fromkeys(self._increments, 0)
            gauges, self._gauges = self._gauges, {}
            loads, self._load_seconds = self._load_seconds, []
        for name, count in increments.items():
            self._metrics[name].increment(count)
        for name, value in gauges.items():
            self._metrics[name].set(value)
        for seconds in loads:
            self._metrics["load"].observe(seconds)

    def close(self) -> None:
        """Metrics must go before their families (the Python backend's rule)."""
        self._metrics.clear()
        self._families.clear()

