//! Snapshots and forks through the control plane (docs/e2b.md "Snapshots and forks"). A
//! snapshot is an image of the caller's project made by `CreateSnapshot` (so E2B's snapshot
//! id is the image's name, and `Sandbox.create(snapshot_id)` starts from it like any image);
//! a fork is `ForkSandbox`.

use std::sync::Arc;

use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tokio_stream::StreamExt;

use super::create::{bool_field, field, timeout_field, DEFAULT_TIMEOUT_S};
use super::sandboxes::{fields, live, sandbox_json};
use super::{ids, ApiError, Caller, Gateway};
use crate::images::name::ImageRef;
use crate::pb;
use crate::types::names::shown;
use crate::types::{Failure, Reason};

/// The tag of a snapshot named without one (E2B's own).
const DEFAULT_TAG: &str = "default";
/// Most copies one fork makes (E2B's bound on `count`).
const MAX_FORKS: i64 = 20;
/// Most snapshots one list page holds.
const MAX_PAGE: usize = 100;

/// The image a snapshot named `name` (or unnamed) becomes in `project`: `name[:tag]` there,
/// tag `default` when none is given; an unnamed one gets `snapshot-<12 hex>`.
/// Errors: 400 naming `name` for one that is no image name, or that names a project.
fn snapshot_image(project: &str, name: Option<&str>) -> Result<String, ApiError> {
    let name = match name {
        None => format!("snapshot-{}", hex::encode(rand::random::<[u8; 6]>())),
        Some(n) if n.contains('/') => {
            return Err(ApiError::bad_request(format!(
            "name {}: a snapshot is made in the caller's project ({project}); give its name alone",
            shown(n)
        )))
        }
        Some(n) => n.to_string(),
    };
    let full = if name.contains(':') {
        format!("{project}/{name}")
    } else {
        format!("{project}/{name}:{DEFAULT_TAG}")
    };
    ImageRef::parse(&full)
        .map_err(|f| ApiError::bad_request(format!("name {}: {}", shown(&name), f.message)))?;
    Ok(full)
}

/// E2B's `SnapshotInfo` of image `name`.
fn snapshot_json(name: &str) -> Value {
    json!({"snapshotID": name, "names": [name]})
}

/// The image `name` when it exists and is a snapshot; `None` when there is no such image.
/// Errors: 409 for an image that is not a snapshot; the apiserver's other failures.
async fn existing_snapshot(
    g: &Gateway,
    caller: &Caller,
    name: &str,
) -> Result<Option<pb::ImageInfo>, ApiError> {
    match g
        .api()
        .get_image(g.req(caller, pb::ImageRef { name: name.into() }))
        .await
    {
        Ok(r) => {
            let info = r.into_inner();
            if !info.snapshot {
                return Err(ApiError::new(
                    409,
                    format!("image {} exists and is not a snapshot", shown(name)),
                ));
            }
            Ok(Some(info))
        }
        Err(s) if s.code() == tonic::Code::NotFound => Ok(None),
        Err(s) => Err(s.into()),
    }
}

/// `POST /sandboxes/{id}/snapshots` `{"name"?, "memory"?}`: the sandbox's files as image
/// `<project>/<name>:<tag>` (see [`snapshot_image`]); 201 with E2B's `SnapshotInfo`. A
/// name that is already a snapshot gets the new one, as on E2B. A container's snapshot keeps
/// its files only: `memory: true` is refused by the apiserver (400).
/// Errors: 404 for a sandbox that is gone; 400 as above; 409 for a name held by an image
/// that is not a snapshot; 403 without `layer.publish` on the project.
pub async fn create_snapshot(
    State(g): State<Arc<Gateway>>,
    caller: Caller,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let m = fields(&body, &["name", "memory"], "a snapshot")?;
    let name = match field(&m, "name") {
        None => None,
        Some(Value::String(s)) if s.is_empty() => None,
        Some(Value::String(s)) => Some(s.as_str()),
        Some(_) => return Err(ApiError::bad_request("name must be a string")),
    };
    let memory = bool_field(&m, "memory")? == Some(true);
    let image = snapshot_image(&caller.project, name)?;
    let sb = live(&g, &caller, &id).await?;
    // Twice at most: a snapshot of the same name made meanwhile (callers snapshotting
    // under one name at once) turns a fresh name into one to take over.
    for last in [false, true] {
        let overwrite = existing_snapshot(&g, &caller, &image).await?.is_some();
        let req = pb::CreateSnapshotRequest {
            id: sb.id.clone(),
            image: image.clone(),
            memory,
            overwrite,
        };
        match g.api().create_snapshot(g.req(&caller, req)).await {
            Ok(_) => break,
            Err(s)
                if !overwrite
                    && !last
                    && crate::rpc::failure_from_status(&s).reason == Reason::Conflict
                    && existing_snapshot(&g, &caller, &image).await?.is_some() => {}
            Err(s) => return Err(super::sandboxes::not_found_as(s.into(), &id)),
        }
    }
    Ok((StatusCode::CREATED, axum::Json(snapshot_json(&image))).into_response())
}

/// Whether snapshot image `name` is what a list's `name` filter asks for: the whole id, or
/// its name with or without the project and the tag.
fn name_matches(image: &ImageRef, want: &str) -> bool {
    let (p, n, t) = (&image.project, &image.name, &image.tag);
    [
        format!("{p}/{n}:{t}"),
        format!("{p}/{n}"),
        format!("{n}:{t}"),
        n.clone(),
    ]
    .iter()
    .any(|s| s == want)
}

/// `GET /snapshots?sandboxID=&name=&limit=&nextToken=`: the snapshots of the caller's
/// project (its subprojects included), by name, `limit` (≤ 100) at a time with
/// `x-next-token`; `sandboxID` keeps those taken of that sandbox. Errors: 400 naming a
/// malformed parameter (`limit` out of range, a `nextToken` this API did not give).
pub async fn list_snapshots(
    State(g): State<Arc<Gateway>>,
    caller: Caller,
    RawQuery(raw): RawQuery,
) -> Result<Response, ApiError> {
    let (mut sandbox, mut name, mut limit, mut after) = (None, None, MAX_PAGE, None);
    for pair in raw.as_deref().unwrap_or_default().split('&') {
        let Some((k, v)) = pair.split_once('=') else {
            continue;
        };
        let v = ids::percent_decode(v).ok_or_else(|| {
            ApiError::bad_request(format!("query parameter {} is not well encoded", shown(k)))
        })?;
        if v.is_empty() {
            continue;
        }
        match k {
            // An id that cannot be one of ours has no snapshots, like one that is gone.
            "sandboxID" => sandbox = Some(ids::from_e2b(&v).unwrap_or_default()),
            "name" => name = Some(v),
            "limit" => {
                limit = v
                    .parse()
                    .ok()
                    .filter(|l| (1..=MAX_PAGE).contains(l))
                    .ok_or_else(|| {
                        ApiError::bad_request(format!("limit must be within 1..={MAX_PAGE}"))
                    })?
            }
            "nextToken" => {
                after = Some(ids::parse_snapshot_page_token(&v).map_err(ApiError::bad_request)?)
            }
            _ => {}
        }
    }
    let req = pb::ListImagesRequest {
        project: caller.project.clone(),
    };
    let images = g
        .api()
        .list_images(g.req(&caller, req))
        .await?
        .into_inner()
        .images;
    let source = sandbox
        .as_deref()
        .map(crate::images::store::snapshot_source);
    let mut names: Vec<String> = images
        .into_iter()
        .filter(|i| i.snapshot)
        .filter(|i| source.as_ref().is_none_or(|s| &i.source == s))
        .filter(|i| {
            name.as_deref()
                .is_none_or(|want| ImageRef::parse(&i.name).is_ok_and(|r| name_matches(&r, want)))
        })
        .map(|i| i.name)
        .filter(|n| after.as_ref().is_none_or(|a| n > a))
        .collect();
    names.sort();
    let more = names.len() > limit;
    names.truncate(limit);
    let body: Vec<Value> = names.iter().map(|n| snapshot_json(n)).collect();
    let mut r = axum::Json(body).into_response();
    if let (true, Some(last)) = (more, names.last()) {
        if let Ok(v) = ids::snapshot_page_token(last).parse() {
            r.headers_mut().insert("x-next-token", v);
        }
    }
    Ok(r)
}

/// `DELETE /templates/{id}` for a snapshot id: deletes that snapshot image; 204. Errors: 404
/// for anything that is not a snapshot of the caller's (the SDK's `delete_snapshot` then
/// returns false): templates are the cluster's, never deleted through the gateway.
pub async fn delete_snapshot(
    State(g): State<Arc<Gateway>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let missing = || ApiError::new(404, format!("snapshot {} not found", shown(&id)));
    if ImageRef::parse(&id).is_err() {
        return Err(missing());
    }
    match existing_snapshot(&g, &caller, &id).await {
        Ok(Some(_)) => {}
        Ok(None) => return Err(missing()),
        Err(e) if e.status == 409 => return Err(missing()),
        Err(e) => return Err(e),
    }
    g.api()
        .delete_image(g.req(&caller, pb::ImageRef { name: id.clone() }))
        .await
        .map_err(|s| {
            if s.code() == tonic::Code::NotFound {
                missing()
            } else {
                s.into()
            }
        })?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// One fork's failure as E2B's `Error`, its code the HTTP status of its reason.
fn fork_error(reason: &str, message: &str) -> Value {
    let f = Failure::new(
        Reason::parse(reason).unwrap_or(Reason::Internal),
        message.to_string(),
    );
    let e = ApiError::from(f);
    json!({"code": e.status, "message": e.message})
}

/// `POST /sandboxes/{id}/fork` `{"timeout"?, "count"?}`: `count` (1..=20, default 1) copies
/// of the sandbox's files, each with `timeout` (default 300 s) to live; 201 with one
/// `SandboxForkResult` per copy, in order, each a sandbox or its own error.
/// Errors: 404 for a sandbox that is gone; 400 for a bad count or timeout, or a sandbox
/// whose files cannot be copied (a node-local image such as `host`).
pub async fn fork(
    State(g): State<Arc<Gateway>>,
    caller: Caller,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let m = fields(&body, &["timeout", "count"], "a fork")?;
    let timeout = timeout_field(&m, "timeout", g.max_timeout_s)?.unwrap_or(DEFAULT_TIMEOUT_S);
    let count = match field(&m, "count") {
        None => 1,
        Some(v) => v
            .as_i64()
            .filter(|c| (1..=MAX_FORKS).contains(c))
            .ok_or_else(|| {
                ApiError::bad_request(format!(
                    "count must be a whole number within 1..={MAX_FORKS}"
                ))
            })?,
    };
    let sb = live(&g, &caller, &id).await?;
    let req = pb::ForkSandboxRequest {
        id: sb.id,
        count: count as u32,
        // E2B's timeout is a lifetime from now, whatever the copy does, as at creation.
        ttl_running_stop: -1,
        ttl_max: timeout,
        ..Default::default()
    };
    let mut stream = g
        .api()
        .fork_sandbox(g.req(&caller, req))
        .await
        .map_err(|s| super::sandboxes::not_found_as(s.into(), &id))?
        .into_inner();
    let mut results: Vec<Option<Value>> = vec![None; count as usize];
    let mut broke: Option<tonic::Status> = None;
    while let Some(item) = stream.next().await {
        let item = match item {
            Ok(i) => i,
            Err(s) => {
                broke = Some(s);
                break;
            }
        };
        let Some(slot) = results.get_mut(item.index as usize) else {
            continue;
        };
        *slot = Some(match (item.sandbox, item.error) {
            (Some(copy), _) => json!({"sandbox": sandbox_json(&g, &caller, &copy)}),
            (None, Some(e)) => json!({"error": fork_error(&e.reason, &e.message)}),
            (None, None) => json!({"error": fork_error("internal", "the copy was not reported")}),
        });
    }
    let lost = broke.map_or_else(
        || fork_error("internal", "the copy was not reported"),
        |s| {
            let f = crate::rpc::failure_from_status(&s);
            fork_error(f.reason.as_str(), &f.message)
        },
    );
    let body: Vec<Value> = results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| json!({"error": lost.clone()})))
        .collect();
    Ok((StatusCode::CREATED, axum::Json(body)).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_names_are_images_of_the_project() {
        assert_eq!(
            snapshot_image("root/e2b", Some("warm")).unwrap(),
            "root/e2b/warm:default"
        );
        assert_eq!(
            snapshot_image("root", Some("warm:v2")).unwrap(),
            "root/warm:v2"
        );
        let unnamed = snapshot_image("root", None).unwrap();
        assert!(unnamed.starts_with("root/snapshot-") && unnamed.ends_with(":default"));
        for (bad, why) in [
            ("other/warm", "give its name alone"),
            ("Warm", "lower case"),
            ("warm:", "tag"),
        ] {
            let e = snapshot_image("root", Some(bad)).unwrap_err();
            assert_eq!(e.status, 400, "{bad}");
            assert!(e.message.contains(why), "{bad}: {}", e.message);
        }
    }

    #[test]
    fn a_name_filter_matches_with_or_without_project_and_tag() {
        let r = ImageRef::parse("root/e2b/warm:default").unwrap();
        for want in [
            "root/e2b/warm:default",
            "root/e2b/warm",
            "warm:default",
            "warm",
        ] {
            assert!(name_matches(&r, want), "{want}");
        }
        for want in ["warm:v2", "root/warm", "war", "e2b/warm"] {
            assert!(!name_matches(&r, want), "{want}");
        }
    }

    #[test]
    fn a_fork_error_carries_its_status() {
        assert_eq!(
            fork_error("no_capacity", "full"),
            json!({"code": 503, "message": "no_capacity: full"})
        );
        assert_eq!(fork_error("bogus", "x")["code"], 500);
    }
}
