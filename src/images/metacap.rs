//! A reader between a layer's tar bytes and the tar reader that bounds the tar's metadata
//! entries (docs/images.md "Untrusted layers"). The tar reader loads a GNU long name, a long
//! link target or a PAX header whole into memory, at whatever size its header claims; a
//! compressed layer can claim gigabytes of zeros in a few kilobytes. This reader follows the
//! archive's block structure as the bytes go by, exactly as the tar reader does, and fails the
//! read at a metadata header over its cap, before the tar reader allocates anything for it.

use std::io::{self, Read};

const BLOCK: usize = 512;
/// The most a GNU long name or long link target may hold: a path is at most 4096 bytes.
pub const MAX_LONG_NAME: u64 = 64 << 10;
/// The most a PAX header may hold (extended attributes are its largest records).
pub const MAX_PAX: u64 = 1 << 20;

/// Wraps `R`, the uncompressed tar stream. Errors: `InvalidData` naming the entry at a
/// metadata header over its cap, at a GNU sparse entry (whose extra header blocks this reader
/// does not follow; layers are refused them anyway), or at a header whose size field is not a
/// number. After an error every later read fails the same way.
pub struct MetaCap<R> {
    inner: R,
    header: [u8; BLOCK],
    filled: usize,
    /// Bytes of entry data (padding included) before the next header block.
    data_left: u64,
    /// A local PAX header's data being collected, and how many bytes it has.
    pax: Option<(Vec<u8>, usize)>,
    /// The size a PAX header gave the next file entry, which overrides its header's.
    pax_size: Option<u64>,
    failed: Option<String>,
}

impl<R: Read> MetaCap<R> {
    pub fn new(inner: R) -> MetaCap<R> {
        MetaCap {
            inner,
            header: [0; BLOCK],
            filled: 0,
            data_left: 0,
            pax: None,
            pax_size: None,
            failed: None,
        }
    }

    fn observe(&mut self, mut b: &[u8]) -> Result<(), String> {
        while !b.is_empty() {
            if self.data_left > 0 {
                let k = b
                    .len()
                    .min(usize::try_from(self.data_left).unwrap_or(usize::MAX));
                let (now, rest) = b.split_at(k);
                if let Some((buf, want)) = &mut self.pax {
                    let take = k.min(want.saturating_sub(buf.len()));
                    buf.extend_from_slice(now.get(..take).unwrap_or_default());
                    if buf.len() == *want {
                        self.pax_size = pax_size(buf);
                        self.pax = None;
                    }
                }
                self.data_left -= k as u64;
                b = rest;
            } else {
                let k = b.len().min(BLOCK - self.filled);
                let (now, rest) = b.split_at(k);
                if let Some(dst) = self.header.get_mut(self.filled..self.filled + k) {
                    dst.copy_from_slice(now);
                }
                self.filled += k;
                b = rest;
                if self.filled == BLOCK {
                    self.filled = 0;
                    self.next_header()?;
                }
            }
        }
        Ok(())
    }

    /// Takes in one whole header block: where the next header lies, and whether this one is
    /// over its cap. Mirrors tar 0.4's `next_entry`: the extension types count only in a
    /// ustar or GNU header, and a PAX size applies to the next header that is not one.
    fn next_header(&mut self) -> Result<(), String> {
        if self.header.iter().all(|b| *b == 0) {
            return Ok(());
        }
        let h = tar::Header::from_byte_slice(&self.header);
        let name = String::from_utf8_lossy(h.path_bytes().as_ref()).into_owned();
        let size = h.entry_size().map_err(|e| format!("entry {name:?}: {e}"))?;
        let kind = h.entry_type();
        let recognized = h.as_ustar().is_some() || h.as_gnu().is_some();
        let long = kind.is_gnu_longname() || kind.is_gnu_longlink();
        let local_pax = kind.is_pax_local_extensions();
        let cap = if long { MAX_LONG_NAME } else { MAX_PAX };
        if (long || local_pax || kind.is_pax_global_extensions()) && size > cap {
            return Err(format!(
                "entry {name:?}: a metadata entry of {size} bytes, more than the {cap} allowed"
            ));
        }
        if kind.is_gnu_sparse() {
            return Err(format!("entry {name:?}: GNU sparse files are not allowed"));
        }
        let is_extension = long || local_pax || kind.is_pax_global_extensions();
        let size = if is_extension {
            size
        } else {
            self.pax_size.unwrap_or(size)
        };
        // The tar reader keeps a pending PAX header only across the extension headers it
        // consumes itself; any header it returns drops it.
        if !(recognized && (long || local_pax)) {
            self.pax_size = None;
        }
        if recognized && local_pax {
            // `size` is at most MAX_PAX here.
            let want = usize::try_from(size).unwrap_or(0);
            if want > 0 {
                self.pax = Some((Vec::with_capacity(want), want));
            }
        }
        self.data_left = size
            .checked_add(BLOCK as u64 - 1)
            .map(|s| s & !(BLOCK as u64 - 1))
            .ok_or_else(|| format!("entry {name:?}: size overflow"))?;
        Ok(())
    }
}

/// The `size` record of a PAX header, as tar 0.4 reads it: the first one, when every record
/// before it parses and its value is a number.
fn pax_size(data: &[u8]) -> Option<u64> {
    for ext in tar::PaxExtensions::new(data) {
        let ext = ext.ok()?;
        if ext.key() != Ok("size") {
            continue;
        }
        return ext.value().ok()?.parse().ok();
    }
    None
}

impl<R: Read> Read for MetaCap<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if let Some(why) = &self.failed {
            return Err(io::Error::new(io::ErrorKind::InvalidData, why.clone()));
        }
        let n = self.inner.read(buf)?;
        if let Err(why) = self.observe(buf.get(..n).unwrap_or_default()) {
            self.failed = Some(why.clone());
            return Err(io::Error::new(io::ErrorKind::InvalidData, why));
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn archive(entries: &[(&str, &[u8])]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (name, data) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_entry_type(tar::EntryType::Regular);
            b.append_data(&mut h, name, *data).expect("append");
        }
        b.into_inner().expect("finish")
    }

    fn names(bytes: &[u8], chunk: usize) -> io::Result<Vec<String>> {
        struct Chunked<'a>(&'a [u8], usize);
        impl Read for Chunked<'_> {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                let n = buf.len().min(self.1).min(self.0.len());
                buf[..n].copy_from_slice(&self.0[..n]);
                self.0 = &self.0[n..];
                Ok(n)
            }
        }
        let mut a = tar::Archive::new(MetaCap::new(Chunked(bytes, chunk)));
        let mut out = Vec::new();
        for e in a.entries()? {
            let mut e = e?;
            out.push(String::from_utf8_lossy(&e.path_bytes()).into_owned());
            io::copy(&mut e, &mut io::sink())?;
        }
        Ok(out)
    }

    #[test]
    fn follows_long_names_and_data_in_any_chunking() {
        let long = format!("{}/f", "d".repeat(300));
        let bytes = archive(&[("a", b"1234"), (&long, &[7u8; 1000]), ("b", b"")]);
        for chunk in [1, 7, 512, 513, 1 << 20] {
            assert_eq!(names(&bytes, chunk).unwrap(), ["a", long.as_str(), "b"]);
        }
    }

    #[test]
    fn follows_a_pax_size_override() {
        // A PAX `size` record gives the next entry's real size; the header says 0.
        let mut b = tar::Builder::new(Vec::new());
        let rec = b"12 size=600\n";
        let mut x = tar::Header::new_ustar();
        x.set_path("PaxHeaders/big").unwrap();
        x.set_entry_type(tar::EntryType::XHeader);
        x.set_size(rec.len() as u64);
        x.set_cksum();
        b.append(&x, &rec[..]).unwrap();
        let mut h = tar::Header::new_ustar();
        h.set_size(0);
        h.set_mode(0o644);
        h.set_path("big").unwrap();
        h.set_cksum();
        b.append(&h, &[0u8; 0][..]).unwrap();
        let mut bytes = b.into_inner().unwrap();
        // The 600 data bytes (padded), then another entry and the end.
        let end = bytes.len() - 1024;
        bytes.truncate(end);
        bytes.extend_from_slice(&[9u8; 1024]);
        bytes.extend_from_slice(&archive(&[("after", b"x")]));
        assert_eq!(names(&bytes, 100).unwrap(), ["big", "after"]);
    }

    #[test]
    fn refuses_oversized_metadata_before_reading_it() {
        let mut h = tar::Header::new_gnu();
        h.set_path("././@LongLink").unwrap();
        h.set_entry_type(tar::EntryType::GNULongName);
        h.set_size(8 << 30);
        h.set_cksum();
        let mut bytes = h.as_bytes().to_vec();
        bytes.extend_from_slice(&[b'a'; 4096]);
        let err = names(&bytes, 1 << 20).unwrap_err();
        assert!(err.to_string().contains("more than"), "{err}");
        let mut h = tar::Header::new_ustar();
        h.set_path("PaxHeaders/x").unwrap();
        h.set_entry_type(tar::EntryType::XHeader);
        h.set_size(MAX_PAX + 1);
        h.set_cksum();
        let err = names(h.as_bytes(), 512).unwrap_err();
        assert!(err.to_string().contains("PaxHeaders/x"), "{err}");
    }
}
