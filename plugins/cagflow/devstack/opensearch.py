"""A real single-node OpenSearch on 127.0.0.1, assembled from Maven Central artifacts.

No OpenSearch package exists on PyPI or Debian, but Maven Central serves the minimal distribution
(``org.opensearch.distribution.integ-test-zip``) and the plugin zips. The 2.19.1 line is the one where
k-NN *and* neural-search are both published, so the hybrid query and its normalization pipelines run
server-side. Its minimal distribution holds only the transport module, so the two modules the project
needs are rebuilt from their published jars: ``lang-painless`` (k-NN extends it), ``reindex``
(delete-by-query) and ``analysis-common`` (the CJK bigram and English stemming filters of the text
analyzer, see ``cagflow.search.index_schema``).

Everything is fetched once into ``~/.cache/cagflow/opensearch`` (``CAGFLOW_OPENSEARCH_CACHE``
overrides it); each node keeps its config, data and logs in a directory its caller chooses.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .background import ServiceError, serve_until_stopped
from .process import ServerContext, ServerProcess, free_port

OPENSEARCH_VERSION = "2.19.1"
PLUGIN_VERSION = f"{OPENSEARCH_VERSION}.0"
PLUGIN_NAMES = ("opensearch-knn", "opensearch-neural-search")

_DISTRIBUTION = ("org.opensearch.distribution.integ-test-zip", "opensearch", OPENSEARCH_VERSION, "zip")
_PLUGIN_ZIPS = (
    ("org.opensearch.plugin", "opensearch-knn", PLUGIN_VERSION, "zip"),  # must install before neural-search
    ("org.opensearch.plugin", "neural-search", PLUGIN_VERSION, "zip"),
)
_MAVEN_DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"

# 2.19 installs a Java Security Manager, which Java 24 removed.
SUPPORTED_JAVA_MAJORS = range(11, 24)

# OpenSearch refuses to run with euid 0. As root, the node runs inside a user namespace that maps this
# id back to root: the JVM sees an ordinary user, files keep their owner, and no chown is needed.
_NAMESPACE_UID = 1000

_READY_MARKER = ".cagflow-ready"


@dataclass(frozen=True)
class _JarModule:
    """A module the minimal distribution lacks, rebuilt from its Maven jar and dependencies."""

    name: str
    artifact: str
    classname: str
    description: str
    security_policy: str = ""
    extended_plugins: str = ""

    def descriptor(self) -> str:
        return "\n".join([
            f"description={self.description}",
            f"version={OPENSEARCH_VERSION}",
            f"name={self.name}",
            f"classname={self.classname}",
            "java.version=11",
            f"opensearch.version={OPENSEARCH_VERSION}",
            f"extended.plugins={self.extended_plugins}",
            "has.native.controller=false",
            "",
        ])


_JAR_MODULES = (
    _JarModule(
        name="lang-painless",
        artifact="lang-painless",
        classname="org.opensearch.painless.PainlessPlugin",
        description="An easy, safe and fast scripting language for OpenSearch",
        security_policy=(
            "grant {\n"
            '  permission java.lang.RuntimePermission "createClassLoader";\n'
            '  permission java.lang.RuntimePermission "getClassLoader";\n'
            "};\n"
        ),
    ),
    _JarModule(
        name="reindex",
        artifact="reindex-client",
        classname="org.opensearch.index.reindex.ReindexPlugin",
        description="Reindex, update-by-query and delete-by-query",
    ),
    _JarModule(
        name="analysis-common",
        artifact="analysis-common",
        classname="org.opensearch.analysis.common.CommonAnalysisPlugin",
        description="Adds analysis components: CJK bigrams, stemmers, character width folding and more",
        extended_plugins="lang-painless",  # it adds analysis functions to painless, as the shipped module does
    ),
)


class OpenSearchSetupError(ServiceError):
    """The distribution could not be fetched, assembled or started."""


def cache_root() -> Path:
    configured = os.environ.get("CAGFLOW_OPENSEARCH_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "cagflow" / "opensearch"


def _progress(message: str) -> None:
    print(f"[opensearch] {message}", file=sys.stderr, flush=True)


# --- Java ------------------------------------------------------------------------------------------


def _java_major(java_home: Path) -> int | None:
    release = java_home / "release"
    if not (java_home / "bin" / "java").exists() or not release.exists():
        return None
    for line in release.read_text(errors="replace").splitlines():
        if line.startswith("JAVA_VERSION="):
            parts = line.split("=", 1)[1].strip('"').split(".")
            major = parts[1] if parts[0] == "1" else parts[0]
            return int(major) if major.isdigit() else None
    return None


def _java_home_candidates() -> Iterator[Path]:
    for variable in ("OPENSEARCH_JAVA_HOME", "JAVA_HOME"):
        if os.environ.get(variable):
            yield Path(os.environ[variable])
    java_on_path = shutil.which("java")
    if java_on_path:
        yield Path(java_on_path).resolve().parent.parent
    jvm_dir = Path("/usr/lib/jvm")
    if jvm_dir.is_dir():
        yield from sorted(path for path in jvm_dir.iterdir() if path.is_dir() and not path.is_symlink())


def find_java_home() -> Path:
    """First JDK the pinned OpenSearch supports: env vars, then ``java`` on PATH, then /usr/lib/jvm."""
    seen = []
    for home in _java_home_candidates():
        major = _java_major(home)
        seen.append(f"{home} (Java {major or '?'})")
        if major in SUPPORTED_JAVA_MAJORS:
            return home
    raise OpenSearchSetupError(
        f"OpenSearch {OPENSEARCH_VERSION} needs Java {SUPPORTED_JAVA_MAJORS.start}-"
        f"{SUPPORTED_JAVA_MAJORS.stop - 1}; set OPENSEARCH_JAVA_HOME. Found: {', '.join(seen) or 'none'}"
    )


# --- Fetch and assemble ----------------------------------------------------------------------------


def _dependency(group: str, artifact: str, version: str, packaging: str, excluded: str = "*:*") -> str:
    excluded_group, excluded_artifact = excluded.split(":")
    return (
        f"<dependency><groupId>{group}</groupId><artifactId>{artifact}</artifactId>"
        f"<version>{version}</version><type>{packaging}</type><exclusions><exclusion>"
        f"<groupId>{excluded_group}</groupId><artifactId>{excluded_artifact}</artifactId>"
        "</exclusion></exclusions></dependency>"
    )


def _pom(artifact_id: str, body: str) -> str:
    return (
        '<project xmlns="http://maven.apache.org/POM/4.0.0"><modelVersion>4.0.0</modelVersion>'
        f"<groupId>cagflow.local</groupId><artifactId>{artifact_id}</artifactId><version>1</version>"
        f"<packaging>pom</packaging>{body}</project>"
    )


def _write_fetch_project(work_dir: Path) -> None:
    """A Maven reactor whose sub-projects each collect one set of files, so one Maven run fetches all.

    ``zips`` takes the distribution and plugin zips alone; each jar module takes its jar with its
    dependencies except the server itself (other jars the distribution ships are dropped later).
    """
    zips = [_dependency(*_DISTRIBUTION), *(_dependency(*plugin) for plugin in _PLUGIN_ZIPS)]
    projects = {"zips": "".join(zips)}
    for module in _JAR_MODULES:
        projects[module.name] = _dependency(
            "org.opensearch.plugin", module.artifact, OPENSEARCH_VERSION, "jar", excluded="org.opensearch:opensearch"
        )
    for name, dependencies in projects.items():
        (work_dir / name).mkdir(parents=True)
        (work_dir / name / "pom.xml").write_text(_pom(f"fetch-{name}", f"<dependencies>{dependencies}</dependencies>"))
    modules = "".join(f"<module>{name}</module>" for name in projects)
    (work_dir / "pom.xml").write_text(_pom("opensearch-fetch", f"<modules>{modules}</modules>"))


def _maven_fetch(work_dir: Path) -> None:
    mvn = shutil.which("mvn")
    if mvn is None:
        raise OpenSearchSetupError("Maven ('mvn') is needed to fetch OpenSearch from Maven Central")
    _write_fetch_project(work_dir)
    command = [
        mvn, "-B", "-ntp", f"-Dmaven.repo.local={cache_root() / 'm2'}",
        f"{_MAVEN_DEPENDENCY_PLUGIN}:copy-dependencies",
    ]
    result = subprocess.run(command, cwd=work_dir, capture_output=True, text=True)
    if result.returncode != 0:
        errors = [line for line in result.stdout.splitlines() if "[ERROR]" in line] or [result.stderr]
        raise OpenSearchSetupError("Maven could not fetch OpenSearch:\n" + "\n".join(errors[:10]))


def _fetched(work_dir: Path, project: str) -> Path:
    return work_dir / project / "target" / "dependency"


def _unzip(archive_path: Path, target: Path) -> None:
    """Extract keeping the Unix mode bits, which ``zipfile`` drops and ``bin/`` needs."""
    with zipfile.ZipFile(archive_path) as archive:
        for member in archive.infolist():
            extracted = Path(archive.extract(member, target))
            mode = member.external_attr >> 16
            if mode and not member.is_dir():
                extracted.chmod(mode & 0o777)


def _artifact_name(jar: Path) -> str:
    """``lucene-core-9.12.1.jar`` -> ``lucene-core``: the name without its version."""
    parts = jar.stem.split("-")
    while parts and parts[-1][:1].isdigit():
        parts.pop()
    return "-".join(parts)


def _install_jar_module(home: Path, module: _JarModule, jar_dir: Path) -> None:
    """Copy the module's jars, skipping any library the server ships (a duplicate class is jar hell)."""
    shipped = {_artifact_name(jar) for jar in (home / "lib").glob("*.jar")}
    target = home / "modules" / module.name
    target.mkdir(parents=True)
    for jar in jar_dir.glob("*.jar"):
        if _artifact_name(jar) not in shipped:
            shutil.copy2(jar, target / jar.name)
    (target / "plugin-descriptor.properties").write_text(module.descriptor())
    if module.security_policy:
        (target / "plugin-security.policy").write_text(module.security_policy)


def _install_plugin(home: Path, plugin_zip: Path, java_home: Path) -> None:
    env = {**os.environ, "OPENSEARCH_JAVA_HOME": str(java_home), "OPENSEARCH_PATH_CONF": str(home / "config")}
    result = subprocess.run(
        [str(home / "bin" / "opensearch-plugin"), "install", "--batch", plugin_zip.resolve().as_uri()],
        env=env, capture_output=True, text=True,
    )
    if result.returncode != 0:
        raise OpenSearchSetupError(f"installing {plugin_zip.name} failed:\n{result.stdout}{result.stderr}")


@contextmanager
def _install_lock(root: Path) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def distribution_home() -> Path:
    return cache_root() / f"opensearch-{OPENSEARCH_VERSION}"


def _recipe() -> str:
    """What the assembled home contains; a cached home built from another recipe is rebuilt."""
    return json.dumps({
        "distribution": ":".join(_DISTRIBUTION),
        "plugins": [":".join(plugin) for plugin in _PLUGIN_ZIPS],
        "modules": [module.descriptor() for module in _JAR_MODULES],
    }, sort_keys=True)


def _is_assembled(home: Path) -> bool:
    marker = home / _READY_MARKER
    return marker.exists() and marker.read_text() == _recipe()


def ensure_distribution() -> Path:
    """Return the OpenSearch home with its plugins, fetching and assembling it only the first time.

    Assembly happens in a staging directory renamed into place at the end, under a file lock, so an
    interrupted or concurrent run never leaves a half-built home behind.
    """
    home = distribution_home()
    if _is_assembled(home):
        return home
    root = cache_root()
    with _install_lock(root):
        if _is_assembled(home):
            return home
        java_home = find_java_home()
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="staging-", dir=root) as staging_name:
            staging = Path(staging_name)
            _progress(f"fetching OpenSearch {OPENSEARCH_VERSION} and plugins from Maven Central")
            _maven_fetch(staging / "fetch")
            zips = _fetched(staging / "fetch", "zips")
            _progress("unpacking the distribution")
            _unzip(zips / f"opensearch-{OPENSEARCH_VERSION}.zip", staging)
            staged_home = staging / f"opensearch-{OPENSEARCH_VERSION}"
            for module in _JAR_MODULES:
                _install_jar_module(staged_home, module, _fetched(staging / "fetch", module.name))
            for group, artifact, version, packaging in _PLUGIN_ZIPS:
                _progress(f"installing plugin {artifact} {version}")
                _install_plugin(staged_home, zips / f"{artifact}-{version}.{packaging}", java_home)
            (staged_home / _READY_MARKER).write_text(_recipe())
            if home.exists():
                shutil.rmtree(home)
            staged_home.rename(home)
        _progress(f"ready at {home} ({time.monotonic() - started:.0f} s)")
    return home


# --- Run a node ------------------------------------------------------------------------------------


def _yaml_string(value: str | Path) -> str:
    return json.dumps(str(value))  # a JSON string is a valid YAML scalar, whatever the path holds


def _launch_prefix() -> list[str]:
    if os.geteuid() != 0:
        return []
    unshare = shutil.which("unshare")
    if unshare is None:
        raise OpenSearchSetupError("running as root needs 'unshare' (util-linux): OpenSearch refuses euid 0")
    return [unshare, "--user", f"--map-user={_NAMESPACE_UID}", f"--map-group={_NAMESPACE_UID}"]


class LocalOpenSearch(ServerContext):
    """One OpenSearch node bound to 127.0.0.1, owned by this process.

    ``data_dir`` holds the node's config, indices and logs and survives restarts. The JVM runs in its
    own process group, so stopping it never touches the caller's group.
    """

    def __init__(self, data_dir: str | Path, port: int | None = None, heap: str = "512m") -> None:
        self.data_dir = Path(data_dir).resolve()
        self.port = port
        self.heap = heap
        self._server = ServerProcess("OpenSearch", self.console_log, OpenSearchSetupError)

    @property
    def url(self) -> str:
        return self._server.http_url(self.port)

    @property
    def pid(self) -> int | None:
        return self._server.pid

    def is_running(self) -> bool:
        return self._server.is_running()

    @property
    def console_log(self) -> Path:
        return self.data_dir / "logs" / "console.log"

    def _write_config(self, home: Path, transport_port: int) -> Path:
        config_dir = self.data_dir / "config"
        shutil.copytree(home / "config", config_dir, dirs_exist_ok=True)
        (config_dir / "opensearch.yml").write_text(
            "\n".join([
                "cluster.name: cagflow-local",
                "node.name: cagflow-local",
                "discovery.type: single-node",
                "network.host: 127.0.0.1",
                f"http.port: {self.port}",
                f"transport.port: {transport_port}",
                f"path.data: {_yaml_string(self.data_dir / 'data')}",
                f"path.logs: {_yaml_string(self.data_dir / 'logs')}",
                "bootstrap.memory_lock: false",
                "cluster.routing.allocation.disk.threshold_enabled: false",
                "",
            ])
        )
        (config_dir / "jvm.options").write_text(self._jvm_options(home))
        (config_dir / "jvm.options.d" / "cagflow-heap.options").write_text(f"-Xms{self.heap}\n-Xmx{self.heap}\n")
        return config_dir

    def _jvm_options(self, home: Path) -> str:
        """The stock options with their paths made absolute: the launcher runs from the shared home."""
        logs = self.data_dir / "logs"
        return (
            (home / "config" / "jvm.options").read_text()
            .replace("-XX:HeapDumpPath=data", f"-XX:HeapDumpPath={self.data_dir / 'data'}")
            .replace("-XX:ErrorFile=logs/", f"-XX:ErrorFile={logs}/")
            .replace("file=logs/gc.log", f"file={logs}/gc.log")
        )

    def start(self, timeout_s: float = 120.0) -> str:
        """Start the node and return its URL once cluster health is yellow or green."""
        if self._server.launched:
            return self.url
        home = ensure_distribution()
        java_home = find_java_home()
        self.port = self.port or free_port()
        for name in ("data", "logs", "tmp"):
            (self.data_dir / name).mkdir(parents=True, exist_ok=True)
        config_dir = self._write_config(home, transport_port=free_port())
        env = {
            **os.environ,
            "OPENSEARCH_JAVA_HOME": str(java_home),
            "OPENSEARCH_PATH_CONF": str(config_dir),
            "OPENSEARCH_TMPDIR": str(self.data_dir / "tmp"),
        }
        env.pop("OPENSEARCH_JAVA_OPTS", None)
        self._server.launch([*_launch_prefix(), str(home / "bin" / "opensearch")], cwd=self.data_dir, env=env)
        self._server.wait_ready(self._is_healthy, timeout_s, interval_s=0.25, retry_on=(OSError, ValueError))
        return self.url

    def _is_healthy(self) -> bool:
        health_url = f"{self.url}/_cluster/health?wait_for_status=yellow&timeout=1s"
        with urllib.request.urlopen(health_url, timeout=3) as response:
            return json.load(response).get("status") in ("green", "yellow")

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the node's process group; SIGKILL it if it has not exited within ``timeout_s``."""
        self._server.stop(timeout_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cagflow.devstack.opensearch", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("fetch", help="fetch and assemble the distribution, then print its home")
    run = commands.add_parser("run", help="run a node in the foreground until interrupted")
    run.add_argument("--data-dir", required=True, type=Path)
    run.add_argument("--port", type=int)
    run.add_argument("--heap", default="512m")
    run.add_argument("--ready-file", type=Path, help="write the URL here once the node is ready")
    args = parser.parse_args(argv)
    if args.command == "fetch":
        print(ensure_distribution())
        return 0
    with LocalOpenSearch(args.data_dir, port=args.port, heap=args.heap) as node:
        serve_until_stopped(node.url, args.ready_file, node.is_running)
    return 0


if __name__ == "__main__":
    sys.exit(main())
