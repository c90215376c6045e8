//! Small valid inputs each target starts from: images of every accepted format, multipart bodies
//! of each form, a LoRA file, prompts. Made by code at run time, so nothing binary is checked in.
use std::io::Cursor;

use diffmesh_shared::wire::lora::{write_f32_safetensors, METADATA_KEY};
use image::{DynamicImage, ImageFormat, Rgb, RgbImage, Rgba, RgbaImage};

pub type Seeds = Vec<(String, Vec<u8>)>;

fn encoded(image: &DynamicImage, format: ImageFormat) -> Vec<u8> {
    let mut out = Cursor::new(Vec::new());
    image
        .write_to(&mut out, format)
        .expect("a small image encodes");
    out.into_inner()
}

fn rgb(w: u32, h: u32) -> DynamicImage {
    DynamicImage::ImageRgb8(RgbImage::from_fn(w, h, |x, y| {
        Rgb([(x * 40) as u8, (y * 60) as u8, ((x ^ y) * 30) as u8])
    }))
}

/// A mask with transparent pixels (the OpenAI convention), and a grey one.
fn masks() -> [DynamicImage; 2] {
    let rgba = RgbaImage::from_fn(6, 4, |x, _| {
        Rgba([255, 255, 255, if x < 2 { 0 } else { 255 }])
    });
    [DynamicImage::ImageRgba8(rgba), rgb(6, 4).grayscale()]
}

/// PNG (RGB, RGBA, grey, 16-bit), JPEG and WebP images of a few pixels.
pub fn images() -> Seeds {
    let [alpha_mask, grey_mask] = masks();
    let wide16 = DynamicImage::ImageRgb16(image::ImageBuffer::from_fn(5, 2, |x, _| {
        Rgb([x as u16 * 9000, 1, 65535])
    }));
    vec![
        ("rgb.png".into(), encoded(&rgb(6, 4), ImageFormat::Png)),
        (
            "alpha-mask.png".into(),
            encoded(&alpha_mask, ImageFormat::Png),
        ),
        (
            "grey-mask.png".into(),
            encoded(&grey_mask, ImageFormat::Png),
        ),
        ("rgb16.png".into(), encoded(&wide16, ImageFormat::Png)),
        ("rgb.jpg".into(), encoded(&rgb(9, 7), ImageFormat::Jpeg)),
        ("rgba.webp".into(), encoded(&alpha_mask, ImageFormat::WebP)),
    ]
}

/// The boundary of the seed bodies.
const BOUNDARY: &str = "XyZ0123";

/// A form's fuzz input: the selector byte (which form reads it), the `Content-Type` line, then
/// the body.
fn form(selector: u8, parts: &[(&str, Option<&str>, &[u8])]) -> Vec<u8> {
    let mut out = vec![selector];
    out.extend(format!("multipart/form-data; boundary={BOUNDARY}\n").as_bytes());
    for (name, filename, content) in parts {
        out.extend(format!("--{BOUNDARY}\r\n").as_bytes());
        let disposition = match filename {
            Some(f) => format!("form-data; name=\"{name}\"; filename=\"{f}\""),
            None => format!("form-data; name=\"{name}\""),
        };
        out.extend(format!("Content-Disposition: {disposition}\r\n\r\n").as_bytes());
        out.extend(*content);
        out.extend(b"\r\n");
    }
    out.extend(format!("--{BOUNDARY}--\r\n").as_bytes());
    out
}

/// A LoRA file of one adapted layer, with diffusers' metadata, and one with a kohya alpha.
pub fn loras() -> Seeds {
    let q = "transformer.transformer_blocks.0.attn.to_q";
    let tensors = vec![
        (format!("{q}.lora_A.weight"), vec![2, 4], vec![0.5; 8]),
        (format!("{q}.lora_B.weight"), vec![3, 2], vec![0.25; 6]),
    ];
    let metadata = [(
        METADATA_KEY.to_string(),
        r#"{"transformer.r": 2, "transformer.lora_alpha": 4, "transformer.rank_pattern": {"to_q": 2}}"#
            .to_string(),
    )];
    let with_metadata = write_f32_safetensors(&tensors, Some(metadata.into_iter().collect()))
        .expect("seed LoRA writes");
    let mut alpha = tensors;
    alpha.push((format!("{q}.alpha"), vec![1], vec![2.0]));
    let with_alpha = write_f32_safetensors(&alpha, None).expect("seed LoRA writes");
    vec![
        ("peft.safetensors".into(), with_metadata),
        ("alpha.safetensors".into(), with_alpha),
    ]
}

/// One body per form (edit, template, LoRA; the first byte picks it), with uploads and text.
pub fn multipart() -> Seeds {
    let png = encoded(&rgb(6, 4), ImageFormat::Png);
    let mask = encoded(&masks()[0], ImageFormat::Png);
    let lora = loras().remove(0).1;
    let edit = form(
        0,
        &[
            ("image", Some("in.png"), &png),
            ("mask", Some("mask.png"), &mask),
            ("prompt", None, b"a yellow square"),
            ("n", None, b"2"),
            ("size", None, b"64x64"),
            ("response_format", None, b"b64_json"),
            ("loras", None, br#"[{"id":"lora-1","scale":0.5}]"#),
        ],
    );
    let by_template = form(
        0,
        &[
            ("template_id", None, b"tpl-1"),
            ("mask", Some("mask.png"), &mask),
            ("prompt", None, b"a red circle"),
        ],
    );
    let template = form(
        1,
        &[
            ("image", Some("t.png"), &png),
            ("prompt", None, b"a blue background"),
            ("seed", None, b"7"),
            ("num_inference_steps", None, b"4"),
            ("guidance_scale", None, b"3.5"),
        ],
    );
    let lora = form(
        2,
        &[
            ("weights", Some("l.safetensors"), &lora),
            ("name", None, b"outline"),
        ],
    );
    let empty_parts = form(1, &[("", None, b""), ("x", None, b""), ("x", None, b"")]);
    vec![
        ("edit".into(), edit),
        ("edit-template".into(), by_template),
        ("template".into(), template),
        ("lora".into(), lora),
        ("empty-parts".into(), empty_parts),
    ]
}

/// Prompts (after the byte that sets the padded length): plain, in-vocabulary, unicode, empty.
pub fn prompts() -> Seeds {
    let prompt = |len: u8, text: &str| {
        let mut out = vec![len];
        out.extend(text.as_bytes());
        out
    };
    vec![
        ("plain".into(), prompt(75, "a red circle on the left")),
        ("vocab".into(), prompt(10, "ab a b <|endoftext|> ab")),
        ("unicode".into(), prompt(30, "Ünïcödé  \t\n 日本語 🎨 ﬁ")),
        ("empty".into(), prompt(2, "")),
    ]
}
