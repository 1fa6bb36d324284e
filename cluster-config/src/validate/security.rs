//! Rules that keep a rack's planes authenticated: names usable in
//! certificates, transports that need `[rack.tls]`, and no plaintext
//! beyond loopback unless the config says so.

use std::net::SocketAddr;

use super::Ctx;
use crate::raw::RawConfig;
use crate::{Donor, Node, Plaintext, TlsSettings, Transport};

/// Why plaintext is refused, in every such error.
const PLAINTEXT_WHY: &str = "plaintext carries rows, credentials and control calls in the clear \
     to anyone on this network; use tls:// or quic:// with [rack.tls], bind a loopback address, \
     or set rack.plaintext = \"allow\" to accept it";

fn loopback(a: SocketAddr) -> bool {
    a.ip().is_loopback()
}

pub(super) fn check(
    cx: &mut Ctx<'_>,
    raw: &RawConfig,
    tls: Option<&TlsSettings>,
    plaintext: Plaintext,
    donors: &[Donor],
    nodes: &[Node],
) {
    for (i, (d, rd)) in donors.iter().zip(&raw.donors).enumerate() {
        let rd = rd.get_ref();
        let k = |f: &str| format!("donor[{i}].{f}");
        for e in &d.listen {
            if e.transport == Transport::Rdma && tls.is_none() {
                cx.at(
                    rd.listen.span(),
                    k("listen"),
                    format!(
                        "{e} needs the rack's PKI: nodes learn RDMA regions and queue-pair \
                         tokens over TLS or QUIC only; add [rack.tls] (see `engram-cluster pki init`)"
                    ),
                );
            }
            if e.transport.is_secure() && tls.is_none() {
                cx.at(
                    rd.listen.span(),
                    k("listen"),
                    format!(
                        "{e} needs the rack's PKI: add [rack.tls] (see `engram-cluster pki init`)"
                    ),
                );
            }
            if e.transport == Transport::Tcp
                && !loopback(e.addr)
                && plaintext == Plaintext::LoopbackOnly
            {
                cx.at(
                    rd.listen.span(),
                    k("listen"),
                    format!("{e} is plaintext on a non-loopback address: {PLAINTEXT_WHY}"),
                );
            }
        }
        if let (Some(c), None, Plaintext::LoopbackOnly, Some(raw_c)) =
            (d.control, tls, plaintext, &rd.control)
            && !loopback(c)
        {
            cx.at(
                raw_c.span(),
                k("control"),
                format!(
                    "control plane {c} would be plaintext and unauthenticated on a non-loopback \
                     address (anyone could Drain or SwapTable this donor): {PLAINTEXT_WHY}"
                ),
            );
        }
        if tls.is_none() {
            for (key, set) in [
                ("clients", rd.clients.as_ref().map(|c| c.span())),
                ("tls_cert", rd.tls_cert.as_ref().map(|c| c.span())),
                ("tls_key", rd.tls_key.as_ref().map(|c| c.span())),
            ] {
                if let Some(span) = set {
                    cx.at(
                        span,
                        k(key),
                        format!("`{key}` applies to TLS and QUIC, which need [rack.tls]"),
                    );
                }
            }
        }
        if let Some(list) = &rd.clients {
            for (j, c) in list.get_ref().iter().enumerate() {
                if !nodes.iter().any(|n| &n.name == c.get_ref()) {
                    cx.at(
                        c.span(),
                        format!("donor[{i}].clients[{j}]"),
                        format!("{:?} is not a node of this rack", c.get_ref()),
                    );
                }
            }
        }
    }
    let Some(tls) = tls else {
        for (i, rn) in raw.nodes.iter().enumerate() {
            let rn = rn.get_ref();
            for (key, set) in [
                ("tls_cert", rn.tls_cert.as_ref().map(|c| c.span())),
                ("tls_key", rn.tls_key.as_ref().map(|c| c.span())),
            ] {
                if let Some(span) = set {
                    cx.at(
                        span,
                        format!("node[{i}].{key}"),
                        format!("`{key}` needs [rack.tls]"),
                    );
                }
            }
        }
        return;
    };
    // Every identity is a DNS name in its certificate.
    let dns = |n: &str| rustls::pki_types::DnsName::try_from(n).is_ok() && !n.contains('_');
    let hosts = raw
        .donors
        .iter()
        .enumerate()
        .map(|(i, d)| (format!("donor[{i}].name"), &d.get_ref().name))
        .chain(
            raw.nodes
                .iter()
                .enumerate()
                .map(|(i, n)| (format!("node[{i}].name"), &n.get_ref().name)),
        );
    for (key, name) in hosts {
        let n = name.get_ref();
        if !dns(n) {
            cx.at(
                name.span(),
                key,
                format!("{n:?} is not a DNS name, which a certificate needs: letters, digits, '-' and '.'"),
            );
        }
    }
    let raw_ops = raw
        .rack
        .get_ref()
        .tls
        .as_ref()
        .map(|t| &t.get_ref().operators);
    for (i, o) in raw_ops.into_iter().flatten().enumerate() {
        let n = o.get_ref();
        let key = format!("rack.tls.operators[{i}]");
        if !dns(n) {
            cx.at(
                o.span(),
                key.clone(),
                format!("{n:?} is not a DNS name, which a certificate needs: letters, digits, '-' and '.'"),
            );
        }
        if donors.iter().any(|d| &d.name == n) || nodes.iter().any(|x| &x.name == n) {
            cx.at(
                o.span(),
                key,
                format!(
                    "{n:?} is already a donor or node: an operator identity needs a name of its own"
                ),
            );
        }
    }
    let _ = &tls.operators;
}
