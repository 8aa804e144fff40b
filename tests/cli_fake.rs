//! The real `opendsec ctl` binary against a fake DSec server in this process (loopback,
//! port 0): JSON output, the error format and exit codes, exec streaming and exit codes,
//! cp both ways, iam backup's file mode, batch output, and failover between addresses.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use opendsec::pb;
use opendsec::pb::d_sec_server::{DSec, DSecServer};
use opendsec::pb::shell_chunk::Kind;
use opendsec::rpc::{self, to_status};
use opendsec::types::{Failure, Reason};
use tokio::net::TcpListener;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

const TOKEN: &str = "dsk.admin.t1.secret";

type Boxed<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

fn boxed<T: Send + 'static>(items: Vec<Result<T, Status>>) -> Boxed<T> {
    Box::pin(tokio_stream::iter(items))
}

/// What the fake keeps: files, the last requests, and counters the tests look at.
#[derive(Default)]
struct Fake {
    calls: AtomicUsize,
    files: Mutex<HashMap<String, (Vec<u8>, u32)>>,
    last_create: Mutex<Option<pb::CreateSandboxRequest>>,
    last_fork: Mutex<Option<pb::ForkSandboxRequest>>,
    last_project: Mutex<Option<pb::CreateProjectRequest>>,
    last_shell: Mutex<Option<pb::RunShellRequest>>,
    last_network: Mutex<Option<pb::UpdateNetworkRequest>>,
    last_port: Mutex<Option<pb::PortFrame>>,
    restored: Mutex<Option<Vec<u8>>>,
    flaky_done: AtomicBool,
}

const BACKUP: &[u8] = b"\x1f\x8b-pretend-gzip-\x00\xff-bytes";

impl Fake {
    /// Counts the call and checks `authorization: Bearer <TOKEN>`.
    fn auth<T>(&self, req: &Request<T>) -> Result<(), Status> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if rpc::bearer(req) == TOKEN {
            Ok(())
        } else {
            Err(to_status(&Failure::unauthenticated("unknown token")))
        }
    }

    fn sandbox(id: &str, spec: Option<pb::SandboxSpec>) -> pb::Sandbox {
        pb::Sandbox {
            id: id.to_string(),
            project: "root".into(),
            principal: "admin".into(),
            edge_id: "edge-1".into(),
            spec,
            state: pb::SandboxState::Running as i32,
            created_at: 1_700_000_000,
            ..Default::default()
        }
    }

    /// The fake command: prints its command line; `fail7` exits 7 with stderr output;
    /// `oom` exits 137, killed by the OOM killer; `slow` with a timeout times out.
    fn shell_result(req: &pb::RunShellRequest) -> (Vec<u8>, Vec<u8>, pb::ShellResult) {
        let out = format!("{}\n", req.cmd).into_bytes();
        let err = if req.cmd.contains("fail7") {
            b"it failed\n".to_vec()
        } else {
            vec![]
        };
        let res = pb::ShellResult {
            cmd_id: 42,
            exit_code: if req.cmd.contains("fail7") {
                7
            } else if req.cmd.contains("oom") {
                137
            } else {
                0
            },
            oom_killed: req.cmd.contains("oom"),
            timed_out: req.cmd.contains("slow") && req.timeout > 0.0,
            dropped_bytes: if req.cmd.contains("flood") { 5000 } else { 0 },
            done: true,
            ..Default::default()
        };
        (out, err, res)
    }
}

fn chunk(kind: Kind, offset: i64) -> Result<pb::ShellChunk, Status> {
    Ok(pb::ShellChunk {
        kind: Some(kind),
        offset,
    })
}

fn sandbox_call<T>(f: &Fake, req: &Request<T>, id: &str) -> Result<Response<pb::Sandbox>, Status> {
    f.auth(req)?;
    if id == "missing" {
        return Err(to_status(&Failure::not_found("sandbox missing not found")));
    }
    let mut sb = Fake::sandbox(id, None);
    if id == "edge-1.stopped" {
        sb.state = pb::SandboxState::Stopped as i32;
    }
    Ok(Response::new(sb))
}

macro_rules! dsec_impl {
    ({ $($body:tt)* } unimplemented { $($name:ident($req:ident) -> $resp:ident;)* }) => {
        #[tonic::async_trait]
        impl DSec for Fake {
            $($body)*
            $(
                async fn $name(&self, _r: Request<pb::$req>) -> Result<Response<pb::$resp>, Status> {
                    Err(Status::unimplemented(stringify!($name)))
                }
            )*
        }
    };
}

dsec_impl!({
    type ConnectPortStream = Boxed<pb::PortFrame>;
    /// An echo service at every port: the connected frame, then each data frame back, and
    /// `eof` for `eof`. The first frame is kept for the test.
    async fn connect_port(
        &self,
        r: Request<tonic::Streaming<pb::PortFrame>>,
    ) -> Result<Response<Self::ConnectPortStream>, Status> {
        self.auth(&r)?;
        let mut inbound = r.into_inner();
        let first = inbound.message().await?.unwrap_or_default();
        *self.last_port.lock().unwrap() = Some(first.clone());
        let port = first.port;
        let connected = pb::PortFrame { port, ..Default::default() };
        let echo = tokio_stream::StreamExt::map(inbound, move |f| {
            f.map(|f| pb::PortFrame { port, data: f.data, eof: f.eof, ..Default::default() })
        });
        let s = tokio_stream::StreamExt::chain(
            tokio_stream::once(Ok(connected)),
            tokio_stream::once(Ok(pb::PortFrame { port, data: first.data, ..Default::default() })),
        );
        Ok(Response::new(Box::pin(tokio_stream::StreamExt::chain(s, echo))))
    }
    type CreateSandboxesStream = Boxed<pb::CreateSandboxesItem>;
    type ForkSandboxStream = Boxed<pb::CreateSandboxesItem>;
    type StreamShellStream = Boxed<pb::ShellChunk>;
    type StreamOutputStream = Boxed<pb::ShellChunk>;
    type StartProcessStream = Boxed<pb::ProcessEvent>;
    type WatchDirStream = Boxed<pb::FileEvent>;
    type ConnectProcessStream = Boxed<pb::ProcessEvent>;

    async fn create_sandbox(&self, r: Request<pb::CreateSandboxRequest>) -> Result<Response<pb::Sandbox>, Status> {
        self.auth(&r)?;
        let req = r.into_inner();
        *self.last_create.lock().unwrap() = Some(req.clone());
        Ok(Response::new(Fake::sandbox("edge-1.new", req.spec)))
    }

    /// Items come back in reverse order; index 1 is over quota and index 3 finds no room.
    async fn create_sandboxes(&self, r: Request<pb::CreateSandboxesRequest>) -> Result<Response<Self::CreateSandboxesStream>, Status> {
        self.auth(&r)?;
        let req = r.into_inner();
        let items = (0..req.count)
            .rev()
            .map(|i| {
                let fail = |reason, msg: &str| pb::ErrorDetail { reason: Reason::as_str(reason).into(), message: msg.into() };
                Ok(match i {
                    1 => pb::CreateSandboxesItem { index: i, sandbox: None, error: Some(fail(Reason::QuotaExceeded, "project root: sandboxes")) },
                    3 => pb::CreateSandboxesItem { index: i, sandbox: None, error: Some(fail(Reason::NoCapacity, "every edge is full")) },
                    _ => pb::CreateSandboxesItem { index: i, sandbox: Some(Fake::sandbox(&format!("edge-1.b{i}"), None)), error: None },
                })
            })
            .collect();
        Ok(Response::new(boxed(items)))
    }

    /// Every copy is made, in reverse order.
    async fn fork_sandbox(&self, r: Request<pb::ForkSandboxRequest>) -> Result<Response<Self::ForkSandboxStream>, Status> {
        self.auth(&r)?;
        let req = r.into_inner();
        *self.last_fork.lock().unwrap() = Some(req.clone());
        let items = (0..req.count)
            .rev()
            .map(|i| Ok(pb::CreateSandboxesItem { index: i, sandbox: Some(Fake::sandbox(&format!("edge-1.f{i}"), None)), error: None }))
            .collect();
        Ok(Response::new(boxed(items)))
    }

    async fn get_sandbox(&self, r: Request<pb::SandboxRef>) -> Result<Response<pb::Sandbox>, Status> {
        let id = r.get_ref().id.clone();
        sandbox_call(self, &r, &id)
    }
    async fn stop_sandbox(&self, r: Request<pb::SandboxRef>) -> Result<Response<pb::Sandbox>, Status> {
        let id = r.get_ref().id.clone();
        let mut resp = sandbox_call(self, &r, &id)?;
        resp.get_mut().state = pb::SandboxState::Stopped as i32;
        Ok(resp)
    }
    async fn pause_sandbox(&self, r: Request<pb::SandboxRef>) -> Result<Response<pb::Sandbox>, Status> {
        let id = r.get_ref().id.clone();
        sandbox_call(self, &r, &id)
    }
    async fn resume_sandbox(&self, r: Request<pb::SandboxRef>) -> Result<Response<pb::Sandbox>, Status> {
        let id = r.get_ref().id.clone();
        sandbox_call(self, &r, &id)
    }
    async fn touch_sandbox(&self, r: Request<pb::SandboxRef>) -> Result<Response<pb::Sandbox>, Status> {
        let id = r.get_ref().id.clone();
        sandbox_call(self, &r, &id)
    }
    async fn set_sandbox_timeout(&self, r: Request<pb::SetSandboxTimeoutRequest>) -> Result<Response<pb::Sandbox>, Status> {
        let id = r.get_ref().id.clone();
        let mut resp = sandbox_call(self, &r, &id)?;
        resp.get_mut().message = format!("timeout {}", r.get_ref().timeout_s);
        Ok(resp)
    }
    /// Answers with the rules it was sent as the sandbox's (as if replaced).
    async fn update_network(&self, r: Request<pb::UpdateNetworkRequest>) -> Result<Response<pb::Sandbox>, Status> {
        let id = r.get_ref().id.clone();
        let mut resp = sandbox_call(self, &r, &id)?;
        let req = r.into_inner();
        resp.get_mut().spec = Some(pb::SandboxSpec {
            network_rules: req.rules.clone(),
            ..Default::default()
        });
        *self.last_network.lock().unwrap() = Some(req);
        Ok(resp)
    }
    async fn list_sandboxes(&self, r: Request<pb::ListSandboxesRequest>) -> Result<Response<pb::ListSandboxesResponse>, Status> {
        self.auth(&r)?;
        let req = r.into_inner();
        if req.task_id == "edge-down" {
            return Ok(Response::new(pb::ListSandboxesResponse {
                sandboxes: vec![],
                unreachable_edges: vec!["edge-2".into()],
            }));
        }
        let mut sb = Fake::sandbox("edge-1.a", None);
        sb.message = format!("project={} task={} ended={}", req.project, req.task_id, req.include_ended);
        Ok(Response::new(pb::ListSandboxesResponse {
            sandboxes: vec![sb],
            unreachable_edges: vec![],
        }))
    }

    async fn pause_task(&self, r: Request<pb::TaskRequest>) -> Result<Response<pb::TaskActionResult>, Status> {
        self.auth(&r)?;
        Ok(Response::new(pb::TaskActionResult::default()))
    }
    async fn resume_task(&self, r: Request<pb::TaskRequest>) -> Result<Response<pb::TaskActionResult>, Status> {
        self.auth(&r)?;
        Ok(Response::new(pb::TaskActionResult::default()))
    }
    async fn stop_task(&self, r: Request<pb::TaskRequest>) -> Result<Response<pb::TaskActionResult>, Status> {
        self.auth(&r)?;
        let req = r.into_inner();
        Ok(Response::new(pb::TaskActionResult {
            affected: 2,
            failed: 1,
            errors: vec![format!("edge-1.x: not_found: gone (task {} in {})", req.task_id, req.project)],
        }))
    }

    /// Output in two stdout chunks (with offsets), then stderr, then the exit record. A
    /// command containing `flaky` breaks the first stream with `unavailable` after one chunk.
    async fn stream_shell(&self, r: Request<pb::RunShellRequest>) -> Result<Response<Self::StreamShellStream>, Status> {
        self.auth(&r)?;
        let req = r.into_inner();
        *self.last_shell.lock().unwrap() = Some(req.clone());
        let (out, err, res) = Fake::shell_result(&req);
        let half = out.len() / 2;
        let mut items = vec![chunk(Kind::Started(42), 0), chunk(Kind::Stdout(out[..half].to_vec()), 0)];
        if req.cmd.contains("flaky") && !self.flaky_done.swap(true, Ordering::SeqCst) {
            items.push(Err(to_status(&Failure::unavailable("edge restarting"))));
            return Ok(Response::new(boxed(items)));
        }
        items.push(chunk(Kind::Stdout(out[half..].to_vec()), half as i64));
        if !err.is_empty() {
            items.push(chunk(Kind::Stderr(err), 0));
        }
        items.push(chunk(Kind::Exit(res), 0));
        Ok(Response::new(boxed(items)))
    }

    /// Picks a command's output up again; re-sends 3 bytes before the asked offset, as a
    /// server might after a reconnect, so the client has to trim them.
    async fn stream_output(&self, r: Request<pb::GetOutputRequest>) -> Result<Response<Self::StreamOutputStream>, Status> {
        self.auth(&r)?;
        let req = r.into_inner();
        let last = self.last_shell.lock().unwrap().clone();
        let Some(shell) = last.filter(|_| req.cmd_id == 42) else {
            return Err(to_status(&Failure::not_found("no such command")));
        };
        let (out, err, res) = Fake::shell_result(&shell);
        let from = (req.stdout_offset - 3).max(0) as usize;
        let mut items = vec![chunk(Kind::Stdout(out[from..].to_vec()), from as i64)];
        if !err.is_empty() {
            items.push(chunk(Kind::Stderr(err[req.stderr_offset as usize..].to_vec()), req.stderr_offset));
        }
        items.push(chunk(Kind::Exit(res), 0));
        Ok(Response::new(boxed(items)))
    }

    async fn read_file(&self, r: Request<pb::ReadFileRequest>) -> Result<Response<pb::ReadFileResponse>, Status> {
        self.auth(&r)?;
        let req = r.into_inner();
        match self.files.lock().unwrap().get(&format!("{}:{}", req.sandbox_id, req.path)) {
            Some((data, _)) => Ok(Response::new(pb::ReadFileResponse { data: data.clone() })),
            None => Err(to_status(&Failure::not_found(format!("{}: no such file", req.path)))),
        }
    }
    async fn write_file(&self, r: Request<pb::WriteFileRequest>) -> Result<Response<pb::FileInfo>, Status> {
        self.auth(&r)?;
        let req = r.into_inner();
        let info = pb::FileInfo {
            name: req.path.rsplit('/').next().unwrap_or("").into(),
            r#type: "file".into(),
            size: req.data.len() as i64,
            mode: req.mode,
            path: req.path.clone(),
            ..Default::default()
        };
        self.files.lock().unwrap().insert(format!("{}:{}", req.sandbox_id, req.path), (req.data, req.mode));
        Ok(Response::new(info))
    }
    async fn stat(&self, r: Request<pb::PathRequest>) -> Result<Response<pb::FileInfo>, Status> {
        self.auth(&r)?;
        Err(to_status(&Failure::not_found("stat is not faked")))
    }

    async fn who_am_i(&self, r: Request<pb::Empty>) -> Result<Response<pb::WhoAmIResponse>, Status> {
        self.auth(&r)?;
        Ok(Response::new(pb::WhoAmIResponse { principal: "admin".into(), project: "root".into(), kind: "user".into(), token_id: "t1".into() }))
    }
    async fn create_project(&self, r: Request<pb::CreateProjectRequest>) -> Result<Response<pb::Project>, Status> {
        self.auth(&r)?;
        let req = r.into_inner();
        *self.last_project.lock().unwrap() = Some(req.clone());
        Ok(Response::new(pb::Project { path: format!("{}/{}", req.parent, req.name), quota: req.quota, ..Default::default() }))
    }
    async fn get_project(&self, r: Request<pb::ProjectRef>) -> Result<Response<pb::Project>, Status> {
        self.auth(&r)?;
        Ok(Response::new(pb::Project { path: r.into_inner().project, children: vec!["root/a".into()], ..Default::default() }))
    }
    async fn delete_project(&self, r: Request<pb::ProjectRef>) -> Result<Response<pb::Empty>, Status> {
        self.auth(&r)?;
        Err(to_status(&Failure::conflict(format!("project {} has subprojects", r.get_ref().project))))
    }
    async fn create_principal(&self, r: Request<pb::CreatePrincipalRequest>) -> Result<Response<pb::CreatePrincipalResponse>, Status> {
        self.auth(&r)?;
        let req = r.into_inner();
        Ok(Response::new(pb::CreatePrincipalResponse {
            principal_id: req.principal_id.clone(),
            token: format!("dsk.{}.t1.s3cret", req.principal_id),
            token_info: Some(pb::TokenInfo { id: "t1".into(), principal: req.principal_id, description: req.kind, expires_at: req.ttl, ..Default::default() }),
        }))
    }
    async fn delete_principal(&self, r: Request<pb::PrincipalRef>) -> Result<Response<pb::Empty>, Status> {
        self.auth(&r)?;
        Ok(Response::new(pb::Empty {}))
    }
    async fn grant(&self, r: Request<pb::GrantRequest>) -> Result<Response<pb::Project>, Status> {
        self.auth(&r)?;
        let req = r.into_inner();
        let mut policies = HashMap::new();
        policies.insert(req.principal, pb::PermissionList { permissions: req.permissions });
        Ok(Response::new(pb::Project { path: req.project, policies, ..Default::default() }))
    }
    async fn revoke(&self, r: Request<pb::GrantRequest>) -> Result<Response<pb::Project>, Status> {
        self.auth(&r)?;
        let req = r.into_inner();
        let mut policies = HashMap::new();
        let left = if req.permissions.is_empty() { vec![] } else { vec![format!("left-after-revoking-{}", req.permissions.len())] };
        policies.insert(req.principal, pb::PermissionList { permissions: left });
        Ok(Response::new(pb::Project { path: req.project, policies, ..Default::default() }))
    }
    async fn create_token(&self, r: Request<pb::CreateTokenRequest>) -> Result<Response<pb::CreateTokenResponse>, Status> {
        self.auth(&r)?;
        let req = r.into_inner();
        let who = if req.principal.is_empty() { "admin".to_string() } else { req.principal };
        Ok(Response::new(pb::CreateTokenResponse {
            token: format!("dsk.{who}.t2.s3cret"),
            info: Some(pb::TokenInfo { id: "t2".into(), principal: who, description: req.description, expires_at: req.ttl, ..Default::default() }),
        }))
    }
    async fn list_tokens(&self, r: Request<pb::PrincipalRef>) -> Result<Response<pb::ListTokensResponse>, Status> {
        self.auth(&r)?;
        let who = r.into_inner().principal;
        Ok(Response::new(pb::ListTokensResponse { tokens: vec![pb::TokenInfo { id: "t1".into(), principal: who, ..Default::default() }] }))
    }
    async fn revoke_token(&self, r: Request<pb::RevokeTokenRequest>) -> Result<Response<pb::Empty>, Status> {
        self.auth(&r)?;
        if r.get_ref().token_id == "nope" {
            return Err(to_status(&Failure::not_found("token nope not found")));
        }
        Ok(Response::new(pb::Empty {}))
    }
    async fn get_usage(&self, r: Request<pb::GetUsageRequest>) -> Result<Response<pb::UsageReport>, Status> {
        self.auth(&r)?;
        let req = r.into_inner();
        let row = |project: &str, day: &str, n: i64, h: f64| pb::UsageRow {
            project: project.into(),
            day: day.into(),
            sandboxes_started: n,
            sandbox_hours: h,
            cpu_core_hours: h * 2.0,
            memory_gb_hours: h * 4.0,
            gpu_hours: 0.0,
        };
        let day = if req.daily { req.start.clone() } else { "total".to_string() };
        Ok(Response::new(pb::UsageReport { rows: vec![row(&req.project, &day, 3, 1.5), row("root/b", &day, 1, 0.25)] }))
    }
    async fn cluster_status(&self, r: Request<pb::Empty>) -> Result<Response<pb::Snapshot>, Status> {
        self.auth(&r)?;
        let edge = pb::EdgeState { id: "edge-1".into(), healthy: true, ..Default::default() };
        Ok(Response::new(pb::Snapshot { version: 7, generated_at: 1_700_000_000, edges: vec![edge] }))
    }
    async fn drain_edge(&self, r: Request<pb::DrainEdgeRequest>) -> Result<Response<pb::EdgeState>, Status> {
        self.auth(&r)?;
        let req = r.into_inner();
        Ok(Response::new(pb::EdgeState { id: req.edge_id, draining: !req.undo, healthy: true, ..Default::default() }))
    }
    async fn iam_backup(&self, r: Request<pb::Empty>) -> Result<Response<pb::IamBackupResponse>, Status> {
        self.auth(&r)?;
        Ok(Response::new(pb::IamBackupResponse { data: BACKUP.to_vec() }))
    }
    async fn iam_members(&self, r: Request<pb::Empty>) -> Result<Response<pb::IamMembersResponse>, Status> {
        self.auth(&r)?;
        Err(Status::unimplemented("iam_members"))
    }
    async fn iam_member_add(&self, r: Request<pb::IamMemberAddRequest>) -> Result<Response<pb::IamMembersResponse>, Status> {
        self.auth(&r)?;
        Err(Status::unimplemented("iam_member_add"))
    }
    async fn iam_member_remove(&self, r: Request<pb::IamMemberRemoveRequest>) -> Result<Response<pb::IamMembersResponse>, Status> {
        self.auth(&r)?;
        Err(Status::unimplemented("iam_member_remove"))
    }
    async fn iam_restore(&self, r: Request<pb::IamRestoreRequest>) -> Result<Response<pb::Empty>, Status> {
        self.auth(&r)?;
        *self.restored.lock().unwrap() = Some(r.into_inner().data);
        Ok(Response::new(pb::Empty {}))
    }
    async fn start_process(&self, _r: Request<pb::StartProcessRequest>) -> Result<Response<Self::StartProcessStream>, Status> {
        Err(Status::unimplemented("start_process"))
    }
    async fn connect_process(&self, _r: Request<pb::ConnectProcessRequest>) -> Result<Response<Self::ConnectProcessStream>, Status> {
        Err(Status::unimplemented("connect_process"))
    }
    async fn watch_dir(&self, _r: Request<pb::WatchDirRequest>) -> Result<Response<Self::WatchDirStream>, Status> {
        Err(Status::unimplemented("watch_dir"))
    }
} unimplemented {
    run_shell(RunShellRequest) -> ShellResult;
    get_output(GetOutputRequest) -> ShellResult;
    list_sessions(ListSessionsRequest) -> ListSessionsResponse;
    close_session(CloseSessionRequest) -> Empty;
    list_dir(PathRequest) -> ListDirResponse;
    remove(RemoveRequest) -> Empty;
    make_dir(PathRequest) -> FileInfo;
    r#move(MoveRequest) -> FileInfo;
    http(HttpRequest) -> HttpResponse;
    send_process_input(ProcessInputRequest) -> Empty;
    close_process_input(ProcessRef) -> Empty;
    signal_process(SignalProcessRequest) -> Empty;
    resize_process_pty(ResizePtyRequest) -> Empty;
    list_processes(ListProcessesRequest) -> ListProcessesResponse;
    create_watcher(WatchDirRequest) -> WatcherRef;
    get_watcher_events(WatcherRef) -> WatcherEvents;
    remove_watcher(WatcherRef) -> Empty;
    set_quota(SetQuotaRequest) -> Project;
    register_image(RegisterImageRequest) -> ImageInfo;
    list_images(ListImagesRequest) -> ListImagesResponse;
    get_image(ImageRef) -> ImageInfo;
    delete_image(ImageRef) -> Empty;
    compose_image(ComposeImageRequest) -> ImageInfo;
    pack_diff(PackDiffRequest) -> ImageInfo;
    create_snapshot(CreateSnapshotRequest) -> ImageInfo;
});

/// A running fake: its address and state.
struct Server {
    addr: String,
    fake: Arc<Fake>,
}

async fn start() -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let fake = Arc::new(Fake::default());
    let svc = DSecServer::from_arc(fake.clone())
        .max_decoding_message_size(rpc::MAX_MESSAGE)
        .max_encoding_message_size(rpc::MAX_MESSAGE);
    let router = rpc::serve::builder(None, rpc::acl::Policy::Public)
        .unwrap()
        .add_service(svc);
    tokio::spawn(async move {
        let _ = router
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await;
    });
    Server { addr, fake }
}

/// What a run of the CLI left.
struct Run {
    code: i32,
    stdout: Vec<u8>,
    stderr: String,
}

impl Run {
    fn out(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.stdout)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}\nstderr: {}", self.out(), self.stderr))
    }
}

/// Runs `opendsec ctl <args>` with `addr` and the good token in the environment.
async fn ctl(addr: &str, args: &[&str]) -> Run {
    ctl_env(addr, TOKEN, args, None).await
}

async fn ctl_env(addr: &str, token: &str, args: &[&str], stdin: Option<&[u8]>) -> Run {
    use tokio::io::AsyncWriteExt;
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_opendsec"));
    cmd.arg("ctl")
        .args(args)
        .env_remove("OPENDSEC_CA")
        .env_remove("OPENDSEC_PROJECT")
        .env("OPENDSEC_ADDR", addr)
        .env("OPENDSEC_TOKEN", token)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let mut input = child.stdin.take().unwrap();
    if let Some(data) = stdin {
        input.write_all(data).await.unwrap();
    }
    drop(input);
    let out = child.wait_with_output().await.unwrap();
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: out.stdout,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_json_and_error_format() {
    let s = start().await;
    let r = ctl(&s.addr, &["sandbox", "get", "edge-1.abc"]).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    let v = r.json();
    assert_eq!(v["id"], "edge-1.abc");
    assert_eq!(v["state"], "RUNNING");
    assert_eq!(v["created_at"], "1700000000");
    // Fields at their default value are left out.
    assert!(
        v.get("ended_at").is_none() && v.get("message").is_none(),
        "{v}"
    );

    let r = ctl(&s.addr, &["sandbox", "get", "missing"]).await;
    assert_eq!(
        (r.code, r.stderr.as_str(), r.stdout.len()),
        (1, "error: not_found: sandbox missing not found\n", 0)
    );

    let r = ctl_env(&s.addr, "dsk.admin.t1.wrong", &["whoami"], None).await;
    assert_eq!(
        (r.code, r.stderr.as_str()),
        (1, "error: unauthenticated: unknown token\n")
    );

    // -token beats OPENDSEC_TOKEN, and may come after the command.
    let r = ctl_env(
        &s.addr,
        "dsk.admin.t1.wrong",
        &["whoami", "-token", TOKEN],
        None,
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json()["principal"], "admin");

    let r = ctl(&s.addr, &["sandbox", "stop", "edge-1.abc"]).await;
    assert_eq!(r.json()["state"], "STOPPED");
    let r = ctl(&s.addr, &["sandbox", "timeout", "edge-1.abc", "600"]).await;
    assert_eq!(r.json()["message"], "timeout 600");
    let r = ctl(
        &s.addr,
        &[
            "sandbox",
            "list",
            "-all",
            "-task",
            "job-1",
            "-project",
            "root/team-a",
        ],
    )
    .await;
    assert_eq!(
        r.json()["sandboxes"][0]["message"],
        "project=root/team-a task=job-1 ended=true"
    );
    // An empty list still has its key; an edge that did not answer is named on stderr.
    let r = ctl(&s.addr, &["sandbox", "list", "-task", "edge-down"]).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json()["sandboxes"], serde_json::json!([]));
    assert_eq!(r.json()["unreachable_edges"], serde_json::json!(["edge-2"]));
    assert!(
        r.stderr
            .contains("warning: edges edge-2 did not answer: their sandboxes are not listed"),
        "{}",
        r.stderr
    );
    let r = ctl(&s.addr, &["status"]).await;
    assert_eq!(r.json()["edges"][0]["id"], "edge-1");
    let r = ctl(&s.addr, &["edge", "drain", "edge-1"]).await;
    assert_eq!(r.json()["draining"], true);
    let r = ctl(&s.addr, &["edge", "drain", "edge-1", "-undo"]).await;
    assert!(r.json().get("draining").is_none());
}

/// `sandbox network ID RULES... [-replace]`: rules as separate words (a comma also
/// separates them), `!` taking one back; checked before anything is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_network_sends_rules_and_checks_them_first() {
    let s = start().await;
    let r = ctl(
        &s.addr,
        &[
            "sandbox",
            "network",
            "edge-1.abc",
            "pypi",
            "github.com:443,192.0.2.0/24:80/tcp",
            "!npm",
        ],
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json()["id"], "edge-1.abc");
    assert_eq!(
        r.json()["spec"]["network_rules"]["!npm"],
        serde_json::Value::Null
    );
    assert_eq!(r.json()["spec"]["network_rules"]["npm"], false);
    let sent = s.fake.last_network.lock().unwrap().take().unwrap();
    assert_eq!((sent.id.as_str(), sent.replace), ("edge-1.abc", false));
    assert_eq!(
        sent.rules,
        [
            ("pypi".to_string(), true),
            ("github.com:443".to_string(), true),
            ("192.0.2.0/24:80/tcp".to_string(), true),
            ("npm".to_string(), false)
        ]
        .into()
    );
    // -replace, before or after the rules; alone it takes every rule back.
    let r = ctl(
        &s.addr,
        &["sandbox", "network", "-replace", "edge-1.abc", "*"],
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    let sent = s.fake.last_network.lock().unwrap().take().unwrap();
    assert!(sent.replace);
    assert_eq!(sent.rules, [("*".to_string(), true)].into());
    let r = ctl(&s.addr, &["sandbox", "network", "edge-1.abc", "-replace"]).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    let sent = s.fake.last_network.lock().unwrap().take().unwrap();
    assert!(sent.replace && sent.rules.is_empty());

    let before = s.fake.calls.load(Ordering::SeqCst);
    for (args, want) in [
        (
            &["sandbox", "network", "edge-1.abc", "x.io:70000"][..],
            "error: invalid: RULES: network rule \"x.io:70000\": port outside 1-65535",
        ),
        (
            &["sandbox", "network", "edge-1.abc", "pypi", "!pypi"],
            "error: invalid: RULES: ",
        ),
        (
            &["sandbox", "network", "edge-1.abc", "pypi,"],
            "error: invalid: RULES: bad rule \"\"",
        ),
        (
            &["sandbox", "network", "edge-1.abc"],
            "error: invalid: RULES: give at least one rule",
        ),
        (
            &["sandbox", "network", "bad id", "pypi"],
            "error: invalid: bad sandbox id",
        ),
    ] {
        let r = ctl(&s.addr, args).await;
        assert_eq!(r.code, 2, "{args:?}: {}", r.stderr);
        assert!(r.stderr.starts_with(want), "{args:?}: {}", r.stderr);
    }
    assert_eq!(
        s.fake.calls.load(Ordering::SeqCst),
        before,
        "nothing was sent for bad input"
    );
    let r = ctl(&s.addr, &["sandbox", "network", "missing", "pypi"]).await;
    assert_eq!(
        (r.code, r.stderr.as_str()),
        (
            1,
            "error: not_found: sandbox missing not found
"
        )
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_checks_input_before_calling() {
    let s = start().await;
    let r = ctl(
        &s.addr,
        &[
            "sandbox",
            "create",
            "-image",
            "root/py:3.12",
            "-backend",
            "container",
            "-ttl-idle",
            "-1",
            "-net",
            "pypi,192.0.2.0/24:443/tcp,!npm",
        ],
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    let v = r.json();
    assert_eq!(v["id"], "edge-1.new");
    let sent = s.fake.last_create.lock().unwrap().clone().unwrap();
    let spec = sent.spec.unwrap();
    assert_eq!(
        (
            spec.backend.as_str(),
            spec.cpu_cores_limit,
            spec.memory_limit_mb,
            spec.ttl_running_stop
        ),
        ("container", 1.0, 1024, -1)
    );
    assert_eq!(sent.project, "root");
    assert!(!sent.idempotency_key.is_empty());
    assert_eq!(
        spec.network_rules,
        [
            ("pypi".to_string(), true),
            ("192.0.2.0/24:443/tcp".to_string(), true),
            ("npm".to_string(), false)
        ]
        .into()
    );

    let before = s.fake.calls.load(Ordering::SeqCst);
    for (args, want) in [
        (
            &["sandbox", "create", "-net", "pypi,,npm"][..],
            "error: invalid: -net: bad rule \"\"",
        ),
        (
            &["sandbox", "create", "-net", "pypi,x.io:70000"],
            "error: invalid: -net: network rule \"x.io:70000\": port outside 1-65535",
        ),
        (
            &["sandbox", "create", "-gpus", "1"],
            "error: invalid: -gpus 1: GPU sandboxes are not built yet",
        ),
        (
            &["sandbox", "create", "-mem", "lots"],
            "error: invalid: -mem: \"lots\" is not a whole number",
        ),
        (
            &["sandbox", "create", "-backend", "docker"],
            "error: invalid: -backend",
        ),
        (
            &["sandbox", "create", "-backend", "container"],
            "error: invalid: -image is required for backend container",
        ),
        (
            &["sandbox", "create", "-count", "0"],
            "error: invalid: -count",
        ),
        (
            &["sandbox", "fork", "edge-1.a", "-count", "0"],
            "error: invalid: -count",
        ),
        (
            &["sandbox", "fork", "edge-1.a", "-count", "257"],
            "error: invalid: -count",
        ),
        (
            &["sandbox", "fork", "edge-1.a", "-label", "novalue"],
            "error: invalid: -label",
        ),
        (
            &["project", "create", "root", "team-a", "-quota", "disk_gb=5"],
            "error: invalid: -quota: unknown key \"disk_gb\"",
        ),
        (
            &["grant", "root", "trainer", "sandbox.fly"],
            "error: invalid: unknown permission",
        ),
        (&["usage", "-from", "2026-13-01"], "error: invalid: -from"),
        (
            &["-deadline", "soon", "whoami"],
            "error: invalid: -deadline",
        ),
    ] {
        let r = ctl(&s.addr, args).await;
        // A value that does not parse or is not allowed is a usage error (docs/cli.md).
        assert_eq!(r.code, 2, "{args:?}: {}", r.stderr);
        assert!(r.stderr.starts_with(want), "{args:?}: {}", r.stderr);
    }
    assert_eq!(
        s.fake.calls.load(Ordering::SeqCst),
        before,
        "a bad input reached the server"
    );

    // Usage errors exit 2.
    let r = ctl(&s.addr, &["sandbox", "create", "-bogus", "1"]).await;
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr
            .starts_with("error: invalid: Unrecognized argument: -bogus"),
        "{}",
        r.stderr
    );
    let r = ctl(&s.addr, &["sandbox", "get"]).await;
    assert_eq!(r.code, 2, "{}", r.stderr);
    // Help exits 0 on stdout, in single-dash style.
    let r = ctl(&s.addr, &["sandbox", "create", "help"]).await;
    assert_eq!(r.code, 0);
    assert!(
        r.out().contains("-ttl-idle") && !r.out().contains("--ttl-idle"),
        "{}",
        r.out()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fork_prints_copies_in_index_order_and_sends_the_copies_settings() {
    let s = start().await;
    let r = ctl(
        &s.addr,
        &[
            "sandbox",
            "fork",
            "edge-1.a",
            "-count",
            "3",
            "-task",
            "t2",
            "-ttl-idle",
            "30",
            "-ttl-max",
            "600",
            "-label",
            "a=b",
            "-label",
            "c=",
        ],
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    let out = r.out();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        &lines[..3],
        &["0\tedge-1.f0", "1\tedge-1.f1", "2\tedge-1.f2"]
    );
    assert!(lines[3].starts_with("created 3/3 in "), "{out}");
    let sent = s.fake.last_fork.lock().unwrap().clone().unwrap();
    assert_eq!(
        (sent.id.as_str(), sent.count, sent.task_id.as_str()),
        ("edge-1.a", 3, "t2")
    );
    assert_eq!((sent.ttl_running_stop, sent.ttl_max), (30, 600));
    assert_eq!(sent.labels.get("a").map(String::as_str), Some("b"));
    assert_eq!(sent.labels.get("c").map(String::as_str), Some(""));
    assert!(
        sent.idempotency_key.starts_with("ctl-"),
        "{}",
        sent.idempotency_key
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_lines_in_index_order_and_summary() {
    let s = start().await;
    let r = ctl(
        &s.addr,
        &[
            "sandbox", "create", "-count", "5", "-backend", "sim", "-task", "job-1",
        ],
    )
    .await;
    assert_eq!(r.code, 1, "{}", r.stderr);
    let out = r.out();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        &lines[..5],
        &[
            "0\tedge-1.b0",
            "1\terror\tquota_exceeded: project root: sandboxes",
            "2\tedge-1.b2",
            "3\terror\tno_capacity: every edge is full",
            "4\tedge-1.b4",
        ]
    );
    assert_eq!(lines.len(), 6, "{out}");
    assert!(lines[5].starts_with("created 3/5 in "), "{}", lines[5]);
    assert!(
        lines[5].ends_with("; failures: map[no_capacity:1 quota_exceeded:1]"),
        "{}",
        lines[5]
    );

    // All good: exit 0.
    let r = ctl(&s.addr, &["sandbox", "create", "-count", "1"]).await;
    assert_eq!(r.code, 0);
    let r = ctl(&s.addr, &["sandbox", "create", "-count", "2"]).await;
    assert_eq!(r.code, 1, "index 1 always fails in the fake");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_streams_quotes_and_passes_exit_codes() {
    let s = start().await;
    let r = ctl(
        &s.addr,
        &["exec", "edge-1.a", "python3", "-c", "print(6*7)"],
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.out(), "python3 -c 'print(6*7)'\n");
    let shell = s.fake.last_shell.lock().unwrap().clone().unwrap();
    assert_eq!(
        (shell.session.as_str(), shell.sandbox_id.as_str()),
        ("default", "edge-1.a")
    );
    assert!(!shell.request_id.is_empty());

    // One argument is a whole shell command, sent as is; -- protects the command's options.
    let r = ctl(
        &s.addr,
        &[
            "exec",
            "edge-1.a",
            "-session",
            "s2",
            "-user",
            "1000",
            "--",
            "ls",
            "-la",
            "it's here",
        ],
    )
    .await;
    assert_eq!(r.out(), "ls -la 'it'\\''s here'\n");
    let shell = s.fake.last_shell.lock().unwrap().clone().unwrap();
    assert_eq!(
        (shell.session.as_str(), shell.user.as_str()),
        ("s2", "1000")
    );
    let r = ctl(&s.addr, &["exec", "edge-1.a", "cd /srv && make | tail"]).await;
    assert_eq!(r.out(), "cd /srv && make | tail\n");

    let r = ctl(&s.addr, &["exec", "edge-1.a", "run fail7"]).await;
    assert_eq!(r.code, 7);
    assert_eq!(r.stderr, "it failed\n");

    let r = ctl(&s.addr, &["exec", "edge-1.a", "run oom"]).await;
    assert_eq!(r.code, 137);
    assert_eq!(
        r.stderr,
        "opendsecctl: the sandbox's OOM killer ended a process of the command (memory_limit_mb)\n"
    );

    let r = ctl(&s.addr, &["exec", "edge-1.a", "-timeout", "2", "slow"]).await;
    assert_eq!(r.code, 124);
    assert_eq!(r.stderr, "opendsecctl: command timed out\n");
    assert_eq!(
        s.fake.last_shell.lock().unwrap().clone().unwrap().timeout,
        2.0
    );

    // A stream broken by `unavailable` resumes from where it was; nothing is repeated.
    let r = ctl(&s.addr, &["exec", "edge-1.a", "flaky output fail7"]).await;
    assert_eq!(r.code, 7, "{}", r.stderr);
    assert_eq!(r.out(), "flaky output fail7\n");
    assert_eq!(r.stderr, "it failed\n");

    // Output past the recorded limit is said to be missing; the exit code is the command's.
    let r = ctl(&s.addr, &["exec", "edge-1.a", "flood"]).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.out(), "flood\n");
    assert!(
        r.stderr
            .contains("5000 bytes of output past the first 64 MB of a stream were dropped"),
        "{}",
        r.stderr
    );

    let r = ctl(&s.addr, &["exec", "missing"]).await;
    assert_eq!(r.code, 2);
    assert!(
        r.stderr.starts_with("error: invalid: exec needs a command"),
        "{}",
        r.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cp_both_ways_byte_for_byte() {
    let s = start().await;
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("blob.bin");
    let data: Vec<u8> = (0..3_000_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(&src, &data).unwrap();
    std::fs::set_permissions(&src, std::fs::Permissions::from_mode(0o750)).unwrap();

    let r = ctl(&s.addr, &["cp", src.to_str().unwrap(), "edge-1.a:/data/"]).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json()["path"], "/data/blob.bin");
    let (stored, mode) = s
        .fake
        .files
        .lock()
        .unwrap()
        .get("edge-1.a:/data/blob.bin")
        .cloned()
        .unwrap();
    assert!(stored == data, "upload changed the bytes");
    assert_eq!(mode, 0o750);

    let back = dir.path().join("back.bin");
    let r = ctl(
        &s.addr,
        &["cp", "edge-1.a:/data/blob.bin", back.to_str().unwrap()],
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        std::fs::read(&back).unwrap() == data,
        "download changed the bytes"
    );

    // Into a directory: the sandbox file's name is kept. `-` is stdin/stdout.
    let sub = dir.path().join("sub");
    std::fs::create_dir(&sub).unwrap();
    let r = ctl(
        &s.addr,
        &["cp", "edge-1.a:/data/blob.bin", sub.to_str().unwrap()],
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(std::fs::read(sub.join("blob.bin")).unwrap() == data);
    let r = ctl_env(
        &s.addr,
        TOKEN,
        &["cp", "-", "edge-1.a:/in.txt"],
        Some(b"from stdin\x00\xff"),
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    let r = ctl(&s.addr, &["cp", "edge-1.a:/in.txt", "-"]).await;
    assert_eq!(r.stdout, b"from stdin\x00\xff");

    let r = ctl(&s.addr, &["cp", "edge-1.a:/nope", back.to_str().unwrap()]).await;
    assert_eq!(
        (r.code, r.stderr.as_str()),
        (1, "error: not_found: /nope: no such file\n")
    );

    // Over 64 MB is refused before anything is sent (a sparse file costs no disk).
    let big = dir.path().join("big.bin");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(64 * 1024 * 1024 + 1)
        .unwrap();
    let before = s.fake.calls.load(Ordering::SeqCst);
    let r = ctl(&s.addr, &["cp", big.to_str().unwrap(), "edge-1.a:/big.bin"]).await;
    assert_eq!(r.code, 1);
    assert!(r.stderr.starts_with("error: invalid: "), "{}", r.stderr);
    assert_eq!(s.fake.calls.load(Ordering::SeqCst), before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn iam_backup_is_private_and_restore_sends_it() {
    let s = start().await;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("iam.json.gz");
    let r = ctl(&s.addr, &["iam", "backup", "-out", out.to_str().unwrap()]).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(std::fs::read(&out).unwrap(), BACKUP);
    assert_eq!(
        std::fs::metadata(&out).unwrap().permissions().mode() & 0o777,
        0o600
    );

    // Restore needs a whole gzip file; a real one goes through unchanged.
    let r = ctl(&s.addr, &["iam", "restore", out.to_str().unwrap()]).await;
    assert_eq!(r.code, 1);
    assert!(r.stderr.starts_with("error: invalid: "), "{}", r.stderr);
    let good = dir.path().join("good.json.gz");
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    std::io::Write::write_all(&mut enc, br#"{"principals":[]}"#).unwrap();
    let gz = enc.finish().unwrap();
    std::fs::write(&good, &gz).unwrap();
    let r = ctl(&s.addr, &["iam", "restore", good.to_str().unwrap()]).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(s.fake.restored.lock().unwrap().clone().unwrap(), gz);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_from_a_dead_address_and_tls_refusal() {
    let s = start().await;
    // A port nothing listens on: bound, then closed.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let both = format!("{dead},{}", s.addr);
    let r = ctl(&both, &["whoami"]).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json()["principal"], "admin");
    let r = ctl(&both, &["sandbox", "create", "-count", "5"]).await;
    assert_eq!(r.out().lines().count(), 6, "{}", r.stderr);

    let r = ctl(&dead, &["whoami"]).await;
    assert_eq!(r.code, 1);
    assert!(
        r.stderr
            .starts_with(&format!("error: unavailable: {dead}: ")),
        "{}",
        r.stderr
    );

    // A CA file that is not there: refused before any call.
    let missing = tempfile::tempdir().unwrap().path().join("ca.crt");
    let r = ctl(&s.addr, &["whoami", "-ca", missing.to_str().unwrap()]).await;
    assert_eq!(r.code, 1);
    assert!(
        r.stderr
            .starts_with(&format!("error: not_found: -ca {}: ", missing.display())),
        "{}",
        r.stderr
    );
    // A real CA against this plaintext server: the TLS handshake fails, as `unavailable`.
    let pki = tempfile::tempdir().unwrap();
    opendsec::pki::Ca::generate(30)
        .unwrap()
        .save(pki.path())
        .unwrap();
    let ca = pki.path().join("ca.crt");
    let r = ctl(&s.addr, &["whoami", "-ca", ca.to_str().unwrap()]).await;
    assert_eq!(r.code, 1);
    assert!(
        r.stderr
            .starts_with(&format!("error: unavailable: {}: ", s.addr)),
        "{}",
        r.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn iam_commands_tasks_and_usage() {
    let s = start().await;
    let r = ctl(
        &s.addr,
        &[
            "project",
            "create",
            "root",
            "team-a",
            "-quota",
            "sandboxes=1000,cpu_cores=4000,memory_mb=4096000",
        ],
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json()["path"], "root/team-a");
    let sent = s.fake.last_project.lock().unwrap().clone().unwrap();
    assert_eq!(sent.quota.get("cpu_cores"), Some(&4000.0));
    assert_eq!(sent.quota.len(), 3);
    let r = ctl(&s.addr, &["project", "get", "-project", "root/x"]).await;
    assert_eq!(r.json()["path"], "root/x");
    let r = ctl(&s.addr, &["project", "delete", "root/team-a"]).await;
    assert_eq!(
        (r.code, r.stderr.as_str()),
        (1, "error: conflict: project root/team-a has subprojects\n")
    );

    let r = ctl(
        &s.addr,
        &[
            "principal",
            "create",
            "root/team-a",
            "trainer",
            "-kind",
            "service",
            "-ttl",
            "3600",
        ],
    )
    .await;
    let v = r.json();
    assert_eq!(v["token"], "dsk.trainer.t1.s3cret");
    assert_eq!(v["token_info"]["description"], "service");
    assert_eq!(v["token_info"]["expires_at"], "3600");
    let r = ctl(
        &s.addr,
        &[
            "principal",
            "create",
            "root/team-a",
            "trainer",
            "-kind",
            "robot",
        ],
    )
    .await;
    assert_eq!(r.code, 2);
    let r = ctl(&s.addr, &["principal", "delete", "trainer"]).await;
    assert_eq!((r.code, r.out().trim()), (0, "{}"));

    let r = ctl(
        &s.addr,
        &[
            "grant",
            "root/team-a",
            "trainer",
            "sandbox.create,sandbox.operate",
        ],
    )
    .await;
    assert_eq!(
        r.json()["policies"]["trainer"]["permissions"],
        serde_json::json!(["sandbox.create", "sandbox.operate"])
    );
    let r = ctl(&s.addr, &["revoke", "root/team-a", "trainer"]).await;
    assert_eq!(r.json()["policies"]["trainer"], serde_json::json!({}));

    let r = ctl(
        &s.addr,
        &["token", "create", "-desc", "gpu-node-07", "-ttl", "60"],
    )
    .await;
    assert_eq!(r.json()["info"]["principal"], "admin");
    assert_eq!(r.json()["info"]["description"], "gpu-node-07");
    let r = ctl(&s.addr, &["token", "list", "trainer"]).await;
    assert_eq!(r.json()["tokens"][0]["principal"], "trainer");
    let r = ctl(&s.addr, &["token", "revoke", "trainer", "nope"]).await;
    assert_eq!(
        (r.code, r.stderr.as_str()),
        (1, "error: not_found: token nope not found\n")
    );

    let r = ctl(
        &s.addr,
        &["task", "stop", "job-1", "-project", "root/team-a"],
    )
    .await;
    let v = r.json();
    assert_eq!(
        (v["affected"].as_str(), v["failed"].as_str()),
        (Some("2"), Some("1"))
    );
    assert!(v["errors"][0]
        .as_str()
        .unwrap()
        .ends_with("(task job-1 in root/team-a)"));
    let r = ctl(&s.addr, &["task", "pause", "job-1"]).await;
    assert_eq!(
        r.json(),
        serde_json::json!({"affected": "0", "failed": "0"})
    );

    let r = ctl(
        &s.addr,
        &[
            "usage",
            "root/team-a",
            "-from",
            "2026-10-01",
            "-to",
            "2026-10-31",
            "-csv",
        ],
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(
        r.out(),
        "day,project,sandboxes_started,sandbox_hours,cpu_core_hours,memory_gb_hours,gpu_hours\n\
         total,root/team-a,3,1.5,3,6,0\n\
         total,root/b,1,0.25,0.5,1,0\n"
    );
    let r = ctl(&s.addr, &["usage", "-from", "2026-10-01", "-daily"]).await;
    let out = r.out();
    let lines: Vec<&str> = out.lines().collect();
    assert!(
        lines[0].starts_with("day ") && lines[0].ends_with("gpu_hours"),
        "{out}"
    );
    assert!(lines[1].starts_with("2026-10-01  root "), "{out}");

    let r = ctl(&s.addr, &["version"]).await;
    assert_eq!(r.out(), format!("opendsec {}\n", opendsec::VERSION));
}

/// `sandbox port-forward ID LOCAL:REMOTE`: listens, prints where, and carries each local
/// connection through one ConnectPort call both ways, half-close included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_port_forward_carries_a_connection_both_ways() {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
    let s = start().await;
    for (bad, says) in [
        ("8080", "is not two ports joined by ':'"),
        ("8080:0", "REMOTE"),
        ("70000:80", "LOCAL"),
    ] {
        let r = ctl(&s.addr, &["sandbox", "port-forward", "edge-1.abc", bad]).await;
        assert_eq!(r.code, 2, "{bad}: {}", r.stderr);
        assert!(r.stderr.contains(says), "{bad}: {}", r.stderr);
    }
    // An unknown sandbox: not_found before anything listens (the command ends).
    let r = ctl(&s.addr, &["sandbox", "port-forward", "missing", "0:8000"]).await;
    assert_eq!(
        (r.code, r.stderr.as_str(), r.stdout.len()),
        (1, "error: not_found: sandbox missing not found\n", 0)
    );
    let r = ctl(
        &s.addr,
        &["sandbox", "port-forward", "edge-1.stopped", "0:8000"],
    )
    .await;
    assert_eq!(
        (r.code, r.stderr.as_str(), r.stdout.len()),
        (1, "error: conflict: sandbox edge-1.stopped is STOPPED\n", 0)
    );
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_opendsec"))
        .args(["ctl", "sandbox", "port-forward", "edge-1.abc", "0:8000"])
        .env_remove("OPENDSEC_CA")
        .env_remove("OPENDSEC_PROJECT")
        .env("OPENDSEC_ADDR", &s.addr)
        .env("OPENDSEC_TOKEN", TOKEN)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let line = lines.next_line().await.unwrap().unwrap();
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["sandbox"], "edge-1.abc");
    assert_eq!(v["port"], 8000);
    let local: std::net::SocketAddr = v["local"].as_str().unwrap().parse().unwrap();
    assert!(local.ip().is_loopback() && local.port() != 0, "{local}");
    for _ in 0..2 {
        let mut c = tokio::net::TcpStream::connect(local).await.unwrap();
        c.write_all(b"hello through the sandbox").await.unwrap();
        let mut buf = [0u8; 25];
        c.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"hello through the sandbox");
        // Half-close: our eof travels, theirs comes back, and the connection ends.
        c.shutdown().await.unwrap();
        let mut rest = Vec::new();
        c.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty(), "{rest:?}");
    }
    let first = s.fake.last_port.lock().unwrap().clone().unwrap();
    assert_eq!(
        (first.sandbox_id.as_str(), first.port),
        ("edge-1.abc", 8000)
    );
    child.kill().await.unwrap();
}
