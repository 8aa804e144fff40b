//! aether's `opendsec.v1.Runtime`: session calls are forwarded unchanged to the session's
//! chronus; ListSessions, CloseSession and Watch are answered here; the process API goes to
//! aether's own process table ([`Procs`]).

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use super::sessions::{session_name, Live, Sessions};
use crate::guest::procs::{ProcError, ProcessEvents, Procs};
use crate::guest::watch::registry::Watchers;
use crate::guest::watch::{Access, Options};
use crate::pb;
use crate::pb::runtime_client::RuntimeClient;
use crate::rpc::to_status;
use crate::types::{now_s, Failure};

/// The service aether serves on its socket.
pub struct Aether {
    pub sessions: Arc<Sessions>,
    pub procs: Procs,
    pub watchers: Watchers,
}

type Res<T> = Result<Response<T>, Status>;
type Boxed<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

fn proc_status(e: ProcError) -> Status {
    to_status(&e.failure())
}

fn events(s: ProcessEvents) -> Boxed<pb::ProcessEvent> {
    Box::pin(s.map(Ok))
}

fn boxed<T: Send + 'static>(s: tonic::Streaming<T>) -> Boxed<T> {
    Box::pin(s)
}

impl Aether {
    /// Session `name`, starting it as `user` when `start` (calls that only read a command's
    /// output never start a session). Errors: `invalid` name or user, `not_found` (not
    /// started), `unavailable` (chronus does not start).
    async fn live(&self, name: &str, user: &str, start: bool) -> Result<Arc<Live>, Status> {
        let name = session_name(name).map_err(|f| to_status(&f))?;
        if start {
            self.sessions.get(&name, user).await
        } else {
            self.sessions
                .existing(&name)
                .ok_or_else(|| Failure::not_found(format!("session {name:?} does not exist")))
        }
        .map_err(|f| to_status(&f))
    }

    /// The client of session `name` (see [`Aether::live`]).
    async fn session(
        &self,
        name: &str,
        user: &str,
        start: bool,
    ) -> Result<RuntimeClient<Channel>, Status> {
        Ok(self.live(name, user, start).await?.client.clone())
    }

    /// The absolute directory `r.path` names and the watch's options: the path is resolved
    /// by the session's chronus (its directory, its user's right to reach it), the watch
    /// itself is aether's, keeping to what the session's user may list. Errors: the
    /// session's; `not_found`; `invalid` for what is not a directory.
    async fn watch_target(
        &self,
        r: &pb::WatchDirRequest,
    ) -> Result<(std::path::PathBuf, Options), Status> {
        let live = self.live(&r.session, &r.user, true).await?;
        let mut c = live.client.clone();
        let info = c
            .stat(pb::PathRequest {
                sandbox_id: r.sandbox_id.clone(),
                path: r.path.clone(),
                session: r.session.clone(),
                user: r.user.clone(),
            })
            .await?
            .into_inner();
        if !matches!(info.r#type.as_str(), "dir" | "symlink") {
            return Err(to_status(&Failure::invalid(format!(
                "{} is not a directory",
                info.path
            ))));
        }
        // aether watches as root: for any other user it keeps to what that user may list.
        let access = if live.uid == 0 {
            None
        } else {
            let groups = crate::guest::user::resolve(&live.user, std::path::Path::new("/"))
                .map(|c| c.groups)
                .unwrap_or_default();
            Some(Arc::new(Access {
                uid: live.uid,
                gid: live.gid,
                groups,
            }))
        };
        let opts = Options {
            recursive: r.recursive,
            include_entry: r.include_entry,
            allow_network_mounts: r.allow_network_mounts,
            access,
        };
        Ok((std::path::PathBuf::from(info.path), opts))
    }

    /// Session `r.session`, started if need be, with `r`'s request id noted for it.
    /// Errors: those of [`Aether::live`]; `not_found` for a retry of a command whose
    /// chronus ended ([`Sessions::forward`]).
    async fn live_for(&self, r: &pb::RunShellRequest) -> Result<Arc<Live>, Status> {
        let live = self.live(&r.session, &r.user, true).await?;
        let name = session_name(&r.session).map_err(|f| to_status(&f))?;
        self.sessions
            .forward(&name, &r.request_id, &live)
            .map_err(|f| to_status(&f))?;
        Ok(live)
    }
}

/// How long a call that broke off waits to see whether the session's chronus died.
const LOST_WITHIN: Duration = Duration::from_millis(500);

#[tonic::async_trait]
impl pb::runtime_server::Runtime for Aether {
    async fn run_shell(&self, req: Request<pb::RunShellRequest>) -> Res<pb::ShellResult> {
        let r = req.into_inner();
        let live = self.live_for(&r).await?;
        let (session, background) = (r.session.clone(), r.background);
        let mut c = live.client.clone();
        match c.run_shell(r).await {
            Ok(mut resp) => {
                if !background && live.take_restarted() {
                    resp.get_mut().state_lost = true;
                }
                Ok(resp)
            }
            // A broken connection (not an answer of chronus's) while chronus dies.
            Err(st)
                if matches!(st.code(), tonic::Code::Unavailable | tonic::Code::Unknown)
                    && live.ended_within(LOST_WITHIN).await =>
            {
                let name = session_name(&session).unwrap_or_default();
                Err(to_status(&super::requests::lost(&name)))
            }
            Err(st) => Err(st),
        }
    }

    async fn get_output(&self, req: Request<pb::GetOutputRequest>) -> Res<pb::ShellResult> {
        let r = req.into_inner();
        let mut c = self.session(&r.session, "", false).await?;
        c.get_output(r).await
    }

    type StreamShellStream = Boxed<pb::ShellChunk>;
    async fn stream_shell(
        &self,
        req: Request<pb::RunShellRequest>,
    ) -> Res<Self::StreamShellStream> {
        let r = req.into_inner();
        let live = self.live_for(&r).await?;
        let mut c = live.client.clone();
        let stream = c.stream_shell(r).await?.into_inner();
        // The end of the first command after a restart tells that the session's state is gone.
        let tell = live.clone();
        Ok(Response::new(Box::pin(stream.map(move |item| {
            item.map(|mut chunk| {
                if let Some(pb::shell_chunk::Kind::Exit(res)) = chunk.kind.as_mut() {
                    if tell.take_restarted() {
                        res.state_lost = true;
                    }
                }
                chunk
            })
        }))))
    }

    type StreamOutputStream = Boxed<pb::ShellChunk>;
    async fn stream_output(
        &self,
        req: Request<pb::GetOutputRequest>,
    ) -> Res<Self::StreamOutputStream> {
        let r = req.into_inner();
        let mut c = self.session(&r.session, "", false).await?;
        Ok(Response::new(boxed(c.stream_output(r).await?.into_inner())))
    }

    async fn list_sessions(
        &self,
        _: Request<pb::ListSessionsRequest>,
    ) -> Res<pb::ListSessionsResponse> {
        Ok(Response::new(pb::ListSessionsResponse {
            sessions: self.sessions.list(),
        }))
    }

    async fn close_session(&self, req: Request<pb::CloseSessionRequest>) -> Res<pb::Empty> {
        let name = session_name(&req.get_ref().session).map_err(|f| to_status(&f))?;
        self.sessions
            .close(&name)
            .await
            .map_err(|f| to_status(&f))?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn read_file(&self, req: Request<pb::ReadFileRequest>) -> Res<pb::ReadFileResponse> {
        let r = req.into_inner();
        let mut c = self.session(&r.session, &r.user, true).await?;
        c.read_file(r).await
    }

    async fn write_file(&self, req: Request<pb::WriteFileRequest>) -> Res<pb::FileInfo> {
        let r = req.into_inner();
        let mut c = self.session(&r.session, &r.user, true).await?;
        c.write_file(r).await
    }

    async fn list_dir(&self, req: Request<pb::PathRequest>) -> Res<pb::ListDirResponse> {
        let r = req.into_inner();
        let mut c = self.session(&r.session, &r.user, true).await?;
        c.list_dir(r).await
    }

    async fn stat(&self, req: Request<pb::PathRequest>) -> Res<pb::FileInfo> {
        let r = req.into_inner();
        let mut c = self.session(&r.session, &r.user, true).await?;
        c.stat(r).await
    }

    async fn remove(&self, req: Request<pb::RemoveRequest>) -> Res<pb::Empty> {
        let r = req.into_inner();
        let mut c = self.session(&r.session, &r.user, true).await?;
        c.remove(r).await
    }

    async fn make_dir(&self, req: Request<pb::PathRequest>) -> Res<pb::FileInfo> {
        let r = req.into_inner();
        let mut c = self.session(&r.session, &r.user, true).await?;
        c.make_dir(r).await
    }

    async fn r#move(&self, req: Request<pb::MoveRequest>) -> Res<pb::FileInfo> {
        let r = req.into_inner();
        let mut c = self.session(&r.session, &r.user, true).await?;
        c.r#move(r).await
    }

    async fn http(&self, req: Request<pb::HttpRequest>) -> Res<pb::HttpResponse> {
        // HttpRequest names no session: it goes through the default one.
        let r = req.into_inner();
        let mut c = self.session("", "", true).await?;
        c.http(r).await
    }

    type ConnectPortStream = Boxed<pb::PortFrame>;
    async fn connect_port(
        &self,
        req: Request<tonic::Streaming<pb::PortFrame>>,
    ) -> Res<Self::ConnectPortStream> {
        let mut inbound = req.into_inner();
        let first = crate::guest::port::first_frame(&mut inbound).await?;
        let frames = crate::guest::port::connect(first, inbound)
            .await
            .map_err(|f| to_status(&f))?;
        Ok(Response::new(frames))
    }

    type StartProcessStream = Boxed<pb::ProcessEvent>;
    async fn start_process(
        &self,
        req: Request<pb::StartProcessRequest>,
    ) -> Res<Self::StartProcessStream> {
        let s = self
            .procs
            .start(req.into_inner())
            .await
            .map_err(proc_status)?;
        Ok(Response::new(events(s)))
    }

    type ConnectProcessStream = Boxed<pb::ProcessEvent>;
    async fn connect_process(
        &self,
        req: Request<pb::ConnectProcessRequest>,
    ) -> Res<Self::ConnectProcessStream> {
        let s = self
            .procs
            .connect(req.into_inner())
            .await
            .map_err(proc_status)?;
        Ok(Response::new(events(s)))
    }

    async fn send_process_input(&self, req: Request<pb::ProcessInputRequest>) -> Res<pb::Empty> {
        self.procs
            .send_input(req.into_inner())
            .await
            .map_err(proc_status)?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn close_process_input(&self, req: Request<pb::ProcessRef>) -> Res<pb::Empty> {
        self.procs
            .close_input(req.into_inner())
            .await
            .map_err(proc_status)?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn signal_process(&self, req: Request<pb::SignalProcessRequest>) -> Res<pb::Empty> {
        self.procs
            .signal(req.into_inner())
            .await
            .map_err(proc_status)?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn resize_process_pty(&self, req: Request<pb::ResizePtyRequest>) -> Res<pb::Empty> {
        self.procs
            .resize(req.into_inner())
            .await
            .map_err(proc_status)?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn list_processes(
        &self,
        _: Request<pb::ListProcessesRequest>,
    ) -> Res<pb::ListProcessesResponse> {
        Ok(Response::new(pb::ListProcessesResponse {
            processes: self.procs.list().await,
        }))
    }

    type WatchDirStream = Boxed<pb::FileEvent>;
    async fn watch_dir(&self, req: Request<pb::WatchDirRequest>) -> Res<Self::WatchDirStream> {
        let (root, opts) = self.watch_target(req.get_ref()).await?;
        let s = self
            .watchers
            .stream(root, opts)
            .await
            .map_err(|f| to_status(&f))?;
        Ok(Response::new(Box::pin(
            s.map(|r| r.map_err(|f| to_status(&f))),
        )))
    }

    async fn create_watcher(&self, req: Request<pb::WatchDirRequest>) -> Res<pb::WatcherRef> {
        let r = req.into_inner();
        let (root, opts) = self.watch_target(&r).await?;
        let id = self
            .watchers
            .create(root, opts)
            .await
            .map_err(|f| to_status(&f))?;
        Ok(Response::new(pb::WatcherRef {
            sandbox_id: r.sandbox_id,
            watcher_id: id,
        }))
    }

    async fn get_watcher_events(&self, req: Request<pb::WatcherRef>) -> Res<pb::WatcherEvents> {
        let events = self
            .watchers
            .take(&req.get_ref().watcher_id)
            .map_err(|f| to_status(&f))?;
        Ok(Response::new(events))
    }

    async fn remove_watcher(&self, req: Request<pb::WatcherRef>) -> Res<pb::Empty> {
        self.watchers
            .remove(&req.get_ref().watcher_id)
            .map_err(|f| to_status(&f))?;
        Ok(Response::new(pb::Empty {}))
    }

    type WatchStream = Boxed<pb::WatchEvent>;
    async fn watch(&self, _: Request<pb::Empty>) -> Res<Self::WatchStream> {
        let ticks = tokio_stream::wrappers::IntervalStream::new(tokio::time::interval(
            Duration::from_secs(1),
        ));
        Ok(Response::new(Box::pin(
            ticks.map(|_| Ok(pb::WatchEvent { at: now_s() })),
        )))
    }
}
