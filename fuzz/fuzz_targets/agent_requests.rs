//! What the in-sandbox agent takes from its callers and its sandbox, from arbitrary bytes:
//! Runtime requests decode or fail; ids are checked; paths resolve to absolute paths, under the
//! session's directory unless given absolute (`..` is left to the kernel, as `files` says);
//! HTTP requests for a server in the sandbox are checked before they are built; passwd and
//! group files from the image parse. None of it panics.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use opendsec_agent::{error, files, http, passwd};
use opendsec_proto::v1 as pb;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    if let Ok(r) = pb::ExecRequest::decode(data) {
        let _ = error::check_id("session", &r.session_id);
        let _ = error::check_id("request", &r.request_id);
    }
    if let Ok(r) = pb::ReadFileRequest::decode(data) {
        match files::resolve(Path::new("/work"), &r.path) {
            Ok(p) => {
                assert!(p.is_absolute(), "{p:?}");
                assert!(r.path.starts_with('/') || p.starts_with("/work"), "{p:?}");
                assert!(!p.as_os_str().as_encoded_bytes().contains(&0), "{p:?}");
            }
            Err(_) => assert!(r.path.is_empty() || r.path.contains('\0')),
        }
    }
    let _ = pb::WriteFileRequest::decode(data);
    let _ = pb::StartProcessRequest::decode(data);
    if let Ok(r) = pb::HttpRequestRequest::decode(data)
        && let Ok(p) = http::prepare(r)
    {
        assert!(p.port != 0 && p.max_body <= 32 << 20);
        assert_eq!(p.request.headers()["connection"], "close");
    }
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = passwd::resolve(s, "root");
        let _ = passwd::resolve(s, "1000");
        let _ = passwd::groups(s, "user", 1000);
    }
});
