//! The rack daemons' Prometheus endpoint: a deliberately tiny HTTP/1.1
//! server that answers `GET /metrics` with whatever a render function
//! returns, shared by the donor and the inference node so both behave the
//! same towards scrapers.
//!
//! What it is: one request per connection (`Connection: close`), the
//! request head bounded in size and time, a bounded number of scrapers at
//! once, typed answers for the rest (404 other paths, 405 other methods,
//! 400 malformed, 408 too slow, 431 head too large). Nothing a peer sends
//! can panic it or hold it up beyond its timeouts.
//!
//! What it is not: a general web server (no keep-alive, no bodies, no TLS).
//! The metrics themselves live in each daemon; [`render_registry`] turns a
//! `prometheus-client` registry into a render function.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
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
            answer(stream, &render, &limits).await;
            drop(permit);
        });
    }
}

/// What a request head asks for, or why it cannot be answered.
#[derive(Debug, PartialEq, Eq)]
enum Route {
    Metrics,
    NotFound,
    BadMethod,
    Malformed,
}

/// Route a complete request head (`GET /metrics HTTP/1.1\r\n...`).
fn route(head: &[u8]) -> Route {
    let line_end = head.iter().position(|&b| b == b'\n').unwrap_or(head.len());
    let Ok(line) = std::str::from_utf8(&head[..line_end]) else {
        return Route::Malformed;
    };
    let mut parts = line.trim_end_matches('\r').split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Route::Malformed;
    };
    let token = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphabetic());
    if !token(method) || !version.starts_with("HTTP/1.") || !target.starts_with('/') {
        return Route::Malformed;
    }
    if method != "GET" {
        return Route::BadMethod;
    }
    let path = target.split(['?', '#']).next().unwrap_or(target);
    if path == "/metrics" {
        Route::Metrics
    } else {
        Route::NotFound
    }
}

/// Read until the end of the request head. `Ok(None)`: the head did not fit.
async fn read_head(stream: &mut TcpStream, max: usize) -> std::io::Result<Option<Vec<u8>>> {
    let mut buf = vec![0u8; max];
    let mut len = 0;
    loop {
        if len == buf.len() {
            return Ok(None);
        }
        let n = stream.read(&mut buf[len..]).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        // Look only where the new bytes could complete a terminator.
        let from = len.saturating_sub(3);
        len += n;
        let seen = &buf[from..len];
        if seen.windows(4).any(|w| w == b"\r\n\r\n") || seen.windows(2).any(|w| w == b"\n\n") {
            buf.truncate(len);
            return Ok(Some(buf));
        }
    }
}

async fn answer(mut stream: TcpStream, render: &Render, limits: &HttpLimits) {
    let head = tokio::time::timeout(limits.read_timeout, read_head(&mut stream, limits.max_head));
    let (status, content_type, body) = match head.await {
        Err(_) => (
            408,
            "text/plain",
            "request head not received in time\n".into(),
        ),
        Ok(Err(_)) => return,
        Ok(Ok(None)) => (431, "text/plain", "request head too large\n".into()),
        Ok(Ok(Some(head))) => match route(&head) {
            Route::Metrics => (200, limits.content_type, render()),
            Route::NotFound => (404, "text/plain", "only /metrics is served here\n".into()),
            Route::BadMethod => (405, "text/plain", "only GET is allowed\n".into()),
            Route::Malformed => (400, "text/plain", "not an HTTP/1 request\n".into()),
        },
    };
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        _ => "Request Header Fields Too Large",
    };
    let allow = if status == 405 { "Allow: GET\r\n" } else { "" };
    let response = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n{allow}Connection: close\r\n\r\n{body}",
        body.len()
    );
    let write = async {
        stream.write_all(response.as_bytes()).await?;
        stream.shutdown().await
    };
    let _ = tokio::time::timeout(limits.write_timeout, write).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_routed_by_method_and_path() {
        assert_eq!(route(b"GET /metrics HTTP/1.1\r\n\r\n"), Route::Metrics);
        assert_eq!(route(b"GET /metrics?x=1 HTTP/1.0\r\n\r\n"), Route::Metrics);
        assert_eq!(route(b"GET / HTTP/1.1\r\n\r\n"), Route::NotFound);
        assert_eq!(route(b"GET /metricsx HTTP/1.1\r\n\r\n"), Route::NotFound);
        assert_eq!(route(b"POST /metrics HTTP/1.1\r\n\r\n"), Route::BadMethod);
        assert_eq!(route(b"GET /metrics\r\n\r\n"), Route::Malformed);
        assert_eq!(route(b"GET /metrics SPDY/3\r\n\r\n"), Route::Malformed);
        assert_eq!(
            route(b"\xff\xfe /metrics HTTP/1.1\r\n\r\n"),
            Route::Malformed
        );
        assert_eq!(route(b"G\0T /metrics HTTP/1.1\r\n\r\n"), Route::Malformed);
        assert_eq!(route(b""), Route::Malformed);
    }

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
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(ok.contains(&format!("Content-Type: {OPENMETRICS_CONTENT_TYPE}\r\n")));
        assert!(ok.contains("Content-Length: 11\r\n"), "{ok}");
        assert!(ok.contains("Connection: close\r\n"));
        assert!(ok.ends_with("\r\n\r\nup 1\n# EOF\n"), "{ok}");
        let nf = exchange(addr, b"GET /other HTTP/1.1\r\n\r\n").await;
        assert!(nf.starts_with("HTTP/1.1 404 "), "{nf}");
        let post = exchange(addr, b"POST /metrics HTTP/1.1\r\n\r\n").await;
        assert!(
            post.starts_with("HTTP/1.1 405 ") && post.contains("Allow: GET"),
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
        assert!(again.starts_with("HTTP/1.1 200 OK\r\n"), "{again}");
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
        let mut out = Vec::new();
        a.read_to_end(&mut out).await.expect("read");
        assert!(String::from_utf8_lossy(&out).starts_with("HTTP/1.1 408 "));
        // Shut down: the listener is closed.
        let _ = stop.send(());
        task.await.expect("server task");
        assert!(TcpStream::connect(addr).await.is_err());
    }
}
