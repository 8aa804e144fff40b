//! The iam role.
