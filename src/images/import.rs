//! Imports an image from a local source into the store (docs/images.md "Import"): resolve it
//! ([`super::oci`]), bring each layer in bottom first ([`super::layer`], a layer the store has
//! is not read again), then write its manifest with the image's env, working directory and
//! user as its defaults.

use std::path::{Path, PathBuf};

use super::layer::{import_layer, Expected, LayerError};
use super::name::ImageRef;
use super::oci::{split_source, Source, SourceError};
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
}

impl ImportError {
    /// The caller-facing failure (`invalid` for a bad source or layer, `conflict` for a taken
    /// name, `internal` for the machine).
    pub fn to_failure(&self) -> Failure {
        match self {
            ImportError::Source(e) => e.to_failure(),
            ImportError::Layer(e) => e.to_failure(),
            ImportError::Store(e) => e.to_failure(),
        }
    }
}

/// What an import reports as it goes, for a progress display.
#[derive(Debug, Clone, PartialEq)]
pub enum Progress {
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
    progress: &mut dyn FnMut(Progress),
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

/// Brings the layers of `src` into `store` (as [`import`] does) and returns the manifest the
/// image would have, without writing it: `opendsec ctl image import` registers it through the
/// API instead (docs/images.md "Import"). Errors: [`ImportError`].
pub fn import_layers(
    store: &Store,
    src: &str,
    opts: Options,
    progress: &mut dyn FnMut(Progress),
) -> Result<ImageManifest, ImportError> {
    let (path, select) = split_source(src);
    let source = Source::open(Path::new(path))?;
    let image = source.resolve(select)?;
    let count = image.layers.len();
    let mut lowers: Vec<PathBuf> = Vec::with_capacity(count);
    for (i, l) in image.layers.iter().enumerate() {
        let expected = Expected {
            blob: l.blob.clone(),
            diff_id: Some(l.diff_id.clone()),
        };
        let cached = store.has_layer(&l.diff_id);
        let meta = if cached {
            None
        } else {
            let blob = source.open_member(&l.member)?;
            Some(import_layer(
                store,
                blob,
                &expected,
                l.diff_id.as_str(),
                &lowers,
                opts.limits,
            )?)
        };
        let (index, diff_id) = (i + 1, l.diff_id.to_string());
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
    let manifest = ImageManifest {
        layers: image.layers.iter().map(|l| l.diff_id.clone()).collect(),
        env: image.env,
        workdir: image.workdir,
        user: image.user,
        source: if image.name.is_empty() {
            path.to_string()
        } else {
            format!("{path}#{}", image.name)
        },
        ..Default::default()
    };
    Ok(manifest)
}
