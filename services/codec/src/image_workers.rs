//! The codec's image work (decode, stretch, token masks, composite, PNG encode) on a pool of
//! actix sync actors, one thread each (`--concurrency` of them, as many as requests handled at
//! once): CPU work sized to the cores, not tokio's blocking pool of up to 512 threads. Each
//! message carries one piece of work and answers its result; a panic in it is caught and
//! answered as an error, and the worker serves on.
use crate::error::CodecError;
use actix::{Actor, Addr, Handler, Message, SyncContext};
use std::panic::{catch_unwind, AssertUnwindSafe};

pub struct ImageWorker;

impl Actor for ImageWorker {
    type Context = SyncContext<Self>;
}

/// One piece of image work, answering `T` (or the panic's text).
pub struct Work<T>(Box<dyn FnOnce() -> T + Send>);

impl<T: Send + 'static> Message for Work<T> {
    type Result = Result<T, String>;
}

impl<T: Send + 'static> Handler<Work<T>> for ImageWorker {
    type Result = Result<T, String>;

    fn handle(&mut self, msg: Work<T>, _: &mut SyncContext<Self>) -> Self::Result {
        catch_unwind(AssertUnwindSafe(msg.0)).map_err(diffmesh_shared::panic_message)
    }
}

/// The pool's address (cheap to clone).
#[derive(Clone)]
pub struct ImageWorkers(Addr<ImageWorker>);

impl ImageWorkers {
    pub fn start(threads: usize) -> Self {
        Self(diffmesh_shared::process::actors::start_sync(
            "codec-image",
            threads,
            || ImageWorker,
        ))
    }

    /// Run `work` on the next free worker.
    pub async fn run<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, CodecError> {
        match self.0.send(Work(Box::new(work))).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(panic)) => Err(CodecError::WorkPanicked(panic)),
            Err(e) => Err(CodecError::WorkPanicked(format!("no image worker: {e}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn work_runs_on_the_pool_and_a_panic_is_an_error() {
        let workers = ImageWorkers::start(2);
        let on = workers
            .run(|| std::thread::current().name().map(str::to_string))
            .await
            .unwrap();
        assert_eq!(on.as_deref(), Some("codec-image"));
        let err = workers.run(|| -> u8 { panic!("bad pixels") }).await;
        assert!(matches!(err, Err(CodecError::WorkPanicked(ref m)) if m.contains("bad pixels")));
        assert_eq!(workers.run(|| 2 + 2).await.unwrap(), 4);
    }
}
