//! Small pieces every command uses: `KEY=VALUE` arguments, waiting for Ctrl-C or SIGTERM,
//! and the resources a sandbox gets unless told.

use std::collections::HashMap;

use opendsec_common::ApiError;

use crate::error::CtlError;

/// What `sandbox create` gives a sandbox unless told (the SDK's defaults too).
pub const DEFAULT_CPU_MILLIS: u32 = 1000;
pub const DEFAULT_MEMORY_MB: u64 = 1024;
pub const DEFAULT_DISK_MB: u64 = 10240;

/// `KEY=VALUE` items as a map (`what` names them in the error).
pub fn kv(items: &[String], what: &str) -> Result<HashMap<String, String>, CtlError> {
    items
        .iter()
        .map(|s| {
            s.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .ok_or_else(|| CtlError::Api(ApiError::invalid(format!("{what} {s:?} is not KEY=VALUE"))))
        })
        .collect()
}

/// Resolves on SIGINT or SIGTERM.
pub async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
