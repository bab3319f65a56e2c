#!/bin/bash
# What the official postgres image does on its first start, for the variables docker-compose.yml sets: a cluster
# whose superuser is POSTGRES_USER with POSTGRES_PASSWORD, a database POSTGRES_DB, password logins over the
# network; then the server in the foreground on every interface.
set -euo pipefail
: "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}"
user=${POSTGRES_USER:-postgres}
database=${POSTGRES_DB:-$user}
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  password_file=$(mktemp)
  printf '%s' "$POSTGRES_PASSWORD" > "$password_file"
  initdb --pgdata="$PGDATA" --username="$user" --pwfile="$password_file" --encoding=UTF8 --locale=C.UTF-8 \
    --auth-local=trust --auth-host=scram-sha-256
  rm -f "$password_file"
  echo 'host all all all scram-sha-256' >> "$PGDATA/pg_hba.conf"
  if [ "$database" != postgres ]; then
    echo "CREATE DATABASE \"${database//\"/\"\"}\" OWNER \"${user//\"/\"\"}\";" \
      | postgres --single -D "$PGDATA" -j postgres > /dev/null
  fi
fi
exec postgres -D "$PGDATA" -c listen_addresses='*' "$@"
