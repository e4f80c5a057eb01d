//! IAM's Raft types, which the log, the state machine and the network all name.

use openraft::BasicNode;
use serde::{Deserialize, Serialize};

use crate::command::{Command, Output};
use crate::error::IamError;

openraft::declare_raft_types!(
    /// IAM's Raft types: commands in, answers out, members named by number and address.
    pub TypeConfig:
        D = Command,
        R = Applied,
        NodeId = u64,
        Node = BasicNode,
);

pub type C = TypeConfig;

/// What applying a command answered, for the proposer waiting on it. It never crosses the
/// network (a write is answered by the member that applied it for its caller): it encodes as
/// nothing and decodes as `None`.
#[derive(Debug, Default)]
pub struct Applied(pub Option<Result<Output, IamError>>);

impl Serialize for Applied {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_unit()
    }
}

impl<'de> Deserialize<'de> for Applied {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Applied, D::Error> {
        <()>::deserialize(d)?;
        Ok(Applied(None))
    }
}
