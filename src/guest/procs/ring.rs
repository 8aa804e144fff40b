//! One output stream of a process, kept in memory: the last `cap` bytes, each byte at its
//! absolute offset in the stream, so a caller that reconnects with an offset gets exactly
//! what it missed (or, when that has been dropped already, what is left).

use std::collections::VecDeque;

/// The last `cap` bytes of a stream and how many came before them.
#[derive(Debug)]
pub struct Ring {
    /// Offset of `buf[0]` in the stream: the number of bytes dropped so far.
    start: u64,
    buf: VecDeque<u8>,
    cap: usize,
}

impl Ring {
    /// An empty stream keeping at most `cap` bytes (at least 1).
    pub fn new(cap: usize) -> Ring {
        Ring {
            start: 0,
            buf: VecDeque::new(),
            cap: cap.max(1),
        }
    }

    /// Bytes written to the stream so far: the offset the next byte gets.
    pub fn end(&self) -> u64 {
        self.start + self.buf.len() as u64
    }

    /// Appends `data`, dropping the oldest bytes beyond `cap` first (so the buffer never
    /// grows past `cap`).
    pub fn push(&mut self, data: &[u8]) {
        let data = if data.len() > self.cap {
            let skip = data.len() - self.cap;
            self.start += self.buf.len() as u64 + skip as u64;
            self.buf.clear();
            data.get(skip..).unwrap_or_default()
        } else {
            data
        };
        let over = (self.buf.len() + data.len()).saturating_sub(self.cap);
        if over > 0 {
            self.buf.drain(..over);
            self.start += over as u64;
        }
        self.buf.extend(data);
    }

    /// Up to `max` bytes from offset `pos` (or from the oldest byte kept, when `pos` has been
    /// dropped already), with the offset they start at; `None` when nothing is there yet.
    pub fn read(&self, pos: u64, max: usize) -> Option<(u64, Vec<u8>)> {
        let from = pos.max(self.start);
        if from >= self.end() || max == 0 {
            return None;
        }
        let i = (from - self.start) as usize;
        let n = (self.buf.len() - i).min(max);
        let (a, b) = self.buf.as_slices();
        let mut out = Vec::with_capacity(n);
        // The n bytes from i: first what the front slice holds from i, then the back slice's.
        let a_part = a.get(i..).unwrap_or_default();
        let a_take = a_part.get(..n).unwrap_or(a_part);
        let b_take = b
            .get(i.saturating_sub(a.len())..)
            .and_then(|b| b.get(..n - a_take.len()))
            .unwrap_or_default();
        out.extend_from_slice(a_take);
        out.extend_from_slice(b_take);
        Some((from, out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_tail_with_offsets() {
        let mut r = Ring::new(8);
        assert_eq!(r.read(0, 10), None);
        r.push(b"hello");
        assert_eq!(r.read(0, 10), Some((0, b"hello".to_vec())));
        assert_eq!(r.read(2, 2), Some((2, b"ll".to_vec())));
        r.push(b" world");
        assert_eq!(r.end(), 11);
        // "hel" has been dropped: a reader at 0 resumes at 3.
        assert_eq!(r.read(0, 100), Some((3, b"lo world".to_vec())));
        assert_eq!(r.read(11, 100), None);
        assert_eq!(r.read(20, 100), None);
        r.push(b"0123456789AB");
        assert_eq!(r.end(), 23);
        assert_eq!(r.read(0, 100), Some((15, b"456789AB".to_vec())));
        // Reads across the VecDeque's wrap point.
        let mut r = Ring::new(4);
        for c in b"abcdefghij" {
            r.push(&[*c]);
            let (off, got) = r.read(0, 4).expect("data");
            assert_eq!(off + got.len() as u64, r.end());
        }
        assert_eq!(r.read(7, 2), Some((7, b"hi".to_vec())));
    }
}
