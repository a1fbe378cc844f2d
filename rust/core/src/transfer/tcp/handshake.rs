//! Connection setup: version check and challenge-response authentication (see
//! [`auth`](super::super::auth)). No request is served before it succeeds. With a
//! token, both ends leave it holding the connection's frame keys ([`seal`](super::seal)),
//! for the wire protection both ends were configured with: the client names its own in
//! its hello, and a server configured otherwise refuses with both names (frames of two
//! different protections would only ever fail their tags).

use std::io::{Read, Write};

use hashbrown::HashMap;

use super::super::auth::{self, AuthKey};
use super::super::protocol::{encode, Msg, VERSION};
use super::super::TransferError;
use super::seal::FrameKeys;
use super::{read_control, ConnError};

/// What the client learns about the server.
#[derive(Debug, Clone)]
pub struct ServerHello {
    pub name: String,
    pub host: [u8; 16],
}

fn lost(e: ConnError) -> TransferError {
    TransferError::ConnectionLost(format!("during handshake: {e}"))
}

/// The client side. A wrong token (on either side) is `Unauthorized`.
pub fn client<S: Read + Write>(
    s: &mut S,
    key: Option<&AuthKey>,
    name: &str,
) -> Result<(ServerHello, FrameKeys), TransferError> {
    let cn = auth::nonce().map_err(TransferError::io)?;
    let protection = key.map_or(0, |k| k.protection().code());
    s.write_all(&encode(&Msg::Hello { version: VERSION, nonce: cn, name: name.into(), protection }))
        .map_err(|e| lost(e.into()))?;
    let (sn, host, server_name, server_auth) = match read_control(s).map_err(lost)? {
        Msg::Challenge { version, auth, nonce, host, name } => {
            if version != VERSION {
                return Err(TransferError::Protocol(format!("peer speaks version {version}, we speak {VERSION}")));
            }
            (nonce, host, name, auth)
        }
        Msg::Refused { reason } => return Err(TransferError::Unauthorized(reason)),
        other => return Err(TransferError::Protocol(format!("expected a challenge, got {other:?}"))),
    };
    let mac = match (server_auth, key) {
        (true, Some(k)) => k.client_proof(&sn, &cn, name),
        (true, None) => return Err(TransferError::Unauthorized("the peer requires an auth_token".into())),
        (false, Some(_)) => {
            return Err(TransferError::Unauthorized("the peer has no auth_token, so it cannot prove itself".into()))
        }
        (false, None) => [0u8; 32],
    };
    s.write_all(&encode(&Msg::Proof { mac })).map_err(|e| lost(e.into()))?;
    match read_control(s) {
        Ok(Msg::Welcome { mac }) => {
            if let Some(k) = key {
                if !auth::mac_eq(&mac, &k.server_proof(&sn, &cn)) {
                    return Err(TransferError::Unauthorized("the peer's proof does not match our token".into()));
                }
            }
            let keys = key.map_or(FrameKeys::default(), |k| {
                let (c2s, s2c) = k.frame_keys(&sn, &cn);
                FrameKeys::keyed(c2s, s2c, k.protection())
            });
            Ok((ServerHello { name: server_name, host }, keys))
        }
        Ok(Msg::Refused { reason }) => Err(TransferError::Unauthorized(reason)),
        Ok(other) => Err(TransferError::Protocol(format!("expected welcome, got {other:?}"))),
        // The server closes right after refusing; a lost Refused frame reads as EOF.
        Err(ConnError::Eof) if server_auth => {
            Err(TransferError::Unauthorized("the peer closed the connection after our proof (wrong token?)".into()))
        }
        Err(e) => Err(lost(e)),
    }
}

/// Why the server side of a handshake failed.
#[derive(Debug)]
pub enum Refusal {
    /// Wrong proof: counted as an auth failure.
    BadToken,
    /// The client asked for another wire protection than this engine's (a
    /// configuration mistake on one side: worth a warning, not a debug line).
    Mismatch(String),
    /// Anything else (bad frames, version, I/O).
    Other(String),
}

/// The server side; returns the client's name (covered by its proof with a token; only
/// claimed without one) and the frame keys.
pub fn server<S: Read + Write>(
    s: &mut S,
    key: Option<&AuthKey>,
    host: [u8; 16],
    name: &str,
) -> Result<(String, FrameKeys), Refusal> {
    server_with(s, key, &HashMap::new(), host, name)
}

/// [`server`] where a client announcing a name of `peer_keys` must prove that name's
/// key instead of `key` (per-peer tokens).
pub fn server_with<S: Read + Write>(
    s: &mut S,
    key: Option<&AuthKey>,
    peer_keys: &HashMap<String, AuthKey>,
    host: [u8; 16],
    name: &str,
) -> Result<(String, FrameKeys), Refusal> {
    let other = |e: ConnError| Refusal::Other(e.to_string());
    let (cn, client_name, client_protection) = match read_control(s).map_err(other)? {
        Msg::Hello { version, nonce, name, protection } if version == VERSION => (nonce, name, protection),
        Msg::Hello { version, .. } => {
            let reason = format!("version {version} not supported (we speak {VERSION})");
            let _ = s.write_all(&encode(&Msg::Refused { reason: reason.clone() }));
            return Err(Refusal::Other(reason));
        }
        m => return Err(Refusal::Other(format!("expected hello, got {m:?}"))),
    };
    let key = peer_keys.get(&client_name).or(key);
    // A client without a token (0) is refused by the proof below, as before.
    if let Some(k) = key.filter(|k| client_protection != 0 && client_protection != k.protection().code()) {
        let asked = match client_protection {
            1 => "encrypted",
            2 => "integrity",
            _ => "an unknown protection",
        };
        // Sent without names: a refusal carries at most 255 bytes.
        let reason = format!(
            "wire_protection mismatch: the peer protects frames as {:?}, this engine asked for {asked:?}; \
             configure the same wire_protection on both engines",
            k.protection().as_str()
        );
        let _ = s.write_all(&encode(&Msg::Refused { reason: reason.clone() }));
        return Err(Refusal::Mismatch(format!("{reason} (client {client_name:?})")));
    }
    let sn = auth::nonce().map_err(|e| Refusal::Other(e.to_string()))?;
    let challenge = Msg::Challenge { version: VERSION, auth: key.is_some(), nonce: sn, host, name: name.into() };
    s.write_all(&encode(&challenge)).map_err(|e| other(e.into()))?;
    let mac = match read_control(s).map_err(other)? {
        Msg::Proof { mac } => mac,
        m => return Err(Refusal::Other(format!("expected proof, got {m:?}"))),
    };
    let (reply, keys) = match key {
        Some(k) if !auth::mac_eq(&mac, &k.client_proof(&sn, &cn, &client_name)) => {
            let _ = s.write_all(&encode(&Msg::Refused { reason: "wrong auth token".into() }));
            return Err(Refusal::BadToken);
        }
        Some(k) => {
            let (c2s, s2c) = k.frame_keys(&sn, &cn);
            (k.server_proof(&sn, &cn), FrameKeys::keyed(s2c, c2s, k.protection()))
        }
        None => ([0u8; 32], FrameKeys::default()),
    };
    s.write_all(&encode(&Msg::Welcome { mac: reply })).map_err(|e| other(e.into()))?;
    Ok((client_name, keys))
}
