//! The FlashPS mask-aware edit forward split over the ranks of a logical group (issue 47
//! point 3: mask-aware edits keep working under sequence parallelism).
//!
//! Every member holds the whole batch's inputs and its template caches. Each computes a
//! contiguous share of every request's masked tokens (`ceil(M / R)` each; the last shares
//! shorter or empty) and, as in [`super::sequence_parallel`], all text tokens. Attention is
//! where the shares meet: a query needs every fresh key, so each block all-gathers the
//! members' fresh image keys (rotated) and values, one collective per request and block,
//! and each member attends its own queries over the text, every masked token's fresh K/V and
//! the cached K/V of the unmasked tokens, read from its own copy of the cache. Only the
//! masked tokens travel (M of N rows), so the exchange shrinks with the mask as the compute
//! does. A last all-gather gives every member each request's whole `[M, out]` velocity,
//! equal to [`FluxTransformer::forward_masked`]'s up to float rounding.
//!
//! Ulysses' head exchange would move the cached rows as well; gathering only the fresh ones
//! keeps the cache local to each member and works for any head count.
use super::masked::{MaskedRequest, Spread, SpreadKeys};
use super::sequence_parallel::all_gather;
use super::FluxTransformer;
use crate::error::Result;
use diffmesh_parallel::{Collectives, Group};
use tch::Tensor;

/// Each request's (start, length) share for one member and the padded share length.
struct Shares {
    mine: Vec<(i64, i64)>,
    /// `ceil(M / R)`: every member's share padded to it for the all-gathers.
    padded: Vec<i64>,
    /// M of each request.
    masked: Vec<i64>,
}

impl Shares {
    fn new(requests: &[MaskedRequest], group: &Group) -> Self {
        let ranks = group.size() as i64;
        let position = group.position as i64;
        let mut shares = Self {
            mine: Vec::with_capacity(requests.len()),
            padded: Vec::with_capacity(requests.len()),
            masked: Vec::with_capacity(requests.len()),
        };
        for q in requests {
            // `prepare` checks the index; a malformed one gives an empty share here and its
            // error there.
            let m = q.token_index.size().first().copied().unwrap_or(0).max(0);
            let padded = (m + ranks - 1) / ranks;
            let start = (position * padded).min(m);
            shares.mine.push((start, (m - start).clamp(0, padded)));
            shares.padded.push(padded);
            shares.masked.push(m);
        }
        shares
    }

    /// Every member's `rows` `[L, ...]` (this member's share of request `r`) in token order:
    /// padded to the share length, gathered, the padding (all at the end) dropped.
    fn gather_rows<C: Collectives>(
        &self,
        comm: &mut C,
        group: &Group,
        r: usize,
        rows: &Tensor,
    ) -> Result<Tensor> {
        let (padded, m) = (self.padded[r], self.masked[r]);
        let mut size = rows.size();
        let missing = padded - size[0];
        let rows = if missing > 0 {
            size[0] = missing;
            let zeros = Tensor::f_zeros(size.as_slice(), (rows.kind(), rows.device()))?;
            Tensor::f_cat(&[rows, &zeros], 0)?
        } else {
            rows.shallow_clone()
        };
        let all = all_gather(comm, group, &rows)?; // [R, padded, ...]
        let mut flat = all.size();
        flat.remove(0);
        flat[0] = group.size() as i64 * padded;
        Ok(all.f_reshape(flat.as_slice())?.f_narrow(0, 0, m)?)
    }
}

/// The exchange of fresh keys and values between the members.
struct GatherKeys<'a, C> {
    comm: &'a mut C,
    group: &'a Group,
    shares: &'a Shares,
}

impl<C: Collectives> SpreadKeys for GatherKeys<'_, C> {
    fn gather(&mut self, request: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        // Keys and values in one message: one collective a request and block.
        let d = k.size()[2];
        let kv = Tensor::f_cat(&[k, v], 2)?;
        let all = self
            .shares
            .gather_rows(self.comm, self.group, request, &kv)?;
        Ok((all.f_narrow(2, 0, d)?, all.f_narrow(2, d, d)?))
    }
}

impl FluxTransformer {
    /// [`Self::forward_masked`] computed by every member of `group` for its share of each
    /// request's masked tokens; each member returns every request's whole velocity
    /// `[M_i, out]`. Every member calls it with the same requests (and caches of equal content).
    pub fn forward_masked_sequence_parallel<C: Collectives>(
        &self,
        requests: &[MaskedRequest],
        comm: &mut C,
        group: &Group,
    ) -> Result<Vec<Tensor>> {
        let shares = Shares::new(requests, group);
        let mut keys = GatherKeys {
            comm: &mut *comm,
            group,
            shares: &shares,
        };
        let mine = self.forward_masked_spread(
            requests,
            0,
            Some(Spread {
                shards: &shares.mine,
                keys: &mut keys,
            }),
        )?;
        mine.iter()
            .enumerate()
            .map(|(r, out)| shares.gather_rows(comm, group, r, out))
            .collect()
    }
}
