//! A shutdown signal every task of a role watches: fired once by SIGTERM/SIGINT or a test.

use tokio::sync::watch;

/// Cloneable handle: `fire()` asks every holder to stop; `wait()` resolves once fired.
#[derive(Clone)]
pub struct Shutdown {
    tx: std::sync::Arc<watch::Sender<bool>>,
    rx: watch::Receiver<bool>,
}

impl Default for Shutdown {
    fn default() -> Self {
        Self::new()
    }
}

impl Shutdown {
    pub fn new() -> Self {
        let (tx, rx) = watch::channel(false);
        Shutdown {
            tx: std::sync::Arc::new(tx),
            rx,
        }
    }

    pub fn fire(&self) {
        let _ = self.tx.send(true);
    }

    pub fn is_fired(&self) -> bool {
        *self.rx.borrow()
    }

    /// Resolves when `fire` has been called (at once if it already was).
    pub async fn wait(&self) {
        let mut rx = self.rx.clone();
        while !*rx.borrow_and_update() {
            if rx.changed().await.is_err() {
                return;
            }
        }
    }

    /// Fires on SIGTERM or SIGINT.
    pub fn fire_on_signals(&self) {
        let me = self.clone();
        tokio::spawn(async move {
            use tokio::signal::unix::{signal, SignalKind};
            let (Ok(mut term), Ok(mut int)) = (
                signal(SignalKind::terminate()),
                signal(SignalKind::interrupt()),
            ) else {
                return;
            };
            tokio::select! {
                _ = term.recv() => {},
                _ = int.recv() => {},
            }
            // Fire first: nothing that logging does may stand between a signal and shutdown.
            me.fire();
            tracing::info!("signal received, shutting down");
        });
    }
}
