//! Webhook signatures as Standard Webhooks (standardwebhooks.com, what OpenAI's own webhooks
//! use) define them: `webhook-signature: v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">`,
//! one such entry per key, space-separated, so receivers can move to a new key while the old
//! one still verifies. The libraries of that standard verify these headers as they are.
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// The secrets' prefix in Standard Webhooks: `whsec_` then the key in base64.
const SECRET_PREFIX: &str = "whsec_";
/// Fewest and most key bytes taken (Standard Webhooks' bounds; shorter keys are guessable).
const MIN_KEY_BYTES: usize = 24;
const MAX_KEY_BYTES: usize = 64;

/// The keys webhooks are signed with, the first being the newest.
#[derive(Clone)]
pub struct SigningKeys {
    keys: Vec<Vec<u8>>,
}

impl std::fmt::Debug for SigningKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SigningKeys({} keys)", self.keys.len())
    }
}

impl SigningKeys {
    /// Comma-separated keys, each `whsec_<base64>` (the standard's form, which its receiver
    /// libraries take as it is) of 24 to 64 bytes.
    pub fn parse(list: &str) -> Result<Self, String> {
        let mut keys = Vec::new();
        for (i, key) in list.split(',').map(str::trim).enumerate() {
            let b64 = key.strip_prefix(SECRET_PREFIX).ok_or_else(|| {
                format!("key {i}: must be {SECRET_PREFIX} and the key in base64 (Standard Webhooks' form)")
            })?;
            let bytes = B64
                .decode(b64)
                .map_err(|e| format!("key {i}: {SECRET_PREFIX} but not base64: {e}"))?;
            if !(MIN_KEY_BYTES..=MAX_KEY_BYTES).contains(&bytes.len()) {
                return Err(format!(
                    "key {i}: {} bytes; a signing key has {MIN_KEY_BYTES} to {MAX_KEY_BYTES}",
                    bytes.len()
                ));
            }
            keys.push(bytes);
        }
        Ok(Self { keys })
    }

    /// The `webhook-signature` header of `body` sent as message `id` at `timestamp` (Unix
    /// seconds).
    pub fn sign(&self, id: &str, timestamp: u64, body: &[u8]) -> String {
        self.keys
            .iter()
            .map(|key| format!("v1,{}", B64.encode(mac(key, id, timestamp, body))))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

fn mac(key: &[u8], id: &str, timestamp: u64, body: &[u8]) -> Vec<u8> {
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes keys of any length");
    mac.update(format!("{id}.{timestamp}.").as_bytes());
    mac.update(body);
    mac.finalize().into_bytes().to_vec()
}

/// Whether `header` holds a valid signature of `body` under `key`: what a receiver checks
/// (the tests' receiver uses it).
pub fn verify(key: &[u8], id: &str, timestamp: u64, body: &[u8], header: &str) -> bool {
    header.split(' ').any(|entry| {
        entry
            .strip_prefix("v1,")
            .and_then(|sig| B64.decode(sig).ok())
            .is_some_and(|sig| {
                let mut check = HmacSha256::new_from_slice(key).expect("any length");
                check.update(format!("{id}.{timestamp}.").as_bytes());
                check.update(body);
                // Compared in constant time.
                check.verify_slice(&sig).is_ok()
            })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_signs_and_each_verifies_alone() {
        let old = [9u8; 24];
        let new_bytes = [7u8; 32];
        let new = format!("whsec_{}", B64.encode(new_bytes));
        let keys = SigningKeys::parse(&format!("{new}, whsec_{}", B64.encode(old))).unwrap();
        let header = keys.sign("job-1", 1_700_000_000, b"{\"a\":1}");
        assert_eq!(header.split(' ').count(), 2);
        assert!(verify(
            &new_bytes,
            "job-1",
            1_700_000_000,
            b"{\"a\":1}",
            &header
        ));
        assert!(verify(&old, "job-1", 1_700_000_000, b"{\"a\":1}", &header));
        assert!(!verify(
            &new_bytes,
            "job-1",
            1_700_000_001,
            b"{\"a\":1}",
            &header
        ));
        assert!(!verify(
            &new_bytes,
            "job-2",
            1_700_000_000,
            b"{\"a\":1}",
            &header
        ));
        assert!(!verify(
            &new_bytes,
            "job-1",
            1_700_000_000,
            b"{\"a\":2}",
            &header
        ));
        assert!(!verify(
            &[8u8; 32],
            "job-1",
            1_700_000_000,
            b"{\"a\":1}",
            &header
        ));
    }

    /// The example of the Standard Webhooks specification, so any receiver library of the
    /// standard accepts these signatures.
    #[test]
    fn the_standard_s_example_signs_the_same() {
        let keys = SigningKeys::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let body = br#"{"test": 2432232314}"#;
        assert_eq!(
            keys.sign("msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
    }

    #[test]
    fn short_or_malformed_keys_are_refused() {
        let short = format!("whsec_{}", B64.encode([1u8; 16]));
        assert!(SigningKeys::parse(&short).unwrap_err().contains("24 to 64"));
        assert!(SigningKeys::parse("whsec_***")
            .unwrap_err()
            .contains("base64"));
        let plain = "a key of more than twenty-four bytes, not in the standard's form";
        assert!(SigningKeys::parse(plain).unwrap_err().contains("whsec_"));
    }
}
