//! The gateway reads each upload's size from its header (`upload::image_size`) before anything
//! else. A PNG header may carry an ICC profile the decoder inflates while it reads it: a 600 KB
//! upload whose profile inflates to 600 MiB must not cost that much memory. A counting allocator
//! measures it.
use std::io::{Cursor, Read};

use diffmesh_gateway::upload::image_size;
use diffmesh_shared::testing::peak_alloc::{peak_of, PeakAlloc};
use image::ImageFormat;

// This file has one test, so nothing else allocates while it measures.
#[global_allocator]
static ALLOC: PeakAlloc = PeakAlloc;

const MIB: usize = 1 << 20;

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend((data.len() as u32).to_be_bytes());
    let start = out.len();
    out.extend(kind);
    out.extend(data);
    let crc = crc32fast::hash(&out[start..]);
    out.extend(crc.to_be_bytes());
}

fn zlib_zeros(len: u64) -> Vec<u8> {
    let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::best());
    std::io::copy(&mut std::io::repeat(0).take(len), &mut z).unwrap();
    z.finish().unwrap()
}

/// A 1x1 RGBA PNG whose iCCP chunk inflates to `profile` bytes.
fn profile_bomb(profile: u64) -> Vec<u8> {
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = 1u32.to_be_bytes().to_vec();
    ihdr.extend(1u32.to_be_bytes());
    ihdr.extend([8, 6, 0, 0, 0]);
    chunk(&mut out, b"IHDR", &ihdr);
    let mut iccp = b"bomb\0\0".to_vec();
    iccp.extend(zlib_zeros(profile));
    chunk(&mut out, b"iCCP", &iccp);
    chunk(&mut out, b"IDAT", &zlib_zeros(5));
    chunk(&mut out, b"IEND", &[]);
    out
}

#[test]
fn a_profile_bomb_costs_the_header_read_a_bounded_allocation() {
    let bytes = profile_bomb(600 << 20);
    assert!(bytes.len() < 2 * MIB, "{} bytes", bytes.len());
    // The control: the image crate's default limits let the header read inflate it.
    let (_, unbounded) = peak_of(|| {
        image::ImageReader::with_format(Cursor::new(&bytes), ImageFormat::Png).into_dimensions()
    });
    assert!(
        unbounded > 256 * MIB,
        "the bomb held only {unbounded} bytes"
    );
    let (size, peak) = peak_of(|| image_size(&bytes, "image"));
    assert_eq!(size.unwrap(), (1, 1));
    assert!(peak < 64 * MIB, "the header read held {peak} bytes");
}
