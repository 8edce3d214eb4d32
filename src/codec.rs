//! The little-endian writer and reader of arx's start-up records: the
//! settings and peer records of [`crate::wire`] and the Verbs endpoint
//! record. Each record keeps its own fixed, versioned layout; this module
//! only makes writing and reading it one call per field.
//!
//! A decoder checks its record's length before reading (to reject a short
//! record by name), so a read past the end is a decoder bug; it reads zeros
//! and marks the reader [`Reader::overran`] instead of panicking.

/// Appends fields, little-endian, to a byte vector.
pub(crate) struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    /// An empty record with room for `n` bytes.
    pub(crate) fn with_capacity(n: usize) -> Self {
        Writer {
            buf: Vec::with_capacity(n),
        }
    }

    pub(crate) fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }

    pub(crate) fn u16(&mut self, v: u16) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }

    pub(crate) fn u32(&mut self, v: u32) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }

    pub(crate) fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }

    pub(crate) fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(b);
        self
    }

    /// Zeros up to offset `at` (nothing if the record is already that long).
    pub(crate) fn pad_to(&mut self, at: usize) -> &mut Self {
        if self.buf.len() < at {
            self.buf.resize(at, 0);
        }
        self
    }

    pub(crate) fn finish(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.buf)
    }
}

/// Reads fields, little-endian, from the front of a record.
pub(crate) struct Reader<'a> {
    b: &'a [u8],
    at: usize,
    overran: bool,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(b: &'a [u8]) -> Self {
        Reader {
            b,
            at: 0,
            overran: false,
        }
    }

    /// The next `N` bytes (zeros past the end).
    pub(crate) fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0; N];
        if let Some(s) = self.take(N) {
            out.copy_from_slice(s);
        }
        out
    }

    pub(crate) fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.array())
    }

    pub(crate) fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.array())
    }

    pub(crate) fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.array())
    }

    /// The next `n` bytes (empty past the end).
    pub(crate) fn bytes(&mut self, n: usize) -> &'a [u8] {
        self.take(n).unwrap_or(&[])
    }

    /// Skips to offset `at` (a reserved or padding stretch); never backwards.
    pub(crate) fn skip_to(&mut self, at: usize) {
        if at > self.b.len() {
            self.overran = true;
        }
        self.at = self.at.max(at.min(self.b.len()));
    }

    /// Some read went past the end of the record.
    pub(crate) fn overran(&self) -> bool {
        self.overran
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        match end {
            Some(end) => {
                let s = &self.b[self.at..end];
                self.at = end;
                Some(s)
            }
            None => {
                self.overran = true;
                self.at = self.b.len();
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn fields_are_little_endian_in_order() {
        let b = Writer::with_capacity(0)
            .u8(0xa1)
            .u16(0x0302)
            .u32(0x0706_0504)
            .u64(0x0f0e_0d0c_0b0a_0908)
            .bytes(b"xy")
            .pad_to(20)
            .pad_to(3)
            .finish();
        assert_eq!(
            b,
            [0xa1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, b'x', b'y', 0, 0, 0]
        );
        let mut r = Reader::new(&b);
        assert_eq!(r.array(), [0xa1]);
        assert_eq!(r.u16(), 0x0302);
        assert_eq!(r.u32(), 0x0706_0504);
        assert_eq!(r.u64(), 0x0f0e_0d0c_0b0a_0908);
        assert_eq!(r.bytes(2), b"xy");
        r.skip_to(19);
        assert_eq!(r.array(), [0]);
        assert!(!r.overran());
    }

    #[test]
    fn random_records_round_trip() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0xc0dec);
        for _ in 0..200 {
            let (a, b, c, d): (u8, u16, u32, u64) = (rng.gen(), rng.gen(), rng.gen(), rng.gen());
            let g: [u8; 16] = rng.gen();
            let bytes = Writer::with_capacity(31)
                .u64(d)
                .bytes(&g)
                .u32(c)
                .u16(b)
                .u8(a)
                .finish();
            assert_eq!(bytes.len(), 31);
            let mut r = Reader::new(&bytes);
            assert_eq!(
                (r.u64(), r.array::<16>(), r.u32(), r.u16(), r.array()),
                (d, g, c, b, [a])
            );
            assert!(!r.overran());
        }
    }

    #[test]
    fn reading_past_the_end_reads_zeros_and_is_recorded() {
        let b = [1, 2, 3];
        let mut r = Reader::new(&b);
        assert_eq!(r.u16(), 0x0201);
        assert!(!r.overran());
        assert_eq!(r.u32(), 0);
        assert!(r.overran());
        assert_eq!((r.array(), r.bytes(1)), ([0], &[][..]));
        let mut r = Reader::new(&b);
        assert_eq!(r.bytes(usize::MAX), &[][..]);
        assert!(r.overran());
        let mut r = Reader::new(&b);
        r.skip_to(4);
        assert!(r.overran());
    }
}
