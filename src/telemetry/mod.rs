//! Logging (tracing) and the health/metrics listener every role serves (docs/architecture.md):
//! `/metrics` (Prometheus text), `/healthz` (alive), `/readyz` (ready to take traffic).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use axum::{routing::get, Router};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

use crate::shutdown::Shutdown;

/// The log levels `-log` takes as a single word.
const LEVELS: &[&str] = &["off", "error", "warn", "info", "debug", "trace"];

/// Checks a `-log` value: a level (`error`, `warn`, `info`, `debug`, `trace`, `off`) or a
/// filter of comma-separated directives, each a level or `target=level` (e.g.
/// `info,opendsec::roles::edge=debug`). A bare word that is not a level is refused: the
/// filter syntax would take it for a target name and log nothing else (`-log verbose`).
/// Errors: a message naming the value.
pub fn check_log_level(level: &str) -> Result<(), String> {
    let bad = |why: &str| format!("-log {level:?}: {why}; use one of {}", LEVELS.join(", "));
    if level.trim().is_empty() {
        return Err(bad("empty"));
    }
    for part in level.split(',') {
        let part = part.trim();
        if !part.contains('=') && !LEVELS.contains(&part.to_ascii_lowercase().as_str()) {
            return Err(bad(&format!("{part:?} is not a log level")));
        }
    }
    tracing_subscriber::EnvFilter::try_new(level)
        .map(drop)
        .map_err(|e| bad(&e.to_string()))
}

/// Libraries that log at info for every packet or netlink message (hickory's server logs
/// each DNS query a sandbox sends; rustables each attribute it skips): warnings only, unless
/// the level names them.
const QUIET: &[&str] = &[
    "rustables",
    "hickory_server",
    "hickory_proto",
    "hickory_net",
    "hickory_resolver",
];

/// `level` with a `=warn` directive for each of [`QUIET`] it does not name.
fn with_quiet_libraries(level: &str) -> String {
    let mut out = level.to_string();
    for lib in QUIET {
        if !level.contains(lib) {
            out.push_str(&format!(",{lib}=warn"));
        }
    }
    out
}

/// Starts logging to stderr at `level` (see [`check_log_level`]). Colours only when stderr
/// is a terminal: a log redirected to a file stays plain text. Errors: the level is not
/// valid (nothing is started then).
pub fn init_logging(level: &str) -> Result<(), String> {
    use std::io::IsTerminal;
    check_log_level(level)?;
    let filter = tracing_subscriber::EnvFilter::try_new(with_quiet_libraries(level))
        .map_err(|e| e.to_string())?;
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .with_target(false)
        // By default a failed write is reported with eprintln!, which panics when stderr is
        // a closed pipe (`| head`, a log shipper that died): the panic killed whichever task
        // was logging, the SIGTERM handler among them, and the role never stopped. A log
        // line that cannot be written is dropped instead.
        .log_internal_errors(false)
        .try_init();
    // Metrics recorded before a recorder exists are dropped, and some gauges are set only once
    // at start: install it together with logging, before any role runs.
    let _ = metrics_handle();
    Ok(())
}

#[cfg(test)]
mod log_level_tests {
    use super::check_log_level;

    #[test]
    fn chatty_libraries_log_warnings_unless_named() {
        let f = super::with_quiet_libraries("debug");
        assert!(
            f.starts_with("debug,")
                && f.contains(",rustables=warn")
                && f.contains(",hickory_server=warn"),
            "{f}"
        );
        let f = super::with_quiet_libraries("info,hickory_server=debug");
        assert!(
            !f.contains("hickory_server=warn") && f.contains("rustables=warn"),
            "{f}"
        );
    }

    #[test]
    fn levels_and_filters_pass_and_other_words_are_refused() {
        for ok in [
            "info",
            "WARN",
            "debug",
            "off",
            "info,opendsec::roles::edge=debug",
            "h2=warn",
        ] {
            assert_eq!(check_log_level(ok), Ok(()), "{ok}");
        }
        for bad in ["verbose", "", "info,loud", "  "] {
            let e = check_log_level(bad).expect_err(bad);
            assert!(e.starts_with(&format!("-log {bad:?}")), "{e}");
            assert!(e.contains("error, warn, info"), "{e}");
        }
    }
}

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the process-wide metrics recorder once and returns its handle.
pub fn metrics_handle() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new().build_recorder();
            let handle = recorder.handle();
            // A second recorder (tests in one process) keeps the first; the handle still renders.
            let _ = metrics::set_global_recorder(recorder);
            metrics::gauge!("opendsec_build_info", "version" => env!("CARGO_PKG_VERSION")).set(1.0);
            handle
        })
        .clone()
}

/// Readiness of one role: set by the role, served on `/readyz`, exported as `opendsec_ready`.
/// Once `drain` is called it stays false whatever the role reports (shutting down).
#[derive(Clone, Default)]
pub struct Ready(Arc<(AtomicBool, AtomicBool)>);

impl Ready {
    pub fn set(&self, v: bool, role: &'static str) {
        self.0 .0.store(v, Ordering::Relaxed);
        let v = v && !self.0 .1.load(Ordering::Relaxed);
        metrics::gauge!("opendsec_ready", "role" => role).set(if v { 1.0 } else { 0.0 });
    }
    /// Not ready from now on, for good.
    pub fn drain(&self, role: &'static str) {
        self.0 .1.store(true, Ordering::Relaxed);
        metrics::gauge!("opendsec_ready", "role" => role).set(0.0);
    }
    pub fn get(&self) -> bool {
        self.0 .0.load(Ordering::Relaxed) && !self.0 .1.load(Ordering::Relaxed)
    }
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `listener` until shutdown.
pub async fn serve_health(
    listener: tokio::net::TcpListener,
    ready: Ready,
    shutdown: Shutdown,
) -> std::io::Result<()> {
    let handle = metrics_handle();
    let r2 = ready.clone();
    let app = Router::new()
        .route(
            "/metrics",
            get(move || {
                let h = handle.clone();
                async move { h.render() }
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(move || {
                let r = r2.clone();
                async move {
                    if r.get() {
                        (axum::http::StatusCode::OK, "ready\n")
                    } else {
                        (axum::http::StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
                    }
                }
            }),
        );
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { shutdown.wait().await })
        .await
}
