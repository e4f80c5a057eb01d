//! Public API requests from arbitrary bytes: decoding never panics, and whatever admission
//! accepts is within the bounds it promises (the project is valid, every backend but sim has a
//! disk, lease ids scoped by project are valid lease ids).
#![no_main]

use libfuzzer_sys::fuzz_target;
use opendsec_apiserver::admission;
use opendsec_common::config::ApiserverConfig;
use opendsec_common::ids;
use opendsec_proto::v1 as pb;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let cfg = ApiserverConfig::default();
    if let Ok(req) = pb::CreateSandboxRequest::decode(data) {
        if let Ok(spec) = admission::check_spec(req.spec.as_ref(), "root/fuzz", &cfg) {
            assert!(ids::validate_project(&spec.project).is_ok(), "{spec:?}");
            let r = spec.resources.expect("accepted specs have resources");
            assert!(r.cpu_millis > 0 && r.memory_mb > 0);
            assert!(spec.backend == "sim" || r.disk_mb > 0, "{spec:?}");
            assert!(spec.ttl_running_stop_s > 0 && spec.ttl_max_s > 0);
            // Egress rules: what admission accepts parses back to the same rules, and a rule
            // lies within itself and within `*`.
            let mut spec = spec;
            if admission::check_network(&mut spec, &[]).is_ok() {
                let any = opendsec_common::egress::Rule::parse("*").expect("* parses");
                for r in &spec.network.as_ref().expect("filled").egress {
                    let rule = opendsec_common::egress::Rule::from_pb(r).expect("accepted rules parse");
                    let again = opendsec_common::egress::Rule::parse(&rule.to_string()).expect("text round trip");
                    assert_eq!(rule, again);
                    assert!(rule.within(&rule) && rule.within(&any), "{rule}");
                }
            }
        }
        if let Ok(Some(key)) = admission::check_lease_id(&req.lease_id) {
            assert!(ids::validate_lease(&admission::scoped_lease_id("root/fuzz", &key)).is_ok());
        }
    }
    if let Ok(req) = pb::CreateSandboxesRequest::decode(data) {
        let _ = admission::check_batch_count(req.count);
        let _ = admission::check_spec(req.spec.as_ref(), "root", &cfg);
    }
    if let Ok(req) = pb::UpdateNetworkRequest::decode(data) {
        let _ = admission::check_network_update(&req);
    }
    if let Ok(req) = pb::SetSandboxTimeoutRequest::decode(data) {
        let _ = admission::check_timeout_update(&req, &cfg.ttl);
        let _ = ids::split_sandbox_id(&req.id);
    }
    for decoded in [
        pb::ExecRequest::decode(data).map(|r| r.sandbox_id),
        pb::ListSandboxesRequest::decode(data).map(|r| r.page_token),
    ] {
        if let Ok(s) = decoded {
            let _ = ids::split_sandbox_id(&s);
            let _ = ids::validate_project(&s);
        }
    }
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = opendsec_common::config::Config::parse(s, "fuzz");
        let _ = opendsec_common::config::parse_token_shape(s);
        let _ = opendsec_common::egress::Rule::parse(s);
    }
});
