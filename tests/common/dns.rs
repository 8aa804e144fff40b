//! DNS for the network tests: a test upstream server (the "internet"'s resolver, which logs
//! every query it gets) and a client that asks from a sandbox's netns, over UDP or TCP. Only
//! inside namespaces the test made.

use std::fs::File;
use std::io::ErrorKind;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hickory_server::proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_server::proto::rr::rdata::{A, CNAME};
use hickory_server::proto::rr::{Name, RData, Record, RecordType};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::netns::{in_ns, PRIVATE, PUBLIC_A, PUBLIC_B};

/// Where the test upstream listens (UDP and TCP port 53), in the internet netns only.
pub const UPSTREAM: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 53);

/// A name of 253 characters (the most DNS allows), under `long.test`.
pub fn long_name() -> String {
    let label = "a".repeat(63);
    // 4 labels of 63 + dots = 255 > 253: three of 63, then fill to 253 with `long.test`.
    let mut n = format!("{label}.{label}.{label}.");
    let rest = 253 - n.len() - "long.test".len() - 1;
    n.push_str(&"b".repeat(rest));
    n.push_str(".long.test");
    assert_eq!(n.len(), 253);
    n
}

/// The test zone: name → its records. `public.test` → PUBLIC_A; `other.test` → PUBLIC_B;
/// `private.test` → PRIVATE; `mixed.test` → PUBLIC_B and PRIVATE; `alias.test` → CNAME
/// `public.test`; the [`long_name`] → PUBLIC_B; `sub.public.test` → PUBLIC_A. Everything else
/// is NXDOMAIN.
fn zone(name: &str) -> Option<Vec<RData>> {
    let a = |x: Ipv4Addr| RData::A(A(x));
    let n = name.trim_end_matches('.').to_ascii_lowercase();
    Some(match n.as_str() {
        "public.test" | "sub.public.test" => vec![a(PUBLIC_A)],
        "other.test" => vec![a(PUBLIC_B)],
        "private.test" => vec![a(PRIVATE)],
        "mixed.test" => vec![a(PUBLIC_B), a(PRIVATE)],
        "alias.test" => vec![RData::CNAME(CNAME(
            Name::from_ascii("public.test.").unwrap(),
        ))],
        _ if n == long_name() => vec![a(PUBLIC_B)],
        _ => return None,
    })
}

fn answer(req: &Message) -> Message {
    let mut resp = Message::response(req.metadata.id, OpCode::Query);
    resp.metadata.recursion_available = true;
    resp.metadata.recursion_desired = req.metadata.recursion_desired;
    resp.queries = req.queries.clone();
    let Some(q) = req.queries.first() else {
        resp.metadata.response_code = ResponseCode::FormErr;
        return resp;
    };
    match zone(&q.name().to_ascii()) {
        None => resp.metadata.response_code = ResponseCode::NXDomain,
        Some(rdatas) => {
            for rd in rdatas {
                let is_cname = matches!(rd, RData::CNAME(_));
                if is_cname || rd.record_type() == q.query_type() {
                    resp.answers
                        .push(Record::from_rdata(q.name().clone(), 60, rd.clone()));
                }
                if let (RData::CNAME(c), RecordType::A) = (&rd, q.query_type()) {
                    for t in zone(&c.0.to_ascii()).unwrap_or_default() {
                        resp.answers.push(Record::from_rdata(c.0.clone(), 60, t));
                    }
                }
            }
        }
    }
    resp
}

/// What the test upstream was asked: (name without the trailing dot, lower case; "udp" or
/// "tcp").
pub type QueryLog = Arc<Mutex<Vec<(String, &'static str)>>>;

fn log(l: &QueryLog, m: &Message, proto: &'static str) {
    for q in &m.queries {
        let n = q
            .name()
            .to_ascii()
            .trim_end_matches('.')
            .to_ascii_lowercase();
        l.lock().unwrap().push((n, proto));
    }
}

/// Starts the test upstream on [`UPSTREAM`]:53 (UDP and TCP) in netns `internet` (adding the
/// address to its `lo`), for the life of the process. Returns its query log.
pub fn serve_upstream(internet: &File) -> QueryLog {
    let out: QueryLog = Arc::default();
    let l = out.clone();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    in_ns(internet, move || {
        Box::pin(async move {
            let _ = std::process::Command::new("ip")
                .args(["addr", "add", &format!("{UPSTREAM}/32"), "dev", "lo"])
                .status();
            let udp = Arc::new(tokio::net::UdpSocket::bind((UPSTREAM, 53)).await.unwrap());
            let tcp = tokio::net::TcpListener::bind((UPSTREAM, 53)).await.unwrap();
            ready_tx.send(()).unwrap();
            let lu = l.clone();
            let udp_task = tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                while let Ok((n, from)) = udp.recv_from(&mut buf).await {
                    let Ok(m) = Message::from_vec(&buf[..n]) else {
                        continue;
                    };
                    log(&lu, &m, "udp");
                    let _ = udp.send_to(&answer(&m).to_vec().unwrap(), from).await;
                }
            });
            loop {
                let Ok((mut s, _)) = tcp.accept().await else {
                    break;
                };
                let lt = l.clone();
                tokio::spawn(async move {
                    loop {
                        let mut len = [0u8; 2];
                        if s.read_exact(&mut len).await.is_err() {
                            break;
                        }
                        let mut buf = vec![0u8; u16::from_be_bytes(len) as usize];
                        if s.read_exact(&mut buf).await.is_err() {
                            break;
                        }
                        let Ok(m) = Message::from_vec(&buf) else {
                            break;
                        };
                        log(&lt, &m, "tcp");
                        let out = answer(&m).to_vec().unwrap();
                        let mut framed = (out.len() as u16).to_be_bytes().to_vec();
                        framed.extend(out);
                        if s.write_all(&framed).await.is_err() {
                            break;
                        }
                    }
                });
            }
            udp_task.abort();
        })
    });
    ready_rx.recv().unwrap();
    out
}

/// One answer as the tests compare it: the response code and the A/CNAME data as text
/// (`A 192.0.2.10`, `CNAME public.test.`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub code: ResponseCode,
    pub records: Vec<String>,
    /// TC: the answer did not fit (UDP without EDNS holds 512 bytes); ask again over TCP.
    pub truncated: bool,
}

fn parse(buf: &[u8]) -> std::io::Result<Answer> {
    let m = Message::from_vec(buf).map_err(|e| std::io::Error::new(ErrorKind::InvalidData, e))?;
    if m.metadata.message_type != MessageType::Response {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            "not a response",
        ));
    }
    Ok(Answer {
        code: m.metadata.response_code,
        records: m
            .answers
            .iter()
            .map(|r| match &r.data {
                RData::A(a) => format!("A {}", a.0),
                RData::CNAME(c) => format!("CNAME {}", c.0),
                other => format!("{} {other}", other.record_type()),
            })
            .collect(),
        truncated: m.metadata.truncation,
    })
}

/// How long a query waits for its answer before it counts as dropped.
pub const NO_ANSWER_AFTER: Duration = Duration::from_millis(1500);

/// Asks `server`:`port` for `name`/`rtype` from netns `ns`, over TCP when `tcp`. The
/// answer, or the error (`TimedOut` when nothing came back).
pub fn ask(
    ns: &File,
    server: SocketAddr,
    name: &str,
    rtype: RecordType,
    tcp: bool,
) -> std::io::Result<Answer> {
    let mut m = Message::query();
    m.metadata.recursion_desired = true;
    m.add_query(Query::query(Name::from_ascii(name).unwrap(), rtype));
    let bytes = m.to_vec().unwrap();
    in_ns(ns, move || {
        Box::pin(async move {
            let timed_out = |_| std::io::Error::from(ErrorKind::TimedOut);
            if tcp {
                let mut s =
                    tokio::time::timeout(NO_ANSWER_AFTER, tokio::net::TcpStream::connect(server))
                        .await
                        .map_err(timed_out)??;
                let mut framed = (bytes.len() as u16).to_be_bytes().to_vec();
                framed.extend(&bytes);
                s.write_all(&framed).await?;
                let mut len = [0u8; 2];
                tokio::time::timeout(NO_ANSWER_AFTER, s.read_exact(&mut len))
                    .await
                    .map_err(timed_out)??;
                let mut buf = vec![0u8; u16::from_be_bytes(len) as usize];
                s.read_exact(&mut buf).await?;
                parse(&buf)
            } else {
                let sock = tokio::net::UdpSocket::bind(("0.0.0.0", 0)).await?;
                sock.send_to(&bytes, server).await?;
                let mut buf = vec![0u8; 4096];
                let (n, _) = tokio::time::timeout(NO_ANSWER_AFTER, sock.recv_from(&mut buf))
                    .await
                    .map_err(timed_out)??;
                parse(&buf[..n])
            }
        })
    })
    .join()
    .unwrap()
}
