//! The rack daemons' Prometheus endpoint: `GET /metrics` answered with
//! whatever a render function returns, over hyper's HTTP/1.1 server, shared
//! by the donor and the inference node so both behave the same towards
//! scrapers.
//!
//! What it is: one request per connection (`Connection: close`), the
//! request head bounded in size and time (hyper answers 400 to what does
//! not parse and 431 to a head too large, and closes a connection whose
//! head is not in within the read timeout), 404 for other paths and 405
//! for other methods. A connection whose head is not in yet is in a
//! pre-auth budget ([`crate::preauth`]: a few per source address,
//! a bounded number in all, the oldest evicted to admit the newest, the
//! read timeout shrinking as it fills), so silent connections never keep
//! a scraper out; a bounded number of pages are rendered at once (more
//! get 503). Nothing a peer sends can panic it or hold it up beyond its
//! timeouts.
//!
//! What it is not: a general web server (no keep-alive, no bodies, no TLS).
//! The metrics themselves live in each daemon; [`render_registry`] turns a
//! `prometheus-client` registry into a render function.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use engram_sync::Mutex;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::registry::Registry;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use crate::preauth::{PreAuth, Ticket};

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
    /// Pages rendered at once; more get 503.
    pub max_scrapers: usize,
    /// Connections whose request head is not in yet, from one source address.
    pub waiting_per_source: usize,
    /// Connections whose request head is not in yet, from every source.
    pub waiting_total: usize,
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
            waiting_per_source: 8,
            waiting_total: 32,
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
    let waiting = PreAuth::new(limits.waiting_per_source, limits.waiting_total);
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => return,
            a = listener.accept() => a,
        };
        let (stream, peer) = match accepted {
            Ok(x) => x,
            Err(e) => {
                static LIMIT: crate::logging::RateLimit = crate::logging::RateLimit::new(1);
                if let Some(suppressed) = LIMIT.allow() {
                    tracing::warn!(error = %e, suppressed, "metrics: accept failed");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some((stream, ticket, evicted)) = waiting.admit_async(peer.ip(), stream) else {
            continue;
        };
        if evicted > 0 {
            tracing::debug!(%peer, "metrics: waiting connections at their bound; closed the oldest");
        }
        let read_timeout = waiting.deadline(limits.read_timeout);
        let (render, limits, permits) = (
            Arc::clone(&render),
            Arc::clone(&limits),
            Arc::clone(&permits),
        );
        tokio::spawn(async move {
            answer(stream, ticket, read_timeout, render, permits, &limits).await;
        });
    }
}

/// Serve one scraper: one request, answered by [`respond`] once its head
/// is in within `read_timeout` (when `ticket`, its place among the waiting
/// connections, is given up), the whole exchange bounded by the read and
/// write timeouts; 503 when `permits` has none left for its render.
async fn answer(
    stream: TcpStream,
    ticket: Ticket,
    read_timeout: Duration,
    render: Render,
    permits: Arc<Semaphore>,
    limits: &HttpLimits,
) {
    let content_type = limits.content_type;
    let ticket = Mutex::new(Some(ticket));
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        drop(ticket.lock().take());
        let page = match permits.try_acquire() {
            Ok(_render) => respond(req.method(), req.uri().path(), &render, content_type),
            Err(_) => busy(),
        };
        async move { Ok::<_, Infallible>(page) }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(read_timeout)
        .max_buf_size(limits.max_head.max(MIN_HEAD_BUF))
        .keep_alive(false)
        .serve_connection(TokioIo::new(stream), service);
    let _ = tokio::time::timeout(read_timeout + limits.write_timeout, conn).await;
}

fn plain(status: StatusCode, text: &'static str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from_static(text.as_bytes())));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    r
}

/// 503: every render permit is taken.
fn busy() -> Response<Full<Bytes>> {
    let mut r = plain(
        StatusCode::SERVICE_UNAVAILABLE,
        "too many scrapes at once; try again\n",
    );
    r.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    r
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

/// CPU time this process has taken (user and system), in seconds: what
/// the daemons report as their cost (`engram_donor_cpu_seconds_total`,
/// the node's summary).
pub fn process_cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the struct it is given, which is plain data.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_SELF needs nothing else.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return 0.0;
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
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
    async fn silent_connections_never_keep_a_scraper_out() {
        let limits = HttpLimits {
            read_timeout: Duration::from_millis(800),
            waiting_per_source: 2,
            waiting_total: 4,
            ..HttpLimits::default()
        };
        let (addr, (stop, task)) = server(limits).await;
        // Two silent connections fill this source's share of the budget.
        let mut a = TcpStream::connect(addr).await.expect("a");
        let _b = TcpStream::connect(addr).await.expect("b");
        tokio::time::sleep(Duration::from_millis(50)).await;
        // A scraper from the same source evicts the oldest and is answered.
        let started = std::time::Instant::now();
        let page = exchange(addr, b"GET /metrics HTTP/1.1\r\n\r\n").await;
        assert!(page.starts_with("HTTP/1.1 200 OK\r\n"), "{page}");
        let mut out = Vec::new();
        let _ = a.read_to_end(&mut out).await;
        assert!(
            out.is_empty() && started.elapsed() < Duration::from_secs(2),
            "the oldest silent one is closed when the scraper comes: {:?}",
            started.elapsed()
        );
        // A hundred more silent ones: a scrape still gets in at once.
        let mut silent = Vec::new();
        for _ in 0..100 {
            silent.push(TcpStream::connect(addr).await.expect("silent"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let page = exchange(addr, b"GET /metrics HTTP/1.1\r\n\r\n").await;
        assert!(page.starts_with("HTTP/1.1 200 OK\r\n"), "{page}");
        // A silent one that was not evicted is closed by its (shrunk) read
        // timeout.
        let started = std::time::Instant::now();
        let last = silent.last_mut().expect("one");
        let _ = last.read_to_end(&mut out).await;
        let took = started.elapsed();
        assert!(took < Duration::from_secs(2), "closed after {took:?}");
        // Shut down: the listener is closed.
        let _ = stop.send(());
        task.await.expect("server task");
        assert!(TcpStream::connect(addr).await.is_err());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn renders_past_the_bound_get_503() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        // The first render holds the only permit until the second scrape
        // has been answered (at most 5 s).
        let started = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let release = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (s, r) = (Arc::clone(&started), Arc::clone(&release));
        let render: Render = Arc::new(move || {
            s.store(true, std::sync::atomic::Ordering::SeqCst);
            let end = std::time::Instant::now() + Duration::from_secs(5);
            while !r.load(std::sync::atomic::Ordering::SeqCst) && std::time::Instant::now() < end {
                std::thread::sleep(Duration::from_millis(1));
            }
            "up 1\n# EOF\n".to_string()
        });
        let limits = HttpLimits {
            max_scrapers: 1,
            ..HttpLimits::default()
        };
        let _task = tokio::spawn(serve_metrics_with(
            listener,
            render,
            limits,
            std::future::pending(),
        ));
        let get = b"GET /metrics HTTP/1.1\r\n\r\n";
        let first = tokio::spawn(exchange(addr, get));
        let end = std::time::Instant::now() + Duration::from_secs(5);
        while !started.load(std::sync::atomic::Ordering::SeqCst) {
            assert!(
                std::time::Instant::now() < end,
                "the first render never started"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let two = exchange(addr, get).await;
        release.store(true, std::sync::atomic::Ordering::SeqCst);
        let one = first.await.expect("first scrape");
        assert!(one.starts_with("HTTP/1.1 200 OK\r\n"), "{one}");
        assert!(
            two.starts_with("HTTP/1.1 503 ") && two.to_ascii_lowercase().contains("retry-after: 1"),
            "{two}"
        );
    }
}
