//! QEMU's machine protocol (QMP) over the VM's unix socket: line-delimited JSON, a greeting,
//! `qmp_capabilities`, then one command at a time; asynchronous events arrive between
//! answers and are set aside (docs/microvm.md "QEMU").

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;

/// The longest line QEMU's answers may take (a `query-*` of a large VM stays far below).
const MAX_LINE: usize = 4 << 20;

/// Why a QMP exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    #[error("QMP socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("QMP: the connection closed")]
    Closed,
    #[error("QMP: {0}")]
    Protocol(String),
    /// QEMU refused the command: its error class and description.
    #[error("QMP {command}: {class}: {desc}")]
    Command {
        command: String,
        class: String,
        desc: String,
    },
    #[error("QMP {0}: no answer in time")]
    Timeout(String),
}

/// One QMP connection, capabilities negotiated.
pub struct Qmp {
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
    /// Events seen while waiting for answers, oldest first (bounded).
    pub events: Vec<Value>,
    /// The id the next command carries: QEMU echoes it in the answer, so the answer of a
    /// command given up on ([`Qmp::execute_within`]) is never taken for a later one's.
    next_id: u64,
}

impl Qmp {
    /// Connects to the QMP socket at `path`, reads the greeting and leaves negotiation
    /// mode. Errors: `Io` when nothing listens, `Protocol` for a greeting that is not QMP's.
    pub async fn connect(path: &Path) -> Result<Qmp, QmpError> {
        let (r, w) = UnixStream::connect(path).await?.into_split();
        let mut q = Qmp {
            reader: BufReader::new(r),
            writer: w,
            events: Vec::new(),
            next_id: 1,
        };
        let greeting = q.read_value().await?;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Protocol(format!("greeting {greeting}")));
        }
        q.execute("qmp_capabilities", None).await?;
        Ok(q)
    }

    async fn read_value(&mut self) -> Result<Value, QmpError> {
        let mut line = String::new();
        loop {
            line.clear();
            let n = (&mut self.reader)
                .take(MAX_LINE as u64)
                .read_line(&mut line)
                .await?;
            if n == 0 {
                return Err(QmpError::Closed);
            }
            if !line.ends_with('\n') && n >= MAX_LINE {
                return Err(QmpError::Protocol("an answer over 4 MiB".into()));
            }
            if line.trim().is_empty() {
                continue;
            }
            return serde_json::from_str(line.trim())
                .map_err(|e| QmpError::Protocol(format!("not JSON ({e}): {}", line.trim())));
        }
    }

    /// Runs `command` with `arguments` and returns its `return` value. Events that come
    /// first are kept in [`Qmp::events`]. Errors: `Command` with QEMU's class and text.
    pub async fn execute(
        &mut self,
        command: &str,
        arguments: Option<Value>,
    ) -> Result<Value, QmpError> {
        let id = self.next_id;
        self.next_id += 1;
        let msg = match arguments {
            Some(a) => json!({ "execute": command, "arguments": a, "id": id }),
            None => json!({ "execute": command, "id": id }),
        };
        let mut line = msg.to_string();
        line.push('\n');
        self.writer.write_all(line.as_bytes()).await?;
        self.answer(command, id).await
    }

    /// Reads until the answer to command `id`; events are kept, others' answers skipped.
    async fn answer(&mut self, command: &str, id: u64) -> Result<Value, QmpError> {
        loop {
            let v = self.read_value().await?;
            if v.get("event").is_some() {
                if self.events.len() >= 256 {
                    self.events.remove(0);
                }
                self.events.push(v);
                continue;
            }
            if v.get("id").and_then(Value::as_u64) != Some(id) {
                // An earlier command's late answer (or one without our id).
                tracing::debug!(answer = %v, "QMP: an answer for another command, skipped");
                continue;
            }
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                let text = |k: &str| e.get(k).and_then(Value::as_str).unwrap_or("").to_string();
                return Err(QmpError::Command {
                    command: command.to_string(),
                    class: text("class"),
                    desc: text("desc"),
                });
            }
            return Err(QmpError::Protocol(format!("unexpected answer {v}")));
        }
    }

    /// Hands QEMU the open file `fd` under `name` (`getfd`), for a later `fd:<name>`
    /// migration URI. Errors: as [`Qmp::execute`].
    pub async fn send_fd(
        &mut self,
        name: &str,
        fd: std::os::fd::BorrowedFd<'_>,
    ) -> Result<(), QmpError> {
        let id = self.next_id;
        self.next_id += 1;
        let mut line =
            json!({ "execute": "getfd", "arguments": { "fdname": name }, "id": id }).to_string();
        line.push('\n');
        crate::sys::fd::send_with_fd(self.writer.as_ref(), line.as_bytes(), fd).await?;
        self.answer("getfd", id).await.map(|_| ())
    }

    /// Hands QEMU the open file `fd` in a new fd set (`add-fd`), for a later
    /// `file:/dev/fdset/<id>` migration URI (QEMU 9.0 and later); returns the set's id.
    /// Errors: as [`Qmp::execute`]; `Protocol` for an answer without `fdset-id`.
    pub async fn add_fd(&mut self, fd: std::os::fd::BorrowedFd<'_>) -> Result<u64, QmpError> {
        let id = self.next_id;
        self.next_id += 1;
        let mut line = json!({ "execute": "add-fd", "id": id }).to_string();
        line.push('\n');
        crate::sys::fd::send_with_fd(self.writer.as_ref(), line.as_bytes(), fd).await?;
        let r = self.answer("add-fd", id).await?;
        r.get("fdset-id")
            .and_then(Value::as_u64)
            .ok_or_else(|| QmpError::Protocol(format!("add-fd answered {r}")))
    }

    /// [`Qmp::execute`] within `limit`. Errors: `Timeout`, or the command's.
    pub async fn execute_within(
        &mut self,
        command: &str,
        arguments: Option<Value>,
        limit: Duration,
    ) -> Result<Value, QmpError> {
        match tokio::time::timeout(limit, self.execute(command, arguments)).await {
            Ok(r) => r,
            Err(_) => Err(QmpError::Timeout(command.to_string())),
        }
    }

    /// The VM's run state (`query-status`'s `status`: `running`, `paused`, `inmigrate`,
    /// `postmigrate`, ...).
    pub async fn status(&mut self) -> Result<String, QmpError> {
        let v = self.execute("query-status", None).await?;
        Ok(v.get("status")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `answer`'s lines, each answer given the id of the command `command` (as QEMU does).
    fn with_id(command: &str, answer: &str) -> String {
        let id = serde_json::from_str::<Value>(command.trim())
            .ok()
            .and_then(|c| c.get("id").cloned());
        answer
            .split_inclusive('\n')
            .map(|l| match serde_json::from_str::<Value>(l.trim()) {
                Ok(Value::Object(mut m)) if !m.contains_key("event") => {
                    if let Some(id) = &id {
                        m.insert("id".into(), id.clone());
                    }
                    format!("{}\r\n", Value::Object(m))
                }
                _ => l.to_string(),
            })
            .collect()
    }

    /// A QMP server that greets, answers `qmp_capabilities`, then answers each command
    /// by the `script` (an event first where asked).
    async fn fake(path: std::path::PathBuf, script: Vec<&'static str>) {
        let l = tokio::net::UnixListener::bind(&path).expect("bind");
        tokio::spawn(async move {
            let (s, _) = l.accept().await.expect("accept");
            let (r, mut w) = s.into_split();
            let mut r = BufReader::new(r);
            w.write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\r\n")
                .await
                .expect("greet");
            let mut line = String::new();
            r.read_line(&mut line).await.expect("caps");
            assert!(line.contains("qmp_capabilities"), "{line}");
            w.write_all(with_id(&line, "{\"return\": {}}\r\n").as_bytes())
                .await
                .expect("caps answer");
            let mut read_ahead: Option<String> = None;
            for answer in script {
                match read_ahead.take() {
                    Some(next) => line = next,
                    None => {
                        line.clear();
                        if r.read_line(&mut line).await.expect("command") == 0 {
                            return;
                        }
                    }
                }
                // "SLOW:" answers late: once the next command came, the client having
                // given up on this one.
                let (late, answer) = match answer.strip_prefix("SLOW:") {
                    Some(a) => (true, a),
                    None => (false, answer),
                };
                if late {
                    let mut next = String::new();
                    r.read_line(&mut next).await.expect("the next command");
                    read_ahead = Some(next);
                }
                w.write_all(with_id(&line, answer).as_bytes())
                    .await
                    .expect("answer");
            }
            // One more command, then QEMU goes away without answering it.
            line.clear();
            let _ = r.read_line(&mut line).await;
        });
    }

    #[tokio::test]
    async fn commands_answer_their_return_and_events_are_set_aside() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("qmp.sock");
        fake(
            path.clone(),
            vec![
                "{\"event\": \"STOP\", \"timestamp\": {}}\r\n{\"return\": {\"status\": \"paused\", \"running\": false}}\r\n",
                "{\"error\": {\"class\": \"GenericError\", \"desc\": \"Can't migrate the vm that was paused due to previous migration\"}}\r\n",
                "not json\r\n",
            ],
        )
        .await;
        let mut q = Qmp::connect(&path).await.expect("connect");
        assert_eq!(q.status().await.expect("status"), "paused");
        assert_eq!(q.events.len(), 1);
        assert_eq!(q.events[0]["event"], "STOP");
        match q
            .execute("migrate", Some(json!({"uri": "exec:cat > f"})))
            .await
        {
            Err(QmpError::Command {
                command,
                class,
                desc,
            }) => {
                assert_eq!(command, "migrate");
                assert_eq!(class, "GenericError");
                assert!(desc.contains("previous migration"), "{desc}");
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            q.execute("cont", None).await,
            Err(QmpError::Protocol(_))
        ));
        assert!(matches!(
            q.execute("cont", None).await,
            Err(QmpError::Closed)
        ));
    }

    #[tokio::test]
    async fn an_answer_that_comes_after_its_command_was_given_up_on_is_not_the_next_one_s() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("qmp.sock");
        fake(
            path.clone(),
            vec![
                "SLOW:{\"return\": {\"status\": \"inmigrate\", \"running\": false}}\r\n",
                "{\"return\": {\"status\": \"running\", \"running\": true}}\r\n",
            ],
        )
        .await;
        let mut q = Qmp::connect(&path).await.expect("connect");
        assert!(matches!(
            q.execute_within("query-status", None, Duration::from_millis(100))
                .await,
            Err(QmpError::Timeout(_))
        ));
        // The fake answers the first command only once the second is sent, just before the
        // second's own answer.
        assert_eq!(q.status().await.expect("status"), "running");
    }

    #[tokio::test]
    async fn a_socket_that_is_not_qmp_is_refused() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("x.sock");
        let l = tokio::net::UnixListener::bind(&path).expect("bind");
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.expect("accept");
            s.write_all(b"{\"hello\": 1}\n").await.expect("write");
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest).await;
        });
        assert!(matches!(
            Qmp::connect(&path).await,
            Err(QmpError::Protocol(_))
        ));
        assert!(matches!(
            Qmp::connect(&dir.path().join("none.sock")).await,
            Err(QmpError::Io(_))
        ));
    }
}
