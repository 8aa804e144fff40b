//! Content digests (`sha256:<64 hex>`) and readers that compute one over what passes through
//! them, so that every blob and every uncompressed layer is checked as it streams
//! (docs/images.md "The store").

use std::fmt;
use std::io::{self, Read};

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

/// A content digest: `sha256:` and 64 lower-case hex digits. Only sha256 is accepted (it is
/// what OCI images use); anything else is refused when parsed.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Digest(String);

/// Why a digest string was refused (for `invalid`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("digest {shown} is not sha256: and 64 lower-case hex digits")]
pub struct BadDigest {
    shown: String,
}

const PREFIX: &str = "sha256:";

impl Digest {
    /// Parses `sha256:<64 lower-case hex>`. Errors: [`BadDigest`] for anything else.
    pub fn parse(s: &str) -> Result<Digest, BadDigest> {
        let ok = s.strip_prefix(PREFIX).is_some_and(|h| {
            h.len() == 64
                && h.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        });
        if ok {
            Ok(Digest(s.to_string()))
        } else {
            Err(BadDigest {
                shown: crate::types::names::shown(s),
            })
        }
    }

    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Digest {
        Digest::from_hasher(Sha256::new_with_prefix(bytes))
    }

    fn from_hasher(h: Sha256) -> Digest {
        Digest(format!("{PREFIX}{}", hex::encode(h.finalize())))
    }

    /// The 64 hex digits alone: the name of a layer's directory in the store (a `:` would
    /// break overlayfs's `lowerdir=` list).
    pub fn hex(&self) -> &str {
        self.0.get(PREFIX.len()..).unwrap_or_default()
    }

    /// The whole `sha256:...` string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for Digest {
    type Error = BadDigest;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        Digest::parse(&s)
    }
}

impl From<Digest> for String {
    fn from(d: Digest) -> String {
        d.0
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A reader that hashes and counts every byte read through it.
pub struct DigestReader<R> {
    inner: R,
    hasher: Sha256,
    bytes: u64,
}

impl<R: Read> DigestReader<R> {
    pub fn new(inner: R) -> Self {
        DigestReader {
            inner,
            hasher: Sha256::new(),
            bytes: 0,
        }
    }

    /// Reads what is left to the end (so the digest covers the whole stream) and returns the
    /// digest, the byte count and the inner reader.
    pub fn finish(mut self) -> io::Result<(Digest, u64, R)> {
        io::copy(&mut self, &mut io::sink())?;
        Ok((Digest::from_hasher(self.hasher), self.bytes, self.inner))
    }

    /// The bytes read so far.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl<R: Read> Read for DigestReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if let Some(got) = buf.get(..n) {
            self.hasher.update(got);
        }
        self.bytes += n as u64;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_only_sha256_with_64_lower_hex() {
        let good = format!("sha256:{}", "a".repeat(64));
        assert_eq!(Digest::parse(&good).unwrap().hex(), "a".repeat(64));
        for bad in [
            "",
            "sha256:",
            &format!("sha256:{}", "A".repeat(64)),
            &format!("sha256:{}", "a".repeat(63)),
            &format!("sha512:{}", "a".repeat(64)),
            &format!("sha256:{}/", "a".repeat(63)),
        ] {
            assert!(Digest::parse(bad).is_err(), "{bad}");
        }
        let json = serde_json::to_string(&Digest::parse(&good).unwrap()).unwrap();
        assert_eq!(json, format!("{good:?}"));
        assert!(serde_json::from_str::<Digest>("\"sha256:00\"").is_err());
    }

    #[test]
    fn the_reader_hashes_the_whole_stream() {
        let data = b"hello world".repeat(1000);
        let mut r = DigestReader::new(&data[..]);
        let mut head = [0u8; 10];
        r.read_exact(&mut head).unwrap();
        let (d, n, _) = r.finish().unwrap();
        assert_eq!((d, n), (Digest::of(&data), data.len() as u64));
        // The empty string's sha256, as every OCI tool knows it.
        assert_eq!(
            Digest::of(b"").as_str(),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}
