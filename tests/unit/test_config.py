from pathlib import Path

import pytest
from cagflow.config import ConfigError, load_config, read_secret


def test_defaults_are_valid():
    config = load_config(environ={})
    assert config.service.port == 8080
    assert config.cache.state_store.startswith("file://")
    assert config.retrieval.fallback_enabled is True
    assert config.model.path == "qwen2.5-coder-1.5b"


def test_yaml_file_then_environment_override(tmp_path):
    path = tmp_path / "cagflow.yaml"
    path.write_text("cache:\n  max_resident_states: 3\n  state_store: s3://snapshots/prod\nretrieval:\n  top_k: 6\n")
    config = load_config(path, environ={"CAGFLOW__CACHE__MAX_RESIDENT_STATES": "5",
                                        "CAGFLOW__RETRIEVAL__FALLBACK_ENABLED": "false",
                                        "CAGFLOW__CACHE__S3__ENDPOINT_URL": "http://127.0.0.1:8333"})
    assert config.cache.max_resident_states == 5
    assert config.cache.state_store == "s3://snapshots/prod"
    assert config.retrieval.top_k == 6
    assert config.retrieval.fallback_enabled is False
    assert config.cache.s3.endpoint_url == "http://127.0.0.1:8333"


def test_config_file_named_by_environment(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("service:\n  port: 9001\n")
    assert load_config(environ={"CAGFLOW_CONFIG": str(path)}).service.port == 9001


@pytest.mark.parametrize("environ, key", [
    ({"CAGFLOW__CACHE__MAX_RESIDENT_STATES": "0"}, "cache.max_resident_states"),
    ({"CAGFLOW__CACHE__MAX_RESIDENT_STATES": "many"}, "cache.max_resident_states"),
    ({"CAGFLOW__SERVICE__PORT": "70000"}, "service.port"),
    ({"CAGFLOW__CACHE__STATE_STORE": "ftp://x"}, "cache.state_store"),
    ({"CAGFLOW__RETRIEVAL__TOP_K": "-1"}, "retrieval.top_k"),
    ({"CAGFLOW__MODEL__MAX_CONTEXT_TOKENS": "10"}, "model.max_context_tokens"),
    ({"CAGFLOW__SERVICE__PROT": "1"}, "service.prot: unknown key"),
])
def test_invalid_values_name_the_key(environ, key):
    with pytest.raises(ConfigError) as error:
        load_config(environ=environ)
    assert key in str(error.value)


def test_bad_files_give_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml", environ={})
    broken = tmp_path / "broken.yaml"
    broken.write_text("service: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken, environ={})
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(scalar, environ={})


def test_secrets_from_environment_or_file(tmp_path):
    secret = tmp_path / "key"
    secret.write_text("s3cr3t\n")
    assert read_secret("API_KEY", {"API_KEY": "inline"}) == "inline"
    assert read_secret("API_KEY", {"API_KEY_FILE": str(secret)}) == "s3cr3t"
    assert read_secret("API_KEY", {}) is None
    with pytest.raises(ConfigError, match="API_KEY_FILE"):
        read_secret("API_KEY", {"API_KEY_FILE": str(tmp_path / "nope")})


def test_environment_values_that_are_not_yaml_stay_strings():
    config = load_config(environ={"CAGFLOW__INGEST__SCHEDULE": "*/15 * * * *",
                                  "CAGFLOW__PRECOMPUTE__VIA": "triton"})
    assert config.ingest.schedule == "*/15 * * * *"
    assert config.precompute.via == "triton"


def test_chunk_overlap_must_be_below_chunk_size():
    with pytest.raises(ConfigError, match="retrieval.chunk_overlap_tokens"):
        load_config(environ={"CAGFLOW__RETRIEVAL__CHUNK_TOKENS": "50", "CAGFLOW__RETRIEVAL__CHUNK_OVERLAP_TOKENS": "50"})


def test_the_example_config_lists_every_key_with_its_default():
    """config/cagflow.example.yaml is what operators copy: it cannot drift from the typed config. Every key
    is there, and every value is the default except the deployment paths it deliberately shows."""
    import yaml
    from cagflow.config import Config

    example_path = Path(__file__).resolve().parents[2] / "config" / "cagflow.example.yaml"
    example = yaml.safe_load(example_path.read_text())
    defaults = Config().model_dump()
    deployment_paths = {("service", "api_keys_file"), ("service", "audit_log_file"), ("cache", "state_store")}

    def walk(expected: dict, given: dict, where: tuple[str, ...]) -> list[str]:
        problems = [f"{'.'.join(where + (key,))}: missing" for key in expected if key not in given]
        problems += [f"{'.'.join(where + (key,))}: not a key of the typed config" for key in given if key not in expected]
        for key, value in expected.items():
            if key not in given:
                continue
            if isinstance(value, dict):
                problems += walk(value, given[key], where + (key,))
            elif where + (key,) not in deployment_paths and given[key] != value:
                problems.append(f"{'.'.join(where + (key,))}: example {given[key]!r}, default {value!r}")
        return problems

    assert walk(defaults, example, ()) == []
    load_config(example_path, environ={})  # and it validates


def test_one_triton_replica_from_the_single_address_keys():
    config = load_config(environ={"CAGFLOW__SERVICE__TRITON_URL": "triton:9000",
                                  "CAGFLOW__SERVICE__TRITON_GRPC_URL": "triton:9001",
                                  "CAGFLOW__SERVICE__TRITON_METRICS_URL": "null"})
    [replica] = config.service.replicas()
    assert (replica.id, replica.http_url, replica.grpc_url, replica.metrics_url) == (
        "triton:9000", "triton:9000", "triton:9001", None)


@pytest.mark.parametrize("value", [
    "name=a http_url=10.0.0.5:8000 grpc_url=10.0.0.5:8001 metrics_url=http://10.0.0.5:8002/metrics,"
    " http_url=10.0.0.6:8000 grpc_url=10.0.0.6:8001",
    '[{"name": "a", "http_url": "10.0.0.5:8000", "grpc_url": "10.0.0.5:8001",'
    ' "metrics_url": "http://10.0.0.5:8002/metrics"}, {"http_url": "10.0.0.6:8000", "grpc_url": "10.0.0.6:8001"}]',
])
def test_triton_replicas_from_the_environment_as_text_or_json(value):
    config = load_config(environ={"CAGFLOW__SERVICE__TRITON_REPLICAS": value})
    assert [(replica.id, replica.grpc_url, replica.metrics_url) for replica in config.service.replicas()] == [
        ("a", "10.0.0.5:8001", "http://10.0.0.5:8002/metrics"), ("10.0.0.6:8000", "10.0.0.6:8001", None)]


def test_triton_replicas_from_a_file_replace_the_single_address(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("service:\n  triton_url: 127.0.0.1:8000\n  triton_replicas:\n"
                    "    - {http_url: '[::1]:8000', grpc_url: '[::1]:8001'}\n"
                    "    - http_url=127.0.0.1:9000 grpc_url=127.0.0.1:9001\n")
    assert [replica.http_url for replica in load_config(path, environ={}).service.replicas()] == [
        "[::1]:8000", "127.0.0.1:9000"]


@pytest.mark.parametrize("value, message", [
    ("http_url=a:8000", "service.triton_replicas.0.grpc_url: Field required"),
    ("http_url=http://a:8000 grpc_url=a:8001", "service.triton_replicas.0.http_url: Value error, must be HOST:PORT"),
    ("http_url=a:8000 grpc_url=a:99999", "service.triton_replicas.0.grpc_url: Value error, must be HOST:PORT"),
    ("http_url=a:8000 grpc_url=a:8001 metrics_url=a:8002", "service.triton_replicas.0.metrics_url: Value error"),
    ("http_url=a:8000 grpc_url=a:8001 port=3", "service.triton_replicas.0.port: unknown key"),
    ("a:8000 a:8001", "entry 'a:8000 a:8001': write space-separated KEY=VALUE pairs"),
    ("http_url=a:8000 grpc_url=a:8001, http_url=a:8000 grpc_url=b:8001", "http_url a:8000 given twice"),
    ("name=x http_url=a:8000 grpc_url=a:8001, name=x http_url=b:8000 grpc_url=b:8001", "name x given twice"),
])
def test_invalid_triton_replicas_say_what_is_wrong(value, message):
    with pytest.raises(ConfigError) as error:
        load_config(environ={"CAGFLOW__SERVICE__TRITON_REPLICAS": value})
    assert message in str(error.value)
