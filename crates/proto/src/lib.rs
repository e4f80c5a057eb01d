//! Generated code for opendsec's protos, and [`upload`]: the one hand-written piece every hop
//! forwarding `Runtime.WriteFile` needs (an upload that can be aborted visibly).
#![allow(clippy::all, clippy::pedantic, missing_docs)]

pub mod serial;
pub mod upload;
pub mod vmnet;

pub mod v1 {
    tonic::include_proto!("opendsec.v1");
    include!(concat!(env!("OUT_DIR"), "/opendsec.v1.serde.rs"));
}
