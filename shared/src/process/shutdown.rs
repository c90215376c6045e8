//! Process shutdown signal shared by every service binary: SIGTERM (orchestrators) or Ctrl-C.
use tokio_util::sync::CancellationToken;

/// Resolves on the first SIGTERM or SIGINT.
pub async fn signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => tracing::info!("SIGTERM received; shutting down"),
                    _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received; shutting down"),
                }
            }
            Err(err) => {
                tracing::warn!(error = %err, "cannot listen for SIGTERM; only Ctrl-C stops the service");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// A token cancelled by the first SIGTERM/SIGINT (what service `run` functions take).
pub fn on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        signal().await;
        t.cancel();
    });
    token
}
