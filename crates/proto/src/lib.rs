//! Generated code for opendsec's protos. Nothing hand-written lives here but this module list.
#![allow(clippy::all, clippy::pedantic, missing_docs)]

pub mod v1 {
    tonic::include_proto!("opendsec.v1");
}
