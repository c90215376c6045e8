//! The process's actor system (actix). Each service keeps its long-lived state in actors: an
//! actor owns its state alone and is reached through typed messages on its `Addr`, from any
//! thread or tokio runtime.
//!
//! Services are libraries started from whatever runtime calls them (`#[tokio::main]`, a test's
//! runtime, several services in one test process), while actix needs a `System` of its own. So
//! the first actor started in a process starts one system thread, and every service of the
//! process starts its actors there:
//! - [`start`]: an async actor (`Context`) on the system's arbiter. Its handlers must not block:
//!   they change the state they own and answer; I/O stays in the service's tokio tasks, which
//!   send the messages.
//! - [`start_sync`]: a sync actor (`SyncContext`) on threads of its own (`SyncArbiter`), for state
//!   that blocking work owns (the denoiser's engine and its tch tensors, image work). A sync
//!   actor that stops is started again by its factory: actix's supervision for sync actors.
//!   Panics are not caught by actix; an actor that may panic catches them and stops itself (see
//!   the denoiser's engine).
use std::sync::OnceLock;

use actix::{Actor, Addr, ArbiterHandle, Context, SyncArbiter, SyncContext, System};

struct ActorSystem {
    system: System,
    arbiter: ArbiterHandle,
}

static SYSTEM: OnceLock<ActorSystem> = OnceLock::new();

fn system() -> &'static ActorSystem {
    SYSTEM.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("actix-system".into())
            .spawn(move || {
                let runner = System::new();
                let _ = tx.send(ActorSystem {
                    system: System::current(),
                    arbiter: actix::Arbiter::current(),
                });
                // Runs until the process ends: services stop their actors, not the system.
                if let Err(e) = runner.run() {
                    tracing::error!(error = %e, "the actor system stopped");
                }
            })
            .expect("starting the actor system thread");
        rx.recv()
            .expect("the actor system thread reports its handles")
    })
}

/// Start an async actor on the process's actor system; `build` runs on the system thread.
pub fn start<A, F>(build: F) -> Addr<A>
where
    A: Actor<Context = Context<A>>,
    F: FnOnce(&mut Context<A>) -> A + Send + 'static,
{
    A::start_in_arbiter(&system().arbiter, build)
}

/// Start `threads` sync actors made by `factory`, each on a thread of its own named `name`
/// (one address for all; `factory` runs on that thread). `factory` runs again whenever an
/// actor stops: that is how a sync actor is restarted.
pub fn start_sync<A, F>(name: &str, threads: usize, factory: F) -> Addr<A>
where
    A: Actor<Context = SyncContext<A>>,
    F: Fn() -> A + Send + Sync + 'static,
{
    // `SyncArbiter` needs a current `System` on the calling thread (it registers its message
    // forwarder with it): make it ours on whatever thread the service starts from.
    System::set_current(system().system.clone());
    let name = name.to_string();
    SyncArbiter::start_with_thread_builder(
        threads.max(1),
        || std::thread::Builder::new().name(name.clone()),
        factory,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix::{Handler, Message};

    struct Counter(u64);
    impl Actor for Counter {
        type Context = Context<Self>;
    }
    struct Add(u64);
    impl Message for Add {
        type Result = u64;
    }
    impl Handler<Add> for Counter {
        type Result = u64;
        fn handle(&mut self, msg: Add, _: &mut Context<Self>) -> u64 {
            self.0 += msg.0;
            self.0
        }
    }

    /// Stops (so its factory restarts it) when asked, keeping nothing.
    struct Worker(u64);
    impl Actor for Worker {
        type Context = SyncContext<Self>;
    }
    struct Bump {
        restart: bool,
    }
    impl Message for Bump {
        type Result = u64;
    }
    impl Handler<Bump> for Worker {
        type Result = u64;
        fn handle(&mut self, msg: Bump, ctx: &mut SyncContext<Self>) -> u64 {
            self.0 += 1;
            if msg.restart {
                actix::ActorContext::stop(ctx);
            }
            self.0
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn actors_answer_from_any_runtime_and_sync_actors_restart_fresh() {
        let counter = start(|_| Counter(0));
        assert_eq!(counter.send(Add(2)).await.unwrap(), 2);
        assert_eq!(counter.send(Add(3)).await.unwrap(), 5);

        let worker = start_sync("test-worker", 1, || Worker(0));
        assert_eq!(worker.send(Bump { restart: false }).await.unwrap(), 1);
        assert_eq!(worker.send(Bump { restart: true }).await.unwrap(), 2);
        // The factory made a new actor: its state starts over.
        assert_eq!(worker.send(Bump { restart: false }).await.unwrap(), 1);
    }
}
