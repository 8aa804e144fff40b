//! Sandbox backends: the Backend trait and its implementations.
