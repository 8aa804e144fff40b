//! Code generated from proto/opendsec/v1 (prost + tonic) with protobuf-JSON serde impls.
#![allow(clippy::all, missing_docs)]

pub mod v1 {
    tonic::include_proto!("opendsec.v1");
    include!(concat!(env!("OUT_DIR"), "/opendsec.v1.serde.rs"));
}
pub use v1::*;
