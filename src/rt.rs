//! Tokio runtimes on worker threads of their own, so that one kind of work cannot queue ahead
//! of another: an edge's creations and stops run on one apart from the runtime that answers
//! its RPCs, and `cluster up` gives every role one, as separate processes would have
//! (docs/architecture.md "Runtimes").

use std::future::Future;

/// A multi-threaded runtime owned by its holder. Dropping it shuts it down without waiting
/// (allowed inside async code, where a plain `Runtime` drop would panic); tasks still on it
/// are dropped.
pub struct Dedicated {
    rt: Option<tokio::runtime::Runtime>,
    handle: tokio::runtime::Handle,
}

impl Dedicated {
    /// Starts `threads` worker threads named `name` (at least one), with timers and I/O.
    /// Errors: the threads could not be started.
    pub fn new(name: &str, threads: usize) -> std::io::Result<Dedicated> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads.max(1))
            .thread_name(name)
            .enable_all()
            .build()?;
        let handle = rt.handle().clone();
        Ok(Dedicated {
            rt: Some(rt),
            handle,
        })
    }

    /// As many worker threads as the machine has CPUs.
    pub fn per_cpu(name: &str) -> std::io::Result<Dedicated> {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::new(name, n)
    }

    /// Runs `fut` on this runtime; the handle can be awaited from any runtime.
    pub fn spawn<F>(&self, fut: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.handle.spawn(fut)
    }

    pub fn handle(&self) -> &tokio::runtime::Handle {
        &self.handle
    }
}

impl Drop for Dedicated {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn work_on_a_dedicated_runtime_does_not_hold_up_the_callers() {
        let work = Dedicated::new("test-work", 1).expect("runtime");
        // Its only worker is blocked for good; the caller's runtime goes on.
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let blocked = work.spawn(async move {
            let _ = rx.recv();
        });
        let t0 = std::time::Instant::now();
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        assert!(t0.elapsed() < std::time::Duration::from_secs(5));
        let name = work.spawn(async { std::thread::current().name().map(String::from) });
        tx.send(()).expect("send");
        blocked.await.expect("blocked task");
        assert_eq!(name.await.expect("task").as_deref(), Some("test-work"));
        drop(work); // inside async code: must not panic
    }
}
