//! The edge role.
