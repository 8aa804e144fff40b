//! `opendsec.v1.Runtime` on the edge's port (docs/architecture.md): each call
//! names its sandbox; the edge resumes it if paused, counts the call in flight (the idle
//! timeout does not run meanwhile), refreshes `last_active_at`, takes aether's channel
//! from the backend's `Runtime` capability and forwards the call unchanged. Streams keep
//! the call counted until they end. A backend without the capability (sim) answers
//! `invalid` "backend <name> runs nothing".

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use tonic::transport::Channel;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use super::machine::Op;
use super::node::{as_handle, handle, lock, Core, Entry};
use super::ops::Cause;
use crate::pb::{self, runtime_client::RuntimeClient, SandboxState};
use crate::rpc::{check_service_token, to_status, MAX_MESSAGE};
use crate::types::{now_s, Failure};

/// A stream of forwarded messages.
pub type Forwarded<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// Requests that name their sandbox.
pub trait SandboxScoped {
    fn sandbox_id(&self) -> &str;
}

macro_rules! scoped {
    ($($t:ty),* $(,)?) => { $(impl SandboxScoped for $t { fn sandbox_id(&self) -> &str { &self.sandbox_id } })* };
}
scoped!(
    pb::RunShellRequest,
    pb::GetOutputRequest,
    pb::ListSessionsRequest,
    pb::CloseSessionRequest,
    pb::ReadFileRequest,
    pb::WriteFileRequest,
    pb::PathRequest,
    pb::RemoveRequest,
    pb::MoveRequest,
    pb::HttpRequest,
    pb::StartProcessRequest,
    pb::ProcessRef,
    pb::ConnectProcessRequest,
    pb::ProcessInputRequest,
    pb::SignalProcessRequest,
    pb::ResizePtyRequest,
    pb::ListProcessesRequest,
    pb::WatchDirRequest,
    pb::WatcherRef,
);

/// A runtime call in flight: counted on the sandbox until dropped, which also marks the
/// sandbox active.
pub(crate) struct CallGuard {
    entry: Arc<Entry>,
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        lock(&self.entry.rec).sandbox.last_active_at = now_s();
        self.entry.calls.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Core {
    /// Readies sandbox `id` for a runtime call: resumes it if paused, counts the call, marks
    /// it active, and returns aether's channel. Errors: `not_found`, `invalid` (backend runs
    /// nothing), `conflict` (ended), the backend's failure otherwise.
    pub(crate) async fn begin_call(&self, id: &str) -> Result<(CallGuard, Channel), Failure> {
        let entry = self.entry(id)?;
        let backend = self
            .backend_of(&entry.snapshot())
            .cloned()
            .ok_or_else(|| Failure::internal(format!("sandbox {id}: backend not configured")))?;
        let Some(rt) = backend.runtime() else {
            return Err(Failure::invalid(format!(
                "backend {} runs nothing",
                backend.name()
            )));
        };
        entry.calls.fetch_add(1, Ordering::AcqRel);
        let guard = CallGuard {
            entry: entry.clone(),
        };
        loop {
            let state = entry.snapshot().state();
            match state {
                SandboxState::Running => break,
                SandboxState::Paused | SandboxState::Pausing | SandboxState::Resuming => {
                    self.lifecycle(id, Op::Resume, Cause::Caller).await?;
                }
                SandboxState::Creating
                | SandboxState::Stopping
                | SandboxState::StateUnspecified => {
                    // Wait for the operation in progress, then look again.
                    drop(entry.op.lock().await);
                    if entry.snapshot().state() == state {
                        return Err(Failure::conflict(format!(
                            "sandbox {id} is {}",
                            state.as_str_name()
                        )));
                    }
                }
                SandboxState::Stopped | SandboxState::Failed => {
                    return Err(Failure::conflict(format!(
                        "sandbox {id} is {}",
                        state.as_str_name()
                    )));
                }
            }
        }
        let rec = self.update(&entry, |r| r.sandbox.last_active_at = now_s());
        let parts = handle(&rec);
        let ch = rt
            .channel(&as_handle(id, &parts))
            .await
            .map_err(|e| e.to_failure())?;
        Ok((guard, ch))
    }
}

pub(crate) struct EdgeRuntime {
    pub core: Arc<Core>,
}

type Client = RuntimeClient<Channel>;

impl EdgeRuntime {
    async fn open<Req: SandboxScoped>(
        &self,
        req: Request<Req>,
    ) -> Result<(CallGuard, Client, Request<Req>), Status> {
        check_service_token(&req, &self.core.service_token)?;
        let deadline = req.metadata().get("grpc-timeout").cloned();
        let msg = req.into_inner();
        let (guard, ch) = self
            .core
            .begin_call(msg.sandbox_id())
            .await
            .map_err(|f| to_status(&f))?;
        let client = RuntimeClient::new(ch)
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE);
        let mut out = Request::new(msg);
        if let Some(d) = deadline {
            out.metadata_mut().insert("grpc-timeout", d);
        }
        Ok((guard, client, out))
    }

    /// Forwards a unary call.
    async fn unary<Req, Resp, F, Fut>(
        &self,
        req: Request<Req>,
        call: F,
    ) -> Result<Response<Resp>, Status>
    where
        Req: SandboxScoped,
        F: FnOnce(Client, Request<Req>) -> Fut,
        Fut: Future<Output = Result<Response<Resp>, Status>>,
    {
        let (guard, client, req) = self.open(req).await?;
        let r = call(client, req).await;
        drop(guard);
        r.map(|resp| Response::new(resp.into_inner()))
    }

    /// Forwards a server-streaming call; the call counts as in flight until the stream ends.
    async fn streaming<Req, Item, F, Fut>(
        &self,
        req: Request<Req>,
        call: F,
    ) -> Result<Response<Forwarded<Item>>, Status>
    where
        Req: SandboxScoped,
        Item: Send + 'static,
        F: FnOnce(Client, Request<Req>) -> Fut,
        Fut: Future<Output = Result<Response<Streaming<Item>>, Status>>,
    {
        let (guard, client, req) = self.open(req).await?;
        let inner = call(client, req).await?.into_inner();
        let s = inner.map(move |x| {
            let _held = &guard;
            x
        });
        Ok(Response::new(Box::pin(s)))
    }
}

#[tonic::async_trait]
impl pb::runtime_server::Runtime for EdgeRuntime {
    async fn run_shell(
        &self,
        req: Request<pb::RunShellRequest>,
    ) -> Result<Response<pb::ShellResult>, Status> {
        self.unary(req, |mut c, r| async move { c.run_shell(r).await })
            .await
    }
    async fn get_output(
        &self,
        req: Request<pb::GetOutputRequest>,
    ) -> Result<Response<pb::ShellResult>, Status> {
        self.unary(req, |mut c, r| async move { c.get_output(r).await })
            .await
    }
    type StreamShellStream = Forwarded<pb::ShellChunk>;
    async fn stream_shell(
        &self,
        req: Request<pb::RunShellRequest>,
    ) -> Result<Response<Self::StreamShellStream>, Status> {
        self.streaming(req, |mut c, r| async move { c.stream_shell(r).await })
            .await
    }
    type StreamOutputStream = Forwarded<pb::ShellChunk>;
    async fn stream_output(
        &self,
        req: Request<pb::GetOutputRequest>,
    ) -> Result<Response<Self::StreamOutputStream>, Status> {
        self.streaming(req, |mut c, r| async move { c.stream_output(r).await })
            .await
    }
    async fn list_sessions(
        &self,
        req: Request<pb::ListSessionsRequest>,
    ) -> Result<Response<pb::ListSessionsResponse>, Status> {
        self.unary(req, |mut c, r| async move { c.list_sessions(r).await })
            .await
    }
    async fn close_session(
        &self,
        req: Request<pb::CloseSessionRequest>,
    ) -> Result<Response<pb::Empty>, Status> {
        self.unary(req, |mut c, r| async move { c.close_session(r).await })
            .await
    }
    async fn read_file(
        &self,
        req: Request<pb::ReadFileRequest>,
    ) -> Result<Response<pb::ReadFileResponse>, Status> {
        self.unary(req, |mut c, r| async move { c.read_file(r).await })
            .await
    }
    async fn write_file(
        &self,
        req: Request<pb::WriteFileRequest>,
    ) -> Result<Response<pb::FileInfo>, Status> {
        self.unary(req, |mut c, r| async move { c.write_file(r).await })
            .await
    }
    async fn list_dir(
        &self,
        req: Request<pb::PathRequest>,
    ) -> Result<Response<pb::ListDirResponse>, Status> {
        self.unary(req, |mut c, r| async move { c.list_dir(r).await })
            .await
    }
    async fn stat(&self, req: Request<pb::PathRequest>) -> Result<Response<pb::FileInfo>, Status> {
        self.unary(req, |mut c, r| async move { c.stat(r).await })
            .await
    }
    async fn remove(&self, req: Request<pb::RemoveRequest>) -> Result<Response<pb::Empty>, Status> {
        self.unary(req, |mut c, r| async move { c.remove(r).await })
            .await
    }
    async fn make_dir(
        &self,
        req: Request<pb::PathRequest>,
    ) -> Result<Response<pb::FileInfo>, Status> {
        self.unary(req, |mut c, r| async move { c.make_dir(r).await })
            .await
    }
    async fn r#move(
        &self,
        req: Request<pb::MoveRequest>,
    ) -> Result<Response<pb::FileInfo>, Status> {
        self.unary(req, |mut c, r| async move { c.r#move(r).await })
            .await
    }
    async fn http(
        &self,
        req: Request<pb::HttpRequest>,
    ) -> Result<Response<pb::HttpResponse>, Status> {
        self.unary(req, |mut c, r| async move { c.http(r).await })
            .await
    }
    type ConnectPortStream = Forwarded<pb::PortFrame>;
    /// Passes the frames on both ways; the call counts as in flight (no idle stop) until the
    /// connection's stream ends.
    async fn connect_port(
        &self,
        req: Request<Streaming<pb::PortFrame>>,
    ) -> Result<Response<Self::ConnectPortStream>, Status> {
        check_service_token(&req, &self.core.service_token)?;
        let mut inbound = req.into_inner();
        let first = crate::guest::port::first_frame(&mut inbound).await?;
        let span =
            tracing::info_span!("ConnectPort", sandbox_id = %first.sandbox_id, port = first.port);
        async move {
            crate::guest::port::port_of(&first).map_err(|f| to_status(&f))?;
            let (guard, ch) = self
                .core
                .begin_call(&first.sandbox_id)
                .await
                .map_err(|f| to_status(&f))?;
            let mut client = RuntimeClient::new(ch)
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE);
            let inner = client
                .connect_port(crate::guest::port::forward(first, inbound))
                .await?
                .into_inner();
            let s = inner.map(move |x| {
                let _held = &guard;
                x
            });
            Ok(Response::new(Box::pin(s) as Forwarded<pb::PortFrame>))
        }
        .instrument(span)
        .await
    }

    type StartProcessStream = Forwarded<pb::ProcessEvent>;
    async fn start_process(
        &self,
        req: Request<pb::StartProcessRequest>,
    ) -> Result<Response<Self::StartProcessStream>, Status> {
        self.streaming(req, |mut c, r| async move { c.start_process(r).await })
            .await
    }
    type ConnectProcessStream = Forwarded<pb::ProcessEvent>;
    async fn connect_process(
        &self,
        req: Request<pb::ConnectProcessRequest>,
    ) -> Result<Response<Self::ConnectProcessStream>, Status> {
        self.streaming(req, |mut c, r| async move { c.connect_process(r).await })
            .await
    }
    async fn send_process_input(
        &self,
        req: Request<pb::ProcessInputRequest>,
    ) -> Result<Response<pb::Empty>, Status> {
        self.unary(req, |mut c, r| async move { c.send_process_input(r).await })
            .await
    }
    async fn close_process_input(
        &self,
        req: Request<pb::ProcessRef>,
    ) -> Result<Response<pb::Empty>, Status> {
        self.unary(
            req,
            |mut c, r| async move { c.close_process_input(r).await },
        )
        .await
    }
    async fn signal_process(
        &self,
        req: Request<pb::SignalProcessRequest>,
    ) -> Result<Response<pb::Empty>, Status> {
        self.unary(req, |mut c, r| async move { c.signal_process(r).await })
            .await
    }
    async fn resize_process_pty(
        &self,
        req: Request<pb::ResizePtyRequest>,
    ) -> Result<Response<pb::Empty>, Status> {
        self.unary(req, |mut c, r| async move { c.resize_process_pty(r).await })
            .await
    }
    type WatchDirStream = Forwarded<pb::FileEvent>;
    async fn watch_dir(
        &self,
        req: Request<pb::WatchDirRequest>,
    ) -> Result<Response<Self::WatchDirStream>, Status> {
        self.streaming(req, |mut c, r| async move { c.watch_dir(r).await })
            .await
    }
    async fn create_watcher(
        &self,
        req: Request<pb::WatchDirRequest>,
    ) -> Result<Response<pb::WatcherRef>, Status> {
        self.unary(req, |mut c, r| async move { c.create_watcher(r).await })
            .await
    }
    async fn get_watcher_events(
        &self,
        req: Request<pb::WatcherRef>,
    ) -> Result<Response<pb::WatcherEvents>, Status> {
        self.unary(req, |mut c, r| async move { c.get_watcher_events(r).await })
            .await
    }
    async fn remove_watcher(
        &self,
        req: Request<pb::WatcherRef>,
    ) -> Result<Response<pb::Empty>, Status> {
        self.unary(req, |mut c, r| async move { c.remove_watcher(r).await })
            .await
    }
    async fn list_processes(
        &self,
        req: Request<pb::ListProcessesRequest>,
    ) -> Result<Response<pb::ListProcessesResponse>, Status> {
        self.unary(req, |mut c, r| async move { c.list_processes(r).await })
            .await
    }
    type WatchStream = Forwarded<pb::WatchEvent>;
    async fn watch(&self, req: Request<pb::Empty>) -> Result<Response<Self::WatchStream>, Status> {
        check_service_token(&req, &self.core.service_token)?;
        Err(to_status(&Failure::invalid(
            "Watch is aether's own liveness stream; the edge does not forward it",
        )))
    }
}
