//! What the builder writes reads back through `cluster_config::Config`:
//! every section and entry kind, an empty `[rack.tls]`, edits by name.

use engram_protocol::TableDigest;

use super::*;

/// Every section and entry kind, with a value of each optional kind.
fn every_kind(dir: &Path) -> RackToml {
    let mut rack = RackToml::new("rack-a");
    rack.rack.credential_file = Some("secret".into());
    rack.rack.plaintext = Some("allow".into());
    rack.rack.tls = Some(TlsSection::with_operators(["ops-1"]));
    let table = |id| {
        TableEntry::new(
            id,
            dir.join(format!("l{id}.etab")),
            1000,
            TableDigest([id as u8; 32]),
        )
    };
    rack.table = vec![table(1), table(14)];
    rack.donor = vec![DonorEntry {
        advertise: Some(vec![
            "tls://10.0.0.11:7410".into(),
            "quic://10.0.0.11:7410".into(),
        ]),
        ram_gib: 2.5,
        headroom_gib: Some(0.5),
        max_rows: Some(500),
        hello_timeout_ms: Some(300),
        control: Some("127.0.0.1:7411".into()),
        clients: Some(vec!["gpu-1".into()]),
        rdma: Some(RdmaSection {
            ack_timeout_ms: Some(4),
            retry_count: Some(3),
            traffic_class: Some(106),
            ..RdmaSection::default()
        }),
        ..DonorEntry::new(
            "donor-a",
            [
                "tls://0.0.0.0:7410",
                "quic://0.0.0.0:7410",
                "rdma://10.0.0.11:7412",
            ],
            [1, 14],
        )
    }];
    rack.node = vec![NodeEntry {
        tokens_per_second: Some(0.5),
        probe_interval_ms: Some(100),
        max_batch: Some(2),
        link: vec![LinkEntry {
            interface: Some("tb0".into()),
            ..LinkEntry::new("donor-a", "quic")
        }],
        ..NodeEntry::new(
            "gpu-1",
            vec![
                RouteEntry {
                    hedge: Some("off".into()),
                    policy: Some("zeros".into()),
                    hard_timeout_ms: Some(300),
                    ..RouteEntry::new(1, ["donor-a", "ssd"]).ssd_path(dir.join("copy.etab"))
                },
                RouteEntry::new(14, ["local"]),
            ],
        )
    }];
    rack.model = Some(ModelSection {
        fusion: Some("cpu".into()),
        ..ModelSection::synthetic(1000, 3, 8, 2)
    });
    rack
}

#[test]
fn a_config_of_every_kind_reads_back() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("rack.toml");
    let text = every_kind(dir.path()).to_toml().expect("toml");
    let config =
        cluster_config::Config::parse(&text, &path).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(config.rack, "rack-a");
    assert_eq!(config.credential_file, Some(dir.path().join("secret")));
    assert_eq!(config.plaintext, cluster_config::Plaintext::Allow);
    assert_eq!(config.tls.expect("[rack.tls]").operators, ["ops-1"]);
    assert_eq!(config.tables.len(), 2);
    assert_eq!(
        (
            config.tables[1].id,
            config.tables[1].layer,
            config.tables[1].rows
        ),
        (14, 14, 1000)
    );
    assert_eq!(config.tables[1].digest, TableDigest([14; 32]));
    assert_eq!(config.tables[0].path, dir.path().join("l1.etab"));
    let d = &config.donors[0];
    assert_eq!(
        (d.name.as_str(), d.tables.as_slice()),
        ("donor-a", &[1, 14][..])
    );
    assert_eq!((d.ram_gib, d.headroom_gib, d.max_rows), (2.5, 0.5, 500));
    assert_eq!(d.listen.len(), 3);
    assert_eq!(d.advertise[1].to_string(), "quic://10.0.0.11:7410");
    assert_eq!(d.hello_timeout, std::time::Duration::from_millis(300));
    assert_eq!(d.clients, ["gpu-1"]);
    assert_eq!(d.control, Some("127.0.0.1:7411".parse().expect("addr")));
    let rdma = d.rdma.as_ref().expect("[donor.rdma]");
    assert_eq!((rdma.retry_count, rdma.traffic_class), (3, Some(106)));
    let n = &config.nodes[0];
    assert_eq!(
        (n.name.as_str(), n.tokens_per_second, n.max_batch),
        ("gpu-1", 0.5, 2)
    );
    assert_eq!(n.probe_interval, std::time::Duration::from_millis(100));
    assert_eq!(n.routes.len(), 2);
    assert_eq!(n.routes[0].ssd_path, dir.path().join("copy.etab"));
    assert_eq!(
        n.routes[0].hard_timeout,
        std::time::Duration::from_millis(300)
    );
    assert_eq!(n.routes[1].sources.len(), 1);
    let (donor, link) = &n.links[0];
    assert_eq!(
        (donor.as_str(), link.interface.as_deref()),
        ("donor-a", Some("tb0"))
    );
    assert_eq!(link.transport, Some(cluster_config::Transport::Quic));
    let model = config.model.expect("[model]");
    assert_eq!((model.hidden, model.streams), (8, 2));
}

/// An empty `[rack.tls]` is still written: its presence turns TLS on.
#[test]
fn an_empty_tls_section_is_written() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut rack = RackToml::new("t");
    rack.rack.tls = Some(TlsSection::default());
    rack.table.push(TableEntry::new(
        1,
        dir.path().join("t.etab"),
        10,
        TableDigest([1; 32]),
    ));
    rack.donor
        .push(DonorEntry::new("d", ["127.0.0.1:7410"], [1]));
    let text = rack.to_toml().expect("toml");
    let config = cluster_config::Config::parse(&text, &dir.path().join("rack.toml"))
        .unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert!(config.tls.is_some(), "{text}");
    assert_eq!(
        config.donors[0].listen[0].transport,
        cluster_config::Transport::Tls
    );
}

#[test]
fn written_configs_load() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("rack.toml");
    let mut rack = RackToml::new("t");
    rack.table.push(TableEntry::new(
        1,
        dir.path().join("t.etab"),
        10,
        TableDigest([1; 32]),
    ));
    rack.donor.push(DonorEntry::new("d", ["127.0.0.1:0"], [1]));
    rack.donor_mut("d").expect("d").max_rows = Some(8192);
    rack.write(&path).expect("write");
    let config = cluster_config::Config::load(&path).expect("loads");
    assert_eq!(config.donors[0].max_rows, 8192);
    assert!(rack.node_mut("n").is_err());
}
