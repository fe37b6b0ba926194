//! The management API (`fastpath.v1`, tonic): the server the daemon runs, its listeners, and
//! the client the CLI uses.
//!
//! Contract: a request is converted field by field (`convert`), then checked with the whole
//! desired state (`rules`) before anything changes; mutations are serialized through one lock
//! on the rules. Reads come straight from the pinned maps and never wait for a mutation.

pub mod authority;
pub mod client;
pub mod convert;
pub mod read;
pub mod server;

/// The generated messages and services.
#[allow(clippy::all, clippy::pedantic, missing_docs, rustdoc::all)]
pub mod pb {
    tonic::include_proto!("fastpath.v1");

    /// `fastpath.v1` and what it imports, encoded (`FileDescriptorSet`): what server
    /// reflection answers with.
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("fastpath_v1");
}

/// The API version this build speaks.
pub const API_VERSION: &str = "fastpath.v1";

/// Largest request or response message accepted, in bytes: a whole config of 10,000 services
/// with their backends fits several times over; anything larger is refused before it is
/// decoded (tonic answers OUT_OF_RANGE; the CLI checks the size first and says what to do).
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

impl From<crate::rules::Rejected> for tonic::Status {
    fn from(r: crate::rules::Rejected) -> tonic::Status {
        use crate::rules::RejectKind as K;
        let code = match r.kind {
            K::Invalid => tonic::Code::InvalidArgument,
            K::AlreadyExists => tonic::Code::AlreadyExists,
            K::NotFound => tonic::Code::NotFound,
            K::Precondition => tonic::Code::FailedPrecondition,
            K::Internal => tonic::Code::Internal,
        };
        tonic::Status::new(code, r.message)
    }
}
