//! `opendsec ctl bench`: creation throughput and latency through the whole stack
//! (client → apiserver → IAM → edge) on an in-process simulated cluster, and with `-compare`
//! random placement (k = 1) against power-of-2 on the same load.

use std::process::ExitCode;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use argh::FromArgs;

use super::local::{LocalCluster, UpOptions};
use crate::pb;

#[derive(FromArgs, Debug)]
/// Scheduling benchmark on an in-process simulated cluster. Exit status: 0, 1 when a run
/// fails, 2 for a bad command line.
#[argh(help_triggers("-h", "--help", "help"))]
struct BenchFlags {
    /// compare random placement with power-of-2
    #[argh(switch)]
    compare: bool,
    /// simulated edges (default 8)
    #[argh(option, default = "8")]
    edges: usize,
    /// single creations to make (default 10000)
    #[argh(option, default = "10000")]
    count: u32,
    /// concurrent callers for single creations (default 64)
    #[argh(option, default = "64")]
    concurrency: u32,
    /// size of the batch creation to time, 0 skips it (default 32768)
    #[argh(option, default = "32768")]
    batch: u32,
    /// median simulated creation time of the edges' sim backend, ms (default 0)
    #[argh(option, default = "0.0")]
    sim_latency_ms: f64,
    /// emit one JSON object instead of text
    #[argh(switch)]
    json: bool,
    /// keep IAM's state in a file (every change fsynced) instead of in memory
    #[argh(switch)]
    durable: bool,
    /// repeat each placement mode this many times (fresh cluster each run) and report medians
    /// (default 1)
    #[argh(option, default = "1")]
    runs: u32,
}

/// Results of one run.
#[derive(Debug, Default, serde::Serialize)]
pub struct BenchResult {
    pub placement: String,
    /// Where IAM kept its state: `memory` or `state file` (fsynced group commits).
    pub iam: String,
    pub single_count: u32,
    pub single_failed: u32,
    pub single_per_s: f64,
    pub single_p50_ms: f64,
    pub single_p99_ms: f64,
    pub batch_count: u32,
    pub batch_failed: u32,
    pub batch_s: f64,
    pub batch_per_s: f64,
    /// Sandboxes on the fullest edge divided by the mean per edge (1.0 = perfect balance).
    pub max_over_mean: f64,
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v.get(i).or(v.last()).copied().unwrap_or(0.0)
}

fn with_token<T>(m: T, token: &str) -> tonic::Request<T> {
    crate::rpc::client::with_token(m, token)
}

/// Runs one benchmark round on a fresh cluster with placement `k`.
pub async fn run_once(
    f_edges: usize,
    count: u32,
    concurrency: u32,
    batch: u32,
    latency: f64,
    k: usize,
    durable: bool,
) -> anyhow::Result<BenchResult> {
    let state = tempfile_dir()?;
    let iam_state = if durable {
        format!("{state}/iam.state")
    } else {
        String::new()
    };
    let o = UpOptions {
        sim_edges: f_edges,
        addr: "127.0.0.1:0".into(),
        state_dir: state.clone(),
        disk_reserve_mb: -1,
        create_latency_ms: latency,
        latency_sigma: if latency > 0.0 { 0.5 } else { 0.0 },
        k: Some(k),
        create_rate: -1.0,
        request_rate: -1.0,
        iam_state,
        ..Default::default()
    };
    let cluster = LocalCluster::up(&o).await?;
    let addr = cluster
        .api_addrs
        .first()
        .ok_or_else(|| anyhow::anyhow!("the local cluster started no apiserver"))?;
    let ch = crate::rpc::client::channel(addr, Duration::from_secs(2))?;
    let client =
        pb::d_sec_client::DSecClient::new(ch).max_decoding_message_size(crate::rpc::MAX_MESSAGE);
    let token = cluster.admin_token.clone();
    let spec = pb::SandboxSpec {
        backend: "sim".into(),
        cpu_cores_limit: 1.0,
        memory_limit_mb: 512,
        ..Default::default()
    };
    let mut out = BenchResult {
        placement: if k == 1 {
            "random".into()
        } else {
            format!("power-of-{k}")
        },
        iam: if durable {
            "state file".into()
        } else {
            "memory".into()
        },
        ..Default::default()
    };

    // Single creations from `concurrency` callers.
    let next = Arc::new(AtomicU32::new(0));
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency.max(1) {
        let (mut c, next, token, spec) =
            (client.clone(), next.clone(), token.clone(), spec.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut failed = 0u32;
            while next.fetch_add(1, Ordering::Relaxed) < count {
                let t = Instant::now();
                let r = c
                    .create_sandbox(with_token(
                        pb::CreateSandboxRequest {
                            spec: Some(spec.clone()),
                            project: String::new(),
                            idempotency_key: String::new(),
                        },
                        &token,
                    ))
                    .await;
                lat.push(t.elapsed().as_secs_f64() * 1000.0);
                if r.is_err() {
                    failed += 1;
                }
            }
            (lat, failed)
        }));
    }
    let mut lat = Vec::new();
    for t in tasks {
        let (l, f) = t.await?;
        lat.extend(l);
        out.single_failed += f;
    }
    let secs = t0.elapsed().as_secs_f64();
    out.single_count = count;
    out.single_per_s = count as f64 / secs;
    out.single_p50_ms = pct(&mut lat, 0.5);
    out.single_p99_ms = pct(&mut lat, 0.99);

    // One batch.
    if batch > 0 {
        let t0 = Instant::now();
        let mut c = client.clone();
        let mut s = c
            .create_sandboxes(with_token(
                pb::CreateSandboxesRequest {
                    spec: Some(spec.clone()),
                    project: String::new(),
                    count: batch,
                    idempotency_key: String::new(),
                },
                &token,
            ))
            .await?
            .into_inner();
        let (mut n, mut failed) = (0u32, 0u32);
        while let Some(item) = s.message().await? {
            n += 1;
            if item.error.is_some() {
                failed += 1;
            }
        }
        out.batch_s = t0.elapsed().as_secs_f64();
        out.batch_count = n;
        out.batch_failed = failed;
        out.batch_per_s = n as f64 / out.batch_s;
    }

    // Balance across edges, from the cluster snapshot once it has caught up.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let snap = client
        .clone()
        .cluster_status(with_token(pb::Empty {}, &token))
        .await?
        .into_inner();
    let per: Vec<f64> = snap
        .edges
        .iter()
        .map(|e| {
            e.allocated
                .as_ref()
                .map(|a| a.sandboxes as f64)
                .unwrap_or(0.0)
        })
        .collect();
    let mean = per.iter().sum::<f64>() / per.len().max(1) as f64;
    let max = per.iter().cloned().fold(0.0, f64::max);
    out.max_over_mean = if mean > 0.0 { max / mean } else { 0.0 };
    cluster.down().await;
    let _ = std::fs::remove_dir_all(&state);
    Ok(out)
}

fn tempfile_dir() -> anyhow::Result<String> {
    let d = std::env::temp_dir().join(format!(
        "opendsec-bench-{}",
        hex::encode(rand::random::<[u8; 6]>())
    ));
    std::fs::create_dir_all(&d)?;
    Ok(d.display().to_string())
}

/// Field-wise medians of several runs of one placement mode.
fn median_of(runs: &[BenchResult]) -> BenchResult {
    let med = |f: &dyn Fn(&BenchResult) -> f64| {
        let mut v: Vec<f64> = runs.iter().map(f).collect();
        pct(&mut v, 0.5)
    };
    BenchResult {
        placement: runs
            .first()
            .map(|r| r.placement.clone())
            .unwrap_or_default(),
        iam: runs.first().map(|r| r.iam.clone()).unwrap_or_default(),
        single_count: runs.first().map(|r| r.single_count).unwrap_or(0),
        single_failed: runs.iter().map(|r| r.single_failed).sum(),
        single_per_s: med(&|r| r.single_per_s),
        single_p50_ms: med(&|r| r.single_p50_ms),
        single_p99_ms: med(&|r| r.single_p99_ms),
        batch_count: runs.first().map(|r| r.batch_count).unwrap_or(0),
        batch_failed: runs.iter().map(|r| r.batch_failed).sum(),
        batch_s: med(&|r| r.batch_s),
        batch_per_s: med(&|r| r.batch_per_s),
        max_over_mean: med(&|r| r.max_over_mean),
    }
}

fn print(r: &BenchResult) {
    println!(
        "{:<12} single: {} in total, {} failed, {:.0}/s, p50 {:.2} ms, p99 {:.2} ms | batch: {} ({} failed) in {:.2} s = {:.0}/s | max/mean per edge {:.3}",
        r.placement, r.single_count, r.single_failed, r.single_per_s, r.single_p50_ms, r.single_p99_ms, r.batch_count, r.batch_failed, r.batch_s, r.batch_per_s, r.max_over_mean
    );
}

/// Entry for `bench`.
pub fn main(args: &[String]) -> ExitCode {
    let f: BenchFlags = match crate::cli::flags::parse("opendsec ctl bench", args) {
        Ok(f) => f,
        Err(code) => return code,
    };
    let _ = crate::telemetry::init_logging("warn");
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: internal: {e}", e = crate::types::chain(&e));
            return ExitCode::from(1);
        }
    };
    let ks: Vec<usize> = if f.compare { vec![1, 2] } else { vec![2] };
    let mut results = Vec::new();
    let mut medians = Vec::new();
    for k in ks {
        let mut runs = Vec::new();
        for _ in 0..f.runs.max(1) {
            match rt.block_on(run_once(
                f.edges,
                f.count,
                f.concurrency,
                f.batch,
                f.sim_latency_ms,
                k,
                f.durable,
            )) {
                Ok(r) => {
                    if !f.json {
                        print(&r);
                    }
                    runs.push(r);
                }
                Err(e) => {
                    eprintln!("error: {e:#}");
                    return ExitCode::from(1);
                }
            }
        }
        let m = median_of(&runs);
        if !f.json && runs.len() > 1 {
            print!("median of {}: ", runs.len());
            print(&m);
        }
        medians.push(m);
        results.extend(runs);
    }
    if f.json {
        let doc = serde_json::json!({ "runs": results, "medians": medians });
        println!("{}", serde_json::to_string_pretty(&doc).unwrap_or_default());
    }
    ExitCode::SUCCESS
}
