//! The container's security policy (docs/containers.md): the seccomp deny-list and
//! the capability set, Docker's defaults minus CAP_MKNOD.

use std::collections::BTreeMap;

use caps::{CapSet, Capability};
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// Why the policy could not be built or applied.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("building the seccomp program: {0}")]
    Build(String),
    #[error("installing the seccomp program: {0}")]
    Install(std::io::Error),
    #[error("dropping capability {cap}: {message}")]
    DropCap { cap: String, message: String },
}

/// Capabilities a sandbox's root keeps: Docker's default set without CAP_MKNOD (without a
/// device cgroup a device node could reach the host's disks).
pub const KEPT_CAPS: [Capability; 13] = [
    Capability::CAP_CHOWN,
    Capability::CAP_DAC_OVERRIDE,
    Capability::CAP_FSETID,
    Capability::CAP_FOWNER,
    Capability::CAP_NET_RAW,
    Capability::CAP_SETGID,
    Capability::CAP_SETUID,
    Capability::CAP_SETFCAP,
    Capability::CAP_SETPCAP,
    Capability::CAP_NET_BIND_SERVICE,
    Capability::CAP_SYS_CHROOT,
    Capability::CAP_KILL,
    Capability::CAP_AUDIT_WRITE,
];

/// System calls that fail with EPERM: mounting and namespace switching (the new mount API
/// too), kernel modules and kexec, bpf, keyrings, file handles (the "shocker" escape),
/// userfaultfd, perf_event_open, raw I/O ports, swap, quotas, reboot, and io_uring (whose
/// submissions bypass this filter).
const DENIED: &[i64] = &[
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_setns,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fspick,
    libc::SYS_move_mount,
    libc::SYS_open_tree,
    libc::SYS_mount_setattr,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_bpf,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_keyctl,
    libc::SYS_open_by_handle_at,
    libc::SYS_name_to_handle_at,
    libc::SYS_userfaultfd,
    libc::SYS_perf_event_open,
    libc::SYS_iopl,
    libc::SYS_ioperm,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_quotactl,
    libc::SYS_quotactl_fd,
    libc::SYS_reboot,
    libc::SYS_acct,
    libc::SYS_lookup_dcookie,
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_vhangup,
    libc::SYS_uselib,
];

fn filter(rules: BTreeMap<i64, Vec<SeccompRule>>, errno: u32) -> Result<BpfProgram, PolicyError> {
    let f = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(errno),
        TargetArch::x86_64,
    )
    .map_err(|e| PolicyError::Build(crate::types::chain(&e)))?;
    f.try_into()
        .map_err(|e: seccompiler::BackendError| PolicyError::Build(crate::types::chain(&e)))
}

/// The two seccomp programs: the EPERM deny-list (plus `clone`/`unshare` with
/// CLONE_NEWUSER: a user namespace would give the dropped capabilities back), and `clone3`
/// → ENOSYS, so libc falls back to `clone`, whose flags the first program can inspect.
pub fn seccomp_programs() -> Result<Vec<BpfProgram>, PolicyError> {
    let mut eperm: BTreeMap<i64, Vec<SeccompRule>> =
        DENIED.iter().map(|nr| (*nr, vec![])).collect();
    let newuser = libc::CLONE_NEWUSER as u64;
    let flag_rule = |arg: u8| -> Result<SeccompRule, PolicyError> {
        let c = SeccompCondition::new(
            arg,
            SeccompCmpArgLen::Qword,
            SeccompCmpOp::MaskedEq(newuser),
            newuser,
        )
        .map_err(|e| PolicyError::Build(crate::types::chain(&e)))?;
        SeccompRule::new(vec![c]).map_err(|e| PolicyError::Build(crate::types::chain(&e)))
    };
    // clone(flags, ...) and unshare(flags) both take the flags as their first argument.
    eperm.insert(libc::SYS_clone, vec![flag_rule(0)?]);
    eperm.insert(libc::SYS_unshare, vec![flag_rule(0)?]);
    let enosys = BTreeMap::from([(libc::SYS_clone3, vec![])]);
    Ok(vec![
        filter(eperm, libc::EPERM as u32)?,
        filter(enosys, libc::ENOSYS as u32)?,
    ])
}

/// Installs the seccomp programs on the calling thread (which must still hold
/// CAP_SYS_ADMIN: no `no_new_privs`, so setuid programs inside keep working).
pub fn install_seccomp() -> Result<(), PolicyError> {
    for prog in seccomp_programs()? {
        let raw: Vec<libc::sock_filter> = prog
            .iter()
            .map(|i| libc::sock_filter {
                code: i.code,
                jt: i.jt,
                jf: i.jf,
                k: i.k,
            })
            .collect();
        crate::sys::process::install_seccomp(&raw).map_err(PolicyError::Install)?;
    }
    Ok(())
}

/// Removes every capability outside [`KEPT_CAPS`] from the bounding set and clears the
/// inheritable and ambient sets; the exec that follows leaves root with the bounding set.
pub fn drop_capabilities() -> Result<(), PolicyError> {
    let keep: std::collections::HashSet<Capability> = KEPT_CAPS.iter().copied().collect();
    for cap in caps::all() {
        if keep.contains(&cap) {
            continue;
        }
        if let Err(e) = caps::drop(None, CapSet::Bounding, cap) {
            // A capability the running kernel does not know cannot be held either.
            if caps::runtime::thread_all_supported().contains(&cap) {
                return Err(PolicyError::DropCap {
                    cap: cap.to_string(),
                    message: crate::types::chain(&e),
                });
            }
        }
    }
    for set in [CapSet::Inheritable, CapSet::Ambient] {
        caps::clear(None, set).map_err(|e| PolicyError::DropCap {
            cap: format!("{set:?} set"),
            message: crate::types::chain(&e),
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn programs_build() {
        let progs = seccomp_programs().expect("build");
        assert_eq!(progs.len(), 2);
        assert!(progs[0].len() > DENIED.len());
        assert!(!KEPT_CAPS.contains(&Capability::CAP_MKNOD));
        assert!(!KEPT_CAPS.contains(&Capability::CAP_SYS_ADMIN));
        // With it a session could trace the (non-dumpable) agents.
        assert!(!KEPT_CAPS.contains(&Capability::CAP_SYS_PTRACE));
    }
}
