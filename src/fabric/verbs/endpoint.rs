//! The endpoint record: what a rank tells every other rank so that they
//! can connect to it (its region, and per lane its GID, rkey, MTU and the
//! QP facing each rank), little-endian and versioned like `wire`'s records.

use super::{mtu_bytes, LANES};
use crate::codec::{Reader, Writer};
use crate::error::{Error, Result};

/// "ARXV" as a little-endian u32: the endpoint record's magic.
const ENDPOINT_MAGIC: u32 = 0x5658_5241;
/// Bump on any change to the endpoint record.
const ENDPOINT_VERSION: u16 = 1;
const HEADER_BYTES: usize = 4 + 2 + 2 + 4 + 4 + 8 + 8;
const LANE_FIXED_BYTES: usize = 16 + 4 + 4 + 4 + 4;

/// One lane of a rank's endpoint record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct LaneRecord {
    pub(super) gid: [u8; 16],
    pub(super) gid_index: u32,
    pub(super) rkey: u32,
    /// `ibv_mtu` code of the port's active MTU.
    pub(super) mtu: u32,
    /// (QPN, PSN) of the QP facing each rank (0, 0 for itself).
    pub(super) qps: Vec<(u32, u32)>,
}

/// What a rank tells every other rank to connect to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Endpoint {
    pub(super) world: u32,
    pub(super) rank: u32,
    pub(super) addr: u64,
    pub(super) len: u64,
    pub(super) lanes: Vec<LaneRecord>,
}

impl Endpoint {
    fn encoded_len(world: usize, lanes: usize) -> usize {
        HEADER_BYTES + lanes * (LANE_FIXED_BYTES + world * 8)
    }

    /// Little-endian: magic, version, lane count, world, rank, region
    /// address and length, then per lane GID, GID index, rkey, MTU code, a
    /// reserved word and (QPN, PSN) per rank.
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(Self::encoded_len(self.world as usize, self.lanes.len()));
        w.u32(ENDPOINT_MAGIC)
            .u16(ENDPOINT_VERSION)
            .u16(self.lanes.len() as u16)
            .u32(self.world)
            .u32(self.rank)
            .u64(self.addr)
            .u64(self.len);
        for l in &self.lanes {
            w.bytes(&l.gid)
                .u32(l.gid_index)
                .u32(l.rkey)
                .u32(l.mtu)
                .u32(0);
            for &(qpn, psn) in &l.qps {
                w.u32(qpn).u32(psn);
            }
        }
        w.finish()
    }

    /// Decodes `rank`'s record and checks it against what this rank expects;
    /// every error names that rank.
    pub(super) fn decode(rank: usize, world: usize, region_len: usize, b: &[u8]) -> Result<Self> {
        let bad = |what: String| Error::PeerFailed {
            peer: rank,
            reason: format!("its verbs endpoint record is unusable: {what}"),
        };
        if b.len() < HEADER_BYTES {
            return Err(bad(format!(
                "{} bytes, shorter than the {HEADER_BYTES}-byte header (another arx build?)",
                b.len()
            )));
        }
        let mut r = Reader::new(b);
        let (magic, version, lanes) = (r.u32(), r.u16(), r.u16() as usize);
        let (w, rk) = (r.u32() as usize, r.u32() as usize);
        let (addr, len) = (r.u64(), r.u64());
        if magic != ENDPOINT_MAGIC {
            return Err(bad(format!("magic {magic:#x}")));
        }
        if version != ENDPOINT_VERSION {
            return Err(bad(format!(
                "version {version}, this build speaks {ENDPOINT_VERSION}"
            )));
        }
        if lanes != LANES {
            return Err(bad(format!("{lanes} lanes announced, {LANES} needed")));
        }
        if w != world || rk != rank {
            return Err(bad(format!(
                "it says rank {rk} of {w}, expected rank {rank} of {world}"
            )));
        }
        let want = Self::encoded_len(world, lanes);
        if b.len() != want {
            return Err(bad(format!("{} bytes, expected {want}", b.len())));
        }
        if addr == 0 || len != region_len as u64 {
            return Err(bad(format!(
                "region at {addr:#x} of {len} bytes, expected {region_len} bytes"
            )));
        }
        let mut out = Endpoint {
            world: w as u32,
            rank: rk as u32,
            addr,
            len,
            lanes: Vec::with_capacity(lanes),
        };
        for lane in 0..lanes {
            let gid: [u8; 16] = r.array();
            let (gid_index, rkey, mtu, _reserved) = (r.u32(), r.u32(), r.u32(), r.u32());
            if gid == [0; 16] {
                return Err(bad(format!("lane {lane} has no GID")));
            }
            if mtu_bytes(mtu) == 0 {
                return Err(bad(format!("lane {lane} has MTU code {mtu}")));
            }
            let mut l = LaneRecord {
                gid,
                gid_index,
                rkey,
                mtu,
                qps: Vec::with_capacity(world),
            };
            for q in 0..world {
                let (qpn, psn) = (r.u32(), r.u32());
                if q != rank && (qpn == 0 || qpn > 0x00ff_ffff || psn > 0x00ff_ffff) {
                    return Err(bad(format!(
                        "lane {lane} QP for rank {q}: QPN {qpn:#x}, PSN {psn:#x}"
                    )));
                }
                l.qps.push((qpn, psn));
            }
            out.lanes.push(l);
        }
        if r.overran() {
            // Unreachable: the length was checked against the layout above.
            return Err(bad(format!("{} bytes, shorter than its layout", b.len())));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdma_sys::ibv_mtu;

    fn endpoint(world: usize, rank: usize) -> Endpoint {
        Endpoint {
            world: world as u32,
            rank: rank as u32,
            addr: 0x7f00_0000_0000,
            len: 1 << 20,
            lanes: (0..LANES)
                .map(|l| LaneRecord {
                    gid: [l as u8 + 1; 16],
                    gid_index: 3,
                    rkey: 0x1234 + l as u32,
                    mtu: ibv_mtu::IBV_MTU_4096,
                    qps: (0..world)
                        .map(|q| {
                            if q == rank {
                                (0, 0)
                            } else {
                                (0x100 + q as u32, 0x42)
                            }
                        })
                        .collect(),
                })
                .collect(),
        }
    }

    #[test]
    fn endpoint_round_trips() {
        for world in [2, 3, 16] {
            for rank in 0..world {
                let e = endpoint(world, rank);
                let b = e.encode();
                assert_eq!(b.len(), Endpoint::encoded_len(world, LANES));
                assert_eq!(Endpoint::decode(rank, world, 1 << 20, &b).unwrap(), e);
            }
        }
    }

    /// The endpoint record's byte layout is the wire format between builds:
    /// pinned here (the hex came from the encoder before the shared codec).
    #[test]
    fn endpoint_layout_is_pinned() {
        let b: String = endpoint(3, 1)
            .encode()
            .iter()
            .map(|x| format!("{x:02x}"))
            .collect();
        let lane = |gid: &str, rkey: &str| {
            [gid, "03000000", rkey, "05000000", "00000000"].concat()
                // (QPN, PSN) facing ranks 0, 1 (itself), 2.
                + "0001000042000000" + "0000000000000000" + "0201000042000000"
        };
        let want = [
            "41525856", // "ARXV"
            "0100",     // version
            "0200",     // lanes
            "03000000", // world
            "01000000", // rank
            "00000000007f0000",
            "0000100000000000",
        ]
        .concat()
            + &lane(&"01".repeat(16), "34120000")
            + &lane(&"02".repeat(16), "35120000");
        assert_eq!(b, want);
    }

    fn rejects(b: &[u8], rank: usize, needle: &str) {
        match Endpoint::decode(rank, 3, 1 << 20, b) {
            Err(Error::PeerFailed { peer, reason }) => {
                assert_eq!(peer, rank);
                assert!(reason.contains(needle), "{reason} lacks {needle}");
            }
            other => panic!("expected a rejection naming {needle}, got {other:?}"),
        }
    }

    #[test]
    fn bad_endpoints_name_the_rank() {
        let good = endpoint(3, 2).encode();
        rejects(&good[..10], 2, "shorter");
        rejects(&good[..good.len() - 1], 2, "bytes, expected");
        let mut b = good.clone();
        b[0] ^= 1;
        rejects(&b, 2, "magic");
        let mut b = good.clone();
        b[4] = 9;
        rejects(&b, 2, "version");
        let mut e = endpoint(3, 2);
        e.lanes.pop();
        rejects(&e.encode(), 2, "1 lanes");
        let mut e = endpoint(3, 2);
        e.lanes[1].gid = [0; 16];
        rejects(&e.encode(), 2, "lane 1 has no GID");
        let mut e = endpoint(3, 2);
        e.lanes[0].qps[1] = (0, 0);
        rejects(&e.encode(), 2, "QP for rank 1");
        let mut e = endpoint(3, 2);
        e.len = 4096;
        rejects(&e.encode(), 2, "region");
        rejects(&endpoint(3, 1).encode(), 2, "expected rank 2");
    }
}
