//! `sandbox port-forward ID LOCAL:REMOTE` (docs/cli.md): a local TCP listener whose every
//! connection becomes one `ConnectPort` call to port REMOTE on the sandbox's loopback
//! (docs/network.md "Ports into a sandbox").

use std::net::Ipv4Addr;
use std::sync::Arc;

use argh::FromArgs;
use tokio::io::AsyncWriteExt;

use super::{conn::Conn, output, values, CtlError, Ctx};
use crate::pb;
use crate::rpc::failure_from_status;
use crate::types::Failure;

#[derive(FromArgs, Debug)]
/// forward a local TCP port to a port on the sandbox's loopback until interrupted; prints
/// {"local": "127.0.0.1:PORT", "sandbox": ID, "port": REMOTE} once listening (LOCAL 0 picks
/// a free port). Each connection is one ConnectPort call; the sandbox's network rules do
/// not apply to it. An unknown sandbox fails before anything listens (not_found), and so
/// does a STOPPED or FAILED one (conflict).
#[argh(
    subcommand,
    name = "port-forward",
    help_triggers("-h", "--help", "help"),
    example = "{command_name} $ID 8080:8000"
)]
pub struct PortForwardArgs {
    /// sandbox id
    #[argh(positional)]
    pub id: String,
    /// LOCAL:REMOTE, e.g. 8080:8000 (LOCAL on 127.0.0.1; 0 picks a free one)
    #[argh(positional)]
    pub ports: String,
}

/// `LOCAL:REMOTE`: LOCAL 0-65535, REMOTE 1-65535. Errors: usage naming the value.
fn ports(s: &str) -> Result<(u16, u16), CtlError> {
    let Some((l, r)) = s.split_once(':') else {
        return Err(CtlError::usage(format!(
            "LOCAL:REMOTE: {s:?} is not two ports joined by ':' (8080:8000)"
        )));
    };
    let local = values::int("LOCAL", l, 0, 65_535)?;
    let remote = values::int("REMOTE", r, 1, 65_535)?;
    // Both are in u16 range: checked just above.
    Ok((local as u16, remote as u16))
}

impl PortForwardArgs {
    pub async fn run(self, ctx: &Ctx) -> Result<(), CtlError> {
        values::sandbox_id(&self.id)?;
        let (local, remote) = ports(&self.ports)?;
        let conn = Arc::new(ctx.connect()?);
        // A sandbox that is not there (or not the caller's) fails here, not at each
        // connection after the listener is up.
        let req = pb::SandboxRef {
            id: self.id.clone(),
        };
        let sb = conn
            .call(req, |mut c, r| async move { c.get_sandbox(r).await })
            .await?;
        // Every connection would be refused: one that will not run again ends here.
        if matches!(
            sb.state(),
            pb::SandboxState::Stopped | pb::SandboxState::Failed
        ) {
            return Err(Failure::conflict(format!(
                "sandbox {} is {}",
                self.id,
                sb.state().as_str_name()
            ))
            .into());
        }
        let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, local))
            .await
            .map_err(|e| Failure::invalid(format!("listening on 127.0.0.1:{local}: {e}")))?;
        let bound = listener
            .local_addr()
            .map_err(|e| Failure::internal(format!("the listener's address: {e}")))?;
        output::out(
            format!(
                "{}\n",
                serde_json::json!({"local": bound.to_string(), "sandbox": self.id, "port": remote})
            )
            .as_bytes(),
        )?;
        loop {
            let (sock, from) = listener
                .accept()
                .await
                .map_err(|e| Failure::internal(format!("accepting on {bound}: {e}")))?;
            let (conn, id) = (conn.clone(), self.id.clone());
            tokio::spawn(async move {
                if let Err(f) = pump(&conn, id, remote, sock).await {
                    eprintln!(
                        "connection from {from}: error: {}: {}",
                        f.reason.as_str(),
                        f.message
                    );
                }
            });
        }
    }
}

/// One local connection through one `ConnectPort` call, until both directions are done.
async fn pump(
    conn: &Conn,
    sandbox_id: String,
    port: u16,
    sock: tokio::net::TcpStream,
) -> Result<(), Failure> {
    let _ = sock.set_nodelay(true);
    let (rd, mut wr) = sock.into_split();
    let (tx, rx) = tokio::sync::mpsc::channel::<pb::PortFrame>(8);
    let first = pb::PortFrame {
        sandbox_id,
        port: u32::from(port),
        ..Default::default()
    };
    // The channel has room: nothing was sent yet.
    let _ = tx.try_send(first);
    let mut client = conn.client()?;
    let mut frames = client
        .connect_port(conn.request(tokio_stream::wrappers::ReceiverStream::new(rx)))
        .await
        .map_err(|s| failure_from_status(&s))?
        .into_inner();
    let up = tokio::spawn(crate::guest::port::send_reads(rd, tx));
    let res = async {
        while let Some(f) = frames
            .message()
            .await
            .map_err(|s| failure_from_status(&s))?
        {
            if !f.data.is_empty() {
                wr.write_all(&f.data)
                    .await
                    .map_err(|e| Failure::unavailable(format!("the local connection: {e}")))?;
            }
            if f.eof {
                let _ = wr.shutdown().await;
            }
        }
        Ok(())
    }
    .await;
    up.abort();
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_checked() {
        assert_eq!(ports("8080:80").unwrap(), (8080, 80));
        assert_eq!(ports("0:65535").unwrap(), (0, 65535));
        for bad in [
            "8080", "8080:0", "70000:80", "a:80", "80:", ":80", "80:80:80",
        ] {
            assert!(ports(bad).is_err(), "{bad}");
        }
    }
}
