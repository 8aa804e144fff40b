//! Importing from an OCI distribution registry (docs/images.md "Import from a registry")
//! against a registry this test serves on 127.0.0.1 (and on [::1], named in brackets): a
//! bearer token service that wants HTTP Basic credentials, an OCI index to choose linux/amd64
//! from, blobs redirected to a second "storage" host that must never see the credentials, a
//! blob whose bytes are not its digest, a repository that does not exist and a registry that
//! is not there. Needs root (layer files keep their owners).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;
use common::layers::{gzip, layer};

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use base64::Engine;
use opendsec::images::auth::Credentials;
use opendsec::images::import::{import, import_resolved, Options, Progress};
use opendsec::images::name::ImageRef;
use opendsec::images::registry::{save, Registry, RegistryOptions};
use opendsec::images::store::Store;
use opendsec::types::Reason;
use serde_json::json;
use sha2::{Digest as _, Sha256};

fn root_or_skip() -> bool {
    opendsec::sys::root_or_skip("the registry import tests")
}

fn sha(b: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(b)))
}

const USER: &str = "robot$ci";
const PASSWORD: &str = "s3cret";
const TOKEN: &str = "the-bearer-token";

#[derive(Default)]
struct Reg {
    /// repository → tag or digest → (media type, body)
    manifests: HashMap<String, HashMap<String, (String, Vec<u8>)>>,
    /// digest → body, as the registry serves them (maybe not what the digest says)
    blobs: HashMap<String, Vec<u8>>,
    /// The registry's own address, for the token realm, and the storage host's.
    addr: String,
    storage: String,
    /// Authorization headers the storage host was sent.
    storage_auth: Vec<String>,
    /// Blob requests the registry answered, and the storage host.
    blob_gets: usize,
    storage_gets: usize,
}

type Shared = Arc<Mutex<Reg>>;

fn authorized(h: &HeaderMap) -> bool {
    h.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) == Some(&format!("Bearer {TOKEN}"))
}

fn challenge(reg: &Reg) -> Response {
    (
        StatusCode::UNAUTHORIZED,
        [(
            header::WWW_AUTHENTICATE,
            format!(
                "Bearer realm=\"http://{}/token\",service=\"fake\"",
                reg.addr
            ),
        )],
        r#"{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}"#,
    )
        .into_response()
}

async fn v2(State(s): State<Shared>, h: HeaderMap) -> Response {
    let reg = s.lock().unwrap();
    if authorized(&h) {
        return StatusCode::OK.into_response();
    }
    challenge(&reg)
}

async fn token(uri: Uri, h: HeaderMap) -> Response {
    let q: HashMap<&str, &str> = uri
        .query()
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .collect();
    let want = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("{USER}:{PASSWORD}"))
    );
    let ok = h.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) == Some(&want);
    if !ok || q.get("service").copied() != Some("fake") {
        return (StatusCode::UNAUTHORIZED, "bad credentials").into_response();
    }
    (
        [(header::CONTENT_TYPE, "application/json")],
        json!({"token": TOKEN}).to_string(),
    )
        .into_response()
}

/// `/v2/<repo...>/manifests/<ref>` and `/v2/<repo...>/blobs/<digest>`: axum cannot match a
/// repository of several segments, so the tail is split here.
async fn api(State(s): State<Shared>, Path(rest): Path<String>, h: HeaderMap) -> Response {
    let mut reg = s.lock().unwrap();
    if !authorized(&h) {
        return challenge(&reg);
    }
    let unknown = |code: &str| {
        (
            StatusCode::NOT_FOUND,
            [(header::CONTENT_TYPE, "application/json")],
            format!(r#"{{"errors":[{{"code":"{code}","message":"unknown"}}]}}"#),
        )
            .into_response()
    };
    if let Some((repo, reference)) = rest.rsplit_once("/manifests/") {
        let Some((mt, body)) = reg.manifests.get(repo).and_then(|m| m.get(reference)) else {
            return unknown("MANIFEST_UNKNOWN");
        };
        return (
            [
                (header::CONTENT_TYPE, mt.clone()),
                (
                    header::HeaderName::from_static("docker-content-digest"),
                    sha(body),
                ),
            ],
            body.clone(),
        )
            .into_response();
    }
    if let Some((_, digest)) = rest.rsplit_once("/blobs/") {
        reg.blob_gets += 1;
        let Some(body) = reg.blobs.get(digest) else {
            return unknown("BLOB_UNKNOWN");
        };
        // Configs are served here; layers from the storage host, as registries backed by
        // object storage do.
        if body.len() < 600 && body.starts_with(b"{") {
            return body.clone().into_response();
        }
        return (
            StatusCode::TEMPORARY_REDIRECT,
            [(
                header::LOCATION,
                format!("http://{}/storage/{digest}", reg.storage),
            )],
        )
            .into_response();
    }
    unknown("NAME_UNKNOWN")
}

async fn storage(State(s): State<Shared>, Path(digest): Path<String>, h: HeaderMap) -> Response {
    let mut reg = s.lock().unwrap();
    reg.storage_gets += 1;
    if let Some(a) = h.get(header::AUTHORIZATION) {
        reg.storage_auth
            .push(a.to_str().unwrap_or("<not text>").to_string());
    }
    match reg.blobs.get(&digest) {
        Some(b) => Body::from(b.clone()).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

async fn serve(router: Router) -> String {
    serve_on(
        tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
        router,
    )
}

fn serve_on(l: tokio::net::TcpListener, router: Router) -> String {
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(async move { axum::serve(l, router).await });
    addr
}

const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";

/// Publishes an image of `layers` (plain, gzip-compressed blob) as `repo:tag`, under an OCI
/// index with an arm64 decoy, and returns the layers' blob digests.
fn publish(reg: &mut Reg, repo: &str, tag: &str, layers: &[(Vec<u8>, Vec<u8>)]) -> Vec<String> {
    let diff_ids: Vec<String> = layers.iter().map(|(raw, _)| sha(raw)).collect();
    let config = serde_json::to_vec(&json!({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/usr/bin", "FROM=registry"], "WorkingDir": "/srv", "User": "0"},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }))
    .unwrap();
    let mut descs = Vec::new();
    let mut digests = Vec::new();
    for (_, blob) in layers {
        let d = sha(blob);
        reg.blobs.insert(d.clone(), blob.clone());
        descs.push(
            json!({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                          "digest": d, "size": blob.len()}),
        );
        digests.push(d);
    }
    reg.blobs.insert(sha(&config), config.clone());
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": sha(&config), "size": config.len()},
        "layers": descs,
    }))
    .unwrap();
    let decoy = b"{\"schemaVersion\":2}".to_vec();
    let index = serde_json::to_vec(&json!({
        "schemaVersion": 2, "mediaType": OCI_INDEX,
        "manifests": [
            {"mediaType": OCI_MANIFEST, "digest": sha(&decoy), "size": decoy.len(),
             "platform": {"architecture": "arm64", "os": "linux"}},
            {"mediaType": OCI_MANIFEST, "digest": sha(&manifest), "size": manifest.len(),
             "platform": {"architecture": "amd64", "os": "linux"}},
        ],
    }))
    .unwrap();
    let m = reg.manifests.entry(repo.to_string()).or_default();
    m.insert(sha(&manifest), (OCI_MANIFEST.into(), manifest));
    m.insert(sha(&decoy), (OCI_MANIFEST.into(), decoy));
    m.insert(tag.to_string(), (OCI_INDEX.into(), index));
    digests
}

fn opts(user: &str, password: &str) -> RegistryOptions {
    RegistryOptions {
        plain_http: true,
        credentials: Credentials::Basic {
            username: user.into(),
            password: password.into(),
        },
    }
}

/// Resolves and imports `reference` into `store`, the way `opendsec ctl image import` does.
async fn pull(
    store: &Store,
    reference: &str,
    o: &RegistryOptions,
) -> Result<(opendsec::images::store::ImageManifest, Vec<Progress>), opendsec::types::Failure> {
    let (registry, image) = Registry::resolve(reference, o)
        .await
        .map_err(|e| e.to_failure())?;
    let store = Store::at(store.root());
    tokio::task::spawn_blocking(move || {
        let seen = std::cell::RefCell::new(Vec::new());
        let name = registry.reference();
        let m = import_resolved(&store, &registry, image, name, Options::default(), &|p| {
            seen.borrow_mut().push(p)
        })
        .map_err(|e| e.to_failure())?;
        Ok((m, seen.into_inner()))
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_image_is_pulled_with_a_bearer_token_and_redirects_carry_no_credentials() {
    if !root_or_skip() {
        return;
    }
    let s: Shared = Arc::default();
    let l1 = layer(&[("etc/hello", "from the registry\n")]);
    let l2 = layer(&[("usr/bin/tool", "#!/bin/sh\n"), ("etc/more", "m")]);
    let blobs = {
        let mut reg = s.lock().unwrap();
        let ls = vec![(l1.clone(), gzip(&l1)), (l2.clone(), gzip(&l2))];
        let blobs = publish(&mut reg, "team/app", "1", &ls);
        // A blob whose bytes are not its digest, and a repository whose blob is missing.
        let bad = layer(&[("etc/evil", "x")]);
        let good = gzip(&layer(&[("etc/fine", "y")]));
        let d = publish(&mut reg, "team/bad", "1", &[(bad, good)]);
        reg.blobs
            .insert(d[0].clone(), gzip(&layer(&[("etc/other", "z")])));
        blobs
    };
    let registry = Router::new()
        .route("/v2/", get(v2))
        .route("/token", get(token))
        .route("/v2/{*rest}", get(api))
        .with_state(s.clone());
    let addr = serve(registry.clone()).await;
    // The same registry on IPv6 loopback, named `[::1]:PORT` (tokens and blobs still come
    // from the IPv4 hosts); a machine without IPv6 skips that part, saying so.
    let addr6 = match tokio::net::TcpListener::bind("[::1]:0").await {
        Ok(l) => Some(serve_on(l, registry)),
        Err(e) => {
            eprintln!("SKIPPED the import from [::1]: no IPv6 loopback here: {e}");
            None
        }
    };
    let storage_addr = serve(
        Router::new()
            .route("/storage/{digest}", get(storage))
            .with_state(s.clone()),
    )
    .await;
    {
        let mut reg = s.lock().unwrap();
        reg.addr = addr.clone();
        reg.storage = storage_addr;
    }
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();

    let (m, seen) = pull(&store, &format!("{addr}/team/app:1"), &opts(USER, PASSWORD))
        .await
        .unwrap();
    assert_eq!(m.layers.len(), 2);
    assert_eq!(m.layers[0].to_string(), sha(&l1), "bottom first");
    assert_eq!(m.env, ["PATH=/usr/bin", "FROM=registry"]);
    assert_eq!((m.workdir.as_str(), m.user.as_str()), ("/srv", "0"));
    assert_eq!(m.source, format!("{addr}/team/app:1"));
    let root = store.layer_dir(&m.layers[0]).join("rootfs");
    assert_eq!(
        std::fs::read_to_string(root.join("etc/hello")).unwrap(),
        "from the registry\n"
    );
    // Progress: each layer announced with its size and read to its end.
    let size = s.lock().unwrap().blobs[&blobs[1]].len() as u64;
    assert!(
        seen.iter()
            .any(|p| matches!(p, Progress::Started { index: 2, size: Some(n), .. } if *n == size)),
        "{seen:?}"
    );
    assert!(
        seen.iter()
            .any(|p| matches!(p, Progress::Read { index: 2, bytes } if *bytes == size)),
        "{seen:?}"
    );
    {
        let reg = s.lock().unwrap();
        assert_eq!(
            reg.storage_gets, 2,
            "both layers came from the storage host"
        );
        assert!(
            reg.storage_auth.is_empty(),
            "the storage host was sent {:?}",
            reg.storage_auth
        );
    }

    // Through the IPv6 address: the same image, into a store of its own.
    if let Some(addr6) = &addr6 {
        let dir6 = tempfile::tempdir().unwrap();
        let (m6, _) = pull(
            &Store::open(dir6.path()).unwrap(),
            &format!("{addr6}/team/app:1"),
            &opts(USER, PASSWORD),
        )
        .await
        .unwrap();
        assert!(addr6.starts_with("[::1]:"), "{addr6}");
        assert_eq!(m6.layers, m.layers);
        assert_eq!(m6.source, format!("{addr6}/team/app:1"));
    }

    // Again: both layers are in the store, so no blob is fetched.
    let gets = s.lock().unwrap().blob_gets;
    let (_, seen) = pull(&store, &format!("{addr}/team/app:1"), &opts(USER, PASSWORD))
        .await
        .unwrap();
    assert!(
        seen.iter().all(|p| matches!(p, Progress::Cached { .. })),
        "{seen:?}"
    );
    assert_eq!(
        s.lock().unwrap().blob_gets,
        gets + 1,
        "only the config is read again"
    );

    // Wrong credentials, and none: the token service refuses, the registry says 401.
    for o in [
        opts(USER, "wrong"),
        RegistryOptions {
            plain_http: true,
            credentials: Credentials::Anonymous,
        },
    ] {
        let e = pull(&store, &format!("{addr}/team/app:1"), &o)
            .await
            .unwrap_err();
        assert_eq!(e.reason, Reason::Unauthenticated, "{e:?}");
    }
    let e = pull(
        &store,
        &format!("{addr}/team/none:1"),
        &opts(USER, PASSWORD),
    )
    .await
    .unwrap_err();
    assert_eq!(e.reason, Reason::NotFound, "{e:?}");
    let e = pull(&store, &format!("{addr}/team/app:2"), &opts(USER, PASSWORD))
        .await
        .unwrap_err();
    assert_eq!(e.reason, Reason::NotFound, "{e:?}");

    // A blob that is not what its digest says: invalid, and nothing of it stays.
    let before: Vec<_> = std::fs::read_dir(dir.path().join("layers"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    let e = pull(&store, &format!("{addr}/team/bad:1"), &opts(USER, PASSWORD))
        .await
        .unwrap_err();
    assert_eq!(e.reason, Reason::Invalid, "{e:?}");
    let after: Vec<_> = std::fs::read_dir(dir.path().join("layers"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(before.len(), after.len());

    // image save: an OCI archive of the amd64 image that imports to the same image; a blob
    // that is not its digest leaves no archive behind.
    let rt = tokio::runtime::Handle::current();
    let out = dir.path().join("saved.tar");
    let (reference, o, at) = (
        format!("{addr}/team/app:1"),
        opts(USER, PASSWORD),
        out.clone(),
    );
    let saved = tokio::task::spawn_blocking(move || save(&rt, &reference, &o, &at, &|_| {}))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(saved.layers, 2);
    assert_eq!(saved.bytes, std::fs::metadata(&out).unwrap().len());
    let other = tempfile::tempdir().unwrap();
    let store2 = Store::open(other.path()).unwrap();
    let m2 = import(
        &store2,
        &format!("{}#1", out.display()),
        &ImageRef::parse("root/saved:1").unwrap(),
        Options::default(),
        &|_| {},
    )
    .unwrap();
    assert_eq!((m2.layers, m2.env), (m.layers.clone(), m.env.clone()));
    let rt = tokio::runtime::Handle::current();
    let bad_out = dir.path().join("bad.tar");
    let (reference, o, at) = (
        format!("{addr}/team/bad:1"),
        opts(USER, PASSWORD),
        bad_out.clone(),
    );
    let e = tokio::task::spawn_blocking(move || save(&rt, &reference, &o, &at, &|_| {}))
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(e.to_failure().reason, Reason::Invalid, "{e}");
    assert!(!bad_out.exists() && !dir.path().join("bad.tar.partial").exists());

    // HTTPS against a plain-HTTP registry, and a registry that is not there.
    let tls = RegistryOptions {
        plain_http: false,
        ..opts(USER, PASSWORD)
    };
    let e = pull(&store, &format!("{addr}/team/app:1"), &tls)
        .await
        .unwrap_err();
    assert_eq!(e.reason, Reason::Unavailable, "{e:?}");
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let e = pull(
        &store,
        &format!("{closed}/team/app:1"),
        &opts(USER, PASSWORD),
    )
    .await
    .unwrap_err();
    assert_eq!(e.reason, Reason::Unavailable, "{e:?}");
}
