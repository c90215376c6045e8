//! What the fuzz targets share: an allocator that turns one oversized allocation into a crash
//! (the build runs without a sanitizer, so nothing else would notice a decoder trusting a length
//! it read), the seed inputs each target writes when asked, and the table of wire messages.
//!
//! `cargo xtask fuzz` runs each target binary once with [`SEEDS_ENV`] set to the target's corpus
//! folder: the seeds are made by the same code that reads them, so they follow the types.
pub mod seeds;
pub mod wire;

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write;
use std::path::Path;

/// Where a target writes its seeds (then exits) instead of fuzzing.
pub const SEEDS_ENV: &str = "DIFFMESH_FUZZ_SEEDS";

/// Largest single allocation a target may make. Every input is bounded far below this (images
/// by the targets' pixel limit, forms by their byte limits), so a larger one is a length taken
/// from the input without a check.
pub const MAX_ALLOC: usize = 128 << 20;

/// The system allocator, aborting (a crash libFuzzer saves) on an allocation above [`MAX_ALLOC`].
pub struct CappedAlloc;

fn check(size: usize) {
    if size > MAX_ALLOC {
        // No formatting here: it would allocate inside the allocator.
        let _ = std::io::stderr().write_all(b"diffmesh-fuzz: one allocation above MAX_ALLOC\n");
        std::process::abort();
    }
}

// SAFETY: every call is forwarded to `System` unchanged, after a size check.
unsafe impl GlobalAlloc for CappedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        check(layout.size());
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        check(layout.size());
        System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        check(new_size);
        System.realloc(ptr, layout, new_size)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

/// With [`SEEDS_ENV`] set: write `seeds()` as files of that folder and exit. Otherwise nothing.
pub fn write_seeds_if_asked(seeds: fn() -> Vec<(String, Vec<u8>)>) {
    let Some(dir) = std::env::var_os(SEEDS_ENV) else {
        return;
    };
    let dir = Path::new(&dir);
    let written = std::fs::create_dir_all(dir).and_then(|()| {
        let all = seeds();
        for (i, (name, bytes)) in all.iter().enumerate() {
            std::fs::write(dir.join(format!("seed-{i:02}-{name}")), bytes)?;
        }
        Ok(all.len())
    });
    match written {
        Ok(n) => {
            eprintln!("{n} seeds written to {}", dir.display());
            std::process::exit(0)
        }
        Err(e) => {
            eprintln!("writing seeds to {} failed: {e}", dir.display());
            std::process::exit(2)
        }
    }
}
