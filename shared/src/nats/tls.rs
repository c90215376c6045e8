//! Certificates for TLS between the mesh's services and its NATS servers (`cargo xtask
//! compose-secrets` for `compose/`, and the TLS tests): a private CA made here, and one server
//! certificate signed by it for every NATS host name. Services trust only that CA
//! (`--nats-ca-file`), so a server without the CA's signature cannot pose as the mesh's NATS.
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use time::{Duration, OffsetDateTime};

/// How long the certificates are valid: long enough for a deployment, short enough that a
/// leaked key does not stay useful for ever (regenerate and restart before it ends).
pub const VALIDITY_DAYS: i64 = 825;

/// A CA and a server certificate it signed, in PEM.
pub struct MeshCertificates {
    pub ca_cert_pem: String,
    pub server_cert_pem: String,
    pub server_key_pem: String,
}

/// Make a CA and a server certificate for `hosts` (DNS names or IP addresses), which are
/// also the names a route between cluster nodes presents (client and server use).
pub fn mesh_certificates(hosts: &[&str]) -> Result<MeshCertificates, rcgen::Error> {
    let now = OffsetDateTime::now_utc();
    // A day back: clocks of the containers may differ a little.
    let (not_before, not_after) = (now - Duration::days(1), now + Duration::days(VALIDITY_DAYS));

    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.distinguished_name
        .push(DnType::CommonName, "diffmesh NATS CA");
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    (ca.not_before, ca.not_after) = (not_before, not_after);
    let ca_cert = ca.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca, ca_key);

    let server_key = KeyPair::generate()?;
    let names: Vec<String> = hosts.iter().map(|h| h.to_string()).collect();
    let mut server = CertificateParams::new(names)?;
    server
        .distinguished_name
        .push(DnType::CommonName, hosts.first().copied().unwrap_or("nats"));
    server.use_authority_key_identifier_extension = true;
    server.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    server.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    (server.not_before, server.not_after) = (not_before, not_after);
    let server_cert = server.signed_by(&server_key, &issuer)?;
    Ok(MeshCertificates {
        ca_cert_pem: ca_cert.pem(),
        server_cert_pem: server_cert.pem(),
        server_key_pem: server_key.serialize_pem(),
    })
}

/// The `tls { ... }` block of a `nats-server` config for client connections, with the three
/// files at these paths; `timeout` leaves a slow container time for the handshake.
pub fn server_tls_block(cert_file: &str, key_file: &str, ca_file: &str) -> String {
    format!(
        "tls {{\n  cert_file: {cert_file:?}\n  key_file: {key_file:?}\n  ca_file: {ca_file:?}\n  timeout: 5\n}}\n"
    )
}
