//! The apiserver role.
