//! Imports one layer blob into the store (docs/images.md "Import"): gzip, zstd or plain tar,
//! told apart by their first bytes; the blob's digest and the uncompressed tar's (its
//! diff_id) computed as it streams and checked against what the image claims; unpacked into
//! a staging directory and put in place whole. A layer the store already holds is not read.

use std::cell::RefCell;
use std::io::{self, BufRead, BufReader, Read};
use std::rc::Rc;

use super::digest::{Digest, DigestReader};
use super::store::{LayerMeta, Store, StoreError};
use super::unpack::{expand_opaque, unpack_layer, Limits, UnpackError};
use crate::types::Failure;

/// Why a layer could not be imported.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    #[error(transparent)]
    Unpack(#[from] UnpackError),
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The bytes are not what the image said they are (`invalid`).
    #[error("layer {layer}: {what} is {got}, the image says {want}")]
    Mismatch {
        layer: String,
        what: &'static str,
        got: Digest,
        want: Digest,
    },
    /// Reading the blob failed (`unavailable`: the source went away).
    #[error("layer {layer}: reading it")]
    Read {
        layer: String,
        #[source]
        source: io::Error,
    },
}

impl LayerError {
    /// The caller-facing failure.
    pub fn to_failure(&self) -> Failure {
        match self {
            LayerError::Unpack(e) => e.to_failure(),
            LayerError::Store(e) => e.to_failure(),
            LayerError::Mismatch { .. } => Failure::invalid(crate::types::chain(self)),
            // A source that found its own bytes wrong (a registry's digest check) sent a bad
            // layer; any other read failure is the source going away.
            LayerError::Read { source, .. } if source.kind() == io::ErrorKind::InvalidData => {
                Failure::invalid(crate::types::chain(self))
            }
            LayerError::Read { .. } => Failure::unavailable(crate::types::chain(self)),
        }
    }
}

/// What the image says of a layer; `None` where it says nothing (a `docker save` tar names
/// no blob digest of its own).
#[derive(Debug, Clone, Default)]
pub struct Expected {
    pub blob: Option<Digest>,
    pub diff_id: Option<Digest>,
}

/// How a blob is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

/// Tells the compression from a blob's first bytes.
pub fn sniff(head: &[u8]) -> Compression {
    if head.starts_with(&[0x1f, 0x8b]) {
        Compression::Gzip
    } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        Compression::Zstd
    } else {
        Compression::None
    }
}

/// The source's own read error, kept where it passes: a decoder or the tar reader above turns
/// it into "not a valid tar", but a source that broke off is `unavailable`, not a bad layer.
struct Tap<R> {
    inner: R,
    failed: Rc<RefCell<Option<(io::ErrorKind, String)>>>,
}

impl<R: Read> Read for Tap<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.inner.read(buf).inspect_err(|e| {
            self.failed
                .borrow_mut()
                .get_or_insert((e.kind(), e.to_string()));
        })
    }
}

type Counted<R> = BufReader<DigestReader<Tap<R>>>;

enum Decoder<R: Read> {
    Plain(Counted<R>),
    Gzip(flate2::bufread::MultiGzDecoder<Counted<R>>),
    Zstd(zstd::stream::read::Decoder<'static, Counted<R>>),
}

impl<R: Read> Read for Decoder<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Decoder::Plain(r) => r.read(buf),
            Decoder::Gzip(r) => r.read(buf),
            Decoder::Zstd(r) => r.read(buf),
        }
    }
}

impl<R: Read> Decoder<R> {
    fn into_inner(self) -> Counted<R> {
        match self {
            Decoder::Plain(r) => r,
            Decoder::Gzip(r) => r.into_inner(),
            Decoder::Zstd(r) => r.finish(),
        }
    }
}

/// Imports the blob read from `blob` as layer `layer` (named in errors) and returns its
/// meta. `lowers` are the `rootfs` directories of the layers below it in its image, against
/// which its opaque directories are expanded before it is put in place (docs/images.md
/// "Untrusted layers"). When `expected.diff_id` names a layer the store has, nothing is read.
/// Errors: [`LayerError`]; nothing of a failed import stays in the store.
pub fn import_layer<R: Read>(
    store: &Store,
    blob: R,
    expected: &Expected,
    layer: &str,
    lowers: &[std::path::PathBuf],
    limits: Limits,
) -> Result<LayerMeta, LayerError> {
    if let Some(d) = &expected.diff_id {
        if store.reuse_layer(d) {
            return Ok(LayerMeta {
                diff_id: Some(d.clone()),
                blob: expected.blob.clone(),
                ..Default::default()
            });
        }
    }
    let read_err = |source: io::Error| LayerError::Read {
        layer: layer.into(),
        source,
    };
    let failed = Rc::new(RefCell::new(None));
    let tap = Tap {
        inner: blob,
        failed: failed.clone(),
    };
    // Whatever failed, a source that broke off says so first.
    let source_failed = || {
        failed.borrow().clone().map(|(kind, msg)| LayerError::Read {
            layer: layer.into(),
            source: io::Error::new(kind, msg),
        })
    };
    let mut counted = BufReader::with_capacity(256 << 10, DigestReader::new(tap));
    let kind = sniff(counted.fill_buf().map_err(read_err)?);
    let decoder = match kind {
        Compression::None => Decoder::Plain(counted),
        Compression::Gzip => Decoder::Gzip(flate2::bufread::MultiGzDecoder::new(counted)),
        Compression::Zstd => {
            Decoder::Zstd(zstd::stream::read::Decoder::with_buffer(counted).map_err(read_err)?)
        }
    };
    let staging = store.stage()?;
    let mut tar = DigestReader::new(decoder);
    let unpacked = match unpack_layer(&mut tar, &staging.rootfs(), layer, limits) {
        Ok(u) => u,
        Err(e) => return Err(source_failed().unwrap_or(e.into())),
    };
    let malformed = |source: io::Error| {
        LayerError::Unpack(UnpackError::Malformed {
            layer: layer.into(),
            source,
        })
    };
    // What follows the tar's end marker counts too: the digests are of whole streams.
    let (diff_id, _, decoder) = tar
        .finish()
        .map_err(|e| source_failed().unwrap_or_else(|| malformed(e)))?;
    let (blob_digest, _, _) = decoder
        .into_inner()
        .into_inner()
        .finish()
        .map_err(read_err)?;
    for (what, got, want) in [
        ("its digest", &blob_digest, &expected.blob),
        ("its diff_id", &diff_id, &expected.diff_id),
    ] {
        if let Some(want) = want {
            if got != want {
                return Err(LayerError::Mismatch {
                    layer: layer.into(),
                    what,
                    got: got.clone(),
                    want: want.clone(),
                });
            }
        }
    }
    let whiteouts = expand_opaque(&staging.rootfs(), layer, &unpacked.opaque, lowers)?;
    let meta = LayerMeta {
        diff_id: Some(diff_id),
        blob: Some(blob_digest),
        entries: unpacked.entries + whiteouts,
        file_bytes: unpacked.file_bytes,
        xattrs_dropped: unpacked.xattrs_dropped,
        opaque: unpacked.opaque,
        created: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
    };
    store.commit_layer(staging, &meta)?;
    Ok(meta)
}
