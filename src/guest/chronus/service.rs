//! chronus's side of `opendsec.v1.Runtime`: the session calls aether forwards to it.
//! Calls aether answers itself (sessions, processes, Watch) are `invalid` here.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::session::{lock, Session};
use super::{files, http};
use crate::pb;
use crate::rpc::to_status;
use crate::types::Failure;

/// The service of one session.
pub struct Chronus {
    pub session: Arc<Session>,
    /// The sandbox's disk size in MB, for the message of a full disk (0: unknown).
    pub disk_mb: u64,
}

type Res<T> = Result<Response<T>, Status>;
type Boxed<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

fn status(f: Failure) -> Status {
    to_status(&f)
}

fn aethers<T>(what: &str) -> Result<T, Status> {
    Err(status(Failure::invalid(format!(
        "{what} is served by aether, not by a session"
    ))))
}

impl Chronus {
    fn cwd(&self) -> std::path::PathBuf {
        lock(&self.session.cwd).clone()
    }
}

#[tonic::async_trait]
impl pb::runtime_server::Runtime for Chronus {
    async fn run_shell(&self, req: Request<pb::RunShellRequest>) -> Res<pb::ShellResult> {
        let req = req.into_inner();
        let s = &self.session;
        let id = s.start(&req).map_err(status)?;
        if req.background {
            let snap = s.snap(id);
            return Ok(Response::new(pb::ShellResult {
                cmd_id: id,
                exit_code: snap.map(|x| x.exit_code).unwrap_or(-1),
                done: snap.is_some_and(|x| x.done),
                ..Default::default()
            }));
        }
        s.wait_done(id, None).await.map_err(status)?;
        Ok(Response::new(s.result(id, 0, 0).await.map_err(status)?))
    }

    async fn get_output(&self, req: Request<pb::GetOutputRequest>) -> Res<pb::ShellResult> {
        let req = req.into_inner();
        let s = &self.session;
        if !(req.wait >= 0.0 && req.wait.is_finite()) {
            return Err(status(Failure::invalid(format!(
                "wait {} is not a number of seconds >= 0",
                req.wait
            ))));
        }
        if req.wait > 0.0 {
            let deadline = tokio::time::Instant::now()
                + Duration::from_secs_f64(req.wait.min(super::session::MAX_SECONDS));
            s.wait_done(req.cmd_id, Some(deadline))
                .await
                .map_err(status)?;
        }
        let r = s
            .result(req.cmd_id, req.stdout_offset, req.stderr_offset)
            .await
            .map_err(status)?;
        Ok(Response::new(r))
    }

    type StreamShellStream = ReceiverStream<Result<pb::ShellChunk, Status>>;
    async fn stream_shell(
        &self,
        req: Request<pb::RunShellRequest>,
    ) -> Res<Self::StreamShellStream> {
        let mut req = req.into_inner();
        // A stream follows the command; it is never detached.
        req.background = false;
        let id = self.session.start(&req).map_err(status)?;
        let rx = self.session.stream(id, 0, 0, true).map_err(status)?;
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    type StreamOutputStream = ReceiverStream<Result<pb::ShellChunk, Status>>;
    async fn stream_output(
        &self,
        req: Request<pb::GetOutputRequest>,
    ) -> Res<Self::StreamOutputStream> {
        let req = req.into_inner();
        let rx = self
            .session
            .stream(req.cmd_id, req.stdout_offset, req.stderr_offset, false)
            .map_err(status)?;
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn list_sessions(
        &self,
        _: Request<pb::ListSessionsRequest>,
    ) -> Res<pb::ListSessionsResponse> {
        aethers("ListSessions")
    }

    async fn close_session(&self, _: Request<pb::CloseSessionRequest>) -> Res<pb::Empty> {
        aethers("CloseSession")
    }

    async fn read_file(&self, req: Request<pb::ReadFileRequest>) -> Res<pb::ReadFileResponse> {
        let r = files::read(self.cwd(), req.into_inner())
            .await
            .map_err(status)?;
        Ok(Response::new(r))
    }

    async fn write_file(&self, req: Request<pb::WriteFileRequest>) -> Res<pb::FileInfo> {
        let r = files::write(self.cwd(), self.disk_mb, req.into_inner())
            .await
            .map_err(status)?;
        Ok(Response::new(r))
    }

    async fn list_dir(&self, req: Request<pb::PathRequest>) -> Res<pb::ListDirResponse> {
        let r = files::list(self.cwd(), req.into_inner())
            .await
            .map_err(status)?;
        Ok(Response::new(r))
    }

    async fn stat(&self, req: Request<pb::PathRequest>) -> Res<pb::FileInfo> {
        let r = files::stat(self.cwd(), req.into_inner())
            .await
            .map_err(status)?;
        Ok(Response::new(r))
    }

    async fn remove(&self, req: Request<pb::RemoveRequest>) -> Res<pb::Empty> {
        let r = files::remove(self.cwd(), req.into_inner())
            .await
            .map_err(status)?;
        Ok(Response::new(r))
    }

    async fn make_dir(&self, req: Request<pb::PathRequest>) -> Res<pb::FileInfo> {
        let r = files::make_dir(self.cwd(), req.into_inner())
            .await
            .map_err(status)?;
        Ok(Response::new(r))
    }

    async fn r#move(&self, req: Request<pb::MoveRequest>) -> Res<pb::FileInfo> {
        let r = files::rename(self.cwd(), req.into_inner())
            .await
            .map_err(status)?;
        Ok(Response::new(r))
    }

    async fn http(&self, req: Request<pb::HttpRequest>) -> Res<pb::HttpResponse> {
        let r = http::request(req.into_inner()).await.map_err(status)?;
        Ok(Response::new(r))
    }

    type ConnectPortStream = Boxed<pb::PortFrame>;
    async fn connect_port(
        &self,
        _: Request<tonic::Streaming<pb::PortFrame>>,
    ) -> Res<Self::ConnectPortStream> {
        aethers("ConnectPort")
    }

    type StartProcessStream = Boxed<pb::ProcessEvent>;
    async fn start_process(
        &self,
        _: Request<pb::StartProcessRequest>,
    ) -> Res<Self::StartProcessStream> {
        aethers("StartProcess")
    }

    type ConnectProcessStream = Boxed<pb::ProcessEvent>;
    async fn connect_process(
        &self,
        _: Request<pb::ConnectProcessRequest>,
    ) -> Res<Self::ConnectProcessStream> {
        aethers("ConnectProcess")
    }

    async fn send_process_input(&self, _: Request<pb::ProcessInputRequest>) -> Res<pb::Empty> {
        aethers("SendProcessInput")
    }

    async fn close_process_input(&self, _: Request<pb::ProcessRef>) -> Res<pb::Empty> {
        aethers("CloseProcessInput")
    }

    async fn signal_process(&self, _: Request<pb::SignalProcessRequest>) -> Res<pb::Empty> {
        aethers("SignalProcess")
    }

    async fn resize_process_pty(&self, _: Request<pb::ResizePtyRequest>) -> Res<pb::Empty> {
        aethers("ResizeProcessPty")
    }

    async fn list_processes(
        &self,
        _: Request<pb::ListProcessesRequest>,
    ) -> Res<pb::ListProcessesResponse> {
        aethers("ListProcesses")
    }

    type WatchDirStream = Boxed<pb::FileEvent>;
    async fn watch_dir(&self, _: Request<pb::WatchDirRequest>) -> Res<Self::WatchDirStream> {
        aethers("WatchDir")
    }

    async fn create_watcher(&self, _: Request<pb::WatchDirRequest>) -> Res<pb::WatcherRef> {
        aethers("CreateWatcher")
    }

    async fn get_watcher_events(&self, _: Request<pb::WatcherRef>) -> Res<pb::WatcherEvents> {
        aethers("GetWatcherEvents")
    }

    async fn remove_watcher(&self, _: Request<pb::WatcherRef>) -> Res<pb::Empty> {
        aethers("RemoveWatcher")
    }

    type WatchStream = Boxed<pb::WatchEvent>;
    async fn watch(&self, _: Request<pb::Empty>) -> Res<Self::WatchStream> {
        aethers("Watch")
    }
}
