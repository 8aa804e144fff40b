//! The public `DSec` service: authentication, the per-principal call rate, auditing and
//! metrics around every call, then the call itself (create, lifecycle, runtime, IAM).

use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use futures::Stream;
use tonic::{Request, Response, Status};

use super::audit::{command_digest, Record};
use super::auth::Caller;
use super::create;
use super::Inner;
use crate::pb;
use crate::rpc::{client, failure_from_status, to_status};
use crate::types::{names, Failure, Reason};

pub(crate) struct Api {
    pub inner: Arc<Inner>,
}

pub(crate) type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

fn st(f: Failure) -> Status {
    to_status(&f)
}

/// What one call leaves in the audit log and the metrics.
pub(crate) struct Call {
    method: &'static str,
    started: Instant,
    caller: Option<Caller>,
    client: String,
    pub project: String,
    pub sandbox_id: String,
    pub cmd: Option<(usize, String)>,
    pub count: Option<u32>,
    audited: bool,
}

impl Api {
    /// Authenticates the caller and takes one token of its call rate.
    async fn begin<T>(
        &self,
        req: &Request<T>,
        method: &'static str,
        audited: bool,
    ) -> Result<(Caller, Call), Status> {
        self.begin_as(req, method, audited, false).await
    }

    /// [`Self::begin`] for the calls a sandbox access token may make (`grants`: the runtime
    /// calls and `GetSandbox`, each then held to the token's sandbox by
    /// `authorize_sandbox`); every other call refuses one with `forbidden`.
    async fn begin_as<T>(
        &self,
        req: &Request<T>,
        method: &'static str,
        audited: bool,
        grants: bool,
    ) -> Result<(Caller, Call), Status> {
        let client = self.inner.auth.client_addr(req);
        let mut call = Call {
            method,
            started: Instant::now(),
            caller: None,
            client: client.clone(),
            project: String::new(),
            sandbox_id: String::new(),
            cmd: None,
            count: None,
            audited,
        };
        let token = crate::rpc::bearer(req);
        let caller = match self.inner.auth.authenticate(&token, &client).await {
            Ok(c) => c,
            Err(f) => return Err(self.fail(call, f)),
        };
        call.caller = Some(caller.clone());
        tracing::Span::current().record("principal", caller.principal.as_str());
        // A sandbox access token spends its sandbox creator's call rate, so a caller with
        // many sandboxes gets no more calls through their tokens than by itself. A token
        // whose sandbox is gone is limited on its own: its calls fail anyway.
        let limited_as = match &caller.grant {
            Some(id) => match self.inner.owner_of(id).await {
                Ok(o) if !o.principal.is_empty() => o.principal,
                _ => caller.principal.clone(),
            },
            None => caller.principal.clone(),
        };
        if let Err(wait) = self.inner.calls.try_take(&limited_as, 1.0) {
            let f = Failure::new(
                Reason::RateLimited,
                format!(
                    "principal {limited_as:?} is over its call rate (admission.request_rate); retry in {} ms",
                    wait.as_millis()
                ),
            );
            return Err(self.fail(call, f));
        }
        // After the rate limit, so refused calls are throttled as any other.
        if caller.grant.is_some() && !grants {
            return Err(self.fail(call, super::auth::grant_only()));
        }
        Ok((caller, call))
    }

    /// `finish` for a call that failed before it got anywhere: the converted error.
    fn fail(&self, call: Call, f: Failure) -> Status {
        let Err(s) = self.finish(call, Err::<std::convert::Infallible, _>(f));
        s
    }

    /// Records the call's outcome (metrics; audit when enabled) and converts the error.
    fn finish<T>(&self, call: Call, r: Result<T, Failure>) -> Result<T, Status> {
        let reason = match &r {
            Ok(_) => "ok",
            Err(f) => f.reason.as_str(),
        };
        let secs = call.started.elapsed().as_secs_f64();
        let span = tracing::Span::current();
        if !call.project.is_empty() {
            span.record("project", call.project.as_str());
        }
        if !call.sandbox_id.is_empty() {
            span.record("sandbox_id", call.sandbox_id.as_str());
        }
        tracing::debug!(reason, duration_ms = secs * 1000.0, "call done");
        metrics::counter!("opendsec_rpc_server_handled_total", "role" => "apiserver", "method" => call.method, "reason" => reason).increment(1);
        metrics::histogram!("opendsec_rpc_server_handling_seconds", "role" => "apiserver", "method" => call.method).record(secs);
        if let Some(a) = &self.inner.audit {
            if call.audited || self.inner.audit_runtime {
                let principal = call
                    .caller
                    .as_ref()
                    .map(|c| c.principal.as_str())
                    .unwrap_or("");
                a.write(&Record {
                    ts: crate::types::now_f(),
                    method: call.method,
                    principal,
                    client: &call.client,
                    project: &call.project,
                    sandbox_id: &call.sandbox_id,
                    reason,
                    duration_ms: secs * 1000.0,
                    cmd_len: call.cmd.as_ref().map(|c| c.0),
                    cmd_sha256: call.cmd.map(|c| c.1),
                    count: call.count,
                });
            }
        }
        r.map_err(st)
    }

    /// A lifecycle call (`op`: get, stop, pause, resume, touch) on one sandbox.
    async fn on_sandbox(
        &self,
        req: Request<pb::SandboxRef>,
        method: &'static str,
        audited: bool,
        op: &str,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let (caller, mut call) = self
            .begin_as(&req, method, audited, method == "GetSandbox")
            .await?;
        let id = req.into_inner().id;
        call.sandbox_id = id.clone();
        let r = self.inner.lifecycle(&caller, &id, op).await;
        self.finish(call, r).map(Response::new)
    }

    /// A task action (`action`: pause, resume, stop) over every edge.
    async fn on_task(
        &self,
        req: Request<pb::TaskRequest>,
        method: &'static str,
        action: &str,
    ) -> Result<Response<pb::TaskActionResult>, Status> {
        let (caller, mut call) = self.begin(&req, method, true).await?;
        let msg = req.into_inner();
        call.project = msg.project.clone();
        let r = self.inner.task_action(&caller, msg, action).await;
        self.finish(call, r).map(Response::new)
    }

    fn project_or_default(p: &str) -> Result<String, Failure> {
        let p = if p.is_empty() { "root" } else { p };
        names::check_project_path(p)?;
        Ok(p.to_string())
    }

    async fn create_one(
        &self,
        caller: &Caller,
        req: pb::CreateSandboxRequest,
    ) -> Result<pb::Sandbox, Failure> {
        let project = Self::project_or_default(&req.project)?;
        let spec = super::admission::normalize_spec(
            &req.spec.unwrap_or_default(),
            &self.inner.cfg.admission,
            &self.inner.net_rules,
        )?;
        if req.idempotency_key.len() > 256 {
            return Err(Failure::invalid(
                "idempotency_key longer than 256 characters",
            ));
        }
        if let Err(wait) = self.inner.creates.try_take(&caller.principal, 1.0) {
            return Err(Failure::new(Reason::RateLimited, format!("principal {:?} is over its creation rate (admission.create_rate); retry in {} ms", caller.principal, wait.as_millis())));
        }
        let _permit = match &self.inner.inflight {
            Some(sem) => Some(sem.clone().try_acquire_owned().map_err(|_| Failure::new(Reason::RateLimited, "too many creations in flight on this apiserver (admission.max_inflight_creates)"))?),
            None => None,
        };
        let key = if req.idempotency_key.is_empty() {
            hex::encode(rand::random::<[u8; 16]>())
        } else {
            req.idempotency_key.clone()
        };
        let items = create::items(caller, &project, &key, 0..1);
        let started = Instant::now();
        let job = create::Job {
            caller,
            project: &project,
            spec: &spec,
            fork: None,
        };
        let r = match self.inner.create_items(&job, items).await {
            Err(f) => Err(f),
            Ok(mut v) => match v.pop() {
                Some((_, r)) => r,
                None => Err(Failure::internal("creation produced no result")),
            },
        };
        let reason = r
            .as_ref()
            .map(|_| "ok")
            .unwrap_or_else(|f| f.reason.as_str());
        metrics::histogram!("opendsec_apiserver_create_seconds", "reason" => reason)
            .record(started.elapsed().as_secs_f64());
        r
    }
}

// async_trait does not see inside macro_rules expansions, so the macros spell out the
// signature it would have produced.
type Fut<'a, T> =
    Pin<Box<dyn std::future::Future<Output = Result<Response<T>, Status>> + Send + 'a>>;

macro_rules! runtime_unary {
    ($name:ident, $method:literal, $req:ty, $resp:ty $(, $cmd:ident)?) => {
        fn $name<'life0, 'async_trait>(&'life0 self, req: Request<$req>) -> Fut<'async_trait, $resp>
        where
            'life0: 'async_trait,
            Self: 'async_trait,
        {
            Box::pin(async move {
                let (caller, mut call) = self.begin_as(&req, $method, false, true).await?;
                let msg = req.into_inner();
                call.sandbox_id = msg.sandbox_id.clone();
                // Commands are audited as their length and digest, never their text.
                $(call.cmd = Some(command_digest(&msg.$cmd));)?
                let r = async {
                    let addr = self
                        .inner
                        .authorize_sandbox(&caller, &msg.sandbox_id)
                        .await?;
                    let mut c = self.inner.edges.runtime(&addr)?;
                    c.$name(self.inner.edges.req(msg))
                        .await
                        .map(|r| r.into_inner())
                        .map_err(|s| failure_from_status(&s))
                }
                .await;
                self.finish(call, r).map(Response::new)
            })
        }
    };
}

macro_rules! runtime_stream {
    ($name:ident, $method:literal, $req:ty, $item:ty $(, $cmd:ident)?) => {
        fn $name<'life0, 'async_trait>(
            &'life0 self,
            req: Request<$req>,
        ) -> Fut<'async_trait, BoxStream<$item>>
        where
            'life0: 'async_trait,
            Self: 'async_trait,
        {
            Box::pin(async move {
                let (caller, mut call) = self.begin_as(&req, $method, false, true).await?;
                let msg = req.into_inner();
                call.sandbox_id = msg.sandbox_id.clone();
                // Commands are audited as their length and digest, never their text.
                $(call.cmd = Some(command_digest(&msg.$cmd));)?
                let r = async {
                    let addr = self
                        .inner
                        .authorize_sandbox(&caller, &msg.sandbox_id)
                        .await?;
                    let mut c = self.inner.edges.runtime(&addr)?;
                    c.$name(self.inner.edges.req(msg))
                        .await
                        .map(|r| r.into_inner())
                        .map_err(|s| failure_from_status(&s))
                }
                .await;
                let s = self.finish(call, r)?;
                Ok(Response::new(Box::pin(s) as BoxStream<$item>))
            })
        }
    };
}

/// A call passed on to the IAM service on the caller's behalf. The long form names the
/// method for metrics and the audit log, and runs `before` (an expression that may `.await`,
/// given the `Api`, the caller, the `Call` record and the request) first: its failure is the
/// call's, and IAM is not asked.
macro_rules! iam_call {
    ($name:ident, $iam:ident, $req:ty, $resp:ty, $audited:expr) => {
        iam_call!(
            $name,
            stringify!($name),
            $iam,
            $req,
            $resp,
            $audited,
            before(_api, _caller, _call, _msg) => Ok(())
        );
    };
    (
        $name:ident,
        $method:expr,
        $iam:ident,
        $req:ty,
        $resp:ty,
        $audited:expr,
        before($api:ident, $caller:ident, $call:ident, $msg:ident) => $before:expr
    ) => {
        fn $name<'life0, 'async_trait>(&'life0 self, req: Request<$req>) -> Fut<'async_trait, $resp>
        where
            'life0: 'async_trait,
            Self: 'async_trait,
        {
            Box::pin(async move {
                let (caller, mut call) = self.begin(&req, $method, $audited).await?;
                let msg = req.into_inner();
                let before: Result<(), Failure> = {
                    let ($api, $caller, $call, $msg) = (self, &caller, &mut call, &msg);
                    $before
                };
                let r = match before {
                    Err(f) => Err(f),
                    Ok(()) => self
                        .inner
                        .iam
                        .clone()
                        .$iam(client::on_behalf(
                            msg,
                            &self.inner.cfg.service_token,
                            &caller.token,
                            &caller.client_addr,
                        ))
                        .await
                        .map(|r| r.into_inner())
                        .map_err(|s| failure_from_status(&s)),
                };
                self.finish(call, r).map(Response::new)
            })
        }
    };
}

#[tonic::async_trait]
impl pb::d_sec_server::DSec for Api {
    async fn create_sandbox(
        &self,
        req: Request<pb::CreateSandboxRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let (caller, mut call) = self.begin(&req, "CreateSandbox", true).await?;
        let msg = req.into_inner();
        call.project = msg.project.clone();
        let r = self.create_one(&caller, msg).await;
        if let Ok(sb) = &r {
            call.sandbox_id = sb.id.clone();
        }
        self.finish(call, r).map(Response::new)
    }

    type CreateSandboxesStream = BoxStream<pb::CreateSandboxesItem>;

    async fn create_sandboxes(
        &self,
        req: Request<pb::CreateSandboxesRequest>,
    ) -> Result<Response<Self::CreateSandboxesStream>, Status> {
        let (caller, mut call) = self.begin(&req, "CreateSandboxes", true).await?;
        let msg = req.into_inner();
        call.project = msg.project.clone();
        call.count = Some(msg.count);
        let prep = (|| {
            if msg.count == 0 || msg.count > 32768 {
                return Err(Failure::invalid(format!(
                    "count {} must be within 1..32768",
                    msg.count
                )));
            }
            if msg.idempotency_key.len() > 256 {
                return Err(Failure::invalid(
                    "idempotency_key longer than 256 characters",
                ));
            }
            let project = Self::project_or_default(&msg.project)?;
            let spec = super::admission::normalize_spec(
                &msg.spec.clone().unwrap_or_default(),
                &self.inner.cfg.admission,
                &self.inner.net_rules,
            )?;
            Ok((project, spec))
        })();
        let (project, spec) = self.finish(call, prep)?;
        let key = if msg.idempotency_key.is_empty() {
            hex::encode(rand::random::<[u8; 16]>())
        } else {
            msg.idempotency_key.clone()
        };
        let items = create::items(&caller, &project, &key, 0..msg.count);
        let (tx, rx) = tokio::sync::mpsc::channel(1024);
        tokio::spawn(create::run_batch(
            self.inner.clone(),
            caller,
            project,
            spec,
            None,
            items,
            tx,
        ));
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn get_sandbox(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        self.on_sandbox(req, "GetSandbox", false, "get").await
    }

    async fn list_sandboxes(
        &self,
        req: Request<pb::ListSandboxesRequest>,
    ) -> Result<Response<pb::ListSandboxesResponse>, Status> {
        let (caller, mut call) = self.begin(&req, "ListSandboxes", false).await?;
        let msg = req.into_inner();
        call.project = msg.project.clone();
        let r = self.inner.list(&caller, msg).await;
        self.finish(call, r).map(Response::new)
    }

    async fn stop_sandbox(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        self.on_sandbox(req, "StopSandbox", true, "stop").await
    }

    async fn pause_sandbox(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        self.on_sandbox(req, "PauseSandbox", true, "pause").await
    }

    async fn resume_sandbox(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        self.on_sandbox(req, "ResumeSandbox", true, "resume").await
    }

    async fn touch_sandbox(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        self.on_sandbox(req, "TouchSandbox", false, "touch").await
    }

    async fn set_sandbox_timeout(
        &self,
        req: Request<pb::SetSandboxTimeoutRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let (caller, mut call) = self.begin(&req, "SetSandboxTimeout", true).await?;
        let msg = req.into_inner();
        call.sandbox_id = msg.id.clone();
        let r = self.inner.set_timeout(&caller, msg).await;
        self.finish(call, r).map(Response::new)
    }

    async fn update_network(
        &self,
        req: Request<pb::UpdateNetworkRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let (caller, mut call) = self.begin(&req, "UpdateNetwork", true).await?;
        let msg = req.into_inner();
        call.sandbox_id = msg.id.clone();
        let r = self.inner.update_network(&caller, msg).await;
        self.finish(call, r).map(Response::new)
    }

    async fn pause_task(
        &self,
        req: Request<pb::TaskRequest>,
    ) -> Result<Response<pb::TaskActionResult>, Status> {
        self.on_task(req, "PauseTask", "pause").await
    }

    async fn resume_task(
        &self,
        req: Request<pb::TaskRequest>,
    ) -> Result<Response<pb::TaskActionResult>, Status> {
        self.on_task(req, "ResumeTask", "resume").await
    }

    async fn stop_task(
        &self,
        req: Request<pb::TaskRequest>,
    ) -> Result<Response<pb::TaskActionResult>, Status> {
        self.on_task(req, "StopTask", "stop").await
    }

    runtime_unary!(
        run_shell,
        "RunShell",
        pb::RunShellRequest,
        pb::ShellResult,
        cmd
    );
    runtime_unary!(
        get_output,
        "GetOutput",
        pb::GetOutputRequest,
        pb::ShellResult
    );

    type StreamShellStream = BoxStream<pb::ShellChunk>;

    runtime_stream!(
        stream_shell,
        "StreamShell",
        pb::RunShellRequest,
        pb::ShellChunk,
        cmd
    );
    type StreamOutputStream = BoxStream<pb::ShellChunk>;
    runtime_stream!(
        stream_output,
        "StreamOutput",
        pb::GetOutputRequest,
        pb::ShellChunk
    );
    runtime_unary!(
        list_sessions,
        "ListSessions",
        pb::ListSessionsRequest,
        pb::ListSessionsResponse
    );
    runtime_unary!(
        close_session,
        "CloseSession",
        pb::CloseSessionRequest,
        pb::Empty
    );
    runtime_unary!(
        read_file,
        "ReadFile",
        pb::ReadFileRequest,
        pb::ReadFileResponse
    );
    runtime_unary!(write_file, "WriteFile", pb::WriteFileRequest, pb::FileInfo);
    runtime_unary!(list_dir, "ListDir", pb::PathRequest, pb::ListDirResponse);
    runtime_unary!(stat, "Stat", pb::PathRequest, pb::FileInfo);
    runtime_unary!(remove, "Remove", pb::RemoveRequest, pb::Empty);
    runtime_unary!(make_dir, "MakeDir", pb::PathRequest, pb::FileInfo);
    runtime_unary!(r#move, "Move", pb::MoveRequest, pb::FileInfo);
    runtime_unary!(http, "Http", pb::HttpRequest, pb::HttpResponse);
    type ConnectPortStream = BoxStream<pb::PortFrame>;
    /// Authorizes `sandbox.operate` on the sandbox the first frame names, then passes the
    /// frames on to its edge both ways (docs/network.md "Ports into a sandbox").
    async fn connect_port(
        &self,
        req: Request<tonic::Streaming<pb::PortFrame>>,
    ) -> Result<Response<Self::ConnectPortStream>, Status> {
        let (caller, mut call) = self.begin_as(&req, "ConnectPort", false, true).await?;
        let mut inbound = req.into_inner();
        let first = match crate::guest::port::first_frame(&mut inbound).await {
            Ok(f) => f,
            Err(s) => return Err(self.fail(call, failure_from_status(&s))),
        };
        call.sandbox_id = first.sandbox_id.clone();
        let r = async {
            crate::guest::port::port_of(&first)?;
            let addr = self
                .inner
                .authorize_sandbox(&caller, &first.sandbox_id)
                .await?;
            let mut c = self.inner.edges.runtime(&addr)?;
            c.connect_port(
                self.inner
                    .edges
                    .req(crate::guest::port::forward(first, inbound)),
            )
            .await
            .map(|r| r.into_inner())
            .map_err(|s| failure_from_status(&s))
        }
        .await;
        let s = self.finish(call, r)?;
        Ok(Response::new(Box::pin(s) as BoxStream<pb::PortFrame>))
    }
    type StartProcessStream = BoxStream<pb::ProcessEvent>;
    runtime_stream!(
        start_process,
        "StartProcess",
        pb::StartProcessRequest,
        pb::ProcessEvent
    );
    type ConnectProcessStream = BoxStream<pb::ProcessEvent>;
    runtime_stream!(
        connect_process,
        "ConnectProcess",
        pb::ConnectProcessRequest,
        pb::ProcessEvent
    );
    runtime_unary!(
        send_process_input,
        "SendProcessInput",
        pb::ProcessInputRequest,
        pb::Empty
    );
    runtime_unary!(
        close_process_input,
        "CloseProcessInput",
        pb::ProcessRef,
        pb::Empty
    );
    runtime_unary!(
        signal_process,
        "SignalProcess",
        pb::SignalProcessRequest,
        pb::Empty
    );
    runtime_unary!(
        resize_process_pty,
        "ResizeProcessPty",
        pb::ResizePtyRequest,
        pb::Empty
    );
    runtime_unary!(
        list_processes,
        "ListProcesses",
        pb::ListProcessesRequest,
        pb::ListProcessesResponse
    );
    type WatchDirStream = BoxStream<pb::FileEvent>;
    runtime_stream!(watch_dir, "WatchDir", pb::WatchDirRequest, pb::FileEvent);
    runtime_unary!(
        create_watcher,
        "CreateWatcher",
        pb::WatchDirRequest,
        pb::WatcherRef
    );
    runtime_unary!(
        get_watcher_events,
        "GetWatcherEvents",
        pb::WatcherRef,
        pb::WatcherEvents
    );
    runtime_unary!(remove_watcher, "RemoveWatcher", pb::WatcherRef, pb::Empty);

    iam_call!(who_am_i, who_am_i, pb::Empty, pb::WhoAmIResponse, false);
    iam_call!(
        create_project,
        create_project,
        pb::CreateProjectRequest,
        pb::Project,
        true
    );
    iam_call!(get_project, get_project, pb::ProjectRef, pb::Project, false);
    iam_call!(set_quota, set_quota, pb::SetQuotaRequest, pb::Project, true);
    // A project that still has images is not deleted (their manifests would be orphaned).
    iam_call!(
        delete_project,
        "DeleteProject",
        delete_project,
        pb::ProjectRef,
        pb::Empty,
        true,
        before(api, caller, call, msg) => {
            call.project = msg.project.clone();
            api.inner
                .check_project_has_no_images(caller, &msg.project)
                .await
        }
    );
    iam_call!(
        create_principal,
        create_principal,
        pb::CreatePrincipalRequest,
        pb::CreatePrincipalResponse,
        true
    );
    iam_call!(
        delete_principal,
        delete_principal,
        pb::PrincipalRef,
        pb::Empty,
        true
    );
    iam_call!(grant, grant, pb::GrantRequest, pb::Project, true);
    iam_call!(revoke, revoke, pb::GrantRequest, pb::Project, true);
    iam_call!(
        create_token,
        create_token,
        pb::CreateTokenRequest,
        pb::CreateTokenResponse,
        true
    );
    iam_call!(
        list_tokens,
        list_tokens,
        pb::PrincipalRef,
        pb::ListTokensResponse,
        false
    );
    iam_call!(
        revoke_token,
        revoke_token,
        pb::RevokeTokenRequest,
        pb::Empty,
        true
    );
    iam_call!(
        get_usage,
        get_usage,
        pb::GetUsageRequest,
        pb::UsageReport,
        false
    );
    iam_call!(iam_backup, backup, pb::Empty, pb::IamBackupResponse, true);
    iam_call!(iam_restore, restore, pb::IamRestoreRequest, pb::Empty, true);
    iam_call!(
        iam_members,
        members,
        pb::Empty,
        pb::IamMembersResponse,
        false
    );
    iam_call!(
        iam_member_add,
        member_add,
        pb::IamMemberAddRequest,
        pb::IamMembersResponse,
        true
    );
    iam_call!(
        iam_member_remove,
        member_remove,
        pb::IamMemberRemoveRequest,
        pb::IamMembersResponse,
        true
    );

    async fn cluster_status(
        &self,
        req: Request<pb::Empty>,
    ) -> Result<Response<pb::Snapshot>, Status> {
        let (_caller, call) = self.begin(&req, "ClusterStatus", false).await?;
        let snap = self.inner.snapshot.read().await.clone();
        self.finish(call, Ok((*snap).clone())).map(Response::new)
    }

    async fn register_image(
        &self,
        req: Request<pb::RegisterImageRequest>,
    ) -> Result<Response<pb::ImageInfo>, Status> {
        let (caller, mut call) = self.begin(&req, "RegisterImage", true).await?;
        let msg = req.into_inner();
        call.project = image_project(msg.image.as_ref().map_or("", |i| i.name.as_str()));
        let r = self.inner.register_image(&caller, msg).await;
        self.finish(call, r).map(Response::new)
    }

    async fn list_images(
        &self,
        req: Request<pb::ListImagesRequest>,
    ) -> Result<Response<pb::ListImagesResponse>, Status> {
        let (caller, mut call) = self.begin(&req, "ListImages", false).await?;
        let msg = req.into_inner();
        call.project = msg.project.clone();
        let r = self.inner.list_images(&caller, msg).await;
        self.finish(call, r).map(Response::new)
    }

    async fn get_image(
        &self,
        req: Request<pb::ImageRef>,
    ) -> Result<Response<pb::ImageInfo>, Status> {
        let (caller, mut call) = self.begin(&req, "GetImage", false).await?;
        let msg = req.into_inner();
        call.project = image_project(&msg.name);
        let r = self.inner.get_image(&caller, msg).await;
        self.finish(call, r).map(Response::new)
    }

    async fn delete_image(
        &self,
        req: Request<pb::ImageRef>,
    ) -> Result<Response<pb::Empty>, Status> {
        let (caller, mut call) = self.begin(&req, "DeleteImage", true).await?;
        let msg = req.into_inner();
        call.project = image_project(&msg.name);
        let r = self.inner.delete_image(&caller, msg).await;
        self.finish(call, r).map(Response::new)
    }

    async fn compose_image(
        &self,
        req: Request<pb::ComposeImageRequest>,
    ) -> Result<Response<pb::ImageInfo>, Status> {
        let (caller, mut call) = self.begin(&req, "ComposeImage", true).await?;
        let msg = req.into_inner();
        call.project = image_project(&msg.name);
        let r = self.inner.compose_image(&caller, msg).await;
        self.finish(call, r).map(Response::new)
    }

    async fn pack_diff(
        &self,
        req: Request<pb::PackDiffRequest>,
    ) -> Result<Response<pb::ImageInfo>, Status> {
        let (caller, mut call) = self.begin(&req, "PackDiff", true).await?;
        let msg = req.into_inner();
        call.project = image_project(&msg.image);
        call.sandbox_id = msg.id.clone();
        let r = self
            .inner
            .image_from_sandbox(
                &caller,
                super::images::FromSandbox {
                    id: msg.id,
                    image: msg.image,
                    scrub: Some(msg.scrub),
                    overwrite: msg.overwrite,
                },
            )
            .await;
        self.finish(call, r).map(Response::new)
    }

    async fn create_snapshot(
        &self,
        req: Request<pb::CreateSnapshotRequest>,
    ) -> Result<Response<pb::ImageInfo>, Status> {
        let (caller, mut call) = self.begin(&req, "CreateSnapshot", true).await?;
        let msg = req.into_inner();
        call.project = image_project(&msg.image);
        call.sandbox_id = msg.id.clone();
        let r = if msg.memory {
            self.inner
                .memory_snapshot(&caller, &msg.id, &msg.image, msg.overwrite)
                .await
        } else {
            self.inner
                .image_from_sandbox(
                    &caller,
                    super::images::FromSandbox {
                        id: msg.id,
                        image: msg.image,
                        scrub: None,
                        overwrite: msg.overwrite,
                    },
                )
                .await
        };
        self.finish(call, r).map(Response::new)
    }

    type ForkSandboxStream = BoxStream<pb::CreateSandboxesItem>;

    async fn fork_sandbox(
        &self,
        req: Request<pb::ForkSandboxRequest>,
    ) -> Result<Response<Self::ForkSandboxStream>, Status> {
        let (caller, mut call) = self.begin(&req, "ForkSandbox", true).await?;
        let msg = req.into_inner();
        call.sandbox_id = msg.id.clone();
        call.count = Some(msg.count);
        let started = Instant::now();
        let prep = self.inner.prepare_fork(&caller, &msg).await;
        if let Ok(p) = &prep {
            call.project = p.project.clone();
        }
        let prepared = self.finish(call, prep)?;
        let (tx, rx) = tokio::sync::mpsc::channel(256);
        tokio::spawn(super::fork::run(
            self.inner.clone(),
            caller,
            prepared,
            started,
            tx,
        ));
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn drain_edge(
        &self,
        req: Request<pb::DrainEdgeRequest>,
    ) -> Result<Response<pb::EdgeState>, Status> {
        let (caller, call) = self.begin(&req, "DrainEdge", true).await?;
        let r = self.inner.drain(&caller, req.into_inner()).await;
        self.finish(call, r).map(Response::new)
    }
}

/// The project part of an image name, for the audit log and the span ("" when the name has
/// none; the call itself reports the bad name).
fn image_project(name: &str) -> String {
    name.rsplit_once('/')
        .map(|(p, _)| p.to_string())
        .unwrap_or_default()
}
