//! The Connect protocol as E2B's SDKs speak it to envd: JSON messages, unary calls as plain
//! JSON bodies, streams as envelopes (`[flags:u8][len:u32 BE][json]`, flag 0x02 = end of
//! stream). No compression in either direction.

use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use futures::{Stream, StreamExt};
use serde::Serialize;

/// The largest request message accepted (a StreamInput chunk, a unary request).
pub const MAX_MESSAGE: usize = 16 << 20;
pub const END_STREAM: u8 = 0x02;
pub const STREAM_CONTENT_TYPE: &str = "application/connect+json";

/// A Connect error: a code from Connect's list and a message.
#[derive(Debug, Clone, PartialEq)]
pub struct ConnectError {
    pub code: Code,
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Canceled,
    Unknown,
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
            Code::Unknown => "unknown",
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

    /// Connect's HTTP status for the code (unary errors).
    pub fn http_status(self) -> StatusCode {
        match self {
            Code::Canceled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            Code::Unknown | Code::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Code::InvalidArgument | Code::FailedPrecondition => StatusCode::BAD_REQUEST,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists => StatusCode::CONFLICT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }
}

impl ConnectError {
    pub fn new(code: Code, message: impl Into<String>) -> ConnectError {
        ConnectError { code, message: message.into() }
    }
    pub fn invalid(message: impl Into<String>) -> ConnectError {
        ConnectError::new(Code::InvalidArgument, message)
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({"code": self.code.as_str(), "message": self.message})
    }

    /// The unary form: Connect's status for the code and `{"code","message"}`.
    pub fn unary_response(&self) -> Response {
        json_response(self.code.http_status(), &self.json())
    }
}

pub fn json_response<T: Serialize>(status: StatusCode, body: &T) -> Response {
    let bytes = serde_json::to_vec(body).unwrap_or_else(|_| b"{}".to_vec());
    let mut r = Response::new(Body::from(bytes));
    *r.status_mut() = status;
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

/// A unary success: 200 with the message as JSON.
pub fn unary_ok<T: Serialize>(msg: &T) -> Response {
    json_response(StatusCode::OK, msg)
}

/// One envelope around `json`.
pub fn envelope(flags: u8, json: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + json.len());
    b.put_u8(flags);
    b.put_u32(json.len() as u32);
    b.put_slice(json);
    b.freeze()
}

pub fn message<T: Serialize>(msg: &T) -> Bytes {
    envelope(0, &serde_json::to_vec(msg).unwrap_or_else(|_| b"{}".to_vec()))
}

/// The end-of-stream envelope: `{}` or `{"error": {...}}`.
pub fn end_stream(err: Option<&ConnectError>) -> Bytes {
    let body = match err {
        None => serde_json::json!({}),
        Some(e) => serde_json::json!({"error": e.json()}),
    };
    envelope(END_STREAM, &serde_json::to_vec(&body).unwrap_or_default())
}

/// A streaming success response: 200, exactly `application/connect+json`, the frames as they
/// come (each flushed as its own chunk).
pub fn stream_response<S>(frames: S) -> Response
where
    S: Stream<Item = Bytes> + Send + 'static,
{
    let body = Body::from_stream(frames.map(Ok::<_, std::convert::Infallible>));
    let mut r = Response::new(body);
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(STREAM_CONTENT_TYPE));
    r
}

/// [`stream_response`] whose stream may fail: the connection is then broken off mid-body (no
/// end of stream), which the SDK takes as a dropped connection (E2B's answer when the
/// sandbox under a stream dies: the SDK then probes its health).
pub fn stream_response_fallible<S>(frames: S) -> Response
where
    S: Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static,
{
    let mut r = Response::new(Body::from_stream(frames));
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(STREAM_CONTENT_TYPE));
    r
}

/// Splits envelopes off a growing buffer.
#[derive(Debug, Default)]
pub struct Decoder {
    buf: BytesMut,
}

/// One decoded envelope.
#[derive(Debug, PartialEq)]
pub struct Frame {
    pub flags: u8,
    pub data: Bytes,
}

impl Decoder {
    pub fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The next whole envelope, if the buffer holds one.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, ConnectError> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        let flags = self.buf[0];
        if flags & 0x01 != 0 {
            return Err(ConnectError::new(Code::Unimplemented, "compressed messages are not supported"));
        }
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if len > MAX_MESSAGE {
            return Err(ConnectError::new(
                Code::ResourceExhausted,
                format!("message of {len} bytes is larger than {MAX_MESSAGE}"),
            ));
        }
        if self.buf.len() < 5 + len {
            return Ok(None);
        }
        self.buf.advance(5);
        Ok(Some(Frame { flags, data: self.buf.split_to(len).freeze() }))
    }

    /// Whether bytes of an unfinished envelope remain.
    pub fn has_partial(&self) -> bool {
        !self.buf.is_empty()
    }
}

/// Decodes a JSON request message, naming what was wrong.
pub fn decode<T: serde::de::DeserializeOwned>(data: &[u8]) -> Result<T, ConnectError> {
    let data = if data.iter().all(u8::is_ascii_whitespace) { b"{}".as_slice() } else { data };
    serde_json::from_slice(data).map_err(|e| ConnectError::invalid(format!("bad request message: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_split_at_any_boundary() {
        let mut all = Vec::new();
        all.extend_from_slice(&envelope(0, b"{\"a\":1}"));
        all.extend_from_slice(&envelope(0, b"{}"));
        all.extend_from_slice(&end_stream(None));
        for cut in 0..all.len() {
            let mut d = Decoder::default();
            let mut got = vec![];
            d.push(&all[..cut]);
            while let Some(f) = d.next_frame().unwrap() {
                got.push(f);
            }
            d.push(&all[cut..]);
            while let Some(f) = d.next_frame().unwrap() {
                got.push(f);
            }
            assert_eq!(got.len(), 3, "cut at {cut}");
            assert_eq!(&got[0].data[..], b"{\"a\":1}");
            assert_eq!(got[2].flags, END_STREAM);
            assert!(!d.has_partial());
        }
    }

    #[test]
    fn oversized_and_compressed_envelopes_are_refused() {
        let mut d = Decoder::default();
        d.push(&[0, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(d.next_frame().unwrap_err().code, Code::ResourceExhausted);
        let mut d = Decoder::default();
        d.push(&envelope(1, b"x"));
        assert_eq!(d.next_frame().unwrap_err().code, Code::Unimplemented);
    }

    #[test]
    fn end_stream_errors_carry_code_and_message() {
        let e = end_stream(Some(&ConnectError::new(Code::DeadlineExceeded, "too slow")));
        assert_eq!(e[0], END_STREAM);
        let v: serde_json::Value = serde_json::from_slice(&e[5..]).unwrap();
        assert_eq!(v["error"]["code"], "deadline_exceeded");
        assert_eq!(v["error"]["message"], "too slow");
    }
}
