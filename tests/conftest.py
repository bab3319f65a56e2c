"""Shared fixtures: a tiny random model with the real tokenizer (fast, exact), the real default model,
and the sample corpus."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import boto3
import pytest
import torch

if TYPE_CHECKING:
    from cagflow.devstack.seaweedfs import LocalSeaweedFS

REPO = Path(__file__).resolve().parents[1]
CORPUS_MANIFEST = REPO / "corpus" / "manifest.yaml"
UNIT_DIR = REPO / "tests" / "unit"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests of tests/unit ``unit``, so that make test's two runs split every test between them: the
    quick run collects tests/unit alone (``unit and not integration and not real_model``) and the server run
    takes the rest (``integration or real_model or not unit``), including tests/integration's quick ones."""
    for item in items:
        if UNIT_DIR in item.path.parents:
            item.add_marker(pytest.mark.unit)


@pytest.fixture(scope="session")
def real_model():
    """SmolLM2-135M on the default recipe (int8 engine)."""
    from cagflow.engine.model import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def real_qwen_model():
    """Qwen2.5-Coder-0.5B on the int8 engine (the Qwen2 family: q/k/v biases, 14:2 grouped heads)."""
    from cagflow.engine.model import load_model

    return load_model("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def real_fp32_model():
    from cagflow.engine.model import load_model

    return load_model("smollm2-135m", precision="fp32")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer Llama with random weights and SmolLM2's tokenizer and chat template: real tokenisation,
    grouped-query attention, and forward passes in milliseconds. head_dim 64 is the smallest the int8
    engine's native kernels take, so the tiny model runs the same kernels as the real ones."""
    from cagflow.engine.model import resolve_model_dir
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2-135m")))
    torch.manual_seed(1234)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                         initializer_range=0.5, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny-model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    """The tiny model on the default recipe (int8 engine)."""
    from cagflow.engine.model import load_model

    return load_model(str(tiny_model_dir))


@pytest.fixture(scope="session")
def tiny_fp32_model(tiny_model_dir):
    from cagflow.engine.model import load_model

    return load_model(str(tiny_model_dir), precision="fp32")


@pytest.fixture(scope="session")
def tiny_engine(tiny_model):
    from cagflow.engine.engine import Engine

    return Engine(tiny_model, max_context_tokens=4096, max_new_tokens=24)


@pytest.fixture(scope="session")
def tiny_fp32_engine(tiny_fp32_model):
    from cagflow.engine.engine import Engine

    return Engine(tiny_fp32_model, max_context_tokens=4096, max_new_tokens=24)


@pytest.fixture(scope="session")
def corpus_manifest_path() -> Path:
    return CORPUS_MANIFEST


@pytest.fixture(scope="session")
def sample_subset():
    """Writes a corpus of some sample documents: ``write(target, doc_ids, versions=None)`` copies their files
    into ``target`` with a manifest of them (``versions`` overrides some versions) and returns its path."""
    import shutil

    import yaml

    def write(target: Path, doc_ids: list[str], versions: dict[str, str] | None = None) -> Path:
        sample = yaml.safe_load(CORPUS_MANIFEST.read_text())["documents"]
        entries = [{**entry, "version": (versions or {}).get(entry["doc_id"], entry["version"])}
                   for entry in sample if entry["doc_id"] in doc_ids]
        for entry in entries:
            (target / entry["path"]).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(CORPUS_MANIFEST.parent / entry["path"], target / entry["path"])
        (target / "manifest.yaml").write_text(yaml.safe_dump({"documents": entries}))
        return target / "manifest.yaml"

    return write


@pytest.fixture(scope="session")
def corpus():
    from cagflow.store.manifests import CorpusManifest

    return CorpusManifest.load(CORPUS_MANIFEST)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator["LocalSeaweedFS"]:
    """One real SeaweedFS for the session, started on first use; while it runs its credentials are the
    only ones in the environment (boto3's cached default session is reset so it sees them)."""
    from cagflow.devstack.seaweedfs import LocalSeaweedFS

    server = LocalSeaweedFS(tmp_path_factory.mktemp("seaweedfs"), access_key=secrets.token_hex(10),
                            secret_key=secrets.token_hex(20))
    with server, pytest.MonkeyPatch.context() as session_env:
        session_env.setenv("AWS_ACCESS_KEY_ID", server.access_key)
        session_env.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
        for variable in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            session_env.delenv(variable, raising=False)
        session_env.setattr(boto3, "DEFAULT_SESSION", None)
        yield server


@pytest.fixture(scope="session")
def opensearch_url(tmp_path_factory) -> Iterator[str]:
    """One real OpenSearch node for the session, started on first use; tests keep to their own indexes."""
    from cagflow.devstack.opensearch import LocalOpenSearch

    with LocalOpenSearch(tmp_path_factory.mktemp("opensearch")) as node:
        yield node.url


@pytest.fixture(scope="session")
def publish_first_parts(tiny_model, corpus):
    """``publish(store, max_new_tokens)``: the first part (~600 tokens) of each English fixed document, precomputed
    with the tiny model and published as the active release; returns ``(engine, release)``."""
    from cagflow.documents.parsing import parse_file
    from cagflow.engine.engine import Engine
    from cagflow.documents.text import language
    from cagflow.offline.precompute import precompute_part
    from cagflow.store.manifests import Release, publish_release

    def publish(store, max_new_tokens: int):
        engine = Engine(tiny_model, max_context_tokens=900, max_new_tokens=max_new_tokens, question_budget_tokens=128)
        entries = []
        for document in corpus.tier("fixed"):
            parsed = parse_file(corpus.file(document), document.title)
            if language(parsed.render()) != "en":
                continue  # ~2 tiny-model tokens per Han character: a Chinese paragraph overflows 900 (test_engine_real)
            part = engine.split(document.doc_id, document.version, parsed)[0]
            entries.append(precompute_part(engine, store, part).entry)
        release = Release.build(engine.fingerprint, entries)
        publish_release(store, release)
        return engine, release

    return publish


@pytest.fixture(scope="session")
def _span_memory():
    """An OpenTelemetry provider for this test process whose spans stay in memory (a process takes one provider,
    so it is installed once; tests that come after it see trace ids, which nothing else depends on)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return exporter


@pytest.fixture()
def finished_spans(_span_memory):
    """The spans finished during the test, oldest first (``finished_spans()``)."""
    _span_memory.clear()
    return _span_memory.get_finished_spans
