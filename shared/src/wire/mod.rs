//! The wire contract: every NATS subject and header name, the MessagePack message types the
//! services exchange, and the formats they agree on (cachestore requests, ControlNet-as-a-Service
//! requests, LoRA files, model announcements, template cache keys and their byte layout). Nothing here does I/O.
pub mod cachestore;
pub mod controlnet;
pub mod controlnet_service;
pub mod lora;
pub mod messages;
pub mod models;
pub mod step_cache;
pub mod subjects;
pub mod templates;
