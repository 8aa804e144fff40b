//! The shared image store (docs/images.md): image names, content digests, the store's layout
//! and its atomic writes, and the unpacking of untrusted layer tars.

pub mod auth;
pub mod cache;
pub mod check;
pub mod compose;
pub mod copy;
pub mod digest;
pub mod gc;
pub mod import;
pub mod layer;
pub mod metacap;
pub mod name;
pub mod oci;
pub mod pack;
pub mod registry;
pub mod store;
pub mod unpack;
