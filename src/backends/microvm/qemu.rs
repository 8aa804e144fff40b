//! QEMU's command line for one microVM (docs/microvm.md "QEMU"): the `microvm` machine with
//! ACPI on (Debian's kernel finds virtio-mmio devices only through ACPI), guest RAM in a
//! file of the sandbox's (so a snapshot can leave it out of the migration stream and copies
//! can map it copy-on-write), devices always in the same order (a restore needs the saved
//! device list), the agent's virtio-serial port and QMP on unix sockets, and QEMU's own
//! seccomp sandbox.

use std::ffi::OsString;
use std::path::PathBuf;

pub use crate::guest::vminit::AGENT_PORT;

/// How the guest's CPU runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    /// Hardware virtualization (`-accel kvm -cpu host,-arch-capabilities`: some nested
    /// KVMs refuse the arch-capabilities MSR).
    Kvm,
    /// Software emulation. `tsc_khz` is the host's TSC rate, passed as `tsc_early_khz`:
    /// without it about a quarter of TCG boots hang calibrating the TSC against the PIT.
    Tcg { tsc_khz: u32 },
}

/// One block device, in the order given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Disk {
    pub path: PathBuf,
    pub read_only: bool,
    /// The serial number the guest finds it by (`/sys/block/vd*/serial`; at most 20
    /// bytes, letters, digits and `-`).
    pub serial: String,
}

/// Guest RAM backed by a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RamFile {
    pub path: PathBuf,
    /// `true`: QEMU writes guest memory to the file (a VM that will be snapshotted);
    /// `false`: a private copy-on-write mapping of it (a restored copy).
    pub shared: bool,
    /// A private mapping of a file opened read-only (`readonly=on,rom=off`, QEMU 8.2 and
    /// later): the file need not be writable to QEMU. Before 8.2 `readonly=on` made the
    /// guest's RAM read-only too, so QEMU opens the file read-write.
    pub open_read_only: bool,
}

/// Everything that makes one VM's command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Machine {
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    /// The kernel's parameters (what [`Accel::Tcg`] needs is added).
    pub append: String,
    /// Arguments for the guest's init, after the kernel's `--`.
    pub init_args: Vec<String>,
    pub memory_mb: u64,
    pub vcpus: u32,
    pub accel: Accel,
    pub ram: RamFile,
    pub disks: Vec<Disk>,
    /// The unix socket QEMU serves the agent port on.
    pub agent_socket: PathBuf,
    /// The unix socket QEMU serves QMP on.
    pub qmp_socket: PathBuf,
    /// Listening sockets the node made at `agent_socket` and `qmp_socket`, inherited by
    /// QEMU as these descriptors (agent, QMP): a jailed QEMU cannot make sockets where the
    /// node looks for them, and must not be able to. None: QEMU makes them at the paths.
    pub listen_fds: Option<(i32, i32)>,
    /// An open TAP device of the VM's network namespace (`crate::netpol::vmns`), inherited
    /// by QEMU as this descriptor, when the VM has networking: QEMU, in a namespace of its
    /// own, could open none.
    pub tap_fd: Option<i32>,
    /// Where the guest's serial console goes.
    pub console: Console,
    /// Start waiting for a migration stream (`-incoming defer`): a restore.
    pub incoming: bool,
}

pub use crate::netpol::vmns::GUEST_MAC;

/// Where a VM's serial console (the kernel's `ttyS0`) goes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Console {
    /// Nowhere (`-serial null`).
    #[default]
    Null,
    /// Appended to a file without bound: for tests and diagnostics by hand, never for a
    /// guest whose root could write to it without end.
    File(PathBuf),
    /// A connected stream socket QEMU inherits as this descriptor (`-chardev
    /// socket,fd=N`): the node reads the other end while it wants to (a boot's last words,
    /// `super::console`) and closes it after; QEMU then drops what the guest writes.
    Fd(i32),
}

/// Why a [`Machine`] cannot be turned into a command line.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MachineError {
    #[error("{what} {path:?} is not an absolute path")]
    RelativePath { what: &'static str, path: PathBuf },
    #[error("{what} {value:?} must be 1 to {max} of A-Z, a-z, 0-9 and '-'")]
    BadName {
        what: &'static str,
        value: String,
        max: usize,
    },
    #[error("init argument {0:?} is empty or holds white space")]
    BadInitArg(String),
    #[error("the console log {0:?} holds a comma")]
    CommaInConsole(PathBuf),
}

/// A name QEMU takes inside `key=value,...` (a disk's serial): a short run
/// of letters, digits and '-', so it can neither end its option nor start another.
fn check_name(what: &'static str, value: &str, max: usize) -> Result<(), MachineError> {
    let ok = !value.is_empty()
        && value.len() <= max
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(MachineError::BadName {
            what,
            value: value.to_string(),
            max,
        })
    }
}

impl Machine {
    /// Checks what `args` puts on the command line: every path absolute (QEMU's working
    /// directory is not ours to rely on), serials at most 20 of `[A-Za-z0-9-]`, init arguments without white space (the kernel splits its
    /// command line there).
    pub fn check(&self) -> Result<(), MachineError> {
        let mut paths: Vec<(&'static str, &std::path::Path)> = vec![
            ("kernel", &self.kernel),
            ("RAM file", &self.ram.path),
            ("agent socket", &self.agent_socket),
            ("QMP socket", &self.qmp_socket),
        ];
        if let Some(i) = &self.initrd {
            paths.push(("initrd", i));
        }
        if let Console::File(c) = &self.console {
            paths.push(("console log", c));
            if c.to_string_lossy().contains(',') {
                return Err(MachineError::CommaInConsole(c.clone()));
            }
        }
        for d in &self.disks {
            paths.push(("disk", &d.path));
            check_name("disk serial", &d.serial, 20)?;
        }
        for (what, p) in paths {
            if !p.is_absolute() {
                return Err(MachineError::RelativePath {
                    what,
                    path: p.to_path_buf(),
                });
            }
        }
        if let Some(bad) = self
            .init_args
            .iter()
            .find(|a| a.is_empty() || a.chars().any(char::is_whitespace))
        {
            return Err(MachineError::BadInitArg(bad.clone()));
        }
        Ok(())
    }

    /// `qemu-system-x86_64`'s arguments (without the program name), after [`Machine::check`].
    /// The kernel always gets `panic=-1`: a guest kernel that panics ends its VM (with
    /// `-no-reboot`, QEMU exits) rather than hang with its memory held.
    pub fn args(&self) -> Result<Vec<OsString>, MachineError> {
        self.check()?;
        let mut a: Vec<OsString> = Vec::new();
        let mut push = |s: &str| a.push(OsString::from(s));
        push("-M");
        push("microvm,memory-backend=mem,acpi=on");
        match self.accel {
            Accel::Kvm => {
                push("-accel");
                push("kvm");
                push("-cpu");
                push("host,-arch-capabilities");
            }
            Accel::Tcg { .. } => {
                push("-accel");
                push("tcg");
                push("-cpu");
                push("max");
            }
        }
        push("-m");
        push(&format!("{}M", self.memory_mb));
        push("-smp");
        push(&self.vcpus.max(1).to_string());
        for s in [
            "-nodefaults",
            "-no-user-config",
            "-nographic",
            "-no-reboot",
            "-display",
            "none",
        ] {
            push(s);
        }
        // QEMU's own seccomp filter: no exec, no privilege changes, no resource control.
        push("-sandbox");
        push("on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny");
        let mut mem = OsString::from(format!(
            "memory-backend-file,id=mem,size={}M,share={},mem-path=",
            self.memory_mb,
            if self.ram.shared { "on" } else { "off" }
        ));
        mem.push(escape(&self.ram.path));
        if !self.ram.shared && self.ram.open_read_only {
            mem.push(",readonly=on,rom=off");
        }
        a.push("-object".into());
        a.push(mem);
        a.push("-kernel".into());
        a.push(self.kernel.clone().into_os_string());
        if let Some(i) = &self.initrd {
            a.push("-initrd".into());
            a.push(i.clone().into_os_string());
        }
        let mut append = self.append.clone();
        if !append.split_whitespace().any(|w| w.starts_with("panic=")) {
            append.push_str(" panic=-1");
        }
        if let Accel::Tcg { tsc_khz } = self.accel {
            if tsc_khz > 0 {
                append.push_str(&format!(" tsc_early_khz={tsc_khz}"));
            }
        }
        // The kernel hands what follows `--` to init, so it comes last.
        if !self.init_args.is_empty() {
            append.push_str(" -- ");
            append.push_str(&self.init_args.join(" "));
        }
        a.push("-append".into());
        a.push(append.trim().into());
        match &self.console {
            Console::Null => {
                a.push("-serial".into());
                a.push("null".into());
            }
            Console::File(p) => {
                let mut s = OsString::from("file:");
                s.push(p);
                a.push("-serial".into());
                a.push(s);
            }
            Console::Fd(fd) => {
                a.push("-chardev".into());
                a.push(format!("socket,id=console,fd={fd}").into());
                a.push("-serial".into());
                a.push("chardev:console".into());
            }
        }
        for (i, d) in self.disks.iter().enumerate() {
            let mut drive = OsString::from(format!(
                "if=none,id=d{i},format=raw,cache=unsafe,readonly={},file=",
                if d.read_only { "on" } else { "off" }
            ));
            drive.push(escape(&d.path));
            a.push("-drive".into());
            a.push(drive);
            a.push("-device".into());
            a.push(format!("virtio-blk-device,drive=d{i},serial={}", d.serial).into());
        }
        a.push("-device".into());
        a.push("virtio-serial-device".into());
        let chardev = match self.listen_fds {
            Some((agent, _)) => {
                OsString::from(format!("socket,id=agent,server=on,wait=off,fd={agent}"))
            }
            None => {
                let mut c = OsString::from("socket,id=agent,server=on,wait=off,path=");
                c.push(escape(&self.agent_socket));
                c
            }
        };
        a.push("-chardev".into());
        a.push(chardev);
        a.push("-device".into());
        a.push(format!("virtserialport,chardev=agent,name={AGENT_PORT}").into());
        a.push("-device".into());
        a.push("virtio-rng-device".into());
        if let Some(fd) = self.tap_fd {
            a.push("-netdev".into());
            a.push(format!("tap,id=n0,fd={fd}").into());
            a.push("-device".into());
            a.push(format!("virtio-net-device,netdev=n0,mac={GUEST_MAC}").into());
        }
        match self.listen_fds {
            Some((_, qmp)) => {
                a.push("-chardev".into());
                a.push(format!("socket,id=qmp,server=on,wait=off,fd={qmp}").into());
                a.push("-mon".into());
                a.push("chardev=qmp,mode=control".into());
            }
            None => {
                let mut qmp = OsString::from("unix:");
                qmp.push(escape(&self.qmp_socket));
                qmp.push(",server=on,wait=off");
                a.push("-qmp".into());
                a.push(qmp);
            }
        }
        if self.incoming {
            a.push("-incoming".into());
            a.push("defer".into());
        }
        Ok(a)
    }
}

/// A path inside one of QEMU's `key=value,...` options: a comma is written twice.
fn escape(p: &std::path::Path) -> OsString {
    use std::os::unix::ffi::{OsStrExt, OsStringExt};
    let mut out = Vec::new();
    for &b in p.as_os_str().as_bytes() {
        out.push(b);
        if b == b',' {
            out.push(b',');
        }
    }
    OsString::from_vec(out)
}

/// The host's TSC rate in kHz from `/proc/cpuinfo`'s first "cpu MHz" (0 when unknown).
pub fn host_tsc_khz() -> u32 {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("cpu MHz"))
                .and_then(|l| l.split(':').nth(1))
                .and_then(|v| v.trim().parse::<f64>().ok())
        })
        .map_or(0, |mhz| (mhz * 1000.0) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine() -> Machine {
        Machine {
            kernel: "/k/vmlinuz".into(),
            initrd: Some("/k/initrd".into()),
            append: "console=ttyS0 panic=-1".into(),
            init_args: vec!["aether".into(), "--vm-init".into()],
            memory_mb: 256,
            vcpus: 2,
            accel: Accel::Tcg { tsc_khz: 2_100_000 },
            ram: RamFile {
                path: "/s/a,b/ram".into(),
                shared: true,
                open_read_only: false,
            },
            disks: vec![
                Disk {
                    path: "/s/image.ext4".into(),
                    read_only: true,
                    serial: "odsec-image".into(),
                },
                Disk {
                    path: "/s/rw.ext4".into(),
                    read_only: false,
                    serial: "odsec-rw".into(),
                },
            ],
            agent_socket: "/s/agent.sock".into(),
            qmp_socket: "/s/qmp.sock".into(),
            listen_fds: None,
            tap_fd: Some(9),
            console: Console::Null,
            incoming: false,
        }
    }

    fn text(m: &Machine) -> Vec<String> {
        m.args()
            .expect("a good machine")
            .into_iter()
            .map(|s| s.to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn the_command_line_names_every_device_in_a_fixed_order() {
        let a = text(&machine());
        let at = |s: &str| a.iter().position(|x| x.contains(s)).unwrap_or(usize::MAX);
        assert!(a.contains(&"microvm,memory-backend=mem,acpi=on".to_string()));
        assert!(a.contains(
            &"console=ttyS0 panic=-1 tsc_early_khz=2100000 -- aether --vm-init".to_string()
        ));
        // A comma in a path is doubled, so it cannot start another option.
        assert!(a
            .iter()
            .any(|x| x.ends_with("share=on,mem-path=/s/a,,b/ram")));
        assert!(at("id=d0,") < at("id=d1,"));
        assert!(a
            .iter()
            .any(|x| x.contains("readonly=on,file=/s/image.ext4")));
        assert!(a.iter().any(|x| x.contains("readonly=off,file=/s/rw.ext4")));
        assert!(at("virtio-blk-device,drive=d1,serial=odsec-rw") < at("virtio-serial-device"));
        assert!(at("virtserialport") < at("virtio-net-device"));
        assert!(a.contains(&format!("virtserialport,chardev=agent,name={AGENT_PORT}")));
        assert!(a.iter().any(|x| x.starts_with("on,obsolete=deny")));
        assert!(!a.contains(&"-incoming".to_string()));
    }

    #[test]
    fn a_restored_copy_maps_the_ram_privately_and_waits_for_its_state() {
        let mut m = machine();
        m.ram.shared = false;
        m.incoming = true;
        m.accel = Accel::Kvm;
        m.tap_fd = None;
        let a = text(&m);
        assert!(a.iter().any(|x| x.contains("share=off")));
        assert!(!a.iter().any(|x| x.contains("readonly=on,rom=off")));
        m.ram.open_read_only = true;
        let a = text(&m);
        assert!(a
            .iter()
            .any(|x| x.ends_with("share=off,mem-path=/s/a,,b/ram,readonly=on,rom=off")));
        assert_eq!(a.last().map(String::as_str), Some("defer"));
        assert!(a.contains(&"host,-arch-capabilities".to_string()));
        assert!(!a.iter().any(|x| x.contains("tsc_early_khz")));
        assert!(!a.iter().any(|x| x.contains("virtio-net")));
    }

    #[test]
    fn a_jailed_qemu_serves_on_sockets_the_node_made() {
        let mut m = machine();
        m.listen_fds = Some((7, 8));
        let a = text(&m);
        assert!(a.contains(&"socket,id=agent,server=on,wait=off,fd=7".to_string()));
        assert!(a.contains(&"socket,id=qmp,server=on,wait=off,fd=8".to_string()));
        assert!(a.contains(&"chardev=qmp,mode=control".to_string()));
        assert!(!a
            .iter()
            .any(|x| x.contains("agent.sock") || x.contains("qmp.sock")));
        assert!(!a.contains(&"-qmp".to_string()));
    }

    #[test]
    fn the_console_goes_nowhere_to_a_file_or_to_an_inherited_socket() {
        let mut m = machine();
        let a = text(&m);
        let at = a.iter().position(|x| x == "-serial").expect("-serial");
        assert_eq!(a.get(at + 1).map(String::as_str), Some("null"));
        m.console = Console::File("/s/console.log".into());
        assert!(text(&m).contains(&"file:/s/console.log".to_string()));
        m.console = Console::Fd(9);
        let a = text(&m);
        let at = a.iter().position(|x| x == "-serial").expect("-serial");
        assert_eq!(a.get(at + 1).map(String::as_str), Some("chardev:console"));
        assert!(a.contains(&"socket,id=console,fd=9".to_string()));
        assert_eq!(a.iter().filter(|x| *x == "-serial").count(), 1);
    }

    #[test]
    fn names_that_could_reach_other_options_and_relative_paths_are_refused() {
        let refused = |f: &dyn Fn(&mut Machine)| {
            let mut m = machine();
            f(&mut m);
            m.args().expect_err("refused")
        };
        for serial in ["", "odsec,x=1", "a b", "abcdefghijklmnopqrstu"] {
            assert!(matches!(
                refused(&|m| m.disks[0].serial = serial.into()),
                MachineError::BadName {
                    what: "disk serial",
                    ..
                }
            ));
        }
        assert!(matches!(
            refused(&|m| m.disks[1].path = "rw.ext4".into()),
            MachineError::RelativePath { what: "disk", .. }
        ));
        assert!(matches!(
            refused(&|m| m.kernel = "vmlinuz".into()),
            MachineError::RelativePath { what: "kernel", .. }
        ));
        assert_eq!(
            refused(&|m| m.init_args.push("--x y".into())),
            MachineError::BadInitArg("--x y".into())
        );
        assert!(matches!(
            refused(&|m| m.console = Console::File("/s/a,b.log".into())),
            MachineError::CommaInConsole(_)
        ));
        // panic=-1 is added where the caller gave no panic= of its own.
        let mut m = machine();
        m.append = "console=ttyS0".into();
        assert!(text(&m)
            .iter()
            .any(|x| x.starts_with("console=ttyS0 panic=-1")));
    }
}
