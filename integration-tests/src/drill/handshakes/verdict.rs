//! What the handshake storm's drill reports, and the invariants it holds
//! the donor to.

use std::time::Duration;

use anyhow::{Result, ensure};

use super::{
    CLOSE_ALLOWANCE, CONTROL_SILENT, CONTROL_SOURCES, NodeDuring, SPOOFED_INITIALS,
    SPOOFED_SOURCES, SYNACK_RETRY, Seen, TLS_HELD, TLS_SOURCES,
};
use crate::drill::report::ensure_timing;
use crate::drill::{Plan, Report};

impl Seen {
    /// The storm's figures in `r`.
    pub(super) fn figures(&self, r: &mut Report, plan: &Plan, node: &NodeDuring) {
        let (s, overflows) = (&self.s, self.overflows);
        let ms = |us: u64| us as f64 / 1e3;
        let tls_mean = ms(s.tls_close_sum_us / s.tls_closed.max(1));
        r.figure(
            "TLS half-open handshakes",
            format!(
                "{} opened from {TLS_SOURCES} addresses (up to {TLS_HELD} held, {} open at once at most), \
                 {} closed by donor-a after {tls_mean:.0} ms on average, \
                 {:.0} ms at most (hello_timeout_ms {}); {} left open; {overflows} dropped by a \
                 full accept queue (the host's, all listeners)",
                s.tls_half_open,
                s.tls_held_max,
                s.tls_closed,
                ms(s.tls_close_max_us),
                plan.hello_timeout_ms,
                s.tls_unclosed
            ),
        );
        r.figure(
            "TLS handshakes without a rack certificate",
            format!(
                "{} completed (none, or one from another CA), {} refused, {} let in",
                s.tls_intruders, s.tls_refused, s.tls_admitted
            ),
        );
        r.figure(
            "QUIC",
            format!(
                "{} junk datagrams; {} Initials from {SPOOFED_SOURCES} spoofed-looking addresses; \
                 {} half-open Initials: {} held then closed after {:.0} ms at most, \
                 {} refused at once, {} unanswered, {} still in progress when the storm ended; \
                 {} handshakes without a certificate, {} refused, {} let in, {} unanswered in time",
                s.quic_junk,
                s.quic_spoofed,
                s.quic_initials,
                s.quic_held,
                ms(s.quic_close_max_us),
                s.quic_refused_at_once,
                s.quic_unanswered,
                s.quic_initials
                    .saturating_sub(s.quic_held + s.quic_refused_at_once + s.quic_unanswered),
                s.quic_intruders,
                s.quic_refused,
                s.quic_admitted,
                s.quic_no_verdict
            ),
        );
        r.figure(
            "QUIC from the node's own address",
            self.forged.figure(self.validated),
        );
        self.rack_figures(r, plan, node);
    }

    /// What donor-a, its control plane and the node saw.
    fn rack_figures(&self, r: &mut Report, plan: &Plan, node: &NodeDuring) {
        let (silent_opened, status, open_max) = (self.silent_opened, &self.status, self.open_max);
        let [timeouts, failed, limit, evicted, retried] = self.refused;
        let control_evicted = self.control_evicted;
        let (by_a, steps, failovers, worst_in) =
            (node.by_a, node.steps, node.failovers, node.worst_us);
        r.figure(
            "donor-a's refusals",
            format!(
                "handshake_timeout {timeouts}, handshake_failed {failed}, handshake_limit {limit}, \
                 preauth_evicted {evicted}, quic_retry {retried}; at most {open_max} connections \
                 open (bound {})",
                plan.max_connections
            ),
        );
        r.figure(
            "control plane",
            format!(
                "{silent_opened} silent connections from {CONTROL_SOURCES} addresses, \
                 {control_evicted} evicted from the pre-auth budget; the operator's \
                 `engram-cluster status` {} in {:.0} ms",
                if status.ok { "succeeded" } else { "FAILED" },
                status.took.as_secs_f64() * 1e3
            ),
        );
        r.figure(
            "node during the storm",
            format!(
                "worst stall {:.2} ms; {by_a} of {steps} steps served by donor-a alone (the others by a hedge past 2 ms); {failovers} failovers",
                worst_in / 1e3
            ),
        );
    }

    /// The storm's invariants.
    pub(super) fn check(&self, plan: &Plan, node: &NodeDuring) -> Result<()> {
        let (s, overflows, silent_opened) = (&self.s, self.overflows, self.silent_opened);
        let hello = Duration::from_millis(plan.hello_timeout_ms);
        let ms = |us: u64| us as f64 / 1e3;
        let bound = hello + CLOSE_ALLOWANCE;
        // A connection whose handshake a full accept queue dropped waits in the
        // kernel for the SYN-ACK's retransmit before the donor can see it.
        let tls_bound = if overflows > 0 {
            bound + SYNACK_RETRY
        } else {
            bound
        };
        ensure!(
            s.tls_closed > 0 && s.tls_unclosed == 0,
            "half-open TLS handshakes were not all closed by donor-a: {} closed, {} left open",
            s.tls_closed,
            s.tls_unclosed
        );
        ensure_timing!(
            Duration::from_micros(s.tls_close_max_us) <= tls_bound,
            "donor-a took {:.0} ms to close a half-open TLS handshake (hello timeout {} ms; \
             {overflows} accept-queue overflows)",
            ms(s.tls_close_max_us),
            plan.hello_timeout_ms
        );
        ensure_timing!(
            s.quic_held == 0 || Duration::from_micros(s.quic_close_max_us) <= bound,
            "donor-a held a half-open QUIC handshake {:.0} ms (hello timeout {} ms)",
            ms(s.quic_close_max_us),
            plan.hello_timeout_ms
        );
        ensure!(
            s.tls_admitted == 0 && s.quic_admitted == 0,
            "donor-a let in clients without a rack certificate: {} over TLS, {} over QUIC",
            s.tls_admitted,
            s.quic_admitted
        );
        ensure!(
            s.tls_refused > 0 && s.quic_refused > 0 && s.quic_initials > 0,
            "the storm did not reach donor-a: {s:?}"
        );
        ensure!(
            s.tls_half_open >= TLS_HELD as u64
                && s.quic_spoofed >= SPOOFED_INITIALS as u64 * 9 / 10
                && silent_opened >= CONTROL_SILENT as usize * 9 / 10,
            "the storm fell short of its size: {} half-open TLS, {} spoofed Initials, \
             {silent_opened} silent control connections",
            s.tls_half_open,
            s.quic_spoofed
        );
        self.check_accounts(node)
    }

    /// The operator got through, and every handshake is accounted for.
    fn check_accounts(&self, node: &NodeDuring) -> Result<()> {
        let (s, status) = (&self.s, &self.status);
        let [timeouts, failed, limit, evicted, retried] = self.refused;
        let control_evicted = self.control_evicted;
        let failovers = node.failovers;
        ensure!(
            status.ok,
            "the operator's status failed during the storm: {}",
            status.said
        );
        ensure_timing!(
            status.took < Duration::from_secs(5),
            "the operator's status took {:?} during the storm",
            status.took
        );
        ensure!(
            control_evicted > 0.0,
            "no silent control connection was evicted: the control plane's pre-auth budget \
             was never reached"
        );
        // Every half-open handshake the donor held and closed was a timeout
        // (or evicted by a newer one from the pre-auth budget), every TLS
        // intruder a failed handshake (QUIC's add to that), and the Initials
        // past the first few in progress got a stateless Retry or hit the
        // handshake limits.
        let held = s.tls_closed + s.quic_held;
        ensure!(
            timeouts + evicted >= held as f64
                && failed >= s.tls_refused as f64
                && limit + retried > 0.0,
            "donor-a's refusals (handshake_timeout {timeouts}, handshake_failed {failed}, \
             handshake_limit {limit}, preauth_evicted {evicted}, quic_retry {retried}) do not \
             account for the storm: {s:?}"
        );
        ensure!(
            failovers == 0,
            "{failovers} failovers during the storm: the node's connection to donor-a was hurt"
        );
        ensure!(
            self.forged.served(),
            "Initials forged from the node's address kept it out over QUIC: {}",
            self.forged.figure(self.validated)
        );
        Ok(())
    }
}
