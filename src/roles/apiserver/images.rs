//! The image calls (docs/images.md): register, list, get, delete and compose images in the
//! shared store, which every apiserver mounts at `image_store.root`. Permissions follow the
//! image's project: `layer.use` to view and list, `layer.publish` to change.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::auth::Caller;
use super::Inner;
use crate::images::compose::{check_env, check_user, check_workdir, compose};
use crate::images::digest::Digest;
use crate::images::name::ImageRef;
use crate::images::store::{ImageManifest, Store};
use crate::pb;
use crate::rpc::failure_from_status;
use crate::types::names::{check_project_path, shown};
use crate::types::Failure;

const USE: &str = "layer.use";
pub(super) const PUBLISH: &str = "layer.publish";

/// The manifest as the API shows it, named `image`.
pub(crate) fn info(image: &ImageRef, m: &ImageManifest) -> pb::ImageInfo {
    pb::ImageInfo {
        name: image.to_string(),
        layers: m.layers.iter().map(|d| d.to_string()).collect(),
        env: m.env.clone(),
        workdir: m.workdir.clone(),
        user: m.user.clone(),
        parent: m.parent.clone(),
        source: m.source.clone(),
        created_at: chrono::DateTime::parse_from_rfc3339(&m.created)
            .map(|t| t.timestamp())
            .unwrap_or(0),
        created_by: m.created_by.clone(),
        snapshot: m.snapshot,
        memory: m.memory,
        labels: m.labels.clone().into_iter().collect(),
        memory_limit_mb: i64::try_from(m.memory_mb).unwrap_or(i64::MAX),
    }
}

/// Most labels one image keeps, longest key and value.
const MAX_LABELS: usize = 32;
const MAX_LABEL_KEY: usize = 128;
const MAX_LABEL_VALUE: usize = 4096;

/// Checks an image's labels. Errors: `invalid` naming the first wrong one.
fn check_labels(labels: &std::collections::HashMap<String, String>) -> Result<(), Failure> {
    if labels.len() > MAX_LABELS {
        return Err(Failure::invalid(format!(
            "{} labels: an image keeps at most {MAX_LABELS}",
            labels.len()
        )));
    }
    for (k, v) in labels {
        let ok = !k.is_empty()
            && k.len() <= MAX_LABEL_KEY
            && k.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._/-".contains(&b));
        if !ok {
            return Err(Failure::invalid(format!(
                "label {}: keys are 1-{MAX_LABEL_KEY} of a-z, 0-9, '.', '_', '/' and '-'",
                shown(k)
            )));
        }
        if v.len() > MAX_LABEL_VALUE {
            return Err(Failure::invalid(format!(
                "label {k}: its value is {} bytes, at most {MAX_LABEL_VALUE}",
                v.len()
            )));
        }
    }
    Ok(())
}

pub(super) fn now_rfc3339() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

/// Runs a blocking store operation off the async threads.
pub(super) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Failure> + Send + 'static,
) -> Result<T, Failure> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Failure::internal(format!("image store task: {e}")))?
}

impl Inner {
    pub(super) fn store(&self) -> Result<Arc<Store>, Failure> {
        self.images.clone().ok_or_else(|| {
            Failure::invalid(
                "this cluster has no image store (image_store.root in the config; `cluster up -image-store DIR`)",
            )
        })
    }

    /// `RegisterImage`: records an image whose layers are already in the store (written by
    /// `opendsec ctl image import`). Errors: `invalid` (bad name, a layer not in the store, a
    /// bad env, workdir, user, parent or label), `forbidden` (no `layer.publish`), `conflict` (the
    /// name exists and `overwrite` is off). With `dry_run` the same checks, and nothing
    /// written.
    pub(crate) async fn register_image(
        &self,
        caller: &Caller,
        req: pb::RegisterImageRequest,
    ) -> Result<pb::ImageInfo, Failure> {
        let img = req
            .image
            .ok_or_else(|| Failure::invalid("RegisterImage needs an image"))?;
        let name = ImageRef::parse(&img.name)?;
        self.auth.authorize(caller, &name.project, PUBLISH).await?;
        if img.snapshot || img.memory {
            return Err(Failure::invalid(
                "snapshots are made with create_snapshot, not registered",
            ));
        }
        if img.layers.is_empty() && !req.dry_run {
            return Err(Failure::invalid(format!(
                "image {name} has no layers; an image needs at least one"
            )));
        }
        if img.layers.len() > crate::images::compose::MAX_LAYERS {
            return Err(Failure::invalid(format!(
                "image {name} has {} layers; at most {} can be stacked",
                img.layers.len(),
                crate::images::compose::MAX_LAYERS
            )));
        }
        let layers = img
            .layers
            .iter()
            .map(|l| {
                Digest::parse(l).map_err(|e| Failure::invalid(format!("layer {}: {e}", shown(l))))
            })
            .collect::<Result<Vec<_>, _>>()?;
        for kv in &img.env {
            let (k, v) = kv.split_once('=').unwrap_or((kv.as_str(), ""));
            check_env(k, v)?;
        }
        check_workdir(&img.workdir)?;
        check_user(&img.user)?;
        if !img.parent.is_empty() {
            ImageRef::parse(&img.parent)?;
        }
        if img.source.len() > 4096 {
            return Err(Failure::invalid("source longer than 4096 bytes"));
        }
        check_labels(&img.labels)?;
        let store = self.store()?;
        let m = ImageManifest {
            layers,
            env: img.env,
            workdir: img.workdir,
            user: img.user,
            parent: img.parent,
            source: img.source,
            labels: img.labels.into_iter().collect(),
            created: now_rfc3339(),
            created_by: caller.principal.clone(),
            ..Default::default()
        };
        blocking(move || {
            if let Some(missing) = m.layers.iter().find(|d| !store.has_layer(d)) {
                return Err(Failure::invalid(format!(
                    "layer {missing} of image {name} is not in the image store (`opendsec ctl image import` writes the layers before it registers)"
                )));
            }
            if req.dry_run {
                if !req.overwrite && store.manifest_path(&name).exists() {
                    return Err(crate::images::store::StoreError::Exists(name.to_string())
                        .to_failure());
                }
                return Ok(info(&name, &m));
            }
            store
                .write_manifest(&name, &m, req.overwrite)
                .map_err(|e| e.to_failure())?;
            tracing::info!(image = %name, layers = m.layers.len(), "image registered");
            Ok(info(&name, &m))
        })
        .await
    }

    /// `GetImage`. Errors: `invalid` (bad name), `forbidden` (no `layer.use`), `not_found`.
    pub(crate) async fn get_image(
        &self,
        caller: &Caller,
        req: pb::ImageRef,
    ) -> Result<pb::ImageInfo, Failure> {
        let name = ImageRef::parse(&req.name)?;
        self.auth.authorize(caller, &name.project, USE).await?;
        let store = self.store()?;
        blocking(move || {
            let m = store.read_manifest(&name).map_err(|e| e.to_failure())?;
            Ok(info(&name, &m))
        })
        .await
    }

    /// `ListImages`: the images of a project ("" = root) and its subprojects, sorted by name.
    /// Errors: `invalid` (bad project path), `forbidden` (no `layer.use` there).
    pub(crate) async fn list_images(
        &self,
        caller: &Caller,
        req: pb::ListImagesRequest,
    ) -> Result<pb::ListImagesResponse, Failure> {
        let project = if req.project.is_empty() {
            "root".to_string()
        } else {
            req.project
        };
        check_project_path(&project)?;
        self.auth.authorize(caller, &project, USE).await?;
        let store = self.store()?;
        blocking(move || {
            let all = store.list_manifests(&project).map_err(|e| e.to_failure())?;
            Ok(pb::ListImagesResponse {
                images: all.iter().map(|(r, m)| info(r, m)).collect(),
            })
        })
        .await
    }

    /// `DeleteImage`: removes the registration, and a memory snapshot's files; `image gc`
    /// reclaims the layers. Errors:
    /// `invalid`, `forbidden` (no `layer.publish`), `not_found`.
    pub(crate) async fn delete_image(
        &self,
        caller: &Caller,
        req: pb::ImageRef,
    ) -> Result<pb::Empty, Failure> {
        let name = ImageRef::parse(&req.name)?;
        self.auth.authorize(caller, &name.project, PUBLISH).await?;
        let store = self.store()?;
        blocking(move || {
            let snapshot = store
                .read_manifest(&name)
                .ok()
                .map(|m| m.vm_snapshot)
                .filter(|d| !d.is_empty());
            store.delete_manifest(&name).map_err(|e| e.to_failure())?;
            if let Some(dir) = snapshot {
                // Copies made from it hold its files by links of their own.
                if let Err(e) = store.remove_snapshot(&dir) {
                    tracing::warn!(image = %name, dir = %dir, error = %crate::types::chain(&e), "removing a deleted image's snapshot (gc takes it later)");
                }
            }
            tracing::info!(image = %name, "image deleted");
            Ok(pb::Empty {})
        })
        .await
    }

    /// `ComposeImage`: stacks `parts` bottom first into `name` without copying data.
    /// Errors: `invalid` (names, env, workdir, user, limits), `forbidden` (`layer.publish` on
    /// the new image's project, `layer.use` on each part's), `not_found` (a part),
    /// `conflict` (the name exists and `overwrite` is off).
    pub(crate) async fn compose_image(
        &self,
        caller: &Caller,
        req: pb::ComposeImageRequest,
    ) -> Result<pb::ImageInfo, Failure> {
        let name = ImageRef::parse(&req.name)?;
        if req.parts.len() > crate::images::compose::MAX_PARTS {
            return Err(Failure::invalid(format!(
                "compose takes at most {} parts, not {}",
                crate::images::compose::MAX_PARTS,
                req.parts.len()
            )));
        }
        let parts = req
            .parts
            .iter()
            .map(|p| ImageRef::parse(p))
            .collect::<Result<Vec<_>, _>>()?;
        self.auth.authorize(caller, &name.project, PUBLISH).await?;
        for p in &parts {
            self.auth.authorize(caller, &p.project, USE).await?;
        }
        let store = self.store()?;
        let env: BTreeMap<String, String> = req.env.into_iter().collect();
        let principal = caller.principal.clone();
        blocking(move || {
            let mut read = Vec::with_capacity(parts.len());
            for p in parts {
                let m = store.read_manifest(&p).map_err(|e| e.to_failure())?;
                if !m.vm_snapshot.is_empty() {
                    return Err(Failure::invalid(format!(
                        "{p} is a microVM's memory snapshot, which has no layers to compose"
                    )));
                }
                read.push((p, m));
            }
            let mut m = compose(&read, &env, &req.workdir, &req.user)?;
            m.created = now_rfc3339();
            m.created_by = principal;
            store
                .write_manifest(&name, &m, req.overwrite)
                .map_err(|e| e.to_failure())?;
            tracing::info!(image = %name, layers = m.layers.len(), "image composed");
            Ok(info(&name, &m))
        })
        .await
    }
}

impl Inner {
    /// Before `DeleteProject`: a project whose own images are still in the store is not
    /// deleted, or they would outlive it with nobody able to see or remove them through the
    /// API. Errors: `forbidden` (no `project.admin` on the parent, as IAM would answer),
    /// `conflict` naming an image, `unavailable` (the store). Nothing to check without a
    /// store, for root, or for a bad path (IAM answers those).
    pub(crate) async fn check_project_has_no_images(
        &self,
        caller: &Caller,
        project: &str,
    ) -> Result<(), Failure> {
        let (Some(store), Some(parent)) = (
            self.images.clone(),
            crate::types::names::project_parent(project),
        ) else {
            return Ok(());
        };
        if check_project_path(project).is_err() {
            return Ok(());
        }
        self.auth.authorize(caller, parent, "project.admin").await?;
        let p = project.to_string();
        let own = blocking(move || {
            let all = store.list_manifests(&p).map_err(|e| e.to_failure())?;
            Ok(all
                .into_iter()
                .filter(|(r, _)| r.project == p)
                .map(|(r, _)| r.to_string())
                .collect::<Vec<_>>())
        })
        .await?;
        match own.first() {
            None => Ok(()),
            Some(first) => Err(Failure::conflict(format!(
                "project {project} still has {} image(s), e.g. {first}: delete them first (`opendsec ctl image delete`)",
                own.len()
            ))),
        }
    }
}

/// What [`Inner::image_from_sandbox`] makes: a `pack_diff` (scrubbed) or a snapshot (as it is).
pub(crate) struct FromSandbox {
    pub id: String,
    pub image: String,
    /// `Some(globs)` for a pack_diff (the defaults, then these); `None` for a snapshot.
    pub scrub: Option<Vec<String>>,
    pub overwrite: bool,
}

impl Inner {
    /// `PackDiff` and `CreateSnapshot` (docs/images.md "Images from sandboxes"): the
    /// sandbox's edge packs its writable layer into the store, then the image is written
    /// here with the sandbox's image as `parent` and its env, workdir and user. Errors:
    /// `invalid` (names, scrub globs, a node-local image, a backend that cannot pack, too
    /// many layers), `forbidden` (no `sandbox.operate` on the sandbox's project, no
    /// `layer.publish` on the image's), `not_found`, `conflict` (the name exists and
    /// `overwrite` is off; a sandbox neither running nor paused), `unavailable` (the store).
    pub(crate) async fn image_from_sandbox(
        &self,
        caller: &Caller,
        req: FromSandbox,
    ) -> Result<pb::ImageInfo, Failure> {
        let name = ImageRef::parse(&req.image)?;
        if let Some(globs) = &req.scrub {
            // Checked here too, so a bad glob costs no trip to the edge.
            crate::images::pack::Scrub::new(true, globs)?;
        }
        let store = self.store()?;
        let addr = self.authorize_sandbox(caller, &req.id).await?;
        self.auth.authorize(caller, &name.project, PUBLISH).await?;
        if !req.overwrite {
            let (s, n) = (store.clone(), name.clone());
            blocking(move || {
                if s.manifest_path(&n).exists() {
                    return Err(
                        crate::images::store::StoreError::Exists(n.to_string()).to_failure()
                    );
                }
                Ok(())
            })
            .await?;
        }
        let snapshot = req.scrub.is_none();
        let packed = self
            .edges
            .edge(&addr)?
            .pack_sandbox(self.edges.req(pb::EdgePackRequest {
                id: req.id.clone(),
                scrub: req.scrub.unwrap_or_default(),
                default_scrub: !snapshot,
                fork_snapshot: String::new(),
            }))
            .await
            .map_err(|s| failure_from_status(&s))?
            .into_inner();
        let mut layers = packed
            .layers
            .iter()
            .map(|l| {
                Digest::parse(l).map_err(|e| {
                    Failure::internal(format!("the edge answered layer {}: {e}", shown(l)))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        // A sandbox that changed nothing packs the empty layer, which its image may end
        // with already (made the same way): once is the same tree.
        layers.dedup();
        if layers.len() > crate::images::compose::MAX_LAYERS {
            return Err(Failure::invalid(format!(
                "the new image would have {} layers; at most {} can be stacked (compose fewer parts)",
                layers.len(),
                crate::images::compose::MAX_LAYERS
            )));
        }
        let principal = caller.principal.clone();
        let id = req.id;
        blocking(move || {
            // The parent's defaults; a parent deleted since the sandbox started has none.
            let parent = ImageRef::parse(&packed.image)
                .ok()
                .and_then(|p| store.read_manifest(&p).ok())
                .unwrap_or_default();
            let m = ImageManifest {
                layers,
                env: parent.env,
                workdir: parent.workdir,
                user: parent.user,
                parent: packed.image.clone(),
                source: if snapshot {
                    crate::images::store::snapshot_source(&id)
                } else {
                    format!("pack_diff of sandbox {id}")
                },
                created: now_rfc3339(),
                created_by: principal,
                snapshot,
                ..Default::default()
            };
            store
                .write_manifest(&name, &m, req.overwrite)
                .map_err(|e| e.to_failure())?;
            tracing::info!(image = %name, sandbox_id = %id, layers = m.layers.len(), file_bytes = packed.file_bytes, scrubbed = packed.scrubbed, snapshot, "image made from a sandbox");
            Ok(info(&name, &m))
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_bounded_and_named_plainly() {
        let one = |k: &str, v: &str| [(k.to_string(), v.to_string())].into_iter().collect();
        assert!(check_labels(&one("e2b.start_cmd", "python3 -m http.server")).is_ok());
        assert!(check_labels(&one("a/b-c_d.9", &"v".repeat(MAX_LABEL_VALUE))).is_ok());
        for (k, v) in [
            ("", "v"),
            ("Upper", "v"),
            ("a b", "v"),
            (&*"k".repeat(MAX_LABEL_KEY + 1), "v"),
            ("k", &*"v".repeat(MAX_LABEL_VALUE + 1)),
        ] {
            let e = check_labels(&one(k, v)).unwrap_err();
            assert_eq!(e.reason, crate::types::Reason::Invalid, "{k:?}");
        }
        let many = (0..=MAX_LABELS)
            .map(|i| (format!("k{i}"), String::new()))
            .collect();
        assert!(check_labels(&many).is_err());
    }
}
