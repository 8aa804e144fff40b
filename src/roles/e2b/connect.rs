//! The Connect protocol as E2B's SDKs speak it to envd (docs/e2b.md "The in-sandbox API"):
//! unary calls (a bare JSON or protobuf body), server streams and client streams (messages in
//! envelopes: a flags byte, a big-endian u32 length, the payload; the server's stream ends
//! with an end-of-stream envelope carrying `{}` or the error). Errors of unary calls are an
//! HTTP status and `{"code": "<connect code>", "message": ...}`; errors of streams travel in
//! the end-of-stream envelope with HTTP 200, which is what both SDKs read.
//!
//! Our own, small: what the SDKs need is a handful of exact behaviours (in-band stream
//! errors, keepalive events, client streams without an end envelope) that the young Rust
//! Connect libraries do not all offer, and the wire format is a few lines.

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::{Stream, StreamExt};

use crate::types::{Failure, Reason};

/// Flag of the envelope that ends a server's stream.
const END_STREAM: u8 = 0x02;
/// Flag of a compressed payload (never sent by the SDKs, which ask for identity).
const COMPRESSED: u8 = 0x01;
/// The largest message accepted (as the apiserver's).
const MAX_MESSAGE: usize = crate::rpc::MAX_MESSAGE;

/// How messages are written: protobuf's canonical JSON (both SDKs) or its binary form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    Json,
    Proto,
}

/// A Connect error code (the strings of the Connect protocol).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Canceled,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Unimplemented,
    Internal,
    Unavailable,
    Unauthenticated,
}

impl Code {
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status of a unary error with this code (the Connect protocol's table).
    pub fn http_status(self) -> StatusCode {
        match self {
            Code::Canceled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            Code::InvalidArgument => StatusCode::BAD_REQUEST,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists => StatusCode::CONFLICT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::FailedPrecondition => StatusCode::PRECONDITION_FAILED,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }
}

/// A failed envd call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectError {
    pub code: Code,
    pub message: String,
}

impl ConnectError {
    pub fn new(code: Code, message: impl Into<String>) -> ConnectError {
        ConnectError {
            code,
            message: message.into(),
        }
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({"code": self.code.as_str(), "message": self.message})
    }
}

impl From<Failure> for ConnectError {
    /// By reason: `not_found` not_found, `invalid` invalid_argument, `unauthenticated`
    /// unauthenticated, `forbidden` permission_denied, `quota_exceeded`, `rate_limited` and
    /// `no_capacity` resource_exhausted, `timeout` deadline_exceeded, `conflict`
    /// failed_precondition, `unavailable` unavailable, `internal` internal.
    fn from(f: Failure) -> ConnectError {
        let code = match f.reason {
            Reason::NotFound => Code::NotFound,
            Reason::Invalid => Code::InvalidArgument,
            Reason::Unauthenticated => Code::Unauthenticated,
            Reason::Forbidden => Code::PermissionDenied,
            Reason::QuotaExceeded | Reason::RateLimited | Reason::NoCapacity => {
                Code::ResourceExhausted
            }
            Reason::Timeout => Code::DeadlineExceeded,
            Reason::Conflict => Code::FailedPrecondition,
            Reason::Unavailable => Code::Unavailable,
            Reason::Internal => Code::Internal,
        };
        ConnectError::new(code, format!("{}: {}", f.reason, f.message))
    }
}

impl From<tonic::Status> for ConnectError {
    fn from(s: tonic::Status) -> ConnectError {
        ConnectError::from(crate::rpc::failure_from_status(&s))
    }
}

impl IntoResponse for ConnectError {
    /// The unary form: the code's HTTP status and the JSON error.
    fn into_response(self) -> Response {
        (self.code.http_status(), axum::Json(self.json())).into_response()
    }
}

/// A message both codecs can carry.
pub trait Msg: prost::Message + Default + serde::Serialize + serde::de::DeserializeOwned {}
impl<T: prost::Message + Default + serde::Serialize + serde::de::DeserializeOwned> Msg for T {}

/// The codec of a request and whether it is a stream (`application/connect+...`).
/// Errors: `invalid_argument` for another content type (a 415 in spirit; the SDKs never
/// send one).
pub fn codec_of(headers: &HeaderMap) -> Result<(Codec, bool), ConnectError> {
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("application/json");
    let base = ct.split(';').next().unwrap_or_default().trim();
    Ok(match base {
        "application/json" | "" => (Codec::Json, false),
        "application/proto" => (Codec::Proto, false),
        "application/connect+json" => (Codec::Json, true),
        "application/connect+proto" => (Codec::Proto, true),
        other => {
            return Err(ConnectError::new(
                Code::InvalidArgument,
                format!(
                    "content type {} is not one of Connect's",
                    crate::types::names::shown(other)
                ),
            ))
        }
    })
}

/// Decodes one message. Errors: `invalid_argument` naming what is wrong.
pub fn decode<T: Msg>(codec: Codec, bytes: &[u8]) -> Result<T, ConnectError> {
    let bad = |e: String| ConnectError::new(Code::InvalidArgument, format!("bad message: {e}"));
    match codec {
        Codec::Json if bytes.iter().all(u8::is_ascii_whitespace) => Ok(T::default()),
        Codec::Json => serde_json::from_slice(bytes).map_err(|e| bad(e.to_string())),
        Codec::Proto => T::decode(bytes).map_err(|e| bad(e.to_string())),
    }
}

/// Encodes one message.
pub fn encode<T: Msg>(codec: Codec, msg: &T) -> Vec<u8> {
    match codec {
        // Serializing generated messages cannot fail: no maps with non-string keys.
        Codec::Json => serde_json::to_vec(msg).unwrap_or_else(|_| b"{}".to_vec()),
        Codec::Proto => msg.encode_to_vec(),
    }
}

/// One envelope around `payload`.
pub fn envelope(flags: u8, payload: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(5 + payload.len());
    out.push(flags);
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    Bytes::from(out)
}

/// The envelope that ends a server stream: `{}` or the error.
pub fn end_envelope(err: Option<&ConnectError>) -> Bytes {
    let body = match err {
        None => serde_json::json!({}),
        Some(e) => serde_json::json!({"error": e.json()}),
    };
    envelope(END_STREAM, body.to_string().as_bytes())
}

/// Reads the envelopes of a request body as they arrive.
pub struct Envelopes {
    body: axum::body::BodyDataStream,
    buf: Vec<u8>,
    done: bool,
}

impl Envelopes {
    pub fn new(body: Body) -> Envelopes {
        Envelopes {
            body: body.into_data_stream(),
            buf: Vec::new(),
            done: false,
        }
    }

    /// The next message's payload; `None` at the end of the body (or at an end envelope).
    /// Errors: `invalid_argument` for a broken envelope, a compressed or oversized message.
    pub async fn next(&mut self) -> Result<Option<Vec<u8>>, ConnectError> {
        loop {
            if let Some(head) = self.buf.get(..5) {
                let flags = head.first().copied().unwrap_or(0);
                let mut len = [0u8; 4];
                len.copy_from_slice(head.get(1..5).unwrap_or(&[0; 4]));
                let len = u32::from_be_bytes(len) as usize;
                if len > MAX_MESSAGE {
                    return Err(ConnectError::new(
                        Code::ResourceExhausted,
                        format!("a message of {len} bytes is over the {MAX_MESSAGE} allowed"),
                    ));
                }
                if flags & COMPRESSED != 0 {
                    return Err(ConnectError::new(
                        Code::Unimplemented,
                        "compressed messages are not accepted; send identity",
                    ));
                }
                if self.buf.len() >= 5 + len {
                    let payload = self.buf.get(5..5 + len).unwrap_or_default().to_vec();
                    self.buf.drain(..5 + len);
                    if flags & END_STREAM != 0 {
                        self.done = true;
                        return Ok(None);
                    }
                    return Ok(Some(payload));
                }
            }
            if self.done {
                if self.buf.is_empty() {
                    return Ok(None);
                }
                return Err(ConnectError::new(
                    Code::InvalidArgument,
                    "the body ends inside an envelope",
                ));
            }
            match self.body.next().await {
                Some(Ok(chunk)) => self.buf.extend_from_slice(&chunk),
                Some(Err(e)) => {
                    return Err(ConnectError::new(
                        Code::Canceled,
                        format!("reading the request: {e}"),
                    ))
                }
                None => self.done = true,
            }
        }
    }
}

/// The one request message of a unary call or a server stream.
/// Errors: as [`decode`] and [`Envelopes::next`]; `invalid_argument` for a stream without a
/// message.
pub async fn request<T: Msg>(codec: Codec, stream: bool, body: Body) -> Result<T, ConnectError> {
    if stream {
        let mut env = Envelopes::new(body);
        let first = env.next().await?.ok_or_else(|| {
            ConnectError::new(Code::InvalidArgument, "the stream holds no request message")
        })?;
        decode(codec, &first)
    } else {
        let bytes = axum::body::to_bytes(body, MAX_MESSAGE).await.map_err(|e| {
            ConnectError::new(Code::InvalidArgument, format!("reading the request: {e}"))
        })?;
        decode(codec, &bytes)
    }
}

fn content_type(codec: Codec, stream: bool) -> HeaderValue {
    HeaderValue::from_static(match (codec, stream) {
        (Codec::Json, false) => "application/json",
        (Codec::Proto, false) => "application/proto",
        (Codec::Json, true) => "application/connect+json",
        (Codec::Proto, true) => "application/connect+proto",
    })
}

/// A unary call's answer.
pub fn unary<T: Msg>(codec: Codec, r: Result<T, ConnectError>) -> Response {
    match r {
        Ok(m) => {
            let mut resp = Response::new(Body::from(encode(codec, &m)));
            resp.headers_mut()
                .insert(header::CONTENT_TYPE, content_type(codec, false));
            resp
        }
        Err(e) => e.into_response(),
    }
}

/// A server stream's answer: each message in an envelope as `messages` yields it, then the
/// end envelope (with the error that ended it, if one did). HTTP 200 either way.
pub fn server_stream<S>(codec: Codec, messages: S) -> Response
where
    S: Stream<Item = Result<Vec<u8>, ConnectError>> + Send + 'static,
{
    let frames =
        futures::stream::unfold((Box::pin(messages), false), |(mut s, ended)| async move {
            if ended {
                return None;
            }
            match s.next().await {
                Some(Ok(m)) => Some((envelope(0, &m), (s, false))),
                Some(Err(e)) => Some((end_envelope(Some(&e)), (s, true))),
                None => Some((end_envelope(None), (s, true))),
            }
        })
        .map(Ok::<Bytes, std::convert::Infallible>);
    let mut resp = Response::new(Body::from_stream(frames));
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, content_type(codec, true));
    resp
}

/// A failed stream before its first message: HTTP 200 and the end envelope alone.
pub fn stream_error(codec: Codec, e: ConnectError) -> Response {
    server_stream(codec, futures::stream::once(async move { Err(e) }))
}

/// A failed call before it ran: in the stream's end envelope for a stream, else as a unary
/// error.
pub fn failed(codec: Codec, stream: bool, e: ConnectError) -> Response {
    if stream {
        stream_error(codec, e)
    } else {
        e.into_response()
    }
}

/// The call's deadline (`connect-timeout-ms`), if it has one.
pub fn timeout(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get("connect-timeout-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_millis)
}

/// How long a stream may stay silent before a keepalive event (`Keepalive-Ping-Interval`,
/// seconds; 90 when absent or not a number, as envd does).
pub fn keepalive(headers: &HeaderMap) -> Duration {
    let s = headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|s| *s > 0)
        .unwrap_or(90);
    Duration::from_secs(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::envd::process::{process_event, ProcessEvent, StartRequest, StartResponse};

    #[test]
    fn messages_take_both_codecs_and_canonical_json() {
        let json = br#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"],"envs":{"A":"1"}},"stdin":false}"#;
        let m: StartRequest = decode(Codec::Json, json).unwrap();
        assert_eq!(m.process.as_ref().unwrap().cmd, "/bin/bash");
        assert_eq!(m.stdin, Some(false));
        let back: StartRequest = decode(Codec::Proto, &encode(Codec::Proto, &m)).unwrap();
        assert_eq!(back, m);
        let out = StartResponse {
            event: Some(ProcessEvent {
                event: Some(process_event::Event::Start(process_event::StartEvent {
                    pid: 42,
                })),
            }),
        };
        assert_eq!(
            String::from_utf8(encode(Codec::Json, &out)).unwrap(),
            r#"{"event":{"start":{"pid":42}}}"#
        );
        assert!(decode::<StartRequest>(Codec::Json, b"{\"process\":5}").is_err());
        // Unknown fields are ignored, as connect-go's JSON codec does.
        assert!(decode::<StartRequest>(Codec::Json, b"{\"future\":1}").is_ok());
    }

    #[tokio::test]
    async fn envelopes_split_however_the_body_arrives() {
        let mut wire = envelope(0, b"one").to_vec();
        wire.extend_from_slice(&envelope(0, b"two!"));
        let chunks: Vec<Result<Bytes, std::io::Error>> = wire
            .chunks(3)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        let mut env = Envelopes::new(Body::from_stream(futures::stream::iter(chunks)));
        assert_eq!(env.next().await.unwrap().unwrap(), b"one");
        assert_eq!(env.next().await.unwrap().unwrap(), b"two!");
        assert_eq!(env.next().await.unwrap(), None);
        let cut = Body::from(envelope(0, b"whole").slice(..6));
        assert_eq!(
            Envelopes::new(cut).next().await.unwrap_err().code,
            Code::InvalidArgument
        );
        let zipped = Body::from(envelope(COMPRESSED, b"x"));
        assert_eq!(
            Envelopes::new(zipped).next().await.unwrap_err().code,
            Code::Unimplemented
        );
    }

    #[tokio::test]
    async fn a_stream_ends_with_its_end_envelope_and_errors_travel_in_it() {
        use http_body_util::BodyExt;
        let msgs = futures::stream::iter(vec![
            Ok(b"{\"a\":1}".to_vec()),
            Err(ConnectError::new(Code::DeadlineExceeded, "late")),
            Ok(b"never".to_vec()),
        ]);
        let r = server_stream(Codec::Json, msgs);
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["content-type"], "application/connect+json");
        let body = r.into_body().collect().await.unwrap().to_bytes();
        let mut want = envelope(0, b"{\"a\":1}").to_vec();
        want.extend_from_slice(&end_envelope(Some(&ConnectError::new(
            Code::DeadlineExceeded,
            "late",
        ))));
        assert_eq!(body.to_vec(), want);
        let tail = String::from_utf8(body.slice(5 + 7 + 5..).to_vec()).unwrap();
        assert_eq!(
            tail,
            r#"{"error":{"code":"deadline_exceeded","message":"late"}}"#
        );
    }
}
