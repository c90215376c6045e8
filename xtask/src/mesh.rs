//! `cargo xtask up` / `down`: run the whole mesh on this machine.
//!
//! Starts a local `nats-server` with JetStream when none answers at the configured URL, then every
//! service with its log in the run directory. Foreground mode stops everything on Ctrl-C;
//! `--detach` records the process ids for `down`.
use crate::setup::nats_server_binary;
use crate::toolchain::{render, run, workspace_root, Toolchain};
use std::fs::File;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct UpArgs {
    /// Return once every service is ready; stop them later with `cargo xtask down`.
    #[arg(long)]
    detach: bool,
    /// NATS server URL, or several comma-separated (a cluster); a local server is started
    /// when a single URL does not answer.
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    nats_url: String,
    /// Port of the gateway's REST API.
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Interface of the gateway's REST API: 127.0.0.1 (this machine only) by default; another
    /// (0.0.0.0: every interface) needs API keys in GATEWAY_API_KEYS or GATEWAY_API_KEYS_FILE,
    /// or the gateway refuses to start (GATEWAY_INSECURE_NO_AUTH=true overrides, knowingly).
    #[arg(long, default_value = "127.0.0.1")]
    host: std::net::IpAddr,
    /// A model directory in the diffusers layout (a FLUX.1 checkpoint) served beside the
    /// tiny model, by `--denoisers` denoisers of its own; repeatable. Requests name it by the
    /// folder's name (`model`); the tiny model stays the default.
    #[arg(long)]
    model_dir: Vec<PathBuf>,
    /// The tiny model's directory (the default model).
    #[arg(long, default_value = "weights/tiny")]
    tiny_model_dir: PathBuf,
    /// Folder of named ControlNets the denoisers serve (skipped when it does not exist).
    #[arg(long, default_value = "weights/tiny-controlnets")]
    controlnet_dir: PathBuf,
    /// Number of denoiser workers per model.
    #[arg(long, default_value_t = 1)]
    denoisers: u32,
    /// ControlNet workers (`diffmesh-controlnet`, serving --controlnet-dir) that steered
    /// steps run on; 0 runs ControlNets on the denoisers' step loops.
    #[arg(long, default_value_t = 1)]
    controlnet_workers: u32,
    /// How denoisers use the ControlNet workers: `sync` (residuals of the step about to run)
    /// or `pipelined` (one step behind, hidden behind the forward).
    #[arg(long, default_value = "pipelined")]
    controlnet_remote: String,
    /// `true_cfg_scale` of requests that give none (the gateway's `--default-true-cfg-scale`):
    /// the default model was trained for true classifier-free guidance at 4 (held-out
    /// all-correct 0.96 at 4, 0.76 without); 1 turns it off.
    #[arg(long, default_value_t = 4.0)]
    true_cfg_scale: f32,
    /// Directory for logs and process ids.
    #[arg(long, default_value = "run")]
    run_dir: PathBuf,
}

/// A process `up` started: its name and pid, one per line in `<run_dir>/pids`.
struct Started {
    name: String,
    child: Child,
}

const SERVICES: &[&str] = &["cachestore", "codec", "router", "denoiser", "gateway"];
/// Health/metrics port of each service, counted from this base (the gateway serves them on its API port).
const HEALTH_PORT_BASE: u16 = 9100;
/// Health/metrics ports of the ControlNet workers (after the services' ranges).
const CONTROLNET_HEALTH_PORT_BASE: u16 = HEALTH_PORT_BASE + 10 * SERVICES.len() as u16;
/// Health/metrics ports of the denoisers when several models are served (one range for all).
const DENOISER_HEALTH_PORT_BASE: u16 = CONTROLNET_HEALTH_PORT_BASE + 10;
/// Most denoisers `up` starts (the size of their port range).
const MAX_DENOISERS: u32 = 100;

/// A model `up` serves: its id (the folder's name, as the denoiser announces it) and folder.
struct ServedModel {
    id: String,
    dir: PathBuf,
    tiny: bool,
}

/// The tiny model first (the default), then each `--model-dir`; ids must differ.
fn served_models(args: &UpArgs) -> anyhow::Result<Vec<ServedModel>> {
    let mut models = Vec::new();
    let dirs = std::iter::once((&args.tiny_model_dir, true))
        .chain(args.model_dir.iter().map(|d| (d, false)));
    for (dir, tiny) in dirs {
        let id = dir
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .ok_or_else(|| anyhow::anyhow!("--model-dir {} names no folder", dir.display()))?;
        anyhow::ensure!(
            !models.iter().any(|m: &ServedModel| m.id == id),
            "two model folders are named {id:?}: a model's id is its folder's name"
        );
        let dir = if tiny {
            dir.clone()
        } else {
            anyhow::ensure!(
                dir.join("model_index.json").is_file(),
                "--model-dir {}: no model_index.json (a diffusers directory is expected)",
                dir.display()
            );
            // The services run from the workspace root, not from where `up` was called.
            std::fs::canonicalize(dir)?
        };
        models.push(ServedModel { id, dir, tiny });
    }
    anyhow::ensure!(
        models.len() as u32 * args.denoisers <= MAX_DENOISERS,
        "at most {MAX_DENOISERS} denoisers"
    );
    Ok(models)
}

pub fn up(tc: &Toolchain, args: UpArgs) -> anyhow::Result<()> {
    let root = workspace_root();
    let run_dir = root.join(&args.run_dir);
    std::fs::create_dir_all(run_dir.join("logs"))?;
    anyhow::ensure!(
        !run_dir.join("pids").exists(),
        "{} exists: a mesh may be running (cargo xtask down)",
        run_dir.join("pids").display()
    );

    let mut build = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    build.current_dir(&root).args(["build", "--release"]);
    for s in SERVICES {
        build.args(["-p", &format!("diffmesh-{s}")]);
    }
    // The ControlNet workers' program (`--controlnet-workers`).
    build.args(["-p", "diffmesh-controlnet"]);
    tc.apply(&mut build)?;
    run(&mut build)?;

    let mut started = Vec::new();
    let result = start_all(tc, &args, &root, &run_dir, &mut started);
    write_pids(&run_dir, &started)?;
    if let Err(e) = result {
        eprintln!(
            "start failed: {e:#}; stopping what was started (logs in {})",
            run_dir.join("logs").display()
        );
        stop(&run_dir)?;
        return Err(e);
    }
    print_examples(args.port);
    if args.detach {
        println!("running detached; stop with: cargo xtask down");
        return Ok(());
    }
    let (tx, rx) = std::sync::mpsc::channel();
    ctrlc::set_handler(move || {
        let _ = tx.send(());
    })?;
    println!("press Ctrl-C to stop");
    let _ = rx.recv();
    stop(&run_dir)
}

fn start_all(
    tc: &Toolchain,
    args: &UpArgs,
    root: &Path,
    run_dir: &Path,
    started: &mut Vec<Started>,
) -> anyhow::Result<()> {
    let nats_addrs = nats_socket_addrs(&args.nats_url)?;
    // The users of a NATS server started here (None: an existing server, used as it is).
    let mut nats_users: Option<Vec<diffmesh_shared::nats::auth::User>> = None;
    let answers =
        |a: &SocketAddr| TcpStream::connect_timeout(a, Duration::from_millis(500)).is_ok();
    if !nats_addrs.iter().any(answers) {
        let [nats_addr] = nats_addrs[..] else {
            anyhow::bail!(
                "none of the NATS servers in --nats-url {} answers (a local server is started \
                 only for a single URL)",
                args.nats_url
            );
        };
        let bin = nats_server_binary()
            .ok_or_else(|| anyhow::anyhow!("nats-server is not installed (cargo xtask setup)"))?;
        let store = run_dir.join("nats");
        std::fs::create_dir_all(&store)?;
        // Its own server refuses anonymous clients: each service gets its role's user.
        let users = diffmesh_shared::nats::auth::mesh_users()?;
        let conf = store.join("auth.conf");
        write_private(&conf, &diffmesh_shared::nats::auth::server_config(&users))?;
        let admin = users
            .iter()
            .find(|u| u.permissions.is_none())
            .expect("admin");
        write_private(
            &store.join("admin.env"),
            &format!(
                "NATS_USER={}\nNATS_PASSWORD={}\n",
                admin.name, admin.password
            ),
        )?;
        println!(
            "NATS: anonymous clients refused; the operator's credentials are in {}",
            store.join("admin.env").display()
        );
        nats_users = Some(users);
        let mut cmd = Command::new(bin);
        cmd.arg("-c")
            .arg(&conf)
            .args([
                "-js",
                "-a",
                &nats_addr.ip().to_string(),
                "-p",
                &nats_addr.port().to_string(),
                "-sd",
            ])
            .arg(&store);
        started.push(spawn("nats-server", cmd, run_dir)?);
        wait_until(Duration::from_secs(10), "nats-server", || {
            TcpStream::connect(nats_addr).is_ok()
        })?;
    } else {
        println!("using the NATS server at {}", args.nats_url);
    }

    let release = crate::target_dir(root).join("release");
    let models = served_models(args)?;
    let users = nats_users.as_deref();
    let mut gateway_health = None;
    let mut denoiser_health = Vec::new();
    for (i, svc) in SERVICES.iter().enumerate() {
        if *svc == "denoiser" {
            let ports = start_denoisers(tc, args, &models, root, run_dir, started, users)?;
            denoiser_health.extend(ports);
            continue;
        }
        let mut cmd = Command::new(release.join(format!("diffmesh-{svc}")));
        cmd.current_dir(root)
            .env("NATS_URL", &args.nats_url)
            .env("RUST_LOG", "info");
        nats_user(&mut cmd, users, svc);
        let health_port = HEALTH_PORT_BASE + (i as u16) * 10;
        cmd.env("HEALTH_ADDR", format!("127.0.0.1:{health_port}"));
        if *svc == "router" {
            // The admin API beside the health port, with a key of its own in the run folder.
            let key = diffmesh_shared::nats::auth::random_password()?;
            let env_file = run_dir.join("router-admin.env");
            let admin_addr = format!("127.0.0.1:{}", health_port + 1);
            write_private(
                &env_file,
                &format!("ROUTER_ADMIN_URL=http://{admin_addr}\nROUTER_ADMIN_KEY={key}\n"),
            )?;
            cmd.env("ROUTER_ADMIN_ADDR", &admin_addr)
                .env("ROUTER_ADMIN_KEY", key);
            println!(
                "router admin API on {admin_addr}; its key is in {}",
                env_file.display()
            );
        }
        if *svc == "gateway" {
            cmd.env(
                "GATEWAY_BIND",
                SocketAddr::new(args.host, args.port).to_string(),
            )
            .env("GATEWAY_DEFAULT_MODEL", &models[0].id)
            .env(
                "GATEWAY_DEFAULT_TRUE_CFG_SCALE",
                args.true_cfg_scale.to_string(),
            );
            gateway_health = Some(health_port);
        }
        tc.apply(&mut cmd)?;
        started.push(spawn(svc, cmd, run_dir)?);
    }
    if root.join(&args.controlnet_dir).is_dir() {
        for copy in 0..args.controlnet_workers {
            let mut cmd = Command::new(release.join("diffmesh-controlnet"));
            let health_port = CONTROLNET_HEALTH_PORT_BASE + copy as u16;
            cmd.current_dir(root)
                .env("NATS_URL", &args.nats_url)
                .env("RUST_LOG", "info")
                .env("HEALTH_ADDR", format!("127.0.0.1:{health_port}"))
                .env("CONTROLNET_WORKER_ID", format!("controlnet-{copy}"))
                .env("CONTROLNET_DIR", &args.controlnet_dir);
            nats_user(&mut cmd, users, "controlnet");
            tc.apply(&mut cmd)?;
            started.push(spawn(&format!("controlnet-{copy}"), cmd, run_dir)?);
            denoiser_health.push(health_port);
        }
    }
    // Ready when every denoiser and ControlNet worker is up and the gateway answers.
    for port in denoiser_health.into_iter().chain(gateway_health) {
        let addr = format!("127.0.0.1:{port}");
        wait_until(
            Duration::from_secs(120),
            &format!("/readyz on {addr}"),
            || http_ok(&addr, "/readyz"),
        )?;
    }
    Ok(())
}

/// `--denoisers` denoisers per served model; returns their health ports. With the tiny model
/// alone they are named and numbered as before (`denoiser-0`, ports of the denoiser range).
fn start_denoisers(
    tc: &Toolchain,
    args: &UpArgs,
    models: &[ServedModel],
    root: &Path,
    run_dir: &Path,
    started: &mut Vec<Started>,
    users: Option<&[diffmesh_shared::nats::auth::User]>,
) -> anyhow::Result<Vec<u16>> {
    let release = crate::target_dir(root).join("release");
    let denoiser_index = SERVICES.iter().position(|s| *s == "denoiser").unwrap_or(0) as u16;
    let mut ports = Vec::new();
    for model in models {
        for copy in 0..args.denoisers {
            let k = ports.len() as u16;
            let health_port = if models.len() == 1 && args.denoisers <= 10 {
                HEALTH_PORT_BASE + denoiser_index * 10 + k
            } else {
                DENOISER_HEALTH_PORT_BASE + k
            };
            let worker_id = if model.tiny {
                format!("denoiser-{copy}")
            } else {
                format!("denoiser-{}-{copy}", subject_safe(&model.id))
            };
            let mut cmd = Command::new(release.join("diffmesh-denoiser"));
            cmd.current_dir(root)
                .env("NATS_URL", &args.nats_url)
                .env("RUST_LOG", "info")
                .env("HEALTH_ADDR", format!("127.0.0.1:{health_port}"))
                .env("DENOISER_MODEL_DIR", &model.dir)
                .env("DENOISER_MODEL_ID", &model.id)
                .env("DENOISER_WORKER_ID", &worker_id);
            nats_user(&mut cmd, users, "denoiser");
            // The ControlNets in --controlnet-dir are the tiny model's.
            if model.tiny && root.join(&args.controlnet_dir).is_dir() {
                cmd.env("DENOISER_CONTROLNET_DIR", &args.controlnet_dir);
                if args.controlnet_workers > 0 {
                    cmd.env("DENOISER_CONTROLNET_REMOTE", &args.controlnet_remote);
                }
            }
            tc.apply(&mut cmd)?;
            let name = if models.len() == 1 && args.denoisers == 1 {
                "denoiser".to_string()
            } else {
                worker_id
            };
            started.push(spawn(&name, cmd, run_dir)?);
            ports.push(health_port);
        }
    }
    Ok(ports)
}

/// `id` with what a NATS subject token cannot hold (worker ids become subjects) made `-`
/// (`FLUX.1-dev` -> `FLUX-1-dev`).
fn subject_safe(id: &str) -> String {
    id.chars()
        .map(|c| match c {
            '.' | '*' | '>' | ' ' => '-',
            c => c,
        })
        .collect()
}

/// The byte budget of a development mesh's JetStream streams, unless JS_MAX_BYTES says
/// otherwise: the server reserves each stream's bound against 75% of its free disk.
const UP_JS_MAX_BYTES: u64 = 2 << 30;

fn spawn(name: &str, mut cmd: Command, run_dir: &Path) -> anyhow::Result<Started> {
    let log = File::create(run_dir.join("logs").join(format!("{name}.log")))?;
    if std::env::var_os("JS_MAX_BYTES").is_none() {
        cmd.env("JS_MAX_BYTES", UP_JS_MAX_BYTES.to_string());
    }
    cmd.stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    println!("starting {name}: {}", render(&cmd));
    let child = cmd
        .spawn()
        .map_err(|e| anyhow::anyhow!("could not start {name}: {e}"))?;
    Ok(Started {
        name: name.to_string(),
        child,
    })
}

fn write_pids(run_dir: &Path, started: &[Started]) -> anyhow::Result<()> {
    let mut f = File::create(run_dir.join("pids"))?;
    for s in started {
        writeln!(f, "{} {}", s.name, s.child.id())?;
    }
    Ok(())
}

/// Stop a mesh started by `up`: SIGTERM to every recorded process (services finish in-flight work),
/// SIGKILL to what is still alive after a grace period.
pub fn down() -> anyhow::Result<()> {
    stop(&workspace_root().join("run"))
}

/// The service's NATS user (named as the service) on a server started here.
fn nats_user(cmd: &mut Command, users: Option<&[diffmesh_shared::nats::auth::User]>, svc: &str) {
    if let Some(u) = users.and_then(|users| users.iter().find(|u| u.name == svc)) {
        cmd.env("NATS_USER", &u.name)
            .env("NATS_PASSWORD", &u.password);
    }
}

/// Write `text` readable by this user only (mode 0600, also over a file that was readable by
/// others before, set before the secret is written), replacing the file.
pub(crate) fn write_private(path: &Path, text: &str) -> anyhow::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    std::io::Write::write_all(&mut file, text.as_bytes())?;
    Ok(())
}

fn stop(run_dir: &Path) -> anyhow::Result<()> {
    let pids_file = run_dir.join("pids");
    let Ok(text) = std::fs::read_to_string(&pids_file) else {
        println!("nothing to stop ({} not found)", pids_file.display());
        return Ok(());
    };
    // Services first (reverse start order), NATS last, so in-flight work can be handed back.
    let procs: Vec<(String, String)> = text
        .lines()
        .filter_map(|l| {
            l.split_once(' ')
                .map(|(n, p)| (n.to_string(), p.to_string()))
        })
        .rev()
        .collect();
    for (name, pid) in &procs {
        if alive(pid) {
            println!("stopping {name} ({pid})");
            let _ = Command::new("kill").args(["-TERM", pid]).status();
            let deadline = Instant::now() + Duration::from_secs(15);
            while alive(pid) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(100));
            }
            if alive(pid) {
                eprintln!("{name} did not stop in time: killing it");
                let _ = Command::new("kill").args(["-KILL", pid]).status();
            }
        }
    }
    std::fs::remove_file(&pids_file)?;
    Ok(())
}

fn alive(pid: &str) -> bool {
    // A zombie (exited, not reaped by a parent that is gone) counts as stopped.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            !s.rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

/// The address of each comma-separated URL of `--nats-url` (port 4222 when none is given).
fn nats_socket_addrs(urls: &str) -> anyhow::Result<Vec<SocketAddr>> {
    urls.split(',')
        .map(|url| {
            let url = url.trim();
            let hostport = url.trim_start_matches("nats://").trim_end_matches('/');
            // Credentials (`user:pass@host`) are the server's business, not the probe's.
            let hostport = hostport.rsplit_once('@').map_or(hostport, |(_, h)| h);
            let hostport = if hostport.contains(':') {
                hostport.to_string()
            } else {
                format!("{hostport}:4222")
            };
            hostport
                .to_socket_addrs()
                .ok()
                .and_then(|mut a| a.next())
                .ok_or_else(|| anyhow::anyhow!("--nats-url: cannot resolve `{url}`"))
        })
        .collect()
}

fn wait_until(limit: Duration, what: &str, mut ready: impl FnMut() -> bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if ready() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    anyhow::bail!("{what} was not ready within {limit:?}")
}

/// A plain HTTP/1.0 GET answering 200 (no HTTP client dependency needed for a health probe).
fn http_ok(addr: &str, path: &str) -> bool {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 32];
    let n = s.read(&mut buf).unwrap_or(0);
    String::from_utf8_lossy(&buf[..n]).split_whitespace().nth(1) == Some("200")
}

fn print_examples(port: u16) {
    let url = format!("http://127.0.0.1:{port}");
    println!();
    println!("diffmesh is up. Try:");
    println!("  curl -s {url}/v1/images/edits -F image=@docs/examples/template.png -F mask=@docs/examples/mask.png \\");
    println!("       -F prompt='a yellow square on the right on a blue background' -F response_format=png -o edited.png");
    println!("  curl -s {url}/v1/images/generations -H 'content-type: application/json' \\");
    println!("       -d '{{\"prompt\":\"a red circle on the left on a blue background\",\"response_format\":\"b64_json\"}}'");
    println!();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_ids_of_model_folders_are_subject_safe() {
        assert_eq!(subject_safe("FLUX.1-dev"), "FLUX-1-dev");
        assert_eq!(subject_safe("a b*c>d"), "a-b-c-d");
    }

    #[test]
    fn nats_url_lists_resolve_each_entry() {
        let addrs =
            nats_socket_addrs("nats://127.0.0.1:24221, nats://u:p@127.0.0.1:24222,127.0.0.1")
                .unwrap();
        let ports: Vec<u16> = addrs.iter().map(SocketAddr::port).collect();
        assert_eq!(ports, [24221, 24222, 4222]);
        let err = nats_socket_addrs("nats://127.0.0.1:1,nats://no host:2").unwrap_err();
        assert!(err.to_string().contains("`nats://no host:2`"), "{err}");
    }
}
