//! `Idempotency-Key`: a repeated key (per API key, for a day) returns the job the first request
//! created instead of starting another. The key is bound to a fingerprint of the request, so
//! reusing it for a different request is refused (422) rather than silently answered with
//! another request's images.
use actix_web::HttpRequest;
use diffmesh_shared::wire::messages::FieldError;
use sha2::{Digest, Sha256};

use crate::auth::Caller;
use crate::error::ApiError;
use crate::validate::RawParams;

pub const HEADER: &str = "Idempotency-Key";
/// Longest key accepted (UUIDs and similar tokens are far shorter).
pub const MAX_KEY_CHARS: usize = 255;

/// A request's idempotency key, scoped to its caller.
#[derive(Debug, Clone, PartialEq)]
pub struct IdempotencyKey {
    /// KV key: hash of the caller and the client's key (hex, so always a valid KV key).
    pub store_key: String,
    /// Hash of the request the key is bound to.
    pub fingerprint: String,
}

fn hex_digest(hasher: Sha256) -> String {
    hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Hash of what a request asks for: the endpoint, its parameters and its uploads.
pub fn fingerprint(
    endpoint: &str,
    raw: &RawParams,
    image: Option<&[u8]>,
    mask: Option<&[u8]>,
) -> String {
    let mut h = Sha256::new();
    h.update(endpoint.as_bytes());
    h.update([0]);
    // Serializing a plain struct of options and numbers cannot fail.
    h.update(serde_json::to_vec(raw).unwrap_or_default());
    for part in [image, mask] {
        match part {
            Some(bytes) => {
                h.update([1]);
                h.update((bytes.len() as u64).to_le_bytes());
                h.update(bytes);
            }
            None => h.update([0]),
        }
    }
    hex_digest(h)
}

/// The request's `Idempotency-Key`, if it has one (400 naming the header when malformed).
pub fn from_request(
    req: &HttpRequest,
    caller: &Caller,
    fingerprint: String,
) -> Result<Option<IdempotencyKey>, ApiError> {
    let Some(value) = req.headers().get(HEADER) else {
        return Ok(None);
    };
    let key = value
        .to_str()
        .ok()
        .map(str::trim)
        .filter(|k| !k.is_empty() && k.len() <= MAX_KEY_CHARS)
        .ok_or_else(|| {
            FieldError::invalid(
                HEADER,
                format!("must be 1 to {MAX_KEY_CHARS} visible ASCII characters"),
            )
        })?;
    let mut h = Sha256::new();
    h.update(caller.limit_key().as_bytes());
    h.update([0]);
    h.update(key.as_bytes());
    Ok(Some(IdempotencyKey {
        store_key: hex_digest(h),
        fingerprint,
    }))
}

/// 422 for a key reused with another request.
pub fn mismatch(job_id: &str) -> ApiError {
    ApiError::IdempotencyMismatch {
        message: format!(
            "this Idempotency-Key was used for a different request (job {job_id}); \
             use a new key for a new request"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::test::TestRequest;

    fn raw(prompt: &str) -> RawParams {
        RawParams {
            prompt: Some(prompt.into()),
            ..Default::default()
        }
    }

    #[test]
    fn fingerprints_tell_requests_apart() {
        let a = fingerprint("edits", &raw("x"), Some(b"img"), None);
        assert_eq!(a, fingerprint("edits", &raw("x"), Some(b"img"), None));
        assert_ne!(a, fingerprint("edits", &raw("y"), Some(b"img"), None));
        assert_ne!(a, fingerprint("edits", &raw("x"), Some(b"img2"), None));
        assert_ne!(a, fingerprint("generations", &raw("x"), Some(b"img"), None));
        // The image/mask boundary is part of the hash.
        assert_ne!(
            fingerprint("edits", &raw("x"), Some(b"ab"), Some(b"c")),
            fingerprint("edits", &raw("x"), Some(b"a"), Some(b"bc"))
        );
    }

    #[test]
    fn keys_are_scoped_per_caller_and_validated() {
        let req = TestRequest::default()
            .insert_header((HEADER, "order-17"))
            .to_http_request();
        let alice = from_request(&req, &Caller::Key("alice".into()), "f".into())
            .unwrap()
            .unwrap();
        let bob = from_request(&req, &Caller::Key("bob".into()), "f".into())
            .unwrap()
            .unwrap();
        assert_ne!(alice.store_key, bob.store_key);
        assert!(alice.store_key.chars().all(|c| c.is_ascii_hexdigit()));

        let none = TestRequest::default().to_http_request();
        assert_eq!(
            from_request(&none, &Caller::Anonymous, "f".into()).unwrap(),
            None
        );

        let long = TestRequest::default()
            .insert_header((HEADER, "k".repeat(300)))
            .to_http_request();
        match from_request(&long, &Caller::Anonymous, "f".into()).unwrap_err() {
            ApiError::Invalid(e) => assert_eq!(e.field, HEADER),
            other => panic!("{other:?}"),
        }
    }
}
