//! Challenge-response authentication over a shared token (the token never travels).
//!
//! Key = BLAKE3 `derive_key("mooncake_rs transfer auth v1", token)`. The client proves
//! knowledge with `keyed_hash(key, "client" | server_nonce | client_nonce | name)`, where
//! `name` is the engine name it announced (so the name a server checks grants against
//! is covered by the proof: a relay cannot rename a connection); the server
//! answers with `keyed_hash(key, "server" | client_nonce | server_nonce)`, so both sides
//! are authenticated and a recorded proof is useless for another pair of nonces.
//! Every MAC also covers the key's [`WireProtection`]: two ends configured differently
//! never agree on a proof or a frame key (the handshake names the mismatch before
//! that), and a relay that rewrites the mode announced in a hello fails the proof.

use super::config::WireProtection;
use super::protocol::{MAC_LEN, NONCE_LEN};

const CONTEXT: &str = "mooncake_rs transfer auth v1";

/// The derived key of a token (`None`: no authentication), and how the sessions it
/// authenticates protect their frames.
#[derive(Clone)]
pub struct AuthKey {
    key: [u8; 32],
    protection: WireProtection,
}

impl std::fmt::Debug for AuthKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AuthKey(..)")
    }
}

impl AuthKey {
    /// The key of `token`, for sessions whose frames are encrypted (the default).
    pub fn from_token(token: &str) -> AuthKey {
        AuthKey { key: blake3::derive_key(CONTEXT, token.as_bytes()), protection: WireProtection::Encrypted }
    }

    /// The same key for sessions protected as `protection` says.
    pub fn with_protection(self, protection: WireProtection) -> AuthKey {
        AuthKey { protection, ..self }
    }

    pub fn protection(&self) -> WireProtection {
        self.protection
    }

    fn mac(&self, role: &[u8], a: &[u8; NONCE_LEN], b: &[u8; NONCE_LEN]) -> [u8; MAC_LEN] {
        self.mac_named(role, a, b, b"")
    }

    fn mac_named(&self, role: &[u8], a: &[u8; NONCE_LEN], b: &[u8; NONCE_LEN], name: &[u8]) -> [u8; MAC_LEN] {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        h.update(role);
        h.update(&[self.protection.code()]);
        h.update(a);
        h.update(b);
        // Length-prefixed, so no (nonce, name) pair reads as another.
        h.update(&(name.len() as u64).to_le_bytes());
        h.update(name);
        *h.finalize().as_bytes()
    }

    /// The client's proof, binding the engine name it announced in its hello.
    pub fn client_proof(
        &self,
        server_nonce: &[u8; NONCE_LEN],
        client_nonce: &[u8; NONCE_LEN],
        client_name: &str,
    ) -> [u8; MAC_LEN] {
        self.mac_named(b"client", server_nonce, client_nonce, client_name.as_bytes())
    }

    pub fn server_proof(&self, server_nonce: &[u8; NONCE_LEN], client_nonce: &[u8; NONCE_LEN]) -> [u8; MAC_LEN] {
        self.mac(b"server", client_nonce, server_nonce)
    }

    /// The frame keys of one connection, `(client -> server, server -> client)`: fresh
    /// for every pair of nonces, different per direction, and unlike the proofs never
    /// sent, so a relay that saw the handshake still cannot tag a frame.
    pub fn frame_keys(&self, server_nonce: &[u8; NONCE_LEN], client_nonce: &[u8; NONCE_LEN]) -> ([u8; 32], [u8; 32]) {
        (self.mac(b"frames c2s", server_nonce, client_nonce), self.mac(b"frames s2c", server_nonce, client_nonce))
    }
}

/// Constant-time equality (blake3's `Hash` compares in constant time).
pub fn mac_eq(a: &[u8; MAC_LEN], b: &[u8; MAC_LEN]) -> bool {
    blake3::Hash::from(*a) == blake3::Hash::from(*b)
}

/// A fresh random nonce (kernel CSPRNG).
pub fn nonce() -> std::io::Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    let mut filled = 0;
    while filled < NONCE_LEN {
        // SAFETY: writes at most NONCE_LEN - filled bytes into our own array.
        let r = unsafe { libc::getrandom(n[filled..].as_mut_ptr() as *mut libc::c_void, NONCE_LEN - filled, 0) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        filled += r as usize;
    }
    Ok(n)
}

/// A per-boot host identity: peers with equal ids share a kernel (and so, normally,
/// `/dev/shm`). Zero when unknown (then shm is never tried).
pub fn host_id() -> [u8; 16] {
    let mut id = [0u8; 16];
    if let Ok(s) = std::fs::read_to_string("/proc/sys/kernel/random/boot_id") {
        let h = blake3::hash(s.trim().as_bytes());
        id.copy_from_slice(&h.as_bytes()[..16]);
    }
    id
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_depend_on_token_nonces_and_role() {
        let k = AuthKey::from_token("secret");
        let (s, c) = (nonce().unwrap(), nonce().unwrap());
        assert_ne!(s, c);
        let p = k.client_proof(&s, &c, "prefill-0");
        assert!(mac_eq(&p, &AuthKey::from_token("secret").client_proof(&s, &c, "prefill-0")));
        assert!(!mac_eq(&p, &AuthKey::from_token("Secret").client_proof(&s, &c, "prefill-0")));
        assert!(!mac_eq(&p, &k.client_proof(&c, &s, "prefill-0")));
        // The announced name is part of the proof: a relay cannot rename a connection.
        assert!(!mac_eq(&p, &k.client_proof(&s, &c, "prefill-1")));
        assert!(!mac_eq(&p, &k.client_proof(&s, &c, "")));
        assert!(!mac_eq(&p, &k.server_proof(&s, &c)));
        assert!(!p.windows(6).any(|w| w == b"secret"));
        let (c2s, s2c) = k.frame_keys(&s, &c);
        assert_ne!(c2s, s2c);
        assert!(c2s != p && s2c != p && s2c != k.server_proof(&s, &c));
        assert_ne!(k.frame_keys(&s, &nonce().unwrap()).0, c2s);
        // Another wire protection: other proofs and other frame keys.
        let ki = k.clone().with_protection(WireProtection::Integrity);
        assert!(!mac_eq(&p, &ki.client_proof(&s, &c, "prefill-0")));
        let (ic2s, is2c) = ki.frame_keys(&s, &c);
        assert!(ic2s != c2s && is2c != s2c);
    }
}
