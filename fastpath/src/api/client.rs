//! Connecting to a daemon's API: its Unix socket, or TCP with TLS and a client certificate.

use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use super::{MAX_MESSAGE_BYTES, pb::fastpath_client::FastpathClient};

/// Where the daemon is.
#[derive(Clone, Debug)]
pub enum Target {
    Unix(PathBuf),
    /// `https://HOST:PORT` (TLS: CA, client certificate and key) or `http://` (insecure).
    Tcp {
        url: String,
        tls: Option<TlsFiles>,
    },
}

#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The name the server's certificate must carry; default: the URL's host.
    pub server_name: Option<String>,
}

/// Why no connection could be made, with what to do.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConnectError(pub String);

pub type Client = FastpathClient<Channel>;

fn read(p: &Path) -> Result<Vec<u8>, ConnectError> {
    std::fs::read(p).map_err(|e| ConnectError(format!("reading {}: {e}", p.display())))
}

/// Connects to the daemon (the connection is made now, so a dead daemon is reported here).
pub async fn connect(target: &Target) -> Result<Client, ConnectError> {
    let channel = match target {
        Target::Unix(path) => {
            let path = path.clone();
            let shown = path.display().to_string();
            // The URI is required by the API but unused: the connector below dials the socket.
            Endpoint::from_static("http://localhost")
                .connect_with_connector(tower::service_fn(move |_| {
                    let path = path.clone();
                    async move {
                        let s = tokio::net::UnixStream::connect(path).await?;
                        Ok::<_, std::io::Error>(TokioIo::new(s))
                    }
                }))
                .await
                .map_err(|e| {
                    ConnectError(format!(
                        "cannot reach the daemon at {shown}: {}; is `fastpath daemon` running with this socket ([api] socket in its config)? Give another with --socket",
                        source_text(&e)
                    ))
                })?
        }
        Target::Tcp { url, tls } => {
            let mut ep = Endpoint::from_shared(url.clone()).map_err(|e| {
                ConnectError(format!("--server {url:?}: {e}; give https://HOST:PORT"))
            })?;
            if let Some(t) = tls {
                let mut cfg = ClientTlsConfig::new()
                    .ca_certificate(Certificate::from_pem(read(&t.ca)?))
                    .identity(Identity::from_pem(read(&t.cert)?, read(&t.key)?));
                if let Some(name) = &t.server_name {
                    cfg = cfg.domain_name(name.clone());
                }
                ep = ep
                    .tls_config(cfg)
                    .map_err(|e| ConnectError(format!("TLS settings: {e}")))?;
            }
            ep.connect().await.map_err(|e| {
                ConnectError(format!(
                    "cannot reach the daemon at {url}: {}; check the address, the certificates (--ca, --cert, --key) and the daemon's [api] listen",
                    source_text(&e)
                ))
            })?
        }
    };
    Ok(FastpathClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES))
}

pub(crate) fn source_text(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(src) = cur {
        let t = src.to_string();
        if !s.contains(&t) {
            s = format!("{s}: {t}");
        }
        cur = src.source();
    }
    s
}
