//! A whole mesh for one test: its own NATS server, codec, cachestore, router, denoisers with
//! the tiny default model, and gateway, each started in-process (`harness`) with the test's
//! config changes, and all ready before `start` returns.
use std::net::SocketAddr;
use std::time::Duration;

use diffmesh_cachestore::CachestoreConfig;
use diffmesh_codec::CodecConfig;
use diffmesh_denoiser::DenoiserConfig;
use diffmesh_gateway::GatewayConfig;
use diffmesh_router::RouterConfig;

use crate::harness::{
    init_test_logging, start_cachestore, start_codec, start_denoiser, start_gateway, start_router,
    tiny_model_dir, NatsServer, Service,
};

/// How long each service may take to answer `/readyz` (a busy 2-core machine).
const READY_WITHIN: Duration = Duration::from_secs(30);

type Tweak<C> = Box<dyn FnOnce(&mut C) + Send>;
/// A config change for every denoiser, told the worker id it is for.
type DenoiserTweak = Box<dyn Fn(&str, &mut DenoiserConfig) + Send>;

/// The mesh's services, stopped in field order when it drops.
pub struct TestMesh {
    /// First to stop: a stopping denoiser hands its queued work back to the router.
    pub denoisers: Vec<Service>,
    pub gateway: Service,
    pub router: Service,
    pub cachestore: Option<Service>,
    pub codec: Service,
    /// The cachestore's disk tier.
    pub disk: tempfile::TempDir,
    /// Last: services must stop before their NATS server.
    pub nats: NatsServer,
}

impl TestMesh {
    /// The gateway's public API address.
    pub fn api(&self) -> SocketAddr {
        self.gateway.addrs.api.expect("the gateway serves an API")
    }

    /// `http://<gateway>{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.api())
    }

    /// The denoiser with worker id `id`.
    pub fn denoiser(&self, id: &str) -> &Service {
        let name = format!("denoiser-{id}");
        self.denoisers
            .iter()
            .find(|d| d.name == name)
            .unwrap_or_else(|| panic!("no denoiser {id}"))
    }

    /// The cachestore (started unless the builder left it out).
    pub fn cachestore(&self) -> &Service {
        self.cachestore
            .as_ref()
            .expect("this mesh runs no cachestore")
    }
}

/// What to start: by default a codec, a cachestore, a router, one denoiser `d1` and a
/// gateway, each with its `for_tests` config.
pub struct MeshBuilder {
    codec: Tweak<CodecConfig>,
    cachestore: Option<Tweak<CachestoreConfig>>,
    router: Tweak<RouterConfig>,
    denoiser_ids: Vec<String>,
    denoiser: DenoiserTweak,
    gateway: Tweak<GatewayConfig>,
}

impl Default for MeshBuilder {
    fn default() -> Self {
        Self {
            codec: Box::new(|_| {}),
            cachestore: Some(Box::new(|_| {})),
            router: Box::new(|_| {}),
            denoiser_ids: vec!["d1".into()],
            denoiser: Box::new(|_, _| {}),
            gateway: Box::new(|_| {}),
        }
    }
}

impl MeshBuilder {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn codec(mut self, tweak: impl FnOnce(&mut CodecConfig) + Send + 'static) -> Self {
        self.codec = Box::new(tweak);
        self
    }

    pub fn cachestore(
        mut self,
        tweak: impl FnOnce(&mut CachestoreConfig) + Send + 'static,
    ) -> Self {
        self.cachestore = Some(Box::new(tweak));
        self
    }

    /// Run no cachestore (edits by template then cannot read caches).
    pub fn without_cachestore(mut self) -> Self {
        self.cachestore = None;
        self
    }

    pub fn router(mut self, tweak: impl FnOnce(&mut RouterConfig) + Send + 'static) -> Self {
        self.router = Box::new(tweak);
        self
    }

    /// The denoisers' worker ids, started in this order (default: `d1`).
    pub fn denoisers(mut self, ids: &[&str]) -> Self {
        self.denoiser_ids = ids.iter().map(|id| id.to_string()).collect();
        self
    }

    /// A config change for every denoiser, told its worker id.
    pub fn denoiser(mut self, tweak: impl Fn(&str, &mut DenoiserConfig) + Send + 'static) -> Self {
        self.denoiser = Box::new(tweak);
        self
    }

    pub fn gateway(mut self, tweak: impl FnOnce(&mut GatewayConfig) + Send + 'static) -> Self {
        self.gateway = Box::new(tweak);
        self
    }

    /// Start everything and wait until every service is ready. Panics (the test fails) when
    /// the tiny model is missing or a service does not start.
    pub async fn start(self) -> TestMesh {
        init_test_logging();
        let model = tiny_model_dir().expect("weights/tiny (the default model) is missing");
        let nats = NatsServer::start();
        let disk = tempfile::tempdir().expect("the cachestore's disk directory");
        let codec = start_codec(&nats, self.codec).expect("codec");
        let cachestore = self
            .cachestore
            .map(|tweak| start_cachestore(&nats, disk.path(), tweak).expect("cachestore"));
        let router = start_router(&nats, self.router).expect("router");
        let tweak = self.denoiser;
        let denoisers: Vec<Service> = self
            .denoiser_ids
            .iter()
            .map(|id| {
                start_denoiser(&nats, &model, id, |c| tweak(id, c))
                    .unwrap_or_else(|e| panic!("denoiser {id}: {e:#}"))
            })
            .collect();
        drop(tweak);
        let gateway = start_gateway(&nats, self.gateway).expect("gateway");
        for s in [&codec, &router, &gateway]
            .into_iter()
            .chain(cachestore.iter())
            .chain(denoisers.iter())
        {
            s.wait_ready(READY_WITHIN).await.expect("ready");
        }
        TestMesh {
            denoisers,
            gateway,
            router,
            cachestore,
            codec,
            disk,
            nats,
        }
    }
}
