//! Result URLs (`response_format: "url"`): a job's result at `/v1/jobs/{id}/result/{n}` with
//! `expires` (Unix seconds) and `signature` (HMAC-SHA256 of the job, index and expiry under the
//! gateway's URL key) in the query, readable without an API key until it expires; without them
//! the result needs the owner's key, as before. Gateways behind one load balancer must share
//! `--result-url-key` (a gateway without it signs with a random key of its own: its URLs work
//! only on it, and not after a restart).
use crate::error::ApiError;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::time::Duration;

type HmacSha256 = Hmac<Sha256>;

/// Signs and checks result URLs.
#[derive(Clone)]
pub struct ResultUrls {
    key: Vec<u8>,
    ttl: Duration,
}

/// The query of a signed result URL.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Signed {
    pub expires: u64,
    pub signature: String,
}

impl ResultUrls {
    /// Signing with `key` (any bytes; None: a random key of this process), URLs valid for
    /// `ttl`.
    pub fn new(key: Option<&str>, ttl: Duration) -> Self {
        let key = match key {
            Some(k) => k.as_bytes().to_vec(),
            // Two v4 UUIDs: 244 random bits from the OS.
            None => [uuid::Uuid::new_v4(), uuid::Uuid::new_v4()]
                .iter()
                .flat_map(|u| u.into_bytes())
                .collect(),
        };
        Self { key, ttl }
    }

    fn mac(&self, job_id: &str, index: usize, expires: u64) -> HmacSha256 {
        // Any key length is valid for HMAC.
        let mut mac = HmacSha256::new_from_slice(&self.key).expect("HMAC takes keys of any length");
        mac.update(format!("{job_id}/{index}/{expires}").as_bytes());
        mac
    }

    /// The path and query of result `index` of `job_id`, valid until `now_s + ttl`.
    pub fn path(&self, job_id: &str, index: usize, now_s: u64) -> String {
        let expires = now_s + self.ttl.as_secs();
        let signature = B64.encode(self.mac(job_id, index, expires).finalize().into_bytes());
        format!("/v1/jobs/{job_id}/result/{index}?expires={expires}&signature={signature}")
    }

    /// Whether `signed` lets anyone read result `index` of `job_id` at `now_s` (401 naming
    /// `signature` when forged or expired).
    pub fn check(
        &self,
        job_id: &str,
        index: usize,
        signed: &Signed,
        now_s: u64,
    ) -> Result<(), ApiError> {
        let refuse = |message: &str| ApiError::Unauthorized {
            message: format!("signature: {message}"),
        };
        if signed.expires < now_s {
            return Err(refuse("this result URL has expired"));
        }
        let given = B64
            .decode(&signed.signature)
            .map_err(|_| refuse("not URL-safe base64"))?;
        self.mac(job_id, index, signed.expires)
            .verify_slice(&given)
            .map_err(|_| refuse("does not match this result"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(path: &str) -> Signed {
        let q = path.split_once('?').unwrap().1;
        let mut parts = q.split('&').map(|kv| kv.split_once('=').unwrap().1);
        Signed {
            expires: parts.next().unwrap().parse().unwrap(),
            signature: parts.next().unwrap().to_string(),
        }
    }

    #[test]
    fn urls_open_their_result_until_they_expire_and_nothing_else() {
        let urls = ResultUrls::new(Some("k"), Duration::from_secs(60));
        let path = urls.path("job", 1, 1_000);
        assert!(path.starts_with("/v1/jobs/job/result/1?expires=1060&signature="));
        let signed = query(&path);
        assert!(urls.check("job", 1, &signed, 1_030).is_ok());
        assert!(urls.check("job", 1, &signed, 1_061).is_err(), "expired");
        assert!(
            urls.check("job", 0, &signed, 1_030).is_err(),
            "another result"
        );
        assert!(
            urls.check("other", 1, &signed, 1_030).is_err(),
            "another job"
        );
        let later = Signed {
            expires: signed.expires + 1000,
            ..signed.clone()
        };
        assert!(
            urls.check("job", 1, &later, 1_030).is_err(),
            "a moved expiry"
        );
        let other_key = ResultUrls::new(Some("k2"), Duration::from_secs(60));
        assert!(other_key.check("job", 1, &signed, 1_030).is_err());
    }
}
