//! The cluster role.
