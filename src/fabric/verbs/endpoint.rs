//! The endpoint record: what a rank tells every other rank so that they
//! can connect to it (its region; per device it opened, the GID, rkey and
//! MTU; per peer, rail and lane, the device and the QP facing that peer),
//! little-endian and versioned like `wire`'s records.

use super::{mtu_bytes, LANES};
use crate::codec::{Reader, Writer};
use crate::error::{Error, Result};

/// "ARXV" as a little-endian u32: the endpoint record's magic.
const ENDPOINT_MAGIC: u32 = 0x5658_5241;
/// Bump on any change to the endpoint record. 2: devices and per-peer
/// rails (routes) instead of one device per lane.
const ENDPOINT_VERSION: u16 = 2;
const HEADER_BYTES: usize = 4 + 2 + 2 + 4 + 4 + 8 + 8;
const DEVICE_BYTES: usize = 16 + 4 + 4 + 4;
const HOP_BYTES: usize = 2 + 4 + 4;

/// One device of a rank's endpoint record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct DeviceRecord {
    pub(super) gid: [u8; 16],
    pub(super) gid_index: u32,
    pub(super) rkey: u32,
    /// `ibv_mtu` code of the port's active MTU.
    pub(super) mtu: u32,
}

/// One lane of a rail to a peer: the device (index into
/// [`Endpoint::devices`]) and the QP facing that peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct HopRecord {
    pub(super) dev: u16,
    pub(super) qpn: u32,
    pub(super) psn: u32,
}

/// What a rank tells every other rank to connect to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Endpoint {
    pub(super) world: u32,
    pub(super) rank: u32,
    pub(super) addr: u64,
    pub(super) len: u64,
    pub(super) devices: Vec<DeviceRecord>,
    /// `peers[q][rail][lane]`; empty for itself and for peers reached
    /// through a relay.
    pub(super) peers: Vec<Vec<[HopRecord; LANES]>>,
}

impl Endpoint {
    fn encoded_len(&self) -> usize {
        HEADER_BYTES
            + 2
            + self.devices.len() * DEVICE_BYTES
            + self
                .peers
                .iter()
                .map(|r| 1 + r.len() * LANES * HOP_BYTES)
                .sum::<usize>()
    }

    /// Little-endian: magic, version, lanes per rail, world, rank, region
    /// address and length; the device count and per device GID, GID index,
    /// rkey, MTU code; then per rank the rail count and per rail and lane
    /// the device index, QPN and PSN.
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(self.encoded_len());
        w.u32(ENDPOINT_MAGIC)
            .u16(ENDPOINT_VERSION)
            .u16(LANES as u16)
            .u32(self.world)
            .u32(self.rank)
            .u64(self.addr)
            .u64(self.len)
            .u16(self.devices.len() as u16);
        for d in &self.devices {
            w.bytes(&d.gid).u32(d.gid_index).u32(d.rkey).u32(d.mtu);
        }
        for rails in &self.peers {
            w.u8(rails.len() as u8);
            for rail in rails {
                for h in rail {
                    w.u16(h.dev).u32(h.qpn).u32(h.psn);
                }
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
        if b.len() < HEADER_BYTES + 2 {
            return Err(bad(format!(
                "{} bytes, shorter than the {}-byte header (another arx build?)",
                b.len(),
                HEADER_BYTES + 2
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
        if addr == 0 || len != region_len as u64 {
            return Err(bad(format!(
                "region at {addr:#x} of {len} bytes, expected {region_len} bytes"
            )));
        }
        let ndev = r.u16() as usize;
        let mut devices = Vec::with_capacity(ndev.min(64));
        for i in 0..ndev {
            let gid: [u8; 16] = r.array();
            let (gid_index, rkey, mtu) = (r.u32(), r.u32(), r.u32());
            if r.overran() {
                return Err(bad(format!("{} bytes, truncated in device {i}", b.len())));
            }
            if gid == [0; 16] {
                return Err(bad(format!("device {i} has no GID")));
            }
            if mtu_bytes(mtu) == 0 {
                return Err(bad(format!("device {i} has MTU code {mtu}")));
            }
            devices.push(DeviceRecord {
                gid,
                gid_index,
                rkey,
                mtu,
            });
        }
        let mut peers = Vec::with_capacity(world);
        for q in 0..world {
            let n = r.array::<1>()[0] as usize;
            let mut rails = Vec::with_capacity(n);
            for rail in 0..n {
                let mut hops = [HopRecord {
                    dev: 0,
                    qpn: 0,
                    psn: 0,
                }; LANES];
                for (lane, h) in hops.iter_mut().enumerate() {
                    *h = HopRecord {
                        dev: r.u16(),
                        qpn: r.u32(),
                        psn: r.u32(),
                    };
                    if r.overran() {
                        return Err(bad(format!("{} bytes, truncated at rank {q}", b.len())));
                    }
                    if q == rank
                        || h.dev as usize >= devices.len()
                        || h.qpn == 0
                        || h.qpn > 0x00ff_ffff
                        || h.psn > 0x00ff_ffff
                    {
                        return Err(bad(format!(
                            "rail {rail} lane {lane} for rank {q}: device {}, QPN {:#x}, PSN {:#x}",
                            h.dev, h.qpn, h.psn
                        )));
                    }
                }
                rails.push(hops);
            }
            peers.push(rails);
        }
        if r.overran() {
            return Err(bad(format!("{} bytes, truncated", b.len())));
        }
        let out = Endpoint {
            world: w as u32,
            rank: rk as u32,
            addr,
            len,
            devices,
            peers,
        };
        if out.encoded_len() != b.len() {
            return Err(bad(format!(
                "{} bytes, expected {}",
                b.len(),
                out.encoded_len()
            )));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdma_sys::ibv_mtu;

    /// Rank `rank` of `world` with two devices, one rail to every peer but
    /// the last (relayed), two to rank 0 when it is not itself.
    fn endpoint(world: usize, rank: usize) -> Endpoint {
        Endpoint {
            world: world as u32,
            rank: rank as u32,
            addr: 0x7f00_0000_0000,
            len: 1 << 20,
            devices: (0..2)
                .map(|d| DeviceRecord {
                    gid: [d as u8 + 1; 16],
                    gid_index: 3,
                    rkey: 0x1234 + d as u32,
                    mtu: ibv_mtu::IBV_MTU_4096,
                })
                .collect(),
            peers: (0..world)
                .map(|q| {
                    let rails = match q {
                        _ if q == rank => 0,
                        0 => 2,
                        _ if q == world - 1 && world > 2 => 0,
                        _ => 1,
                    };
                    (0..rails)
                        .map(|r| {
                            [0, 1].map(|l| HopRecord {
                                dev: l as u16,
                                qpn: 0x100 + (q * 4 + r * 2 + l) as u32,
                                psn: 0x42,
                            })
                        })
                        .collect()
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
                assert_eq!(b.len(), e.encoded_len());
                assert_eq!(Endpoint::decode(rank, world, 1 << 20, &b).unwrap(), e);
            }
        }
    }

    /// The endpoint record's byte layout is the wire format between builds:
    /// pinned here.
    #[test]
    fn endpoint_layout_is_pinned() {
        let b: String = endpoint(3, 1)
            .encode()
            .iter()
            .map(|x| format!("{x:02x}"))
            .collect();
        let dev = |gid: &str, rkey: &str| [gid, "03000000", rkey, "05000000"].concat();
        let hop = |dev: &str, qpn: &str| [dev, qpn, "42000000"].concat();
        let want = [
            "41525856", // "ARXV"
            "0200",     // version
            "0200",     // lanes
            "03000000", // world
            "01000000", // rank
            "00000000007f0000",
            "0000100000000000",
            "0200", // devices
        ]
        .concat()
            + &dev(&"01".repeat(16), "34120000")
            + &dev(&"02".repeat(16), "35120000")
            // rank 0: two rails; itself: none; rank 2 (relayed): none.
            + "02"
            + &hop("0000", "00010000")
            + &hop("0100", "01010000")
            + &hop("0000", "02010000")
            + &hop("0100", "03010000")
            + "00"
            + "00";
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
        rejects(&good[..good.len() - 1], 2, "truncated");
        let mut long = good.clone();
        long.push(0);
        rejects(&long, 2, "expected");
        let mut b = good.clone();
        b[0] ^= 1;
        rejects(&b, 2, "magic");
        let mut b = good.clone();
        b[4] = 9;
        rejects(&b, 2, "version");
        let mut b = good.clone();
        b[6] = 1;
        rejects(&b, 2, "1 lanes");
        let mut e = endpoint(3, 2);
        e.devices[1].gid = [0; 16];
        rejects(&e.encode(), 2, "device 1 has no GID");
        let mut e = endpoint(3, 2);
        e.peers[1][0][1].qpn = 0;
        rejects(&e.encode(), 2, "rail 0 lane 1 for rank 1");
        let mut e = endpoint(3, 2);
        e.peers[1][0][0].dev = 7;
        rejects(&e.encode(), 2, "device 7");
        let mut e = endpoint(3, 2);
        e.len = 4096;
        rejects(&e.encode(), 2, "region");
        rejects(&endpoint(3, 1).encode(), 2, "expected rank 2");
    }
}
