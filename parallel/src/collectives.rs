//! The collectives sequence-parallel execution needs, on any logical group: all-gather,
//! all-to-all, reduce-scatter, send/recv and a barrier ([`Collectives`]). Each moves the
//! payload in chunks ([`Endpoint::chunk_for`]): a rank stages chunk `c` for its peers and then
//! takes their chunk `c`, so staging one chunk overlaps the peers' copies of the last.
//! Shapes are checked first; a wrong one fails naming the group before any message moves.
use crate::group::Group;
use crate::shm::Endpoint;
use crate::Error;

/// Group-free collectives on a logical group (GF-DiT §4). Every member calls the same one
/// with matching shapes; a rank's calls run in its one submission order.
pub trait Collectives {
    /// `out` = every member's `input`, in group order (`out.len() == size * input.len()`).
    fn all_gather(&mut self, group: &Group, input: &[f32], out: &mut [f32]) -> Result<(), Error>;
    /// `input` holds `size` equal parts, part `j` for member `j`; `out` gets part
    /// `position` of every member, in group order.
    fn all_to_all(&mut self, group: &Group, input: &[f32], out: &mut [f32]) -> Result<(), Error>;
    /// `input` holds `size` equal parts; `out` = the sum over members of their part
    /// `position`, added in group order (the same float result on every rank layout).
    fn reduce_scatter(
        &mut self,
        group: &Group,
        input: &[f32],
        out: &mut [f32],
    ) -> Result<(), Error>;
    /// Send `data` to the member at position `to`. Returns once the last chunk is posted;
    /// with more than two chunks in flight it waits for the receiver to take them, so two
    /// members must not both send a long payload to each other before receiving (order
    /// them, or exchange with `all_to_all`).
    fn send(&mut self, group: &Group, to: usize, data: &[f32]) -> Result<(), Error>;
    /// Receive `out.len()` floats from the member at position `from`.
    fn recv(&mut self, group: &Group, from: usize, out: &mut [f32]) -> Result<(), Error>;
    /// Send `data` to the member at position `to` while receiving `out.len()` floats from
    /// the one at `from`, chunk by chunk (a ring's step: every member shifts at once, and
    /// none waits on a send the other end has not begun to take).
    fn shift(
        &mut self,
        group: &Group,
        to: usize,
        from: usize,
        data: &[f32],
        out: &mut [f32],
    ) -> Result<(), Error>;
    /// Return once every member has entered it.
    fn barrier(&mut self, group: &Group) -> Result<(), Error>;
}

fn shape(group: &Group, what: String) -> Error {
    Error::Shape {
        group: group.id,
        what,
    }
}

/// `[a, b)` of chunk `c` of `n` floats in chunks of `len`.
fn chunk_range(c: usize, len: usize, n: usize) -> (usize, usize) {
    (c * len, ((c + 1) * len).min(n))
}

/// Copy a received chunk into `dst`, which must be as long.
fn land(group: &Group, dst: &mut [f32], data: &[f32]) -> Result<(), Error> {
    if data.len() != dst.len() {
        return Err(shape(
            group,
            format!(
                "a peer sent {} floats where {} were expected",
                data.len(),
                dst.len()
            ),
        ));
    }
    dst.copy_from_slice(data);
    Ok(())
}

impl Endpoint {
    fn peers_of(group: &Group) -> Vec<usize> {
        group.peers().map(|(_, r)| r).collect()
    }
}

impl Collectives for Endpoint {
    fn all_gather(&mut self, group: &Group, input: &[f32], out: &mut [f32]) -> Result<(), Error> {
        let (n, k) = (input.len(), group.size());
        if out.len() != n * k {
            return Err(shape(
                group,
                format!(
                    "all_gather of {n} floats over {k} ranks needs {} out, got {}",
                    n * k,
                    out.len()
                ),
            ));
        }
        self.check_members(group.id, &group.ranks)?;
        out[group.position * n..][..n].copy_from_slice(input);
        let peers = Self::peers_of(group);
        let len = self.chunk_for(group.size());
        for c in 0..n.div_ceil(len) {
            let (a, b) = chunk_range(c, len, n);
            self.post(group.id, &peers, &input[a..b])?;
            for (j, peer) in group.peers() {
                let dst = &mut out[j * n + a..j * n + b];
                self.take_from(group.id, peer, |data| land(group, dst, data))?;
            }
        }
        Ok(())
    }

    fn all_to_all(&mut self, group: &Group, input: &[f32], out: &mut [f32]) -> Result<(), Error> {
        let k = group.size();
        if !input.len().is_multiple_of(k) || out.len() != input.len() {
            return Err(shape(
                group,
                format!(
                    "all_to_all over {k} ranks needs equal parts and as much out as in; got {} in, {} out",
                    input.len(),
                    out.len()
                ),
            ));
        }
        self.check_members(group.id, &group.ranks)?;
        let m = input.len() / k;
        let me = group.position;
        out[me * m..][..m].copy_from_slice(&input[me * m..][..m]);
        let len = self.chunk_for(group.size());
        for c in 0..m.div_ceil(len) {
            let (a, b) = chunk_range(c, len, m);
            for (j, peer) in group.peers() {
                self.post(group.id, &[peer], &input[j * m + a..j * m + b])?;
            }
            for (i, peer) in group.peers() {
                let dst = &mut out[i * m + a..i * m + b];
                self.take_from(group.id, peer, |data| land(group, dst, data))?;
            }
        }
        Ok(())
    }

    fn reduce_scatter(
        &mut self,
        group: &Group,
        input: &[f32],
        out: &mut [f32],
    ) -> Result<(), Error> {
        let k = group.size();
        if !input.len().is_multiple_of(k) || out.len() * k != input.len() {
            return Err(shape(
                group,
                format!(
                    "reduce_scatter over {k} ranks of {} floats needs {} out, got {}",
                    input.len(),
                    input.len() / k.max(1),
                    out.len()
                ),
            ));
        }
        self.check_members(group.id, &group.ranks)?;
        let m = out.len();
        let me = group.position;
        let len = self.chunk_for(group.size());
        for c in 0..m.div_ceil(len) {
            let (a, b) = chunk_range(c, len, m);
            for (j, peer) in group.peers() {
                self.post(group.id, &[peer], &input[j * m + a..j * m + b])?;
            }
            let dst = &mut out[a..b];
            dst.fill(0.0);
            for (i, &rank) in group.ranks.iter().enumerate() {
                if i == me {
                    for (d, s) in dst.iter_mut().zip(&input[me * m + a..me * m + b]) {
                        *d += s;
                    }
                    continue;
                }
                self.take_from(group.id, rank, |data| {
                    if data.len() != dst.len() {
                        return Err(shape(
                            group,
                            format!(
                                "a peer sent {} floats where {} were expected",
                                data.len(),
                                dst.len()
                            ),
                        ));
                    }
                    for (d, s) in dst.iter_mut().zip(data) {
                        *d += s;
                    }
                    Ok(())
                })?;
            }
        }
        Ok(())
    }

    fn send(&mut self, group: &Group, to: usize, data: &[f32]) -> Result<(), Error> {
        let peer = member(group, to)?;
        self.check_members(group.id, &[peer])?;
        let len = self.chunk_for(group.size());
        for c in 0..data.len().div_ceil(len) {
            let (a, b) = chunk_range(c, len, data.len());
            self.post(group.id, &[peer], &data[a..b])?;
        }
        Ok(())
    }

    fn recv(&mut self, group: &Group, from: usize, out: &mut [f32]) -> Result<(), Error> {
        let peer = member(group, from)?;
        self.check_members(group.id, &[peer])?;
        let len = self.chunk_for(group.size());
        let n = out.len();
        for c in 0..n.div_ceil(len) {
            let (a, b) = chunk_range(c, len, n);
            let dst = &mut out[a..b];
            self.take_from(group.id, peer, |data| land(group, dst, data))?;
        }
        Ok(())
    }

    fn shift(
        &mut self,
        group: &Group,
        to: usize,
        from: usize,
        data: &[f32],
        out: &mut [f32],
    ) -> Result<(), Error> {
        let (next, prev) = (member(group, to)?, member(group, from)?);
        self.check_members(group.id, &[next, prev])?;
        let len = self.chunk_for(group.size());
        let (sent, taken) = (data.len(), out.len());
        for c in 0..sent.max(taken).div_ceil(len) {
            if c * len < sent {
                let (a, b) = chunk_range(c, len, sent);
                self.post(group.id, &[next], &data[a..b])?;
            }
            if c * len < taken {
                let (a, b) = chunk_range(c, len, taken);
                let dst = &mut out[a..b];
                self.take_from(group.id, prev, |d| land(group, dst, d))?;
            }
        }
        Ok(())
    }

    fn barrier(&mut self, group: &Group) -> Result<(), Error> {
        self.check_members(group.id, &group.ranks)?;
        let peers = Self::peers_of(group);
        self.post(group.id, &peers, &[])?;
        for peer in peers {
            self.take_from(group.id, peer, |_| Ok(()))?;
        }
        Ok(())
    }
}

/// The world rank at `position` of `group`, other than the caller.
fn member(group: &Group, position: usize) -> Result<usize, Error> {
    match group.ranks.get(position) {
        Some(&rank) if position != group.position => Ok(rank),
        _ => Err(shape(
            group,
            format!(
                "position {position} is not another member of a group of {}",
                group.size()
            ),
        )),
    }
}
