//! Integration tests of the whole mesh live in tests/tests/; this crate holds their harness.
pub mod harness;
pub mod images;
pub mod mesh;
pub mod promql;
pub mod sd;
pub mod tools;
pub mod webhook_receiver;
