//! Who may say what on the mesh's NATS: one user per service kind, each allowed to publish and
//! subscribe only to what its role needs (the subjects table in `docs/ARCHITECTURE.md`). The
//! gateway cannot hand work to a denoiser directly, only denoisers publish heartbeats, only the
//! router forwards cancels to a denoiser, and so on. [`server_config`] writes the
//! `authorization` block of a `nats-server` config with these users; a server with it refuses
//! anonymous connections.
//!
//! JetStream is narrowed per role as well. A role reaches the JetStream API (`$JS.API.…`) only
//! for the streams it uses ([`Role::stream_access`]), and there only for what it does with
//! them ([`StreamUse`]): manage them (create, update, info: the buckets of
//! [`Role::layout_specs`], which it ensures at start, and the async queue), read them
//! (message gets, ordered consumers and their flow control, `$JS.FC.<stream>.>`), purge them,
//! delete a message, pull from a durable consumer and ack what it delivers
//! (`$JS.ACK.<stream>.<consumer>.>`).
//! So the codec cannot read job records, the gateway cannot purge or rescale the cache bucket,
//! the denoiser cannot purge template images or LoRA weights it only reads, and the controlnet
//! worker has no JetStream at all. [`JETSTREAM_DENIED`] stays refused on top of the lists.
//!
//! What the lists do not narrow: a role that may purge a stream may purge all of it (the
//! subject filter of a purge is in its payload, which permissions do not see; object stores
//! need purges, since deleting or replacing an object purges its chunks); a role that manages
//! a stream may update its whole config, as each service bounds and scales what it opens at
//! start; reading covers every message of a stream; stream info, which the router reads for
//! every stream (its storage gauges), lists subjects when asked to (KV keys); and every
//! service may publish to reply inboxes (`_INBOX.>`: chunked answers send several messages to
//! one inbox, more than `allow_responses` lets through). Writes to buckets
//! (`$KV.<bucket>.>`, `$O.<bucket>.>`) and stream subjects are per service. The cache bucket
//! is named here by its default, [`CACHE_BUCKET`]: a cachestore run with another `--bucket`
//! needs these lists changed too.
use crate::stores::jetstream_layout::{
    self, Spec, BLOBS, CACHES, IDEMPOTENCY, JOBS, LORA_RECORDS, LORA_WEIGHTS, TEMPLATE_CAPTURES,
    TEMPLATE_IMAGES, TEMPLATE_RECORDS, TEMPLATE_USES,
};
use crate::stores::{async_queue, webhook_queue};
use crate::wire::cachestore::CACHE_BUCKET;
use crate::wire::subjects::{
    BLOB_BUCKET, IDEMPOTENCY_BUCKET, JOB_BUCKET, LORA_BUCKET, TEMPLATE_BUCKET,
};

/// The kinds of service, one NATS user each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Gateway,
    Router,
    Denoiser,
    Codec,
    Cachestore,
    Controlnet,
}

/// Subjects a user may publish and subscribe to (NATS wildcards).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Permissions {
    pub publish: Vec<String>,
    /// Subjects refused even where `publish` allows them (deny wins in nats-server).
    pub publish_deny: Vec<String>,
    pub subscribe: Vec<String>,
}

/// JetStream API calls no service makes, which would destroy or copy out the mesh's data or
/// reshape the cluster: refused to every service (the operator's `admin` keeps them) on top of
/// the per-role allow lists ([`Role::jetstream_api`]), so no later widening of a list lets
/// them through.
pub const JETSTREAM_DENIED: [&str; 7] = [
    "$JS.API.STREAM.DELETE.>",
    "$JS.API.STREAM.SNAPSHOT.>",
    "$JS.API.STREAM.RESTORE.>",
    "$JS.API.STREAM.PEER.REMOVE.>",
    "$JS.API.ACCOUNT.PURGE.>",
    "$JS.API.SERVER.>",
    "$JS.API.META.>",
];

/// What a role does with one stream through the JetStream API. Writing messages is no API
/// call: it is publishing to the stream's subjects (`$KV.<bucket>.>`, `$O.<bucket>.>`, a
/// plain stream's subjects), allowed or not by the role's subject list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamUse {
    /// Read the stream's info, nothing else ([`stream_api_info`]).
    Info,
    /// Create the stream, or set its replicas and bounds (`jetstream_layout::ensure`,
    /// `AsyncQueue::open`), and read its info ([`stream_api_manage`]).
    Manage,
    /// Read its messages ([`stream_api_read`]): message gets (KV gets, object infos and
    /// chunks, all read from the leader), direct gets (a bucket made by an older version takes
    /// them until `ensure` turns them off), and ordered push consumers (KV keys and watches,
    /// object reads and listings, `JobStore::watch_since`, the replay of capture
    /// announcements).
    Read,
    /// Purge messages ([`stream_api_purge`]): an object's chunks when it is deleted or
    /// replaced, a template use or capture announcement that ended.
    Purge,
    /// Delete one message by sequence ([`stream_api_delete_message`]): a cancelled async job.
    DeleteMessage,
    /// Pull from the durable consumer of this name, created on first use, and ack what it
    /// delivers ([`stream_api_pull`]).
    Pull(&'static str),
}

/// One stream a role reaches through the JetStream API, and what it does there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamAccess {
    /// The stream's name (`KV_<bucket>`, `OBJ_<bucket>`, or a plain stream's).
    pub stream: String,
    pub uses: Vec<StreamUse>,
}

/// The JetStream API's subject prefix (the mesh uses no JetStream domain).
const JS_API: &str = "$JS.API";

/// Read `stream`'s info: what opening it (`get_stream`) asks, and the storage gauges.
pub fn stream_api_info(stream: &str) -> Vec<String> {
    vec![format!("{JS_API}.STREAM.INFO.{stream}")]
}

/// Create `stream`, update its config, read its info.
pub fn stream_api_manage(stream: &str) -> Vec<String> {
    vec![
        format!("{JS_API}.STREAM.INFO.{stream}"),
        format!("{JS_API}.STREAM.CREATE.{stream}"),
        format!("{JS_API}.STREAM.UPDATE.{stream}"),
    ]
}

/// Read `stream`'s messages: message gets, direct gets, and ordered push consumers, which
/// async-nats makes as `CONSUMER.CREATE.<stream>` (no name), re-makes as
/// `CONSUMER.CREATE.<stream>.<name>.<filter>` after deleting the previous one, asks the info of
/// (KV keys) and answers the flow control of (`$JS.FC.<stream>.<consumer>.<token>`).
pub fn stream_api_read(stream: &str) -> Vec<String> {
    vec![
        format!("{JS_API}.STREAM.INFO.{stream}"),
        format!("{JS_API}.STREAM.MSG.GET.{stream}"),
        format!("{JS_API}.DIRECT.GET.{stream}"),
        format!("{JS_API}.DIRECT.GET.{stream}.>"),
        format!("{JS_API}.CONSUMER.CREATE.{stream}"),
        format!("{JS_API}.CONSUMER.CREATE.{stream}.>"),
        format!("{JS_API}.CONSUMER.INFO.{stream}.*"),
        format!("{JS_API}.CONSUMER.DELETE.{stream}.*"),
        format!("$JS.FC.{stream}.>"),
    ]
}

/// Purge `stream` (any part of it: the subject filter is in the payload).
pub fn stream_api_purge(stream: &str) -> Vec<String> {
    vec![format!("{JS_API}.STREAM.PURGE.{stream}")]
}

/// Delete single messages of `stream` by sequence.
pub fn stream_api_delete_message(stream: &str) -> Vec<String> {
    vec![format!("{JS_API}.STREAM.MSG.DELETE.{stream}")]
}

/// Pull from the durable `consumer` of `stream` (made on first use) and ack its messages: the
/// server's ack subjects are `$JS.ACK.<stream>.<consumer>.` and then the delivery count, the
/// stream and consumer sequences, the time and the pending count.
pub fn stream_api_pull(stream: &str, consumer: &str) -> Vec<String> {
    vec![
        format!("{JS_API}.STREAM.INFO.{stream}"),
        format!("{JS_API}.CONSUMER.INFO.{stream}.{consumer}"),
        format!("{JS_API}.CONSUMER.CREATE.{stream}.{consumer}"),
        // A durable consumer with a subject filter is made on `...<consumer>.<filter>`.
        format!("{JS_API}.CONSUMER.CREATE.{stream}.{consumer}.>"),
        format!("{JS_API}.CONSUMER.MSG.NEXT.{stream}.{consumer}"),
        format!("$JS.ACK.{stream}.{consumer}.>"),
    ]
}

/// The subjects `kind` of use of `stream` publishes to.
fn stream_api(stream: &str, kind: StreamUse) -> Vec<String> {
    match kind {
        StreamUse::Info => stream_api_info(stream),
        StreamUse::Manage => stream_api_manage(stream),
        StreamUse::Read => stream_api_read(stream),
        StreamUse::Purge => stream_api_purge(stream),
        StreamUse::DeleteMessage => stream_api_delete_message(stream),
        StreamUse::Pull(consumer) => stream_api_pull(stream, consumer),
    }
}

/// Add `uses` of `stream` to `access` (merged into the stream's entry when it has one).
fn grant(access: &mut Vec<StreamAccess>, stream: String, uses: &[StreamUse]) {
    let found = access.iter().position(|a| a.stream == stream);
    let index = match found {
        Some(index) => index,
        None => {
            access.push(StreamAccess {
                stream,
                uses: Vec::new(),
            });
            access.len() - 1
        }
    };
    for kind in uses {
        if !access[index].uses.contains(kind) {
            access[index].uses.push(*kind);
        }
    }
}

/// Whether `subject` matches the NATS subject pattern `pattern` (`*`: one token, `>`: one or
/// more tokens to the end).
pub fn subject_matches(pattern: &str, subject: &str) -> bool {
    let mut tokens = subject.split('.');
    for want in pattern.split('.') {
        if want == ">" {
            return tokens.next().is_some();
        }
        match tokens.next() {
            Some(token) if want == "*" || want == token => {}
            _ => return false,
        }
    }
    tokens.next().is_none()
}

impl Permissions {
    /// Whether the server lets this user publish to `subject` (an allow matches, no deny does).
    pub fn may_publish(&self, subject: &str) -> bool {
        self.publish.iter().any(|p| subject_matches(p, subject))
            && !self
                .publish_deny
                .iter()
                .any(|p| subject_matches(p, subject))
    }
}

/// One user of the server: a service role, or (no permissions) an operator who may do anything.
#[derive(Debug, Clone)]
pub struct User {
    pub name: String,
    pub password: String,
    pub permissions: Option<Permissions>,
}

fn kv(bucket: &str) -> String {
    format!("$KV.{bucket}.>")
}

fn objects(bucket: &str) -> String {
    format!("$O.{bucket}.>")
}

fn strings(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

impl Role {
    pub const ALL: [Role; 6] = [
        Role::Gateway,
        Role::Router,
        Role::Denoiser,
        Role::Codec,
        Role::Cachestore,
        Role::Controlnet,
    ];

    /// The user name (also the service's program name without `diffmesh-`).
    pub fn name(self) -> &'static str {
        match self {
            Role::Gateway => "gateway",
            Role::Router => "router",
            Role::Denoiser => "denoiser",
            Role::Codec => "codec",
            Role::Cachestore => "cachestore",
            Role::Controlnet => "controlnet",
        }
    }

    /// The buckets and streams of [`jetstream_layout::ALL`] this role opens, which it should
    /// ensure at start (`jetstream_layout::ensure`) and may manage ([`StreamUse::Manage`]).
    /// The cachestore's is [`CACHES`] under its `--bucket`; the async queue
    /// ([`async_queue::STREAM`]), no spec of the table, the gateway and the router open and
    /// manage themselves (`AsyncQueue::open`).
    pub fn layout_specs(self) -> Vec<Spec> {
        match self {
            // Job records and idempotency keys (`JobStore`, `IdempotencyStore`), blobs
            // (`Mesh::blobs`), template records and images and their uses and captures
            // (`templates::Templates::open`), LoRA records and weights (`loras::store`).
            Role::Gateway => vec![
                JOBS,
                IDEMPOTENCY,
                TEMPLATE_RECORDS,
                BLOBS,
                TEMPLATE_IMAGES,
                TEMPLATE_USES,
                TEMPLATE_CAPTURES,
                LORA_RECORDS,
                LORA_WEIGHTS,
            ],
            // Job records (`JobStore`: placement, adoption, async jobs).
            Role::Router => vec![JOBS],
            // Inputs and results, template caches, template images, LoRA weights, and the
            // capture announcements it replays at start.
            Role::Denoiser => vec![
                BLOBS,
                CACHES,
                TEMPLATE_IMAGES,
                LORA_WEIGHTS,
                TEMPLATE_CAPTURES,
            ],
            // Inputs and outputs, prepared template images.
            Role::Codec => vec![BLOBS, TEMPLATE_IMAGES],
            // Its cluster tier.
            Role::Cachestore => vec![CACHES],
            Role::Controlnet => Vec::new(),
        }
    }

    /// Every stream this role reaches through the JetStream API, and how: it manages what it
    /// opens ([`Role::layout_specs`], and the async queue for the gateway and the router).
    pub fn stream_access(self) -> Vec<StreamAccess> {
        use StreamUse::{DeleteMessage, Info, Manage, Pull, Purge, Read};
        let mut access = Vec::new();
        for spec in self.layout_specs() {
            grant(&mut access, spec.stream_name(), &[Manage]);
        }
        let mut give =
            |spec: Spec, uses: &[StreamUse]| grant(&mut access, spec.stream_name(), uses);
        match self {
            Role::Gateway => {
                give(JOBS, &[Read]);
                give(IDEMPOTENCY, &[Read]);
                give(TEMPLATE_RECORDS, &[Read]);
                give(LORA_RECORDS, &[Read]);
                // Objects are read, written and deleted (a put replacing one, and a delete,
                // purge its chunks).
                give(BLOBS, &[Read, Purge]);
                give(TEMPLATE_IMAGES, &[Read, Purge]);
                give(LORA_WEIGHTS, &[Read, Purge]);
                // An edit's use ends with a purge of its subject, a deleted template's
                // capture announcement too; listing uses is stream info.
                give(TEMPLATE_USES, &[Purge]);
                give(TEMPLATE_CAPTURES, &[Purge]);
            }
            Role::Router => {
                give(JOBS, &[Read]);
                // The storage gauges read every stream's info (`storage_usage`).
                for spec in jetstream_layout::ALL {
                    give(spec, &[Info]);
                }
                grant(&mut access, webhook_queue::STREAM.to_string(), &[Info]);
            }
            Role::Denoiser => {
                give(BLOBS, &[Read, Purge]);
                give(CACHES, &[Read, Purge]);
                give(TEMPLATE_IMAGES, &[Read]);
                give(LORA_WEIGHTS, &[Read]);
                give(TEMPLATE_CAPTURES, &[Read]);
            }
            Role::Codec => {
                give(BLOBS, &[Read, Purge]);
                give(TEMPLATE_IMAGES, &[Read, Purge]);
            }
            Role::Cachestore => give(CACHES, &[Read, Purge]),
            Role::Controlnet => {}
        }
        match self {
            // Appends jobs (a publish), takes a cancelled one out by sequence, reads the
            // stream's info for a job's position; sets the queue's bounds.
            Role::Gateway => {
                grant(
                    &mut access,
                    async_queue::STREAM.to_string(),
                    &[Manage, DeleteMessage],
                );
                // Webhooks: the relay reads job records' writes, the senders take the
                // deliveries due from their queue.
                grant(
                    &mut access,
                    JOBS.stream_name(),
                    &[Pull(webhook_queue::RELAY)],
                );
                grant(
                    &mut access,
                    webhook_queue::STREAM.to_string(),
                    &[Manage, Pull(webhook_queue::SENDERS)],
                );
            }
            // Takes jobs from the routers' durable consumer; raises the queue's replicas.
            Role::Router => grant(
                &mut access,
                async_queue::STREAM.to_string(),
                &[Manage, Pull(async_queue::CONSUMER)],
            ),
            _ => {}
        }
        access
    }

    /// The JetStream subjects this role may publish to: the API for its streams
    /// ([`Role::stream_access`]), flow control and acks of its consumers.
    pub fn jetstream_api(self) -> Vec<String> {
        let mut subjects: Vec<String> = Vec::new();
        for access in self.stream_access() {
            for kind in access.uses {
                for subject in stream_api(&access.stream, kind) {
                    if !subjects.contains(&subject) {
                        subjects.push(subject);
                    }
                }
            }
        }
        subjects
    }

    pub fn permissions(self) -> Permissions {
        // Every service answers requests and receives JetStream deliveries on inboxes.
        let mut publish = strings(&["_INBOX.>"]);
        let mut subscribe = strings(&["_INBOX.>"]);
        match self {
            Role::Gateway => {
                publish.extend(strings(&[
                    "diffmesh.codec.pre",
                    "diffmesh.router.submit",
                    "diffmesh.router.cancel",
                    "diffmesh.denoiser.outcome",
                    "diffmesh.cachestore.get",
                    "diffmesh.cachestore.put",
                    "diffmesh.cachestore.delete",
                    "diffmesh.cachestore.stats",
                    "diffmesh.cachestore.locate",
                    "diffmesh.templates.evict",
                    "diffmesh.template-uses.>",
                    "diffmesh.queue.async.>",
                    webhook_queue::SUBJECT,
                ]));
                publish.extend([
                    kv(JOB_BUCKET),
                    kv(IDEMPOTENCY_BUCKET),
                    kv(TEMPLATE_BUCKET),
                    kv(LORA_BUCKET),
                    objects(BLOB_BUCKET),
                    objects(TEMPLATE_BUCKET),
                    objects(LORA_BUCKET),
                ]);
                subscribe.extend(strings(&[
                    "diffmesh.denoiser.heartbeat",
                    "diffmesh.controlnet.heartbeat",
                    "diffmesh.job.*.events",
                    "diffmesh.templates.captured.>",
                ]));
            }
            Role::Router => {
                publish.extend(strings(&[
                    "diffmesh.denoiser.*.submit",
                    "diffmesh.denoiser.*.cancel",
                    "diffmesh.job.*.events",
                    "diffmesh.cachestore.prefetch",
                ]));
                publish.push(kv(JOB_BUCKET));
                subscribe.extend(strings(&[
                    "diffmesh.router.submit",
                    "diffmesh.router.cancel",
                    "diffmesh.denoiser.heartbeat",
                    "diffmesh.job.*.events",
                ]));
            }
            Role::Denoiser => {
                publish.extend(strings(&[
                    "diffmesh.denoiser.heartbeat",
                    "diffmesh.job.*.events",
                    "diffmesh.codec.post",
                    // A job its engine gave up (a restart) is placed again through the router.
                    "diffmesh.router.submit",
                    "diffmesh.cachestore.get",
                    "diffmesh.cachestore.put",
                    "diffmesh.cachestore.range.*",
                    "diffmesh.controlnet.worker.*.>",
                    "diffmesh.templates.captured.>",
                ]));
                publish.extend([objects(BLOB_BUCKET), objects(CACHE_BUCKET)]);
                subscribe.extend(strings(&[
                    "diffmesh.denoiser.*.submit",
                    "diffmesh.denoiser.*.cancel",
                    "diffmesh.denoiser.outcome",
                    "diffmesh.templates.evict",
                    "diffmesh.templates.captured.>",
                    "diffmesh.controlnet.heartbeat",
                ]));
            }
            Role::Codec => {
                publish.extend([objects(BLOB_BUCKET), objects(TEMPLATE_BUCKET)]);
                subscribe.extend(strings(&["diffmesh.codec.pre", "diffmesh.codec.post"]));
            }
            Role::Cachestore => {
                publish.push(objects(CACHE_BUCKET));
                subscribe.extend(strings(&[
                    "diffmesh.cachestore.>",
                    "diffmesh.templates.evict",
                ]));
            }
            Role::Controlnet => {
                publish.extend(strings(&[
                    "diffmesh.controlnet.heartbeat",
                    "diffmesh.controlnet.worker.*.ping",
                ]));
                subscribe.extend(strings(&["diffmesh.controlnet.worker.>"]));
            }
        }
        // The JetStream API, for the streams the role uses only.
        publish.extend(self.jetstream_api());
        Permissions {
            publish,
            publish_deny: strings(&JETSTREAM_DENIED),
            subscribe,
        }
    }
}

/// A fresh random password (32 hex digits from the OS's random source).
pub fn random_password() -> std::io::Result<String> {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// One user per role plus the operator `admin` (all subjects), each with a random password.
pub fn mesh_users() -> std::io::Result<Vec<User>> {
    let mut users = vec![User {
        name: "admin".into(),
        password: random_password()?,
        permissions: None,
    }];
    for role in Role::ALL {
        users.push(User {
            name: role.name().into(),
            password: random_password()?,
            permissions: Some(role.permissions()),
        });
    }
    Ok(users)
}

fn quoted(list: &[String]) -> String {
    let items: Vec<String> = list.iter().map(|s| format!("{s:?}")).collect();
    format!("[{}]", items.join(", "))
}

/// The `authorization { users = [...] }` block of a `nats-server` config for `users`
/// (passwords in plain text: the file must be readable by the server only).
pub fn server_config(users: &[User]) -> String {
    let mut out = String::from("authorization {\n  users = [\n");
    for u in users {
        out.push_str(&format!(
            "    {{ user: {:?}, password: {:?}",
            u.name, u.password
        ));
        if let Some(p) = &u.permissions {
            out.push_str(&format!(
                ", permissions: {{ publish: {{ allow: {}, deny: {} }}, subscribe: {{ allow: {} }} }}",
                quoted(&p.publish),
                quoted(&p.publish_deny),
                quoted(&p.subscribe)
            ));
        }
        out.push_str(" }\n");
    }
    out.push_str("  ]\n}\n");
    out
}

#[cfg(test)]
#[path = "auth_tests.rs"]
mod tests;
