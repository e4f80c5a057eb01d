//! The sandbox state machine (DESIGN.md section 6):
//!
//! ```text
//! CREATING -> RUNNING <-> PAUSING -> PAUSED -> RESUMING -> RUNNING
//! RUNNING | PAUSED -> STOPPING -> STOPPED;   any live state -> FAILED
//! ```
//!
//! This module only says which transitions exist; the edge runs them under the sandbox's
//! operation lock. STOPPED and FAILED are final: a record in either state never changes state
//! again (only its `lease_released` mark does).

use serde::{Deserialize, Serialize};

use opendsec_proto::v1::SandboxState;

/// Where a sandbox is in its life. Serialized in records as SCREAMING_SNAKE_CASE, which is also
/// how it appears in messages (`sandbox ... is PAUSED`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum SandboxStatus {
    Creating,
    Running,
    Pausing,
    Paused,
    Resuming,
    Stopping,
    Stopped,
    Failed,
}

impl SandboxStatus {
    pub const ALL: [SandboxStatus; 8] = [
        SandboxStatus::Creating,
        SandboxStatus::Running,
        SandboxStatus::Pausing,
        SandboxStatus::Paused,
        SandboxStatus::Resuming,
        SandboxStatus::Stopping,
        SandboxStatus::Stopped,
        SandboxStatus::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SandboxStatus::Creating => "CREATING",
            SandboxStatus::Running => "RUNNING",
            SandboxStatus::Pausing => "PAUSING",
            SandboxStatus::Paused => "PAUSED",
            SandboxStatus::Resuming => "RESUMING",
            SandboxStatus::Stopping => "STOPPING",
            SandboxStatus::Stopped => "STOPPED",
            SandboxStatus::Failed => "FAILED",
        }
    }

    /// STOPPED or FAILED: the sandbox is gone and holds no resources.
    pub fn is_ended(self) -> bool {
        matches!(self, SandboxStatus::Stopped | SandboxStatus::Failed)
    }

    /// Counts against the edge's capacity (everything but STOPPED and FAILED).
    pub fn is_live(self) -> bool {
        !self.is_ended()
    }

    /// A pause may start from here (PAUSED itself is answered as is, not paused again).
    pub fn can_pause(self) -> bool {
        self == SandboxStatus::Running
    }

    /// A resume may start from here (RUNNING itself is answered as is).
    pub fn can_resume(self) -> bool {
        self == SandboxStatus::Paused
    }

    /// A stop may start from here.
    pub fn can_stop(self) -> bool {
        matches!(self, SandboxStatus::Running | SandboxStatus::Paused)
    }

    /// TTLs may be changed (the sandbox is settled and alive).
    pub fn can_set_timeout(self) -> bool {
        matches!(self, SandboxStatus::Running | SandboxStatus::Paused)
    }

    /// The backend holds a settled sandbox that can be adopted after a restart.
    pub fn is_adoptable(self) -> bool {
        matches!(self, SandboxStatus::Running | SandboxStatus::Paused)
    }

    /// Whether `self -> next` is a transition of the state machine.
    pub fn can_become(self, next: SandboxStatus) -> bool {
        use SandboxStatus::*;
        match (self, next) {
            (Creating, Running) => true,
            (Running, Pausing) | (Pausing, Paused) => true,
            (Paused, Resuming) | (Resuming, Running) => true,
            // A failed pause or resume goes back where it came from when the sandbox survived.
            (Pausing, Running) | (Resuming, Paused) => true,
            (Running | Paused, Stopping) => true,
            // A failed stop leaves a sandbox that still lives where it was.
            (Stopping, Running | Paused) => true,
            (Stopping, Stopped) => true,
            (from, Failed) => from.is_live(),
            _ => false,
        }
    }

    pub fn to_proto(self) -> SandboxState {
        match self {
            SandboxStatus::Creating => SandboxState::Creating,
            SandboxStatus::Running => SandboxState::Running,
            SandboxStatus::Pausing => SandboxState::Pausing,
            SandboxStatus::Paused => SandboxState::Paused,
            SandboxStatus::Resuming => SandboxState::Resuming,
            SandboxStatus::Stopping => SandboxState::Stopping,
            SandboxStatus::Stopped => SandboxState::Stopped,
            SandboxStatus::Failed => SandboxState::Failed,
        }
    }

    /// `None` for UNSPECIFIED.
    pub fn from_proto(s: SandboxState) -> Option<SandboxStatus> {
        Some(match s {
            SandboxState::Unspecified => return None,
            SandboxState::Creating => SandboxStatus::Creating,
            SandboxState::Running => SandboxStatus::Running,
            SandboxState::Pausing => SandboxStatus::Pausing,
            SandboxState::Paused => SandboxStatus::Paused,
            SandboxState::Resuming => SandboxStatus::Resuming,
            SandboxState::Stopping => SandboxStatus::Stopping,
            SandboxState::Stopped => SandboxStatus::Stopped,
            SandboxState::Failed => SandboxStatus::Failed,
        })
    }
}

impl std::fmt::Display for SandboxStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The `end_reason` values the edge sets (stable strings: callers and dashboards match them).
pub mod end_reason {
    /// Stopped by a StopSandbox call.
    pub const USER: &str = "user";
    /// Moved to another edge: the copy there runs on under the same id (this record answers
    /// where it went).
    pub const MOVED: &str = "moved";
    /// Idle longer than `ttl_running_stop_s`.
    pub const TTL_RUNNING_STOP: &str = "ttl_running_stop";
    /// Older than `ttl_max_s`.
    pub const TTL_MAX: &str = "ttl_max";
    /// Paused longer than `ttl_paused_s`.
    pub const TTL_PAUSED: &str = "ttl_paused";
    /// IAM binds the lease elsewhere or no longer has it: the caller moved on.
    pub const LEASE_MOVED: &str = "lease_moved";
    /// The backend reports the sandbox dead.
    pub const LOST: &str = "lost";
    /// The backend could not create the sandbox.
    pub const CREATE_FAILED: &str = "create_failed";
    /// The edge restarted in the middle of an operation on the sandbox.
    pub const EDGE_RESTART: &str = "edge_restart";
    /// The backend could not take the sandbox back after an edge restart.
    pub const ADOPT_FAILED: &str = "adopt_failed";
    /// The record names a backend this edge no longer offers.
    pub const BACKEND_GONE: &str = "backend_gone";
    /// The edge exited without `keep_sandboxes_on_exit`.
    pub const EDGE_SHUTDOWN: &str = "edge_shutdown";
}

#[cfg(test)]
mod tests {
    use super::SandboxStatus::*;
    use super::*;

    #[test]
    fn the_happy_path_is_allowed() {
        for (a, b) in [
            (Creating, Running),
            (Running, Pausing),
            (Pausing, Paused),
            (Paused, Resuming),
            (Resuming, Running),
            (Running, Stopping),
            (Paused, Stopping),
            (Stopping, Stopped),
        ] {
            assert!(a.can_become(b), "{a} -> {b}");
        }
    }

    #[test]
    fn ended_states_are_final() {
        for end in [Stopped, Failed] {
            for next in SandboxStatus::ALL {
                assert!(!end.can_become(next), "{end} -> {next}");
            }
            assert!(!end.can_pause() && !end.can_resume() && !end.can_stop());
            assert!(!end.can_set_timeout() && !end.is_live());
        }
    }

    #[test]
    fn every_live_state_may_fail() {
        for s in SandboxStatus::ALL.into_iter().filter(|s| s.is_live()) {
            assert!(s.can_become(Failed), "{s}");
        }
    }

    #[test]
    fn shortcuts_are_refused() {
        for (a, b) in [
            (Creating, Paused),
            (Creating, Stopping),
            (Running, Paused),
            (Paused, Running),
            (Running, Stopped),
            (Pausing, Stopping),
            (Resuming, Stopping),
        ] {
            assert!(!a.can_become(b), "{a} -> {b}");
        }
    }

    #[test]
    fn checks_agree_with_transitions() {
        for s in SandboxStatus::ALL {
            assert_eq!(s.can_pause(), s.can_become(Pausing), "{s}");
            assert_eq!(s.can_resume(), s.can_become(Resuming), "{s}");
            assert_eq!(s.can_stop(), s.can_become(Stopping), "{s}");
        }
    }

    #[test]
    fn proto_round_trip() {
        for s in SandboxStatus::ALL {
            assert_eq!(SandboxStatus::from_proto(s.to_proto()), Some(s));
            assert_eq!(s.to_proto().as_str_name(), format!("SANDBOX_STATE_{s}"));
        }
        assert_eq!(SandboxStatus::from_proto(SandboxState::Unspecified), None);
    }

    #[test]
    fn serialized_names_match_display() {
        for s in SandboxStatus::ALL {
            assert_eq!(serde_json::to_string(&s).unwrap(), format!("\"{s}\""));
        }
    }
}
