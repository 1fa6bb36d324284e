//! The storm's forged part: QUIC Initials that claim the node's own
//! address (127.0.0.1, where the drill's node dials from), never
//! continued, then a QUIC dial as the node from that address, which must
//! get through them and read rows.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use cluster_config::{Config, Transport};
use inference_node::client::{ClientOptions, DonorClient, Request, TlsClient};
use inference_node::tls::NodeTls;

use crate::forge::{Forged, forge_quic_initials};

/// Initials forged from the node's address before it dials.
pub(super) const FORGED_INITIALS: usize = 1000;
/// Lookups the node reads on its QUIC connection.
const LOOKUPS: usize = 20;

/// What the forged Initials and the node's dial through them came to.
#[derive(Debug, Clone)]
pub(super) struct ForgedDial {
    pub forged: Forged,
    /// How long the node's QUIC connect took, or why it failed.
    pub connect: Result<Duration, String>,
    /// Lookups answered on that connection.
    pub lookups: usize,
}

/// Node `node` of `config`, over QUIC to donor `donor`, pinned to every
/// table of the rack.
fn options(config: &Config, node: &str, donor: &str) -> Result<ClientOptions> {
    let pinned = config.tables.iter().map(|t| (t.id, t.digest)).collect();
    let mut o = ClientOptions::new(node, pinned);
    o.transport = Transport::Quic;
    // A table of another encoding than V4.1's is read at version 2.
    if config
        .tables
        .iter()
        .any(|t| t.encoding != engram_protocol::encoding::RowEncoding::V41)
    {
        o.version = engram_protocol::PROTOCOL_VERSION;
    }
    o.connect_timeout = Duration::from_secs(5);
    let files = config
        .tls_files(node)
        .context("the node's certificate files")?;
    o.tls = Some(TlsClient {
        tls: NodeTls::load(&files)?,
        server_name: cluster_config::tls::server_name(donor)?,
    });
    Ok(o)
}

/// Forge [`FORGED_INITIALS`] Initials from 127.0.0.1 at `quic`, then dial
/// it as `node` and read [`LOOKUPS`] lookups of the rack's first table.
pub(super) fn forged_then_dial(
    config: &Path,
    node: &str,
    donor: &str,
    quic: SocketAddr,
) -> Result<ForgedDial> {
    let cfg = Config::load(config).context("the rack config")?;
    let opts = options(&cfg, node, donor)?;
    let ca = &cfg.tls.as_ref().context("the rack has no [rack.tls]")?.ca;
    let table = cfg.tables.first().context("the rack has no table")?;
    let rows: Vec<u64> = (0..24).map(|i| i * 7 % table.rows.max(1)).collect();
    let forged = forge_quic_initials(Ipv4Addr::LOCALHOST, None, quic, ca, FORGED_INITIALS);
    let rt = crate::runtime();
    let (connect, lookups) = rt.block_on(async {
        let t0 = Instant::now();
        let c = match DonorClient::connect(quic, &opts).await {
            Ok(c) => c,
            Err(e) => return (Err(e.to_string()), 0),
        };
        let took = t0.elapsed();
        let mut out = vec![0u8; rows.len() * c.row_bytes(table.id)];
        let req = [Request {
            table: table.id,
            rows: &rows,
        }];
        let mut answered = 0;
        for _ in 0..LOOKUPS {
            if c.lookup(&req, &mut out).await.is_ok() {
                answered += 1;
            }
        }
        (Ok(took), answered)
    });
    Ok(ForgedDial {
        forged,
        connect,
        lookups,
    })
}

impl ForgedDial {
    /// Whether the node got through and read every lookup.
    pub(super) fn served(&self) -> bool {
        self.connect.is_ok() && self.lookups == LOOKUPS
    }

    /// One line for the report.
    pub(super) fn figure(&self, validated: f64) -> String {
        let how = if self.forged.raw {
            "raw socket"
        } else {
            "sockets bound to it"
        };
        let dial = match &self.connect {
            Ok(d) => format!("connected in {:.1} ms", d.as_secs_f64() * 1e3),
            Err(e) => format!("FAILED to connect: {e}"),
        };
        format!(
            "{} Initials forged from the node's address 127.0.0.1 ({how}); then a QUIC dial as \
             the node from it: {dial}, {} of {LOOKUPS} lookups answered; donor-a validated {validated} \
             Retry tokens",
            self.forged.sent, self.lookups
        )
    }
}
