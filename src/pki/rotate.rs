//! Rotating the cluster's CA without downtime, in three steps (docs/tls.md "Rotating the
//! CA"). Each step changes the files of one directory; the operator then delivers them and
//! restarts the roles one at a time. Until restarted, a component keeps the certificate and
//! trust it loaded, so every step keeps each restarted component able to talk to each one
//! not yet restarted:
//!
//! 1. a new CA is made in `next/`, and `ca.crt` becomes the bundle of old and new: trusted
//!    by all, while every certificate still comes from the old one;
//! 2. every component certificate of the directory is issued again, from the new CA, with
//!    the same identity and names: both CAs are trusted everywhere by now;
//! 3. once no certificate of the directory comes from the old CA, `ca.crt` and `ca.key`
//!    become the new CA's and `next/` goes.
//!
//! Skipping step 1 would have restarted components present certificates that the others
//! do not trust yet; dropping the old CA before step 2 would reject every certificate not
//! yet reissued. Step 3 checks for that.

use std::path::{Path, PathBuf};

use super::{
    save_issued, write_file, Ca, CertInfo, Identity, PkiError, API_DNS_NAME, CA_CERT, CA_KEY,
};

/// Where step 1 puts the new CA, under the directory.
pub const NEXT: &str = "next";

fn step_err(step: u8, why: impl Into<String>) -> PkiError {
    PkiError::Rotation {
        step,
        why: why.into(),
    }
}

fn read(path: &Path) -> Result<String, PkiError> {
    std::fs::read_to_string(path).map_err(|source| PkiError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Every component certificate in `dir` (`<role>-<id>.crt` naming an identity of ours),
/// with what it says, sorted by path.
pub fn component_certs(dir: &Path) -> Result<Vec<(PathBuf, CertInfo)>, PkiError> {
    let entries = std::fs::read_dir(dir).map_err(|source| PkiError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut out = Vec::new();
    for e in entries {
        let e = e.map_err(|source| PkiError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let path = e.path();
        let name = e.file_name().to_string_lossy().to_string();
        if name == CA_CERT || !name.ends_with(".crt") || name.starts_with('.') {
            continue;
        }
        let info = CertInfo::from_pem(&read(&path)?).map_err(|message| PkiError::Parse {
            path: path.clone(),
            message,
        })?;
        let Some(who) = info.identities.first() else {
            continue;
        };
        if format!("{}.crt", who.file_stem()) != name {
            continue;
        }
        out.push((path, info));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// Step 1: a new CA valid `ca_days` in `dir/next`, and `dir/ca.crt` the bundle of the
/// current CA and it. Returns the new CA's directory. Errors: `Rotation` where a rotation
/// is under way (`next/` is there) or `dir` holds no CA that can issue; `Io`, `Make`.
pub fn step1(dir: &Path, ca_days: i64) -> Result<PathBuf, PkiError> {
    let next = dir.join(NEXT);
    if next.exists() {
        return Err(step_err(
            1,
            format!(
                "{} is there: a rotation is under way; go on with step 2 or 3",
                next.display()
            ),
        ));
    }
    let old = Ca::load(dir).map_err(|e| step_err(1, format!("the current CA: {e}")))?;
    let new = Ca::generate(ca_days)?;
    new.save(&next)?;
    let bundle = format!("{}\n{}", old.cert_pem.trim_end(), new.cert_pem);
    write_file(&dir.join(CA_CERT), bundle.as_bytes(), 0o644)?;
    Ok(next)
}

/// Step 2: every component certificate in `dir` issued again from the new CA in
/// `dir/next`, with its identity, DNS names and addresses, valid `days`. Returns their
/// paths. Errors: `Rotation` without step 1; as [`Ca::issue`].
pub fn step2(dir: &Path, days: i64) -> Result<Vec<PathBuf>, PkiError> {
    let next = dir.join(NEXT);
    let new =
        Ca::load(&next).map_err(|e| step_err(2, format!("no new CA ({e}); run step 1 first")))?;
    let mut written = Vec::new();
    for (_, info) in component_certs(dir)? {
        let Some(who) = info.identities.first() else {
            continue;
        };
        let mut hosts: Vec<String> = info
            .dns_names
            .iter()
            .filter(|d| d.as_str() != API_DNS_NAME)
            .cloned()
            .collect();
        hosts.extend(info.ips.iter().map(|ip| ip.to_string()));
        let issued = new.issue(who, &hosts, days)?;
        written.push(save_issued(dir, who, &issued)?);
    }
    Ok(written)
}

/// Whether the certificate `info` was issued by the CA whose certificate is `ca_pem`.
fn issued_by(cert_path: &Path, ca_pem: &str) -> Result<bool, PkiError> {
    let pem = read(cert_path)?;
    let parse = |p: &Path, t: &str| -> Result<x509_parser::pem::Pem, PkiError> {
        x509_parser::pem::parse_x509_pem(t.as_bytes())
            .map(|(_, p)| p)
            .map_err(|e| PkiError::Parse {
                path: p.to_path_buf(),
                message: e.to_string(),
            })
    };
    let leaf = parse(cert_path, &pem)?;
    let ca = parse(Path::new(CA_CERT), ca_pem)?;
    let (leaf, ca) = match (leaf.parse_x509(), ca.parse_x509()) {
        (Ok(l), Ok(c)) => (l, c),
        _ => return Ok(false),
    };
    Ok(leaf.verify_signature(Some(ca.public_key())).is_ok())
}

/// Step 3: `dir/ca.crt` and `dir/ca.key` become the new CA's and `dir/next` goes, once
/// every component certificate in `dir` comes from it. Returns the identities checked.
/// Errors: `Rotation` without step 1, or naming the certificates still from the old CA.
pub fn step3(dir: &Path) -> Result<Vec<Identity>, PkiError> {
    let next = dir.join(NEXT);
    Ca::load(&next)
        .map_err(|e| step_err(3, format!("no new CA ({e}); run steps 1 and 2 first")))?;
    let new_pem = read(&next.join(CA_CERT))?;
    let mut old = Vec::new();
    let mut checked = Vec::new();
    for (path, info) in component_certs(dir)? {
        if !issued_by(&path, &new_pem)? {
            old.push(path.display().to_string());
        }
        checked.extend(info.identities.into_iter().take(1));
    }
    if !old.is_empty() {
        return Err(step_err(
            3,
            format!(
                "still from the old CA: {}; run step 2 (and deliver and restart) first",
                old.join(", ")
            ),
        ));
    }
    let key = read(&next.join(CA_KEY))?;
    // The key first: a crash between the two leaves a new key beside the bundle, which
    // Ca::load refuses (not the bundle's first CA), rather than an old key and a new CA.
    write_file(&dir.join(CA_KEY), key.as_bytes(), 0o600)?;
    write_file(&dir.join(CA_CERT), new_pem.as_bytes(), 0o644)?;
    std::fs::remove_dir_all(&next).map_err(|source| PkiError::Io {
        path: next.clone(),
        source,
    })?;
    Ok(checked)
}
