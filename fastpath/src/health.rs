//! Health checks: the daemon probes every backend of every service that has a
//! `[service.health_check]` (a TCP connect, or an HTTP GET expecting a status) and reports
//! each change of state. A backend goes down after `fall` failed probes in a row and up after
//! `rise` good ones; it starts up. The daemon then applies the services with down backends at
//! weight 0: no new connections go to them, established ones keep their backend (conntrack).

use std::{net::SocketAddr, time::Duration};

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpStream,
    sync::mpsc,
    task::JoinHandle,
};
use tracing::info;

use crate::config::{HealthCheck, HealthKind, ServiceConfig, ServiceId};

/// A backend changed state: `backend` of `service` is now `up` or not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Change {
    pub service: ServiceId,
    /// The backend's address and port (not the probed port).
    pub backend: SocketAddr,
    pub up: bool,
    /// What the last probe saw.
    pub detail: String,
}

/// One probe of `addr`: Ok, or what went wrong.
pub async fn probe(check: &HealthCheck, addr: SocketAddr) -> Result<(), String> {
    let timeout = Duration::from_millis(*check.timeout_ms.get_ref());
    let attempt = async {
        let mut stream = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        if *check.kind.get_ref() == HealthKind::Tcp {
            return Ok(());
        }
        let host = match addr {
            SocketAddr::V4(a) => a.ip().to_string(),
            SocketAddr::V6(a) => format!("[{}]", a.ip()),
        };
        let request = format!(
            "GET {} HTTP/1.0\r\nHost: {host}\r\nUser-Agent: fastpath-health\r\nConnection: close\r\n\r\n",
            check.path
        );
        stream
            .write_all(request.as_bytes())
            .await
            .map_err(|e| format!("sending the request: {e}"))?;
        let mut head = [0u8; 64];
        let mut n = 0;
        while n < head.len() && !head[..n].contains(&b'\n') {
            let got = stream
                .read(&mut head[n..])
                .await
                .map_err(|e| format!("reading the status line: {e}"))?;
            if got == 0 {
                break;
            }
            n += got;
        }
        let line = String::from_utf8_lossy(&head[..n]);
        let status: Option<u16> = line.split_whitespace().nth(1).and_then(|s| s.parse().ok());
        match status {
            Some(s) if s == check.expect_status => Ok(()),
            Some(s) => Err(format!("HTTP status {s}, expected {}", check.expect_status)),
            None => Err(format!(
                "no HTTP status line: {:?}",
                line.lines().next().unwrap_or("")
            )),
        }
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(r) => r,
        Err(_) => Err(format!("no answer within {} ms", timeout.as_millis())),
    }
}

/// Counts consecutive results into up/down decisions (`rise`/`fall`).
#[derive(Debug)]
pub struct Tracker {
    pub up: bool,
    streak: u32,
}

impl Default for Tracker {
    fn default() -> Self {
        Tracker {
            up: true,
            streak: 0,
        }
    }
}

impl Tracker {
    /// Records one probe; returns the new state when it changed.
    pub fn record(&mut self, ok: bool, rise: u32, fall: u32) -> Option<bool> {
        if ok == self.up {
            self.streak = 0;
            return None;
        }
        self.streak += 1;
        let needed = if self.up { fall } else { rise };
        if self.streak >= needed {
            self.up = !self.up;
            self.streak = 0;
            Some(self.up)
        } else {
            None
        }
    }
}

/// What one probing task watches: a backend of a service, with the service's check.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ProbeKey {
    pub service: ServiceId,
    pub backend: SocketAddr,
    /// The check as configured (a changed check restarts the probe).
    pub check: String,
}

/// Every probe the services ask for, with its check.
pub fn probes_of(services: &[ServiceConfig]) -> Vec<(ProbeKey, HealthCheck)> {
    let mut out = Vec::new();
    for svc in services {
        let Some(check) = &svc.health_check else {
            continue;
        };
        for b in &svc.backends {
            let key = ProbeKey {
                service: svc.id(),
                backend: SocketAddr::new(*b.address.get_ref(), *b.port.get_ref()),
                check: format!("{check:?}"),
            };
            out.push((key, check.clone()));
        }
    }
    out
}

/// Starts the probing task of `key`; changes go to `tx`. The task ends when `tx`'s receiver
/// is dropped, or when aborted.
pub fn spawn_probe(key: ProbeKey, check: HealthCheck, tx: mpsc::Sender<Change>) -> JoinHandle<()> {
    let addr = SocketAddr::new(key.backend.ip(), check.port.unwrap_or(key.backend.port()));
    tokio::spawn(async move {
        let mut tracker = Tracker::default();
        let mut tick = tokio::time::interval(Duration::from_millis(*check.interval_ms.get_ref()));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let result = probe(&check, addr).await;
            let ok = result.is_ok();
            if let Some(up) = tracker.record(ok, *check.rise.get_ref(), *check.fall.get_ref()) {
                let detail = result.err().unwrap_or_else(|| "probe ok".into());
                info!(service = %key.service, backend = %key.backend, probed = %addr, up, detail = %detail, "Backend health changed");
                let change = Change {
                    service: key.service,
                    backend: key.backend,
                    up,
                    detail,
                };
                if tx.send(change).await.is_err() {
                    return;
                }
            }
        }
    })
}

/// `services` as the datapath should have them: backends in `down` at weight 0.
pub fn effective(
    services: &[ServiceConfig],
    down: &std::collections::HashMap<(ServiceId, SocketAddr), String>,
) -> Vec<ServiceConfig> {
    let mut out = services.to_vec();
    if down.is_empty() {
        return out;
    }
    for svc in &mut out {
        let id = svc.id();
        for b in &mut svc.backends {
            let addr = SocketAddr::new(*b.address.get_ref(), *b.port.get_ref());
            if down.contains_key(&(id, addr)) {
                b.weight = toml::Spanned::new(0..0, 0);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fall_and_rise_need_streaks() {
        let mut t = Tracker::default();
        assert_eq!(t.record(false, 2, 3), None);
        assert_eq!(t.record(false, 2, 3), None);
        assert_eq!(
            t.record(true, 2, 3),
            None,
            "a success breaks the failure streak"
        );
        assert_eq!(t.record(false, 2, 3), None);
        assert_eq!(t.record(false, 2, 3), None);
        assert_eq!(t.record(false, 2, 3), Some(false));
        assert_eq!(t.record(false, 2, 3), None);
        assert_eq!(t.record(true, 2, 3), None);
        assert_eq!(t.record(true, 2, 3), Some(true));
    }

    #[tokio::test]
    async fn probes_tell_listening_from_closed_and_check_http_status() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let mut buf = [0u8; 512];
                let _ = s.read(&mut buf).await;
                let reply: &[u8] = if buf.starts_with(b"GET /ok ") {
                    b"HTTP/1.0 200 OK\r\n\r\n"
                } else {
                    b"HTTP/1.0 503 Unavailable\r\n\r\n"
                };
                let _ = s.write_all(reply).await;
            }
        });
        let check = |kind, path: &str| HealthCheck {
            kind: toml::Spanned::new(0..0, kind),
            interval_ms: toml::Spanned::new(0..0, 100),
            timeout_ms: toml::Spanned::new(0..0, 500),
            rise: toml::Spanned::new(0..0, 1),
            fall: toml::Spanned::new(0..0, 1),
            port: None,
            path: path.into(),
            expect_status: 200,
        };
        assert_eq!(probe(&check(HealthKind::Tcp, "/"), addr).await, Ok(()));
        assert_eq!(probe(&check(HealthKind::Http, "/ok"), addr).await, Ok(()));
        let e = probe(&check(HealthKind::Http, "/bad"), addr)
            .await
            .unwrap_err();
        assert!(e.contains("503"), "{e}");
        // A closed port: connection refused.
        let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let closed_addr = closed.local_addr().unwrap();
        drop(closed);
        assert!(
            probe(&check(HealthKind::Tcp, "/"), closed_addr)
                .await
                .is_err()
        );
    }
}
