//! Imports an image into the store (docs/images.md "Import"): resolve it ([`super::oci`] for
//! local sources, [`super::registry`] for registries), bring each layer in bottom first
//! ([`super::layer`], a layer the store has is not read again), then write its manifest with
//! the image's env, working directory and user as its defaults.

use std::io::{self, Read};
use std::path::{Path, PathBuf};

use super::layer::{import_layer, Expected, LayerError};
use super::name::ImageRef;
use super::oci::{split_source, LayerRef, Resolved, Source, SourceError};
use super::registry::{Registry, RegistryError};
use super::store::{ImageManifest, Store, StoreError};
use super::unpack::Limits;
use crate::types::Failure;

/// Why an import failed.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error(transparent)]
    Layer(#[from] LayerError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Registry(#[from] RegistryError),
}

impl ImportError {
    /// The caller-facing failure (`invalid` for a bad source or layer, `conflict` for a taken
    /// name, `internal` for the machine).
    pub fn to_failure(&self) -> Failure {
        match self {
            ImportError::Source(e) => e.to_failure(),
            ImportError::Layer(e) => e.to_failure(),
            ImportError::Store(e) => e.to_failure(),
            ImportError::Registry(e) => e.to_failure(),
        }
    }
}

/// What an import reports as it goes, for a progress display.
#[derive(Debug, Clone, PartialEq)]
pub enum Progress {
    /// Layer `index` of `count` (from 1) starts to be read: its blob's size in bytes, where
    /// the source tells.
    Started {
        index: usize,
        count: usize,
        diff_id: String,
        size: Option<u64>,
    },
    /// Bytes of layer `index`'s blob read so far (every 256 KiB and at its end).
    Read { index: usize, bytes: u64 },
    /// Layer `index` of `count` (from 1), already in the store.
    Cached {
        index: usize,
        count: usize,
        diff_id: String,
    },
    /// Layer `index` of `count` imported: its file bytes.
    Imported {
        index: usize,
        count: usize,
        diff_id: String,
        file_bytes: u64,
    },
}

/// How to import.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// Replace an image of the same name (without it, an existing name is `conflict`).
    pub overwrite: bool,
    pub limits: Limits,
}

/// Imports `src` (`PATH` or `PATH#name:tag`: an OCI layout directory, an OCI archive or a
/// `docker save` tar) into `store` as `target`, and returns the manifest written. Errors:
/// [`ImportError`]; a taken name is refused before any layer is read.
pub fn import(
    store: &Store,
    src: &str,
    target: &ImageRef,
    opts: Options,
    progress: &dyn Fn(Progress),
) -> Result<ImageManifest, ImportError> {
    let _span = tracing::info_span!("image_import", src = %src, target = %target).entered();
    if !opts.overwrite && store.manifest_path(target).exists() {
        return Err(StoreError::Exists(target.to_string()).into());
    }
    let mut manifest = import_layers(store, src, opts, progress)?;
    manifest.created = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    store.write_manifest(target, &manifest, opts.overwrite)?;
    Ok(manifest)
}

/// Where an import reads layer blobs: a local source or a registry.
pub trait Blobs {
    /// Opens `layer`'s blob, with its size in bytes where the source knows it.
    fn open_blob(
        &self,
        layer: &LayerRef,
    ) -> Result<(Box<dyn Read + Send>, Option<u64>), ImportError>;
}

impl Blobs for Source {
    fn open_blob(
        &self,
        layer: &LayerRef,
    ) -> Result<(Box<dyn Read + Send>, Option<u64>), ImportError> {
        Ok((
            self.open_member(&layer.member)?,
            self.member_size(&layer.member),
        ))
    }
}

impl Blobs for Registry {
    fn open_blob(
        &self,
        layer: &LayerRef,
    ) -> Result<(Box<dyn Read + Send>, Option<u64>), ImportError> {
        Ok(Registry::open_blob(self, &layer.member)?)
    }
}

/// Brings the layers of `src` into `store` (as [`import`] does) and returns the manifest the
/// image would have, without writing it: `opendsec ctl image import` registers it through the
/// API instead (docs/images.md "Import"). Errors: [`ImportError`].
pub fn import_layers(
    store: &Store,
    src: &str,
    opts: Options,
    progress: &dyn Fn(Progress),
) -> Result<ImageManifest, ImportError> {
    let (path, select) = split_source(src);
    if select.is_empty() && src.ends_with('#') {
        return Err(SourceError::Bad {
            source_name: src.to_string(),
            why: "nothing after `#`: name the image as FILE#name:tag, or leave out the `#`".into(),
        }
        .into());
    }
    let source = Source::open(Path::new(path))?;
    let image = source.resolve(select)?;
    let name = if image.name.is_empty() {
        path.to_string()
    } else {
        format!("{path}#{}", image.name)
    };
    import_resolved(store, &source, image, name, opts, progress)
}

/// Brings the layers of the resolved `image` into `store`, reading blobs from `blobs`, and
/// returns the manifest it would have, its `source` set to `source_name`. Errors:
/// [`ImportError`]; layers already imported stay (they are whole, and GC reclaims them).
pub fn import_resolved(
    store: &Store,
    blobs: &dyn Blobs,
    image: Resolved,
    source_name: String,
    opts: Options,
    progress: &dyn Fn(Progress),
) -> Result<ImageManifest, ImportError> {
    let count = image.layers.len();
    let mut lowers: Vec<PathBuf> = Vec::with_capacity(count);
    for (i, l) in image.layers.iter().enumerate() {
        let expected = Expected {
            blob: l.blob.clone(),
            diff_id: Some(l.diff_id.clone()),
        };
        let (index, diff_id) = (i + 1, l.diff_id.to_string());
        let meta = if store.reuse_layer(&l.diff_id) {
            None
        } else {
            let (blob, size) = blobs.open_blob(l)?;
            progress(Progress::Started {
                index,
                count,
                diff_id: diff_id.clone(),
                size,
            });
            let counted = Counting {
                inner: blob,
                index,
                read: 0,
                told: 0,
                progress,
            };
            Some(import_layer(
                store,
                counted,
                &expected,
                l.diff_id.as_str(),
                &lowers,
                opts.limits,
            )?)
        };
        progress(match meta {
            None => Progress::Cached {
                index,
                count,
                diff_id,
            },
            Some(m) => Progress::Imported {
                index,
                count,
                diff_id,
                file_bytes: m.file_bytes,
            },
        });
        lowers.push(store.layer_dir(&l.diff_id).join("rootfs"));
    }
    Ok(ImageManifest {
        layers: image.layers.iter().map(|l| l.diff_id.clone()).collect(),
        env: image.env,
        workdir: image.workdir,
        user: image.user,
        source: source_name,
        ..Default::default()
    })
}

/// Counts a blob's bytes for [`Progress::Read`].
struct Counting<'a, R> {
    inner: R,
    index: usize,
    read: u64,
    told: u64,
    progress: &'a dyn Fn(Progress),
}

impl<R: Read> Read for Counting<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read += n as u64;
        if n == 0 || self.read - self.told >= 256 << 10 {
            self.told = self.read;
            (self.progress)(Progress::Read {
                index: self.index,
                bytes: self.read,
            });
        }
        Ok(n)
    }
}
