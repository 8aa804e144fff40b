//! The sandbox state machine (docs/concepts.md, docs/architecture.md):
//! CREATING → RUNNING ⇄ PAUSING/PAUSED/RESUMING → STOPPING → STOPPED, and FAILED.
//!
//! Each lifecycle operation runs under the sandbox's operation lock, so an operation only
//! ever starts from a settled state. Choices for operations that do not apply:
//! - pausing a PAUSED sandbox, resuming a RUNNING one, stopping a STOPPED or FAILED one:
//!   the record is returned as is (idempotent);
//! - pausing, resuming, touching, setting the timeout or changing the network rules of an
//!   ended (STOPPED/FAILED) sandbox: `conflict`, naming the state.

use crate::pb::SandboxState;

/// A lifecycle operation a caller asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Pause,
    Resume,
    Stop,
    /// Touch, SetSandboxTimeout and UpdateNetwork: change the record (and for UpdateNetwork
    /// the sandbox's rules), not its lifecycle state.
    Update,
}

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::Pause => "pause",
            Op::Resume => "resume",
            Op::Stop => "stop",
            Op::Update => "update",
        }
    }
}

/// What to do for an operation in a given state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// Nothing to do: return the record as is.
    AsIs,
    /// Refuse with `conflict` and this message.
    Conflict(String),
    /// Change the record only.
    Update,
    /// Call the backend: enter `via`, then `done` on success or `failed` on error.
    Run {
        via: SandboxState,
        done: SandboxState,
        failed: SandboxState,
    },
}

/// Decides what `op` does to a sandbox in `state`.
pub fn plan(op: Op, state: SandboxState) -> Plan {
    use SandboxState as S;
    let conflict = || {
        Plan::Conflict(format!(
            "cannot {} a sandbox that is {}",
            op.name(),
            state.as_str_name()
        ))
    };
    match (op, state) {
        (Op::Pause, S::Running) => Plan::Run {
            via: S::Pausing,
            done: S::Paused,
            failed: S::Running,
        },
        (Op::Pause, S::Paused) => Plan::AsIs,
        (Op::Resume, S::Paused) => Plan::Run {
            via: S::Resuming,
            done: S::Running,
            failed: S::Paused,
        },
        (Op::Resume, S::Running) => Plan::AsIs,
        (Op::Stop, S::Running | S::Paused) => Plan::Run {
            via: S::Stopping,
            done: S::Stopped,
            failed: S::Failed,
        },
        (Op::Stop, S::Stopped | S::Failed) => Plan::AsIs,
        (Op::Update, S::Running | S::Paused) => Plan::Update,
        _ => conflict(),
    }
}

/// Whether the machine has an edge from `from` to `to`.
pub fn allowed(from: SandboxState, to: SandboxState) -> bool {
    use SandboxState as S;
    matches!(
        (from, to),
        (
            S::Creating,
            S::Running | S::Failed | S::Stopping | S::Stopped
        ) | (S::Running, S::Pausing | S::Stopping | S::Failed)
            | (S::Pausing, S::Paused | S::Running | S::Failed)
            | (S::Paused, S::Resuming | S::Stopping | S::Failed)
            | (S::Resuming, S::Running | S::Paused | S::Failed)
            | (S::Stopping, S::Stopped | S::Failed)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use SandboxState as S;

    const ALL: [S; 8] = [
        S::Creating,
        S::Running,
        S::Pausing,
        S::Paused,
        S::Resuming,
        S::Stopping,
        S::Stopped,
        S::Failed,
    ];

    #[test]
    fn every_planned_step_is_an_edge_of_the_machine() {
        for op in [Op::Pause, Op::Resume, Op::Stop] {
            for s in ALL {
                if let Plan::Run { via, done, failed } = plan(op, s) {
                    assert!(allowed(s, via), "{op:?} {s:?} -> {via:?}");
                    assert!(allowed(via, done), "{op:?} {via:?} -> {done:?}");
                    assert!(
                        allowed(via, failed) || failed == s,
                        "{op:?} {via:?} -> {failed:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn repeated_operations_are_idempotent() {
        assert_eq!(plan(Op::Pause, S::Paused), Plan::AsIs);
        assert_eq!(plan(Op::Resume, S::Running), Plan::AsIs);
        assert_eq!(plan(Op::Stop, S::Stopped), Plan::AsIs);
        assert_eq!(plan(Op::Stop, S::Failed), Plan::AsIs);
    }

    #[test]
    fn ended_sandboxes_refuse_changes_with_conflict() {
        for s in [S::Stopped, S::Failed] {
            for op in [Op::Pause, Op::Resume, Op::Update] {
                match plan(op, s) {
                    Plan::Conflict(m) => assert!(m.contains(s.as_str_name()), "{m}"),
                    p => panic!("{op:?} on {s:?} gave {p:?}"),
                }
            }
        }
    }

    #[test]
    fn the_main_paths() {
        assert_eq!(
            plan(Op::Pause, S::Running),
            Plan::Run {
                via: S::Pausing,
                done: S::Paused,
                failed: S::Running
            }
        );
        assert_eq!(
            plan(Op::Resume, S::Paused),
            Plan::Run {
                via: S::Resuming,
                done: S::Running,
                failed: S::Paused
            }
        );
        assert_eq!(
            plan(Op::Stop, S::Paused),
            Plan::Run {
                via: S::Stopping,
                done: S::Stopped,
                failed: S::Failed
            }
        );
        assert_eq!(plan(Op::Update, S::Paused), Plan::Update);
        assert!(!allowed(S::Stopped, S::Running));
        assert!(!allowed(S::Failed, S::Running));
        assert!(!allowed(S::Creating, S::Paused));
    }
}
