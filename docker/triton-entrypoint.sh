#!/bin/sh
# tritonserver in the foreground on every interface, with the backend directory and the stub environment
# the image assembled at build time (see Dockerfile). Extra arguments are passed on to tritonserver.
set -eu
export PATH="$(cat /opt/triton/stub-bin):$PATH"
export LD_LIBRARY_PATH="$(python -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$(cat /opt/triton/binary)" \
  --model-repository=/app/triton_models \
  --backend-directory=/opt/triton/backends \
  --allow-gpu-metrics=false --pinned-memory-pool-byte-size=0 --cuda-memory-pool-byte-size=0:0 \
  --http-port=8000 --grpc-port=8001 --metrics-port=8002 \
  --exit-timeout-secs=30 \
  "$@"
