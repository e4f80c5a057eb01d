//! Tokens `dsk.<id>.<secret>`: making them (proposer side), hashing their secrets and comparing
//! hashes in constant time.
//!
//! Only `HMAC-SHA256(hash_key, secret)` is ever stored or put in a command; the secret itself
//! exists only in the answer to `CreateToken` and in the admin's config. Nothing here logs.

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

/// Length of generated token ids ([a-z0-9]).
pub const ID_LEN: usize = 16;
/// Length of generated secrets ([A-Za-z0-9]).
pub const SECRET_LEN: usize = 43;
/// Length of the HMAC key made at bootstrap.
pub const HASH_KEY_LEN: usize = 32;
/// Longest token string looked at; anything longer is malformed without further work.
pub const MAX_TOKEN_LEN: usize = 200;

/// Splits a token into (id, secret), or `None` when it does not have the shape.
pub fn parse(token: &str) -> Option<(&str, &str)> {
    if token.len() > MAX_TOKEN_LEN {
        return None;
    }
    opendsec_common::config::parse_token_shape(token)
}

/// Whether `id` has the shape of a token id (generated ids are 16 chars; the admin's may be up
/// to 32, as `parse_token_shape` allows).
pub fn valid_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 32 && id.bytes().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
}

pub fn format(id: &str, secret: &str) -> String {
    format!("dsk.{id}.{secret}")
}

/// A new random token id: 16 characters of [a-z0-9].
pub fn new_id() -> String {
    use rand::RngExt;
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..ID_LEN).map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char).collect()
}

/// A new random id for a sandbox's token: [`opendsec_common::config::SANDBOX_TOKEN_ID_LEN`]
/// characters of [a-z0-9], so that a caller can tell such a token from others by its shape.
pub fn new_sandbox_token_id() -> String {
    use rand::RngExt;
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..opendsec_common::config::SANDBOX_TOKEN_ID_LEN)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect()
}

/// A new random secret: 43 characters of [A-Za-z0-9] (about 256 bits).
pub fn new_secret() -> String {
    opendsec_common::grpc::random_secret(SECRET_LEN)
}

/// The secret of a token IAM mints for a sandbox, derived from the hash key and the token's
/// id (HMAC-SHA256 under a label of its own, as 43 characters of [A-Za-z0-9]), so that every
/// member gives the same token again for the same sandbox (E2B's `connect` answers the token
/// its `create` did) while only its hash is stored.
pub fn derive_secret(key: &[u8], token_id: &str) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut out = String::with_capacity(SECRET_LEN);
    let mut counter = 0u8;
    while out.len() < SECRET_LEN {
        let block = hash_secret(key, &format!("opendsec sandbox token\0{token_id}\0{counter}"));
        // 62 * 4 = 248 <= 255: bytes below it map evenly onto the alphabet.
        for b in block.into_iter().filter(|b| *b < 248) {
            if out.len() == SECRET_LEN {
                break;
            }
            out.push(ALPHABET[(b % 62) as usize] as char);
        }
        counter = counter.wrapping_add(1);
    }
    out
}

/// A new HMAC key for token secrets, as hex.
pub fn new_hash_key() -> String {
    let bytes: [u8; HASH_KEY_LEN] = rand::random();
    to_hex(&bytes)
}

/// HMAC-SHA256(key, secret).
pub fn hash_secret(key: &[u8], secret: &str) -> [u8; 32] {
    // HMAC takes keys of any length, so this cannot fail; the fallback keeps it panic-free.
    let mut mac = match <Hmac<Sha256> as KeyInit>::new_from_slice(key) {
        Ok(m) => m,
        Err(_) => return [0; 32],
    };
    mac.update(secret.as_bytes());
    let out = mac.finalize().into_bytes();
    let mut h = [0u8; 32];
    h.copy_from_slice(&out[..32]);
    h
}

/// HMAC-SHA256(key, secret) as lowercase hex (the stored form).
pub fn hash_secret_hex(key: &[u8], secret: &str) -> String {
    to_hex(&hash_secret(key, secret))
}

/// Whether `secret` hashes to the stored hex hash, compared in constant time.
pub fn verify(key: &[u8], secret: &str, stored_hex: &str) -> bool {
    let Some(stored) = from_hex(stored_hex) else { return false };
    let got = hash_secret(key, secret);
    stored.len() == got.len() && bool::from(stored.as_slice().ct_eq(&got))
}

pub use opendsec_common::hex::{from_hex, to_hex};

/// Whether `s` is the hex of exactly 32 bytes (a hash key or a secret hash).
pub fn is_hex32(s: &str) -> bool {
    s.len() == 64 && from_hex(s).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_tokens_parse_and_verify() {
        let key = from_hex(&new_hash_key()).unwrap();
        let (id, secret) = (new_id(), new_secret());
        let t = format(&id, &secret);
        assert_eq!(parse(&t), Some((id.as_str(), secret.as_str())));
        let h = hash_secret_hex(&key, &secret);
        assert!(verify(&key, &secret, &h));
        assert!(!verify(&key, "other-secret-0123456789", &h));
        assert!(!verify(&key, &secret, "zz"));
        assert!(valid_id(&id) && id.len() == ID_LEN && secret.len() == SECRET_LEN);
    }

    #[test]
    fn derived_secrets_are_stable_per_key_and_id() {
        let (k1, k2) = (from_hex(&new_hash_key()).unwrap(), from_hex(&new_hash_key()).unwrap());
        let s = derive_secret(&k1, "abc");
        assert_eq!(s.len(), SECRET_LEN);
        assert!(s.bytes().all(|b| b.is_ascii_alphanumeric()));
        assert_eq!(s, derive_secret(&k1, "abc"));
        assert_ne!(s, derive_secret(&k1, "abd"));
        assert_ne!(s, derive_secret(&k2, "abc"));
        assert!(parse(&format("abc", &s)).is_some());
    }

    #[test]
    fn hmac_matches_a_known_vector() {
        // RFC 4231 test case 2.
        let h = hash_secret(b"Jefe", "what do ya want for nothing?");
        assert_eq!(to_hex(&h), "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
    }

    #[test]
    fn hex_round_trip() {
        assert_eq!(from_hex(&to_hex(&[0, 1, 0xab, 0xff])).unwrap(), vec![0, 1, 0xab, 0xff]);
        assert!(from_hex("abc").is_none());
        assert!(from_hex("AB").is_none());
        assert!(!is_hex32("00"));
    }
}
