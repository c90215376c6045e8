//! Every MessagePack message type a service decodes from NATS (`diffmesh_fuzz::wire` lists
//! them; the first byte picks one), checked as its receiver checks it, plus the cache's step-blob
//! format. No message may panic a receiver.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[global_allocator]
static ALLOC: diffmesh_fuzz::CappedAlloc = diffmesh_fuzz::CappedAlloc;

fuzz_target!(
    init: diffmesh_fuzz::write_seeds_if_asked(diffmesh_fuzz::wire::seeds),
    |data: &[u8]| diffmesh_fuzz::wire::fuzz_one(data)
);
