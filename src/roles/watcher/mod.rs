//! The watcher role.
