//! HA replication refuses what it must: a real daemon (node B) serves the sync
//! service in a namespace; a hand-made peer in another namespace connects to it with the
//! wrong certificates, or with the right ones and malformed messages. A peer whose
//! certificate another CA signed, or that has none, is refused at the handshake; a message
//! without a valid node id — 0, B's own, out of range, no configured peer's, or another
//! configured peer's than the one its certificate names — closes the stream and is counted
//! (B has two peers: the hand-made one, node 7, and node 3, which never connects);
//! malformed or out-of-range connections are refused, counted, acknowledged as refused and never installed, while the
//! valid one in the same batch is; a gap in the tail is answered with a resend request.

use std::{path::Path, time::Duration};

use fastpath::{
    datapath::CtTable,
    sync::pb,
    testkit::netns::{
        Daemon, DaemonConfig, TempDir, Topology, VethEnd, prepare_test, unique_pin_dir,
    },
};
use fastpath_common::map_names;
use rcgen::ExtendedKeyUsagePurpose;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

use fastpath::testkit::pki::{CertFiles, TestCa};

const B_ADDR: &str = "10.202.0.2";
const ROGUE_ADDR: &str = "10.202.0.1";
const VIP: &str = "10.203.0.1";
const BACKEND: &str = "10.203.1.1";

use crate::bin;

fn ep(a: [u8; 4], port: u32) -> Option<pb::Endpoint> {
    Some(pb::Endpoint {
        address: a.to_vec().into(),
        port,
    })
}

/// A replied, established TCP connection 10.202.0.1:40000 → 10.203.0.9:22 (no NAT).
fn valid() -> pb::Connection {
    pb::Connection {
        family: 4,
        protocol: 6,
        lo: ep([10, 202, 0, 1], 40000),
        hi: ep([10, 203, 0, 9], 22),
        original_is_lo: true,
        tcp_state: 3,
        seen_reply: true,
        assured: true,
        ..Default::default()
    }
}

/// Each malformed in one way, with what is wrong.
fn malformed() -> Vec<(&'static str, pb::Connection)> {
    vec![
        (
            "family 5",
            pb::Connection {
                family: 5,
                ..valid()
            },
        ),
        (
            "protocol 200",
            pb::Connection {
                protocol: 200,
                ..valid()
            },
        ),
        (
            "a 3-byte address",
            pb::Connection {
                lo: Some(pb::Endpoint {
                    address: vec![10, 202, 0].into(),
                    port: 40000,
                }),
                ..valid()
            },
        ),
        (
            "port 70000",
            pb::Connection {
                hi: ep([10, 203, 0, 9], 70_000),
                ..valid()
            },
        ),
        (
            "TCP state 99",
            pb::Connection {
                tcp_state: 99,
                ..valid()
            },
        ),
        (
            "no lo endpoint",
            pb::Connection {
                lo: None,
                ..valid()
            },
        ),
        (
            "lb and lb_alias both",
            pb::Connection {
                lb: true,
                lb_alias: true,
                ..valid()
            },
        ),
        (
            "a service this node does not have",
            pb::Connection {
                lb: true,
                nat: ep([10, 203, 1, 1], 80),
                nat2: ep([0, 0, 0, 0], 0),
                service: Some(pb::ServiceRef {
                    vip: vec![10, 9, 9, 9].into(),
                    port: 80,
                    protocol: 6,
                }),
                backend: ep([10, 203, 1, 1], 80),
                ..valid()
            },
        ),
    ]
}

fn upsert(seq: u64, c: pb::Connection) -> pb::Change {
    pb::Change {
        seq,
        op: Some(pb::change::Op::Upsert(c)),
    }
}

/// What a hand-made peer saw of one stream.
#[derive(Debug)]
enum Outcome {
    /// The stream could not be opened (TLS refused), and why (shown on failure).
    Refused(#[allow(dead_code, reason = "shown by Debug in assertion messages")] String),
    /// The acknowledgements it got before the stream ended (or it stopped reading).
    Acks(Vec<pb::Ack>),
}

/// Opens a stream to B as `identity` (none: no client certificate), sends `batches` one by
/// one reading an ack after each batch that `wants_ack`.
fn peer_session(
    rogue: &fastpath::testkit::netns::Netns,
    ca: &Path,
    identity: Option<&CertFiles>,
    batches: Vec<(pb::Batch, bool)>,
) -> Outcome {
    let ca = std::fs::read(ca).expect("CA");
    let identity = identity.map(|c| {
        Identity::from_pem(
            std::fs::read(&c.cert).expect("cert"),
            std::fs::read(&c.key).expect("key"),
        )
    });
    rogue
        .in_netns(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca));
                if let Some(id) = identity {
                    tls = tls.identity(id);
                }
                let channel = match Endpoint::from_shared(format!("https://{B_ADDR}:7946"))
                    .expect("uri")
                    .tls_config(tls)
                    .expect("tls")
                    .connect_timeout(Duration::from_secs(3))
                    .connect()
                    .await
                {
                    Ok(c) => c,
                    Err(e) => return Outcome::Refused(format!("connect: {e:?}")),
                };
                let mut client = pb::sync_client::SyncClient::new(channel);
                let (tx, rx) = tokio::sync::mpsc::channel(16);
                let mut acks = match client
                    .replicate(tokio_stream::wrappers::ReceiverStream::new(rx))
                    .await
                {
                    Ok(r) => r.into_inner(),
                    Err(e) => return Outcome::Refused(format!("replicate: {e:?}")),
                };
                let mut got = Vec::new();
                for (b, wants_ack) in batches {
                    if tx.send(b).await.is_err() {
                        break;
                    }
                    if wants_ack {
                        match tokio::time::timeout(Duration::from_secs(5), acks.message()).await {
                            Ok(Ok(Some(a))) => got.push(a),
                            _ => break,
                        }
                    }
                }
                Outcome::Acks(got)
            })
        })
        .expect("entering the rogue namespace")
}

fn status(b: &Daemon) -> serde_json::Value {
    serde_json::from_str(&b.cli_ok(&["ha", "status", "-o", "json"])).expect("ha status json")
}

fn installed_from(b: &Daemon, origin: u32) -> Vec<fastpath_common::ct::CtKey> {
    let table =
        CtTable::open_pin(&b.pin_dir().join("maps").join(map_names::CT)).expect("B's table");
    let mut keys = Vec::new();
    table
        .walk(|ks, es| {
            for (k, e) in ks.iter().zip(es) {
                if e.origin == origin {
                    keys.push(*k);
                }
            }
        })
        .expect("walk");
    keys
}

/// Whether B's table has the connection of [`valid`], from anyone.
fn holds_valid(b: &Daemon) -> bool {
    let table =
        CtTable::open_pin(&b.pin_dir().join("maps").join(map_names::CT)).expect("B's table");
    let mut found = false;
    table
        .walk(|ks, _| found |= ks.iter().any(|k| (k.port_lo, k.port_hi) == (40000, 22)))
        .expect("walk");
    found
}

#[test]
fn a_peer_without_a_valid_certificate_or_with_malformed_messages_changes_nothing() {
    prepare_test(&[]);
    let dir = TempDir::new("ha-bad-peer").expect("temp dir");
    let mut topo = Topology::new();
    topo.add_ns("b").expect("ns");
    topo.add_ns("rogue").expect("ns");
    topo.veth(
        VethEnd::new("b", "sync0").addr(&format!("{B_ADDR}/24")),
        VethEnd::new("rogue", "eth0").addr(&format!("{ROGUE_ADDR}/24")),
    )
    .expect("veth");
    let usages = [
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let ca = TestCa::new(&dir, "fastpath-ha-ca", "ca");
    let evil_ca = TestCa::new(&dir, "another-ca", "evil-ca");
    let b_cert = ca.leaf(&dir, "node-b", &[B_ADDR], &usages);
    let good = ca.leaf(&dir, "peer-good", &["fastpath-peer"], &usages);
    let node_c = ca.leaf(&dir, "node-c", &["fastpath-node-c"], &usages);
    let evil = evil_ca.leaf(&dir, "peer-evil", &["fastpath-peer"], &usages);
    let config = DaemonConfig::new(&unique_pin_dir("ha-bad-peer"))
        .interface("sync0")
        .services(&format!(
            "[[service]]\nvip = \"{VIP}\"\nport = 80\n[[service.backend]]\naddress = \"{BACKEND}\"\nport = 80\n"
        ))
        .raw(&format!(
            "[ha]\nnode_id = 2\nlisten = \"{B_ADDR}:7946\"\ntls_cert = {:?}\ntls_key = {:?}\ntls_ca = {:?}\n[[ha.peers]]\naddress = \"{ROGUE_ADDR}:7946\"\nnode_id = 7\nserver_name = \"fastpath-peer\"\n[[ha.peers]]\naddress = \"10.202.0.3:7946\"\nnode_id = 3\nserver_name = \"fastpath-node-c\"\n",
            b_cert.cert, b_cert.key, ca.cert
        ));
    let b = Daemon::start(bin(), topo.ns("b"), &config);
    let rogue = topo.ns("rogue");

    // Certificates: another CA's, or none, are refused before any message.
    let snapshot = |node_id: u64, changes: Vec<pb::Change>| pb::Batch {
        node_id,
        epoch: 1000,
        changes,
        snapshot: true,
        ..Default::default()
    };
    let done = |node_id: u64| pb::Batch {
        node_id,
        epoch: 1000,
        snapshot: true,
        snapshot_done: true,
        watermark: 0,
        ..Default::default()
    };
    for (who, id) in [
        ("another CA's certificate", Some(&evil)),
        ("no certificate", None),
    ] {
        let out = peer_session(
            rogue,
            &ca.cert,
            id,
            vec![
                (snapshot(7, vec![upsert(0, valid())]), false),
                (done(7), true),
            ],
        );
        // TLS 1.3: the client may finish its side of the handshake before the server checks
        // its certificate, so the refusal shows at connect or as a stream that never answers.
        let refused = match &out {
            Outcome::Refused(_) => true,
            Outcome::Acks(a) => a.is_empty(),
        };
        assert!(refused, "a peer with {who} must be refused: {out:?}");
        assert!(!holds_valid(&b), "a peer with {who} installed entries");
    }
    assert_eq!(
        status(&b)["peers_in"].as_array().map_or(0, Vec::len),
        0,
        "refused peers must not appear as peers: {}",
        status(&b)
    );

    // A message without a valid node id: the stream is closed, counted, nothing applied.
    // With the right CA's certificate: 0, B's own, out of range, no configured peer's (9),
    // and node 3's, whose certificate this is not; then node 3's certificate claiming 7.
    let claims = [
        (0u64, &good),
        (2, &good),
        (1 << 40, &good),
        (9, &good),
        (3, &good),
        (7, &node_c),
    ];
    for (bad_id, cert) in claims {
        let out = peer_session(
            rogue,
            &ca.cert,
            Some(cert),
            vec![
                (snapshot(bad_id, vec![upsert(0, valid())]), false),
                (done(bad_id), true),
            ],
        );
        assert!(
            matches!(&out, Outcome::Acks(a) if a.is_empty()),
            "node id {bad_id} with {:?} must get no acknowledgement: {out:?}",
            cert.cert
        );
    }
    let s = status(&b);
    assert_eq!(s["rejected_messages"], claims.len(), "{s}");
    assert!(
        !holds_valid(&b),
        "a message with an invalid node id was applied"
    );
    let log = b.log();
    assert!(
        log.contains("the name of node 3's [[ha.peers]] entry")
            && log.contains("node id 9 is no configured peer's"),
        "B's log must say why each claim was refused:\n{log}"
    );

    // Malformed connections among valid ones: only the valid one is installed; the rest are
    // counted and the acknowledgement says how many were refused.
    let bad = malformed();
    let mut changes: Vec<pb::Change> = bad.iter().map(|(_, c)| upsert(0, c.clone())).collect();
    changes.push(upsert(0, valid()));
    let gap = pb::Batch {
        node_id: 7,
        epoch: 1000,
        changes: vec![upsert(5, valid())],
        ..Default::default()
    };
    let out = peer_session(
        rogue,
        &ca.cert,
        Some(&good),
        vec![(snapshot(7, changes), false), (done(7), true), (gap, true)],
    );
    let Outcome::Acks(acks) = &out else {
        panic!("a well-authenticated peer must be served: {out:?}");
    };
    assert_eq!(acks.len(), 2, "{acks:?}");
    assert_eq!(
        (
            acks[0].epoch,
            acks[0].seq,
            acks[0].resend,
            acks[0].resync,
            acks[0].rejected
        ),
        (1000, 0, false, false, bad.len() as u64),
        "the snapshot's end is acknowledged with the refusals counted: {acks:?}"
    );
    assert_eq!(
        (acks[1].seq, acks[1].resend),
        (0, true),
        "a gap (seq 5 after 0) asks for a resend after 0: {acks:?}"
    );
    let installed = installed_from(&b, 7);
    assert_eq!(
        installed.len(),
        1,
        "only the valid connection is installed: {installed:?}"
    );
    assert_eq!(
        (
            installed[0].port_lo,
            installed[0].port_hi,
            installed[0].proto
        ),
        (40000, 22, 6)
    );
    let s = status(&b);
    let peer = &s["peers_in"][0];
    assert_eq!(peer["node_id"], 7, "{s}");
    assert_eq!(peer["rejected"], bad.len() as u64, "{s}");
    assert_eq!(peer["synced"], true, "{s}");
    let metrics_refused = format!("{}", peer["rejected"]);
    eprintln!(
        "refused: another CA's certificate, no certificate, node ids 0/own/out of range/unconfigured/another peer's (6 messages), {} malformed connections ({}); installed 1; B's status:\n{}",
        metrics_refused,
        bad.iter().map(|(w, _)| *w).collect::<Vec<_>>().join(", "),
        b.cli_ok(&["ha", "status"])
    );
}
