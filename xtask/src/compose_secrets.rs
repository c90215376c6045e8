//! `cargo xtask compose-secrets`: everything `compose/docker-compose.yml` refuses to start
//! without, written into `compose/secrets/` (ignored by git): the NATS users with their
//! permissions (`shared::nats::auth`), a private CA and the NATS servers' certificate for TLS
//! between services and across the cluster (`shared::nats::tls`), one env file per service
//! (its NATS user and password; the gateway's first API key; the router's admin key),
//! Grafana's admin password, and the operator's own `operator.env`.
use crate::mesh::write_private;
use crate::toolchain::workspace_root;
use diffmesh_shared::nats::auth::{mesh_users, random_password, server_config, Role};
use diffmesh_shared::nats::tls::mesh_certificates;
use std::path::{Path, PathBuf};

#[derive(clap::Args)]
pub struct ComposeSecretsArgs {
    /// Folder to write, relative to the workspace root (docker-compose.yml reads
    /// compose/secrets).
    #[arg(long, default_value = "compose/secrets")]
    out: PathBuf,
    /// Replace secrets that exist (then restart the whole stack: old passwords stop working).
    #[arg(long)]
    force: bool,
}

/// The names the NATS servers answer to: the compose service names, the network alias, and
/// this machine for an operator on the published port.
const NATS_HOSTS: &[&str] = &[
    "nats",
    "nats-1",
    "nats-2",
    "nats-3",
    "localhost",
    "127.0.0.1",
];

pub fn compose_secrets(args: ComposeSecretsArgs) -> anyhow::Result<()> {
    let dir = workspace_root().join(&args.out);
    let nats_dir = dir.join("nats");
    anyhow::ensure!(
        args.force || !nats_dir.join("users.conf").exists(),
        "{} holds secrets already: a running stack uses them (--force replaces them all)",
        dir.display()
    );
    std::fs::create_dir_all(&nats_dir)?;

    let users = mesh_users()?;
    write_private(&nats_dir.join("users.conf"), &server_config(&users))?;
    let certs = mesh_certificates(NATS_HOSTS)?;
    // The CA and the certificate are public; the key stays the servers' own.
    write_public(&nats_dir.join("ca.pem"), &certs.ca_cert_pem)?;
    write_public(&nats_dir.join("server-cert.pem"), &certs.server_cert_pem)?;
    write_private(&nats_dir.join("server-key.pem"), &certs.server_key_pem)?;

    let api_key = format!("dm-{}", random_password()?);
    let admin_key = random_password()?;
    let grafana = random_password()?;
    let password_of = |name: &str| {
        users
            .iter()
            .find(|u| u.name == name)
            .map(|u| u.password.clone())
            .expect("mesh_users has a user per role and the operator")
    };
    for role in Role::ALL {
        let name = role.name();
        let mut env = format!("NATS_USER={name}\nNATS_PASSWORD={}\n", password_of(name));
        match role {
            // `operator` names the key in logs and job records (`name:key`).
            Role::Gateway => env.push_str(&format!("GATEWAY_API_KEYS=operator:{api_key}\n")),
            Role::Router => env.push_str(&format!("ROUTER_ADMIN_KEY={admin_key}\n")),
            _ => {}
        }
        write_private(&dir.join(format!("{name}.env")), &env)?;
    }
    write_private(
        &dir.join("grafana.env"),
        &format!("GF_SECURITY_ADMIN_PASSWORD={grafana}\n"),
    )?;
    let ca = std::fs::canonicalize(nats_dir.join("ca.pem"))?;
    write_private(
        &dir.join("operator.env"),
        &format!(
            "# `set -a; . {}` before talking to the stack from this machine.\n\
             NATS_URL=tls://127.0.0.1:4222\nNATS_USER=admin\nNATS_PASSWORD={}\nNATS_CA_FILE={}\n\
             DIFFMESH_API_KEY={api_key}\nROUTER_ADMIN_KEY={admin_key}\nGRAFANA_ADMIN_PASSWORD={grafana}\n",
            dir.join("operator.env").display(),
            password_of("admin"),
            ca.display()
        ),
    )?;
    println!(
        "wrote {} (keep it private; it is ignored by git):",
        dir.display()
    );
    println!("  nats/users.conf, nats/server-key.pem: NATS users and the servers' TLS key (0600)");
    println!("  nats/ca.pem, nats/server-cert.pem: the mesh's CA and the servers' certificate");
    println!(
        "  <service>.env: each service's NATS user; the gateway's API key, the router's admin key"
    );
    println!("  grafana.env, operator.env: Grafana's admin password; all of the above for you");
    println!(
        "the clients' API key is DIFFMESH_API_KEY in {} (set -a; . that file; then curl -H \
         \"Authorization: Bearer $DIFFMESH_API_KEY\" ...)",
        dir.join("operator.env").display()
    );
    Ok(())
}

/// Write `text` readable by everyone (certificates), replacing the file.
fn write_public(path: &Path, text: &str) -> anyhow::Result<()> {
    std::fs::write(path, text)?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644))?;
    Ok(())
}
