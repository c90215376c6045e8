//! Durable state in JetStream: the table of every bucket and stream ([`jetstream_layout`]), the
//! JSON records in KV ([`record`], and the job and idempotency records built on it), blobs in
//! object stores ([`blob_store`]), reading cachestore values ([`cache_read`]), and what makes
//! them survive a NATS node loss ([`transient`] retries, [`reopening_watch`]).
pub mod async_queue;
pub mod blob_store;
pub mod cache_read;
pub mod idempotency;
pub mod jetstream_layout;
pub mod job;
pub mod record;
pub mod reopening_watch;
pub mod storage_usage;
pub mod transient;
pub mod webhook_queue;
