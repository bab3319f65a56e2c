"""Offline checks of the Kubernetes deployment (docker/k8s), without a cluster or network: kustomize renders the
base (with placeholder files for the secrets a deployment creates), every object validates against the
Kubernetes JSON schemas of kubernetes-validate (strict: an unknown field fails), every workload has probes and
resources and runs as non-root, Services and the other selectors find the pods, the ConfigMap holds a CAGFlow
configuration that loads and points at those Services, each container finds the files its configuration names,
and airflow-values.yaml validates against the Airflow chart's values schema (a cut copy in docker/k8s/schemas).
kustomize comes from `make tools` (docker/static-tools.sh): the tests that render with it are marked ``tools``, and
a missing one fails, as in test_container_files.py."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

import jsonschema
import kubernetes_validate
import pytest
import yaml
from cagflow.config import load_config
from cagflow.store.backends import credential_variables

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "docker" / "k8s"
AIRFLOW_VALUES = K8S / "airflow-values.yaml"
CHART_SCHEMA = K8S / "schemas" / "airflow-chart-values.schema.json"
# The oldest Kubernetes minor that managed clusters still run, and the newest kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.33", "1.37")
WORKLOADS = ("Deployment", "StatefulSet")
CAGFLOW_IMAGE = re.compile(r"^cagflow(:|$)")
# The pods of the Airflow chart carry this label; the NetworkPolicies let them in.
AIRFLOW_POD_LABELS = {"tier": "airflow"}


def _kustomize() -> Path:
    """Where docker/static-tools.sh keeps kustomize: the script owns the version and the cache folder."""
    path = Path(subprocess.run(["bash", str(REPO / "docker" / "static-tools.sh"), "path", "kustomize"], check=True,
                               capture_output=True, text=True).stdout.strip())
    if not path.exists():
        pytest.fail(f"kustomize is not installed at {path}: run `make tools` (docker/static-tools.sh)")
    return path


def _generated_files(kustomization: dict) -> list[str]:
    """The files secretGenerator reads: what a deployment creates under docker/k8s/secrets/."""
    return [entry.split("=", 1)[-1] for generator in kustomization.get("secretGenerator", [])
            for entry in generator.get("files", [])]


def _build(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(_kustomize()), "build", str(folder)], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """docker/k8s as a deployment would have it: a copy with a placeholder in every secret file."""
    folder = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, folder, ignore=shutil.ignore_patterns("secrets"))
    for name in _generated_files(yaml.safe_load((K8S / "kustomization.yaml").read_text())):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("placeholder")
    return folder


@pytest.fixture(scope="module")
def objects(checkout) -> list[dict]:
    result = _build(checkout)
    assert result.returncode == 0, f"kustomize build failed:\n{result.stderr}"
    return [item for item in yaml.safe_load_all(result.stdout) if item]


def _named(objects: list[dict], kind: str) -> dict[str, dict]:
    return {item["metadata"]["name"]: item for item in objects if item["kind"] == kind}


def _workloads(objects: list[dict]) -> list[dict]:
    return [item for item in objects if item["kind"] in WORKLOADS]


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and selector.items() <= labels.items()


def _pods_labels(objects: list[dict]) -> list[dict[str, str]]:
    return [item["spec"]["template"]["metadata"]["labels"] for item in _workloads(objects)]


def _validation_errors(item: dict, version: str) -> str | None:
    try:
        kubernetes_validate.validate(item, version, strict=True)
    except kubernetes_validate.ValidationError as error:
        return f"{'.'.join(map(str, error.path))}: {error.message}"
    return None


@pytest.mark.tools
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_validates_against_the_kubernetes_schemas(objects, version):
    kinds = {item["kind"] for item in objects}
    assert {"Deployment", "StatefulSet", "Service", "HorizontalPodAutoscaler", "ConfigMap", "Secret",
            "NetworkPolicy"} <= kinds
    errors = {f"{item['kind']}/{item['metadata']['name']}": _validation_errors(item, version) for item in objects}
    assert {name: error for name, error in errors.items() if error} == {}


@pytest.mark.tools
def test_a_broken_manifest_is_rejected(objects):
    """The validator really validates: a misspelt field and a wrong type each fail."""
    router = _named(objects, "Deployment")["cagflow-router"]
    misspelt = copy.deepcopy(router)
    misspelt["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["paht"] = "/healthz"
    wrong_type = copy.deepcopy(router)
    wrong_type["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "https"
    assert "'paht' was unexpected" in _validation_errors(misspelt, KUBERNETES_VERSIONS[0])
    assert "is not of type 'integer'" in _validation_errors(wrong_type, KUBERNETES_VERSIONS[0])


@pytest.mark.tools
def test_a_kustomization_naming_a_missing_file_does_not_render(checkout, tmp_path):
    broken = tmp_path / "k8s"
    shutil.copytree(checkout, broken)
    (broken / "triton.yaml").unlink()
    result = _build(broken)
    assert result.returncode != 0 and "triton.yaml" in result.stderr


@pytest.mark.tools
def test_every_workload_has_probes_and_resources_and_runs_as_non_root(objects):
    problems = []
    for workload in _workloads(objects):
        name, pod = workload["metadata"]["name"], workload["spec"]["template"]["spec"]
        pod_security = pod.get("securityContext", {})
        if not pod_security.get("runAsNonRoot") or not pod_security.get("runAsUser"):
            problems.append(f"{name}: the pod does not run as a non-root user id")
        if pod.get("automountServiceAccountToken") is not False:
            problems.append(f"{name}: mounts a service account token it does not need")
        for container in pod["containers"]:
            where = f"{name}/{container['name']}"
            problems += [f"{where}: no {probe}" for probe in ("livenessProbe", "readinessProbe")
                         if probe not in container]
            resources = container.get("resources", {})
            problems += [f"{where}: no {kind} {what}" for kind, what in
                         (("requests", "cpu"), ("requests", "memory"), ("limits", "memory"))
                         if what not in resources.get(kind, {})]
            security = container.get("securityContext", {})
            dropped = security.get("capabilities", {}).get("drop")
            if security.get("allowPrivilegeEscalation") is not False or dropped != ["ALL"]:
                problems.append(f"{where}: may escalate privileges or keeps capabilities")
    assert problems == []


@pytest.mark.tools
def test_services_select_pods_and_name_their_ports(objects):
    workloads = _workloads(objects)
    for service in _named(objects, "Service").values():
        selected = [workload for workload in workloads
                    if _matches(service["spec"]["selector"], workload["spec"]["template"]["metadata"]["labels"])]
        assert selected, f"Service {service['metadata']['name']} selects no pod"
        port_names = {port["name"] for workload in selected
                      for container in workload["spec"]["template"]["spec"]["containers"]
                      for port in container.get("ports", [])}
        assert {port["targetPort"] for port in service["spec"]["ports"]} <= port_names, service["metadata"]["name"]


@pytest.mark.tools
def test_autoscaler_budgets_and_network_policies_find_their_pods(objects):
    deployments = _named(objects, "Deployment")
    for autoscaler in _named(objects, "HorizontalPodAutoscaler").values():
        target = autoscaler["spec"]["scaleTargetRef"]
        assert target["kind"] == "Deployment" and target["name"] in deployments
        assert "replicas" not in deployments[target["name"]]["spec"], "the autoscaler owns the replica count"
        assert [metric["resource"]["name"] for metric in autoscaler["spec"]["metrics"]] == ["cpu"]
    pods = _pods_labels(objects) + [AIRFLOW_POD_LABELS]
    budgets = _named(objects, "PodDisruptionBudget").values()
    selectors = [budget["spec"]["selector"]["matchLabels"] for budget in budgets]
    for policy in _named(objects, "NetworkPolicy").values():
        selectors.append(policy["spec"]["podSelector"]["matchLabels"])
        selectors += [peer["podSelector"]["matchLabels"] for rule in policy["spec"]["ingress"]
                      for peer in rule.get("from", [])]
    assert [selector for selector in selectors if not any(_matches(selector, labels) for labels in pods)] == []


def _image_environment() -> dict[str, str]:
    """The CAGFLOW__* variables the image sets (docker/Dockerfile ENV): they override the YAML file."""
    return dict(re.findall(r"(CAGFLOW__[A-Z_]+)=(\S+)", (REPO / "docker" / "Dockerfile").read_text()))


def _files(pod: dict, container: dict, objects: list[dict]) -> dict[str, str]:
    """Every file ``container`` sees from a ConfigMap or Secret, as {path: "Kind/name"}."""
    configmaps, secrets = _named(objects, "ConfigMap"), _named(objects, "Secret")

    def sources(volume: dict) -> list[tuple[str, dict]]:
        if "configMap" in volume:
            return [("ConfigMap", configmaps[volume["configMap"]["name"]])]
        return [(kind, (configmaps if kind == "ConfigMap" else secrets)[source[key]["name"]])
                for source in volume.get("projected", {}).get("sources", [])
                for key, kind in (("configMap", "ConfigMap"), ("secret", "Secret")) if key in source]

    volumes = {volume["name"]: volume for volume in pod.get("volumes", [])}
    return {str(PurePosixPath(mount["mountPath"]) / key): f"{kind}/{item['metadata']['name']}"
            for mount in container.get("volumeMounts", []) if mount["name"] in volumes
            for kind, item in sources(volumes[mount["name"]]) for key in item.get("data", {})}


def _file_variables(role: str) -> set[str]:
    """The variables naming ``role``'s S3 credential files, as the store reads them."""
    return {f"{name}_FILE" for name in credential_variables(role)}


def _environment(container: dict) -> dict[str, str]:
    return {variable["name"]: variable["value"] for variable in container.get("env", []) if "value" in variable}


def _cagflow_containers(objects: list[dict]) -> list[tuple[dict, dict]]:
    return [(w["spec"]["template"]["spec"], container) for w in _workloads(objects)
            for container in w["spec"]["template"]["spec"]["containers"] if CAGFLOW_IMAGE.match(container["image"])]


def _config(path: str, files: dict[str, str], objects: list[dict], tmp_path: Path, environ: dict[str, str]):
    """The configuration a container loads: the ConfigMap's file at ``path``, with ``environ`` on top."""
    configmap = _named(objects, "ConfigMap")[files[path].split("/", 1)[1]]
    local = tmp_path / PurePosixPath(path).name
    local.write_text(configmap["data"][PurePosixPath(path).name])
    return load_config(local, environ=environ)


@pytest.mark.tools
def test_the_config_map_holds_a_cagflow_config_pointing_at_the_services(objects, tmp_path):
    configmap = _named(objects, "ConfigMap")["cagflow-config"]
    (tmp_path / "cagflow.yaml").write_text(configmap["data"]["cagflow.yaml"])
    config = load_config(tmp_path / "cagflow.yaml", environ={})
    assert config.cache.state_store.startswith("s3://")
    services = {name: {port["port"] for port in service["spec"]["ports"]}
                for name, service in _named(objects, "Service").items()}
    for address in (config.service.triton_url, config.service.triton_grpc_url, config.service.triton_metrics_url,
                    config.retrieval.endpoint, config.precompute.triton_url):
        parsed = urlparse(address if "://" in address else f"tcp://{address}")
        assert parsed.port in services.get(parsed.hostname, set()), f"{address} is no Service port"
    assert config.service.host == "0.0.0.0" and config.service.port in services["cagflow-router"]


@pytest.mark.tools
def test_each_cagflow_container_finds_the_files_its_config_names(objects, tmp_path):
    """CAGFLOW_CONFIG, the S3 credential files (reader only: serving never writes the store), the TLS pair and
    the API keys file are all mounted, from the objects this base creates."""
    containers = _cagflow_containers(objects)
    assert {container["name"] for _, container in containers} == {"router", "triton"}
    for pod, container in containers:
        files, environ = _files(pod, container, objects), _environment(container)
        config = _config(environ["CAGFLOW_CONFIG"], files, objects, tmp_path, {**_image_environment(), **environ})
        secret_files = {name: value for name, value in environ.items() if name.endswith("_FILE")}
        assert set(secret_files) == _file_variables("reader")
        needed = list(secret_files.values())
        if container["name"] == "router":
            needed += [config.service.tls_cert_file, config.service.tls_key_file, config.service.api_keys_file]
        assert [path for path in needed if path not in files] == [], f"{container['name']}: not mounted"
        assert all(files[path].startswith("Secret/") for path in needed)


def _uncut(schema: dict, value, path: str = "") -> list[str]:
    """Keys of ``value`` the schema copy cannot judge, as it was cut to the keys the values had then: the copy
    must be made again (docker/k8s/schemas/cut_chart_schema.py). Free-form maps (a schema for any key) judge all."""
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [key for item in value for key in _uncut(schema["items"], item, f"{path}[]")]
    free_form = isinstance(schema.get("additionalProperties"), dict)
    if not isinstance(value, dict) or "properties" not in schema or free_form:
        return []
    found = []
    for key, item in value.items():
        if key in schema["properties"]:
            found += _uncut(schema["properties"][key], item, f"{path}.{key}")
        else:
            found.append(f"{path}.{key}")
    return found


@pytest.fixture(scope="module")
def chart_schema() -> dict:
    return json.loads(CHART_SCHEMA.read_text())


@pytest.fixture(scope="module")
def airflow_values() -> dict:
    return yaml.safe_load(AIRFLOW_VALUES.read_text())


def test_airflow_values_validate_against_the_chart_schema(chart_schema, airflow_values):
    jsonschema.validators.validator_for(chart_schema)(chart_schema).validate(airflow_values)
    assert _uncut(chart_schema, airflow_values) == [], "run docker/k8s/schemas/cut_chart_schema.py again"
    assert airflow_values["executor"] == "KubernetesExecutor"
    assert airflow_values["config"]["core"]["dags_folder"] == "/app/dags"  # the DAGs baked into the image


@pytest.mark.parametrize("change, complaint", [
    (lambda values: values.update(executor="Kubernetes"), "does not match"),
    (lambda values: values["scheduler"]["livenessProbe"].update(comand=["airflow"]), "'comand' was unexpected"),
    (lambda values: values["workers"]["kubernetes"]["extraVolumes"][0].update(configmap={}),
     "'configmap' was unexpected"),
], ids=["executor", "probe", "volume"])
def test_a_broken_values_file_is_rejected(chart_schema, airflow_values, change, complaint):
    broken = copy.deepcopy(airflow_values)
    change(broken)
    with pytest.raises(jsonschema.ValidationError, match=re.escape(complaint)):
        jsonschema.validators.validator_for(chart_schema)(chart_schema).validate(broken)


def test_a_key_the_schema_copy_was_cut_without_is_named(chart_schema, airflow_values):
    grown = copy.deepcopy(airflow_values)
    grown["images"] = {"airflow": {"pullPolicy": "Always"}}
    grown["scheduler"]["replicas"] = 2
    assert sorted(_uncut(chart_schema, grown)) == [".images", ".scheduler.replicas"]


@pytest.mark.tools
def test_airflow_pods_find_the_config_and_write_credentials(objects, airflow_values, tmp_path):
    """The Airflow task pods (the chart's pod template) mount what this base creates, under the names it keeps."""
    workers = airflow_values["workers"]["kubernetes"]
    task_pod = {"volumes": airflow_values["volumes"] + workers["extraVolumes"]}
    task = {"env": airflow_values["env"] + workers["env"],
            "volumeMounts": airflow_values["volumeMounts"] + workers["extraVolumeMounts"]}
    files, environ = _files(task_pod, task, objects), _environment(task)
    config = _config(environ["CAGFLOW_CONFIG"], files, objects, tmp_path, {**_image_environment(), **environ})
    assert config.cache.state_store.startswith("s3://")
    writer = {name: path for name, path in environ.items() if name in _file_variables("writer")}
    assert set(writer) == _file_variables("writer")
    assert {files.get(path) for path in writer.values()} == {"Secret/cagflow-s3-writer"}
    api_server = _files({"volumes": airflow_values["apiServer"]["extraVolumes"]},
                        {"volumeMounts": airflow_values["apiServer"]["extraVolumeMounts"]}, objects)
    passwords = airflow_values["config"]["core"]["simple_auth_manager_passwords_file"]
    assert api_server.get(passwords) == "Secret/cagflow-airflow-passwords"


def test_the_secret_files_stay_out_of_git():
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    names = [f"docker/k8s/{name}" for name in _generated_files(kustomization)]
    checked = subprocess.run(["git", "check-ignore", "--no-index", *names], cwd=REPO, capture_output=True, text=True)
    assert sorted(checked.stdout.split()) == sorted(names), checked.stderr
