//! What the gateway's integration tests share: a blank PNG, the field of an error answer, and a
//! stand-in codec that answers one request.
use std::io::Cursor;

use diffmesh_shared::wire::messages::{
    decode, encode, FieldError, PreprocessReply, PreprocessRequest,
};
use diffmesh_shared::wire::subjects::CODEC_PRE;
use futures::StreamExt;
use serde_json::Value;

pub fn png(w: u32, h: u32) -> Vec<u8> {
    let img = image::DynamicImage::ImageRgb8(image::RgbImage::new(w, h));
    let mut out = Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

/// The error's field, after checking the status and the error's shape.
pub fn field(status: u16, body: &Value, want_status: u16) -> String {
    assert_eq!(status, want_status, "{body}");
    let err = &body["error"];
    assert!(
        err["message"].is_string() && err["error_type"].is_string(),
        "{body}"
    );
    err["field"].as_str().unwrap_or_default().to_string()
}

/// Answer the next codec request as the codec would refuse it (a field error `codec`), so a
/// request that got past the gateway's checks ends there; yields the request it carried.
pub async fn answer_codec_once(
    client: async_nats::Client,
) -> tokio::task::JoinHandle<PreprocessRequest> {
    let mut codec = client.subscribe(CODEC_PRE).await.unwrap();
    client.flush().await.unwrap();
    tokio::spawn(async move {
        let msg = codec.next().await.unwrap();
        let pre: PreprocessRequest = decode(&msg.payload).unwrap();
        let reply = PreprocessReply::Invalid(FieldError::invalid("codec", "seen by the test"));
        client
            .publish(msg.reply.unwrap(), encode(&reply).unwrap().into())
            .await
            .unwrap();
        client.flush().await.unwrap();
        pre
    })
}
