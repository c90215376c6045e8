#!/bin/sh
# Create the mesh's JetStream buckets replicated on all three nodes before the services start.
# The services create missing buckets themselves (get-or-create), but with one replica; made here
# first, they survive the loss of a NATS node. Settings mirror the code: keep them in step with
# shared/src/job.rs (JOB_BUCKET), shared/src/nats.rs (BLOB_BUCKET) and shared/src/cachestore.rs
# (CACHE_BUCKET). An existing bucket is left as it is, so re-running is harmless.
set -eu
: "${NATS_URL:=nats://nats:4222}"
: "${JS_REPLICAS:=3}"
export NATS_URL

# JetStream needs a meta leader before it accepts stream creation; wait for it.
i=0
until nats account info >/dev/null 2>&1; do
  i=$((i + 1))
  if [ "$i" -ge 60 ]; then
    echo "JetStream at $NATS_URL not ready after 60 s" >&2
    exit 1
  fi
  sleep 1
done

if nats kv info diffmesh-jobs >/dev/null 2>&1; then
  echo "kv diffmesh-jobs exists"
else
  nats kv add diffmesh-jobs --history=1 --ttl=168h --replicas="$JS_REPLICAS"
fi

# name and TTL ("" = keep forever) of each object store bucket.
add_object_store() {
  if nats object info "$1" >/dev/null 2>&1; then
    echo "object store $1 exists"
  else
    nats object add "$1" --replicas="$JS_REPLICAS" ${2:+--ttl="$2"}
  fi
}
add_object_store diffmesh-blobs 24h
add_object_store diffmesh-cache ""
echo "JetStream buckets ready (replicas=$JS_REPLICAS)"
