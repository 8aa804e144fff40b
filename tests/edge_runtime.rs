//! Runtime calls through the edge to a sandbox's agent, with a test backend that has the
//! Runtime capability and a fake aether: a paused sandbox is resumed by the call, the call
//! is forwarded unchanged (errors too), a stream counts as in flight so the idle timeout
//! waits for it, and shutdown stops the sandboxes of a real backend.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use opendsec::backends::{
    Adopted, Backend, BackendError, BackendState, CleanupReport, CreateRequest, Handle, Health,
    Recorded, Runtime,
};
use opendsec::config::Config;
use opendsec::pb::{self, edge_client::EdgeClient, runtime_client::RuntimeClient, SandboxState};
use opendsec::rpc::{self, failure_from_status};
use opendsec::shutdown::Shutdown;
use opendsec::telemetry::Ready;
use opendsec::types::{Failure, Reason};
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

const TOKEN: &str = "rt-token";

/// A backend whose sandboxes all answer on one fake aether.
struct Vm {
    aether: Channel,
    ops: Mutex<Vec<String>>,
}

#[async_trait]
impl Runtime for Vm {
    async fn channel(&self, _s: &Handle<'_>) -> Result<Channel, BackendError> {
        Ok(self.aether.clone())
    }
}

#[async_trait]
impl Backend for Vm {
    fn name(&self) -> &str {
        "vm"
    }
    fn runtime_kind(&self) -> &'static str {
        "firecracker"
    }
    async fn create(&self, r: &CreateRequest) -> Result<BackendState, BackendError> {
        self.ops
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(format!("create {}", r.sandbox_id));
        Ok(BackendState::Null)
    }
    async fn stop(&self, s: &Handle<'_>) -> Result<(), BackendError> {
        self.ops
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(format!("stop {}", s.sandbox_id));
        Ok(())
    }
    async fn pause(&self, s: &Handle<'_>) -> Result<BackendState, BackendError> {
        self.ops
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(format!("pause {}", s.sandbox_id));
        Ok(BackendState::Null)
    }
    async fn resume(&self, s: &Handle<'_>) -> Result<BackendState, BackendError> {
        self.ops
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(format!("resume {}", s.sandbox_id));
        Ok(BackendState::Null)
    }
    async fn probe(&self, _s: &Handle<'_>) -> Health {
        Health::Alive
    }
    async fn adopt(&self, s: &Handle<'_>, r: Recorded) -> Result<Adopted, BackendError> {
        Ok(Adopted {
            state: s.state.clone(),
            paused: r == Recorded::Paused,
        })
    }
    async fn cleanup(&self, _k: &HashSet<String>) -> Result<CleanupReport, BackendError> {
        Ok(CleanupReport::default())
    }
    fn runtime(&self) -> Option<&dyn Runtime> {
        Some(self)
    }
}

struct Aether;

type R<T> = Result<Response<T>, Status>;
type S<T> = std::pin::Pin<Box<dyn futures::Stream<Item = Result<T, Status>> + Send>>;

fn unimpl<T>() -> R<T> {
    Err(Status::unimplemented("fake aether"))
}

#[tonic::async_trait]
impl pb::runtime_server::Runtime for Aether {
    async fn run_shell(&self, r: Request<pb::RunShellRequest>) -> R<pb::ShellResult> {
        let r = r.into_inner();
        if r.session == "missing" {
            return Err(rpc::to_status(&Failure::not_found("no session missing")));
        }
        Ok(Response::new(pb::ShellResult {
            exit_code: 0,
            stdout: format!("{}:{}", r.sandbox_id, r.cmd).into_bytes(),
            done: true,
            ..Default::default()
        }))
    }
    type StreamShellStream = S<pb::ShellChunk>;
    async fn stream_shell(&self, _r: Request<pb::RunShellRequest>) -> R<Self::StreamShellStream> {
        let s = futures::stream::iter(0..5).then(|i| async move {
            tokio::time::sleep(Duration::from_millis(600)).await;
            Ok(pb::ShellChunk {
                kind: Some(pb::shell_chunk::Kind::Stdout(vec![b'0' + i as u8])),
                offset: i,
            })
        });
        Ok(Response::new(Box::pin(s)))
    }
    async fn get_output(&self, _: Request<pb::GetOutputRequest>) -> R<pb::ShellResult> {
        unimpl()
    }
    type StreamOutputStream = S<pb::ShellChunk>;
    async fn stream_output(&self, _: Request<pb::GetOutputRequest>) -> R<Self::StreamOutputStream> {
        unimpl()
    }
    async fn list_sessions(
        &self,
        _: Request<pb::ListSessionsRequest>,
    ) -> R<pb::ListSessionsResponse> {
        unimpl()
    }
    async fn close_session(&self, _: Request<pb::CloseSessionRequest>) -> R<pb::Empty> {
        unimpl()
    }
    async fn read_file(&self, _: Request<pb::ReadFileRequest>) -> R<pb::ReadFileResponse> {
        unimpl()
    }
    async fn write_file(&self, _: Request<pb::WriteFileRequest>) -> R<pb::FileInfo> {
        unimpl()
    }
    async fn list_dir(&self, _: Request<pb::PathRequest>) -> R<pb::ListDirResponse> {
        unimpl()
    }
    async fn stat(&self, _: Request<pb::PathRequest>) -> R<pb::FileInfo> {
        unimpl()
    }
    async fn remove(&self, _: Request<pb::RemoveRequest>) -> R<pb::Empty> {
        unimpl()
    }
    async fn make_dir(&self, _: Request<pb::PathRequest>) -> R<pb::FileInfo> {
        unimpl()
    }
    async fn r#move(&self, _: Request<pb::MoveRequest>) -> R<pb::FileInfo> {
        unimpl()
    }
    async fn http(&self, _: Request<pb::HttpRequest>) -> R<pb::HttpResponse> {
        unimpl()
    }
    type StartProcessStream = S<pb::ProcessEvent>;
    async fn start_process(
        &self,
        _: Request<pb::StartProcessRequest>,
    ) -> R<Self::StartProcessStream> {
        unimpl()
    }
    type ConnectProcessStream = S<pb::ProcessEvent>;
    async fn connect_process(
        &self,
        _: Request<pb::ConnectProcessRequest>,
    ) -> R<Self::ConnectProcessStream> {
        unimpl()
    }
    async fn send_process_input(&self, _: Request<pb::ProcessInputRequest>) -> R<pb::Empty> {
        unimpl()
    }
    async fn close_process_input(&self, _: Request<pb::ProcessRef>) -> R<pb::Empty> {
        unimpl()
    }
    async fn signal_process(&self, _: Request<pb::SignalProcessRequest>) -> R<pb::Empty> {
        unimpl()
    }
    async fn resize_process_pty(&self, _: Request<pb::ResizePtyRequest>) -> R<pb::Empty> {
        unimpl()
    }
    async fn list_processes(
        &self,
        _: Request<pb::ListProcessesRequest>,
    ) -> R<pb::ListProcessesResponse> {
        unimpl()
    }
    type WatchDirStream = S<pb::FileEvent>;
    async fn watch_dir(&self, _: Request<pb::WatchDirRequest>) -> R<Self::WatchDirStream> {
        unimpl()
    }
    async fn create_watcher(&self, _: Request<pb::WatchDirRequest>) -> R<pb::WatcherRef> {
        unimpl()
    }
    async fn get_watcher_events(&self, _: Request<pb::WatcherRef>) -> R<pb::WatcherEvents> {
        unimpl()
    }
    async fn remove_watcher(&self, _: Request<pb::WatcherRef>) -> R<pb::Empty> {
        unimpl()
    }
    type ConnectPortStream = S<pb::PortFrame>;
    /// The real thing, on this process's loopback.
    async fn connect_port(
        &self,
        r: Request<tonic::Streaming<pb::PortFrame>>,
    ) -> R<Self::ConnectPortStream> {
        let mut inbound = r.into_inner();
        let first = opendsec::guest::port::first_frame(&mut inbound).await?;
        let frames = opendsec::guest::port::connect(first, inbound)
            .await
            .map_err(|f| rpc::to_status(&f))?;
        Ok(Response::new(frames))
    }
    type WatchStream = S<pb::WatchEvent>;
    async fn watch(&self, _: Request<pb::Empty>) -> R<Self::WatchStream> {
        unimpl()
    }
}

fn req<T>(m: T) -> Request<T> {
    rpc::client::internal(m, TOKEN)
}

async fn get(c: &mut EdgeClient<Channel>, id: &str) -> pb::Sandbox {
    c.get_sandbox(req(pb::SandboxRef { id: id.into() }))
        .await
        .unwrap_or_else(|s| panic!("{s:?}"))
        .into_inner()
}

fn state(s: &pb::Sandbox) -> SandboxState {
    SandboxState::try_from(s.state).unwrap_or(SandboxState::StateUnspecified)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtime_calls_resume_forward_and_hold_off_idle() {
    // The fake aether.
    let al = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let aether_addr = al
        .local_addr()
        .unwrap_or_else(|e| panic!("{e}"))
        .to_string();
    let aether_down = Shutdown::new();
    let at = tokio::spawn(rpc::serve::serve(
        rpc::serve::builder(None, rpc::acl::Policy::Public)
            .unwrap()
            .add_service(pb::runtime_server::RuntimeServer::new(Aether)),
        al,
        aether_down.clone(),
    ));
    let vm = Arc::new(Vm {
        aether: rpc::client::channel(&aether_addr, Duration::from_secs(2))
            .unwrap_or_else(|e| panic!("{e}")),
        ops: Mutex::new(vec![]),
    });

    // The edge, with that backend.
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let cfg: Config = serde_json::from_value(serde_json::json!({
        "service_token": TOKEN,
        "edge_template": {"state_dir": dir.path().display().to_string(), "mem_reserve_mb": -1, "disk_reserve_mb": -1,
                          "capacity": {"cpu_cores": 8, "memory_mb": 8192}, "backends": {"vm": {"runtime": "firecracker", "kernel": "/k"}}}
    }))
    .unwrap_or_else(|e| panic!("{e}"));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let addr = l.local_addr().unwrap_or_else(|e| panic!("{e}")).to_string();
    let shutdown = Shutdown::new();
    let mut backends: BTreeMap<String, Arc<dyn Backend>> = BTreeMap::new();
    backends.insert("vm".into(), vm.clone());
    let edge = opendsec::roles::edge::start_with_backends(
        Arc::new(cfg),
        "e7".into(),
        backends,
        l,
        shutdown.clone(),
        Ready::default(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let ch = rpc::client::channel(&addr, Duration::from_secs(2)).unwrap_or_else(|e| panic!("{e}"));
    let mut c = EdgeClient::new(ch.clone());
    let mut rt = RuntimeClient::new(ch);

    let spec = pb::SandboxSpec {
        backend: "vm".into(),
        memory_limit_mb: 512,
        ttl_running_stop: 1,
        ..Default::default()
    };
    let item = pb::EdgeCreateItem {
        sandbox_id: "e7.a".into(),
        lease_id: "L".into(),
        project: "root".into(),
        principal: "p".into(),
    };
    let out = c
        .create_sandboxes(req(pb::EdgeCreateRequest {
            fork: None,
            spec: Some(spec),
            items: vec![item],
        }))
        .await
        .unwrap_or_else(|s| panic!("{s:?}"))
        .into_inner();
    assert!(out.results[0].error.is_none(), "{:?}", out.results[0]);
    assert!(
        dir.path().join("edges/e7/sandboxes/e7.a.json").exists(),
        "persist_state defaults to on with a real backend"
    );

    // A call to a paused sandbox resumes it first, then is forwarded unchanged.
    let p = c
        .pause_sandbox(req(pb::SandboxRef { id: "e7.a".into() }))
        .await
        .unwrap_or_else(|s| panic!("{s:?}"))
        .into_inner();
    assert_eq!(state(&p), SandboxState::Paused);
    let r = rt
        .run_shell(req(pb::RunShellRequest {
            sandbox_id: "e7.a".into(),
            cmd: "echo hi".into(),
            ..Default::default()
        }))
        .await
        .unwrap_or_else(|s| panic!("{s:?}"))
        .into_inner();
    assert_eq!(r.stdout, b"e7.a:echo hi");
    assert_eq!(state(&get(&mut c, "e7.a").await), SandboxState::Running);
    let ops = vm.ops.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert_eq!(ops, vec!["create e7.a", "pause e7.a", "resume e7.a"]);

    // The agent's errors reach the caller with their reason.
    let e = rt
        .run_shell(req(pb::RunShellRequest {
            sandbox_id: "e7.a".into(),
            session: "missing".into(),
            ..Default::default()
        }))
        .await;
    assert_eq!(
        e.err().map(|s| failure_from_status(&s).reason),
        Some(Reason::NotFound)
    );
    let e = rt
        .run_shell(req(pb::RunShellRequest {
            sandbox_id: "e7.nope".into(),
            ..Default::default()
        }))
        .await;
    assert_eq!(
        e.err().map(|s| failure_from_status(&s).reason),
        Some(Reason::NotFound)
    );

    // A 3-second stream keeps the 1-second idle timeout from stopping the sandbox.
    let mut s = rt
        .stream_shell(req(pb::RunShellRequest {
            sandbox_id: "e7.a".into(),
            cmd: "slow".into(),
            ..Default::default()
        }))
        .await
        .unwrap_or_else(|s| panic!("{s:?}"))
        .into_inner();
    let mut got = Vec::new();
    while let Some(m) = s.next().await {
        if let Some(pb::shell_chunk::Kind::Stdout(b)) = m.unwrap_or_else(|s| panic!("{s:?}")).kind {
            got.extend(b);
        }
    }
    assert_eq!(got, b"01234");
    let after = get(&mut c, "e7.a").await;
    assert_eq!(state(&after), SandboxState::Running, "{after:?}");

    // ConnectPort: a paused sandbox is resumed, frames pass both ways (half-close
    // included), and the open connection keeps the 1-second idle timeout off for 2 s.
    let service = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let port = service
        .local_addr()
        .unwrap_or_else(|e| panic!("{e}"))
        .port();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        if let Ok((mut sock, _)) = service.accept().await {
            let mut got = Vec::new();
            let _ = sock.read_to_end(&mut got).await;
            tokio::time::sleep(Duration::from_secs(2)).await;
            let _ = sock
                .write_all(format!("{} bytes", got.len()).as_bytes())
                .await;
        }
    });
    c.pause_sandbox(req(pb::SandboxRef { id: "e7.a".into() }))
        .await
        .unwrap_or_else(|s| panic!("{s:?}"));
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let frame = |data: &[u8], eof: bool| pb::PortFrame {
        data: data.to_vec(),
        eof,
        ..Default::default()
    };
    tx.send(pb::PortFrame {
        sandbox_id: "e7.a".into(),
        port: u32::from(port),
        data: b"abc".to_vec(),
        eof: false,
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let mut back = rt
        .connect_port(req(tokio_stream::wrappers::ReceiverStream::new(rx)))
        .await
        .unwrap_or_else(|s| panic!("{s:?}"))
        .into_inner();
    let connected = back.next().await.and_then(|m| m.ok());
    assert_eq!(
        connected.map(|f| (f.port, f.data.len(), f.eof)),
        Some((u32::from(port), 0, false))
    );
    tx.send(frame(&[7u8; 100_000], false))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    tx.send(frame(b"", true))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut got = Vec::new();
    let mut eof = false;
    while let Some(m) = back.next().await {
        let f = m.unwrap_or_else(|s| panic!("{s:?}"));
        got.extend(f.data);
        eof |= f.eof;
    }
    assert_eq!((got.as_slice(), eof), (&b"100003 bytes"[..], true));
    assert_eq!(state(&get(&mut c, "e7.a").await), SandboxState::Running);
    // Nothing listening there any more: `unavailable`, with the reason.
    let e = rt
        .connect_port(req(tokio_stream::once(pb::PortFrame {
            sandbox_id: "e7.a".into(),
            port: u32::from(port),
            ..Default::default()
        })))
        .await
        .err()
        .map(|s| failure_from_status(&s));
    assert_eq!(
        e.as_ref().map(|f| f.reason),
        Some(Reason::Unavailable),
        "{e:?}"
    );
    assert!(e.is_some_and(|f| f.message.contains("nothing listens on it")));

    // Shutdown without keep_sandboxes_on_exit stops real sandboxes.
    shutdown.fire();
    tokio::time::timeout(Duration::from_secs(30), edge)
        .await
        .unwrap_or_else(|_| panic!("edge did not stop"))
        .unwrap_or_else(|e| panic!("{e}"));
    let ops = vm.ops.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert!(ops.last().is_some_and(|o| o == "stop e7.a"), "{ops:?}");
    aether_down.fire();
    let _ = at.await;
}
