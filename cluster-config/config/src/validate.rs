//! Every rule a rack config must satisfy, each reported with file, line,
//! column and key; defaults filled in; paths resolved against the file's
//! directory. All problems are collected, not just the first.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use engram_protocol::TableDigest;
use engram_protocol::encoding::RowEncoding;
use engram_protocol::etab::MAX_ROWS;
use engram_protocol::frame::{DEFAULT_MAX_ROWS, MAX_ROWS_CEILING};
use engram_protocol::messages::{MAX_NAME, NO_TABLE};

use crate::raw::{RawConfig, RawDonor, RawTable, RawTls};
use crate::{
    Config, ConfigError, Diagnostic, Donor, Endpoint, KeptLayout, MlockMode, Plaintext,
    SCHEMA_VERSION, Table, TlsSettings, Transport,
};
use toml::Spanned;

/// Highest layer id accepted.
pub const MAX_LAYER: i64 = 1023;
/// Longest timeout accepted, in milliseconds (one day).
pub const MAX_TIMEOUT_MS: i64 = 86_400_000;

struct Ctx<'a> {
    text: &'a str,
    file: &'a Path,
    diags: Vec<Diagnostic>,
}

impl Ctx<'_> {
    fn at(&mut self, span: Range<usize>, key: impl Into<String>, message: impl Into<String>) {
        let upto = self.text.get(..span.start).unwrap_or(self.text);
        let line = upto.matches('\n').count() + 1;
        let column = upto.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        self.diags.push(Diagnostic {
            file: self.file.to_path_buf(),
            line,
            column,
            key: key.into(),
            message: message.into(),
        });
    }

    fn int(&mut self, v: &Spanned<i64>, key: &str, lo: i64, hi: i64) -> Option<i64> {
        let x = *v.get_ref();
        if (lo..=hi).contains(&x) {
            Some(x)
        } else {
            self.at(v.span(), key, format!("{x} is out of range {lo}..={hi}"));
            None
        }
    }

    fn opt_ms(
        &mut self,
        v: &Option<Spanned<i64>>,
        key: &str,
        default_ms: i64,
        allow_zero: bool,
    ) -> Duration {
        let lo = if allow_zero { 0 } else { 1 };
        let ms = match v {
            Some(v) => self.int(v, key, lo, MAX_TIMEOUT_MS).unwrap_or(default_ms),
            None => default_ms,
        };
        Duration::from_millis(ms as u64)
    }

    fn name(&mut self, v: &Spanned<String>, key: &str) -> String {
        let n = v.get_ref();
        let ok_chars = n
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
        if n.is_empty() || n.len() > MAX_NAME || !ok_chars {
            self.at(
                v.span(),
                key,
                format!("{n:?} is not a name: 1 to {MAX_NAME} of A-Z a-z 0-9 - _ ."),
            );
        }
        n.clone()
    }

    fn path(&mut self, v: &Spanned<String>, key: &str, base: &Path) -> PathBuf {
        if v.get_ref().trim().is_empty() {
            self.at(v.span(), key, "a path cannot be empty");
        }
        base.join(v.get_ref())
    }
}

/// Parse and validate config text.
pub(crate) fn parse(text: &str, file: &Path) -> Result<Config, ConfigError> {
    let mut cx = Ctx {
        text,
        file,
        diags: Vec::new(),
    };
    let raw: RawConfig = match toml::from_str(text) {
        Ok(r) => r,
        Err(e) => {
            let span = e.span().unwrap_or(0..0);
            let key = text
                .get(span.clone())
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty() && s.len() < 80);
            cx.at(
                span,
                key.unwrap_or_else(|| "(document)".into()),
                e.message().trim().to_string(),
            );
            return Err(ConfigError::Invalid(cx.diags));
        }
    };
    let base = file.parent().unwrap_or(Path::new(".")).to_path_buf();
    let config = build(&mut cx, &raw, &base);
    if cx.diags.is_empty() {
        Ok(config)
    } else {
        Err(ConfigError::Invalid(cx.diags))
    }
}

fn build(cx: &mut Ctx<'_>, raw: &RawConfig, base: &Path) -> Config {
    if *raw.version.get_ref() != i64::from(SCHEMA_VERSION) {
        cx.at(
            raw.version.span(),
            "version",
            format!(
                "schema version {} is not supported (this build reads {SCHEMA_VERSION})",
                raw.version.get_ref()
            ),
        );
    }
    let rack = raw.rack.get_ref();
    let rack_name = cx.name(&rack.name, "rack.name");
    let credential_file = rack
        .credential_file
        .as_ref()
        .map(|p| cx.path(p, "rack.credential_file", base));

    let plaintext = match rack.plaintext.as_ref().map(|p| (p, p.get_ref().as_str())) {
        None | Some((_, "loopback")) => Plaintext::LoopbackOnly,
        Some((_, "allow")) => Plaintext::Allow,
        Some((p, other)) => {
            cx.at(
                p.span(),
                "rack.plaintext",
                format!("{other:?} is not one of \"loopback\" (the default), \"allow\""),
            );
            Plaintext::LoopbackOnly
        }
    };
    let tls = rack.tls.as_ref().map(|t| tls(cx, t.get_ref(), base));
    let default_transport = if tls.is_some() {
        Transport::Tls
    } else {
        Transport::Tcp
    };

    let tables = tables(cx, &raw.tables, base);
    let donors = donors(cx, &raw.donors, &tables, default_transport, base);
    let nodes = node::nodes(cx, &raw.nodes, &tables, &donors, base);
    let model = raw.model.as_ref().map(|m| model::model(cx, m, base));
    let family = model.as_ref().map(|m| m.family).unwrap_or_default();
    model::routes_fit_family(cx, &raw.nodes, &tables, family);
    security::one_namespace(cx, raw);
    security::check(cx, raw, tls.as_ref(), plaintext, &donors, &nodes);
    Config {
        path: cx.file.to_path_buf(),
        rack: rack_name,
        credential_file,
        tables,
        donors,
        nodes,
        model,
        tls,
        plaintext,
    }
}

fn tls(cx: &mut Ctx<'_>, t: &RawTls, base: &Path) -> TlsSettings {
    let dir = match &t.dir {
        Some(d) => cx.path(d, "rack.tls.dir", base),
        None => base.join("pki"),
    };
    let ca = match &t.ca {
        Some(c) => cx.path(c, "rack.tls.ca", base),
        None => dir.join("ca.pem"),
    };
    let mut operators = Vec::new();
    for (i, o) in t.operators.iter().enumerate() {
        let key = format!("rack.tls.operators[{i}]");
        let name = cx.name(o, &key);
        if operators.contains(&name) {
            cx.at(o.span(), key, format!("operator {name:?} is listed twice"));
        } else {
            operators.push(name);
        }
    }
    TlsSettings { dir, ca, operators }
}

fn tables(cx: &mut Ctx<'_>, raw: &[Spanned<RawTable>], base: &Path) -> Vec<Table> {
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    for (i, t) in raw.iter().enumerate() {
        let t = t.get_ref();
        let k = |f: &str| format!("table[{i}].{f}");
        let id = cx.int(&t.id, &k("id"), 0, i64::from(NO_TABLE) - 1);
        let layer = cx.int(&t.layer, &k("layer"), 0, MAX_LAYER);
        let rows = cx.int(&t.rows, &k("rows"), 1, MAX_ROWS as i64);
        let path = cx.path(&t.path, &k("path"), base);
        let digest = match t.digest.get_ref().parse::<TableDigest>() {
            Ok(d) => Some(d),
            Err(e) => {
                cx.at(
                    t.digest.span(),
                    k("digest"),
                    format!("{e} (`memory-donor inspect FILE` prints it)"),
                );
                None
            }
        };
        let encoding = match &t.encoding {
            None => RowEncoding::V41,
            Some(e) => RowEncoding::parse(e.get_ref()).unwrap_or_else(|err| {
                cx.at(e.span(), k("encoding"), err.to_string());
                RowEncoding::V41
            }),
        };
        let tensor_scale = t.tensor_scale.as_ref().and_then(|s| {
            let v = *s.get_ref();
            if !encoding.has_tensor_scale() {
                cx.at(
                    s.span(),
                    k("tensor_scale"),
                    format!("{} rows have no table scale", encoding.name()),
                );
                return None;
            }
            let f = v as f32;
            if !(f.is_finite() && f > 0.0) {
                cx.at(
                    s.span(),
                    k("tensor_scale"),
                    format!("{v} is not a table scale (a positive finite f32)"),
                );
                return None;
            }
            Some(f)
        });
        // A table with a valid, new id is kept even when other fields are bad
        // (the config is refused anyway), so references to it raise no echoes.
        match id {
            Some(id) if !seen.insert(id) => cx.at(
                t.id.span(),
                k("id"),
                format!("table id {id} is defined twice"),
            ),
            Some(id) => out.push(Table {
                id: id as u32,
                layer: layer.unwrap_or(0) as u32,
                path,
                rows: rows.unwrap_or(1) as u64,
                digest: digest.unwrap_or(TableDigest([0; 32])),
                encoding,
                tensor_scale,
            }),
            None => {}
        }
    }
    out
}

/// Data-plane addresses: `[tcp|tls|quic://]IP:PORT`, `default` when the
/// scheme is left out.
/// The longest path a Unix socket address holds (`sun_path` less its NUL).
const MAX_SOCKET_PATH: usize = 107;

/// Split a donor's `listen` into its host socket (`unix://PATH`: an
/// absolute path of at most 107 bytes, one at most) and the network
/// addresses left.
fn host_socket(
    cx: &mut Ctx<'_>,
    list: &Spanned<Vec<Spanned<String>>>,
    key: &str,
) -> (Option<PathBuf>, Spanned<Vec<Spanned<String>>>) {
    let mut socket: Option<PathBuf> = None;
    let mut rest = Vec::new();
    for (j, a) in list.get_ref().iter().enumerate() {
        let Some(path) = a.get_ref().strip_prefix("unix://") else {
            rest.push(a.clone());
            continue;
        };
        let key = format!("{key}[{j}]");
        let p = PathBuf::from(path);
        if !p.is_absolute() || path.len() > MAX_SOCKET_PATH || path.contains('\0') {
            cx.at(
                a.span(),
                key,
                format!(
                    "{path:?} is not a socket path: an absolute path of at most {MAX_SOCKET_PATH} bytes (unix:///run/engram-rack/donor.sock)"
                ),
            );
        } else if socket.is_some() {
            cx.at(a.span(), key, "a donor has one host socket");
        } else {
            socket = Some(p);
        }
    }
    if socket.is_some() && rest.is_empty() {
        cx.at(
            list.span(),
            key,
            "a host socket serves only its own host: list a network address beside it (tls://127.0.0.1:7410 for a host-only donor)",
        );
    }
    (socket, Spanned::new(list.span(), rest))
}

fn endpoints(
    cx: &mut Ctx<'_>,
    list: &Spanned<Vec<Spanned<String>>>,
    key: &str,
    allow_wildcard: bool,
    default: Transport,
) -> Vec<Endpoint> {
    let mut out: Vec<Endpoint> = Vec::new();
    if list.get_ref().is_empty() {
        cx.at(list.span(), key, "at least one address is needed");
    }
    for (j, a) in list.get_ref().iter().enumerate() {
        let key = format!("{key}[{j}]");
        let text = a.get_ref();
        let (transport, rest) = match text.split_once("://") {
            Some((scheme, rest)) => match Transport::parse(scheme) {
                Some(t) => (t, rest),
                None => {
                    cx.at(
                        a.span(),
                        key,
                        format!(
                            "{scheme:?} is not a transport: \"tcp://\", \"tls://\", \"quic://\", \"unix://\" \
                             or \"rdma://\""
                        ),
                    );
                    continue;
                }
            },
            None => (default, text.as_str()),
        };
        let Some(addr) = addr_str(cx, rest, a.span(), &key, allow_wildcard) else {
            continue;
        };
        let e = Endpoint::new(transport, addr);
        // TCP and TLS share TCP's port space; QUIC is UDP; RDMA has the
        // connection manager's own.
        let space = |t: Transport| match t {
            Transport::Tcp | Transport::Tls => 0,
            Transport::Quic => 1,
            Transport::Rdma => 2,
        };
        if out.contains(&e) {
            cx.at(a.span(), key, format!("{e} is listed twice"));
            continue;
        }
        if transport == Transport::Rdma && out.iter().any(|b| b.transport == Transport::Rdma) {
            cx.at(
                a.span(),
                key,
                format!("{e}: a donor has one RDMA address (one device)"),
            );
            continue;
        }
        if let Some(b) = out
            .iter()
            .find(|b| space(b.transport) == space(transport) && overlaps(b.addr, addr))
        {
            cx.at(
                a.span(),
                key,
                format!("{e} collides with {b}: give each its own address or port"),
            );
            continue;
        }
        out.push(e);
    }
    out
}

/// One `IP:PORT`; with `allow_wildcard`, a bindable one (`0.0.0.0`, port 0).
fn addr(
    cx: &mut Ctx<'_>,
    a: &Spanned<String>,
    key: &str,
    allow_wildcard: bool,
) -> Option<SocketAddr> {
    addr_str(cx, a.get_ref(), a.span(), key, allow_wildcard)
}

fn addr_str(
    cx: &mut Ctx<'_>,
    text: &str,
    span: Range<usize>,
    key: &str,
    allow_wildcard: bool,
) -> Option<SocketAddr> {
    match text.parse::<SocketAddr>() {
        Ok(addr) if !allow_wildcard && (addr.ip().is_unspecified() || addr.port() == 0) => {
            cx.at(
                span,
                key,
                format!("{addr} cannot be dialled: give a concrete address and port"),
            );
            None
        }
        Ok(addr) => Some(addr),
        Err(_) => {
            cx.at(span, key, format!("{text:?} is not IP:PORT"));
            None
        }
    }
}

/// True when binding both would collide: same port on the same or a wildcard IP.
fn overlaps(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() == b.port()
        && a.port() != 0
        && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
}

/// A donor's control and metrics addresses: bindable, distinct from the
/// data plane and from each other.
fn ops_addrs(
    cx: &mut Ctx<'_>,
    d: &RawDonor,
    listen: &[Endpoint],
    k: &dyn Fn(&str) -> String,
) -> (Option<SocketAddr>, Option<SocketAddr>) {
    let mut taken: Vec<(SocketAddr, &str)> = listen
        .iter()
        .filter(|e| e.transport != Transport::Quic)
        .map(|e| (e.addr, "listen"))
        .collect();
    let mut out = [None, None];
    for (slot, (name, raw)) in out
        .iter_mut()
        .zip([("control", &d.control), ("metrics", &d.metrics)])
    {
        let Some(raw) = raw else { continue };
        let Some(a) = addr(cx, raw, &k(name), true) else {
            continue;
        };
        if let Some((b, other)) = taken.iter().find(|(b, _)| overlaps(a, *b)) {
            cx.at(
                raw.span(),
                k(name),
                format!("{a} collides with {other} address {b}: give it a port of its own"),
            );
            continue;
        }
        taken.push((a, name));
        *slot = Some(a);
    }
    let [control, metrics] = out;
    (control, metrics)
}

fn donors(
    cx: &mut Ctx<'_>,
    raw: &[Spanned<RawDonor>],
    tables: &[Table],
    default_transport: Transport,
    base: &Path,
) -> Vec<Donor> {
    let mut out = Vec::new();
    let mut names = HashSet::new();
    for (i, d) in raw.iter().enumerate() {
        let d = d.get_ref();
        let k = |f: &str| format!("donor[{i}].{f}");
        let name = cx.name(&d.name, &k("name"));
        if name == "ssd" || name == "local" {
            cx.at(
                d.name.span(),
                k("name"),
                format!("{name:?} is reserved for the node's own sources"),
            );
        }
        if !names.insert(name.clone()) {
            cx.at(
                d.name.span(),
                k("name"),
                format!("donor {name:?} is defined twice"),
            );
        }
        out.push(donor(cx, d, name, &k, tables, default_transport, base));
    }
    out
}

/// One donor's entry, its name checked already; `k` names its keys.
fn donor(
    cx: &mut Ctx<'_>,
    d: &RawDonor,
    name: String,
    k: &dyn Fn(&str) -> String,
    tables: &[Table],
    default_transport: Transport,
    base: &Path,
) -> Donor {
    // `unix://PATH` is the host socket, not a network endpoint.
    let (host_socket, network) = host_socket(cx, &d.listen, &k("listen"));
    let listen = endpoints(cx, &network, &k("listen"), true, default_transport);
    let host_uids = host_ids(cx, &d.host_uids, &k("host_uids"), host_socket.is_some());
    let host_gids = host_ids(cx, &d.host_gids, &k("host_gids"), host_socket.is_some());
    let advertise = advertise(cx, d, k, &listen, default_transport);
    let held = held_tables(cx, d, k, tables);
    let (ram_gib, headroom_gib) = memory(cx, d, k);
    let log_level = log_level(cx, &d.log_level, &k("log_level"));
    let knobs = knobs(cx, d, k);
    let mlock = mlock_mode(cx, d, k);
    let (control, metrics) = ops_addrs(cx, d, &listen, &k);
    let clients = clients(cx, d, k);
    let table_dirs = table_dirs(cx, d, k, tables, &held, base);
    let tls_cert = d
        .tls_cert
        .as_ref()
        .map(|p| cx.path(p, &k("tls_cert"), base));
    let tls_key = d.tls_key.as_ref().map(|p| cx.path(p, &k("tls_key"), base));
    let rdma = rdma_device(cx, d, &listen, &k);
    let map_files = d.map_files.unwrap_or_else(|| {
        pages_by_default(
            listen.iter().any(|e| e.transport == Transport::Rdma),
            host_socket.is_some(),
            d.numa_node.is_some(),
        )
    });
    let host_layout = host_layout(cx, d, k, &listen, (host_socket.is_some(), map_files));
    Donor {
        name,
        listen,
        advertise,
        tables: held,
        ram_gib,
        headroom_gib,
        log_level,
        max_connections: knobs.max_connections,
        max_rows: knobs.max_rows,
        mlock,
        trust_digest: d.trust_digest.unwrap_or(false),
        fd_store: d.fd_store.unwrap_or(true),
        map_files,
        numa_node: numa_node(cx, d, k),
        host_layout,
        load_threads: knobs.load_threads,
        busy_poll: knobs.busy_poll,
        hello_timeout: knobs.timeouts[0],
        idle_timeout: knobs.timeouts[1],
        write_timeout: knobs.timeouts[2],
        drain_timeout: knobs.timeouts[3],
        control,
        metrics,
        clients,
        host_socket,
        host_uids,
        host_gids,
        table_dirs,
        tls_cert,
        tls_key,
        rdma,
    }
}

/// A donor's data-plane limits, threads and timeouts, with their defaults.
struct Knobs {
    max_connections: usize,
    max_rows: u32,
    load_threads: usize,
    busy_poll: Duration,
    /// Hello, idle, write and drain.
    timeouts: [Duration; 4],
}

fn knobs(cx: &mut Ctx<'_>, d: &RawDonor, k: &dyn Fn(&str) -> String) -> Knobs {
    let ms = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    let max_connections = opt_int(cx, &d.max_connections, &k("max_connections"), 1, 65_536)
        .map_or(crate::DEFAULT_MAX_CONNECTIONS, |n| n as usize);
    let max_rows = opt_int(
        cx,
        &d.max_rows,
        &k("max_rows"),
        48,
        i64::from(MAX_ROWS_CEILING),
    )
    .unwrap_or(i64::from(DEFAULT_MAX_ROWS)) as u32;
    let load_threads =
        opt_int(cx, &d.load_threads, &k("load_threads"), 0, 1024).unwrap_or(0) as usize;
    let busy_poll = Duration::from_micros(
        opt_int(cx, &d.busy_poll_us, &k("busy_poll_us"), 0, 10_000).unwrap_or(0) as u64,
    );
    let timeouts = [
        cx.opt_ms(
            &d.hello_timeout_ms,
            &k("hello_timeout_ms"),
            ms(crate::DEFAULT_HELLO_TIMEOUT_MS),
            false,
        ),
        cx.opt_ms(
            &d.idle_timeout_ms,
            &k("idle_timeout_ms"),
            ms(crate::DEFAULT_IDLE_TIMEOUT_MS),
            true,
        ),
        cx.opt_ms(
            &d.write_timeout_ms,
            &k("write_timeout_ms"),
            ms(crate::DEFAULT_WRITE_TIMEOUT_MS),
            false,
        ),
        cx.opt_ms(
            &d.drain_timeout_ms,
            &k("drain_timeout_ms"),
            ms(crate::DEFAULT_DRAIN_TIMEOUT_MS),
            false,
        ),
    ];
    Knobs {
        max_connections,
        max_rows,
        load_threads,
        busy_poll,
        timeouts,
    }
}

/// `host_layout`: "packed" or "planar"; planar only for a donor with a
/// host socket (what it is for), its own copy (not `map_files`: a file's
/// pages are packed) and no `rdma://` address (one-sided reads take whole
/// rows).
fn host_layout(
    cx: &mut Ctx<'_>,
    d: &RawDonor,
    k: &dyn Fn(&str) -> String,
    listen: &[Endpoint],
    (host_socket, map_files): (bool, bool),
) -> KeptLayout {
    let Some(v) = &d.host_layout else {
        return KeptLayout::Packed;
    };
    let Some(layout) = KeptLayout::parse(v.get_ref()) else {
        cx.at(
            v.span(),
            k("host_layout"),
            format!("{:?} is not one of \"packed\", \"planar\"", v.get_ref()),
        );
        return KeptLayout::Packed;
    };
    if layout == KeptLayout::Planar {
        let why = if !host_socket {
            Some(
                "lays tables out for engines that map them: it needs a host socket (a unix:// address in listen)",
            )
        } else if map_files {
            Some(
                "needs the donor's own copy of its tables: with map_files = true it serves the files' packed pages",
            )
        } else if listen.iter().any(|e| e.transport == Transport::Rdma) {
            Some("cannot serve rdma://: one-sided reads take each row's 264 bytes whole")
        } else {
            None
        };
        if let Some(why) = why {
            cx.at(v.span(), k("host_layout"), format!("\"planar\" {why}"));
            return KeptLayout::Packed;
        }
    }
    layout
}

/// `numa_node`: a node number, and only where the donor keeps its own copy.
fn numa_node(cx: &mut Ctx<'_>, d: &RawDonor, k: &dyn Fn(&str) -> String) -> Option<u32> {
    if let Some(n) = &d.numa_node
        && d.map_files.unwrap_or(false)
    {
        cx.at(
            n.span(),
            k("numa_node"),
            "binds the donor's own copy of its tables; with map_files = true it serves the \
             page cache's pages, which it does not place",
        );
    }
    opt_int(
        cx,
        &d.numa_node,
        &k("numa_node"),
        0,
        i64::from(crate::MAX_NUMA_NODE),
    )
    .map(|n| n as u32)
}

/// An optional integer key, range-checked (out of range: reported, and
/// `None`).
fn opt_int(cx: &mut Ctx<'_>, v: &Option<Spanned<i64>>, key: &str, lo: i64, hi: i64) -> Option<i64> {
    v.as_ref().and_then(|v| cx.int(v, key, lo, hi))
}

/// `host_uids` or `host_gids`: ids, only beside a host socket.
fn host_ids(
    cx: &mut Ctx<'_>,
    v: &Option<Spanned<Vec<Spanned<i64>>>>,
    key: &str,
    has_host_socket: bool,
) -> Vec<u32> {
    let Some(list) = v else {
        return Vec::new();
    };
    if !has_host_socket {
        cx.at(list.span(), key, "only beside a unix:// listen address");
    }
    list.get_ref()
        .iter()
        .enumerate()
        .filter_map(|(j, id)| cx.int(id, &format!("{key}[{j}]"), 0, i64::from(u32::MAX - 1)))
        .map(|id| id as u32)
        .collect()
}

/// The addresses nodes dial: `advertise` (each on a transport the donor
/// listens on), else the listen addresses (no wildcard among them).
fn advertise(
    cx: &mut Ctx<'_>,
    d: &RawDonor,
    k: &dyn Fn(&str) -> String,
    listen: &[Endpoint],
    default_transport: Transport,
) -> Vec<Endpoint> {
    match &d.advertise {
        Some(a) => {
            let ads = endpoints(cx, a, &k("advertise"), false, default_transport);
            for (j, e) in ads.iter().enumerate() {
                if !listen.iter().any(|l| l.transport == e.transport) {
                    cx.at(
                        a.get_ref()[j.min(a.get_ref().len() - 1)].span(),
                        format!("{}[{j}]", k("advertise")),
                        format!("{e}: the donor listens on no {} address", e.transport),
                    );
                }
            }
            ads
        }
        None => {
            if listen.iter().any(|a| a.addr.ip().is_unspecified()) {
                cx.at(
                    d.listen.span(),
                    k("listen"),
                    "a wildcard listen address needs `advertise` (the address nodes dial)",
                );
            }
            listen.to_vec()
        }
    }
}

/// The tables the donor holds: defined, each once, at least one.
fn held_tables(
    cx: &mut Ctx<'_>,
    d: &RawDonor,
    k: &dyn Fn(&str) -> String,
    tables: &[Table],
) -> Vec<u32> {
    let mut held = Vec::new();
    if d.tables.get_ref().is_empty() {
        cx.at(
            d.tables.span(),
            k("tables"),
            "a donor holds at least one table",
        );
    }
    for (j, t) in d.tables.get_ref().iter().enumerate() {
        let id = *t.get_ref();
        if !tables.iter().any(|x| i64::from(x.id) == id) {
            let known: Vec<String> = tables.iter().map(|x| x.id.to_string()).collect();
            cx.at(
                t.span(),
                format!("{}[{j}]", k("tables")),
                format!("table {id} is not defined (defined: {})", known.join(", ")),
            );
        } else if held.contains(&(id as u32)) {
            cx.at(
                t.span(),
                format!("{}[{j}]", k("tables")),
                format!("table {id} is listed twice"),
            );
        } else {
            held.push(id as u32);
        }
    }
    held
}

/// A daemon's `log_level`: a filter the daemons accept.
fn log_level(cx: &mut Ctx<'_>, v: &Option<Spanned<String>>, key: &str) -> Option<String> {
    v.as_ref().map(|l| {
        if let Err(e) = valid_log_filter(l.get_ref()) {
            cx.at(
                l.span(),
                key,
                format!("{:?} is not a log filter: {e}", l.get_ref()),
            );
        }
        l.get_ref().clone()
    })
}

/// `ram_gib` and `headroom_gib`, in range.
fn memory(cx: &mut Ctx<'_>, d: &RawDonor, k: &dyn Fn(&str) -> String) -> (f64, f64) {
    let ram_gib = *d.ram_gib.get_ref();
    if !(ram_gib.is_finite() && ram_gib > 0.0 && ram_gib <= 1.0e6) {
        cx.at(
            d.ram_gib.span(),
            k("ram_gib"),
            format!("{ram_gib} is not a RAM size in GiB (0 < ram_gib <= 1e6)"),
        );
    }
    let headroom_gib = match &d.headroom_gib {
        None => crate::DEFAULT_HEADROOM_GIB,
        Some(h) => {
            let v = *h.get_ref();
            if !(v.is_finite() && v >= 0.0 && v < ram_gib.max(0.0)) {
                cx.at(
                    h.span(),
                    k("headroom_gib"),
                    format!("{v} is not a headroom in GiB (0 <= headroom_gib < ram_gib)"),
                );
            }
            v
        }
    };
    (ram_gib, headroom_gib)
}

fn mlock_mode(cx: &mut Ctx<'_>, d: &RawDonor, k: &dyn Fn(&str) -> String) -> MlockMode {
    match d.mlock.as_ref().map(|m| (m, m.get_ref().as_str())) {
        None | Some((_, "try")) => MlockMode::Try,
        Some((_, "require")) => MlockMode::Require,
        Some((_, "off")) => MlockMode::Off,
        Some((m, other)) => {
            cx.at(
                m.span(),
                k("mlock"),
                format!("{other:?} is not one of \"try\", \"require\", \"off\""),
            );
            MlockMode::Try
        }
    }
}

/// The node names admitted on the data plane (empty: every node).
fn clients(cx: &mut Ctx<'_>, d: &RawDonor, k: &dyn Fn(&str) -> String) -> Vec<String> {
    match &d.clients {
        None => Vec::new(),
        Some(list) => {
            if list.get_ref().is_empty() {
                cx.at(
                    list.span(),
                    k("clients"),
                    "an empty list would admit no node: leave `clients` out to admit every node",
                );
            }
            list.get_ref()
                .iter()
                .enumerate()
                .map(|(j, c)| cx.name(c, &format!("{}[{j}]", k("clients"))))
                .collect()
        }
    }
}

/// Where a swap may load files from: `table_dir`, else the directories of
/// the tables the donor holds.
fn table_dirs(
    cx: &mut Ctx<'_>,
    d: &RawDonor,
    k: &dyn Fn(&str) -> String,
    tables: &[Table],
    held: &[u32],
    base: &Path,
) -> Vec<PathBuf> {
    match &d.table_dir {
        Some(p) => vec![cx.path(p, &k("table_dir"), base)],
        None => {
            let mut dirs: Vec<PathBuf> = Vec::new();
            for t in tables.iter().filter(|t| held.contains(&t.id)) {
                if let Some(p) = t.path.parent()
                    && !dirs.iter().any(|d| d == p)
                {
                    dirs.push(p.to_path_buf());
                }
            }
            dirs
        }
    }
}

/// Whether a donor that does not set `map_files` serves its tables from
/// their files' pages: yes, unless something needs its own copy of the
/// rows (an `rdma://` address registers packed rows, a host socket hands
/// out a sealed memfd, `numa_node` binds the copy's memory). A verified
/// start then costs about a hash of the file instead of a copy into fresh
/// memory on top of it (docs/benchmarks.md, `engram-bench load`).
pub fn pages_by_default(rdma: bool, host_socket: bool, numa_node: bool) -> bool {
    !(rdma || host_socket || numa_node)
}

/// `[donor.rdma]`: only beside an `rdma://` listen address, which gets the
/// defaults without it; and an RDMA donor needs a TLS or QUIC address too,
/// where nodes learn its regions.
fn rdma_device(
    cx: &mut Ctx<'_>,
    d: &RawDonor,
    listen: &[Endpoint],
    k: &dyn Fn(&str) -> String,
) -> Option<crate::RdmaDevice> {
    let has_rdma = listen.iter().any(|e| e.transport == Transport::Rdma);
    if has_rdma && !listen.iter().any(|e| e.transport.is_secure()) {
        cx.at(
            d.listen.span(),
            k("listen"),
            "an rdma:// address needs a tls:// or quic:// address beside it: nodes learn the \
             donor's RDMA regions and queue-pair tokens there, never in the clear",
        );
    }
    let Some(raw) = &d.rdma else {
        return has_rdma.then(crate::RdmaDevice::default);
    };
    if !has_rdma {
        cx.at(
            raw.span(),
            k("rdma"),
            "[donor.rdma] without an rdma:// listen address: add one, or remove the section",
        );
        return None;
    }
    let r = raw.get_ref();
    let device = r.device.as_ref().map(|n| rdma_device_name(cx, n, k));
    // The connection manager takes the port and the GID from the address
    // it binds or resolves: a choice here would be ignored, so it is
    // refused rather than silently dropped.
    for (key, value, what) in [
        ("rdma.port", r.port.as_ref(), "port"),
        ("rdma.gid_index", r.gid_index.as_ref(), "GID"),
    ] {
        if let Some(v) = value {
            cx.at(
                v.span(),
                k(key),
                format!(
                    "is not supported: the connection manager takes the device's {what} from the \
                     rdma:// address (put the address on the port and interface to use); remove it"
                ),
            );
        }
    }
    let d = crate::RdmaDevice::default();
    let ack_timeout = r
        .ack_timeout_ms
        .as_ref()
        .and_then(|v| cx.int(v, &k("rdma.ack_timeout_ms"), 1, 10_000))
        .map_or(d.ack_timeout, |ms| Duration::from_millis(ms as u64));
    let retry_count = r
        .retry_count
        .as_ref()
        .and_then(|v| cx.int(v, &k("rdma.retry_count"), 0, 7))
        .map_or(d.retry_count, |n| n as u8);
    let traffic_class = r
        .traffic_class
        .as_ref()
        .and_then(|v| cx.int(v, &k("rdma.traffic_class"), 0, 255))
        .map(|n| n as u8);
    Some(crate::RdmaDevice {
        device,
        ack_timeout,
        retry_count,
        traffic_class,
    })
}

/// An RDMA device's name: 1 to 63 of A-Z a-z 0-9 _ - . (an error
/// where it is not, the name kept either way).
fn rdma_device_name(cx: &mut Ctx<'_>, n: &Spanned<String>, k: &dyn Fn(&str) -> String) -> String {
    let v = n.get_ref();
    let ok = !v.is_empty()
        && v.len() <= 63
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.');
    if !ok {
        cx.at(
            n.span(),
            k("rdma.device"),
            format!(
                "{v:?} is not an RDMA device name (1-63 of A-Z a-z 0-9 _ - ., like \"mlx5_0\")"
            ),
        );
    }
    v.clone()
}

pub(crate) mod node;
mod security;

mod model;
#[cfg(test)]
mod tests;

/// `Ok` when `directives` is a log filter the daemons accept
/// (`info`, `memory_donor=debug,warn`); else the parser's complaint.
pub(crate) fn valid_log_filter(directives: &str) -> Result<(), String> {
    tracing_subscriber::EnvFilter::try_new(directives)
        .map(|_| ())
        .map_err(|e| e.to_string())
}
