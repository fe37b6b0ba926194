//! Traffic that end-to-end tests keep running through a load balancer while they break it:
//! a slowly read download ([`SlowDownload`]), a pool of long-lived echo conversations over TCP
//! or UDP ([`ConnPool`] against [`EchoServers`]), and the TCP reset counters of a namespace
//! ([`tcp_resets`]).
//!
//! Contract: every byte is checked. The download is compared with its file by the caller; each
//! pooled connection sends its own deterministic byte stream and compares every echoed byte,
//! recording the first error (reset, EOF, mismatch, stall) per connection; a UDP flow sends
//! its stream a datagram at a time from one socket (one source port, so one conntrack entry)
//! and sends a datagram again until its echo arrives. Sockets are created
//! inside the namespaces (a thread that entered it), then served by a tokio runtime the object
//! owns; dropping the object stops its tasks and closes its sockets.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    fs::File,
    io::{self, Read as _},
    net::{SocketAddr, TcpListener, TcpStream, UdpSocket},
    path::Path,
    process::ExitStatus,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use super::netns::{Netns, NetnsError, Spawned, host_run, unique_name};

/// How much [`SlowDownload`]'s reader takes every 10 ms (1.6 MB/s).
pub const SLOW_READ: usize = 16 << 10;

/// A download kept open by a slow reader: curl in the client namespace writes the body into a
/// FIFO that a thread of the test reads [`SLOW_READ`] bytes at a time, every 10 ms, until
/// [`SlowDownload::finish`] — a slow client, its connection held open by TCP flow control for
/// as long as the test needs. (curl's own `--limit-rate` proved no limit here: 512K let 8 MiB
/// through in 0.07 s.)
pub struct SlowDownload {
    curl: Spawned,
    read: Arc<AtomicUsize>,
    done: Arc<AtomicBool>,
    reader: thread::JoinHandle<io::Result<Vec<u8>>>,
}

impl SlowDownload {
    /// GETs `url` from `client` (from source port `sport` if given); the FIFO goes in `dir`.
    /// Panics if it cannot start.
    pub fn start(client: &Netns, dir: &Path, url: &str, sport: Option<u16>) -> SlowDownload {
        let fifo = dir.join(unique_name("slow.fifo"));
        host_run(&["mkfifo", fifo.to_str().expect("utf-8")]).unwrap_or_else(|e| panic!("{e}"));
        let port = sport.map_or(String::new(), |p| format!("--local-port {p} "));
        let curl = client
            .spawn(&[
                "sh",
                "-c",
                &format!("exec curl -q -sS --fail {port}{url} > {}", fifo.display()),
            ])
            .unwrap_or_else(|e| panic!("slow download of {url}: {e}"));
        let (read, done) = (
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let (r, d) = (read.clone(), done.clone());
        let reader = thread::spawn(move || {
            let mut f = File::open(&fifo)?;
            let (mut body, mut buf) = (Vec::new(), vec![0u8; SLOW_READ]);
            loop {
                let n = f.read(&mut buf)?;
                if n == 0 {
                    return Ok(body);
                }
                body.extend_from_slice(&buf[..n]);
                r.store(body.len(), Ordering::Relaxed);
                if !d.load(Ordering::Relaxed) {
                    // The reading rate, not synchronisation.
                    thread::sleep(Duration::from_millis(10));
                }
            }
        });
        SlowDownload {
            curl,
            read,
            done,
            reader,
        }
    }

    /// Bytes of the body read so far.
    pub fn bytes_read(&self) -> usize {
        self.read.load(Ordering::Relaxed)
    }

    /// curl's output so far (its errors).
    pub fn curl_log(&self) -> String {
        self.curl.log()
    }

    /// Waits until `more` bytes beyond `from` were read; panics after 20 s naming `when`.
    /// Returns the bytes read by then.
    pub fn progressed(&self, from: usize, more: usize, when: &str) -> usize {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let now = self.bytes_read();
            if now >= from + more {
                return now;
            }
            assert!(
                Instant::now() < deadline,
                "{when}: the download stalled at {now} bytes (was {from}); curl: {}",
                self.curl_log()
            );
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Reads the rest at full speed: curl's exit status (`None`: still running after 60 s)
    /// and the body.
    pub fn finish(self) -> (Option<ExitStatus>, Vec<u8>) {
        self.finish_within(Duration::from_secs(60))
    }

    /// [`SlowDownload::finish`] giving curl `timeout` to end (a stalled download is killed
    /// then: `None` and the body so far).
    pub fn finish_within(mut self, timeout: Duration) -> (Option<ExitStatus>, Vec<u8>) {
        self.done.store(true, Ordering::Relaxed);
        let status = self.curl.wait_exit(timeout);
        if status.is_none() {
            // A stalled download: end it so the reader sees EOF.
            self.curl.kill();
        }
        let body = self
            .reader
            .join()
            .expect("the reader thread")
            .unwrap_or_else(|e| panic!("reading the download: {e}"));
        (status, body)
    }
}

/// `n` random bytes (from /dev/urandom): a file to download.
pub fn random_bytes(n: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(n);
    File::open("/dev/urandom")
        .and_then(|f| f.take(n as u64).read_to_end(&mut v))
        .expect("reading /dev/urandom");
    v
}

/// TCP resets a namespace's stack has sent and seen so far (`/proc/net/snmp`: OutRsts,
/// EstabResets): a reset on either end shows here, whoever caused it.
pub fn tcp_resets(ns: &Netns) -> (u64, u64) {
    let snmp = ns
        .run(&["cat", "/proc/net/snmp"])
        .unwrap_or_else(|e| panic!("{e}"));
    let mut tcp = snmp.lines().filter(|l| l.starts_with("Tcp:"));
    let (names, values) = (tcp.next().unwrap_or(""), tcp.next().unwrap_or(""));
    let field = |want: &str| {
        names
            .split_whitespace()
            .zip(values.split_whitespace())
            .find(|(n, _)| *n == want)
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or_else(|| panic!("no Tcp {want} in /proc/net/snmp:\n{snmp}"))
    };
    (field("OutRsts"), field("EstabResets"))
}

fn runtime(name: &str) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(name)
        .enable_io()
        .enable_time()
        .build()
        .unwrap_or_else(|e| panic!("starting a tokio runtime for {name}: {e}"))
}

/// The transport of an [`EchoServers`] listener or a [`ConnPool`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    Tcp,
    Udp,
}

/// Echo servers, one socket per `(namespace, address)`. TCP: every byte read is written back,
/// and a connection ends when its client closes (FIN answered with FIN, no reset). UDP: every
/// datagram goes back to the address it came from.
pub struct EchoServers {
    rt: Option<tokio::runtime::Runtime>,
    /// Connections accepted so far, over all listeners (TCP).
    accepted: Arc<AtomicU64>,
    /// Per listener, in the order given: the addresses it served (a TCP connection's or a UDP
    /// datagram's source).
    peers: Vec<Arc<Mutex<BTreeSet<SocketAddr>>>>,
}

impl EchoServers {
    /// TCP echo servers.
    pub fn start(listeners: &[(&Netns, SocketAddr)]) -> Result<EchoServers, NetnsError> {
        EchoServers::start_on(Transport::Tcp, listeners)
    }

    pub fn start_on(
        transport: Transport,
        listeners: &[(&Netns, SocketAddr)],
    ) -> Result<EchoServers, NetnsError> {
        let rt = runtime("echo-servers");
        let accepted = Arc::new(AtomicU64::new(0));
        let mut peers = Vec::with_capacity(listeners.len());
        for &(ns, addr) in listeners {
            let served = Arc::new(Mutex::new(BTreeSet::new()));
            peers.push(served.clone());
            let io_err = |what: &str, source| NetnsError::Io {
                what: format!("{what} echo server on {addr} in {}", ns.name()),
                source,
            };
            let _in_rt = rt.enter();
            match transport {
                Transport::Tcp => {
                    let listener = ns
                        .in_netns(move || {
                            let l = TcpListener::bind(addr)?;
                            l.set_nonblocking(true)?;
                            Ok::<_, io::Error>(l)
                        })?
                        .and_then(tokio::net::TcpListener::from_std)
                        .map_err(|e| io_err("TCP", e))?;
                    let accepted = accepted.clone();
                    rt.spawn(async move {
                        while let Ok((mut s, peer)) = listener.accept().await {
                            accepted.fetch_add(1, Ordering::Relaxed);
                            served.lock().expect("not poisoned").insert(peer);
                            tokio::spawn(async move {
                                let (mut r, mut w) = s.split();
                                let _ = tokio::io::copy(&mut r, &mut w).await;
                                let _ = w.shutdown().await;
                            });
                        }
                    });
                }
                Transport::Udp => {
                    let socket = ns
                        .in_netns(move || {
                            let s = UdpSocket::bind(addr)?;
                            s.set_nonblocking(true)?;
                            Ok::<_, io::Error>(s)
                        })?
                        .and_then(tokio::net::UdpSocket::from_std)
                        .map_err(|e| io_err("UDP", e))?;
                    rt.spawn(async move {
                        let mut buf = vec![0u8; 65536];
                        while let Ok((n, peer)) = socket.recv_from(&mut buf).await {
                            served.lock().expect("not poisoned").insert(peer);
                            if socket.send_to(&buf[..n], peer).await.is_err() {
                                break;
                            }
                        }
                    });
                }
            }
        }
        Ok(EchoServers {
            rt: Some(rt),
            accepted,
            peers,
        })
    }

    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }

    /// Per listener, in the order given to `start`: the peers it served so far.
    pub fn peers(&self) -> Vec<BTreeSet<SocketAddr>> {
        self.peers
            .iter()
            .map(|p| p.lock().expect("not poisoned").clone())
            .collect()
    }

    /// Peers served by more than one listener (a flow that moved between backends), with
    /// the listeners' indexes.
    pub fn peers_on_two_listeners(&self) -> BTreeMap<SocketAddr, Vec<usize>> {
        let mut on: BTreeMap<SocketAddr, Vec<usize>> = BTreeMap::new();
        for (i, set) in self.peers().into_iter().enumerate() {
            for peer in set {
                on.entry(peer).or_default().push(i);
            }
        }
        on.retain(|_, listeners| listeners.len() > 1);
        on
    }
}

impl Drop for EchoServers {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

/// How a [`ConnPool`] connection behaves.
#[derive(Clone, Copy, Debug)]
pub struct PoolOptions {
    /// Bytes sent (and echoed) per round.
    pub chunk: usize,
    /// Pause between rounds; the connections' rounds are spread over it.
    pub interval: Duration,
    /// A round whose echo has not fully arrived after this long fails the connection
    /// ([`ConnError::Stalled`]).
    pub stall_timeout: Duration,
}

impl Default for PoolOptions {
    fn default() -> PoolOptions {
        PoolOptions {
            chunk: 256,
            interval: Duration::from_millis(150),
            stall_timeout: Duration::from_secs(20),
        }
    }
}

/// Why a pooled connection stopped before [`ConnPool::finish`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConnError {
    /// ECONNRESET (or EPIPE: a reset that arrived while writing).
    Reset,
    /// The server closed the connection.
    Eof,
    /// An echoed byte differed from the one sent, at this offset of the stream.
    Mismatch { offset: u64 },
    /// No complete echo within [`PoolOptions::stall_timeout`].
    Stalled,
    /// Any other error.
    Io(String),
}

impl fmt::Display for ConnError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConnError::Reset => write!(f, "reset"),
            ConnError::Eof => write!(f, "EOF"),
            ConnError::Mismatch { offset } => write!(f, "echo differs at byte {offset}"),
            ConnError::Stalled => write!(f, "stalled"),
            ConnError::Io(e) => write!(f, "{e}"),
        }
    }
}

impl ConnError {
    fn from_io(e: &io::Error) -> ConnError {
        match e.kind() {
            io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe => ConnError::Reset,
            io::ErrorKind::UnexpectedEof => ConnError::Eof,
            _ => ConnError::Io(e.to_string()),
        }
    }
}

/// A pooled connection's socket, made in the client's namespace.
enum Made {
    Tcp(TcpStream),
    Udp(UdpSocket),
}

impl Made {
    /// A TCP connection to `target` (within 5 s), or a UDP socket connected to it.
    fn connect(transport: Transport, target: SocketAddr) -> io::Result<Made> {
        Ok(match transport {
            Transport::Tcp => {
                let s = TcpStream::connect_timeout(&target, Duration::from_secs(5))?;
                s.set_nodelay(true)?;
                s.set_nonblocking(true)?;
                Made::Tcp(s)
            }
            Transport::Udp => {
                let any = if target.is_ipv4() {
                    SocketAddr::from(([0u8; 4], 0))
                } else {
                    SocketAddr::from(([0u16; 8], 0))
                };
                let s = UdpSocket::bind(any)?;
                s.connect(target)?;
                s.set_nonblocking(true)?;
                Made::Udp(s)
            }
        })
    }
}

/// One connection's counters, written by its task.
#[derive(Default)]
struct ConnStat {
    sent: AtomicU64,
    verified: AtomicU64,
    /// UDP datagrams sent again after [`UDP_RESEND`] without their echo.
    resent: AtomicU64,
    error: Mutex<Option<ConnError>>,
}

/// How long a UDP flow waits for a datagram's echo before sending the datagram again.
pub const UDP_RESEND: Duration = Duration::from_secs(1);

/// Bytes each connection had verified at one moment: see [`ConnPool::mark`].
#[derive(Clone, Debug)]
pub struct Mark {
    verified: Vec<u64>,
    pub at: Instant,
}

/// Where every connection stands against a [`Mark`].
#[derive(Clone, Debug, Default)]
pub struct Progress {
    /// Connections that verified more bytes since the mark.
    pub progressed: usize,
    /// Connections still without progress (no error either), by index.
    pub waiting: Vec<usize>,
    /// Connections that failed, by index, with their error.
    pub failed: Vec<(usize, ConnError)>,
}

impl Progress {
    /// The failures counted by kind (`reset: 12, stalled: 3`).
    pub fn failure_kinds(&self) -> String {
        kinds(&self.failed)
    }
}

fn kinds(failed: &[(usize, ConnError)]) -> String {
    let mut counts: std::collections::BTreeMap<String, usize> = Default::default();
    for (_, e) in failed {
        let k = match e {
            ConnError::Mismatch { .. } => "mismatch".to_owned(),
            ConnError::Io(_) => "io".to_owned(),
            other => other.to_string(),
        };
        *counts.entry(k).or_default() += 1;
    }
    counts
        .iter()
        .map(|(k, n)| format!("{k}: {n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// What [`ConnPool::finish`] found.
#[derive(Clone, Debug)]
pub struct PoolTotals {
    pub connections: usize,
    pub bytes_sent: u64,
    pub bytes_verified: u64,
    /// UDP datagrams sent again (see [`UDP_RESEND`]).
    pub resent: u64,
    pub failed: Vec<(usize, ConnError)>,
}

/// `n` long-lived TCP connections (or UDP flows) from a namespace to one address (a VIP):
/// each sends a chunk of its own deterministic byte stream every interval and checks the echo
/// byte for byte. Meant to run against [`EchoServers`] behind a load balancer.
pub struct ConnPool {
    rt: Option<tokio::runtime::Runtime>,
    stats: Arc<Vec<ConnStat>>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    target: SocketAddr,
}

impl ConnPool {
    /// Connects `n` times over TCP from `client` to `target` (one after the other, each
    /// within 5 s), then starts the rounds. Fails on the first connection that cannot be made.
    pub fn open(
        client: &Netns,
        target: SocketAddr,
        n: usize,
        opts: PoolOptions,
    ) -> Result<ConnPool, NetnsError> {
        ConnPool::open_on(Transport::Tcp, client, target, n, opts)
    }

    /// As [`ConnPool::open`] over `transport`; a UDP flow is a socket of its own, connected to
    /// `target` (no packet is sent before its first round).
    pub fn open_on(
        transport: Transport,
        client: &Netns,
        target: SocketAddr,
        n: usize,
        opts: PoolOptions,
    ) -> Result<ConnPool, NetnsError> {
        let made = client
            .in_netns(move || {
                (0..n)
                    .map(|i| Made::connect(transport, target).map_err(|e| (i, e)))
                    .collect::<Result<Vec<_>, (usize, io::Error)>>()
            })?
            .map_err(|(i, source)| NetnsError::Io {
                what: format!("pooled {transport:?} connection {i} of {n} to {target}"),
                source,
            })?;
        let rt = runtime("conn-pool");
        let stats: Arc<Vec<ConnStat>> = Arc::new((0..n).map(|_| ConnStat::default()).collect());
        let stop = Arc::new(AtomicBool::new(false));
        let _in_rt = rt.enter();
        let mut tasks = Vec::with_capacity(n);
        for (i, made) in made.into_iter().enumerate() {
            let registered = |source| NetnsError::Io {
                what: "registering a pooled connection".into(),
                source,
            };
            let (stats, stop) = (stats.clone(), stop.clone());
            let first = opts.interval.mul_f64(i as f64 / n as f64);
            let conn = i as u64;
            tasks.push(match made {
                Made::Tcp(s) => {
                    let s = tokio::net::TcpStream::from_std(s).map_err(registered)?;
                    rt.spawn(async move {
                        let stat = &stats[i];
                        if let Err(e) = converse(conn, s, stat, &stop, first, opts).await {
                            *stat.error.lock().expect("not poisoned") = Some(e);
                        }
                    })
                }
                Made::Udp(s) => {
                    let s = tokio::net::UdpSocket::from_std(s).map_err(registered)?;
                    rt.spawn(async move {
                        let stat = &stats[i];
                        if let Err(e) = converse_udp(conn, s, stat, &stop, first, opts).await {
                            *stat.error.lock().expect("not poisoned") = Some(e);
                        }
                    })
                }
            });
        }
        drop(_in_rt);
        Ok(ConnPool {
            rt: Some(rt),
            stats,
            stop,
            tasks,
            target,
        })
    }

    pub fn len(&self) -> usize {
        self.stats.len()
    }

    pub fn is_empty(&self) -> bool {
        self.stats.is_empty()
    }

    /// Every connection's verified bytes now.
    pub fn mark(&self) -> Mark {
        Mark {
            verified: self
                .stats
                .iter()
                .map(|s| s.verified.load(Ordering::Relaxed))
                .collect(),
            at: Instant::now(),
        }
    }

    /// Bytes verified so far, over all connections.
    pub fn bytes_verified(&self) -> u64 {
        self.stats
            .iter()
            .map(|s| s.verified.load(Ordering::Relaxed))
            .sum()
    }

    /// Every connection against `since`.
    pub fn progress(&self, since: &Mark) -> Progress {
        let mut p = Progress::default();
        for (i, s) in self.stats.iter().enumerate() {
            if let Some(e) = s.error.lock().expect("not poisoned").clone() {
                p.failed.push((i, e));
            } else if s.verified.load(Ordering::Relaxed) > since.verified[i] {
                p.progressed += 1;
            } else {
                p.waiting.push(i);
            }
        }
        p
    }

    /// Waits until every connection has progressed since `since` or failed, at most
    /// `timeout`; returns where they stand then.
    pub fn wait_progress(&self, since: &Mark, timeout: Duration) -> Progress {
        let deadline = Instant::now() + timeout;
        loop {
            let p = self.progress(since);
            if p.waiting.is_empty() || Instant::now() >= deadline {
                return p;
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Panics unless every connection verified more bytes since `since` (waiting up to
    /// `timeout`) and none failed; `when` names the moment for the message.
    pub fn check_progress(&self, since: &Mark, timeout: Duration, when: &str) -> Progress {
        let p = self.wait_progress(since, timeout);
        assert!(
            p.failed.is_empty() && p.waiting.is_empty(),
            "{when}: of {} connections to {}, {} progressed, {} made no progress within {timeout:?} \
             (e.g. {:?}), {} failed ({}; e.g. {:?})",
            self.len(),
            self.target,
            p.progressed,
            p.waiting.len(),
            &p.waiting[..p.waiting.len().min(5)],
            p.failed.len(),
            p.failure_kinds(),
            &p.failed[..p.failed.len().min(5)]
        );
        p
    }

    /// Ends every connection cleanly (the round in flight completes, then FIN both ways) and
    /// returns the totals.
    pub fn finish(mut self) -> PoolTotals {
        self.stop.store(true, Ordering::Relaxed);
        let rt = self.rt.take().expect("finish runs once");
        let tasks = std::mem::take(&mut self.tasks);
        rt.block_on(async {
            for t in tasks {
                let _ = t.await;
            }
        });
        rt.shutdown_timeout(Duration::from_secs(1));
        let mut totals = PoolTotals {
            connections: self.stats.len(),
            bytes_sent: 0,
            bytes_verified: 0,
            resent: 0,
            failed: Vec::new(),
        };
        for (i, s) in self.stats.iter().enumerate() {
            totals.bytes_sent += s.sent.load(Ordering::Relaxed);
            totals.resent += s.resent.load(Ordering::Relaxed);
            totals.bytes_verified += s.verified.load(Ordering::Relaxed);
            if let Some(e) = s.error.lock().expect("not poisoned").clone() {
                totals.failed.push((i, e));
            }
        }
        totals
    }
}

impl ConnPool {
    /// [`ConnPool::finish`], panicking (`when` names the moment) unless every connection
    /// closed cleanly with every byte it sent echoed and verified.
    pub fn finish_intact(self, when: &str) -> PoolTotals {
        let target = self.target;
        let totals = self.finish();
        assert!(
            totals.failed.is_empty(),
            "{when}: {} of {} connections to {target} failed ({}; e.g. {:?})",
            totals.failed.len(),
            totals.connections,
            totals.failure_kinds(),
            &totals.failed[..totals.failed.len().min(5)]
        );
        assert_eq!(
            totals.bytes_verified, totals.bytes_sent,
            "{when}: bytes echoed and verified against bytes sent to {target}"
        );
        totals
    }
}

impl PoolTotals {
    /// The failures counted by kind (`reset: 12, stalled: 3`).
    pub fn failure_kinds(&self) -> String {
        kinds(&self.failed)
    }
}

impl Drop for ConnPool {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

/// Byte `offset` of connection `conn`'s stream: a splitmix64 of both, so every connection's
/// stream differs and a byte delivered to the wrong connection or offset is caught.
pub fn stream_byte(conn: u64, offset: u64) -> u8 {
    let mut z = (conn << 40 ^ offset >> 3).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    z.to_le_bytes()[(offset & 7) as usize]
}

/// Fills `out` with connection `conn`'s stream from `offset`.
fn fill(out: &mut [u8], conn: u64, offset: u64) {
    for (i, b) in out.iter_mut().enumerate() {
        *b = stream_byte(conn, offset + i as u64);
    }
}

/// One pooled connection: rounds of send-then-verify until told to stop, then a clean close.
async fn converse(
    conn: u64,
    mut s: tokio::net::TcpStream,
    stat: &ConnStat,
    stop: &AtomicBool,
    first: Duration,
    opts: PoolOptions,
) -> Result<(), ConnError> {
    tokio::time::sleep(first).await;
    let (mut out, mut back) = (vec![0u8; opts.chunk], vec![0u8; opts.chunk]);
    let mut offset = 0u64;
    while !stop.load(Ordering::Relaxed) {
        fill(&mut out, conn, offset);
        let round = async {
            s.write_all(&out).await?;
            stat.sent.fetch_add(out.len() as u64, Ordering::Relaxed);
            s.read_exact(&mut back).await.map(drop)
        };
        match tokio::time::timeout(opts.stall_timeout, round).await {
            Err(_) => return Err(ConnError::Stalled),
            Ok(Err(e)) => return Err(ConnError::from_io(&e)),
            Ok(Ok(())) => {}
        }
        if let Some(i) = out.iter().zip(&back).position(|(a, b)| a != b) {
            return Err(ConnError::Mismatch {
                offset: offset + i as u64,
            });
        }
        offset += out.len() as u64;
        stat.verified.store(offset, Ordering::Relaxed);
        tokio::time::sleep(opts.interval).await;
    }
    // FIN, then wait for the server's: nothing unread is left, so no reset either way.
    s.shutdown().await.map_err(|e| ConnError::from_io(&e))?;
    let mut rest = [0u8; 64];
    match tokio::time::timeout(opts.stall_timeout, s.read(&mut rest)).await {
        Ok(Ok(0)) => Ok(()),
        Ok(Ok(_)) => Err(ConnError::Io("data after the last echo".into())),
        Ok(Err(e)) => Err(ConnError::from_io(&e)),
        Err(_) => Err(ConnError::Stalled),
    }
}

/// One pooled UDP flow: a datagram per round, sent again every [`UDP_RESEND`] until its echo
/// arrives (an echo of the previous round's datagram, late after a resend, is passed over).
async fn converse_udp(
    conn: u64,
    s: tokio::net::UdpSocket,
    stat: &ConnStat,
    stop: &AtomicBool,
    first: Duration,
    opts: PoolOptions,
) -> Result<(), ConnError> {
    tokio::time::sleep(first).await;
    let (mut out, mut back) = (vec![0u8; opts.chunk], vec![0u8; opts.chunk + 1]);
    let mut previous = vec![0u8; opts.chunk];
    let mut offset = 0u64;
    while !stop.load(Ordering::Relaxed) {
        fill(&mut out, conn, offset);
        stat.sent.fetch_add(out.len() as u64, Ordering::Relaxed);
        let deadline = tokio::time::Instant::now() + opts.stall_timeout;
        'round: loop {
            s.send(&out).await.map_err(|e| ConnError::from_io(&e))?;
            let resend = tokio::time::Instant::now() + UDP_RESEND;
            loop {
                match tokio::time::timeout_at(resend.min(deadline), s.recv(&mut back)).await {
                    Err(_) if tokio::time::Instant::now() >= deadline => {
                        return Err(ConnError::Stalled);
                    }
                    Err(_) => break,
                    Ok(Err(e)) => return Err(ConnError::from_io(&e)),
                    Ok(Ok(n)) if back[..n] == out[..] => break 'round,
                    Ok(Ok(n)) if offset > 0 && back[..n] == previous[..] => {}
                    Ok(Ok(_)) => return Err(ConnError::Mismatch { offset }),
                }
            }
            stat.resent.fetch_add(1, Ordering::Relaxed);
        }
        offset += out.len() as u64;
        stat.verified.store(offset, Ordering::Relaxed);
        std::mem::swap(&mut out, &mut previous);
        tokio::time::sleep(opts.interval).await;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_differ_by_connection_and_offset() {
        let a: Vec<u8> = (0..64).map(|o| stream_byte(1, o)).collect();
        let b: Vec<u8> = (0..64).map(|o| stream_byte(2, o)).collect();
        let a2: Vec<u8> = (64..128).map(|o| stream_byte(1, o)).collect();
        assert_ne!(a, b);
        assert_ne!(a, a2);
        assert_eq!(a, (0..64).map(|o| stream_byte(1, o)).collect::<Vec<_>>());
    }
}
