//! A multipart request to each form the gateway reads (the first byte picks the edit, template
//! or LoRA form), its `Content-Type` (the first line, boundary included) and body (the rest, in
//! chunks of a fuzzed size, as a client's packets arrive). Any refusal must be a 4xx.
#![no_main]

use actix_multipart::Multipart;
use actix_web::error::PayloadError;
use actix_web::http::header::{HeaderMap, HeaderValue, CONTENT_TYPE};
use actix_web::ResponseError;
use bytes::Bytes;
use diffmesh_gateway::api::image_request::read_edit_form;
use diffmesh_gateway::error::ApiError;
use diffmesh_gateway::request_limits::{Defaults, Limits};
use diffmesh_gateway::{loras, templates};
use libfuzzer_sys::fuzz_target;

#[global_allocator]
static ALLOC: diffmesh_fuzz::CappedAlloc = diffmesh_fuzz::CappedAlloc;

/// Small limits, so the fuzzer reaches them.
const MAX_BODY_BYTES: usize = 16 * 1024;
const MAX_WEIGHTS_BYTES: usize = 16 * 1024;

const LIMITS: Limits = Limits {
    max_n: 4,
    min_steps: 1,
    max_steps: 50,
    max_guidance: 30.0,
    max_pixels: 1 << 20,
    max_prompt_chars: 1000,
};

const DEFAULTS: Defaults = Defaults {
    steps: 4,
    guidance: 3.5,
    true_cfg: 1.0,
    width: 64,
    height: 64,
};

fn refused_with_4xx(result: Result<(), ApiError>) {
    if let Err(e) = result {
        assert!(
            e.status_code().is_client_error(),
            "{e:?} answered {}",
            e.status_code()
        );
    }
}

fuzz_target!(
    init: diffmesh_fuzz::write_seeds_if_asked(diffmesh_fuzz::seeds::multipart),
    |data: &[u8]| {
        let Some((&selector, rest)) = data.split_first() else {
            return;
        };
        let Some(newline) = rest.iter().position(|&b| b == b'\n') else {
            return;
        };
        let Ok(content_type) = HeaderValue::from_bytes(&rest[..newline]) else {
            return;
        };
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, content_type);
        let chunk = 1 + usize::from(selector >> 2) * 61;
        let chunks: Vec<Result<Bytes, PayloadError>> = rest[newline + 1..]
            .chunks(chunk)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        let payload = Multipart::new(&headers, futures::stream::iter(chunks));
        let read = async {
            match selector % 3 {
                0 => read_edit_form(payload, MAX_BODY_BYTES).await.map(drop),
                1 => templates::form::read(payload, MAX_BODY_BYTES, &LIMITS, &DEFAULTS)
                    .await
                    .map(drop),
                _ => loras::form::read(payload, MAX_WEIGHTS_BYTES, &std::env::temp_dir())
                    .await
                    .map(drop),
            }
        };
        refused_with_4xx(futures::executor::block_on(read));
    }
);
