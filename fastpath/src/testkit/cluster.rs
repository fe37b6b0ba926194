//! A cluster of active nodes behind routers' ECMP, as one plan: the config files of each node
//! (fastpath and BIRD) that the cluster test runs with its addresses, and that
//! `config/cluster/` ships with the example's. A unit test holds the shipped files to what
//! the plan renders, so the examples are what the suite runs.

/// The nodes' shared services and each node's addresses (node `i`: 1-based).
pub struct ClusterPlan {
    pub nodes: usize,
    pub vip: String,
    pub ports: Vec<u16>,
    pub backends: Vec<String>,
    /// Node `i`'s address on its link to the router, the router's there, its full-NAT source
    /// prefix and address in it.
    pub node_addr: fn(usize) -> String,
    pub router_addr: fn(usize) -> String,
    pub source_prefix: fn(usize) -> String,
    pub snat_address: fn(usize) -> String,
    /// Where node `i`'s certificate is (`node{i}.pem`, `node{i}.key`) and the CA's (`ca.pem`).
    pub tls_dir: String,
    pub table: u32,
    /// The sync port each node listens on.
    pub sync_port: u16,
}

impl ClusterPlan {
    /// The shipped example (`config/cluster/`).
    pub fn example() -> ClusterPlan {
        ClusterPlan {
            nodes: 3,
            vip: "192.0.2.100".into(),
            ports: vec![443],
            backends: (11..=13).map(|h| format!("198.51.100.{h}")).collect(),
            node_addr: |i| format!("10.0.{i}.2"),
            router_addr: |i| format!("10.0.{i}.1"),
            source_prefix: |i| format!("203.0.113.{}/28", 16 * i),
            snat_address: |i| format!("203.0.113.{}", 16 * i + 1),
            tls_dir: "/etc/fastpath/cluster".into(),
            table: 100,
            sync_port: 7946,
        }
    }

    /// The `[[service]]` tables of node `i`: every node has the same services, each with its
    /// own full-NAT source address.
    pub fn services(&self, i: usize) -> String {
        let mut s = String::new();
        for port in &self.ports {
            s += &format!(
                "[[service]]\nvip = \"{}\"\nport = {port}\nscheduler = \"maglev\"   # every node picks the same backend for a flow\nmode = \"full_nat\"\nsnat_address = \"{}\"   # in this node's source prefix\n\n[service.health_check]\nkind = \"tcp\"\ninterval_ms = 200\ntimeout_ms = 100\nfall = 2\nrise = 1\n",
                self.vip,
                (self.snat_address)(i)
            );
            for b in &self.backends {
                s += &format!("\n[[service.backend]]\naddress = \"{b}\"\nport = {port}\n");
            }
            s += "\n";
        }
        s
    }

    /// Node `i`'s `[announce]` and, when `replicate`, `[ha]` with every other node a peer.
    pub fn cluster_tables(&self, i: usize, replicate: bool) -> String {
        let others: Vec<usize> = (1..=self.nodes).filter(|&k| k != i).collect();
        let backups: Vec<String> = others
            .iter()
            .map(|&k| format!("\"{}\"", (self.source_prefix)(k)))
            .collect();
        let mut s = format!(
            "[announce]\ntable = {}              # BIRD learns it: config/cluster/bird-node{i}.conf\nprefixes = [\"{}\"]   # this node's full-NAT source prefix\nbackup_prefixes = [{}]   # the others': replies of a dead node's connections\nsync_timeout_s = 10\n",
            self.table,
            (self.source_prefix)(i),
            backups.join(", ")
        );
        if replicate {
            s += "\n";
            s += &self.ha_table(i);
        }
        s
    }

    /// Node `i`'s `[ha]`: every other node a peer, mutual TLS.
    pub fn ha_table(&self, i: usize) -> String {
        let tls = &self.tls_dir;
        let mut s = format!(
            "[ha]\nnode_id = {i}\nlisten = \"{}:{}\"\ntls_cert = \"{tls}/node{i}.pem\"\ntls_key = \"{tls}/node{i}.key\"\ntls_ca = \"{tls}/ca.pem\"\n",
            (self.node_addr)(i),
            self.sync_port
        );
        for k in (1..=self.nodes).filter(|&k| k != i) {
            s += &format!(
                "\n[[ha.peers]]\naddress = \"{}:{}\"\nnode_id = {k}\n",
                (self.node_addr)(k),
                self.sync_port
            );
        }
        s
    }

    /// Each node's certificate for `[ha]` (`node{i}.pem`, `node{i}.key`, its address the
    /// name), signed by `ca`, written to `dir` (the plan's `tls_dir`).
    pub fn issue_certs(&self, ca: &super::pki::TestCa, dir: &super::netns::TempDir) {
        for i in 1..=self.nodes {
            ca.leaf(
                dir,
                &format!("node{i}"),
                &[&(self.node_addr)(i)],
                &[
                    rcgen::ExtendedKeyUsagePurpose::ServerAuth,
                    rcgen::ExtendedKeyUsagePurpose::ClientAuth,
                ],
            );
        }
    }

    /// Node `i`'s whole config file, as shipped.
    pub fn node_toml(&self, i: usize) -> String {
        format!(
            "# fastpath — node {i} of {} active nodes behind routers' ECMP (docs/announce.md). Each\n# node announces the VIP and its own full-NAT source prefix through BIRD\n# (bird-node{i}.conf), the other nodes' prefixes as backups, and replicates its connections\n# to every other node, so that any node carries any flow when the routers rehash. The nodes'\n# files differ in node_id, addresses, snat_address and prefixes only.\n# Every key is documented in config/README.md.\n\n[datapath]\npin_dir = \"/sys/fs/bpf/fastpath\"\ndetach_on_exit = false   # a stop or crash of the daemon leaves the datapath forwarding\n\n[[interface]]\nname = \"eth0\"            # one arm: clients and backends both behind the router\nxdp = \"auto\"\n\n{}{}",
            self.nodes,
            self.services(i),
            self.cluster_tables(i, true)
        )
    }

    /// Node `i`'s BIRD configuration (AS 65000 + `i`, the router AS 65000).
    pub fn bird(&self, i: usize) -> String {
        super::bgp::bird_config(
            &(self.node_addr)(i),
            65000 + i as u32,
            &(self.router_addr)(i),
            "eth0",
            self.table,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_cluster_examples_are_the_rendered_ones() {
        // Compiled in, as the keepalived examples are: the unprivileged unit-test run may not
        // be able to read the checkout.
        let shipped: [(&str, &str); 3] = [
            (
                include_str!("../../../config/cluster/node1.toml"),
                include_str!("../../../config/cluster/bird-node1.conf"),
            ),
            (
                include_str!("../../../config/cluster/node2.toml"),
                include_str!("../../../config/cluster/bird-node2.conf"),
            ),
            (
                include_str!("../../../config/cluster/node3.toml"),
                include_str!("../../../config/cluster/bird-node3.conf"),
            ),
        ];
        let plan = ClusterPlan::example();
        assert_eq!(
            plan.nodes,
            shipped.len(),
            "one shipped pair of files per node"
        );
        let dir = format!("{}/../config/cluster", env!("CARGO_MANIFEST_DIR"));
        for (i, (node, bird)) in (1..=plan.nodes).zip(shipped) {
            for (file, rendered, shipped) in [
                (format!("{dir}/node{i}.toml"), plan.node_toml(i), node),
                (format!("{dir}/bird-node{i}.conf"), plan.bird(i), bird),
            ] {
                if std::env::var_os("FASTPATH_BLESS").is_some() {
                    std::fs::write(&file, &rendered)
                        .unwrap_or_else(|e| panic!("writing {file}: {e}"));
                    continue;
                }
                assert!(
                    rendered == shipped,
                    "{file} differs from what the tests run (FASTPATH_BLESS=1 rewrites it); it should be:\n{rendered}"
                );
            }
            let path = std::path::PathBuf::from(format!("config/cluster/node{i}.toml"));
            if let Err(e) = crate::config::Config::parse_with(
                &path,
                &plan.node_toml(i),
                crate::config::InterfaceCheck::Skip,
            ) {
                panic!("example {} is invalid: {e}", path.display());
            }
        }
    }
}
