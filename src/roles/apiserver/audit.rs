//! The audit log (docs/configuration.md `apiserver[].audit_dir`): one JSON line per public call,
//! rotated by size (`audit_max_mb`), `audit_keep` files kept (the current one included).
//! Commands are recorded as their length and SHA-256, never their text.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;

use sha2::{Digest, Sha256};

/// The audit directory could not be used.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error("opening audit log {path}")]
    Open {
        path: String,
        source: std::io::Error,
    },
}

struct Current {
    file: File,
    size: u64,
}

/// An append-only, size-rotated JSON-lines log.
pub(crate) struct Audit {
    dir: PathBuf,
    max_bytes: u64,
    keep: u32,
    cur: Mutex<Current>,
}

/// One audited call.
#[derive(serde::Serialize)]
pub(crate) struct Record<'a> {
    pub ts: f64,
    pub method: &'a str,
    pub principal: &'a str,
    pub client: &'a str,
    pub project: &'a str,
    pub sandbox_id: &'a str,
    pub reason: &'a str,
    pub duration_ms: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cmd_len: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cmd_sha256: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub count: Option<u32>,
}

/// Length and SHA-256 (hex) of a command, for the `cmd_len`/`cmd_sha256` fields.
pub(crate) fn command_digest(cmd: &str) -> (usize, String) {
    (cmd.len(), hex::encode(Sha256::digest(cmd.as_bytes())))
}

impl Audit {
    pub fn open(dir: &str, max_mb: u64, keep: u32) -> Result<Audit, AuditError> {
        let dirp = PathBuf::from(dir);
        std::fs::create_dir_all(&dirp).map_err(|source| AuditError::Open {
            path: dir.to_string(),
            source,
        })?;
        let path = dirp.join("audit.log");
        let file = open_log(&path)?;
        let size = file.metadata().map(|m| m.len()).unwrap_or(0);
        Ok(Audit {
            dir: dirp,
            max_bytes: max_mb.max(1) * 1024 * 1024,
            keep: keep.max(1),
            cur: Mutex::new(Current { file, size }),
        })
    }

    /// Appends one record; rotates first when the file would pass the size limit. Failures are
    /// logged, never returned: auditing must not fail the call it records.
    pub fn write(&self, rec: &Record) {
        let mut line = match serde_json::to_vec(rec) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %crate::types::chain(&e), "audit record not serializable");
                return;
            }
        };
        line.push(b'\n');
        let mut cur = self.cur.lock().unwrap_or_else(|p| p.into_inner());
        if cur.size + line.len() as u64 > self.max_bytes && cur.size > 0 {
            if let Err(e) = self.rotate(&mut cur) {
                tracing::error!(error = %crate::types::chain(&e), "audit log rotation failed");
            }
        }
        match cur.file.write_all(&line) {
            Ok(()) => cur.size += line.len() as u64,
            Err(e) => tracing::error!(error = %crate::types::chain(&e), "audit write failed"),
        }
    }

    fn rotate(&self, cur: &mut Current) -> Result<(), AuditError> {
        let base = self.dir.join("audit.log");
        // audit.log.N is the oldest kept; the current file becomes audit.log.1.
        let keep = self.keep.saturating_sub(1);
        if keep == 0 {
            let _ = std::fs::remove_file(&base);
        } else {
            let _ = std::fs::remove_file(self.dir.join(format!("audit.log.{keep}")));
            for i in (1..keep).rev() {
                let _ = std::fs::rename(
                    self.dir.join(format!("audit.log.{i}")),
                    self.dir.join(format!("audit.log.{}", i + 1)),
                );
            }
            let _ = std::fs::rename(&base, self.dir.join("audit.log.1"));
        }
        cur.file = open_log(&base)?;
        cur.size = 0;
        Ok(())
    }
}

fn open_log(path: &PathBuf) -> Result<File, AuditError> {
    use std::os::unix::fs::OpenOptionsExt;
    OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(path)
        .map_err(|source| AuditError::Open {
            path: path.display().to_string(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec<'a>(m: &'a str) -> Record<'a> {
        Record {
            ts: 1.0,
            method: m,
            principal: "p",
            client: "c",
            project: "root",
            sandbox_id: "",
            reason: "ok",
            duration_ms: 1.0,
            cmd_len: None,
            cmd_sha256: None,
            count: None,
        }
    }

    #[test]
    fn rotates_and_keeps_the_newest_files() {
        let d = tempfile::tempdir().unwrap();
        let a = Audit::open(d.path().to_str().unwrap(), 1, 3).unwrap();
        let big = "x".repeat(300_000);
        for _ in 0..20 {
            a.write(&rec(&big));
        }
        let mut names: Vec<String> = std::fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, vec!["audit.log", "audit.log.1", "audit.log.2"]);
        let text = std::fs::read_to_string(d.path().join("audit.log")).unwrap();
        let v: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
        assert_eq!(v["principal"], "p");
    }

    #[test]
    fn commands_are_digested() {
        let (n, h) = command_digest("echo secret");
        assert_eq!(n, 11);
        assert_eq!(h.len(), 64);
        assert!(!h.contains("secret"));
    }
}
