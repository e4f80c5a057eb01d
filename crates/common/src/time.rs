//! Wall-clock helpers. Times on the wire and on disk are unix milliseconds.

/// Milliseconds since the unix epoch.
pub fn now_ms() -> i64 {
    let d = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}
