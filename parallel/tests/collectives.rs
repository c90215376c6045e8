//! Group-free collectives on a CPU world: each collective against the same sums and copies done
//! serially, on group sizes 1-4, sizes that are not multiples of the chunk, a staging buffer
//! small enough that the ring wraps and slots are reused hundreds of times, and overlapping
//! groups interleaved; an ordering violation, a departed rank and a silent one each fail with
//! an error naming it instead of hanging or mixing data.
use std::time::Duration;

use diffmesh_parallel::{Collectives, Error, Group, RankConfig, Ranks};

fn ranks(n: usize, buffer: usize, chunk: usize, timeout: Duration) -> Ranks {
    Ranks::start(RankConfig {
        ranks: n,
        buffer_floats: buffer,
        chunk_floats: chunk,
        timeout,
    })
    .expect("rank threads")
}

/// Deterministic values for `(rank, round, i)`.
fn data(rank: usize, round: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((rank * 7919 + round * 104_729 + i * 31) % 1000) as f32 / 7.0 - 60.0)
        .collect()
}

/// What member `position` of `members` gets from each collective, computed serially.
fn gathered(members: &[usize], round: usize, n: usize) -> Vec<f32> {
    members.iter().flat_map(|&r| data(r, round, n)).collect()
}

fn exchanged(members: &[usize], round: usize, m: usize, position: usize) -> Vec<f32> {
    let k = members.len();
    members
        .iter()
        .flat_map(|&r| data(r, round, k * m)[position * m..][..m].to_vec())
        .collect()
}

fn reduced(members: &[usize], round: usize, m: usize, position: usize) -> Vec<f32> {
    let k = members.len();
    let mut out = vec![0.0f32; m];
    for &r in members {
        for (o, v) in out
            .iter_mut()
            .zip(&data(r, round, k * m)[position * m..][..m])
        {
            *o += v;
        }
    }
    out
}

/// One round of every collective on `members`, run by each member; true when all matched.
fn round(ranks: &Ranks, id: u64, members: Vec<usize>, round_no: usize, n: usize) {
    let world = ranks.len();
    let pending: Vec<_> = members
        .iter()
        .map(|&me| {
            let members = members.clone();
            ranks.submit(me, move |ep| -> Result<(), Error> {
                let g = Group::new(id, &members, me, world)?;
                let (k, pos) = (g.size(), g.position);
                let mut out = vec![0.0; n * k];
                ep.all_gather(&g, &data(me, round_no, n), &mut out)?;
                assert_eq!(
                    out,
                    gathered(&members, round_no, n),
                    "all_gather {members:?}"
                );
                let input = data(me, round_no, n * k);
                ep.all_to_all(&g, &input, &mut out)?;
                assert_eq!(out, exchanged(&members, round_no, n, pos), "all_to_all");
                let mut part = vec![0.0; n];
                ep.reduce_scatter(&g, &input, &mut part)?;
                assert_eq!(part, reduced(&members, round_no, n, pos), "reduce_scatter");
                if k > 1 {
                    // Around the ring: send to the next, take from the one before.
                    let next = (pos + 1) % k;
                    let before = (pos + k - 1) % k;
                    // Position 0 sends first, every other takes first: a pipeline, since a
                    // send waits for its receiver once two chunks are in flight.
                    if pos == 0 {
                        ep.send(&g, next, &data(me, round_no, n))?;
                        ep.recv(&g, before, &mut part)?;
                    } else {
                        ep.recv(&g, before, &mut part)?;
                        ep.send(&g, next, &data(me, round_no, n))?;
                    }
                    assert_eq!(part, data(members[before], round_no, n), "send/recv");
                }
                if k > 1 {
                    // A ring step: everyone shifts to the next at once.
                    let (next, before) = ((pos + 1) % k, (pos + k - 1) % k);
                    let mut got = vec![0.0; n + 3];
                    ep.shift(&g, next, before, &data(me, round_no + 1, n + 3), &mut got)?;
                    assert_eq!(got, data(members[before], round_no + 1, n + 3), "shift");
                }
                ep.barrier(&g)
            })
        })
        .collect();
    for (me, rx) in members.iter().zip(pending) {
        match rx.recv() {
            Ok(result) => result.unwrap_or_else(|e| panic!("rank {me}: {e}")),
            Err(_) => panic!("rank {me} panicked (a wrong result above)"),
        }
    }
}

#[test]
fn every_collective_matches_the_serial_result() {
    let ranks = ranks(4, 1 << 16, 1 << 10, Duration::from_secs(20));
    let mut id = 0;
    for members in [vec![0], vec![1, 3], vec![2, 0, 1], vec![3, 2, 1, 0]] {
        // Below, at and past the chunk, and odd.
        for n in [1, 7, 1024, 2500] {
            id += 1;
            round(&ranks, id, members.clone(), id as usize, n);
        }
    }
}

#[test]
fn overlapping_groups_interleave_without_mixing_signals() {
    // A 512-float buffer and 13-float chunks: the ring wraps and each edge's two slots are
    // reused many times within one collective.
    let ranks = ranks(4, 512, 13, Duration::from_secs(20));
    let groups: [&[usize]; 5] = [&[0, 1, 2, 3], &[0, 1], &[2, 3], &[1, 2], &[3, 0, 2]];
    // Rounds are submitted to every member before the next round: each rank's queue holds
    // its groups' collectives in one order, and pairs shared by two groups see them in the
    // same order at both ends (pairwise-consistent), while disjoint groups run at once.
    let world = ranks.len();
    let mut pending = Vec::new();
    for r in 0..40 {
        let members = groups[r % groups.len()].to_vec();
        let n = 5 + (r * 37) % 300;
        for &me in &members {
            let members = members.clone();
            pending.push((
                me,
                r,
                ranks.submit(me, move |ep| -> Result<(), Error> {
                    let g = Group::new(1000 + r as u64, &members, me, world)?;
                    let mut out = vec![0.0; n * g.size()];
                    ep.all_gather(&g, &data(me, r, n), &mut out)?;
                    assert_eq!(out, gathered(&members, r, n), "round {r} {members:?}");
                    let input = data(me, r, n * g.size());
                    ep.all_to_all(&g, &input, &mut out)?;
                    assert_eq!(out, exchanged(&members, r, n, g.position), "round {r}");
                    Ok(())
                }),
            ));
        }
    }
    for (me, r, rx) in pending {
        match rx.recv() {
            Ok(result) => result.unwrap_or_else(|e| panic!("rank {me}, round {r}: {e}")),
            Err(_) => panic!("rank {me} panicked in round {r}"),
        }
    }
}

#[test]
fn ranks_that_disagree_on_order_are_told_so() {
    let ranks = ranks(2, 4096, 64, Duration::from_secs(5));
    // Groups 1 and 2 both hold ranks 0 and 1; rank 0 runs 1 then 2, rank 1 the reverse.
    let run = |first: u64, second: u64, me: usize| {
        ranks.submit(me, move |ep| -> Result<(), Error> {
            let mut out = vec![0.0; 8];
            for id in [first, second] {
                let g = Group::new(id, &[0, 1], me, 2)?;
                ep.all_gather(&g, &[me as f32; 4], &mut out)?;
            }
            Ok(())
        })
    };
    let (r0, r1) = (run(1, 2, 0), run(2, 1, 1));
    for rx in [r0, r1] {
        let err = rx.recv().unwrap().unwrap_err();
        assert!(matches!(err, Error::OutOfOrder { .. }), "{err}");
        assert!(err.to_string().contains("different orders"), "{err}");
    }
}

#[test]
fn a_departed_rank_fails_the_collectives_that_need_it() {
    let mut ranks = ranks(3, 4096, 64, Duration::from_secs(30));
    // Rank 0 waits in an all-gather with rank 1, which then stops instead of joining.
    let waiting = ranks.submit(0, |ep| {
        let g = Group::new(5, &[0, 1], 0, 3).unwrap();
        let mut out = vec![0.0; 4];
        ep.all_gather(&g, &[1.0, 2.0], &mut out)
    });
    std::thread::sleep(Duration::from_millis(50));
    ranks.stop(1);
    let err = waiting.recv().unwrap().unwrap_err();
    assert_eq!(err, Error::PeerLeft { group: 5, rank: 1 });
    // A later collective on a group with the departed rank fails at once; others still work.
    let at_once = ranks.submit(2, |ep| {
        let g = Group::new(6, &[2, 1], 2, 3).unwrap();
        ep.barrier(&g)
    });
    assert_eq!(
        at_once.recv().unwrap().unwrap_err(),
        Error::PeerLeft { group: 6, rank: 1 }
    );
    let alive: Vec<_> = [0usize, 2]
        .into_iter()
        .map(|me| {
            ranks.submit(me, move |ep| {
                let g = Group::new(7, &[0, 2], me, 3).unwrap();
                let mut out = vec![0.0; 2];
                ep.all_gather(&g, &[me as f32], &mut out).map(|_| out)
            })
        })
        .collect();
    for rx in alive {
        assert_eq!(rx.recv().unwrap().unwrap(), vec![0.0, 2.0]);
    }
}

#[test]
fn a_silent_rank_times_out() {
    let ranks = ranks(2, 4096, 64, Duration::from_millis(300));
    let _busy = ranks.submit(1, |_| std::thread::sleep(Duration::from_secs(3)));
    let started = std::time::Instant::now();
    let err = ranks
        .submit(0, |ep| {
            let g = Group::new(9, &[0, 1], 0, 2).unwrap();
            ep.barrier(&g)
        })
        .recv()
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Timeout {
                group: 9,
                rank: 1,
                ..
            }
        ),
        "{err}"
    );
    // Well before the silent rank wakes (3 s), with room for a loaded machine.
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn shapes_are_checked_before_anything_moves() {
    let ranks = ranks(2, 4096, 64, Duration::from_secs(5));
    let err = ranks
        .submit(0, |ep| {
            let g = Group::new(3, &[0, 1], 0, 2).unwrap();
            let mut out = vec![0.0; 5];
            ep.all_gather(&g, &[1.0, 2.0], &mut out)
        })
        .recv()
        .unwrap()
        .unwrap_err();
    assert!(err.to_string().contains("needs 4 out, got 5"), "{err}");
    let err = ranks
        .submit(0, |ep| {
            let g = Group::new(3, &[0, 1], 0, 2).unwrap();
            ep.send(&g, 0, &[1.0])
        })
        .recv()
        .unwrap()
        .unwrap_err();
    assert!(
        err.to_string().contains("position 0 is not another member"),
        "{err}"
    );
}
