//! What a stop gave back to an edge's allocation, told to the apiserver in a response header
//! of `Edge.StopSandbox` so that its placement overlay stops counting the sandbox before the
//! next cluster snapshot shows it gone (docs/architecture.md, "Creating a sandbox").
//!
//! The header `x-opendsec-freed` holds `<incarnation> <since_seq> <seq> <cpu_cores>
//! <memory_mb> <gpus> <disk_mb> <sandboxes>`: edge states of that incarnation with
//! `since_seq <= admitted_seq < seq` still count the resources; from `seq` on they do not.

use crate::types::Res;

/// The response header's name.
pub const FREED_HEADER: &str = "x-opendsec-freed";

/// A stop's return of resources, as the apiserver reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct FreedReport {
    pub incarnation: String,
    pub since_seq: u64,
    pub seq: u64,
    pub res: Res,
}

impl FreedReport {
    /// The header value.
    pub fn encode(&self) -> String {
        let r = &self.res;
        format!(
            "{} {} {} {} {} {} {} {}",
            self.incarnation,
            self.since_seq,
            self.seq,
            r.cpu_cores,
            r.memory_mb,
            r.gpus,
            r.disk_mb,
            r.sandboxes
        )
    }

    /// Parses a header value; None when it is not one (an older edge, a garbled value).
    pub fn decode(v: &str) -> Option<FreedReport> {
        let mut it = v.split(' ');
        let incarnation = it.next()?.to_string();
        let since_seq = it.next()?.parse().ok()?;
        let seq = it.next()?.parse().ok()?;
        let cpu_cores: f64 = it.next()?.parse().ok()?;
        if !cpu_cores.is_finite() || cpu_cores < 0.0 {
            return None;
        }
        let res = Res {
            cpu_cores,
            memory_mb: it.next()?.parse().ok()?,
            gpus: it.next()?.parse().ok()?,
            disk_mb: it.next()?.parse().ok()?,
            sandboxes: it.next()?.parse().ok()?,
        };
        if it.next().is_some() || incarnation.is_empty() {
            return None;
        }
        Some(FreedReport {
            incarnation,
            since_seq,
            seq,
            res,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_round_trip_and_garbage_is_none() {
        let r = FreedReport {
            incarnation: "ab12".into(),
            since_seq: 3,
            seq: 9,
            res: Res {
                cpu_cores: 1.5,
                memory_mb: 512,
                gpus: 0,
                disk_mb: 1024,
                sandboxes: 1,
            },
        };
        assert_eq!(FreedReport::decode(&r.encode()), Some(r));
        for bad in [
            "",
            "x",
            "x 1 2 nan 1 1 1 1",
            "x 1 2 1 1 1 1 1 9",
            " 1 2 1 1 1 1 1",
        ] {
            assert_eq!(FreedReport::decode(bad), None, "{bad:?}");
        }
    }
}
