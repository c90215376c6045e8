#!/bin/sh
# Create the mesh's JetStream buckets replicated on all three nodes before the services start.
# The services create missing buckets themselves (get-or-create), but with one replica; made here
# first, they survive the loss of a NATS node. Settings mirror the code: keep them in step with
# shared/src/job.rs (JOB_BUCKET, IDEMPOTENCY_BUCKET), shared/src/nats.rs (BLOB_BUCKET),
# shared/src/cachestore.rs (CACHE_BUCKET), shared/src/templates.rs (TEMPLATE_BUCKET) and
# services/gateway/src/templates/uses.rs (TEMPLATE_USES_STREAM). An existing bucket is left as
# it is, so re-running is harmless.
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

# name and TTL ("" = keep forever) of each KV bucket.
add_kv() {
  if nats kv info "$1" >/dev/null 2>&1; then
    echo "kv $1 exists"
  else
    nats kv add "$1" --history=1 --replicas="$JS_REPLICAS" ${2:+--ttl="$2"}
  fi
}
add_kv diffmesh-jobs 168h
add_kv diffmesh-idempotency 24h
add_kv diffmesh-templates ""

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
add_object_store diffmesh-templates ""

# Edits by template in flight (one message per edit, kept at most a day).
if nats stream info DIFFMESH_TEMPLATE_USES >/dev/null 2>&1; then
  echo "stream DIFFMESH_TEMPLATE_USES exists"
else
  nats stream add DIFFMESH_TEMPLATE_USES --subjects="diffmesh.template-uses.>" \
    --storage=file --retention=limits --discard=old --replicas="$JS_REPLICAS" \
    --max-msgs-per-subject=1 --max-age=24h --max-msgs=-1 --max-bytes=-1 \
    --max-msg-size=-1 --max-consumers=-1 --dupe-window=2m \
    --no-allow-rollup --no-deny-delete --no-deny-purge
fi
echo "JetStream buckets ready (replicas=$JS_REPLICAS)"
