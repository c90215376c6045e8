//! Tests of `auth`: who may publish what.
use super::*;

fn may(role: Role, subject: &str) -> bool {
    role.permissions().may_publish(subject)
}

/// Every stream the mesh has: the layout's, the async queue and the webhooks due.
fn every_stream() -> Vec<String> {
    let mut all: Vec<String> = jetstream_layout::ALL
        .iter()
        .map(Spec::stream_name)
        .collect();
    all.push(async_queue::STREAM.to_string());
    all.push(webhook_queue::STREAM.to_string());
    all
}

#[test]
fn subjects_match_patterns_token_by_token() {
    assert!(subject_matches("a.b", "a.b"));
    assert!(!subject_matches("a.b", "a.b.c"));
    assert!(!subject_matches("a.b.c", "a.b"));
    assert!(subject_matches("a.*.c", "a.x.c"));
    assert!(!subject_matches("a.*", "a.x.c"));
    assert!(subject_matches("a.>", "a.x.c"));
    assert!(!subject_matches("a.>", "a"));
    assert!(!subject_matches(
        "$JS.API.STREAM.INFO.KV_a",
        "$JS.API.STREAM.INFO.KV_ab"
    ));
}

#[test]
fn no_role_reaches_the_whole_jetstream_api() {
    for role in Role::ALL {
        let p = role.permissions();
        for broad in [
            "$JS.API.>",
            "$JS.ACK.>",
            "$JS.FC.>",
            "$JS.>",
            "$JS.API.STREAM.>",
        ] {
            assert!(!p.publish.iter().any(|s| s == broad), "{role:?}: {broad}");
        }
        // Nothing that lists or reads the account's streams at large.
        for subject in [
            "$JS.API.INFO",
            "$JS.API.STREAM.NAMES",
            "$JS.API.STREAM.LIST",
            "$JS.API.STREAM.CREATE.OTHER",
            "$JS.API.STREAM.MSG.GET.OTHER",
            "$JS.API.CONSUMER.CREATE.OTHER",
        ] {
            assert!(!may(role, subject), "{role:?}: {subject}");
        }
        // Every JetStream subject allowed names one stream of the mesh.
        for pattern in p.publish.iter().filter(|s| s.starts_with("$JS.")) {
            assert!(
                every_stream()
                    .iter()
                    .any(|stream| pattern.split('.').any(|token| token == stream.as_str())),
                "{role:?}: {pattern}"
            );
        }
        // And the refused calls stay refused.
        for stream in every_stream() {
            for call in ["DELETE", "SNAPSHOT", "RESTORE"] {
                let subject = format!("$JS.API.STREAM.{call}.{stream}");
                assert!(!may(role, &subject), "{role:?}: {subject}");
            }
        }
    }
}

#[test]
fn every_role_manages_the_streams_it_opens_and_no_other() {
    for role in Role::ALL {
        let managed: Vec<String> = role
            .stream_access()
            .into_iter()
            .filter(|a| a.uses.contains(&StreamUse::Manage))
            .map(|a| a.stream)
            .collect();
        for spec in role.layout_specs() {
            assert!(
                managed.contains(&spec.stream_name()),
                "{role:?}: {}",
                spec.name
            );
        }
        for stream in every_stream() {
            for call in ["CREATE", "UPDATE"] {
                let subject = format!("$JS.API.STREAM.{call}.{stream}");
                assert_eq!(
                    may(role, &subject),
                    managed.contains(&stream),
                    "{role:?}: {subject}"
                );
            }
            if managed.contains(&stream) {
                assert!(may(role, &format!("$JS.API.STREAM.INFO.{stream}")));
            }
        }
    }
    // Each bucket of the layout is ensured by some role.
    for spec in jetstream_layout::ALL {
        assert!(
            Role::ALL.iter().any(|r| r.layout_specs().contains(&spec)),
            "{}",
            spec.name
        );
    }
    let queue = format!("$JS.API.STREAM.UPDATE.{}", async_queue::STREAM);
    assert!(may(Role::Gateway, &queue) && may(Role::Router, &queue));
    assert!(!may(Role::Denoiser, &queue));
    assert!(Role::Controlnet.jetstream_api().is_empty());
}

#[test]
fn job_records_are_read_by_the_gateway_and_the_router_only() {
    assert_eq!(JOBS.stream_name(), "KV_diffmesh-jobs");
    let get = "$JS.API.STREAM.MSG.GET.KV_diffmesh-jobs";
    let watch = "$JS.API.CONSUMER.CREATE.KV_diffmesh-jobs";
    for role in Role::ALL {
        let reads = matches!(role, Role::Gateway | Role::Router);
        assert_eq!(may(role, get), reads, "{role:?}");
        assert_eq!(may(role, watch), reads, "{role:?}");
    }
    assert!(!may(Role::Codec, "$JS.API.STREAM.INFO.KV_diffmesh-jobs"));
    assert!(!may(
        Role::Codec,
        "$JS.API.DIRECT.GET.KV_diffmesh-jobs.$KV.diffmesh-jobs.j1"
    ));
    // An ordered consumer made again after a reconnect names itself and its filter, and
    // answers flow control.
    assert!(may(
        Role::Router,
        "$JS.API.CONSUMER.CREATE.KV_diffmesh-jobs.abc_2.$KV.diffmesh-jobs.>"
    ));
    assert!(may(
        Role::Router,
        "$JS.API.CONSUMER.DELETE.KV_diffmesh-jobs.abc_1"
    ));
    assert!(may(Role::Router, "$JS.FC.KV_diffmesh-jobs.abc_2.x7Qz"));
    assert!(!may(Role::Router, "$JS.FC.OBJ_diffmesh-blobs.abc_2.x7Qz"));
    // The idempotency keys are the gateway's alone.
    let keys = format!("$JS.API.STREAM.MSG.GET.{}", IDEMPOTENCY.stream_name());
    for role in Role::ALL {
        assert_eq!(may(role, &keys), role == Role::Gateway, "{role:?}");
    }
}

#[test]
fn only_the_cache_bucket_writers_purge_it() {
    assert_eq!(CACHES.stream_name(), "OBJ_diffmesh-cache");
    let purge = "$JS.API.STREAM.PURGE.OBJ_diffmesh-cache";
    for role in Role::ALL {
        let writes = matches!(role, Role::Cachestore | Role::Denoiser);
        assert_eq!(may(role, purge), writes, "{role:?}");
    }
    assert!(!may(
        Role::Gateway,
        "$JS.API.STREAM.MSG.GET.OBJ_diffmesh-cache"
    ));
    assert!(!may(
        Role::Gateway,
        "$JS.API.STREAM.UPDATE.OBJ_diffmesh-cache"
    ));
    assert!(may(
        Role::Cachestore,
        "$JS.API.STREAM.MSG.GET.OBJ_diffmesh-cache"
    ));
    // The cachestore reaches nothing but its bucket.
    for access in Role::Cachestore.stream_access() {
        assert_eq!(access.stream, "OBJ_diffmesh-cache");
    }
}

#[test]
fn what_a_role_only_reads_it_cannot_purge() {
    for spec in [TEMPLATE_IMAGES, LORA_WEIGHTS] {
        let stream = spec.stream_name();
        let purge = format!("$JS.API.STREAM.PURGE.{stream}");
        assert!(may(
            Role::Denoiser,
            &format!("$JS.API.STREAM.MSG.GET.{stream}")
        ));
        assert!(!may(Role::Denoiser, &purge), "{purge}");
        assert!(may(Role::Gateway, &purge), "{purge}");
    }
    // Messages are deleted by the gateway only, and only from the async queue.
    for role in Role::ALL {
        for stream in every_stream() {
            let delete = format!("$JS.API.STREAM.MSG.DELETE.{stream}");
            let allowed = role == Role::Gateway && stream == async_queue::STREAM;
            assert_eq!(may(role, &delete), allowed, "{role:?}: {delete}");
        }
    }
    // Key-value records are written by publishing: no role purges a bucket of them.
    for spec in [JOBS, IDEMPOTENCY, TEMPLATE_RECORDS, LORA_RECORDS] {
        let purge = format!("$JS.API.STREAM.PURGE.{}", spec.stream_name());
        for role in Role::ALL {
            assert!(!may(role, &purge), "{role:?}: {purge}");
        }
    }
}

#[test]
fn only_routers_pull_and_ack_async_jobs() {
    let stream = async_queue::STREAM;
    let consumer = async_queue::CONSUMER;
    let next = format!("$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}");
    let create = format!("$JS.API.CONSUMER.CREATE.{stream}.{consumer}");
    let ack = format!("$JS.ACK.{stream}.{consumer}.1.42.7.1700000000000000000.3");
    for role in Role::ALL {
        let router = role == Role::Router;
        assert_eq!(may(role, &next), router, "{role:?}");
        assert_eq!(may(role, &create), router, "{role:?}");
        assert_eq!(may(role, &ack), router, "{role:?}");
    }
    // No other consumer on the queue, and no acks elsewhere.
    assert!(!may(
        Role::Router,
        &format!("$JS.API.CONSUMER.CREATE.{stream}.other")
    ));
    assert!(!may(
        Role::Router,
        &format!("$JS.API.CONSUMER.DELETE.{stream}.{consumer}")
    ));
    assert!(!may(Role::Router, "$JS.ACK.KV_diffmesh-jobs.c.1.1.1.1.0"));
    // The router's storage gauges read every stream's info, and nothing more of them.
    for stream in every_stream() {
        assert!(may(Role::Router, &format!("$JS.API.STREAM.INFO.{stream}")));
    }
    assert!(!may(
        Role::Router,
        "$JS.API.STREAM.MSG.GET.OBJ_diffmesh-blobs"
    ));
    assert!(!may(
        Role::Router,
        "$JS.API.STREAM.PURGE.OBJ_diffmesh-blobs"
    ));
}

#[test]
fn only_gateways_relay_and_send_webhooks() {
    let jobs = JOBS.stream_name();
    let (queue, senders, relay) = (
        webhook_queue::STREAM,
        webhook_queue::SENDERS,
        webhook_queue::RELAY,
    );
    let subjects = [
        format!("$JS.API.CONSUMER.MSG.NEXT.{queue}.{senders}"),
        format!("$JS.ACK.{queue}.{senders}.1.42.7.1700000000000000000.3"),
        format!("$JS.API.CONSUMER.MSG.NEXT.{jobs}.{relay}"),
        format!("$JS.ACK.{jobs}.{relay}.1.42.7.1700000000000000000.3"),
        format!("$JS.API.STREAM.CREATE.{queue}"),
        webhook_queue::SUBJECT.to_string(),
    ];
    for role in Role::ALL {
        for subject in &subjects {
            assert_eq!(
                may(role, subject),
                role == Role::Gateway,
                "{role:?}: {subject}"
            );
        }
    }
    // The relay is made with its subject filter in the subject.
    assert!(may(
        Role::Gateway,
        &format!("$JS.API.CONSUMER.CREATE.{jobs}.{relay}.$KV.diffmesh-jobs.*")
    ));
    // The gateway acks no other consumer of the job records, nor takes async jobs.
    assert!(!may(
        Role::Gateway,
        &format!("$JS.ACK.{jobs}.other.1.1.1.1.0")
    ));
    assert!(!may(
        Role::Gateway,
        &format!("$JS.API.CONSUMER.MSG.NEXT.{queue}.{relay}")
    ));
    assert!(!may(
        Role::Gateway,
        &format!(
            "$JS.API.CONSUMER.MSG.NEXT.{}.{}",
            async_queue::STREAM,
            async_queue::CONSUMER
        )
    ));
}

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
