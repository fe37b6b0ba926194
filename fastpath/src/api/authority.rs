//! The Unix socket's HTTP/2 requests, with an `:authority` that h2 accepts.
//!
//! gRPC clients that dial a Unix socket (grpc-core, so Python's `grpcio`, C++, Ruby; grpc-java;
//! grpc-swift) send the socket's path as the `:authority`, percent-encoded
//! (`tmp%2Ffastpath%2Ffastpath.sock`) or raw. RFC 3986 allows the first, but h2 parses the
//! value with `http::uri::Authority`, which refuses `%` and `/` in a host, and resets the stream
//! (PROTOCOL_ERROR) before hyper, tonic or any tower layer sees a request. h2 has no option to
//! relax this, so the Unix listener normalizes the bytes before h2 reads them: [`AuthorityFix`]
//! wraps each accepted connection and rewrites the header blocks the client sends, replacing
//! an `:authority` that does not parse with the conventional `localhost` (what grpc-go, grpcurl
//! and the CLI send over a Unix socket; nothing in the daemon reads the authority). The TCP
//! listener does not use it: there the authority is a host name, checked exactly as h2 does.
//!
//! Contract: the bytes the server writes pass untouched; of the client's bytes, every frame but
//! HEADERS and CONTINUATION passes untouched; each header block is decoded (HPACK, with the
//! client's dynamic table) and encoded again as literals that never enter the server's dynamic
//! table, so both tables stay consistent whatever the client indexes. A header block that does
//! not decode, is interrupted by another frame, or is larger than [`MAX_HEADER_LIST`] closes
//! the connection (a read error): h2 would end it for the first two too (COMPRESSION_ERROR,
//! PROTOCOL_ERROR).

use std::{
    io,
    pin::Pin,
    task::{Context, Poll, ready},
};

use bytes::{Buf as _, BufMut as _, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// What a client sends first on an HTTP/2 connection with prior knowledge (RFC 9113 §3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// The authority given to requests whose own does not parse.
const LOCALHOST: &[u8] = b"localhost";
/// Largest frame payload the server accepts before its SETTINGS raise it (RFC 9113 §4.2); the
/// re-encoded blocks are cut to fit it.
const MAX_FRAME: usize = 16_384;
/// The HPACK dynamic table size the client may use: the protocol's default, which the server
/// (hyper/h2 as tonic configures it) never changes.
const HEADER_TABLE_SIZE: usize = 4_096;
/// Largest header block (encoded, all fragments) and decoded header list (RFC 9113 §6.5.2
/// sizes) taken in: far above what the server accepts (16 KiB), so h2 still answers requests
/// that are merely too large; only the memory a client can make this filter hold is bounded.
pub const MAX_HEADER_LIST: usize = 1 << 20;

const FRAME_HEADERS: u8 = 0x1;
const FRAME_CONTINUATION: u8 = 0x9;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;
const FLAG_PRIORITY: u8 = 0x20;

/// Why a connection was closed instead of passed on.
#[derive(Debug, thiserror::Error)]
pub enum AuthorityFixError {
    #[error("HTTP/2 frame from the client is malformed: {0}")]
    Frame(&'static str),
    #[error("header block from the client does not decode (HPACK): {0:?}")]
    Hpack(loona_hpack::decoder::DecoderError),
    #[error("header block from the client is larger than {MAX_HEADER_LIST} bytes")]
    TooLarge,
}

impl From<AuthorityFixError> for io::Error {
    fn from(e: AuthorityFixError) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidData, e)
    }
}

/// Where the filter is in the client's byte stream.
enum State {
    /// `n` bytes of the preface seen.
    Preface(usize),
    /// Not HTTP/2 with prior knowledge: everything passes; h2 refuses it.
    Opaque,
    /// Collecting a frame's 9-byte header.
    FrameHeader,
    /// Copying `n` more payload bytes of a frame that passes untouched.
    Pass(usize),
    /// Collecting the payload of a HEADERS or CONTINUATION frame.
    Block(FrameHead),
}

/// The fields of a frame header the filter uses.
#[derive(Clone, Copy)]
struct FrameHead {
    len: usize,
    kind: u8,
    flags: u8,
    stream: u32,
}

/// A header block being assembled from a HEADERS frame and its CONTINUATIONs.
struct OpenBlock {
    stream: u32,
    /// END_STREAM of the HEADERS frame.
    end_stream: bool,
    /// The HEADERS frame's priority fields, when it had them.
    priority: Option<[u8; 5]>,
    fragments: Vec<u8>,
}

/// The rewriting of the client's side of one connection, without I/O: bytes in, bytes out.
pub struct RequestFilter {
    state: State,
    /// Bytes of the current frame header, or of the current HEADERS/CONTINUATION payload.
    pending: Vec<u8>,
    open: Option<OpenBlock>,
    decoder: loona_hpack::Decoder<'static>,
}

impl Default for RequestFilter {
    fn default() -> Self {
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(HEADER_TABLE_SIZE);
        RequestFilter {
            state: State::Preface(0),
            pending: Vec::new(),
            open: None,
            decoder,
        }
    }
}

impl RequestFilter {
    /// Consumes all of `input` (what the client sent next) and appends what the server is to
    /// read to `out`; a partial frame is kept until the rest arrives.
    pub fn feed(&mut self, mut input: &[u8], out: &mut BytesMut) -> Result<(), AuthorityFixError> {
        while !input.is_empty() {
            match self.state {
                State::Opaque => {
                    out.put_slice(input);
                    return Ok(());
                }
                State::Preface(seen) => {
                    let n = input.len().min(PREFACE.len() - seen);
                    let (head, rest) = input.split_at(n);
                    out.put_slice(head);
                    input = rest;
                    self.state = if head != &PREFACE[seen..seen + n] {
                        State::Opaque
                    } else if seen + n == PREFACE.len() {
                        State::FrameHeader
                    } else {
                        State::Preface(seen + n)
                    };
                }
                State::Pass(left) => {
                    let n = input.len().min(left);
                    let (head, rest) = input.split_at(n);
                    out.put_slice(head);
                    input = rest;
                    self.state = if n == left {
                        State::FrameHeader
                    } else {
                        State::Pass(left - n)
                    };
                }
                State::FrameHeader => {
                    input = self.collect(input, 9);
                    if self.pending.len() == 9 {
                        let header = std::mem::take(&mut self.pending);
                        self.frame_header(&header, out)?;
                    }
                }
                State::Block(head) => {
                    input = self.collect(input, head.len);
                    if self.pending.len() == head.len {
                        self.block_frame(head, out)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Moves bytes from `input` to `pending` until it holds `want`; returns the rest.
    fn collect<'a>(&mut self, input: &'a [u8], want: usize) -> &'a [u8] {
        let n = input.len().min(want.saturating_sub(self.pending.len()));
        self.pending.extend_from_slice(&input[..n]);
        &input[n..]
    }

    /// A complete frame header in `h`: what follows is passed or collected.
    fn frame_header(&mut self, h: &[u8], out: &mut BytesMut) -> Result<(), AuthorityFixError> {
        let head = FrameHead {
            len: usize::from(h[0]) << 16 | usize::from(h[1]) << 8 | usize::from(h[2]),
            kind: h[3],
            flags: h[4],
            stream: u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff,
        };
        let in_block = match (&self.open, head.kind) {
            (Some(open), FRAME_CONTINUATION) if open.stream == head.stream => true,
            // RFC 9113 §6.10: nothing may come between a HEADERS and its CONTINUATIONs.
            (Some(_), _) => return Err(AuthorityFixError::Frame("header block interrupted")),
            (None, FRAME_HEADERS) => true,
            // A stray CONTINUATION (or a PUSH_PROMISE, which a client never sends) passes: h2
            // ends the connection for it.
            (None, _) => false,
        };
        if !in_block {
            out.put_slice(h);
            self.state = if head.len == 0 {
                State::FrameHeader
            } else {
                State::Pass(head.len)
            };
            return Ok(());
        }
        let held = self.open.as_ref().map_or(0, |o| o.fragments.len());
        if held + head.len > MAX_HEADER_LIST {
            return Err(AuthorityFixError::TooLarge);
        }
        self.state = State::Block(head);
        if head.len == 0 {
            self.block_frame(head, out)?;
        }
        Ok(())
    }

    /// A complete HEADERS or CONTINUATION payload in `pending`.
    fn block_frame(
        &mut self,
        head: FrameHead,
        out: &mut BytesMut,
    ) -> Result<(), AuthorityFixError> {
        let payload = std::mem::take(&mut self.pending);
        self.state = State::FrameHeader;
        let open = match self.open.take() {
            Some(mut open) => {
                open.fragments.extend_from_slice(&payload);
                open
            }
            None => headers_frame(head, &payload)?,
        };
        if head.flags & FLAG_END_HEADERS == 0 {
            self.open = Some(open);
            return Ok(());
        }
        self.emit(open, out)
    }

    /// Decodes a whole header block and writes it again, as HEADERS (and CONTINUATIONs).
    fn emit(&mut self, open: OpenBlock, out: &mut BytesMut) -> Result<(), AuthorityFixError> {
        let mut block = Vec::with_capacity(open.fragments.len() + LOCALHOST.len());
        let mut size = 0usize;
        let mut too_large = false;
        self.decoder
            .decode_with_cb(&open.fragments, |name, value| {
                // RFC 9113 §6.5.2: a field's size counts 32 bytes besides its name and value.
                size += name.len() + value.len() + 32;
                if size > MAX_HEADER_LIST {
                    too_large = true;
                    return;
                }
                let value: &[u8] = if &*name == b":authority"
                    && http::uri::Authority::try_from(&*value).is_err()
                {
                    LOCALHOST
                } else {
                    &value
                };
                literal(&name, value, &mut block);
            })
            .map_err(AuthorityFixError::Hpack)?;
        if too_large {
            return Err(AuthorityFixError::TooLarge);
        }
        let first_room = MAX_FRAME - open.priority.map_or(0, |p| p.len());
        let (first, mut rest) = block.split_at(block.len().min(first_room));
        let mut flags = if open.end_stream { FLAG_END_STREAM } else { 0 };
        if open.priority.is_some() {
            flags |= FLAG_PRIORITY;
        }
        if rest.is_empty() {
            flags |= FLAG_END_HEADERS;
        }
        let priority = open.priority.unwrap_or_default();
        let priority = &priority[..open.priority.map_or(0, |p| p.len())];
        frame(out, FRAME_HEADERS, flags, open.stream, &[priority, first]);
        while !rest.is_empty() {
            let (chunk, tail) = rest.split_at(rest.len().min(MAX_FRAME));
            rest = tail;
            let flags = if rest.is_empty() { FLAG_END_HEADERS } else { 0 };
            frame(out, FRAME_CONTINUATION, flags, open.stream, &[chunk]);
        }
        Ok(())
    }
}

/// The header block fragment and fields of a HEADERS frame's payload (RFC 9113 §6.2).
fn headers_frame(head: FrameHead, payload: &[u8]) -> Result<OpenBlock, AuthorityFixError> {
    let mut p = payload;
    let mut pad = 0;
    if head.flags & FLAG_PADDED != 0 {
        let (&n, rest) = p.split_first().ok_or(AuthorityFixError::Frame(
            "padded HEADERS without a pad length",
        ))?;
        pad = usize::from(n);
        p = rest;
    }
    let mut priority = None;
    if head.flags & FLAG_PRIORITY != 0 {
        let (fields, rest) = p.split_first_chunk::<5>().ok_or(AuthorityFixError::Frame(
            "HEADERS too short for its priority fields",
        ))?;
        priority = Some(*fields);
        p = rest;
    }
    let fragment = p
        .len()
        .checked_sub(pad)
        .map(|n| &p[..n])
        .ok_or(AuthorityFixError::Frame(
            "HEADERS padding longer than the frame",
        ))?;
    Ok(OpenBlock {
        stream: head.stream,
        end_stream: head.flags & FLAG_END_STREAM != 0,
        priority,
        fragments: fragment.to_vec(),
    })
}

/// One field as "literal header field without indexing, new name" (RFC 7541 §6.2.2): the
/// server's dynamic table never changes, whatever the client indexed.
fn literal(name: &[u8], value: &[u8], out: &mut Vec<u8>) {
    out.push(0x00);
    for s in [name, value] {
        // Writing to a Vec cannot fail. The H bit (Huffman) stays clear: raw octets.
        let _ = loona_hpack::encoder::encode_integer_into(s.len(), 7, 0, out);
        out.extend_from_slice(s);
    }
}

/// Appends one frame whose payload is `parts` joined.
fn frame(out: &mut BytesMut, kind: u8, flags: u8, stream: u32, parts: &[&[u8]]) {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    // len <= MAX_FRAME: fits the 24-bit length field.
    out.put_uint(len as u64, 3);
    out.put_u8(kind);
    out.put_u8(flags);
    out.put_u32(stream);
    for p in parts {
        out.put_slice(p);
    }
}

/// An accepted Unix socket connection whose requests reach h2 through a [`RequestFilter`].
pub struct AuthorityFix<S> {
    inner: S,
    filter: RequestFilter,
    /// Filtered bytes not yet read by the server.
    ready: BytesMut,
    /// Raw bytes read from the client, reused across reads.
    scratch: Box<[u8]>,
}

impl<S> AuthorityFix<S> {
    pub fn new(inner: S) -> Self {
        AuthorityFix {
            inner,
            filter: RequestFilter::default(),
            ready: BytesMut::new(),
            scratch: vec![0; MAX_FRAME].into_boxed_slice(),
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthorityFix<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        // A read from the client may yield nothing for the server (a partial frame). The loop
        // ends with bytes for the server, with Pending (the client has none), or at EOF.
        while this.ready.is_empty() {
            let mut raw = ReadBuf::new(&mut this.scratch);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut raw))?;
            if raw.filled().is_empty() {
                return Poll::Ready(Ok(()));
            }
            this.filter.feed(raw.filled(), &mut this.ready)?;
        }
        let n = this.ready.len().min(buf.remaining());
        buf.put_slice(&this.ready[..n]);
        this.ready.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthorityFix<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for AuthorityFix<tokio::net::UnixStream> {
    type ConnectInfo = <tokio::net::UnixStream as tonic::transport::server::Connected>::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FRAME_DATA: u8 = 0x0;
    const FRAME_SETTINGS: u8 = 0x4;

    type Fields = Vec<(Vec<u8>, Vec<u8>)>;

    fn request(authority: &str, path: &str) -> Fields {
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", authority),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
        .iter()
        .map(|(n, v)| (n.as_bytes().to_vec(), v.as_bytes().to_vec()))
        .collect()
    }

    fn raw_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = BytesMut::new();
        out.put_uint(payload.len() as u64, 3);
        out.put_u8(kind);
        out.put_u8(flags);
        out.put_u32(stream);
        out.put_slice(payload);
        out.to_vec()
    }

    /// Splits what the filter gave the server into the preface and frames.
    fn frames(mut b: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        assert!(
            b.starts_with(PREFACE),
            "output must start with the preface: {b:?}"
        );
        b = &b[PREFACE.len()..];
        let mut v = Vec::new();
        while !b.is_empty() {
            assert!(b.len() >= 9, "truncated frame header: {b:?}");
            let len = usize::from(b[0]) << 16 | usize::from(b[1]) << 8 | usize::from(b[2]);
            let stream = u32::from_be_bytes([b[5], b[6], b[7], b[8]]);
            assert!(b.len() >= 9 + len, "truncated frame payload");
            v.push((b[3], b[4], stream, b[9..9 + len].to_vec()));
            b = &b[9 + len..];
        }
        v
    }

    /// Feeds `input` in pieces of `step` bytes.
    fn filter(input: &[u8], step: usize) -> Result<Vec<u8>, AuthorityFixError> {
        let mut f = RequestFilter::default();
        let mut out = BytesMut::new();
        for chunk in input.chunks(step) {
            f.feed(chunk, &mut out)?;
        }
        Ok(out.to_vec())
    }

    /// A client connection: preface, SETTINGS, two requests whose header blocks use the
    /// dynamic table (the second refers to entries the first added), DATA after each.
    fn client_bytes(authority: &str) -> Vec<u8> {
        let mut enc = loona_hpack::Encoder::new();
        let mut input = PREFACE.to_vec();
        input.extend(raw_frame(FRAME_SETTINGS, 0, 0, &[0, 4, 0, 0, 0xff, 0xff]));
        for (stream, path) in [
            (1, "/fastpath.v1.Fastpath/GetInfo"),
            (3, "/fastpath.v1.Fastpath/ListServices"),
        ] {
            let fields = request(authority, path);
            let block = enc.encode(fields.iter().map(|(n, v)| (&n[..], &v[..])));
            input.extend(raw_frame(FRAME_HEADERS, FLAG_END_HEADERS, stream, &block));
            input.extend(raw_frame(
                FRAME_DATA,
                FLAG_END_STREAM,
                stream,
                &[0, 0, 0, 0, 0],
            ));
        }
        input
    }

    /// The header lists the server decodes from `out`, with a decoder of its own (as h2 has).
    fn server_decodes(out: &[u8]) -> Vec<Fields> {
        let mut dec = loona_hpack::Decoder::new();
        frames(out)
            .into_iter()
            .filter(|f| f.0 == FRAME_HEADERS)
            .map(|(_, flags, _, block)| {
                assert!(flags & FLAG_END_HEADERS != 0, "one frame per block here");
                dec.decode(&block)
                    .expect("the server decodes what the filter wrote")
            })
            .collect()
    }

    #[test]
    fn an_authority_that_does_not_parse_becomes_localhost_in_every_request() {
        let input = client_bytes("run%2Ffastpath%2Ffastpath.sock");
        for step in [1, 7, input.len()] {
            let out = filter(&input, step).expect("a well-formed connection");
            let lists = server_decodes(&out);
            assert_eq!(lists.len(), 2, "two requests");
            for (list, path) in lists.iter().zip(["GetInfo", "ListServices"]) {
                let want = request("localhost", &format!("/fastpath.v1.Fastpath/{path}"));
                assert_eq!(
                    list, &want,
                    "request to {path}, input fed {step} bytes at a time"
                );
            }
            // SETTINGS and DATA pass byte for byte.
            let passed: Vec<_> = frames(&out)
                .into_iter()
                .filter(|f| f.0 != FRAME_HEADERS)
                .collect();
            assert_eq!(
                passed,
                vec![
                    (FRAME_SETTINGS, 0, 0, vec![0, 4, 0, 0, 0xff, 0xff]),
                    (FRAME_DATA, FLAG_END_STREAM, 1, vec![0; 5]),
                    (FRAME_DATA, FLAG_END_STREAM, 3, vec![0; 5]),
                ]
            );
        }
    }

    #[test]
    fn a_valid_authority_passes_unchanged() {
        for authority in [
            "localhost",
            "fastpath.example:50051",
            "[fd00::1]:443",
            "10.0.0.1",
        ] {
            let out = filter(&client_bytes(authority), 5).expect("a well-formed connection");
            let lists = server_decodes(&out);
            assert!(
                lists
                    .iter()
                    .all(|l| l[3] == (b":authority".to_vec(), authority.as_bytes().to_vec())),
                "{authority}: {lists:?}"
            );
        }
    }

    #[test]
    fn padding_priority_and_continuation_are_folded_into_one_block() {
        let block = loona_hpack::Encoder::new().encode(
            request("/tmp/raw path.sock", "/p")
                .iter()
                .map(|(n, v)| (&n[..], &v[..])),
        );
        let (a, b) = block.split_at(block.len() / 2);
        let mut headers = vec![3u8]; // pad length
        headers.extend([0x80, 0, 0, 1, 16]); // exclusive dependency on stream 1, weight 16
        headers.extend(a);
        headers.extend([0, 0, 0]);
        let mut input = PREFACE.to_vec();
        input.extend(raw_frame(
            FRAME_HEADERS,
            FLAG_PADDED | FLAG_PRIORITY | FLAG_END_STREAM,
            5,
            &headers,
        ));
        input.extend(raw_frame(FRAME_CONTINUATION, FLAG_END_HEADERS, 5, b));
        let out = filter(&input, 3).expect("a well-formed connection");
        let f = frames(&out);
        assert_eq!(f.len(), 1, "one HEADERS frame: {f:?}");
        let (kind, flags, stream, payload) = &f[0];
        assert_eq!(
            (*kind, *flags, *stream),
            (
                FRAME_HEADERS,
                FLAG_END_STREAM | FLAG_PRIORITY | FLAG_END_HEADERS,
                5
            )
        );
        assert_eq!(payload[..5], [0x80, 0, 0, 1, 16], "priority fields kept");
        let list = loona_hpack::Decoder::new()
            .decode(&payload[5..])
            .expect("decodes");
        assert_eq!(list, request("localhost", "/p"));
    }

    #[test]
    fn a_block_larger_than_a_frame_is_cut_into_continuations() {
        let mut fields = request("a%2Fb", "/p");
        fields.push((b"x-big".to_vec(), vec![b'v'; 40_000]));
        let block =
            loona_hpack::Encoder::new().encode(fields.iter().map(|(n, v)| (&n[..], &v[..])));
        let mut input = PREFACE.to_vec();
        let (a, b) = block.split_at(MAX_FRAME);
        input.extend(raw_frame(FRAME_HEADERS, 0, 1, a));
        input.extend(raw_frame(FRAME_CONTINUATION, FLAG_END_HEADERS, 1, b));
        let out = filter(&input, 4096).expect("a well-formed connection");
        let f = frames(&out);
        let kinds: Vec<_> = f
            .iter()
            .map(|(k, fl, s, p)| (*k, *fl, *s, p.len() <= MAX_FRAME))
            .collect();
        assert_eq!(
            kinds,
            vec![
                (FRAME_HEADERS, 0, 1, true),
                (FRAME_CONTINUATION, 0, 1, true),
                (FRAME_CONTINUATION, FLAG_END_HEADERS, 1, true),
            ]
        );
        let block: Vec<u8> = f.iter().flat_map(|x| x.3.clone()).collect();
        fields[3].1 = b"localhost".to_vec();
        assert_eq!(
            loona_hpack::Decoder::new().decode(&block).expect("decodes"),
            fields
        );
    }

    #[test]
    fn bytes_that_are_not_http2_pass_untouched() {
        let input = b"GET / HTTP/1.1\r\nHost: /tmp/x.sock\r\n\r\n";
        let mut out = BytesMut::new();
        RequestFilter::default()
            .feed(input, &mut out)
            .expect("passed");
        assert_eq!(&out[..], input);
    }

    #[test]
    fn malformed_or_oversized_blocks_close_the_connection() {
        let block = loona_hpack::Encoder::new()
            .encode(request("x", "/p").iter().map(|(n, v)| (&n[..], &v[..])));
        let mut interrupted = PREFACE.to_vec();
        interrupted.extend(raw_frame(FRAME_HEADERS, 0, 1, &block));
        interrupted.extend(raw_frame(FRAME_DATA, 0, 1, b"x"));
        assert!(matches!(
            filter(&interrupted, 9),
            Err(AuthorityFixError::Frame(_))
        ));

        let mut garbage = PREFACE.to_vec();
        // An indexed field past the end of both tables.
        garbage.extend(raw_frame(FRAME_HEADERS, FLAG_END_HEADERS, 1, &[0xff, 0x7f]));
        assert!(matches!(
            filter(&garbage, 9),
            Err(AuthorityFixError::Hpack(_))
        ));

        let mut huge = PREFACE.to_vec();
        let chunk = vec![0u8; MAX_FRAME];
        huge.extend(raw_frame(FRAME_HEADERS, 0, 1, &chunk));
        for _ in 0..MAX_HEADER_LIST / MAX_FRAME {
            huge.extend(raw_frame(FRAME_CONTINUATION, 0, 1, &chunk));
        }
        assert!(matches!(
            filter(&huge, 65_536),
            Err(AuthorityFixError::TooLarge)
        ));
    }
}
