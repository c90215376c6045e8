//! Who may say what on the mesh's NATS: one user per service kind, each allowed to publish and
//! subscribe only to what its role needs (the subjects table in `docs/ARCHITECTURE.md`). The
//! gateway cannot hand work to a denoiser directly, only denoisers publish heartbeats, only the
//! router forwards cancels to a denoiser, and so on. [`server_config`] writes the
//! `authorization` block of a `nats-server` config with these users; a server with it refuses
//! anonymous connections.
//!
//! What the lists do not narrow: every service that uses JetStream may call most of its API
//! (`$JS.API.>` but [`JETSTREAM_DENIED`]: deleting, snapshotting or restoring a stream and
//! cluster operations; updating and purging stay open, since every service bounds and scales
//! the streams at start and object deletes are purges), and every service may publish to reply
//! inboxes (`_INBOX.>`: chunked answers send
//! several messages to one inbox, more than `allow_responses` lets through). Writes to buckets
//! (`$KV.<bucket>.>`, `$O.<bucket>.>`) and stream subjects are per service.
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
/// reshape the cluster: refused to every service (the operator's `admin` keeps them), though
/// the services otherwise reach the JetStream API. Object deletes are purges of one subject,
/// so `STREAM.PURGE` stays allowed.
pub const JETSTREAM_DENIED: [&str; 7] = [
    "$JS.API.STREAM.DELETE.>",
    "$JS.API.STREAM.SNAPSHOT.>",
    "$JS.API.STREAM.RESTORE.>",
    "$JS.API.STREAM.PEER.REMOVE.>",
    "$JS.API.ACCOUNT.PURGE.>",
    "$JS.API.SERVER.>",
    "$JS.API.META.>",
];

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

    pub fn permissions(self) -> Permissions {
        // Every service answers requests and receives JetStream deliveries on inboxes.
        let mut publish = strings(&["_INBOX.>"]);
        let mut subscribe = strings(&["_INBOX.>"]);
        let jetstream = ["$JS.API.>", "$JS.ACK.>", "$JS.FC.>"];
        match self {
            Role::Gateway => {
                publish.extend(strings(&jetstream));
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
                publish.extend(strings(&jetstream));
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
                publish.extend(strings(&jetstream));
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
                publish.extend(strings(&jetstream));
                publish.extend([objects(BLOB_BUCKET), objects(TEMPLATE_BUCKET)]);
                subscribe.extend(strings(&["diffmesh.codec.pre", "diffmesh.codec.post"]));
            }
            Role::Cachestore => {
                publish.extend(strings(&jetstream));
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
mod tests {
    use super::*;

    #[test]
    fn only_denoisers_publish_heartbeats_and_only_the_router_hands_out_work() {
        for role in Role::ALL {
            let p = role.permissions();
            let heartbeats = p.publish.iter().any(|s| s == "diffmesh.denoiser.heartbeat");
            assert_eq!(heartbeats, role == Role::Denoiser, "{role:?}");
            let work = p
                .publish
                .iter()
                .any(|s| s.starts_with("diffmesh.denoiser.*"));
            assert_eq!(work, role == Role::Router, "{role:?}");
            assert!(
                !p.publish.iter().any(|s| s == ">" || s == "diffmesh.>"),
                "{role:?}"
            );
        }
    }

    #[test]
    fn the_config_lists_every_user_with_its_permissions() {
        let users = mesh_users().unwrap();
        assert_eq!(users.len(), 7);
        assert_eq!(users[1].password.len(), 32);
        assert_ne!(users[1].password, users[2].password);
        let conf = server_config(&users);
        assert!(conf.contains("user: \"gateway\""), "{conf}");
        assert!(conf.contains("\"diffmesh.queue.async.>\""), "{conf}");
        assert_eq!(conf.matches("permissions").count(), 6, "the admin has none");
    }
}
