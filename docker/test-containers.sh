#!/usr/bin/env bash
# `make test-containers`: the compose stacks, really run. Builds the images that are missing
# (docker/build-local.sh, the project's image with the smallest model tier), then runs two stacks, one after the
# other, each as its own compose project on free ports of 127.0.0.1, and removes each one's containers and
# volumes however it ended (set KEEP=1 to leave them running for a look; the command that removes them is printed):
#   small  docker-compose.yml + docker-compose.small.yml (project cagflow-test): both DAGs in the Airflow
#          containers (LocalExecutor), the demo questions through the router container, /readyz, /metrics and
#          Prometheus' targets.
#   scale  + docker-compose.scale.yml + docker-compose.scale.small.yml (project cagflow-test-scale), the
#          scale-out profile: both DAGs on two Celery workers, one of them killed (docker kill) while it computes
#          a precompute part, the run completing on its retry and the release verified; the demo through nginx;
#          one API key on both routers; a burst over the rate limit answered 429 by both routers as one; one
#          Triton replica killed under load from 8 clients; the OpenSearch cluster green with two nodes.
# Each prints its steps' times and every container's memory (now and at its peak).
# Environment: SCALE (1: both stacks, the default; 0: the small stack only; only: the scale stack only),
# CAGFLOW_MODEL (smollm2-135m), CAGFLOW_IMAGE (cagflow:$CAGFLOW_MODEL), DEMO_QUESTIONS (2 per language),
# LOAD_CLIENTS (8) and LOAD_SECONDS (60) of the scale stack's load, PYTHON (.venv/bin/python), KEEP, and
# build-local.sh's.
set -euo pipefail

SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$0")/.."
STARTED=$SECONDS
PYTHON=${PYTHON:-.venv/bin/python}
DEMO_QUESTIONS=${DEMO_QUESTIONS:-2}
LOAD_CLIENTS=${LOAD_CLIENTS:-8}
LOAD_SECONDS=${LOAD_SECONDS:-120}
export CAGFLOW_MODEL=${CAGFLOW_MODEL:-smollm2-135m}
export CAGFLOW_IMAGE=${CAGFLOW_IMAGE:-cagflow:$CAGFLOW_MODEL}

fail() { echo "test-containers.sh${STACK:+ ($STACK)}: FAILED: $*" >&2; exit 1; }
say() { printf '\n==> [%4d s]%s %s\n' $((SECONDS - STARTED)) "${STACK:+ $STACK:}" "$*"; }

DOCKER_CONFIG=$(bash docker/static-tools.sh path docker-config)
export DOCKER_CONFIG
[ -x "$DOCKER_CONFIG/cli-plugins/docker-compose" ] || fail "docker compose is not built: run \`make tools\`"

# Without STACK: build the images once, then run each stack in a process of its own (its own trap and clean-up).
if [ -z "${STACK:-}" ]; then
  case ${SCALE:-1} in
    0) stacks=(small) ;;
    1) stacks=(small scale) ;;
    only) stacks=(scale) ;;
    *) fail "SCALE must be 1 (both stacks), 0 (the small one) or only (the scale-out one), not '$SCALE'" ;;
  esac
  say "images (docker/build-local.sh)"
  bash docker/build-local.sh
  BUILT=$((SECONDS - STARTED))
  status=0 results=()
  for stack in "${stacks[@]}"; do
    begun=$SECONDS
    if STACK=$stack bash "$SELF"; then
      results+=("$(printf '%-6s passed in %d s' "$stack" $((SECONDS - begun)))")
    else
      status=1 results+=("$(printf '%-6s FAILED after %d s' "$stack" $((SECONDS - begun)))")
    fi
  done
  printf '\nmake test-containers: images %d s\n' "$BUILT"
  printf '  %s\n' "${results[@]}"
  printf 'total %d s\n' $((SECONDS - STARTED))
  exit $status
fi

# AIRFLOW_CLI: the container whose Airflow command line reads the metadata database directly. In the scale
# stack, a worker (idle then) rather than the API server, whose small memory limit leaves no room for a second
# Airflow process.
case $STACK in
  small) PROJECT=cagflow-test AIRFLOW_CLI=airflow-apiserver
         FILES=(docker/docker-compose.yml docker/docker-compose.small.yml) ;;
  scale) PROJECT=cagflow-test-scale AIRFLOW_CLI=airflow-worker-1
         FILES=(docker/docker-compose.yml docker/docker-compose.small.yml
                docker/docker-compose.scale.yml docker/docker-compose.scale.small.yml) ;;
  *) fail "STACK must be small or scale, not '$STACK'" ;;
esac
COMPOSE_FILES=()
for file in "${FILES[@]}"; do COMPOSE_FILES+=(-f "$file"); done

WORK=$(mktemp -d "${TMPDIR:-/tmp}/cagflow-test-containers.XXXXXX")
compose() { docker compose -p "$PROJECT" "${COMPOSE_FILES[@]}" --env-file "$WORK/env" "$@"; }
finish() {
  local status=$?
  jobs -p | xargs -r kill 2> /dev/null || true  # a load generator still running in the background
  if [ $status -ne 0 ] && [ -f "$WORK/env" ]; then
    echo "--- containers" >&2
    compose ps -a >&2 || true
    echo "--- the last log lines of each service" >&2
    compose logs --no-color --tail 25 >&2 || true
  fi
  if [ "${KEEP:-0}" = 1 ] && [ -f "$WORK/env" ]; then
    echo "KEEP=1: the stack keeps running; remove it with: DOCKER_CONFIG=$DOCKER_CONFIG docker compose -p $PROJECT" \
      "${COMPOSE_FILES[*]} --env-file $WORK/env down -v" >&2
  else
    [ -f "$WORK/env" ] && compose down -v --remove-orphans --timeout 30 > /dev/null 2>&1 || true
    rm -rf "$WORK"
  fi
  echo "test-containers.sh ($STACK): $([ $status -eq 0 ] && echo passed || echo failed) in $((SECONDS - STARTED)) s" >&2
  exit $status
}
trap finish EXIT
trap 'exit 130' INT TERM

# Fresh secrets and free ports for this run only. Compose mounts the passwords file as it is, so the Airflow
# containers' user (50000) must be able to read it; the env file stays the caller's.
read -r API_PORT AIRFLOW_PORT PROMETHEUS_PORT OPENSEARCH_PORT S3_PORT TRITON_HTTP_PORT TRITON_GRPC_PORT \
  TRITON_METRICS_PORT ROUTER_PORT ROUTER_2_PORT \
  < <("$PYTHON" -c 'from cagflow.devstack.process import free_ports; print(*free_ports(10))')
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
CAGFLOW_ROUTER_PORT=$ROUTER_PORT
CAGFLOW_ROUTER_2_PORT=$ROUTER_2_PORT
AIRFLOW_PORT=$AIRFLOW_PORT
PROMETHEUS_PORT=$PROMETHEUS_PORT
OPENSEARCH_PORT=$OPENSEARCH_PORT
S3_PORT=$S3_PORT
TRITON_HTTP_PORT=$TRITON_HTTP_PORT
TRITON_GRPC_PORT=$TRITON_GRPC_PORT
TRITON_METRICS_PORT=$TRITON_METRICS_PORT
EOF
API=http://127.0.0.1:$API_PORT
OPENSEARCH=http://127.0.0.1:$OPENSEARCH_PORT

say "docker compose up (project $PROJECT, API on $API, Airflow on http://127.0.0.1:$AIRFLOW_PORT)"
compose up -d --no-build --quiet-pull --wait --wait-timeout 900
UP=$((SECONDS - STARTED))
compose ps --format 'table {{.Service}}\t{{.Status}}'

# The Airflow CLI in an Airflow container: it reads the metadata database directly.
airflow() { compose exec -T "$AIRFLOW_CLI" airflow "$@" 2> "$WORK/airflow.err"; }
# A query of the metadata database (psql in its container: no Python started), rows as a|b|c.
sql() { compose exec -T postgres psql -U airflow -d airflow -At -F '|' -c "$1"; }

# Unpause DAG (it starts paused) and trigger a run of it; prints the run's id. Unpausing also starts the run of
# the DAG's latest cron interval (catchup is off), and one run at a time is allowed: the run triggered here
# waits for that one, then finds the work done.
start_dag() {
  local dag=$1 run_id deadline=$((SECONDS + 120))
  run_id="test-containers-$(date +%s)"
  until airflow dags unpause "$dag" > /dev/null; do
    [ $SECONDS -lt $deadline ] || fail "DAG $dag was not parsed in 2 min: $(tail -3 "$WORK/airflow.err")"
    sleep 5
  done
  airflow dags trigger "$dag" --run-id "$run_id" > /dev/null || fail "triggering $dag: $(tail -3 "$WORK/airflow.err")"
  echo "$run_id"
}

# Run DAG once and wait for it, as `cagflow airflow trigger` does: unpause, trigger, poll.
run_dag() {
  local dag=$1 run_id state deadline=$((SECONDS + 1200))
  run_id=$(start_dag "$dag")
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

# Wait until GET URL answers 200 (at most SECONDS s); the last body in $WORK/ready.
wait_ready() {
  local url=$1 seconds=$2 deadline=$((SECONDS + $2))
  until [ "$(curl -s -o "$WORK/ready" -w '%{http_code}' "$url")" = 200 ]; do
    [ $SECONDS -lt $deadline ] || fail "$url is not 200 after $seconds s: $(cat "$WORK/ready")"
    sleep 5
  done
}

check_prometheus_targets() {
  local deadline=$((SECONDS + $1))
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
}

# Memory now (docker stats) and at its peak (the cgroup's high-water mark, page cache included), per container.
memory_report() {
  local containers id name peak
  mapfile -t containers < <(compose ps -q)
  docker stats --no-stream --format 'table {{.Name}}\t{{.MemUsage}}\t{{.CPUPerc}}' "${containers[@]}" | sed 's/^/  /'
  echo "  peak memory per container (cgroup high-water mark, page cache included):"
  for id in "${containers[@]}"; do
    id=$(docker inspect -f '{{.Id}}' "$id") name=$(docker inspect -f '{{.Name}}' "$id")
    peak=""
    for file in "/sys/fs/cgroup/memory/docker/$id/memory.max_usage_in_bytes" \
                "/sys/fs/cgroup/system.slice/docker-$id.scope/memory.peak" "/sys/fs/cgroup/docker/$id/memory.peak"; do
      [ -r "$file" ] && peak=$(cat "$file") && break
    done
    [ -n "$peak" ] && printf '    %-40s %6d MiB\n' "${name#/}" $((peak / 1048576))
  done
  return 0
}

if [ "$STACK" = small ]; then
  say "DAG cag_variable_ingest (in the Airflow containers)"
  run_dag cag_variable_ingest
  say "DAG cag_fixed_precompute (in the Airflow containers; Triton precomputes and loads the release)"
  run_dag cag_fixed_precompute
  DAGS=$((SECONDS - STARTED))

  say "waiting for the router to follow the new release: GET $API/readyz"
  wait_ready "$API/readyz" 180
  cat "$WORK/ready"; echo

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
  check_prometheus_targets 60

  say "memory per container"
  memory_report
  printf '\nsmall stack: stack up %d s, DAGs %d s, demo %d s, total %d s\n' \
    "$UP" $((DAGS - UP)) $((DEMO - DAGS)) $((SECONDS - STARTED))
  exit 0
fi

# ------------------------------------------------------------------------------------------------------------------
# The scale-out profile.
ROUTER=http://127.0.0.1:$ROUTER_PORT ROUTER_2=http://127.0.0.1:$ROUTER_2_PORT

say "both Celery workers ready, OpenSearch with two nodes"
for worker in airflow-worker-1 airflow-worker-2; do
  deadline=$((SECONDS + 180))
  until compose logs --no-color "$worker" 2>&1 | grep -q "celery@$worker ready"; do
    [ $SECONDS -lt $deadline ] || fail "$worker did not report ready to Celery in 3 min"
    sleep 5
  done
  echo "  celery@$worker ready"
done
deadline=$((SECONDS + 180))
until [ "$(curl -s "$OPENSEARCH/_cluster/health" | python3 -c 'import json, sys; print(json.load(sys.stdin)["number_of_nodes"])' 2> /dev/null)" = 2 ]; do
  [ $SECONDS -lt $deadline ] || fail "OpenSearch has not two nodes after 3 min: $(curl -s "$OPENSEARCH/_cluster/health")"
  sleep 5
done
curl -s "$OPENSEARCH/_cat/nodes?h=name,node.role,cluster_manager,heap.max" | sed 's/^/  /'
READY=$((SECONDS - STARTED))

# Wait for every run of DAG (the triggered one and the cron interval's) to succeed, polling the metadata
# database every 3 s; HOOK, when given, is called at each poll with the DAG's id.
run_dag_scale() {
  local dag=$1 hook=${2:-} run_id counts deadline=$((SECONDS + 1500))
  run_id=$(start_dag "$dag")
  while :; do
    counts=$(sql "select count(*) filter (where state = 'failed'), count(*) filter (where state <> 'success'),
                         count(*) filter (where run_id = '$run_id') from dag_run where dag_id = '$dag'") || counts=""
    case $counts in
      "") ;;  # the database did not answer this time
      0\|0\|1) break ;;
      0\|*) ;;
      *) sql "select task_id, map_index, try_number, state, hostname from task_instance where dag_id = '$dag'
              order by start_date" | sed 's/^/  /'
         fail "a run of $dag failed" ;;
    esac
    [ $SECONDS -lt $deadline ] || fail "the runs of $dag are not done after 25 min ($counts)"
    [ -z "$hook" ] || "$hook" "$dag"
    sleep 3
  done
  sql "select run_id, state, to_char(start_date, 'HH24:MI:SS'), to_char(end_date, 'HH24:MI:SS') from dag_run
       where dag_id = '$dag' order by start_date" | awk -F'|' '{printf "  run %-44s %-8s %s to %s\n", $1, $2, $3, $4}'
  sql "select task_id, count(*), string_agg(distinct state, ','), string_agg(distinct hostname, ',')
       from task_instance where dag_id = '$dag' group by task_id order by min(start_date)" \
    | awk -F'|' '{printf "  %-26s x%-3s %-10s on %s\n", $1, $2, $3, $4}'
}

KILLED="" KILLED_PART="" KILL_AT=0 RESTARTED=""
# Kill (docker kill) a worker while it computes a precompute part that has run for 8 s at least, airflow-worker-2's
# if it has one; 10 s later, start it again unless its restart policy did.
kill_a_worker_mid_precompute() {
  local dag=$1 row map label try container
  if [ -z "$KILLED" ]; then
    row=$(sql "select hostname, map_index, coalesce(rendered_map_index, ''), try_number from task_instance
               where dag_id = '$dag' and task_id = 'precompute' and state = 'running' and hostname like 'airflow-worker-%'
               and start_date < now() - interval '8 seconds' order by hostname desc, start_date limit 1") || return 0
    [ -n "$row" ] || return 0
    IFS='|' read -r KILLED map label try <<< "$row"
    KILLED_PART="part $map ($label), try $try"
    KILL_AT=$SECONDS
    say "docker kill $KILLED, in the middle of precompute $KILLED_PART"
    docker kill "$(compose ps -q "$KILLED")" > /dev/null
  elif [ -z "$RESTARTED" ] && [ $((SECONDS - KILL_AT)) -ge 10 ]; then
    container=$(compose ps -aq "$KILLED")
    if [ "$(docker inspect -f '{{.State.Running}}' "$container")" = true ]; then
      RESTARTED="by its restart policy (restarts: $(docker inspect -f '{{.RestartCount}}' "$container"))"
    else
      compose start "$KILLED" > /dev/null
      RESTARTED="by this script (compose start; Docker does not restart a container killed by hand)"
    fi
    echo "  $KILLED restarted $RESTARTED"
  fi
}

say "DAG cag_variable_ingest (Celery workers)"
run_dag_scale cag_variable_ingest
INGESTED=$((SECONDS - STARTED))

say "DAG cag_fixed_precompute (Celery workers, two parts at once; one worker killed mid-part)"
run_dag_scale cag_fixed_precompute kill_a_worker_mid_precompute
[ -n "$KILLED" ] || fail "no precompute part ran for 8 s on a worker: nothing was killed"
echo "  killed $KILLED during precompute $KILLED_PART; restarted $RESTARTED"
echo "  every try of every part (history first), in start order:"
sql "select run_id, map_index, coalesce(rendered_map_index, ''), try_number, state, hostname,
            coalesce(round(extract(epoch from end_date - start_date))::text, '-')
     from (select run_id, map_index, rendered_map_index, try_number, state, hostname, start_date, end_date
           from task_instance_history where dag_id = 'cag_fixed_precompute' and task_id = 'precompute'
           union all
           select run_id, map_index, rendered_map_index, try_number, state, hostname, start_date, end_date
           from task_instance where dag_id = 'cag_fixed_precompute' and task_id = 'precompute' and state is not null) t
     order by start_date" > "$WORK/parts"
awk -F'|' '{printf "    %-26s part %-3s %-28s try %s  %-14s %-17s %s s\n", substr($1, 1, 26), $2, $3, $4, $5, $6, $7}' "$WORK/parts"
hosts=$(awk -F'|' '$5 == "success" {print $6}' "$WORK/parts" | sort | uniq -c | xargs)
all_hosts=$(awk -F'|' '{print $6}' "$WORK/parts" | sort -u | xargs)
echo "  parts that succeeded, per worker: $hosts; workers that ran parts: $all_hosts"
[ "$all_hosts" = "airflow-worker-1 airflow-worker-2" ] || fail "the parts did not run on both workers ($all_hosts)"
awk -F'|' -v host="$KILLED" '$6 == host && $5 != "success" {found = 1} END {exit !found}' "$WORK/parts" \
  || fail "no failed try of a part on the killed $KILLED"
DAGS=$((SECONDS - STARTED))

say "the active release, verified: every snapshot re-read against its sha256 and header, every fixed document in it"
compose run --rm --no-deps -T create-bucket python - <<'EOF' || fail "the release does not verify"
import sys
from cagflow.config import load_config
from cagflow.offline.validation import validate_snapshots
from cagflow.store.backends import open_store
from cagflow.store.manifests import CorpusManifest, load_release

# What the maintenance DAG's verify_active_release does, with the configured store's read-only role.
config = load_config()
store = open_store(config.cache.state_store, config.cache.s3, role="reader")
release = load_release(store)
validate_snapshots(store, release.snapshots, [entry.key for entry in release.snapshots])
fixed = {entry.doc_id for entry in CorpusManifest.load(config.corpus.manifest).tier("fixed")}
missing = sorted(fixed - set(release.doc_ids))
verified = {"release_id": release.release_id, "snapshots": len(release.snapshots),
            "bytes": sum(entry.bytes for entry in release.snapshots)}
print(f"  release {verified['release_id']}: {verified['snapshots']} snapshots, {verified['bytes']} bytes, "
      f"{len(release.doc_ids)} of {len(fixed)} fixed documents" + (f"; missing {missing}" if missing else ""))
sys.exit(1 if missing or not verified["snapshots"] else 0)
EOF
parts=$(awk -F'|' '$5 == "success"' "$WORK/parts" | wc -l)
echo "  $parts precompute parts succeeded"

say "the routers follow the release: GET /readyz through nginx and on each router"
wait_ready "$API/readyz" 180
for url in "$ROUTER" "$ROUTER_2"; do
  wait_ready "$url/readyz" 120
  python3 - "$url" "$WORK/ready" <<'EOF' || fail "$url/readyz: not both Triton replicas ready, or the shared rate limit store failing"
import json, sys
report = json.load(open(sys.argv[2]))
replicas = report["triton"]["replicas"]
limits = report.get("rate_limit") or {}
print(f"  {sys.argv[1]}/readyz: ready {report['ready']}, replicas "
      + ", ".join(f"{r['name']} {'ready' if r['ready'] else 'DOWN'} ({r.get('resident_snapshots')} resident)" for r in replicas)
      + f"; rate limit {json.dumps(limits)}")
sys.exit(0 if sorted(r["name"] for r in replicas if r["ready"]) == ["triton", "triton-2"] and "error" not in limits else 1)
EOF
done

say "API keys: made in a one-off container on the routers' shared keys volume"
# The clients below (keys, demo, load) run in one-off containers of the router's image, each with a memory limit of
# its own, never in a router's container; HOST and PORT point their `cagflow` commands at nginx.
client() { compose run --rm --no-deps -T -e CAGFLOW__SERVICE__HOST=nginx -e CAGFLOW__SERVICE__PORT=8080 "$@"; }
client router sh -c 'for name in scale-test scale-burst scale-shared scale-load; do cagflow keys create --name $name; done' \
  2> /dev/null > "$WORK/keys" || fail "cagflow keys create failed"
{ read -r KEY; read -r BURST_KEY; read -r SHARED_KEY; read -r LOAD_KEY; } < "$WORK/keys"
[ -n "$LOAD_KEY" ] || fail "four keys were not printed"
for url in "$API" "$ROUTER" "$ROUTER_2"; do
  status=$(curl -s -o "$WORK/releases" -w '%{http_code}' -H "Authorization: Bearer $KEY" "$url/v1/releases")
  echo "  GET $url/v1/releases with the key: $status"
  [ "$status" = 200 ] || fail "the key is refused by $url: $(cat "$WORK/releases")"
done
for url in "$ROUTER" "$ROUTER_2"; do
  status=$(curl -s -o "$WORK/answer" -w '%{http_code}' -H "Authorization: Bearer $KEY" -H 'Content-Type: application/json' \
    -d '{"question": "Which port does the web console use?", "max_new_tokens": 24}' "$url/v1/query")
  echo "  POST $url/v1/query: $status $(head -c 200 "$WORK/answer")"
  [ "$status" = 200 ] || fail "$url did not answer with the key"
done

say "the demo questions through nginx ($API, $DEMO_QUESTIONS per language), from a client container"
client -e CAGFLOW_API_KEY="$KEY" router cagflow demo --questions "$DEMO_QUESTIONS" || fail "cagflow demo through nginx failed"
DEMO=$((SECONDS - STARTED))

say "rate limits shared by the routers (Redis)"
# burst: 60 requests of one key through nginx, 12 at a time; then a key's bucket emptied on router and tried on
# router-2 at once. Each router alone would let its own burst through (2 x 20 across the two).
python3 - "$API" "$ROUTER" "$ROUTER_2" "$BURST_KEY" "$SHARED_KEY" <<'EOF' || fail "the rate limit is not shared or not answered as JSON 429"
import collections, concurrent.futures, json, sys, time, urllib.error, urllib.request

api, router, router_2, burst_key, shared_key = sys.argv[1:]
RATE, BURST = 5.0, 20  # service.rate_limit_per_s and rate_limit_burst (defaults)

def get(url, key):
    request = urllib.request.Request(url + "/v1/releases", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.headers.get("X-CAGFlow-Upstream"), None
    except urllib.error.HTTPError as error:
        try:
            code = json.loads(error.read())["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = "not_json"
        return error.code, error.headers.get("X-CAGFlow-Upstream"), (code, error.headers.get("Retry-After"))

def burst(url, key, count, workers):
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(lambda _: get(url, key), range(count)))
    return results, time.monotonic() - started

ok = True
results, elapsed = burst(api, burst_key, 60, 12)
statuses = collections.Counter(status for status, _, _ in results)
refusals = collections.Counter(detail for status, _, detail in results if status != 200)
upstreams = collections.Counter((upstream, status) for upstream, status in ((u, s) for s, u, _ in results))
allowed = BURST + RATE * elapsed + 2
print(f"  through nginx: 60 requests in {elapsed:.1f} s: {dict(statuses)}; refusals (code, Retry-After): "
      f"{dict(refusals)}; at most {allowed:.0f} may pass with one shared bucket")
print("  per router (address, status): " + ", ".join(f"{u} {s}: {n}" for (u, s), n in sorted(upstreams.items())))
if set(statuses) - {200, 429} or any(code != "rate_limited" or not retry for code, retry in refusals):
    print("  a refusal is not the API's JSON 429 rate_limited with Retry-After"); ok = False
if statuses[200] > allowed or not statuses[429]:
    print("  more passed than one bucket allows: the routers do not share it"); ok = False
if len({u for (u, s) in upstreams if s == 429}) < 2:
    print("  not both routers answered 429"); ok = False

drained, _ = burst(router, shared_key, 30, 10)
started = time.monotonic()
after, _ = burst(router_2, shared_key, 5, 5)
passed = sum(status == 200 for status, _, _ in after)
print(f"  bucket emptied on router ({sum(s == 200 for s, _, _ in drained)} of 30 passed), then on router-2 within "
      f"{time.monotonic() - started:.2f} s: {passed} of 5 passed")
if passed > 2:
    print("  router-2 has a bucket of its own"); ok = False
sys.exit(0 if ok else 1)
EOF

replica_state() {  # the routers' view of triton-2: /readyz's ready flag and cagflow_router_triton_replica_up
  local url
  for url in "$ROUTER" "$ROUTER_2"; do
    printf '%s readyz %s up %s; ' "${url##*:}" \
      "$(curl -s "$url/readyz" | python3 -c 'import json, sys; print(next((r["ready"] for r in json.load(sys.stdin)["triton"]["replicas"] if r["name"] == "triton-2"), "absent"))' 2> /dev/null)" \
      "$(curl -s "$url/metrics" | grep -E '^cagflow_router_triton_replica_up\{.*replica="triton-2"' | awk '{print $2}')"
  done
}

say "Triton replica triton-2 killed under load: $LOAD_CLIENTS clients for $LOAD_SECONDS s through nginx (cagflow bench load)"
client -e CAGFLOW_API_KEY="$LOAD_KEY" router cagflow bench load --clients "$LOAD_CLIENTS" --duration "$LOAD_SECONDS" \
  --max-new-tokens 24 > "$WORK/load.log" 2>&1 &
LOAD_PID=$!
deadline=$((SECONDS + 60))
until grep -q '^burst:' "$WORK/load.log"; do
  [ $SECONDS -lt $deadline ] && kill -0 $LOAD_PID 2> /dev/null || { cat "$WORK/load.log"; fail "the load did not start"; }
  sleep 1
done
sleep 10
echo "  before: $(replica_state)"
docker kill "$(compose ps -q triton-2)" > /dev/null
KILLED_TRITON_AT=$SECONDS
echo "  docker kill triton-2"
deadline=$((SECONDS + 30)) seen_down=""
while [ $SECONDS -lt $deadline ]; do
  state=$(replica_state)
  if [ "$(grep -o 'readyz False up 0' <<< "$state" | wc -l)" = 2 ]; then seen_down=$state; break; fi
  sleep 2
done
[ -n "$seen_down" ] || fail "the routers did not mark triton-2 down within 30 s: $(replica_state)"
echo "  after $((SECONDS - KILLED_TRITON_AT)) s: $seen_down"
sleep 5
container=$(compose ps -aq triton-2)
if [ "$(docker inspect -f '{{.State.Running}}' "$container")" = true ]; then
  echo "  triton-2 restarted by its restart policy"
else
  compose start triton-2 > /dev/null
  echo "  triton-2 started again by this script (compose start)"
fi
status=0
wait $LOAD_PID || status=$?
sed -n '/^burst:/,$p' "$WORK/load.log" | sed 's/^/  | /'
[ $status -eq 0 ] || fail "requests failed in an unintended way while triton-2 was down (bench load exit $status)"
deadline=$((SECONDS + 300))
until [ "$(grep -o 'readyz True up 1' <<< "$(replica_state)" | wc -l)" = 2 ]; do
  [ $SECONDS -lt $deadline ] || fail "triton-2 is not back in both routers after 5 min: $(replica_state)"
  sleep 5
done
echo "  back after $((SECONDS - KILLED_TRITON_AT)) s: $(replica_state)"
for url in "$ROUTER" "$ROUTER_2"; do
  echo "  ${url##*:} failovers: $(curl -s "$url/metrics" | grep -E '^cagflow_router_triton_failovers_total' | awk '{printf "%s %s; ", $1, $2}')"
done
LOADED=$((SECONDS - STARTED))

say "GET $API/metrics (through nginx), and Prometheus' four targets"
curl -sf "$API/metrics" > "$WORK/metrics" || fail "/metrics did not answer through nginx"
echo "  $(grep -cE '^cagflow_' "$WORK/metrics" || true) cagflow_ series"
grep -qE '^cagflow_' "$WORK/metrics" || fail "/metrics has no cagflow_ metric"
check_prometheus_targets 120

say "OpenSearch: green with two nodes, one replica of every shard of CAGFlow's index"
curl -s "$OPENSEARCH/_cluster/health?wait_for_status=green&timeout=60s" > "$WORK/health"
python3 - "$WORK/health" <<'EOF' || fail "the OpenSearch cluster is not green with two nodes"
import json, sys
health = json.load(open(sys.argv[1]))
print("  " + ", ".join(f"{key} {health[key]}" for key in ("status", "number_of_nodes", "active_primary_shards",
                                                          "active_shards", "unassigned_shards")))
sys.exit(0 if health["status"] == "green" and health["number_of_nodes"] == 2 else 1)
EOF
curl -s "$OPENSEARCH/_cat/shards/cagflow-*?h=index,shard,prirep,state,docs,node" | sed 's/^/  /'
[ "$(curl -s "$OPENSEARCH/_cat/shards/cagflow-*?h=prirep,state,node" | awk '$2 == "STARTED" {print $1, $3}' | sort -u | wc -l)" -ge 2 ] \
  || fail "CAGFlow's index has no started replica on the second node"

say "memory per container"
memory_report
printf '\nscale stack: stack up %d s, workers and OpenSearch %d s, ingest DAG %d s, precompute DAG with a worker killed %d s,' \
  "$UP" $((READY - UP)) $((INGESTED - READY)) $((DAGS - INGESTED))
printf ' checks and demo %d s, rate limits, load and Triton failover %d s, total %d s\n' \
  $((DEMO - DAGS)) $((LOADED - DEMO)) $((SECONDS - STARTED))
