//! Crafted uploads against the codec's decoder (`imaging::decode_upload`, which the image and
//! the mask of every job go through): a PNG header claiming 100000x100000, a pixel bomb (a small
//! PNG whose pixels would inflate to gigabytes), a profile bomb (a 1x1 PNG whose embedded ICC
//! profile inflates to 600 MiB), truncated and oversized JPEGs. Each is answered with a field
//! error, quickly, and without allocating what the file claims: a counting allocator measures it.
use std::io::{Cursor, Read};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use diffmesh_codec::imaging::{decode_upload, MAX_SIDE_ALLOC};
use diffmesh_shared::testing::peak_alloc::{peak_of, PeakAlloc};
use image::{DynamicImage, ImageFormat, RgbImage};

#[global_allocator]
static ALLOC: PeakAlloc = PeakAlloc;

/// One test at a time: the tests of this file run on parallel threads, and another test's
/// allocations would count in a measurement.
fn serial() -> MutexGuard<'static, ()> {
    static ONE: Mutex<()> = Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

/// `f`'s result, the most bytes it held at once beyond what was live before, and its time.
fn measured<T>(f: impl FnOnce() -> T) -> (T, usize, Duration) {
    let started = Instant::now();
    let (out, peak) = peak_of(f);
    (out, peak, started.elapsed())
}

/// The codec's default `--max-pixels`.
const MAX_PIXELS: u64 = 16_777_216;
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

/// An 8-bit RGBA PNG of `width x height` whose IDAT holds `rows` rows of zeros, with an
/// optional iCCP chunk (a zlib stream) before it.
fn png(width: u32, height: u32, rows: u64, iccp: Option<&[u8]>) -> Vec<u8> {
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = width.to_be_bytes().to_vec();
    ihdr.extend(height.to_be_bytes());
    ihdr.extend([8, 6, 0, 0, 0]);
    chunk(&mut out, b"IHDR", &ihdr);
    if let Some(profile) = iccp {
        let mut data = b"bomb\0\0".to_vec();
        data.extend(profile);
        chunk(&mut out, b"iCCP", &data);
    }
    chunk(
        &mut out,
        b"IDAT",
        &zlib_zeros(rows * (1 + 4 * u64::from(width))),
    );
    chunk(&mut out, b"IEND", &[]);
    out
}

fn jpeg(width: u32, height: u32) -> Vec<u8> {
    let img = DynamicImage::ImageRgb8(RgbImage::from_fn(width, height, |x, y| {
        image::Rgb([(x * 7) as u8, (y * 5) as u8, (x ^ y) as u8])
    }));
    let mut out = Cursor::new(Vec::new());
    img.write_to(&mut out, ImageFormat::Jpeg).unwrap();
    out.into_inner()
}

#[test]
fn a_header_claiming_100000_by_100000_is_refused_without_allocating() {
    let _serial = serial();
    let bytes = png(100_000, 100_000, 1, None);
    let (result, peak, elapsed) = measured(|| decode_upload(&bytes, "image", MAX_PIXELS));
    let e = result.unwrap_err();
    assert_eq!(e.field, "image");
    assert!(
        e.message.contains("100000x100000") && e.message.contains("above the limit"),
        "{}",
        e.message
    );
    assert!(peak < MIB, "refusing the header held {peak} bytes");
    assert!(elapsed < Duration::from_secs(1), "{elapsed:?}");
}

#[test]
fn a_pixel_bomb_is_refused_by_the_pixel_limit() {
    let _serial = serial();
    // 60000x60000 RGBA is 14.4 GB of pixels; the file holds 64 compressed rows (a few KiB).
    let bytes = png(60_000, 60_000, 64, None);
    assert!(bytes.len() < 64 * 1024, "{} bytes", bytes.len());
    let (result, peak, elapsed) = measured(|| decode_upload(&bytes, "mask", MAX_PIXELS));
    let e = result.unwrap_err();
    assert_eq!(e.field, "mask");
    assert!(e.message.contains("3600000000 pixels"), "{}", e.message);
    assert!(peak < MIB, "refusing the bomb held {peak} bytes");
    assert!(elapsed < Duration::from_secs(1), "{elapsed:?}");
}

#[test]
fn a_profile_bomb_is_bounded_by_the_side_allocation_limit() {
    let _serial = serial();
    // A 1x1 image whose ICC profile inflates to 600 MiB from under a MiB of file.
    let bytes = png(1, 1, 1, Some(&zlib_zeros(600 << 20)));
    assert!(bytes.len() < 2 * MIB, "{} bytes", bytes.len());
    // The control: with the image crate's default limits the header read alone inflates it.
    let (_, unbounded, _) = measured(|| {
        image::ImageReader::with_format(Cursor::new(&bytes), ImageFormat::Png).into_dimensions()
    });
    assert!(
        unbounded > 256 * MIB,
        "the bomb held only {unbounded} bytes"
    );
    let (result, peak, elapsed) = measured(|| decode_upload(&bytes, "image", MAX_PIXELS));
    // The decoder drops a profile it cannot inflate within its limit; the pixel is fine.
    let image = result.expect("the pixel decodes");
    assert_eq!((image.width(), image.height()), (1, 1));
    let bound = 2 * MAX_SIDE_ALLOC as usize + MIB;
    assert!(peak < bound, "decoding held {peak} bytes, above {bound}");
    assert!(elapsed < Duration::from_secs(5), "{elapsed:?}");
}

#[test]
fn truncated_and_oversized_jpegs_are_refused() {
    let _serial = serial();
    let whole = jpeg(64, 48);
    assert!(decode_upload(&whole, "image", MAX_PIXELS).is_ok());
    // Cut inside the scan (the decoder alone would fill the rest with grey), inside the
    // header, and after a few bytes.
    for keep in [whole.len() - 2, whole.len() / 2, 200, 20] {
        let (result, peak, _) = measured(|| decode_upload(&whole[..keep], "image", MAX_PIXELS));
        let e = result.expect_err(&format!("{keep} of {} bytes decoded", whole.len()));
        assert_eq!(e.field, "image");
        assert!(
            e.message.to_lowercase().contains("jpeg"),
            "{keep} bytes: {}",
            e.message
        );
        assert!(peak < 4 * MIB, "{keep} bytes: held {peak} bytes");
    }
    // A frame header claiming 65500x65500 (4.3 Gpx) in a file of a few hundred bytes.
    let mut huge = whole.clone();
    let sof = huge
        .windows(2)
        .position(|w| w == [0xFF, 0xC0])
        .expect("a baseline frame header");
    huge[sof + 5..sof + 9].copy_from_slice(&[0xFF, 0xDC, 0xFF, 0xDC]);
    let (result, peak, _) = measured(|| decode_upload(&huge, "image", MAX_PIXELS));
    let e = result.unwrap_err();
    assert!(e.message.contains("65500x65500"), "{}", e.message);
    assert!(peak < 4 * MIB, "held {peak} bytes");
}

#[test]
fn the_limit_itself_still_decodes() {
    let _serial = serial();
    // 4096x4096 is the default limit exactly: accepted (the bounds above are not too tight).
    let img = DynamicImage::ImageRgb8(RgbImage::new(4096, 4096));
    let mut bytes = Cursor::new(Vec::new());
    img.write_to(&mut bytes, ImageFormat::Png).unwrap();
    let image = decode_upload(bytes.get_ref(), "image", MAX_PIXELS).expect("at the limit");
    assert_eq!((image.width(), image.height()), (4096, 4096));
}
