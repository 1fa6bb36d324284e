//! The rack daemons' Prometheus endpoint: `GET /metrics` answered with
//! whatever a render function returns, over hyper's HTTP/1.1 server, shared
//! by the donor and the inference node so both behave the same towards
//! scrapers.
//!
//! What it is: one request per connection (`Connection: close`), the
//! request head bounded in size and time (hyper answers 400 to what does
//! not parse and 431 to a head too large, and closes a connection whose
//! head is not in within the read timeout), a bounded number of scrapers
//! at once (more are closed on accept), 404 for other paths and 405 for
//! other methods. Nothing a peer sends can panic it or hold it up beyond
//! its timeouts.
//!
//! What it is not: a general web server (no keep-alive, no bodies, no TLS).
//! The metrics themselves live in each daemon; [`render_registry`] turns a
//! `prometheus-client` registry into a render function.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::registry::Registry;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// Produces the metrics text on each scrape.
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// The content type of what [`render_registry`] produces.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Bounds of the metrics server.
#[derive(Debug, Clone)]
pub struct HttpLimits {
    /// Largest request head (request line and headers) read.
    pub max_head: usize,
    /// Time a scraper has to send its whole request head.
    pub read_timeout: Duration,
    /// Time allowed to write the answer.
    pub write_timeout: Duration,
    /// Scrapers served at once; more are closed at once.
    pub max_scrapers: usize,
    /// Content type of the metrics answer.
    pub content_type: &'static str,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            max_head: 8 << 10,
            read_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(5),
            max_scrapers: 8,
            content_type: OPENMETRICS_CONTENT_TYPE,
        }
    }
}

/// A render function over a finished registry (OpenMetrics text).
pub fn render_registry(registry: Arc<Registry>) -> Render {
    Arc::new(move || {
        let mut out = String::new();
        // Writing to a String cannot fail; a collector's own error leaves a partial page.
        if prometheus_client::encoding::text::encode(&mut out, &registry).is_err() {
            out.push_str("# EOF\n");
        }
        out
    })
}

/// Serve `GET /metrics` on `listener` with default limits until `shutdown` resolves.
pub async fn serve_metrics(
    listener: TcpListener,
    render: Render,
    shutdown: impl Future<Output = ()>,
) {
    serve_metrics_with(listener, render, HttpLimits::default(), shutdown).await;
}

/// Serve `GET /metrics` on `listener` within `limits` until `shutdown` resolves.
pub async fn serve_metrics_with(
    listener: TcpListener,
    render: Render,
    limits: HttpLimits,
    shutdown: impl Future<Output = ()>,
) {
    let limits = Arc::new(limits);
    let permits = Arc::new(Semaphore::new(limits.max_scrapers.max(1)));
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => return,
            a = listener.accept() => a,
        };
        let (stream, peer) = match accepted {
            Ok(x) => x,
            Err(e) => {
                static LIMIT: crate::daemon::logging::RateLimit =
                    crate::daemon::logging::RateLimit::new(1);
                if let Some(suppressed) = LIMIT.allow() {
                    tracing::warn!(error = %e, suppressed, "metrics: accept failed");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
            tracing::debug!(%peer, "metrics: too many scrapers; closing");
            continue;
        };
        let (render, limits) = (Arc::clone(&render), Arc::clone(&limits));
        tokio::spawn(async move {
            answer(stream, render, &limits).await;
            drop(permit);
        });
    }
}

/// Serve one scraper: one request, answered by [`respond`], within the
/// head's read timeout and the whole exchange's (read plus write) bound.
async fn answer(stream: TcpStream, render: Render, limits: &HttpLimits) {
    let content_type = limits.content_type;
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let page = respond(req.method(), req.uri().path(), &render, content_type);
        async move { Ok::<_, Infallible>(page) }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.read_timeout)
        .max_buf_size(limits.max_head.max(MIN_HEAD_BUF))
        .keep_alive(false)
        .serve_connection(TokioIo::new(stream), service);
    let _ = tokio::time::timeout(limits.read_timeout + limits.write_timeout, conn).await;
}

/// hyper's smallest read buffer.
const MIN_HEAD_BUF: usize = 8192;

/// The answer to `method path`: the metrics for `GET /metrics`, 404 for
/// other paths, 405 (with `Allow`) for other methods.
fn respond(
    method: &Method,
    path: &str,
    render: &Render,
    content_type: &'static str,
) -> Response<Full<Bytes>> {
    let plain = |status: StatusCode, text: &'static str| {
        let mut r = Response::new(Full::new(Bytes::from_static(text.as_bytes())));
        *r.status_mut() = status;
        r.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        r
    };
    if path != "/metrics" {
        return plain(StatusCode::NOT_FOUND, "only /metrics is served here\n");
    }
    if method != Method::GET {
        let mut r = plain(StatusCode::METHOD_NOT_ALLOWED, "only GET is allowed\n");
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("GET"));
        return r;
    }
    let mut r = Response::new(Full::new(Bytes::from(render())));
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    type Stop = (
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<()>,
    );

    async fn server(limits: HttpLimits) -> (std::net::SocketAddr, Stop) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let render: Render = Arc::new(|| "up 1\n# EOF\n".to_string());
        let task = tokio::spawn(serve_metrics_with(listener, render, limits, async move {
            let _ = rx.await;
        }));
        (addr, (tx, task))
    }

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn exchange(addr: std::net::SocketAddr, request: &[u8]) -> String {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        let _ = s.write_all(request).await;
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out).await;
        String::from_utf8_lossy(&out).into_owned()
    }

    #[tokio::test]
    async fn answers_metrics_and_refuses_the_rest() {
        let (addr, _stop) = server(HttpLimits::default()).await;
        let ok = exchange(addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await;
        let lower = ok.to_ascii_lowercase();
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(lower.contains(&format!("content-type: {OPENMETRICS_CONTENT_TYPE}\r\n")));
        assert!(lower.contains("content-length: 11\r\n"), "{ok}");
        assert!(lower.contains("connection: close\r\n"), "{ok}");
        assert!(ok.ends_with("\r\n\r\nup 1\n# EOF\n"), "{ok}");
        let nf = exchange(addr, b"GET /other HTTP/1.1\r\n\r\n").await;
        assert!(nf.starts_with("HTTP/1.1 404 "), "{nf}");
        let post = exchange(addr, b"POST /metrics HTTP/1.1\r\n\r\n").await;
        assert!(
            post.starts_with("HTTP/1.1 405 ") && post.to_ascii_lowercase().contains("allow: get"),
            "{post}"
        );
        let junk = exchange(addr, b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\r\n\r\n").await;
        assert!(junk.starts_with("HTTP/1.1 400 "), "{junk}");
        let big = vec![b'a'; 20 << 10];
        let long = exchange(addr, &big).await;
        assert!(
            long.is_empty() || long.starts_with("HTTP/1.1 431 "),
            "{long}"
        );
        // Still answering after all that.
        let again = exchange(addr, b"GET /metrics HTTP/1.0\n\n").await;
        assert!(again.starts_with("HTTP/1.0 200 OK\r\n"), "{again}");
    }

    #[tokio::test]
    async fn a_silent_scraper_times_out_and_the_bound_holds() {
        let limits = HttpLimits {
            read_timeout: Duration::from_millis(500),
            max_scrapers: 2,
            ..HttpLimits::default()
        };
        let (addr, (stop, task)) = server(limits).await;
        // Two silent scrapers hold both permits; a third (accepted after
        // them, in backlog order) is closed at once.
        let mut a = TcpStream::connect(addr).await.expect("a");
        let _b = TcpStream::connect(addr).await.expect("b");
        let third = exchange(addr, b"GET /metrics HTTP/1.1\r\n\r\n").await;
        assert_eq!(third, "", "over the bound: closed without an answer");
        // The silent one is closed at the read timeout.
        let started = std::time::Instant::now();
        let mut out = Vec::new();
        let _ = a.read_to_end(&mut out).await;
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(300) && took < Duration::from_secs(3),
            "closed after {took:?}"
        );
        // Shut down: the listener is closed.
        let _ = stop.send(());
        task.await.expect("server task");
        assert!(TcpStream::connect(addr).await.is_err());
    }
}
