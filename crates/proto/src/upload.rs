//! `Runtime.WriteFile` with an upload the sender can abort so that the server sees an error.
//!
//! Why not just drop the call: dropping a tonic call resets the stream with `CANCEL`, and a
//! tonic server reads a `CANCEL` on a request stream as its clean end, so an abandoned upload
//! would be taken as complete (a short file). An error from the request's encoder instead
//! makes hyper reset the stream with `INTERNAL_ERROR`, which the server reads as an error.
//! [`Upload::Abort`] is that encoder error. After sending it, wait for the call to fail
//! (dropping it before the reset went out would send `CANCEL` after all).

use crate::v1 as pb;
use tonic::Status;
use tonic::Streaming;
use tonic::codec::{BufferSettings, Codec, EncodeBuf, Encoder};
use tonic::codegen::{Body, Bytes, GrpcMethod, StdError, http};
use tonic_prost::ProstCodec;

/// One item of an abortable upload.
#[derive(Debug, Clone)]
pub enum Upload<T> {
    Message(T),
    /// Fails the upload with this reason: the server sees the stream reset, not ended.
    Abort(String),
}

type Inner = ProstCodec<pb::WriteFileRequest, pb::WriteFileResponse>;

/// The `WriteFile` codec, with [`Upload::Abort`] turned into an encoding error.
#[derive(Default)]
pub struct WriteFileCodec(Inner);

pub struct AbortableEncoder(<Inner as Codec>::Encoder);

impl Encoder for AbortableEncoder {
    type Item = Upload<pb::WriteFileRequest>;
    type Error = Status;

    fn encode(&mut self, item: Self::Item, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        match item {
            Upload::Message(m) => self.0.encode(m, dst),
            Upload::Abort(why) => Err(Status::aborted(why)),
        }
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}

impl Codec for WriteFileCodec {
    type Encode = Upload<pb::WriteFileRequest>;
    type Decode = pb::WriteFileResponse;
    type Encoder = AbortableEncoder;
    type Decoder = <Inner as Codec>::Decoder;

    fn encoder(&mut self) -> Self::Encoder {
        AbortableEncoder(self.0.encoder())
    }

    fn decoder(&mut self) -> Self::Decoder {
        self.0.decoder()
    }
}

/// Largest message either way, on every hop (reference section 13); `opendsec_common::grpc`
/// re-exports it.
pub const MAX_MESSAGE_BYTES: usize = 80 << 20;

/// Calls `Runtime.WriteFile` over `channel` with an abortable stream of messages (the first
/// names the sandbox and path).
pub async fn write_file<T, S>(channel: T, messages: S) -> Result<tonic::Response<pb::WriteFileResponse>, Status>
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<StdError>,
    T::ResponseBody: Body<Data = Bytes> + Send + 'static,
    <T::ResponseBody as Body>::Error: Into<StdError> + Send,
    S: futures::Stream<Item = Upload<pb::WriteFileRequest>> + Send + 'static,
{
    write_file_with(channel, messages, tonic::metadata::MetadataMap::new()).await
}

/// [`write_file`] with request metadata.
pub async fn write_file_with<T, S>(
    channel: T,
    messages: S,
    metadata: tonic::metadata::MetadataMap,
) -> Result<tonic::Response<pb::WriteFileResponse>, Status>
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<StdError>,
    T::ResponseBody: Body<Data = Bytes> + Send + 'static,
    <T::ResponseBody as Body>::Error: Into<StdError> + Send,
    S: futures::Stream<Item = Upload<pb::WriteFileRequest>> + Send + 'static,
{
    let mut grpc = tonic::client::Grpc::new(channel)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    grpc.ready().await.map_err(|e| Status::unknown(format!("service was not ready: {}", e.into())))?;
    let path = http::uri::PathAndQuery::from_static("/opendsec.v1.Runtime/WriteFile");
    let mut req = tonic::Request::new(messages);
    *req.metadata_mut() = metadata;
    req.extensions_mut().insert(GrpcMethod::new("opendsec.v1.Runtime", "WriteFile"));
    grpc.client_streaming(req, path, WriteFileCodec::default()).await
}

/// How [`forward`] talks to the next hop.
#[derive(Clone, Debug, Default)]
pub struct Hop {
    /// Sent with the forwarded call.
    pub metadata: tonic::metadata::MetadataMap,
    /// How long the next hop may take to answer once the whole upload went out (none: no
    /// limit); the upload itself takes as long as the caller sends.
    pub answer_wait: Option<std::time::Duration>,
    /// How long the reset of an aborted upload may take to go out.
    pub abort_wait: std::time::Duration,
}

/// Forwards a WriteFile stream whose first message was already read: `first`, then the rest of
/// `incoming`, each checked by `check`, to `channel`. A failure on the incoming side (or a
/// refused message) resets the forwarded stream with an error, so the next hop never commits
/// a short file. Every hop forwarding WriteFile (apiserver, edge, aether) goes through here.
/// `incoming` is only borrowed: a hop that refused the first message can be tried again with
/// the rest of it, when `check` saw no other.
pub async fn forward<T>(
    channel: T,
    first: pb::WriteFileRequest,
    incoming: &mut Streaming<pb::WriteFileRequest>,
    check: impl Fn(&pb::WriteFileRequest) -> Result<(), Status>,
    hop: Hop,
) -> Result<tonic::Response<pb::WriteFileResponse>, Status>
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<StdError>,
    T::ResponseBody: Body<Data = Bytes> + Send + 'static,
    <T::ResponseBody as Body>::Error: Into<StdError> + Send,
{
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    // Cannot fail: `rx` lives until the forwarded call ends.
    let _ = tx.send(Upload::Message(first)).await;
    let feed = async {
        while let Some(m) = incoming.message().await? {
            check(&m)?;
            if tx.send(Upload::Message(m)).await.is_err() {
                // The next hop answered early (an error): its answer is the call's.
                break;
            }
        }
        Ok::<(), Status>(())
    };
    let upload = write_file_with(channel, tokio_stream::wrappers::ReceiverStream::new(rx), hop.metadata);
    tokio::pin!(upload);
    let fed = tokio::select! {
        r = &mut upload => return r,
        fed = feed => fed,
    };
    match fed {
        Ok(()) => {
            drop(tx);
            match hop.answer_wait {
                Some(d) => tokio::time::timeout(d, upload).await.unwrap_or_else(|_| {
                    Err(Status::deadline_exceeded(format!("the upload got no answer within {} s", d.as_secs())))
                }),
                None => upload.await,
            }
        }
        Err(e) => {
            // Reset the forwarded stream with an error and let the reset go out before the
            // call is dropped.
            let abort = async {
                let _ = tx.send(Upload::Abort(e.message().to_string())).await;
                drop(tx);
                let _ = upload.await;
            };
            let _ = tokio::time::timeout(hop.abort_wait, abort).await;
            Err(e)
        }
    }
}
