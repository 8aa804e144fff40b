//! A microVM boots with aether as its PID 1 (docs/microvm.md): Debian's cloud kernel under
//! QEMU's `microvm` machine (TCG here), the initramfs the backend builds (this build's
//! binary as `/init` and the kernel's virtio modules), the config disk, and the runtime API
//! served over the agent's virtio-serial port. The kernel is unpacked once into
//! target/guest-kernel by packaging/kernel/fetch-debian.sh.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use opendsec::backends::microvm::{agent_channel, initramfs, qemu, qemu_binary};
use opendsec::guest::vminit::{config_disk, VmConfig, CONFIG_SERIAL};
use opendsec::pb;
use opendsec::pb::runtime_client::RuntimeClient;

/// The guest kernel: `OPENDSEC_TEST_KERNEL`, else Debian's cloud kernel in
/// target/guest-kernel (fetched there the first time).
fn kernel() -> PathBuf {
    if let Some(k) = std::env::var_os("OPENDSEC_TEST_KERNEL") {
        return PathBuf::from(k);
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/guest-kernel");
    let find = || {
        std::fs::read_dir(dir.join("boot"))
            .ok()?
            .flatten()
            .map(|e| e.path())
            .find(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("vmlinuz-"))
            })
    };
    if let Some(k) = find() {
        return k;
    }
    let st = Command::new("bash")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/kernel/fetch-debian.sh"))
        .arg(&dir)
        .status()
        .expect("run fetch-debian.sh");
    assert!(st.success(), "fetch-debian.sh failed");
    find().expect("a kernel after fetch-debian.sh")
}

/// This build's binary without its debug sections (a third of the size in the initramfs).
fn agent(dir: &Path) -> PathBuf {
    let out = dir.join("opendsec");
    let ok = Command::new("strip")
        .arg("-o")
        .arg(&out)
        .arg(common::BIN)
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        std::fs::copy(common::BIN, &out).unwrap();
    }
    out
}

struct Vm {
    child: std::process::Child,
    console: PathBuf,
}

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Vm {
    fn console(&self) -> String {
        std::fs::read_to_string(&self.console).unwrap_or_default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_microvm_boots_with_aether_as_init_and_answers_on_its_agent_port() {
    let qemu_bin = qemu_binary().expect("qemu-system-x86_64 on PATH (.ci/run installs it)");
    let dir = tempfile::tempdir().unwrap();
    let kernel = kernel();
    let modules = initramfs::modules_of(&kernel);
    let initrd = dir.path().join("initrd");
    let loaded = initramfs::build(&agent(dir.path()), modules.as_deref(), &initrd).unwrap();
    assert!(
        loaded.iter().any(|m| m.starts_with("virtio_console.ko")),
        "{loaded:?}"
    );
    let cfg_disk = dir.path().join("config.img");
    std::fs::write(
        &cfg_disk,
        config_disk(&VmConfig {
            sandbox_id: "n1.vmtest".into(),
            hostname: "vm-under-test".into(),
            ..Default::default()
        }),
    )
    .unwrap();
    let machine = qemu::Machine {
        kernel: kernel.clone(),
        initrd: Some(initrd),
        append: "console=ttyS0 panic=-1 reboot=t quiet".into(),
        init_args: vec!["aether".into(), "--vm-init".into()],
        memory_mb: 512,
        vcpus: 1,
        accel: qemu::Accel::Tcg {
            tsc_khz: qemu::host_tsc_khz(),
        },
        ram: qemu::RamFile {
            path: dir.path().join("ram"),
            shared: true,
        },
        disks: vec![qemu::Disk {
            path: cfg_disk,
            read_only: true,
            serial: CONFIG_SERIAL.into(),
        }],
        agent_socket: dir.path().join("agent.sock"),
        qmp_socket: dir.path().join("qmp.sock"),
        tap: None,
        console_log: Some(dir.path().join("console.log")),
        incoming: false,
    };
    let child = Command::new(&qemu_bin)
        .args(machine.args().unwrap())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("qemu.err")).unwrap())
        .spawn()
        .unwrap();
    let vm = Vm {
        child,
        console: dir.path().join("console.log"),
    };
    // QEMU makes its sockets at once; the guest answers once booted (seconds under TCG).
    let start = Instant::now();
    let qemu_err = dir.path().join("qemu.err");
    let mut rt = connect_within(
        &machine.agent_socket,
        Duration::from_secs(180),
        5,
        500,
        || {
            format!(
                "the guest did not answer in time; console:\n{}\nqemu: {}",
                vm.console(),
                std::fs::read_to_string(&qemu_err).unwrap_or_default()
            )
        },
    )
    .await;
    eprintln!("guest answered {:?} after QEMU started", start.elapsed());
    // A process started straight from the agent binary, inside the guest.
    let out = run(&mut rt, &["/init", "version"]).await;
    assert_eq!(out.trim(), format!("opendsec {}", opendsec::VERSION));
    // The guest's own kernel and hostname, not the host's.
    let host_release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let release = kernel
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .trim_start_matches("vmlinuz-")
        .to_string();
    let guest_version = read(&mut rt, "/proc/sys/kernel/osrelease").await;
    assert_eq!(guest_version.trim(), release);
    assert_ne!(guest_version.trim(), host_release.trim());
    assert_eq!(
        read(&mut rt, "/proc/sys/kernel/hostname").await.trim(),
        "vm-under-test"
    );
    // The edge's next connection (an edge restart, a channel given up): the guest drops
    // the old connection's sessions at its RESET and serves the new one.
    drop(rt);
    let again = Instant::now();
    let mut rt = connect_within(
        &machine.agent_socket,
        Duration::from_secs(20),
        3,
        100,
        || {
            format!(
                "the guest did not answer a second connection; console:\n{}",
                vm.console()
            )
        },
    )
    .await;
    eprintln!("a second connection answered after {:?}", again.elapsed());
    let out = run(&mut rt, &["/init", "version"]).await;
    assert_eq!(out.trim(), format!("opendsec {}", opendsec::VERSION));
    drop(vm);
}

/// Connects to the agent port at `socket` and lists sessions, try after try (each bounded
/// by `try_s`: a guest not yet reading its port leaves a call unanswered, `pause_ms` apart)
/// for at most `limit`; panics with `why()` past that.
async fn connect_within(
    socket: &std::path::Path,
    limit: Duration,
    try_s: u64,
    pause_ms: u64,
    why: impl Fn() -> String,
) -> RuntimeClient<tonic::transport::Channel> {
    let start = Instant::now();
    loop {
        assert!(start.elapsed() < limit, "{}", why());
        let attempt = async {
            let ch = agent_channel(socket).await.ok()?;
            let mut c = RuntimeClient::new(ch);
            c.list_sessions(pb::ListSessionsRequest::default())
                .await
                .ok()?;
            Some(c)
        };
        if let Ok(Some(c)) = tokio::time::timeout(Duration::from_secs(try_s), attempt).await {
            return c;
        }
        tokio::time::sleep(Duration::from_millis(pause_ms)).await;
    }
}

/// Runs `argv` in the guest through StartProcess and returns its stdout.
async fn run(rt: &mut RuntimeClient<tonic::transport::Channel>, argv: &[&str]) -> String {
    let mut s = rt
        .start_process(pb::StartProcessRequest {
            cmd: argv[0].to_string(),
            args: argv[1..].iter().map(|a| a.to_string()).collect(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut out = Vec::new();
    while let Some(ev) = s.message().await.unwrap() {
        if let Some(pb::process_event::Kind::Stdout(d)) = ev.kind {
            out.extend_from_slice(&d);
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Reads a file in the guest.
async fn read(rt: &mut RuntimeClient<tonic::transport::Channel>, path: &str) -> String {
    let r = rt
        .read_file(pb::ReadFileRequest {
            path: path.into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    String::from_utf8_lossy(&r.data).into_owned()
}
