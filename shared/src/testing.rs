//! Test fixture: a real `nats-server` (with JetStream) on a free local port, removed on drop.
//!
//! The one fixture every test of the workspace uses (service crates and the mesh tests alike).
//! The binary is `$NATS_SERVER_BIN`, else Debian's `/usr/sbin/nats-server`, else `nats-server` on
//! `PATH`. Tests need no network: the server listens on 127.0.0.1 only and keeps its JetStream
//! data and log in a fresh temp directory.
pub mod peak_alloc;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

pub struct NatsServer {
    child: Child,
    pub port: u16,
    dir: PathBuf,
    /// How it was started, for [`NatsServer::restart`].
    label: String,
    extra: Vec<String>,
}

fn nats_server_binary() -> PathBuf {
    if let Ok(p) = std::env::var("NATS_SERVER_BIN") {
        return PathBuf::from(p);
    }
    let debian = Path::new("/usr/sbin/nats-server");
    if debian.exists() {
        return debian.to_path_buf();
    }
    PathBuf::from("nats-server")
}

/// Run `nats-server -js` on `port` with its data under `dir` and `extra` flags, logging to `log`.
/// What nats-server logs once it takes clients.
const READY_LINE: &str = "Server is ready";

fn launch(port: u16, dir: &Path, extra: &[String], log: std::fs::File) -> Child {
    let bin = nats_server_binary();
    Command::new(&bin)
        .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
        .arg(dir.join("js"))
        .args(extra)
        .stdout(Stdio::from(log.try_clone().expect("clone log handle")))
        .stderr(Stdio::from(log))
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot start `{}` (install nats-server or set NATS_SERVER_BIN): {e}",
                bin.display()
            )
        })
}

/// A currently free local TCP port (another process could take it before use, so `start`
/// retries with a new port when the server fails to come up).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free local port")
}

impl NatsServer {
    /// Start a server and wait until it accepts connections. Panics with the server's log when
    /// it cannot start (this is test code: a missing fixture must fail the test loudly).
    pub fn start() -> Self {
        let mut last_log = String::new();
        for _ in 0..5 {
            let port = free_port();
            let mut server = Self::spawn(port, "solo", &[]);
            if server.wait_ready(Duration::from_secs(10)) {
                return server;
            }
            last_log = server.log();
        }
        panic!("nats-server did not come up after 5 tries; last log:\n{last_log}")
    }

    /// [`NatsServer::start`] with `config` (a `nats-server` config file's text, such as
    /// `nats::auth::server_config`'s authorization block) read by the server.
    pub fn start_with_config(config: &str) -> Self {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let path = std::env::temp_dir().join(format!(
            "diffmesh-nats-{}-{}.conf",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&path, config).expect("write the nats-server config");
        let extra = ["-c".to_string(), path.display().to_string()];
        let mut last_log = String::new();
        for _ in 0..5 {
            let port = free_port();
            let mut server = Self::spawn(port, "config", &extra);
            if server.wait_ready(Duration::from_secs(10)) {
                return server;
            }
            last_log = server.log();
        }
        panic!("nats-server did not come up after 5 tries; last log:\n{last_log}")
    }

    /// Start `nats-server -js` on `port` with `extra` flags, data and log in a fresh temp dir.
    fn spawn(port: u16, label: &str, extra: &[String]) -> Self {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!(
            "diffmesh-nats-{}-{seq}-{label}-{port}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).expect("create nats temp dir");
        let log = std::fs::File::create(dir.join("nats.log")).expect("create nats log");
        let child = launch(port, &dir, extra, log);
        Self {
            child,
            port,
            dir,
            label: label.to_string(),
            extra: extra.to_vec(),
        }
    }

    /// Stop the server (as a crash would; its data stays).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Start the server again on its port with its data, and wait until it accepts connections.
    pub fn restart(&mut self) {
        self.kill();
        let log = std::fs::OpenOptions::new()
            .append(true)
            .open(self.dir.join("nats.log"))
            .expect("open nats log");
        let earlier_starts = self.log().matches(READY_LINE).count();
        self.child = launch(self.port, &self.dir, &self.extra, log);
        assert!(
            self.wait_ready_after(Duration::from_secs(10), earlier_starts),
            "nats-server {} did not come back:\n{}",
            self.label,
            self.log()
        );
    }

    fn wait_ready(&mut self, within: Duration) -> bool {
        self.wait_ready_after(within, 0)
    }

    /// Wait until the server answers and its log says it is ready once more than
    /// `earlier_starts` times (the log of a restarted server holds the first start's line).
    fn wait_ready_after(&mut self, within: Duration, earlier_starts: usize) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return false;
            }
            // Its own log must say so: when two tests' servers race for one port, the loser's
            // port answers too (the winner's), until the winner is stopped.
            if TcpStream::connect(("127.0.0.1", self.port)).is_ok()
                && self.log().matches(READY_LINE).count() > earlier_starts
            {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    /// The server process's id (to read its CPU time in measurements).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The server's log so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("nats.log")).unwrap_or_default()
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A JetStream cluster of `nodes` local servers (cluster `diffmesh-test`), for what only shows
/// with replicas: replica counts, leaders and followers.
pub struct NatsCluster {
    pub nodes: Vec<NatsServer>,
}

impl NatsCluster {
    /// Start the nodes and wait until each accepts connections (JetStream elects its meta
    /// leader shortly after; callers retry their first JetStream request).
    pub fn start(nodes: usize) -> Self {
        let mut last_log = String::new();
        for _ in 0..5 {
            let cluster_ports: Vec<u16> = (0..nodes).map(|_| free_port()).collect();
            let routes = cluster_ports
                .iter()
                .map(|p| format!("nats://127.0.0.1:{p}"))
                .collect::<Vec<_>>()
                .join(",");
            let mut servers: Vec<NatsServer> = cluster_ports
                .iter()
                .enumerate()
                .map(|(i, cluster_port)| {
                    let name = format!("n{i}");
                    let extra = [
                        "--name".to_string(),
                        name.clone(),
                        "--cluster_name".into(),
                        "diffmesh-test".into(),
                        "--cluster".into(),
                        format!("nats://127.0.0.1:{cluster_port}"),
                        "--routes".into(),
                        routes.clone(),
                    ];
                    NatsServer::spawn(free_port(), &name, &extra)
                })
                .collect();
            if servers
                .iter_mut()
                .all(|s| s.wait_ready(Duration::from_secs(10)))
            {
                return Self { nodes: servers };
            }
            last_log = servers
                .iter()
                .map(NatsServer::log)
                .collect::<Vec<_>>()
                .join("\n");
        }
        panic!("a nats-server cluster did not come up after 5 tries; last logs:\n{last_log}")
    }

    /// Client URLs of every node, comma-separated (what `NATS_URL` takes).
    pub fn url(&self) -> String {
        self.nodes
            .iter()
            .map(NatsServer::url)
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// A valid text-to-image job at the tiny model's 64x64 resolution (256 image tokens), for tests
/// that need some job to place, run or fail.
pub fn generation_job(
    job_id: &str,
    prompt: &str,
    seed: u64,
    steps: u32,
) -> crate::wire::messages::DenoiseJob {
    use crate::wire::messages::{DenoiseJob, GenerationParams, JobKind, PreparedInputs};
    DenoiseJob {
        job_id: job_id.into(),
        kind: JobKind::Generate,
        params: GenerationParams {
            model: String::new(),
            prompt: prompt.into(),
            n: 1,
            num_inference_steps: steps,
            guidance_scale: 1.0,
            seed,
            width: 64,
            height: 64,
            loras: Vec::new(),
            preview_steps: Vec::new(),
            strength: None,
            cache_threshold: None,
            cache_method: None,
            deadline_unix_ms: None,
            controlnet: None,
            extra_controlnets: Vec::new(),
            true_cfg: None,
        },
        inputs: PreparedInputs {
            image_key: None,
            template_image_key: None,
            token_mask_key: None,
            mask_ratio: 1.0,
            masked_tokens: 256,
            input_width: 64,
            input_height: 64,
            model_width: 64,
            model_height: 64,
            token_rows: 0,
            token_cols: 0,
            template_id: None,
            control_image_key: None,
            extra_control_image_keys: Vec::new(),
        },
        raw_image_key: None,
        raw_mask_key: None,
        attempt: 0,
        template: None,
    }
}

/// A LoRA file (diffusers' keys, f32, no metadata: scale 1) of `modules` (`(path, in, out)`) at
/// `rank`, with deterministic pseudo-random values in +-`amplitude`/2.
pub fn lora_file(
    modules: &[(String, usize, usize)],
    rank: usize,
    amplitude: f32,
    seed: u64,
) -> Vec<u8> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * amplitude
    };
    let mut tensors = Vec::new();
    for (module, inp, out) in modules {
        for (suffix, shape) in [("lora_A", vec![rank, *inp]), ("lora_B", vec![*out, rank])] {
            let values = (0..shape.iter().product::<usize>())
                .map(|_| next())
                .collect();
            tensors.push((
                format!("transformer.{module}.{suffix}.weight"),
                shape,
                values,
            ));
        }
    }
    crate::wire::lora::write_f32_safetensors(&tensors, None).expect("valid shapes")
}

/// Run `python/parity/<script> <out>` into a fresh `out` with the project's Python
/// (`DIFFMESH_PYTHON`, default the venv `cargo xtask setup` fills) and return `out`; the script's
/// progress output is dropped (its errors still show).
pub fn parity_fixture(script: &str, out: &Path) -> PathBuf {
    parity_fixture_with(script, &[], out)
}

/// [`parity_fixture`] with `args` before `out`.
pub fn parity_fixture_with(script: &str, args: &[&std::ffi::OsStr], out: &Path) -> PathBuf {
    let _ = std::fs::remove_dir_all(out);
    std::fs::create_dir_all(out).expect("the fixture's folder");
    let python = std::env::var("DIFFMESH_PYTHON")
        .unwrap_or_else(|_| "/root/.cache/diffmesh/venv/bin/python".into());
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../python/parity")
        .join(script);
    let status = Command::new(&python)
        .arg(&script)
        .args(args)
        .arg(out)
        .env("TQDM_DISABLE", "1")
        .stdout(Stdio::null())
        .status()
        .unwrap_or_else(|e| panic!("cannot run {python} (set DIFFMESH_PYTHON): {e}"));
    assert!(status.success(), "{} failed: {status}", script.display());
    out.to_path_buf()
}
