//! The `microvm` backend's parts (docs/microvm.md): QEMU's `microvm` machine and its
//! machine protocol, the guest's initramfs, and the agent channel over a virtio-serial
//! port. Firecracker's API and jailer fit the same shape later; see docs/microvm.md for
//! what runs where.

mod backend;
pub mod console;
pub mod disks;
pub mod initramfs;
pub mod jail;
pub mod qemu;
pub mod qmp;
pub mod snapshot;

pub use backend::{qemu_at_least, MicrovmBackend, VmState, DEFAULT_VM_OVERHEAD_MB, MIN_MEMORY_MB};

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Uri};

use crate::guest::portmux::Mux;
use crate::guest::uds;

/// Connects to a VM's agent port at `socket` (QEMU's chardev) and returns a channel to
/// aether's runtime service over it. The connection resets whatever sessions the guest
/// held (a restored copy's are its source's). Once the connection is done (QEMU gone, or
/// the guest sent what is none of ours) the channel's calls fail `unavailable`, and a new
/// channel makes a new connection. Errors: the socket's, when QEMU is not there; the
/// transport's.
pub async fn agent_channel(socket: &Path) -> Result<Channel, std::io::Error> {
    let s = tokio::net::UnixStream::connect(socket).await?;
    let (r, w) = s.into_split();
    let mux: Arc<Mux> = Mux::host(r, w);
    // Pings find a guest that stopped answering (a hung or killed VM) within 30 s. A
    // running VM answers them while its workload is busy, but aether answers them between
    // the calls it serves: under emulation, on a loaded node, a burst of hundreds of calls
    // held a ping past 5 s and the channel was dropped with every call on it.
    let ch = uds::endpoint("http://aether", Duration::from_secs(10))
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(20))
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let mux = mux.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(mux.open().await?)) }
        }))
        .await
        .map_err(std::io::Error::other)?;
    Ok(ch)
}

/// Where QEMU is: `qemu-system-x86_64` on `PATH`.
pub fn qemu_binary() -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join("qemu-system-x86_64"))
            .find(|f| f.is_file())
    })
}
