//! A booting VM's last words (docs/microvm.md "When a VM does not boot"): while the node
//! waits for a new VM's agent, it reads the guest's serial console from a socket QEMU
//! inherited and keeps only its last [`KEEP`] bytes, so that a guest that dies at boot
//! says why in the creation's error. Once the agent answers the socket is closed and QEMU
//! drops whatever the guest writes to its console from then on: a guest's root can write
//! there without end, and nothing of it reaches the node's memory or disk.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use tokio::io::AsyncReadExt;

/// How much of the console is kept (bytes, the last ones).
pub const KEEP: usize = 4096;

/// The most lines of it an error carries.
const LINES: usize = 30;

/// The reading end of a VM's console, read in the background until dropped.
pub struct ConsoleTail {
    kept: Arc<Mutex<VecDeque<u8>>>,
    reader: tokio::task::JoinHandle<()>,
}

impl ConsoleTail {
    /// Starts reading `stream` (the node's end of the console's socket pair). Errors:
    /// the socket cannot be made non-blocking or registered with the runtime.
    pub fn spawn(stream: std::os::unix::net::UnixStream) -> std::io::Result<Self> {
        stream.set_nonblocking(true)?;
        let mut s = tokio::net::UnixStream::from_std(stream)?;
        let kept = Arc::new(Mutex::new(VecDeque::with_capacity(KEEP)));
        let k = kept.clone();
        let reader = tokio::spawn(async move {
            let mut buf = [0u8; 4096];
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => keep(
                        &mut k.lock().unwrap_or_else(std::sync::PoisonError::into_inner),
                        buf.get(..n).unwrap_or_default(),
                    ),
                }
            }
        });
        Ok(ConsoleTail { kept, reader })
    }

    /// [`ConsoleTail::text`] once QEMU has gone: first waits, at most `limit`, until
    /// everything QEMU wrote has been read (the socket's end), so that the last lines,
    /// the ones that say why, are not lost to the reader's lag.
    pub async fn last_words(&self, limit: std::time::Duration) -> String {
        let started = std::time::Instant::now();
        while !self.reader.is_finished() && started.elapsed() < limit {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        self.text()
    }

    /// What the console said last, as text fit for an error: at most [`LINES`] lines of
    /// the last [`KEEP`] bytes, escape sequences and other control characters removed;
    /// empty when it said nothing.
    pub fn text(&self) -> String {
        let bytes: Vec<u8> = self
            .kept
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .copied()
            .collect();
        printable(&bytes)
    }
}

impl Drop for ConsoleTail {
    fn drop(&mut self) {
        // The task owns the socket: ending it closes the node's end.
        self.reader.abort();
    }
}

/// Appends `new` to `kept`, dropping the oldest bytes beyond [`KEEP`].
fn keep(kept: &mut VecDeque<u8>, new: &[u8]) {
    let new = new.get(new.len().saturating_sub(KEEP)..).unwrap_or(new);
    let over = (kept.len() + new.len()).saturating_sub(KEEP);
    kept.drain(..over.min(kept.len()));
    kept.extend(new);
}

/// The console's bytes as plain text: ANSI escape sequences (the firmware clears the
/// screen) and control characters other than newline and tab removed, lines trimmed of
/// trailing space, empty lines dropped, the last [`LINES`] kept.
fn printable(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\u{1b}' => {
                // ESC [ parameters final-byte, or ESC and one character.
                if chars.peek() == Some(&'[') {
                    chars.next();
                    for c in chars.by_ref() {
                        if ('\u{40}'..='\u{7e}').contains(&c) {
                            break;
                        }
                    }
                } else {
                    chars.next();
                }
            }
            '\n' | '\t' => out.push(c),
            c if c.is_control() => {}
            c => out.push(c),
        }
    }
    let lines: Vec<&str> = out
        .lines()
        .map(str::trim_end)
        .filter(|l| !l.trim().is_empty())
        .collect();
    lines
        .get(lines.len().saturating_sub(LINES)..)
        .unwrap_or_default()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn only_the_last_bytes_are_kept() {
        let mut k = VecDeque::new();
        keep(&mut k, &[b'a'; KEEP - 2]);
        keep(&mut k, b"bcde");
        assert_eq!(k.len(), KEEP);
        assert_eq!(
            k.iter().rev().take(5).copied().collect::<Vec<_>>(),
            b"edcba"
        );
        keep(&mut k, &vec![b'z'; 3 * KEEP]);
        assert_eq!(k.len(), KEEP);
        assert!(k.iter().all(|&b| b == b'z'));
    }

    #[test]
    fn escape_sequences_and_control_characters_are_removed() {
        let raw = b"\x1bc\x1b[?7l\x1b[2J\x1b[0mSeaBIOS (version 1)\r\n\
                    Booting from ROM...\r\n\x1bc\x1b[?7l\x1b[2J\x07panic: \xff here \r\n\r\n";
        assert_eq!(
            printable(raw),
            "SeaBIOS (version 1)\nBooting from ROM...\npanic: \u{fffd} here"
        );
        let many: String = (0..100).map(|i| format!("line {i}\n")).collect();
        let t = printable(many.as_bytes());
        assert_eq!(t.lines().count(), LINES);
        assert!(t.ends_with("line 99"));
        assert!(t.starts_with(&format!("line {}", 100 - LINES)));
    }

    #[tokio::test]
    async fn a_console_is_read_until_it_is_dropped_and_then_closed() {
        let (node, mut qemu) = std::os::unix::net::UnixStream::pair().unwrap();
        let tail = ConsoleTail::spawn(node).unwrap();
        qemu.write_all(b"Kernel panic - not syncing\r\n").unwrap();
        let started = std::time::Instant::now();
        while tail.text().is_empty() && started.elapsed() < std::time::Duration::from_secs(5) {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        assert_eq!(tail.text(), "Kernel panic - not syncing");
        // What came just before the writer went is read before the words are taken.
        let (node2, mut qemu2) = std::os::unix::net::UnixStream::pair().unwrap();
        let tail2 = ConsoleTail::spawn(node2).unwrap();
        qemu2.write_all(b"one\ntwo\nreboot: Power down\n").unwrap();
        drop(qemu2);
        assert!(tail2
            .last_words(std::time::Duration::from_secs(5))
            .await
            .ends_with("reboot: Power down"));
        drop(tail);
        // The writer then finds the socket closed (QEMU drops the console's output).
        let started = std::time::Instant::now();
        let closed = loop {
            if qemu.write_all(b"more\n").is_err() {
                break true;
            }
            if started.elapsed() > std::time::Duration::from_secs(5) {
                break false;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        };
        assert!(closed);
    }
}
