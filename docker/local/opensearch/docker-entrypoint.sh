#!/bin/bash
# As the official image does: every environment variable whose name looks like a setting (lower case with a
# dot, e.g. discovery.type) becomes `-E name=value`; OPENSEARCH_JAVA_OPTS reaches the JVM through bin/opensearch.
# The official image's DISABLE_SECURITY_PLUGIN and DISABLE_INSTALL_DEMO_CONFIG have nothing to turn off here:
# this distribution has no security plugin.
set -euo pipefail
settings=()
while IFS= read -r setting; do
  settings+=("-E$setting")
done < <(env | grep -E '^[a-z0-9_]+\.[a-z0-9_.]+=' || true)
exec opensearch "${settings[@]}" "$@"
