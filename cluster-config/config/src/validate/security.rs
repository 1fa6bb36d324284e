//! Rules that keep a rack's planes authenticated: names usable in
//! certificates, transports that need `[rack.tls]`, and no plaintext
//! beyond loopback unless the config says so.

use std::net::SocketAddr;

use super::Ctx;
use crate::raw::{RawConfig, RawDonor};
use crate::{Donor, Node, Plaintext, TlsSettings, Transport};

use crate::PLAINTEXT_WHY;

fn loopback(a: SocketAddr) -> bool {
    a.ip().is_loopback()
}

/// Donors, nodes and operators share one namespace of names, compared
/// without case as certificates' DNS names are: two hosts whose names fold
/// to the same are refused (a node named like a donor could pass a TLS name
/// check as that donor). Exact duplicates within one kind are reported by
/// that kind's own rule.
pub(super) fn one_namespace(cx: &mut Ctx<'_>, raw: &RawConfig) {
    let operators = raw
        .rack
        .get_ref()
        .tls
        .as_ref()
        .map(|t| &t.get_ref().operators);
    let all = raw
        .donors
        .iter()
        .enumerate()
        .map(|(i, d)| ("donor", format!("donor[{i}].name"), &d.get_ref().name))
        .chain(
            raw.nodes
                .iter()
                .enumerate()
                .map(|(i, n)| ("node", format!("node[{i}].name"), &n.get_ref().name)),
        )
        .chain(
            operators
                .into_iter()
                .flatten()
                .enumerate()
                .map(|(i, o)| ("operator", format!("rack.tls.operators[{i}]"), o)),
        );
    let mut seen: Vec<(&str, String, &str, String)> = Vec::new();
    for (kind, key, name) in all {
        let n = name.get_ref().as_str();
        let folded = crate::tls::normalize(n);
        let first = seen.iter().find(|(_, _, _, f)| *f == folded);
        match first {
            Some((k, _, other, _)) if *k == kind && *other == n => {}
            Some((other_kind, other_key, other, _)) => cx.at(
                name.span(),
                key,
                format!(
                    "{kind} {n:?} collides with {other_kind} {other:?} ({other_key}): donors, \
                     nodes and operators share one namespace of names, compared without case as \
                     certificates' DNS names are; give each a name of its own (a host running \
                     both daemons: set ENGRAM_DONOR_NAME or ENGRAM_NODE_NAME for its units, \
                     docs/operations.md)"
                ),
            ),
            None => seen.push((kind, key, n, folded)),
        }
    }
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
        donor(cx, i, d, rd.get_ref(), tls.is_some(), plaintext, nodes);
    }
    if plaintext == Plaintext::LoopbackOnly {
        plaintext_nodes(cx, raw, nodes);
    }
    if tls.is_none() {
        node_tls_without_pki(cx, raw);
        return;
    }
    dns_names(cx, raw);
}

/// One donor's addresses, plaintext, and TLS keys.
fn donor(
    cx: &mut Ctx<'_>,
    i: usize,
    d: &Donor,
    rd: &RawDonor,
    has_pki: bool,
    plaintext: Plaintext,
    nodes: &[Node],
) {
    let k = |f: &str| format!("donor[{i}].{f}");
    donor_listen(cx, &k, d, rd, has_pki, plaintext);
    donor_plaintext(cx, &k, d, rd, has_pki, plaintext);
    if !has_pki {
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

/// Each listen address: a PKI for TLS, QUIC and RDMA; plaintext TCP on
/// loopback only, unless the rack allows it.
fn donor_listen(
    cx: &mut Ctx<'_>,
    k: &dyn Fn(&str) -> String,
    d: &Donor,
    rd: &RawDonor,
    has_pki: bool,
    plaintext: Plaintext,
) {
    for e in &d.listen {
        if e.transport == Transport::Rdma && !has_pki {
            cx.at(
                rd.listen.span(),
                k("listen"),
                format!(
                    "{e} needs the rack's PKI: nodes learn RDMA regions and queue-pair \
                     tokens over TLS or QUIC only; add [rack.tls] (see `engram-cluster pki init`)"
                ),
            );
        }
        if e.transport.is_secure() && !has_pki {
            cx.at(
                rd.listen.span(),
                k("listen"),
                format!("{e} needs the rack's PKI: add [rack.tls] (see `engram-cluster pki init`)"),
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
}

/// Advertised plaintext addresses, /metrics and a control plane without
/// TLS: on loopback only, unless the rack allows plaintext.
fn donor_plaintext(
    cx: &mut Ctx<'_>,
    k: &dyn Fn(&str) -> String,
    d: &Donor,
    rd: &RawDonor,
    has_pki: bool,
    plaintext: Plaintext,
) {
    if plaintext == Plaintext::LoopbackOnly {
        for e in &d.advertise {
            if e.transport == Transport::Tcp && !loopback(e.addr) {
                let span = rd.advertise.as_ref().map_or(rd.listen.span(), |a| a.span());
                cx.at(
                    span,
                    k("advertise"),
                    format!(
                        "{e} tells nodes to dial plaintext on a non-loopback address: \
                         {PLAINTEXT_WHY}"
                    ),
                );
            }
        }
        if let (Some(m), Some(raw_m)) = (d.metrics, &rd.metrics)
            && !loopback(m)
        {
            cx.at(
                raw_m.span(),
                k("metrics"),
                format!(
                    "/metrics at {m} is plaintext HTTP, unauthenticated, on a non-loopback \
                     address (scrape it through a local agent or a TLS proxy): {PLAINTEXT_WHY}"
                ),
            );
        }
    }
    if let (Some(c), false, Plaintext::LoopbackOnly, Some(raw_c)) =
        (d.control, has_pki, plaintext, &rd.control)
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
}

/// A node's API and /metrics stay on loopback in a rack without plaintext.
fn plaintext_nodes(cx: &mut Ctx<'_>, raw: &RawConfig, nodes: &[Node]) {
    for (i, (n, rn)) in nodes.iter().zip(&raw.nodes).enumerate() {
        let rn = rn.get_ref();
        // The node API has no TLS: it stays on loopback (the default).
        if let Some(raw_api) = &rn.api
            && !loopback(n.api)
        {
            cx.at(
                raw_api.span(),
                format!("node[{i}].api"),
                format!(
                    "the node API at {} is plaintext gRPC with no authentication (anyone \
                     reaching it could Generate); keep it on loopback and front it with \
                     your own authenticated proxy: {PLAINTEXT_WHY}",
                    n.api
                ),
            );
        }
        if let (Some(m), Some(raw_m)) = (n.metrics, &rn.metrics)
            && !loopback(m)
        {
            cx.at(
                raw_m.span(),
                format!("node[{i}].metrics"),
                format!(
                    "/metrics at {m} is plaintext HTTP, unauthenticated, on a non-loopback \
                     address (scrape it through a local agent or a TLS proxy): {PLAINTEXT_WHY}"
                ),
            );
        }
    }
}

/// A node's TLS keys need the rack's PKI.
fn node_tls_without_pki(cx: &mut Ctx<'_>, raw: &RawConfig) {
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
}

/// Every identity is a DNS name in its certificate.
fn dns_names(cx: &mut Ctx<'_>, raw: &RawConfig) {
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
                key,
                format!("{n:?} is not a DNS name, which a certificate needs: letters, digits, '-' and '.'"),
            );
        }
    }
}
