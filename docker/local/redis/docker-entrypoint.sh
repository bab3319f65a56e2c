#!/bin/sh
# As the official image does: options alone (`--appendonly yes`) are redis-server's; `redis-server [options]`
# starts from this image's configuration (docker.conf), unless a configuration file is named first; any other
# command runs as given.
set -eu
case "${1:-}" in
  -*) set -- redis-server "$@" ;;
esac
if [ "${1:-}" = redis-server ]; then
  shift
  case "${1:-}" in
    ""|-*) set -- redis-server /etc/redis/docker.conf "$@" ;;
    *) set -- redis-server "$@" ;;
  esac
fi
exec "$@"
