//! What a sandbox may reach, as boxes over (destination address, IP protocol, destination
//! port), and their disjoint form: the kernel's concatenated-range sets refuse overlapping
//! elements, while rules overlap all the time (`*` and `203.0.113.0/24:tcp/80`).
//!
//! [`disjoint`] keeps exactly the same points (property-tested) with no two boxes sharing one.

use opendsec_common::egress::{Protocol, Rule};

/// Inclusive ranges on each axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Box3 {
    pub addr: (u32, u32),
    pub proto: (u8, u8),
    pub port: (u16, u16),
}

impl Box3 {
    pub fn contains(&self, addr: u32, proto: u8, port: u16) -> bool {
        (self.addr.0..=self.addr.1).contains(&addr)
            && (self.proto.0..=self.proto.1).contains(&proto)
            && (self.port.0..=self.port.1).contains(&port)
    }

    /// The box of `rule`'s protocol and ports over the addresses `first..=last`.
    pub fn of(first: u32, last: u32, protocol: Protocol, ports: (u16, u16)) -> Box3 {
        Box3 { addr: (first, last), proto: protocol.numbers(), port: ports }
    }

    /// The protocol-and-port part of a rule over `first..=last`.
    pub fn of_rule(first: u32, last: u32, r: &Rule) -> Box3 {
        Box3::of(first, last, r.protocol, r.ports)
    }
}

/// Cuts points `[lo, hi]` of each range into elementary intervals: the sorted bounds where
/// the set of covering ranges can change.
fn cuts<T: Copy + Into<u64>>(ranges: impl Iterator<Item = (T, T)>) -> Vec<u64> {
    let mut v: Vec<u64> = ranges.flat_map(|(a, b)| [a.into(), b.into() + 1]).collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// Protocol and port ranges over one address interval.
type Plane = Vec<((u8, u8), (u16, u16))>;
/// An interval of the axis being swept (inclusive, in u64 so the end can be one past the top)
/// and what lies over it.
type Run<T> = Option<(u64, u64, T)>;

/// Merges port ranges into disjoint, sorted, non-adjacent ones.
fn merge(mut r: Vec<(u16, u16)>) -> Vec<(u16, u16)> {
    r.sort_unstable();
    let mut out: Vec<(u16, u16)> = Vec::with_capacity(r.len());
    for (a, b) in r {
        match out.last_mut() {
            Some(last) if u32::from(a) <= u32::from(last.1) + 1 => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

/// The protocol and port boxes over one elementary address interval, disjoint and sorted.
fn plane(boxes: &[&Box3]) -> Plane {
    let cut = cuts(boxes.iter().map(|b| b.proto));
    let mut out: Plane = Vec::new();
    let mut prev: Run<Vec<(u16, u16)>> = None;
    for w in cut.windows(2) {
        let (lo, hi) = (w[0], w[1] - 1);
        let ports = merge(
            boxes.iter().filter(|b| u64::from(b.proto.0) <= lo && hi <= u64::from(b.proto.1)).map(|b| b.port).collect(),
        );
        // Neighbouring protocol intervals with the same ports become one.
        match &mut prev {
            Some((_, phi, p)) if *phi + 1 == lo && *p == ports => *phi = hi,
            _ => {
                if let Some((plo, phi, p)) = prev.take() {
                    out.extend(p.into_iter().map(|pr| ((plo as u8, phi as u8), pr)));
                }
                prev = Some((lo, hi, ports));
            }
        }
    }
    if let Some((plo, phi, p)) = prev {
        out.extend(p.into_iter().map(|pr| ((plo as u8, phi as u8), pr)));
    }
    out
}

/// The same points as `boxes`, in boxes no two of which overlap.
pub fn disjoint(boxes: &[Box3]) -> Vec<Box3> {
    let cut = cuts(boxes.iter().map(|b| b.addr));
    let mut out = Vec::new();
    let mut prev: Run<Plane> = None;
    let flush = |p: Run<Plane>, out: &mut Vec<Box3>| {
        if let Some((lo, hi, planes)) = p {
            out.extend(planes.into_iter().map(|(proto, port)| Box3 { addr: (lo as u32, hi as u32), proto, port }));
        }
    };
    for w in cut.windows(2) {
        let (lo, hi) = (w[0], w[1] - 1);
        let covering: Vec<&Box3> =
            boxes.iter().filter(|b| u64::from(b.addr.0) <= lo && hi <= u64::from(b.addr.1)).collect();
        let p = plane(&covering);
        match &mut prev {
            Some((_, phi, pp)) if *phi + 1 == lo && *pp == p => *phi = hi,
            _ => {
                flush(prev.take(), &mut out);
                prev = Some((lo, hi, p));
            }
        }
    }
    flush(prev, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_box() -> impl Strategy<Value = Box3> {
        // Small axes so that random boxes overlap often.
        (0u32..40, 0u32..40, 0u8..8, 0u8..8, 0u16..30, 0u16..30).prop_map(|(a, b, p, q, s, t)| Box3 {
            addr: (a.min(b), a.max(b)),
            proto: (p.min(q), p.max(q)),
            port: (s.min(t), s.max(t)),
        })
    }

    proptest! {
        #[test]
        fn disjoint_keeps_every_point_and_no_overlap(boxes in proptest::collection::vec(arb_box(), 0..8)) {
            let d = disjoint(&boxes);
            for addr in 0..41u32 {
                for proto in 0..9u8 {
                    for port in 0..31u16 {
                        let want = boxes.iter().any(|b| b.contains(addr, proto, port));
                        let n = d.iter().filter(|b| b.contains(addr, proto, port)).count();
                        prop_assert_eq!(n, usize::from(want), "point {} {} {}", addr, proto, port);
                    }
                }
            }
        }
    }

    #[test]
    fn the_usual_overlap_becomes_one_box() {
        let any = Box3 { addr: (0, u32::MAX), proto: (0, 255), port: (0, u16::MAX) };
        let web = Box3 { addr: (100, 200), proto: (6, 6), port: (80, 80) };
        assert_eq!(disjoint(&[any, web]), vec![any]);
        assert_eq!(disjoint(&[]), vec![]);
        // Full axes survive the u64 arithmetic at the top end.
        assert_eq!(disjoint(&[any]), vec![any]);
    }
}
