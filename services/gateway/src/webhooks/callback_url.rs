//! Which `callback_url`s the gateway posts to. A webhook makes the gateway send a request
//! wherever a caller says, so the default refuses what would reach inside the deployment:
//! plain http, credentials in the URL, and any address that is not public (loopback, private,
//! link-local (cloud metadata services), carrier-grade NAT, multicast, reserved). A name is
//! checked again when a post resolves it ([`PublicResolver`]): a check made only when the job
//! was accepted could be defeated by the name resolving elsewhere by the time of the post.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use diffmesh_shared::wire::messages::FieldError;
use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use reqwest::Url;

/// Longest `callback_url` taken.
pub const MAX_URL_CHARS: usize = 2048;

/// What a callback URL may be.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CallbackPolicy {
    /// Plain http too (a test or a receiver on a trusted network).
    pub allow_http: bool,
    /// Addresses that are not public too (a receiver inside the deployment, tests).
    pub allow_private_addresses: bool,
}

fn invalid(message: impl Into<String>) -> FieldError {
    FieldError::invalid("callback_url", message)
}

impl CallbackPolicy {
    /// `url` as the gateway will post to it, or a 400 naming `callback_url` and why.
    pub fn check(&self, url: &str) -> Result<Url, FieldError> {
        if url.chars().count() > MAX_URL_CHARS {
            return Err(invalid(format!("longer than {MAX_URL_CHARS} characters")));
        }
        let parsed = Url::parse(url).map_err(|e| invalid(format!("not a URL: {e}")))?;
        match parsed.scheme() {
            "https" => {}
            "http" if self.allow_http => {}
            "http" => return Err(invalid(
                "must be https (this gateway posts to plain http only with --webhook-allow-http)",
            )),
            other => return Err(invalid(format!("must be https, not {other}"))),
        }
        if !parsed.username().is_empty() || parsed.password().is_some() {
            return Err(invalid(
                "must not carry credentials (user:password@): receivers check the signature instead",
            ));
        }
        if parsed.fragment().is_some() {
            return Err(invalid("must not have a fragment (#...)"));
        }
        let host = parsed
            .host()
            .ok_or_else(|| invalid("has no host"))?
            .to_owned();
        if !self.allow_private_addresses {
            let refused = match host {
                url::Host::Ipv4(ip) => !is_public(IpAddr::V4(ip)),
                url::Host::Ipv6(ip) => !is_public(IpAddr::V6(ip)),
                url::Host::Domain(name) => {
                    let name = name.trim_end_matches('.').to_ascii_lowercase();
                    name == "localhost" || name.ends_with(".localhost") || !name.contains('.')
                }
            };
            if refused {
                return Err(invalid(
                    "must reach a public address (not loopback, private, link-local or a bare host name)",
                ));
            }
        }
        Ok(parsed)
    }

    /// Whether a post may go to `ip` (a URL's literal address, or what its name resolved to).
    pub fn may_reach(&self, ip: IpAddr) -> bool {
        self.allow_private_addresses || is_public(ip)
    }
}

/// What a request's `callback_url` may be on this gateway.
#[derive(Debug, Clone, Copy)]
pub struct WebhookGate {
    pub policy: CallbackPolicy,
    /// Webhooks are on (a signing key is configured).
    pub enabled: bool,
}

impl WebhookGate {
    /// The URL to keep on the job's record, or a 400 naming `callback_url`.
    pub fn accept(
        &self,
        url: Option<&str>,
        respond_async: bool,
    ) -> Result<Option<String>, FieldError> {
        let Some(url) = url else {
            return Ok(None);
        };
        if !respond_async {
            return Err(FieldError::invalid(
                "callback_url",
                "only with Prefer: respond-async (a synchronous request's answer is the result itself)",
            ));
        }
        if !self.enabled {
            return Err(FieldError::invalid(
                "callback_url",
                "this gateway sends no webhooks (it has no --webhook-signing-key)",
            ));
        }
        self.policy.check(url).map(|u| Some(u.to_string()))
    }
}

/// Whether `ip` is an address of the public internet. IPv6 is public only in global unicast
/// (2000::/3) outside its special blocks; addresses that carry an IPv4 one (mapped,
/// compatible, NAT64, 6to4) are judged by it.
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_public_v4(v4),
        IpAddr::V6(v6) => {
            if let Some(v4) = embedded_v4(v6) {
                return is_public_v4(v4);
            }
            let [first, second, third, ..] = v6.segments();
            (first & 0xe000) == 0x2000
                // Teredo 2001::/32, benchmarking 2001:2::/48, ORCHID 2001:10::/28 and
                // 2001:20::/28, documentation 2001:db8::/32 and 3fff::/20.
                && !(first == 0x2001
                    && (second == 0
                        || (second == 2 && third == 0)
                        || (second & 0xfff0) == 0x10
                        || (second & 0xfff0) == 0x20
                        || second == 0x0db8))
                && !(first == 0x3fff && (second & 0xf000) == 0)
        }
    }
}

/// The IPv4 address inside an IPv4-mapped (::ffff:a.b.c.d), IPv4-compatible (::a.b.c.d),
/// NAT64 (64:ff9b::/96) or 6to4 (2002::/16) IPv6 address, which reaches that IPv4 host.
fn embedded_v4(v6: Ipv6Addr) -> Option<Ipv4Addr> {
    let s = v6.segments();
    let from = |hi: u16, lo: u16| {
        let [a, b] = hi.to_be_bytes();
        let [c, d] = lo.to_be_bytes();
        Ipv4Addr::new(a, b, c, d)
    };
    if let Some(v4) = v6.to_ipv4() {
        return Some(v4);
    }
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return Some(from(s[6], s[7]));
    }
    if s[0] == 0x2002 {
        return Some(from(s[1], s[2]));
    }
    None
}

fn is_public_v4(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    !(ip.is_loopback()
        || ip.is_private()
        || ip.is_link_local()
        || ip.is_unspecified()
        || ip.is_broadcast()
        || ip.is_multicast()
        || ip.is_documentation()
        || a == 0
        // Carrier-grade NAT 100.64.0.0/10, IETF protocol assignments 192.0.0.0/24,
        // benchmarking 198.18.0.0/15, reserved 240.0.0.0/4.
        || (a == 100 && (b & 0xc0) == 64)
        || (a == 192 && b == 0 && c == 0)
        || (a == 198 && (b & 0xfe) == 18)
        || a >= 240)
}

/// The webhook client's resolver: the system's, keeping only addresses [`CallbackPolicy`]
/// lets a post reach; a name with none left fails the post.
#[derive(Debug, Clone, Copy)]
pub struct PublicResolver {
    pub policy: CallbackPolicy,
}

impl Resolve for PublicResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let policy = self.policy;
        Box::pin(async move {
            let host = name.as_str().to_string();
            let found: Vec<SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let allowed: Vec<SocketAddr> = found
                .into_iter()
                .filter(|a| policy.may_reach(a.ip()))
                .collect();
            if allowed.is_empty() {
                return Err(format!("{host} resolves to no public address").into());
            }
            Ok(Box::new(allowed.into_iter()) as Addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_callback_url_needs_an_async_request_and_a_signing_key() {
        let on = WebhookGate {
            policy: CallbackPolicy::default(),
            enabled: true,
        };
        assert_eq!(on.accept(None, false).unwrap(), None);
        assert_eq!(
            on.accept(Some("https://example.com/h"), true)
                .unwrap()
                .as_deref(),
            Some("https://example.com/h")
        );
        let sync = on.accept(Some("https://example.com/h"), false).unwrap_err();
        assert!(sync.message.contains("respond-async"), "{}", sync.message);
        let off = WebhookGate {
            enabled: false,
            ..on
        };
        let err = off.accept(Some("https://example.com/h"), true).unwrap_err();
        assert_eq!(err.field, "callback_url");
        assert!(err.message.contains("--webhook-signing-key"));
    }

    #[test]
    fn only_https_urls_of_public_hosts_pass_by_default() {
        let strict = CallbackPolicy::default();
        assert!(strict
            .check("https://hooks.example.com/diffmesh?x=1")
            .is_ok());
        assert!(strict.check("https://93.184.215.14:8443/h").is_ok());
        for (url, why) in [
            ("http://hooks.example.com/h", "https"),
            ("ftp://hooks.example.com/h", "https"),
            ("https://user:pw@hooks.example.com/h", "credentials"),
            ("https://hooks.example.com/h#frag", "fragment"),
            ("https://localhost/h", "public"),
            ("https://app.localhost/h", "public"),
            ("https://intranet/h", "public"),
            ("https://127.0.0.1/h", "public"),
            ("https://10.1.2.3/h", "public"),
            ("https://169.254.169.254/latest/meta-data", "public"),
            ("https://100.64.0.1/h", "public"),
            ("https://[::1]/h", "public"),
            ("https://[fd00::1]/h", "public"),
            ("https://[::ffff:10.0.0.1]/h", "public"),
            ("https://[::127.0.0.1]/h", "public"),
            ("https://2130706433/h", "public"),
            ("https://0x7f.1/h", "public"),
            ("https://017700000001/h", "public"),
            ("not a url", "not a URL"),
        ] {
            let err = strict.check(url).unwrap_err();
            assert_eq!(err.field, "callback_url");
            assert!(err.message.contains(why), "{url}: {}", err.message);
        }
        let long = format!("https://example.com/{}", "a".repeat(MAX_URL_CHARS));
        assert!(strict.check(&long).is_err());
    }

    #[test]
    fn the_flags_open_http_and_private_addresses() {
        let open = CallbackPolicy {
            allow_http: true,
            allow_private_addresses: true,
        };
        assert!(open.check("http://127.0.0.1:9000/h").is_ok());
        assert!(open.may_reach("10.0.0.1".parse().unwrap()));
        assert!(
            open.check("https://u:p@example.com/h").is_err(),
            "never credentials"
        );
    }

    #[test]
    fn addresses_that_reach_inside_are_not_public() {
        for ip in [
            "127.0.0.1",
            "0.0.0.0",
            "192.168.1.1",
            "172.16.0.1",
            "169.254.169.254",
            "100.100.0.1",
            "198.18.0.1",
            "255.255.255.255",
            "224.0.0.1",
            "::",
            "fe80::1",
            "64:ff9b::a00:1",
            "2002:a00:1::",
            "2001:db8::1",
            "2001::1",
            "2001:2::1",
            "2001:10::1",
            "3fff::1",
            "fec0::1",
            "100::1",
            "64:ff9b:1::1",
            "::ffff:0:0",
        ] {
            assert!(!is_public(ip.parse().unwrap()), "{ip}");
        }
        for ip in [
            "93.184.215.14",
            "1.1.1.1",
            "2606:4700::1111",
            "64:ff9b::101:101",
        ] {
            assert!(is_public(ip.parse().unwrap()), "{ip}");
        }
    }
}
