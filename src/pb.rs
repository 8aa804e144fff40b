//! Code generated from proto/opendsec/v1 (prost + tonic) with protobuf-JSON serde impls.
#![allow(clippy::all, missing_docs)]

pub mod v1 {
    tonic::include_proto!("opendsec.v1");
    include!(concat!(env!("OUT_DIR"), "/opendsec.v1.serde.rs"));
}
pub use v1::*;

/// E2B's envd messages (proto/e2b), served by the E2B gateway (docs/e2b.md).
pub mod envd {
    #![allow(clippy::all, missing_docs)]
    pub mod process {
        include!(concat!(env!("OUT_DIR"), "/process.rs"));
        include!(concat!(env!("OUT_DIR"), "/process.serde.rs"));
    }
    pub mod filesystem {
        include!(concat!(env!("OUT_DIR"), "/filesystem.rs"));
        include!(concat!(env!("OUT_DIR"), "/filesystem.serde.rs"));
    }
}
