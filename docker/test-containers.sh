#!/usr/bin/env bash
# `make test-containers`: the compose stack, really run. Builds the images that are missing
# (docker/build-local.sh, the project's image with the smallest model tier), starts docker-compose.yml with
# docker-compose.small.yml as project "cagflow-test" on free ports of 127.0.0.1, runs both DAGs in the Airflow
# containers, asks the demo questions through the router container, checks /readyz, /metrics and Prometheus'
# targets, prints the wall time and each container's memory, and removes the project's containers and volumes
# however it ends (set KEEP=1 to leave them running for a look; `docker compose -p cagflow-test down -v` then).
# Environment: CAGFLOW_MODEL (smollm2-135m), CAGFLOW_IMAGE (cagflow:$CAGFLOW_MODEL), DEMO_QUESTIONS (2 per
# language), PYTHON (.venv/bin/python), and build-local.sh's.
set -euo pipefail

cd "$(dirname "$0")/.."
STARTED=$SECONDS
PROJECT=cagflow-test
PYTHON=${PYTHON:-.venv/bin/python}
DEMO_QUESTIONS=${DEMO_QUESTIONS:-2}
export CAGFLOW_MODEL=${CAGFLOW_MODEL:-smollm2-135m}
export CAGFLOW_IMAGE=${CAGFLOW_IMAGE:-cagflow:$CAGFLOW_MODEL}

fail() { echo "test-containers.sh: FAILED: $*" >&2; exit 1; }
say() { printf '\n==> [%4d s] %s\n' $((SECONDS - STARTED)) "$*"; }

DOCKER_CONFIG=$(bash docker/static-tools.sh path docker-config)
export DOCKER_CONFIG
[ -x "$DOCKER_CONFIG/cli-plugins/docker-compose" ] || fail "docker compose is not built: run \`make tools\`"

say "images (docker/build-local.sh)"
bash docker/build-local.sh
BUILT=$((SECONDS - STARTED))

WORK=$(mktemp -d "${TMPDIR:-/tmp}/cagflow-test-containers.XXXXXX")
compose() {
  docker compose -p "$PROJECT" -f docker/docker-compose.yml -f docker/docker-compose.small.yml \
    --env-file "$WORK/env" "$@"
}
finish() {
  local status=$?
  if [ $status -ne 0 ] && [ -f "$WORK/env" ]; then
    echo "--- containers" >&2
    compose ps -a >&2 || true
    echo "--- the last log lines of each service" >&2
    compose logs --no-color --tail 25 >&2 || true
  fi
  if [ "${KEEP:-0}" = 1 ] && [ -f "$WORK/env" ]; then
    echo "KEEP=1: the stack keeps running; remove it with: DOCKER_CONFIG=$DOCKER_CONFIG docker compose -p $PROJECT" \
      "-f docker/docker-compose.yml -f docker/docker-compose.small.yml --env-file $WORK/env down -v" >&2
  else
    [ -f "$WORK/env" ] && compose down -v --remove-orphans --timeout 30 > /dev/null 2>&1 || true
    rm -rf "$WORK"
  fi
  echo "test-containers.sh: $([ $status -eq 0 ] && echo passed || echo failed) in $((SECONDS - STARTED)) s" >&2
  exit $status
}
trap finish EXIT
trap 'exit 130' INT TERM

# Fresh secrets and free ports for this run only. Compose mounts the passwords file as it is, so the Airflow
# containers' user (50000) must be able to read it; the env file stays the caller's.
read -r API_PORT AIRFLOW_PORT PROMETHEUS_PORT OPENSEARCH_PORT S3_PORT TRITON_HTTP_PORT TRITON_GRPC_PORT \
  TRITON_METRICS_PORT < <("$PYTHON" -c 'from cagflow.devstack.process import free_ports; print(*free_ports(8))')
AIRFLOW_PASSWORD=$(openssl rand -hex 12)
printf '{"admin": "%s"}\n' "$AIRFLOW_PASSWORD" > "$WORK/airflow-passwords.json"
chmod 0711 "$WORK" && chmod 0644 "$WORK/airflow-passwords.json"
(umask 077 && cat > "$WORK/env") <<EOF
S3_ACCESS_KEY=$(openssl rand -hex 10)
S3_SECRET_KEY=$(openssl rand -hex 20)
CAGFLOW_BUCKET=cagflow
AIRFLOW_DB_PASSWORD=$(openssl rand -hex 16)
AIRFLOW_JWT_SECRET=$(openssl rand -hex 24)
AIRFLOW_FERNET_KEY=$(openssl rand -base64 32 | tr '+/' '-_')
AIRFLOW_PASSWORDS_FILE=$WORK/airflow-passwords.json
CAGFLOW_IMAGE=$CAGFLOW_IMAGE
CAGFLOW_API_PORT=$API_PORT
AIRFLOW_PORT=$AIRFLOW_PORT
PROMETHEUS_PORT=$PROMETHEUS_PORT
OPENSEARCH_PORT=$OPENSEARCH_PORT
S3_PORT=$S3_PORT
TRITON_HTTP_PORT=$TRITON_HTTP_PORT
TRITON_GRPC_PORT=$TRITON_GRPC_PORT
TRITON_METRICS_PORT=$TRITON_METRICS_PORT
EOF
API=http://127.0.0.1:$API_PORT

say "docker compose up (project $PROJECT, API on $API, Airflow on http://127.0.0.1:$AIRFLOW_PORT)"
compose up -d --no-build --quiet-pull --wait --wait-timeout 900
UP=$((SECONDS - STARTED))
compose ps --format 'table {{.Service}}\t{{.Status}}'

# The Airflow CLI in the API server's container: it reads the metadata database directly.
airflow() { compose exec -T airflow-apiserver airflow "$@" 2> "$WORK/airflow.err"; }

# Run DAG once and wait for it, as `cagflow airflow trigger` does: unpause (it starts paused), trigger, poll.
# Unpausing also starts the run of the DAG's latest cron interval (catchup is off), and one run at a time is
# allowed: the run triggered here waits for that one, then finds the work done.
run_dag() {
  local dag=$1 run_id state deadline=$((SECONDS + 1200))
  run_id="test-containers-$(date +%s)"
  until airflow dags unpause "$dag" > /dev/null; do
    [ $SECONDS -lt $((deadline - 1080)) ] || fail "DAG $dag was not parsed in 2 min: $(tail -3 "$WORK/airflow.err")"
    sleep 5
  done
  airflow dags trigger "$dag" --run-id "$run_id" > /dev/null || fail "triggering $dag: $(tail -3 "$WORK/airflow.err")"
  while :; do
    # The JSON is the last line of the output; Airflow may print warnings before it.
    state=$(airflow dags list-runs "$dag" -o json | tail -1 | RUN_ID=$run_id python3 -c \
      'import json, os, sys; print(next((r["state"] for r in json.load(sys.stdin) if r["run_id"] == os.environ["RUN_ID"]), "none"))' \
      2> /dev/null) || state="unknown ($(tail -1 "$WORK/airflow.err"))"
    case $state in
      success) break ;;
      failed) airflow tasks states-for-dag-run "$dag" "$run_id" || true; fail "DAG run $dag $run_id failed" ;;
    esac
    [ $SECONDS -lt $deadline ] || fail "DAG run $dag $run_id still $state after 20 min"
    sleep 10
  done
  airflow dags list-runs "$dag" -o json | tail -1 | python3 -c '
import json, sys
for run in json.load(sys.stdin):
    print("  run %-40s %-8s %s to %s" % (run["run_id"], run["state"], (run["start_date"] or "")[11:19],
                                         (run["end_date"] or "")[11:19]))' || true
  airflow tasks states-for-dag-run "$dag" "$run_id" -o table | grep -v '^$' || true
}

say "DAG cag_variable_ingest (in the Airflow containers)"
run_dag cag_variable_ingest
say "DAG cag_fixed_precompute (in the Airflow containers; Triton precomputes and loads the release)"
run_dag cag_fixed_precompute
DAGS=$((SECONDS - STARTED))

say "waiting for the router to follow the new release: GET $API/readyz"
deadline=$((SECONDS + 180))
until [ "$(curl -s -o "$WORK/readyz" -w '%{http_code}' "$API/readyz")" = 200 ]; do
  [ $SECONDS -lt $deadline ] || fail "/readyz is not 200 after 3 min: $(cat "$WORK/readyz")"
  sleep 5
done
cat "$WORK/readyz"; echo

say "the demo questions through the router container ($DEMO_QUESTIONS per language)"
compose exec -T router cagflow keys init-local > /dev/null
compose exec -T router cagflow demo --questions "$DEMO_QUESTIONS" || fail "cagflow demo failed"
DEMO=$((SECONDS - STARTED))

say "GET $API/metrics"
curl -sf "$API/metrics" > "$WORK/metrics" || fail "/metrics did not answer"
grep -E '^cagflow_router_(answers_total|cache_hits_total|release_snapshots|ready) ?' "$WORK/metrics" | sed 's/^/  /' || true
echo "  $(grep -cE '^cagflow_' "$WORK/metrics" || true) cagflow_ series in all"
grep -qE '^cagflow_' "$WORK/metrics" || fail "/metrics has no cagflow_ metric"

say "Prometheus targets"
deadline=$((SECONDS + 60))
until curl -s "http://127.0.0.1:$PROMETHEUS_PORT/api/v1/targets" > "$WORK/targets" \
    && python3 - "$WORK/targets" <<'EOF'
import json, sys
targets = json.load(open(sys.argv[1]))["data"]["activeTargets"]
for target in targets:
    print(f"  {target['labels']['job']:<8} {target['scrapeUrl']:<32} {target['health']}")
sys.exit(0 if targets and all(target["health"] == "up" for target in targets) else 1)
EOF
do
  [ $SECONDS -lt $deadline ] || fail "a Prometheus target is not up"
  sleep 5
done

say "memory per container (docker stats)"
mapfile -t containers < <(compose ps -q)
docker stats --no-stream --format 'table {{.Name}}\t{{.MemUsage}}\t{{.CPUPerc}}' "${containers[@]}" | sed 's/^/  /'

printf '\nmake test-containers: images %d s, stack up %d s, DAGs %d s, demo %d s, total %d s\n' \
  "$BUILT" $((UP - BUILT)) $((DAGS - UP)) $((DEMO - DAGS)) $((SECONDS - STARTED))
