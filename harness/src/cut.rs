//! A TCP proxy in front of workers that breaks one answer mid-way: the fault a worker crash
//! or a connection reset causes, at the byte a test chooses.
//!
//! Every connection is relayed both ways as it is. The first answer (of any connection, through
//! any of the proxy's addresses) whose bytes pass `cut_after` is cut there: the bytes up to it
//! are delivered, then the connection is reset. Every later answer passes whole, so what takes
//! the broken request over is not cut too.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// The proxy: one address per target, relaying until dropped.
#[derive(Debug)]
pub struct CutProxy {
    /// Where to reach each target through the proxy, in the targets' order.
    pub addrs: Vec<SocketAddr>,
    cut: Arc<AtomicBool>,
    tasks: Vec<JoinHandle<()>>,
}

impl CutProxy {
    /// Proxies each of `targets`, cutting the first answer that passes `cut_after` bytes.
    ///
    /// # Errors
    ///
    /// An address cannot be bound.
    pub async fn start(targets: &[SocketAddr], cut_after: usize) -> anyhow::Result<CutProxy> {
        let cut = Arc::new(AtomicBool::new(false));
        let mut addrs = Vec::new();
        let mut tasks = Vec::new();
        for &target in targets {
            let listener = TcpListener::bind("127.0.0.1:0").await?;
            addrs.push(listener.local_addr()?);
            let cut = cut.clone();
            tasks.push(tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    tokio::spawn(relay(client, target, cut_after, cut.clone()));
                }
            }));
        }
        Ok(CutProxy { addrs, cut, tasks })
    }

    /// Whether an answer has been cut.
    pub fn has_cut(&self) -> bool {
        self.cut.load(Ordering::SeqCst)
    }
}

impl Drop for CutProxy {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

async fn relay(client: TcpStream, target: SocketAddr, cut_after: usize, cut: Arc<AtomicBool>) {
    let Ok(upstream) = TcpStream::connect(target).await else {
        return;
    };
    let (mut client_read, mut client_write) = client.into_split();
    let (mut upstream_read, mut upstream_write) = upstream.into_split();
    let requests = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut client_read, &mut upstream_write).await;
    });
    let mut passed = 0usize;
    let mut buffer = vec![0u8; 16 << 10];
    loop {
        let read = match upstream_read.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(read) => read,
        };
        if passed + read > cut_after && !cut.swap(true, Ordering::SeqCst) {
            let _ = client_write
                .write_all(&buffer[..cut_after.saturating_sub(passed)])
                .await;
            let _ = client_write.flush().await;
            // Let the bytes before the cut arrive, then reset (not an orderly close): the answer
            // is broken, as a crashed worker's is.
            tokio::time::sleep(Duration::from_millis(20)).await;
            let _ = client_write.as_ref().set_zero_linger();
            requests.abort();
            return;
        }
        passed += read;
        if client_write.write_all(&buffer[..read]).await.is_err() {
            break;
        }
    }
    requests.abort();
}
