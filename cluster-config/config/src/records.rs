//! TLS 1.3 on the data plane, decrypted in place: rustls runs the
//! handshake (its unbuffered API) and keeps the keys afterwards (its kernel
//! connection: key updates, session tickets); the records themselves are
//! sealed and opened here, with ring's AEAD, in the caller's buffers. A
//! record costs one copy of its plaintext and no allocation, where rustls'
//! buffered path copies each record three times and allocates for it
//! (docs/transports.md, "TLS records in place").
//!
//! The record layer is RFC 8446 section 5.2: a 5-byte header (type 23,
//! version 0x0303, length), the AEAD of the inner plaintext (the content,
//! its real type, any zero padding) with the header as associated data, and
//! a nonce that is the key's IV XOR the record's sequence number. Each side
//! updates its sending keys (a KeyUpdate) at half the cipher suite's
//! confidentiality limit, and follows the peer's updates.

use std::ops::Range;
use std::sync::Arc;

use ring::aead::{self, Aad, LessSafeKey, Nonce, UnboundKey};
use rustls::client::{ClientConnectionData, UnbufferedClientConnection};
use rustls::kernel::KernelConnection;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::server::{ServerConnectionData, UnbufferedServerConnection};
use rustls::unbuffered::{ConnectionState, EncodeError, UnbufferedStatus};
use rustls::{ConnectionTrafficSecrets, ContentType};

/// A record's header: type, legacy version, length.
pub const HEADER: usize = 5;
/// The most plaintext one record carries.
pub const MAX_PLAIN: usize = 1 << 14;
/// The largest record a peer may send (RFC 8446: 2^14 + 256 of ciphertext).
pub const MAX_RECORD: usize = HEADER + MAX_PLAIN + 256;
/// The AEAD tag.
const TAG: usize = 16;
/// The most handshake bytes a peer may have buffered before the
/// handshake completes (its certificate chain is the largest part).
pub const MAX_HANDSHAKE_BYTES: usize = 128 << 10;

/// Why a session failed after its handshake.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// A header that is not a TLS 1.3 application-data record.
    #[error("not a TLS 1.3 record (type {kind}, length {len})")]
    BadHeader {
        /// The record's content type byte.
        kind: u8,
        /// The record's length field, in bytes.
        len: usize,
    },
    /// Authentication failed: corrupted or forged bytes.
    #[error("a record failed authentication (corrupted or forged)")]
    Decrypt,
    /// The peer sent an alert other than close_notify.
    #[error("the peer sent TLS alert {0}")]
    Alert(u8),
    /// Something this record layer does not accept after the handshake.
    #[error("{0}")]
    Unexpected(&'static str),
    /// A key update rustls refused.
    #[error("TLS key update: {0}")]
    Keys(#[from] rustls::Error),
}

/// A session in its handshake, either side.
pub enum Handshake {
    /// This end is the TLS client.
    Client(UnbufferedClientConnection),
    /// This end is the TLS server.
    Server(UnbufferedServerConnection),
}

impl std::fmt::Debug for Handshake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Client(_) => "Handshake::Client",
            Self::Server(_) => "Handshake::Server",
        })
    }
}

/// What a handshake needs next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// Send what was written, then read more.
    NeedInput,
    /// Send what was written: the handshake is complete.
    Done,
}

/// What one pass over the peer's bytes came to.
enum Step {
    Again,
    Need,
    Done,
    Failed(rustls::Error),
}

/// Append an encoded handshake record to `out`.
fn encode_into<D>(
    enc: &mut rustls::unbuffered::EncodeTlsData<'_, D>,
    out: &mut Vec<u8>,
) -> Result<(), rustls::Error> {
    let at = out.len();
    out.resize(at + 4096, 0);
    loop {
        match enc.encode(&mut out[at..]) {
            Ok(n) => {
                out.truncate(at + n);
                return Ok(());
            }
            Err(EncodeError::InsufficientSize(s)) if s.required_size <= MAX_RECORD * 8 => {
                out.resize(at + s.required_size, 0);
            }
            Err(e) => {
                out.truncate(at);
                return Err(rustls::Error::General(e.to_string()));
            }
        }
    }
}

/// Handle one state of the handshake; plaintext that arrived with it goes
/// to `plain`.
fn step<D>(
    status: UnbufferedStatus<'_, '_, D>,
    out: &mut Vec<u8>,
    plain: &mut Vec<u8>,
) -> (usize, Step) {
    let mut discard = status.discard;
    let step = match status.state {
        Err(e) => Step::Failed(e),
        Ok(ConnectionState::EncodeTlsData(mut enc)) => match encode_into(&mut enc, out) {
            Ok(()) => Step::Again,
            Err(e) => Step::Failed(e),
        },
        Ok(ConnectionState::TransmitTlsData(t)) => {
            // The caller sends `out` before it reads again.
            t.done();
            Step::Again
        }
        Ok(ConnectionState::BlockedHandshake) => Step::Need,
        Ok(ConnectionState::WriteTraffic(_)) => Step::Done,
        Ok(ConnectionState::ReadTraffic(mut r)) => {
            let mut failed = None;
            while let Some(rec) = r.next_record() {
                match rec {
                    Ok(rec) if plain.len() + rec.payload.len() <= MAX_HANDSHAKE_BYTES => {
                        discard += rec.discard;
                        plain.extend_from_slice(rec.payload);
                    }
                    Ok(_) => {
                        failed = Some(rustls::Error::General(
                            "too much data with the handshake".into(),
                        ));
                        break;
                    }
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                }
            }
            failed.map_or(Step::Again, Step::Failed)
        }
        Ok(ConnectionState::PeerClosed | ConnectionState::Closed) => Step::Failed(
            rustls::Error::General("the peer closed the session during the handshake".into()),
        ),
        Ok(_) => Step::Failed(rustls::Error::General("early data is not accepted".into())),
    };
    (discard, step)
}

impl Handshake {
    /// A client's handshake with `name`.
    pub fn client(
        config: Arc<rustls::ClientConfig>,
        name: ServerName<'static>,
    ) -> Result<Self, rustls::Error> {
        Ok(Self::Client(UnbufferedClientConnection::new(config, name)?))
    }

    /// A server's handshake.
    pub fn server(config: Arc<rustls::ServerConfig>) -> Result<Self, rustls::Error> {
        Ok(Self::Server(UnbufferedServerConnection::new(config)?))
    }

    fn process(&mut self, incoming: &mut Vec<u8>, out: &mut Vec<u8>, plain: &mut Vec<u8>) -> Step {
        let (discard, s) = match self {
            Self::Client(c) => step(c.process_tls_records(incoming), out, plain),
            Self::Server(c) => step(c.process_tls_records(incoming), out, plain),
        };
        incoming.drain(..discard.min(incoming.len()));
        s
    }

    /// Take what can be taken of the peer's bytes in `incoming` (consumed
    /// from the front; what is left belongs to the session after the
    /// handshake), appending the records to send to `out` and any
    /// application data that came with the handshake to `plain`. On an
    /// error, `out` holds the alert that tells the peer why.
    pub fn advance(
        &mut self,
        incoming: &mut Vec<u8>,
        out: &mut Vec<u8>,
        plain: &mut Vec<u8>,
    ) -> Result<Progress, rustls::Error> {
        if incoming.len() > MAX_HANDSHAKE_BYTES {
            return Err(rustls::Error::General(format!(
                "over {MAX_HANDSHAKE_BYTES} bytes of handshake"
            )));
        }
        loop {
            match self.process(incoming, out, plain) {
                Step::Again => {}
                Step::Need => return Ok(Progress::NeedInput),
                Step::Done => return Ok(Progress::Done),
                Step::Failed(e) => {
                    // rustls queued an alert for the peer: it comes first.
                    if let Step::Again = self.process(&mut Vec::new(), out, plain) {}
                    return Err(e);
                }
            }
        }
    }

    /// The peer's certificate chain, once it was received.
    pub fn peer_certificates(&self) -> Option<&[CertificateDer<'static>]> {
        match self {
            Self::Client(c) => c.peer_certificates(),
            Self::Server(c) => c.peer_certificates(),
        }
    }

    /// The session after a complete handshake ([`Progress::Done`]): its
    /// records sealed and opened here from now on.
    pub fn into_records(self) -> Result<Records, rustls::Error> {
        let (secrets, kernel) = match self {
            Self::Client(c) => {
                let (s, k) = c.dangerous_into_kernel_connection()?;
                (s, Kernel::Client(k))
            }
            Self::Server(c) => {
                let (s, k) = c.dangerous_into_kernel_connection()?;
                (s, Kernel::Server(k))
            }
        };
        let limit = match &kernel {
            Kernel::Client(k) => k.negotiated_cipher_suite(),
            Kernel::Server(k) => k.negotiated_cipher_suite(),
        }
        .tls13()
        .map_or(1 << 23, |s| s.common.confidentiality_limit);
        Ok(Records {
            tx: Keys::new(secrets.tx.0, secrets.tx.1)?,
            rx: Keys::new(secrets.rx.0, secrets.rx.1)?,
            kernel,
            update_at: (limit / 2).max(1),
            pending: Vec::new(),
        })
    }
}

/// rustls' key schedule after the handshake.
enum Kernel {
    Client(KernelConnection<ClientConnectionData>),
    Server(KernelConnection<ServerConnectionData>),
}

/// One direction's key, IV and next sequence number.
struct Keys {
    key: LessSafeKey,
    iv: [u8; aead::NONCE_LEN],
    seq: u64,
}

impl Keys {
    fn new(seq: u64, secrets: ConnectionTrafficSecrets) -> Result<Self, rustls::Error> {
        let (alg, key, iv) = match &secrets {
            ConnectionTrafficSecrets::Aes128Gcm { key, iv } => (&aead::AES_128_GCM, key, iv),
            ConnectionTrafficSecrets::Aes256Gcm { key, iv } => (&aead::AES_256_GCM, key, iv),
            ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => {
                (&aead::CHACHA20_POLY1305, key, iv)
            }
            _ => return Err(rustls::Error::General("an unsupported cipher suite".into())),
        };
        let key = UnboundKey::new(alg, key.as_ref())
            .map_err(|_| rustls::Error::General("a traffic key of the wrong length".into()))?;
        let iv: [u8; aead::NONCE_LEN] = iv
            .as_ref()
            .try_into()
            .map_err(|_| rustls::Error::General("an IV of the wrong length".into()))?;
        Ok(Self {
            key: LessSafeKey::new(key),
            iv,
            seq,
        })
    }

    /// The next record's nonce (and the sequence number moves on).
    fn nonce(&mut self) -> Result<Nonce, RecordError> {
        let mut n = self.iv;
        for (b, s) in n[4..].iter_mut().zip(self.seq.to_be_bytes()) {
            *b ^= s;
        }
        self.seq = self
            .seq
            .checked_add(1)
            .ok_or(RecordError::Unexpected("TLS sequence numbers ran out"))?;
        Ok(Nonce::assume_unique_for_key(n))
    }
}

/// What one record held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Opened {
    /// Application data: this range of the record's bytes.
    Data(Range<usize>),
    /// Nothing for the caller (a key update, a session ticket): if
    /// [`Records::has_pending`], a record now waits to be sent.
    Nothing,
    /// The peer's close_notify: no more data comes.
    Closed,
}

/// A session's records after its handshake.
pub struct Records {
    kernel: Kernel,
    tx: Keys,
    rx: Keys,
    /// Sending keys are updated when their sequence number reaches this.
    update_at: u64,
    /// Records to send before any more data (the answer to a peer's key
    /// update that asked for one).
    pending: Vec<u8>,
}

impl std::fmt::Debug for Records {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Records")
            .field("tx_seq", &self.tx.seq)
            .field("rx_seq", &self.rx.seq)
            .finish_non_exhaustive()
    }
}

/// The length of the whole record at the front of `buf`, once its header
/// has arrived (`None` before): an error for anything that is not an
/// application-data record of at most [`MAX_RECORD`] bytes.
pub fn record_len(buf: &[u8]) -> Result<Option<usize>, RecordError> {
    let Some(h) = buf.get(..HEADER) else {
        return Ok(None);
    };
    let len = usize::from(u16::from_be_bytes([h[3], h[4]]));
    if h[0] != 23 || h[1] != 3 || !(TAG + 1..=MAX_RECORD - HEADER).contains(&len) {
        return Err(RecordError::BadHeader { kind: h[0], len });
    }
    Ok(Some(HEADER + len))
}

/// The most bytes of our own records (answers to the peer's key updates)
/// that may wait for our next record: a peer asking for updates faster
/// than we send is cut off, not buffered for.
const MAX_PENDING: usize = 4096;

/// Handshake message types met after the handshake.
const NEW_SESSION_TICKET: u8 = 4;
const KEY_UPDATE: u8 = 24;

impl Records {
    /// Open the whole record `rec` (exactly [`record_len`] bytes) in place.
    pub fn open(&mut self, rec: &mut [u8]) -> Result<Opened, RecordError> {
        let (head, body) = rec.split_at_mut(HEADER);
        let head: [u8; HEADER] = (&*head).try_into().unwrap_or([0; HEADER]);
        let nonce = self.rx.nonce()?;
        let inner = self
            .rx
            .key
            .open_in_place(nonce, Aad::from(head), body)
            .map_err(|_| RecordError::Decrypt)?;
        // The real type is the last byte that is not padding.
        let Some(end) = inner.iter().rposition(|&b| b != 0) else {
            return Err(RecordError::Unexpected("a record with no content type"));
        };
        let kind = inner[end];
        match ContentType::from(kind) {
            ContentType::ApplicationData => Ok(Opened::Data(HEADER..HEADER + end)),
            ContentType::Alert => match inner[..end] {
                [_, 0] => Ok(Opened::Closed),
                [_, d] => Err(RecordError::Alert(d)),
                _ => Err(RecordError::Unexpected("a malformed alert")),
            },
            ContentType::Handshake => {
                self.handshake_messages(&inner[..end])?;
                Ok(Opened::Nothing)
            }
            _ => Err(RecordError::Unexpected(
                "a record type not allowed after the handshake",
            )),
        }
    }

    /// Key updates and session tickets, whole within their record (a
    /// message split over records is refused).
    fn handshake_messages(&mut self, mut msgs: &[u8]) -> Result<(), RecordError> {
        while !msgs.is_empty() {
            let [kind, a, b, c, rest @ ..] = msgs else {
                return Err(RecordError::Unexpected("a truncated handshake message"));
            };
            let len = u32::from_be_bytes([0, *a, *b, *c]) as usize;
            let Some(body) = rest.get(..len) else {
                return Err(RecordError::Unexpected(
                    "a handshake message split over records",
                ));
            };
            match (*kind, &self.kernel) {
                (KEY_UPDATE, _) => {
                    let requested = match body {
                        [0] => false,
                        [1] => true,
                        _ => return Err(RecordError::Unexpected("a malformed key update")),
                    };
                    let (seq, s) = match &mut self.kernel {
                        Kernel::Client(k) => k.update_rx_secret()?,
                        Kernel::Server(k) => k.update_rx_secret()?,
                    };
                    self.rx = Keys::new(seq, s)?;
                    if requested {
                        if self.pending.len() >= MAX_PENDING {
                            return Err(RecordError::Unexpected(
                                "key updates keep coming while ours wait to be sent",
                            ));
                        }
                        let mut pending = std::mem::take(&mut self.pending);
                        self.update_tx(&mut pending)?;
                        self.pending = pending;
                    }
                }
                (NEW_SESSION_TICKET, Kernel::Client(_)) => {
                    if let Kernel::Client(k) = &mut self.kernel {
                        k.handle_new_session_ticket(body)?;
                    }
                }
                _ => {
                    return Err(RecordError::Unexpected(
                        "a handshake message not allowed after the handshake",
                    ));
                }
            }
            msgs = &rest[len..];
        }
        Ok(())
    }

    /// Seal a KeyUpdate (not requesting one back) with the current keys
    /// into `out`, then switch to the next sending keys.
    fn update_tx(&mut self, out: &mut Vec<u8>) -> Result<(), RecordError> {
        self.seal_one(&[KEY_UPDATE, 0, 0, 1, 0], ContentType::Handshake, out)?;
        let (seq, s) = match &mut self.kernel {
            Kernel::Client(k) => k.update_tx_secret()?,
            Kernel::Server(k) => k.update_tx_secret()?,
        };
        self.tx = Keys::new(seq, s)?;
        Ok(())
    }

    /// True when a record waits to be sent ([`Records::seal`] sends it
    /// first; [`Records::take_pending`] gives it to a writer now).
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Append the records waiting to be sent to `out`.
    pub fn take_pending(&mut self, out: &mut Vec<u8>) {
        out.append(&mut self.pending);
    }

    fn seal_one(
        &mut self,
        plain: &[u8],
        kind: ContentType,
        out: &mut Vec<u8>,
    ) -> Result<(), RecordError> {
        let len = plain.len() + 1 + TAG;
        let at = out.len();
        out.reserve(HEADER + len);
        let head = [23, 3, 3, (len >> 8) as u8, len as u8];
        out.extend_from_slice(&head);
        out.extend_from_slice(plain);
        out.push(u8::from(kind));
        let nonce = self.tx.nonce()?;
        let tag = self
            .tx
            .key
            .seal_in_place_separate_tag(nonce, Aad::from(head), &mut out[at + HEADER..])
            .map_err(|_| RecordError::Unexpected("sealing a record failed"))?;
        out.extend_from_slice(tag.as_ref());
        Ok(())
    }

    /// Append `plain` to `out` as records of at most [`MAX_PLAIN`] bytes
    /// (after any record waiting to be sent, and a key update when the
    /// sending keys are due one).
    pub fn seal(&mut self, plain: &[u8], out: &mut Vec<u8>) -> Result<(), RecordError> {
        self.take_pending(out);
        for chunk in plain.chunks(MAX_PLAIN) {
            if self.tx.seq >= self.update_at {
                self.update_tx(out)?;
            }
            self.seal_one(chunk, ContentType::ApplicationData, out)?;
        }
        Ok(())
    }

    /// Append a close_notify alert to `out`.
    pub fn seal_close_notify(&mut self, out: &mut Vec<u8>) -> Result<(), RecordError> {
        self.take_pending(out);
        self.seal_one(&[1, 0], ContentType::Alert, out)
    }

    #[cfg(test)]
    fn set_update_at(&mut self, at: u64) {
        self.update_at = at;
    }
}

#[cfg(test)]
mod tests;
