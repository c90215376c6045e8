//! An upload, as an image and as a mask: the gateway's header read, the codec's decode (through
//! its decoded-image cache), the repaint mask, the token mask on a model grid, the resize to and
//! from the model resolution, the composite and the PNG encode. No input may panic.
#![no_main]

use std::sync::OnceLock;

use diffmesh_codec::decoded::DecodedImages;
use diffmesh_codec::imaging::{self, TokenGrid};
use diffmesh_gateway::upload::image_size;
use diffmesh_shared::wire::models::{ModelGeometry, Resolution};
use libfuzzer_sys::fuzz_target;

#[global_allocator]
static ALLOC: diffmesh_fuzz::CappedAlloc = diffmesh_fuzz::CappedAlloc;

/// Smaller than the codec's default (16 Mpx) so that each run stays fast; the limit is the
/// same code either way.
const MAX_PIXELS: u64 = 1 << 20;

fn decoded() -> &'static DecodedImages {
    static CACHE: OnceLock<DecodedImages> = OnceLock::new();
    CACHE.get_or_init(|| {
        let lookups = prometheus::IntCounterVec::new(
            prometheus::Opts::new("lookups", "decoded-image cache lookups"),
            &["outcome"],
        )
        .expect("counter");
        DecodedImages::new(8 << 20, lookups)
    })
}

fuzz_target!(
    init: diffmesh_fuzz::write_seeds_if_asked(diffmesh_fuzz::seeds::images),
    |data: &[u8]| {
        let header = image_size(data, "image");
        let Ok(image) = decoded().decode(data, "image", MAX_PIXELS) else {
            return;
        };
        // The gateway sizes the output from the header; the codec decoded the same bytes.
        assert_eq!(header.ok(), Some((image.width(), image.height())));
        let mask = imaging::decode_upload(data, "mask", MAX_PIXELS).expect("decoded once already");
        let repaint = imaging::repaint_mask(&image, Some(&mask)).expect("same size");
        let _ = imaging::repaint_mask(&image, None);
        let geometry = ModelGeometry {
            token_pixels: 1 + u32::from(data[data.len() / 2] % 16),
            resolution: Resolution::Scaled { max_pixels: 4096 },
            default_width: 64,
            default_height: 64,
        };
        let (model_width, model_height) = geometry.model_size(image.width(), image.height());
        let grid = TokenGrid {
            model_width,
            model_height,
            token_pixels: geometry.token_pixels,
        };
        let tokens = imaging::token_mask(&repaint, grid);
        assert_eq!(tokens.len(), grid.tokens() as usize);
        assert_eq!(
            repaint.masked_pixels() > 0,
            tokens.contains(&1),
            "a repainted pixel is in a repainted token"
        );
        let rgb = imaging::to_model_rgb(&image, grid);
        let generated = imaging::model_output(rgb, model_width, model_height).expect("model size");
        let resized = imaging::to_output_size(&generated, image.width(), image.height());
        let edited = imaging::composite(&image, &repaint, &resized);
        imaging::encode_png(&edited).expect("an edited image encodes");
    }
);
