//! Every JetStream bucket and stream of the mesh, in one table.
//!
//! Services open what they use from these specs (get, or create with one replica when missing),
//! and each service first ensures the specs its role opens ([`context`], `Role::layout_specs`)
//! with the deployment's replica count (`JS_REPLICAS`): on a NATS cluster every bucket then
//! exists with that many replicas whichever of its users starts first, and a bucket made
//! earlier with fewer is scaled up. No second copy of the settings (a CLI script) can drift
//! from the code.
//!
//! Every stream is bounded in bytes too: the deployment gives one storage budget
//! (`JS_MAX_BYTES`) and each spec takes its fixed share of it ([`Spec::max_bytes`]). When
//! a stream is full, one of job records, idempotency keys or job blobs drops its oldest entries
//! (under traffic that fills it, they are kept for less than their age limit); every other
//! refuses new writes, and the request that wrote answers an error (507 at the gateway),
//! rather than losing a template, a LoRA or a cache something still reads. `storage_usage` exports how full each one is. The server reserves each stream's
//! bound against its own `max_file_store` (per node, each replica): the budget must fit in it.
use std::borrow::Cow;
use std::time::Duration;

use async_nats::jetstream::{self, kv, stream};

use crate::error::MeshError;
use crate::nats::auth::Role;
use crate::wire::cachestore::CACHE_BUCKET;
use crate::wire::subjects::{
    BLOB_BUCKET, IDEMPOTENCY_BUCKET, JOB_BUCKET, LORA_BUCKET, TEMPLATES_CAPTURED, TEMPLATE_BUCKET,
    TEMPLATE_CAPTURES_STREAM, TEMPLATE_USES_PREFIX, TEMPLATE_USES_STREAM,
};

/// What a spec is stored as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// A key-value bucket (stream `KV_<name>`, one message per key). Reads go to the stream's
    /// leader (no direct gets): on a cluster a follower answering a direct get can lag, and
    /// every bucket here has a reader that must see writes acknowledged before it (a job's
    /// state must not go back, an idempotency key found taken must be readable, a template's
    /// `deleting` mark must stop the edits checked after it).
    Kv,
    /// An object store bucket (stream `OBJ_<name>`). Its object infos are read from the
    /// leader too: a service reads objects another just wrote (a capture's cache, handed to
    /// the cachestore by key), and a lagging follower answered "not found" (a template
    /// registration failed so on a three-node cluster).
    Objects,
    /// A plain stream over `<subject_prefix>.>`, keeping the last message per subject.
    LastPerSubject { subject_prefix: &'static str },
}

/// One bucket or stream of the mesh.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spec {
    pub name: Cow<'static, str>,
    pub layout: Layout,
    /// Entries older than this are dropped by the server (zero: kept until deleted).
    pub max_age: Duration,
    /// Its bound in bytes, in thousandths of the storage budget (`JS_MAX_BYTES`).
    pub share_per_mille: u32,
    /// When full, drop the oldest entries (true) or refuse new ones (false).
    pub discard_old: bool,
}

/// The smallest bound a stream gets: room for a few of its largest messages.
const MIN_STREAM_BYTES: u64 = 8 * 1024 * 1024;

const DAY: Duration = Duration::from_secs(24 * 3600);

/// Job records by job id (a week; `--js-job-retention` sets it, [`configured`]).
pub const JOBS: Spec = Spec {
    name: Cow::Borrowed(JOB_BUCKET),
    layout: Layout::Kv,
    max_age: Duration::from_secs(7 * 24 * 3600),
    share_per_mille: 60,
    discard_old: true,
};

/// How long a repeated idempotency key returns the same job.
pub const IDEMPOTENCY_TTL: Duration = DAY;

/// Idempotency keys to job ids.
pub const IDEMPOTENCY: Spec = Spec {
    name: Cow::Borrowed(IDEMPOTENCY_BUCKET),
    layout: Layout::Kv,
    max_age: IDEMPOTENCY_TTL,
    share_per_mille: 10,
    discard_old: true,
};

/// Template records.
pub const TEMPLATE_RECORDS: Spec = Spec {
    name: Cow::Borrowed(TEMPLATE_BUCKET),
    layout: Layout::Kv,
    max_age: Duration::ZERO,
    share_per_mille: 10,
    discard_old: false,
};

/// Uploads, prepared tensors and results (a day: ample for clients to fetch results). When
/// full, the oldest go first (a ring): under traffic that fills it within the day, results
/// stay fetchable for less than a day, and nothing new is refused.
pub const BLOBS: Spec = Spec {
    name: Cow::Borrowed(BLOB_BUCKET),
    layout: Layout::Objects,
    max_age: DAY,
    share_per_mille: 380,
    discard_old: true,
};

/// Template activation caches, the cluster tier (the cachestore manages their lifetime).
pub const CACHES: Spec = Spec {
    name: Cow::Borrowed(CACHE_BUCKET),
    layout: Layout::Objects,
    max_age: Duration::ZERO,
    share_per_mille: 300,
    discard_old: false,
};

/// Templates' images, kept as long as the template.
pub const TEMPLATE_IMAGES: Spec = Spec {
    name: Cow::Borrowed(TEMPLATE_BUCKET),
    layout: Layout::Objects,
    max_age: Duration::ZERO,
    share_per_mille: 80,
    discard_old: false,
};

/// Edits by template in flight, one message per edit (a day bounds a use whose gateway died).
pub const TEMPLATE_USES: Spec = Spec {
    name: Cow::Borrowed(TEMPLATE_USES_STREAM),
    layout: Layout::LastPerSubject {
        subject_prefix: TEMPLATE_USES_PREFIX,
    },
    max_age: DAY,
    share_per_mille: 10,
    discard_old: false,
};

/// Capture announcements, the last per cache key, which a denoiser started later replays to
/// warm its local tier. A template delete purges its cache's announcement; a week bounds any
/// left behind (a replayed one whose cache is gone costs one cachestore lookup). Templates
/// captured earlier are fetched at their first edit instead.
pub const TEMPLATE_CAPTURES: Spec = Spec {
    name: Cow::Borrowed(TEMPLATE_CAPTURES_STREAM),
    layout: Layout::LastPerSubject {
        subject_prefix: TEMPLATES_CAPTURED,
    },
    max_age: Duration::from_secs(7 * 24 * 3600),
    share_per_mille: 10,
    discard_old: false,
};

/// LoRA records (`lora::LoraRecord`), kept until deleted.
pub const LORA_RECORDS: Spec = Spec {
    name: Cow::Borrowed(LORA_BUCKET),
    layout: Layout::Kv,
    max_age: Duration::ZERO,
    share_per_mille: 10,
    discard_old: false,
};

/// LoRA weights (`lora::weights_key`), kept as long as their record.
pub const LORA_WEIGHTS: Spec = Spec {
    name: Cow::Borrowed(LORA_BUCKET),
    layout: Layout::Objects,
    max_age: Duration::ZERO,
    share_per_mille: 120,
    discard_old: false,
};

/// Everything the mesh stores in JetStream.
pub const ALL: [Spec; 10] = [
    JOBS,
    IDEMPOTENCY,
    TEMPLATE_RECORDS,
    BLOBS,
    CACHES,
    TEMPLATE_IMAGES,
    TEMPLATE_USES,
    TEMPLATE_CAPTURES,
    LORA_RECORDS,
    LORA_WEIGHTS,
];

impl Spec {
    /// The same spec with entries kept for `max_age`.
    pub fn with_max_age(self, max_age: Duration) -> Self {
        Self { max_age, ..self }
    }

    /// The same spec under another name (the cachestore's bucket is a flag).
    pub fn renamed(self, name: impl Into<String>) -> Self {
        Self {
            name: Cow::Owned(name.into()),
            ..self
        }
    }

    /// Its bound in bytes under a storage budget of `budget` bytes for every stream together
    /// (0: no bounds; then -1, as JetStream writes "none").
    pub fn max_bytes(&self, budget: u64) -> i64 {
        if budget == 0 {
            return -1;
        }
        let share = budget / 1000 * u64::from(self.share_per_mille);
        i64::try_from(share.max(MIN_STREAM_BYTES)).unwrap_or(i64::MAX)
    }

    fn discard(&self) -> stream::DiscardPolicy {
        match self.discard_old {
            true => stream::DiscardPolicy::Old,
            false => stream::DiscardPolicy::New,
        }
    }

    /// Buckets whose reads go to the stream's leader (no direct gets).
    fn reads_from_leader(&self) -> bool {
        matches!(self.layout, Layout::Kv | Layout::Objects)
    }

    /// The name of the stream behind the bucket.
    pub fn stream_name(&self) -> String {
        match self.layout {
            Layout::Kv => format!("KV_{}", self.name),
            Layout::Objects => format!("OBJ_{}", self.name),
            Layout::LastPerSubject { .. } => self.name.to_string(),
        }
    }

    /// The stream behind the spec. KV buckets and object stores are made directly, in the
    /// layout async-nats' `create_key_value` / `create_object_store` would make, but without
    /// direct reads (see [`Layout::Kv`], [`Layout::Objects`]); `create_key_value` also needs
    /// account-info fields older servers (2.9) do not send.
    fn stream_config(&self, replicas: usize, budget: u64) -> stream::Config {
        match self.layout {
            Layout::Kv => stream::Config {
                name: self.stream_name(),
                subjects: vec![format!("$KV.{}.>", self.name)],
                max_messages_per_subject: 1,
                max_age: self.max_age,
                max_bytes: self.max_bytes(budget),
                allow_rollup: true,
                deny_delete: true,
                allow_direct: false,
                discard: self.discard(),
                num_replicas: replicas,
                ..Default::default()
            },
            Layout::LastPerSubject { subject_prefix } => stream::Config {
                name: self.stream_name(),
                subjects: vec![format!("{subject_prefix}.>")],
                max_messages_per_subject: 1,
                max_age: self.max_age,
                max_bytes: self.max_bytes(budget),
                discard: self.discard(),
                num_replicas: replicas,
                ..Default::default()
            },
            Layout::Objects => stream::Config {
                name: self.stream_name(),
                subjects: vec![
                    format!("$O.{}.C.>", self.name),
                    format!("$O.{}.M.>", self.name),
                ],
                max_age: self.max_age,
                max_bytes: self.max_bytes(budget),
                allow_rollup: true,
                allow_direct: false,
                discard: self.discard(),
                num_replicas: replicas,
                ..Default::default()
            },
        }
    }

    /// Create the bucket or stream with `replicas` replicas (an error if it exists with
    /// another config; callers check for it first).
    async fn create(
        &self,
        js: &jetstream::Context,
        replicas: usize,
        budget: u64,
    ) -> Result<(), MeshError> {
        js.create_stream(self.stream_config(replicas, budget))
            .await
            .map(drop)
            .map_err(|e| {
                self.error(format!(
                    "create: {e} (it reserves {} bytes, its share of JS_MAX_BYTES, on each \
                     server holding a replica: that server's max_file_store must have room)",
                    self.max_bytes(budget)
                ))
            })
    }

    fn error(&self, reason: String) -> MeshError {
        MeshError::JetStreamLayout {
            name: self.stream_name(),
            reason,
        }
    }

    /// Get the stream behind the spec, creating it with one replica and no byte bound when
    /// missing (services run [`ensure_all`] first, so only a test's store gets here; the next
    /// service start bounds it). A race with another creator is harmless: its stream is used.
    pub async fn get_or_create(
        &self,
        js: &jetstream::Context,
    ) -> Result<stream::Stream, MeshError> {
        if let Ok(stream) = js.get_stream(self.stream_name()).await {
            return Ok(stream);
        }
        let created = self.create(js, 1, 0).await;
        match js.get_stream(self.stream_name()).await {
            Ok(stream) => Ok(stream),
            Err(err) => Err(created
                .err()
                .unwrap_or_else(|| self.error(format!("get: {err}")))),
        }
    }

    /// Open the KV bucket of this spec (get, or create with one replica).
    pub async fn open_kv(&self, js: &jetstream::Context) -> Result<kv::Store, MeshError> {
        debug_assert!(
            matches!(self.layout, Layout::Kv),
            "{} is no KV bucket",
            self.name
        );
        self.get_or_create(js).await?;
        Ok(js.get_key_value(self.name.as_ref()).await?)
    }
}

/// What [`ensure`] did to one spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ensured {
    Created {
        replicas: usize,
    },
    Existed {
        replicas: usize,
    },
    /// Raised to the wanted replica count, its byte bound, discard policy and age limit set to
    /// the budget's and the spec's, and/or (a bucket) direct reads turned off.
    Updated {
        replicas_before: usize,
        replicas: usize,
    },
}

/// Make `spec` exist with at least `replicas` replicas, its byte bound and discard policy (and
/// bucket reads from the leader). An existing stream is never scaled down (an operator may
/// have raised it); its byte bound follows the budget both ways (`JS_MAX_BYTES` is the one
/// place it is set) and its age limit the spec (`--js-job-retention` for job records); its
/// other settings stay.
pub async fn ensure(
    js: &jetstream::Context,
    spec: &Spec,
    replicas: usize,
    budget: u64,
) -> Result<Ensured, MeshError> {
    let replicas = replicas.max(1);
    let existing = match js.get_stream(spec.stream_name()).await {
        Ok(stream) => stream,
        Err(_) => match spec.create(js, replicas, budget).await {
            Ok(()) => return Ok(Ensured::Created { replicas }),
            // Another service may have created it meanwhile.
            Err(create_err) => js
                .get_stream(spec.stream_name())
                .await
                .map_err(|_| create_err)?,
        },
    };
    let mut config = existing.cached_info().config.clone();
    let stored = existing.cached_info().state.bytes;
    let before = config.num_replicas.max(1);
    // Buckets made by earlier versions (or `nats kv add`, `nats object add`) take direct reads.
    let direct_reads = spec.reads_from_leader() && config.allow_direct;
    let mut bound = spec.max_bytes(budget);
    // A stream that refuses writes when full, holding more than its new bound, would refuse
    // every write: it keeps its old bound until data is deleted or the budget raised.
    if !spec.discard_old && bound >= 0 && stored > bound as u64 {
        tracing::warn!(stream = %spec.stream_name(), stored, new_bound = bound,
            kept = config.max_bytes,
            "the stream holds more than its share of JS_MAX_BYTES: its bound is left as it was");
        bound = config.max_bytes;
    }
    let bounds_differ = config.max_bytes != bound
        || config.discard != spec.discard()
        || config.max_age != spec.max_age;
    if before >= replicas && !direct_reads && !bounds_differ {
        return Ok(Ensured::Existed { replicas: before });
    }
    config.num_replicas = before.max(replicas);
    if config.max_age != spec.max_age {
        // Lowered, the stream drops what is older at once.
        let lowered = spec.max_age != Duration::ZERO
            && (config.max_age == Duration::ZERO || spec.max_age < config.max_age);
        if lowered {
            tracing::warn!(stream = %spec.stream_name(), was = ?config.max_age, now = ?spec.max_age,
                "lowering the stream's age limit: older entries go now");
        }
        config.max_age = spec.max_age;
    }
    config.max_bytes = bound;
    config.discard = spec.discard();
    if spec.reads_from_leader() {
        config.allow_direct = false;
    }
    js.update_stream(config.clone()).await.map_err(|e| {
        spec.error(format!(
            "update: {e} (its bound of {bound} bytes, its share of JS_MAX_BYTES, is reserved on \
             each server holding a replica: that server's max_file_store must have room)"
        ))
    })?;
    Ok(Ensured::Updated {
        replicas_before: before,
        replicas: config.num_replicas,
    })
}

/// `specs` as the deployment configures them: job records kept for `--js-job-retention`.
pub fn configured(specs: Vec<Spec>, config: &crate::CommonConfig) -> Vec<Spec> {
    specs
        .into_iter()
        .map(
            |spec| match spec.name == JOBS.name && spec.layout == JOBS.layout {
                true => spec.with_max_age(config.js_job_retention),
                false => spec,
            },
        )
        .collect()
}

/// [`ensure`] every spec of the mesh (plus `extra`, e.g. a cachestore bucket under another
/// name) under the storage budget `budget` (`JS_MAX_BYTES`; 0: no byte bounds); returns what
/// was done to each, by stream name. (What an operator's tool does; a service ensures only
/// its own, [`context`].)
pub async fn ensure_all(
    js: &jetstream::Context,
    replicas: usize,
    budget: u64,
    extra: &[Spec],
) -> Result<Vec<(String, Ensured)>, MeshError> {
    ensure_specs(js, ALL.iter().chain(extra), replicas, budget).await
}

/// [`ensure`] each of `specs` once (by stream name).
async fn ensure_specs<'a>(
    js: &jetstream::Context,
    specs: impl Iterator<Item = &'a Spec>,
    replicas: usize,
    budget: u64,
) -> Result<Vec<(String, Ensured)>, MeshError> {
    let mut done = Vec::new();
    for spec in specs {
        if done.iter().any(|(name, _)| *name == spec.stream_name()) {
            continue;
        }
        let ensured = ensure(js, spec, replicas, budget).await?;
        if !matches!(ensured, Ensured::Existed { .. }) {
            tracing::info!(stream = %spec.stream_name(), ?ensured, "JetStream layout");
        }
        done.push((spec.stream_name(), ensured));
    }
    Ok(done)
}

/// The JetStream context of a service of `role`, after [`ensure`] of the specs that role
/// opens ([`Role::layout_specs`], or `instead` when given: a cachestore bucket under another
/// name) with the configured replica count. Each role manages only its own streams: its NATS
/// user may create and update no other (`nats::auth`).
pub async fn context(
    client: &async_nats::Client,
    config: &crate::CommonConfig,
    role: Role,
    instead: Option<&[Spec]>,
) -> Result<jetstream::Context, MeshError> {
    let js = jetstream::new(client.clone());
    let own = configured(role.layout_specs(), config);
    ensure_specs(
        &js,
        instead.unwrap_or(&own).iter(),
        usize::from(config.js_replicas),
        config.js_max_bytes,
    )
    .await?;
    Ok(js)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_spec_has_its_own_stream() {
        let mut names: Vec<String> = ALL.iter().map(Spec::stream_name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), ALL.len());
    }

    #[test]
    fn the_shares_fit_in_the_budget_and_only_records_drop_their_oldest() {
        let total: u32 = ALL.iter().map(|s| s.share_per_mille).sum();
        assert!(total <= 1000, "{total}");
        for spec in ALL {
            assert!(spec.share_per_mille > 0, "{}", spec.name);
            // A template, a LoRA or a blob someone reads must never vanish to make room.
            let droppable = spec == JOBS || spec == IDEMPOTENCY || spec == BLOBS;
            assert_eq!(spec.discard_old, droppable, "{}", spec.name);
        }
    }

    #[test]
    fn buckets_read_from_the_leader() {
        for spec in ALL.iter().filter(|s| s.reads_from_leader()) {
            let config = spec.stream_config(3, 0);
            assert!(!config.allow_direct, "{}", spec.name);
            assert_eq!(config.num_replicas, 3);
        }
    }
}
