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

use opendsec::backends::microvm::{agent_channel, disks, initramfs, qemu, qemu_binary};
use opendsec::guest::vminit::{
    VmConfig, AGENT_DIR, AGENT_FILE, AGENT_SERIAL, CONFIG_SERIAL, IMAGE_SERIAL, RW_SERIAL,
};
use opendsec::pb;
use opendsec::pb::runtime_client::RuntimeClient;

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

/// An ext4 disk image at `out` holding `dir`'s files (none: an empty file system) with
/// `spare_mb` beyond them, as `mkfs.ext4 -d` makes it.
fn ext4(out: &Path, dir: Option<&Path>, spare_mb: u64) {
    let used: u64 = dir.map_or(0, |d| {
        walk(d)
            .iter()
            .map(|p| std::fs::metadata(p).map_or(0, |m| m.len()))
            .sum()
    });
    let size_mb = used / (1 << 20) + used / (1 << 22) + spare_mb;
    let f = std::fs::File::create(out).unwrap();
    f.set_len(size_mb << 20).unwrap();
    let mut cmd = Command::new("mkfs.ext4");
    cmd.args(["-q", "-F", "-E", "root_owner=0:0"]);
    if let Some(d) = dir {
        cmd.arg("-d").arg(d);
    }
    let out = cmd.arg(out).output().unwrap();
    assert!(
        out.status.success(),
        "mkfs.ext4: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn walk(d: &Path) -> Vec<PathBuf> {
    let mut all = Vec::new();
    for e in std::fs::read_dir(d).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            all.extend(walk(&p));
        } else {
            all.push(p);
        }
    }
    all
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
    let kernel = common::guest_kernel();
    let modules = initramfs::modules_of(&kernel);
    let initrd = dir.path().join("initrd");
    let loaded = initramfs::build(&agent(dir.path()), modules.as_deref(), &initrd).unwrap();
    // A modular kernel (Debian's) brings its virtio modules; one with them built in
    // (packaging/kernel/build.sh) has none to bring.
    match &modules {
        Some(_) => assert!(
            loaded.iter().any(|m| m.starts_with("virtio_console.ko")),
            "{loaded:?}"
        ),
        None => assert!(loaded.is_empty(), "{loaded:?}"),
    }
    // The three disks the guest assembles its root from: an image with one file of its own,
    // an empty writable disk, and the agent disk with this build's binary.
    let image_dir = dir.path().join("image");
    std::fs::create_dir_all(image_dir.join("etc")).unwrap();
    std::fs::write(image_dir.join("etc/image-marker"), "from the image\n").unwrap();
    let image_disk = dir.path().join("image.ext4");
    ext4(&image_disk, Some(&image_dir), 8);
    let rw_disk = dir.path().join("rw.ext4");
    ext4(&rw_disk, None, 64);
    let agent_disk = disks::agent_disk(&agent(dir.path()), &dir.path().join("disks")).unwrap();
    let cfg_disk = dir.path().join("config.img");
    disks::config_disk(
        &cfg_disk,
        &VmConfig {
            sandbox_id: "n1.vmtest".into(),
            hostname: "vm-under-test".into(),
            ..Default::default()
        },
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
            open_read_only: false,
        },
        disks: vec![
            qemu::Disk {
                path: agent_disk,
                read_only: true,
                serial: AGENT_SERIAL.into(),
            },
            qemu::Disk {
                path: image_disk,
                read_only: true,
                serial: IMAGE_SERIAL.into(),
            },
            qemu::Disk {
                path: rw_disk,
                read_only: false,
                serial: RW_SERIAL.into(),
            },
            qemu::Disk {
                path: cfg_disk,
                read_only: true,
                serial: CONFIG_SERIAL.into(),
            },
        ],
        agent_socket: dir.path().join("agent.sock"),
        qmp_socket: dir.path().join("qmp.sock"),
        listen_fds: None,
        tap_fd: None,
        console: qemu::Console::File(dir.path().join("console.log")),
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
    // The second stage runs from the agent disk, in the sandbox's root: the image's files
    // under an overlay, the initramfs gone.
    let agent_bin = format!("{AGENT_DIR}/{AGENT_FILE}");
    let out = run(&mut rt, &[&agent_bin, "version"]).await;
    assert_eq!(out.trim(), format!("opendsec {}", opendsec::VERSION));
    assert_eq!(read(&mut rt, "/etc/image-marker").await, "from the image\n");
    let mounts = read(&mut rt, "/proc/self/mountinfo").await;
    let root = mounts
        .lines()
        .find(|l| l.split(' ').nth(4) == Some("/"))
        .unwrap_or_default();
    assert!(root.contains(" - overlay "), "root mount: {root}\n{mounts}");
    // Its upper layer is on the writable disk, its lower the image disk.
    assert!(
        root.contains("lowerdir=/mnt/image,upperdir=/mnt/rw/upper"),
        "root mount: {root}"
    );
    let agent_mount = mounts
        .lines()
        .find(|l| l.split(' ').nth(4) == Some(AGENT_DIR))
        .unwrap_or_default();
    assert!(
        agent_mount
            .split(' ')
            .nth(5)
            .is_some_and(|o| o.split(',').any(|f| f == "ro")),
        "agent disk mount: {agent_mount}"
    );
    assert!(
        read_err(&mut rt, "/init").await,
        "the initramfs's /init is still there"
    );
    assert!(read_err(&mut rt, "/modules/order").await);
    // The machine id comes from the sandbox id.
    use sha2::Digest;
    let want_id = hex::encode(&sha2::Sha256::digest(b"n1.vmtest")[..16]);
    assert_eq!(read(&mut rt, "/etc/machine-id").await.trim(), want_id);
    // What the sandbox writes goes to its writable disk's upper layer.
    rt.write_file(pb::WriteFileRequest {
        path: "/etc/written-in-the-vm".into(),
        data: b"kept\n".to_vec(),
        ..Default::default()
    })
    .await
    .unwrap();
    assert_eq!(read(&mut rt, "/etc/written-in-the-vm").await, "kept\n");
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
    let out = run(&mut rt, &[&agent_bin, "version"]).await;
    assert_eq!(out.trim(), format!("opendsec {}", opendsec::VERSION));
    drop(rt);
    drop(vm);
}

/// Whether reading `path` in the guest fails.
async fn read_err(rt: &mut RuntimeClient<tonic::transport::Channel>, path: &str) -> bool {
    rt.read_file(pb::ReadFileRequest {
        path: path.into(),
        ..Default::default()
    })
    .await
    .is_err()
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
        // A guest that powered off (its init failed) answers never.
        let said = why();
        assert!(
            !said.contains("reboot: Power down") && !said.contains("Kernel panic"),
            "{said}"
        );
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
