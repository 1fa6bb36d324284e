//! A bounded accept loop for the daemons' gRPC servers (the donor's control
//! plane, the node daemon's API): at most `max` connections open at once,
//! more closed on accept, accept errors logged at a bounded rate.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::transport::server::{Connected, TcpConnectInfo};

/// A connection holding one of the bounded slots while it lives.
#[derive(Debug)]
pub struct BoundedConn {
    stream: TcpStream,
    _permit: OwnedSemaphorePermit,
}

impl Connected for BoundedConn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for BoundedConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for BoundedConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// Accept on `listener` into a stream of bounded connections (at most
/// `max` open; more are closed on accept). Both daemons' gRPC servers take
/// their connections through it.
pub fn bounded_incoming(
    listener: TcpListener,
    max: usize,
) -> tokio_stream::wrappers::ReceiverStream<std::io::Result<BoundedConn>> {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let permits = Arc::new(Semaphore::new(max.max(1)));
    tokio::spawn(async move {
        loop {
            let (stream, peer) = tokio::select! {
                () = tx.closed() => return,
                a = listener.accept() => match a {
                    Ok(x) => x,
                    Err(e) => {
                        static LIMIT: crate::logging::RateLimit =
                            crate::logging::RateLimit::new(1);
                        if let Some(suppressed) = LIMIT.allow() {
                            tracing::warn!(error = %e, suppressed, "accept failed");
                        }
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
                tracing::debug!(%peer, "too many connections; closing");
                continue;
            };
            let _ = stream.set_nodelay(true);
            let conn = BoundedConn {
                stream,
                _permit: permit,
            };
            if tx.send(Ok(conn)).await.is_err() {
                return;
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}
