//! The edge's DNS proxy (docs/network.md "DNS"): every DNS query a sandbox sends, to any
//! address, is redirected here (the `dns` chain of [`super::nft`]). The proxy tells the
//! sandbox by the query's source address (which the `guard` chain keeps honest) and answers
//! by its policy:
//!
//! - a name no rule allows gets NXDOMAIN and is never sent upstream, so a denied name cannot
//!   carry data out through the upstream resolvers;
//! - AAAA gets an empty answer: sandboxes have no IPv6;
//! - an allowed name is resolved upstream (with a cache), and the public IPv4 addresses of
//!   the answer join the sandbox's resolved sets **before** the answer is sent, so the first
//!   connection to an address it just resolved passes; private addresses in an answer are
//!   never added (no DNS rebinding), though the answer shows them.
//!
//! Server side is hickory-server over UDP and our own TCP front ([`super::dns_tcp`], which
//! caps connections per sandbox); upstream is hickory-resolver.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use hickory_resolver::config::{ConnectionConfig, NameServerConfig, ResolveHosts, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::net::{DnsError, NetError};
use hickory_resolver::TokioResolver;
use hickory_server::proto::op::{Edns, MessageType, Metadata, OpCode, ResponseCode};
use hickory_server::proto::rr::{DNSClass, RData, Record, RecordType};
use hickory_server::server::{Request, RequestHandler, ResponseHandler, ResponseInfo};
use hickory_server::zone_handler::MessageResponseBuilder;
use tracing::Instrument;

use super::network::Network;
use super::{is_public, Policy};

/// How long a TCP client may stay idle before the proxy closes its connection.
pub(super) const TCP_IDLE: Duration = Duration::from_secs(10);
/// How long one upstream exchange may take before the proxy answers SERVFAIL.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(3);

/// Why the proxy could not start.
#[derive(Debug, thiserror::Error)]
pub enum DnsProxyError {
    /// The UDP or TCP socket on `dns_port`.
    #[error("DNS proxy: listening on {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// The resolvers the proxy asks (`network.upstream_dns`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Upstream {
    /// The host's `/etc/resolv.conf`, read at start.
    System,
    /// These servers, over UDP with TCP for truncated answers.
    Servers(Vec<SocketAddr>),
}

impl Upstream {
    /// From `network.upstream_dns` (already parsed): empty means the host's resolvers.
    pub fn from_config(servers: Vec<SocketAddr>) -> Upstream {
        if servers.is_empty() {
            Upstream::System
        } else {
            Upstream::Servers(servers)
        }
    }

    /// The resolver, or why there is none (then allowed names get SERVFAIL).
    fn resolver(&self) -> Result<TokioResolver, String> {
        let mut builder = match self {
            Upstream::System => TokioResolver::builder_tokio().map_err(|e| {
                format!("reading the host's resolvers (/etc/resolv.conf): {e}; set network.upstream_dns")
            })?,
            Upstream::Servers(servers) => {
                let ns = servers
                    .iter()
                    .map(|a| {
                        let conn = |mut c: ConnectionConfig| {
                            c.port = a.port();
                            c
                        };
                        NameServerConfig::new(
                            a.ip(),
                            true,
                            vec![conn(ConnectionConfig::udp()), conn(ConnectionConfig::tcp())],
                        )
                    })
                    .collect();
                TokioResolver::builder_with_config(
                    ResolverConfig::from_name_servers(ns),
                    TokioRuntimeProvider::default(),
                )
            }
        };
        let o = builder.options_mut();
        // The host's /etc/hosts names the host's own services: not for sandboxes.
        o.use_hosts_file = ResolveHosts::Never;
        // Queries arrive fully qualified; the host's search domains must not add to them.
        o.ndots = 0;
        o.timeout = UPSTREAM_TIMEOUT;
        o.attempts = 1;
        o.preserve_intermediates = true;
        builder
            .build()
            .map_err(|e| format!("building the upstream resolver: {e}"))
    }
}

/// A running proxy; dropping it stops it (its sockets close).
pub struct DnsProxy {
    server: hickory_server::Server<Handler>,
    tcp: tokio::task::JoinHandle<()>,
    listen: SocketAddr,
}

impl Drop for DnsProxy {
    fn drop(&mut self) {
        self.tcp.abort();
    }
}

impl std::fmt::Debug for DnsProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DnsProxy")
            .field("listen", &self.listen)
            .finish()
    }
}

impl DnsProxy {
    /// Serves `net`'s sandboxes on UDP and TCP port `port` of every address of the caller's
    /// netns (the table's `in` chain admits only sandboxes to it), asking `upstream`. Needs a
    /// Tokio runtime. When the upstream resolver cannot be built (no resolv.conf), the proxy
    /// still runs: denied names get NXDOMAIN and allowed ones SERVFAIL, with a warning.
    /// Errors: [`DnsProxyError::Bind`] (the port is taken).
    pub async fn start(
        net: Arc<Network>,
        port: u16,
        upstream: &Upstream,
    ) -> Result<DnsProxy, DnsProxyError> {
        let listen = SocketAddr::from((Ipv4Addr::UNSPECIFIED, port));
        let bind_err = |source| DnsProxyError::Bind {
            addr: listen,
            source,
        };
        let udp = tokio::net::UdpSocket::bind(listen)
            .await
            .map_err(bind_err)?;
        let tcp = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(bind_err)?;
        let resolver = match upstream.resolver() {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::warn!(error = %e, "DNS proxy has no upstream: allowed names get SERVFAIL");
                None
            }
        };
        let handler = Handler { net, resolver };
        let tcp = super::dns_tcp::spawn(tcp, handler.clone(), TCP_IDLE);
        let mut server = hickory_server::Server::new(handler);
        server.register_socket(udp);
        tracing::info!(%listen, ?upstream, "DNS proxy on");
        Ok(DnsProxy {
            server,
            tcp,
            listen,
        })
    }

    /// The address it listens on.
    pub fn listen_addr(&self) -> SocketAddr {
        self.listen
    }

    /// Stops serving and waits for the sockets to close.
    pub async fn stop(mut self) {
        self.tcp.abort();
        if let Err(e) = self.server.shutdown_gracefully().await {
            tracing::debug!(error = %e, "DNS proxy shutdown");
        }
    }
}

#[derive(Clone)]
struct Handler {
    net: Arc<Network>,
    resolver: Option<TokioResolver>,
}

/// What the proxy answers one query with.
enum Answer {
    Code(ResponseCode),
    Records {
        answers: Vec<Record>,
        authorities: Vec<Record>,
    },
    Empty(ResponseCode, Vec<Record>),
}

impl Handler {
    /// The answer to `name`/`qtype` for the sandbox in `slot` under `policy`; see the module
    /// doc.
    async fn answer(
        &self,
        slot: u32,
        policy: &Policy,
        name: &hickory_server::proto::rr::LowerName,
        qtype: RecordType,
    ) -> Answer {
        let shown = name.to_string();
        // Rules compare names as dotted text, so a label holding a dot (`x\.allowed` +
        // `test`, which reads as `x.allowed.test`) or any other byte a host name cannot have
        // would pass for a name it is not. Such names are denied like any other.
        if !is_host_name(name) || !policy.allows_name(&shown) {
            tracing::debug!(name = %shown, "denied");
            return Answer::Code(ResponseCode::NXDomain);
        }
        match qtype {
            RecordType::AAAA => return Answer::Empty(ResponseCode::NoError, Vec::new()),
            // Zone transfers and the like are not for sandboxes.
            RecordType::AXFR | RecordType::IXFR | RecordType::ANY | RecordType::OPT => {
                return Answer::Code(ResponseCode::Refused)
            }
            _ => {}
        }
        let Some(resolver) = &self.resolver else {
            return Answer::Code(ResponseCode::ServFail);
        };
        let lookup = match resolver
            .lookup(hickory_server::proto::rr::Name::from(name.clone()), qtype)
            .await
        {
            Ok(l) => l,
            Err(NetError::Dns(DnsError::NoRecordsFound(nr))) => {
                let soa = nr
                    .soa
                    .map(|s| s.into_record_of_rdata())
                    .into_iter()
                    .collect();
                return Answer::Empty(nr.response_code, soa);
            }
            Err(NetError::Dns(DnsError::ResponseCode(rc))) => return Answer::Code(rc),
            Err(e) => {
                tracing::debug!(name = %shown, error = %e, "upstream failed");
                return Answer::Code(ResponseCode::ServFail);
            }
        };
        let answers: Vec<Record> = lookup.answers().to_vec();
        let public: Vec<Ipv4Addr> = answers
            .iter()
            .filter_map(|r| match &r.data {
                RData::A(a) if is_public(a.0) => Some(a.0),
                _ => None,
            })
            .collect();
        let limits = policy.name_limits(&shown);
        // Under `*` alone public addresses pass already; the sets are for domain rules.
        if !public.is_empty() && !limits.is_empty() {
            if let Err(e) = self.net.add_resolved(slot, limits, public).await {
                tracing::warn!(name = %shown, error = %crate::types::chain(&e), "allowing resolved addresses");
                return Answer::Code(ResponseCode::ServFail);
            }
        }
        Answer::Records {
            answers,
            authorities: lookup.authorities().to_vec(),
        }
    }
}

/// Whether every label of `name` holds only letters, digits, `-` and `_` (service labels
/// such as `_http._tcp`): what names in rules can be.
fn is_host_name(name: &hickory_server::proto::rr::LowerName) -> bool {
    hickory_server::proto::rr::Name::from(name.clone())
        .iter()
        .all(|label| {
            !label.is_empty()
                && label
                    .iter()
                    .all(|b| b.is_ascii_alphanumeric() || *b == b'-' || *b == b'_')
        })
}

#[async_trait::async_trait]
impl RequestHandler for Handler {
    async fn handle_request<R: ResponseHandler, T: hickory_server::net::runtime::Time>(
        &self,
        request: &Request,
        mut response: R,
    ) -> ResponseInfo {
        let src = request.src();
        let span = tracing::debug_span!("dns", %src, id = request.metadata.id);
        async move {
            let mut meta = Metadata::response_from_request(&request.metadata);
            meta.recursion_available = true;
            let queries = request.queries.queries();
            let sandbox = match src.ip() {
                IpAddr::V4(a) => self.net.sandbox_policy(a),
                IpAddr::V6(_) => None,
            };
            let answer = match (sandbox, queries) {
                // Only sandboxes get answers: anything else that reaches the port (the
                // table lets nothing else in) is refused.
                (None, _) => Answer::Code(ResponseCode::Refused),
                _ if request.metadata.message_type != MessageType::Query => {
                    Answer::Code(ResponseCode::FormErr)
                }
                _ if request.metadata.op_code != OpCode::Query => {
                    Answer::Code(ResponseCode::NotImp)
                }
                (Some((slot, policy)), [q]) if q.query_class() == DNSClass::IN => {
                    self.answer(slot, &policy, q.name(), q.query_type()).await
                }
                (Some(_), [_]) => Answer::Code(ResponseCode::Refused),
                (Some(_), _) => Answer::Code(ResponseCode::FormErr),
            };
            let mut edns = None;
            if let Some(req) = &request.edns {
                let mut e = Edns::new();
                e.set_max_payload(req.max_payload().max(512));
                edns = Some(e);
            }
            let mut builder = MessageResponseBuilder::new(&request.queries, None);
            if let Some(e) = &edns {
                builder.edns(e);
            }
            let sent = match &answer {
                Answer::Code(rc) => {
                    meta.response_code = *rc;
                    response.send_response(builder.build_no_records(meta)).await
                }
                Answer::Empty(rc, soa) => {
                    meta.response_code = *rc;
                    let none: &[Record] = &[];
                    response
                        .send_response(builder.build(meta, none, none, soa.iter(), none))
                        .await
                }
                Answer::Records {
                    answers,
                    authorities,
                } => {
                    let none: &[Record] = &[];
                    response
                        .send_response(builder.build(
                            meta,
                            answers.iter(),
                            authorities.iter(),
                            none,
                            none,
                        ))
                        .await
                }
            };
            match sent {
                Ok(info) => info,
                Err(e) => {
                    tracing::debug!(error = %e, "sending a DNS answer");
                    ResponseInfo::from(hickory_server::proto::op::Header {
                        metadata: meta,
                        counts: Default::default(),
                    })
                }
            }
        }
        .instrument(span)
        .await
    }
}
