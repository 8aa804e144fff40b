//! Control-plane errors as E2B's SDKs parse them: an HTTP status and the JSON body
//! `{"code": <status>, "message": "..."}` on every failure (docs/e2b.md "Errors").

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::types::{Failure, Reason};

/// One failed control-plane call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status, also the body's `code` (the JS SDK reads the body, Python the status).
    pub status: u16,
    pub message: String,
    /// E2B's `error_code`, for the few cases SDKs or callers tell apart.
    pub error_code: Option<&'static str>,
    /// Whether the Python SDK may send the same request again. It replays 429, 502, 503
    /// and 504 unless told `Should-Retry: false`, creations included, so a failure after
    /// which something may exist says false.
    pub retry: bool,
}

impl ApiError {
    pub fn new(status: u16, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            error_code: None,
            retry: false,
        }
    }
    /// 400: a malformed request or an option this gateway cannot honour.
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(400, message)
    }
    /// 401: no API key.
    pub fn unauthenticated(message: impl Into<String>) -> ApiError {
        ApiError::new(401, message)
    }
    /// 404 for a sandbox: its E2B id in the message, as E2B words it.
    pub fn sandbox_not_found(e2b_id: &str) -> ApiError {
        ApiError::new(
            404,
            format!("sandbox {} not found", crate::types::names::shown(e2b_id)),
        )
    }
}

impl From<Failure> for ApiError {
    /// A failure of the apiserver, by reason: `invalid` 400, `unauthenticated` 401,
    /// `forbidden` 403, `not_found` 404, `conflict` 409, `quota_exceeded` and `rate_limited`
    /// 429, `no_capacity` and `unavailable` 503, `timeout` 504, `internal` 500.
    fn from(f: Failure) -> ApiError {
        let (status, error_code, retry) = match f.reason {
            Reason::Invalid => (400, None, false),
            Reason::Unauthenticated => (401, None, false),
            Reason::Forbidden => (403, None, false),
            Reason::NotFound => (404, None, false),
            Reason::Conflict => (409, None, false),
            // A quota does not free itself within the SDK's few retries.
            Reason::QuotaExceeded => (429, None, false),
            Reason::RateLimited => (429, None, true),
            // Nothing was placed: a retry is safe and may find room.
            Reason::NoCapacity => (503, Some("sandbox_capacity_unavailable"), true),
            Reason::Unavailable => (503, None, false),
            Reason::Timeout => (504, None, false),
            Reason::Internal => (500, Some("internal_server_error"), false),
        };
        ApiError {
            status,
            message: format!("{}: {}", f.reason, f.message),
            error_code,
            retry,
        }
    }
}

impl From<tonic::Status> for ApiError {
    fn from(s: tonic::Status) -> ApiError {
        ApiError::from(crate::rpc::failure_from_status(&s))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut body = serde_json::json!({"code": self.status, "message": self.message});
        if let (Some(code), Some(obj)) = (self.error_code, body.as_object_mut()) {
            obj.insert("error_code".into(), code.into());
        }
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut r = (status, axum::Json(body)).into_response();
        let h = r.headers_mut();
        h.insert(
            "should-retry",
            HeaderValue::from_static(if self.retry { "true" } else { "false" }),
        );
        if self.status == 429 && self.retry {
            // The JS SDK replays a 429 only with a numeric Retry-After.
            h.insert("retry-after", HeaderValue::from_static("1"));
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_has_a_status_and_the_body_repeats_it() {
        let want = [
            (Reason::Invalid, 400),
            (Reason::Unauthenticated, 401),
            (Reason::Forbidden, 403),
            (Reason::NotFound, 404),
            (Reason::Conflict, 409),
            (Reason::QuotaExceeded, 429),
            (Reason::RateLimited, 429),
            (Reason::NoCapacity, 503),
            (Reason::Unavailable, 503),
            (Reason::Timeout, 504),
            (Reason::Internal, 500),
        ];
        assert_eq!(want.len(), Reason::ALL.len());
        for (r, status) in want {
            let e = ApiError::from(Failure::new(r, "why"));
            assert_eq!(e.status, status, "{r}");
            assert_eq!(e.message, format!("{r}: why"));
        }
    }

    #[tokio::test]
    async fn the_body_is_json_with_code_and_message_and_retries_are_said() {
        use http_body_util::BodyExt;
        let r = ApiError::from(Failure::new(Reason::NoCapacity, "full")).into_response();
        assert_eq!(r.status(), 503);
        assert_eq!(r.headers()["should-retry"], "true");
        let body = r.into_body().collect().await.unwrap().to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"code": 503, "message": "no_capacity: full",
                "error_code": "sandbox_capacity_unavailable"})
        );
        let r = ApiError::from(Failure::unavailable("edge gone")).into_response();
        assert_eq!(r.headers()["should-retry"], "false");
        let r = ApiError::from(Failure::new(Reason::RateLimited, "slow")).into_response();
        assert_eq!(r.headers()["retry-after"], "1");
    }
}
