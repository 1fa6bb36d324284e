//! Who may call what on the control plane. Every gRPC request passes
//! through [`Gate`] before it reaches a service (health or
//! `DonorControl`), so one rule decides for all of them:
//!
//! | caller | health, ListTables, Stats | Drain, SwapTable (and any other method) |
//! | --- | --- | --- |
//! | TLS, an operator's certificate | yes | yes |
//! | TLS, a node's certificate | yes | no (`not_operator`) |
//! | TLS, any other name the rack CA signed | no (`no_role`) | no (`no_role`) |
//! | plaintext, from loopback | yes | yes |
//! | plaintext, from elsewhere | yes | no (`not_loopback`) |
//!
//! A certificate the rack CA did not sign never gets this far: the TLS
//! handshake refuses it. A certified name with no role is refused even
//! health: it proves only that the rack's PKI issued it (to another donor,
//! say), not that it has business here. On a plaintext control plane
//! (loopback only unless `rack.plaintext = "allow"`) there are no
//! identities, so only the donor's own host may change anything.
//!
//! Refusals answer PERMISSION_DENIED saying why, are logged (at a bounded
//! rate) with the caller and the method, and are counted in
//! `engram_donor_refusals_total{plane="control",reason}`.

use std::convert::Infallible;
use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::{Context, Poll};

use daemon_runtime::logging::RateLimit;
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::{BoxFuture, Service, http};
use tonic::server::NamedService;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

use crate::stats::Stats;
use crate::tls::{DonorTls, Role};

/// A control-plane method, as the rules see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rpc {
    /// Any `grpc.health.v1.Health` method.
    Health,
    /// `DonorControl/ListTables`.
    ListTables,
    /// `DonorControl/Stats`.
    Stats,
    /// `DonorControl/Drain`.
    Drain,
    /// `DonorControl/SwapTable`.
    SwapTable,
    /// Anything else (answered UNIMPLEMENTED once allowed).
    Other,
}

impl Rpc {
    /// The method of a gRPC request path (`/package.Service/Method`).
    pub fn from_path(path: &str) -> Self {
        let control = format!("/{}/", engram_protocol::control::SERVICE_NAME);
        if path.starts_with("/grpc.health.v1.Health/") {
            return Self::Health;
        }
        match path.strip_prefix(control.as_str()) {
            Some("ListTables") => Self::ListTables,
            Some("Stats") => Self::Stats,
            Some("Drain") => Self::Drain,
            Some("SwapTable") => Self::SwapTable,
            _ => Self::Other,
        }
    }

    /// True for the methods that only read.
    pub fn reads_only(self) -> bool {
        matches!(self, Self::Health | Self::ListTables | Self::Stats)
    }

    /// Its name in logs and messages.
    pub fn name(self) -> &'static str {
        match self {
            Self::Health => "health",
            Self::ListTables => "ListTables",
            Self::Stats => "Stats",
            Self::Drain => "Drain",
            Self::SwapTable => "SwapTable",
            Self::Other => "an unknown method",
        }
    }
}

/// Who is calling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// Over TLS: the name its certificate proves (none when it names no
    /// host) and that name's role on this donor.
    Certified {
        /// The host name its certificate proves, if it names one.
        identity: Option<String>,
        /// That name's role on this donor, if it has one.
        role: Option<Role>,
        /// Its address, where the connection tells it.
        peer: Option<SocketAddr>,
    },
    /// Over plaintext: only its address is known.
    Plain {
        /// Its address, where the connection tells it.
        peer: Option<SocketAddr>,
    },
}

impl fmt::Display for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let peer =
            |p: &Option<SocketAddr>| p.map_or("an unknown address".into(), |a| a.to_string());
        match self {
            Self::Certified {
                identity, peer: p, ..
            } => write!(
                f,
                "{} ({})",
                identity
                    .as_deref()
                    .unwrap_or("a certificate naming no host"),
                peer(p)
            ),
            Self::Plain { peer: p } => write!(f, "{}", peer(p)),
        }
    }
}

/// Why a call is refused: the counted reason and the caller's message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// snake_case, the `reason` label of the refusals counter.
    pub reason: &'static str,
    /// What the caller is told.
    pub message: String,
}

fn loopback(peer: Option<SocketAddr>) -> bool {
    peer.is_some_and(|p| p.ip().to_canonical().is_loopback())
}

/// May `caller` call `rpc` on donor `donor`?
pub fn authorize(donor: &str, rpc: Rpc, caller: &Caller) -> Result<(), Refusal> {
    match caller {
        Caller::Certified {
            role: Some(Role::Operator),
            ..
        } => Ok(()),
        Caller::Certified {
            role: Some(Role::Node),
            ..
        } if rpc.reads_only() => Ok(()),
        Caller::Certified {
            identity,
            role: Some(Role::Node),
            ..
        } => Err(Refusal {
            reason: "not_operator",
            message: format!(
                "{} is a node: {} on donor {donor} needs an operator's certificate \
                 (a name in [rack.tls] operators)",
                identity.as_deref().unwrap_or("this caller"),
                rpc.name()
            ),
        }),
        Caller::Certified { identity, .. } => Err(Refusal {
            reason: "no_role",
            message: format!(
                "{} has no role on donor {donor}: it is neither a node nor an operator of \
                 this rack ([rack.tls] operators)",
                identity
                    .as_deref()
                    .unwrap_or("a certificate naming no host (no dNSName)")
            ),
        }),
        Caller::Plain { .. } if rpc.reads_only() => Ok(()),
        Caller::Plain { peer } if loopback(*peer) => Ok(()),
        Caller::Plain { peer } => Err(Refusal {
            reason: "not_loopback",
            message: format!(
                "{} from {} refused: a plaintext control plane has no identities, so only \
                 donor {donor}'s own host (loopback) may call it; use [rack.tls] and an \
                 operator certificate",
                rpc.name(),
                peer.map_or("an unknown address".into(), |a| a.to_string())
            ),
        }),
    }
}

static REFUSED: RateLimit = RateLimit::new(10);

/// Log (at a bounded rate) and count a refused control call.
pub fn refused(stats: &Stats, caller: &dyn fmt::Display, rpc: Rpc, r: &Refusal) {
    stats.refusal("control", r.reason);
    if let Some(suppressed) = REFUSED.allow() {
        tracing::warn!(
            caller = %caller,
            rpc = rpc.name(),
            reason = r.reason,
            suppressed,
            "control call refused: {}",
            r.message
        );
    }
}

/// What [`Gate`] decides with.
#[derive(Debug)]
pub struct Rules {
    /// The donor's name (in messages).
    pub donor: String,
    /// Where refusals are counted.
    pub stats: Arc<Stats>,
    /// The TLS state when the control plane speaks TLS (roles come from
    /// its access rules, which a reload replaces).
    pub tls: Option<Arc<DonorTls>>,
}

impl Rules {
    /// The caller of a request, from what the connection told tonic.
    pub fn caller(&self, ext: &http::Extensions) -> Caller {
        match &self.tls {
            Some(tls) => {
                let info = ext.get::<TlsConnectInfo<TcpConnectInfo>>();
                let certs = info.and_then(TlsConnectInfo::peer_certs);
                let identity =
                    cluster_config::tls::peer_identity(certs.as_deref().map(Vec::as_slice));
                Caller::Certified {
                    role: identity.as_deref().and_then(|i| tls.role(i)),
                    identity,
                    peer: info.and_then(|i| i.get_ref().remote_addr()),
                }
            }
            None => Caller::Plain {
                peer: ext
                    .get::<TcpConnectInfo>()
                    .and_then(TcpConnectInfo::remote_addr),
            },
        }
    }

    /// Allow the request, or the status to answer it with (logged and counted).
    pub fn check<B>(&self, req: &http::Request<B>) -> Result<(), Status> {
        let rpc = Rpc::from_path(req.uri().path());
        let caller = self.caller(req.extensions());
        // Every call checks the caller's certificate again, against the CA,
        // the time and the access rules of now: an open HTTP/2 session gets
        // nothing once a new CA, an expiry or a reload has cut its holder off.
        if let Some(tls) = &self.tls {
            let certs = req
                .extensions()
                .get::<TlsConnectInfo<TcpConnectInfo>>()
                .and_then(TlsConnectInfo::peer_certs)
                .unwrap_or_default();
            if let Err(why) = tls.still_admits(&certs, crate::tls::Plane::Control) {
                let r = Refusal {
                    reason: "revoked",
                    message: format!("refused: {why}"),
                };
                refused(&self.stats, &caller, rpc, &r);
                return Err(Status::permission_denied(r.message));
            }
        }
        authorize(&self.donor, rpc, &caller).map_err(|r| {
            refused(&self.stats, &caller, rpc, &r);
            Status::permission_denied(r.message)
        })
    }
}

/// A gRPC service behind the control plane's rules.
#[derive(Debug, Clone)]
pub struct Gate<S> {
    inner: S,
    rules: Arc<Rules>,
}

impl<S> Gate<S> {
    /// `inner`, answering only the calls `rules` allow.
    pub fn new(inner: S, rules: Arc<Rules>) -> Self {
        Self { inner, rules }
    }
}

impl<S: NamedService> NamedService for Gate<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<http::Request<Body>> for Gate<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<http::Response<Body>, Infallible>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        match self.rules.check(&req) {
            Ok(()) => Box::pin(self.inner.call(req)),
            Err(status) => Box::pin(std::future::ready(Ok(status.into_http()))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [Rpc; 6] = [
        Rpc::Health,
        Rpc::ListTables,
        Rpc::Stats,
        Rpc::Drain,
        Rpc::SwapTable,
        Rpc::Other,
    ];

    fn tls(identity: Option<&str>, role: Option<Role>) -> Caller {
        Caller::Certified {
            identity: identity.map(String::from),
            role,
            peer: Some("10.0.0.5:4000".parse().expect("addr")),
        }
    }

    fn plain(peer: &str) -> Caller {
        Caller::Plain {
            peer: Some(peer.parse().expect("addr")),
        }
    }

    fn allowed(caller: &Caller) -> Vec<Rpc> {
        ALL.into_iter()
            .filter(|r| authorize("d", *r, caller).is_ok())
            .collect()
    }

    #[test]
    fn paths_name_their_methods() {
        assert_eq!(Rpc::from_path("/grpc.health.v1.Health/Check"), Rpc::Health);
        assert_eq!(Rpc::from_path("/grpc.health.v1.Health/Watch"), Rpc::Health);
        let m = |name: &str| format!("/engram.control.v1.DonorControl/{name}");
        assert_eq!(Rpc::from_path(&m("ListTables")), Rpc::ListTables);
        assert_eq!(Rpc::from_path(&m("Stats")), Rpc::Stats);
        assert_eq!(Rpc::from_path(&m("Drain")), Rpc::Drain);
        assert_eq!(Rpc::from_path(&m("SwapTable")), Rpc::SwapTable);
        assert_eq!(Rpc::from_path(&m("Nope")), Rpc::Other);
        assert_eq!(
            Rpc::from_path("/grpc.reflection.v1.ServerReflection/X"),
            Rpc::Other
        );
        assert_eq!(
            Rpc::from_path("/engram.control.v1.DonorControl/Drain/x"),
            Rpc::Other
        );
    }

    #[test]
    fn the_roles_table() {
        assert_eq!(allowed(&tls(Some("ops"), Some(Role::Operator))), ALL);
        let reads = [Rpc::Health, Rpc::ListTables, Rpc::Stats];
        assert_eq!(allowed(&tls(Some("n"), Some(Role::Node))), reads);
        assert_eq!(allowed(&tls(Some("other-donor"), None)), []);
        assert_eq!(allowed(&tls(None, None)), []);
        assert_eq!(allowed(&plain("127.0.0.1:5000")), ALL);
        assert_eq!(allowed(&plain("[::1]:5000")), ALL);
        assert_eq!(allowed(&plain("[::ffff:127.0.0.1]:5000")), ALL);
        assert_eq!(allowed(&plain("10.0.0.5:5000")), reads);
        assert_eq!(allowed(&Caller::Plain { peer: None }), reads);
    }

    #[test]
    fn refusals_say_why() {
        let r = authorize("d", Rpc::Drain, &tls(Some("n"), Some(Role::Node))).expect_err("node");
        assert_eq!(r.reason, "not_operator");
        assert!(
            r.message.contains("n is a node") && r.message.contains("Drain"),
            "{}",
            r.message
        );
        let r = authorize("d", Rpc::Health, &tls(Some("x"), None)).expect_err("no role");
        assert_eq!(r.reason, "no_role");
        assert!(
            r.message.contains("x has no role on donor d"),
            "{}",
            r.message
        );
        let r = authorize("d", Rpc::SwapTable, &plain("10.0.0.5:5000")).expect_err("remote");
        assert_eq!(r.reason, "not_loopback");
        assert!(
            r.message.contains("SwapTable from 10.0.0.5:5000")
                && r.message.contains("no identities")
                && r.message.contains("[rack.tls]"),
            "{}",
            r.message
        );
        assert_eq!(
            tls(Some("n"), Some(Role::Node)).to_string(),
            "n (10.0.0.5:4000)"
        );
        assert_eq!(plain("10.0.0.5:5000").to_string(), "10.0.0.5:5000");
    }
}
