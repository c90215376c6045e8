//! Crafted multipart bodies against the gateway's form readers: 10,000 parts, many empty or
//! nameless parts, parts without a disposition, a body cut short. Each is refused with a 4xx
//! naming `body`, at once; the last test sends the 10,000 parts through a running gateway.
//! The readers get the body as a stream of chunks with no length, as a chunked upload arrives.
use std::io::Cursor;
use std::time::{Duration, Instant};

use actix_multipart::Multipart;
use actix_web::error::PayloadError;
use actix_web::http::header::{HeaderMap, HeaderValue, CONTENT_TYPE};
use actix_web::ResponseError;
use bytes::Bytes;
use diffmesh_gateway::api::image_request::read_edit_form;
use diffmesh_gateway::error::ApiError;
use diffmesh_gateway::request_limits::{Defaults, Limits};
use diffmesh_gateway::upload::MAX_PARTS;
use diffmesh_gateway::{loras, start, templates, GatewayConfig};
use diffmesh_shared::testing::NatsServer;
use serde_json::Value;

const BOUNDARY: &str = "hostile-boundary";
const MAX_BODY: usize = 8 * 1024 * 1024;

fn png(w: u32, h: u32) -> Vec<u8> {
    let img = image::DynamicImage::ImageRgb8(image::RgbImage::new(w, h));
    let mut out = Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

/// A form-data part (`name` `None`: no Content-Disposition at all).
fn part(name: Option<&str>, content: &[u8]) -> Vec<u8> {
    let mut out = format!("--{BOUNDARY}\r\n").into_bytes();
    if let Some(name) = name {
        out.extend(format!("Content-Disposition: form-data; name=\"{name}\"\r\n").as_bytes());
    }
    out.extend(b"\r\n");
    out.extend(content);
    out.extend(b"\r\n");
    out
}

fn body(parts: impl IntoIterator<Item = Vec<u8>>) -> Vec<u8> {
    let mut out: Vec<u8> = parts.into_iter().flatten().collect();
    out.extend(format!("--{BOUNDARY}--\r\n").as_bytes());
    out
}

/// `n` empty text parts with distinct names.
fn empty_parts(n: usize) -> impl Iterator<Item = Vec<u8>> {
    (0..n).map(|i| part(Some(&format!("x{i}")), b""))
}

/// The body as a multipart stream in 1000-byte chunks, no length given.
fn multipart(body: &[u8]) -> Multipart {
    multipart_with(BOUNDARY, body)
}

fn multipart_with(boundary: &str, body: &[u8]) -> Multipart {
    let mut headers = HeaderMap::new();
    let content_type = format!("multipart/form-data; boundary={boundary}");
    headers.insert(CONTENT_TYPE, HeaderValue::from_str(&content_type).unwrap());
    let chunks: Vec<Result<Bytes, PayloadError>> = body
        .chunks(1000)
        .map(|c| Ok(Bytes::copy_from_slice(c)))
        .collect();
    Multipart::new(&headers, futures::stream::iter(chunks))
}

fn limits() -> Limits {
    Limits {
        max_n: 4,
        min_steps: 1,
        max_steps: 50,
        max_guidance: 30.0,
        max_pixels: 1 << 20,
        max_prompt_chars: 1000,
    }
}

fn defaults() -> Defaults {
    Defaults {
        steps: 4,
        guidance: 3.5,
        true_cfg: 1.0,
        width: 64,
        height: 64,
    }
}

/// The outcome of each form reader (edit, template, LoRA) on `body`.
fn read_all(body: &[u8]) -> [Result<(), ApiError>; 3] {
    futures::executor::block_on(async {
        [
            read_edit_form(multipart(body), MAX_BODY).await.map(drop),
            templates::form::read(multipart(body), MAX_BODY, &limits(), &defaults())
                .await
                .map(drop),
            loras::form::read(multipart(body), MAX_BODY, &std::env::temp_dir())
                .await
                .map(drop),
        ]
    })
}

/// Every reader refuses `body` with a 400 naming `field` whose message contains `says`, at once.
fn refused(body: &[u8], field: &str, says: &str) {
    let started = Instant::now();
    for (form, result) in ["edit", "template", "lora"].iter().zip(read_all(body)) {
        let e = result.expect_err(form);
        assert_eq!(e.status_code().as_u16(), 400, "{form}: {e}");
        match &e {
            ApiError::Invalid(f) => {
                assert_eq!(f.field, field, "{form}: {e}");
                assert!(f.message.contains(says), "{form}: {e}");
            }
            other => panic!("{form}: expected an invalid {field}, got {other:?}"),
        }
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn ten_thousand_parts_are_refused_naming_the_limit() {
    let too_many = format!("more than {MAX_PARTS} parts");
    refused(&body(empty_parts(10_000)), "body", &too_many);
    // Nameless parts count the same; parts without a disposition are malformed from the first.
    refused(
        &body((0..10_000).map(|_| part(Some(""), b""))),
        "body",
        &too_many,
    );
    refused(
        &body((0..10_000).map(|_| part(None, b"x"))),
        "body",
        "malformed",
    );
}

#[test]
fn up_to_the_part_limit_a_form_is_read() {
    let at_limit = body(empty_parts(MAX_PARTS));
    let form = futures::executor::block_on(read_edit_form(multipart(&at_limit), MAX_BODY))
        .expect("MAX_PARTS parts are fine");
    assert_eq!(form.text.len(), MAX_PARTS);
    let too_many = format!("more than {MAX_PARTS} parts");
    refused(&body(empty_parts(MAX_PARTS + 1)), "body", &too_many);
}

#[test]
fn a_body_cut_short_or_without_boundaries_is_refused() {
    // Cut inside a part: the part being read is named.
    let whole = body([part(Some("prompt"), b"a red circle on the left")]);
    refused(
        &whole[..whole.len() - 30],
        "prompt",
        "reading the upload failed",
    );
    // Headers that never end, and no boundary at all.
    let mut endless =
        format!("--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"a\"\r\n").into_bytes();
    endless.extend(std::iter::repeat_n(b"X-Filler: y\r\n".as_slice(), 5_000).flatten());
    refused(&endless, "body", "malformed");
    refused(&vec![b'a'; 100_000], "body", "malformed");
}

/// actix-multipart 0.7.2 panicked on these (a boundary under 4 characters and a short first
/// line), which took down the server worker; 0.8 refuses them.
#[test]
fn short_boundaries_are_a_400() {
    for (boundary, body) in [("", "\n"), ("a", "\n"), ("ab", "--\n"), ("abc", "--\n")] {
        let results = futures::executor::block_on(async {
            [
                read_edit_form(multipart_with(boundary, body.as_bytes()), MAX_BODY)
                    .await
                    .map(drop),
                loras::form::read(
                    multipart_with(boundary, body.as_bytes()),
                    MAX_BODY,
                    &std::env::temp_dir(),
                )
                .await
                .map(drop),
            ]
        });
        for result in results {
            match result {
                Err(ApiError::Invalid(f)) => assert_eq!(f.field, "body", "{boundary:?}"),
                other => panic!("boundary {boundary:?}: {other:?}"),
            }
        }
    }
}

/// A body that ends inside a boundary: actix-multipart 0.7.2 waited for the rest forever (no
/// more data would ever wake it), holding the request; it is an error now, at once.
#[test]
fn a_body_ending_inside_a_boundary_is_refused_not_waited_on() {
    let mut cut =
        format!("--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\n")
            .into_bytes();
    cut.extend(format!("a red circle\r\n--{}", &BOUNDARY[..8]).as_bytes());
    let (done, outcome) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(read_all(&cut).map(|r| r.map_err(|e| e.to_string())));
    });
    let outcomes = outcome
        .recv_timeout(Duration::from_secs(10))
        .expect("the readers answered within 10 s");
    for (form, result) in ["edit", "template", "lora"].iter().zip(outcomes) {
        let e = result.expect_err(form);
        assert!(e.contains("prompt"), "{form}: {e}");
    }
}

/// Through a running gateway: an edit with a valid image, mask and prompt followed by 10,000
/// empty parts is a 400 naming `body` (it used to be read whole and sent on as a job).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_gateway_answers_ten_thousand_parts_with_400() {
    let nats = NatsServer::start();
    let mut config = GatewayConfig::for_tests(nats.url());
    config.submit_wait = Duration::from_millis(500);
    let gateway = start(config).await.expect("gateway");
    let image = png(8, 8);
    let request = body(
        [
            part(Some("image"), &image),
            part(Some("mask"), &image),
            part(Some("prompt"), b"a red circle"),
        ]
        .into_iter()
        .chain(empty_parts(10_000)),
    );
    let started = Instant::now();
    let r = reqwest::Client::new()
        .post(format!("http://{}/v1/images/edits", gateway.addr))
        .header(
            "content-type",
            format!("multipart/form-data; boundary={BOUNDARY}"),
        )
        .body(request)
        .send()
        .await
        .unwrap();
    let (status, body) = (r.status().as_u16(), r.json::<Value>().await.unwrap());
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["field"], "body", "{body}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}
