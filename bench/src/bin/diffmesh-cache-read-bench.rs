//! diffmesh-cache-read-bench: how fast a client reads large cachestore values, in ranges
//! straight from the cachestore (`shared::stores::cache_read`) against through the JetStream object
//! store (the path before ranges, and still the fallback).
//!
//! Starts its own `nats-server -js` (the test fixture's: default 1 MiB messages), or uses the
//! server at `--nats-url` (e.g. one with the compose file's 8 MB `max_payload`; it needs
//! JetStream), and an in-process cachestore whose memory tier holds every
//! value, stores one value per size the way a denoiser does, then times whole reads of each
//! value both ways, alternating, and a whole cache (`--cache-entries` values of
//! `--cache-entry-mb`) read `--cache-concurrency` at a time as the denoiser's fetch does.
//! Prints a table; the last line is one JSON object.
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use diffmesh_cachestore::{start, CachestoreConfig};
use diffmesh_shared::nats::request_msgpack;
use diffmesh_shared::stores::blob_store::BlobStore;
use diffmesh_shared::stores::cache_read::{CacheReader, ReadPath};
use diffmesh_shared::stores::jetstream_layout::CACHES;
use diffmesh_shared::testing::NatsServer;
use diffmesh_shared::wire::cachestore::{put_subject, CachePut, CachePutReply};
use futures::StreamExt;
use serde_json::json;

#[derive(Parser)]
#[command(about = "Large cachestore values: ranged reads against object-store reads")]
struct Args {
    /// Value sizes in MiB.
    #[arg(long, value_delimiter = ',', default_values_t = [1.0, 4.0, 16.0, 64.0, 256.0])]
    sizes_mb: Vec<f64>,
    /// Timed reads of each value per path (the median is reported).
    #[arg(long, default_value_t = 7)]
    rounds: usize,
    /// The whole-cache read: entries, MiB each, and how many are read at once.
    #[arg(long, default_value_t = 21)]
    cache_entries: usize,
    #[arg(long, default_value_t = 0.75)]
    cache_entry_mb: f64,
    #[arg(long, default_value_t = 8)]
    cache_concurrency: usize,
    /// Use this NATS server instead of starting one.
    #[arg(long)]
    nats_url: Option<String>,
}

const T: Duration = Duration::from_secs(60);

/// Store `value` under `key` as a denoiser does: the bucket first, then a put naming it.
async fn store(c: &async_nats::Client, bucket: &BlobStore, key: &str, value: &[u8]) -> Result<()> {
    bucket.put(key, value).await?;
    let req = CachePut {
        key: key.into(),
        value: None,
    };
    match request_msgpack::<_, CachePutReply>(c, &put_subject(), &req, T).await? {
        CachePutReply::Stored { .. } => Ok(()),
        CachePutReply::Failed { message } => bail!("put {key}: {message}"),
    }
}

/// One whole read of `key` by `path` (ranged, or the object store as before ranges).
async fn read(reader: &CacheReader, key: &str, path: ReadPath) -> Result<usize> {
    let read = match path {
        ReadPath::Ranged => reader.read(key).await,
        _ => reader.read_unranged(key).await,
    };
    let (value, how) = read.map_err(anyhow::Error::msg)?.context("missing")?;
    if how != path {
        bail!("{key} came by {}, not {}", how.as_str(), path.as_str());
    }
    Ok(value.len())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let own = args.nats_url.is_none().then(NatsServer::start);
    let url = args
        .nats_url
        .clone()
        .unwrap_or_else(|| own.as_ref().map(|n| n.url()).unwrap_or_default());
    let disk = tempfile::tempdir()?;
    let largest = args.sizes_mb.iter().copied().fold(0.0, f64::max);
    let mut config = CachestoreConfig::for_tests(url.clone(), disk.path().to_path_buf());
    // Every value stays in memory: the bench measures the transport, not the tiers.
    config.memory_bytes = ((largest * 2.0 + 64.0) * (1 << 20) as f64) as u64
        + (args.cache_entries as f64 * args.cache_entry_mb * (1 << 20) as f64) as u64;
    config.disk_bytes = config.memory_bytes;
    config.transfer_bytes = config.memory_bytes * 2;
    let cachestore = start(config).await?;
    let c = async_nats::connect(url.as_str()).await?;
    let bucket = BlobStore::open_with(&async_nats::jetstream::new(c.clone()), &CACHES).await?;
    let reader = CacheReader {
        client: c.clone(),
        bucket: bucket.clone(),
        timeout: T,
        max_bytes: usize::MAX,
    };
    println!(
        "server max_payload {} bytes; median of {} reads each",
        c.server_info().max_payload,
        args.rounds
    );
    println!(
        "| MiB | ranged (ms) | object store (ms) | ranged GB/s | object store GB/s | speed-up |"
    );
    let mut rows = Vec::new();
    for &mb in &args.sizes_mb {
        let bytes = (mb * (1 << 20) as f64) as usize;
        let key = format!("bench/v{bytes}");
        let value: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8).collect();
        store(&c, &bucket, &key, &value).await?;
        drop(value);
        let (mut ranged, mut object) = (Vec::new(), Vec::new());
        for round in 0..=args.rounds {
            for path in [ReadPath::Ranged, ReadPath::ObjectStore] {
                let t = Instant::now();
                let n = read(&reader, &key, path).await?;
                let s = t.elapsed().as_secs_f64();
                if n != bytes {
                    bail!("{key}: read {n} of {bytes} bytes");
                }
                // Round 0 warms both paths up.
                if round > 0 {
                    if path == ReadPath::Ranged {
                        ranged.push(s)
                    } else {
                        object.push(s)
                    }
                }
            }
        }
        let (r, o) = (median(ranged), median(object));
        let gbps = |s: f64| bytes as f64 / s / 1e9;
        println!(
            "| {mb} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2}x |",
            r * 1e3,
            o * 1e3,
            gbps(r),
            gbps(o),
            o / r
        );
        rows.push(json!({"mib": mb, "ranged_s": r, "object_store_s": o, "speedup": o / r}));
    }

    // A whole cache, entries read several at once (the denoiser's `CacheClient::fetch`).
    let entry = (args.cache_entry_mb * (1 << 20) as f64) as usize;
    let keys: Vec<String> = (0..args.cache_entries)
        .map(|i| format!("bench/cache/s{i}"))
        .collect();
    for key in &keys {
        let value: Vec<u8> = (0..entry).map(|i| (i % 241) as u8).collect();
        store(&c, &bucket, key, &value).await?;
    }
    let mut whole = serde_json::Map::new();
    let mut cache_times = (Vec::new(), Vec::new());
    for round in 0..=args.rounds {
        for path in [ReadPath::Ranged, ReadPath::ObjectStore] {
            let t = Instant::now();
            let mut reads = futures::stream::iter(&keys)
                .map(|k| read(&reader, k, path))
                .buffered(args.cache_concurrency);
            while let Some(n) = reads.next().await {
                if n? != entry {
                    bail!("a cache entry came short");
                }
            }
            let s = t.elapsed().as_secs_f64();
            if round > 0 {
                if path == ReadPath::Ranged {
                    cache_times.0.push(s)
                } else {
                    cache_times.1.push(s)
                }
            }
        }
    }
    let (r, o) = (median(cache_times.0), median(cache_times.1));
    let total = (entry * keys.len()) as f64;
    println!(
        "whole cache: {} entries of {} MiB ({:.1} MB), {} at once: ranged {:.1} ms ({:.2} GB/s), object store {:.1} ms ({:.2} GB/s), {:.2}x",
        keys.len(),
        args.cache_entry_mb,
        total / 1e6,
        args.cache_concurrency,
        r * 1e3,
        total / r / 1e9,
        o * 1e3,
        total / o / 1e9,
        o / r
    );
    whole.insert("ranged_s".into(), json!(r));
    whole.insert("object_store_s".into(), json!(o));
    whole.insert("bytes".into(), json!(total));
    cachestore.shutdown().await?;
    println!(
        "{}",
        json!({
            "max_payload": c.server_info().max_payload,
            "values": rows,
            "whole_cache": whole,
        })
    );
    Ok(())
}
