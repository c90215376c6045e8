//! Elastic-parallelism policies (GF-DiT §5.4) behind one trait: at every decision point the
//! runtime (the simulator here; a node's ranks live) hands a policy the tasks whose next
//! denoising step is ready (requests waiting to start, and running requests at a step
//! boundary, whose ranks are free again) and the free ranks; the policy answers which of them
//! run their next step now and on how many ranks. Groups cost nothing to form
//! (`diffmesh-parallel`), so only counts matter here.
use super::cost::{Class, StepCost};

/// A request whose next step is ready.
#[derive(Debug, Clone, PartialEq)]
pub struct Ready {
    pub id: usize,
    pub class: usize,
    pub arrival: f64,
    pub deadline: f64,
    pub steps_left: u32,
    /// Ranks of its last step (0: not started).
    pub degree: u32,
}

/// What a policy sees besides the ready tasks.
#[derive(Debug, Clone, Copy)]
pub struct View<'a> {
    pub now: f64,
    /// Ranks free now (those of the ready tasks included).
    pub free: u32,
    pub classes: &'a [Class],
    pub cost: &'a StepCost,
}

impl View<'_> {
    fn remaining_s(&self, task: &Ready, k: u32) -> f64 {
        f64::from(task.steps_left) * self.cost.step_s(&self.classes[task.class], k)
    }
}

/// Decides, at each decision point, which ready tasks step now and on how many ranks.
pub trait ElasticPolicy: Send {
    fn name(&self) -> String;
    /// `(task id, ranks)` for the tasks to step now; together at most `view.free` ranks.
    fn assign(&mut self, view: &View, ready: &[Ready]) -> Vec<(usize, u32)>;
}

/// The largest power of two not above `n` (n >= 1).
fn pow2_floor(n: u32) -> u32 {
    1 << (31 - n.max(1).leading_zeros())
}

/// Static SP-k, FCFS (the fixed-parallelism baseline): every request runs all its steps on
/// `k` ranks; the running keep theirs, the waiting start in arrival order while `k` are
/// free, and none overtakes the first that does not fit.
pub struct StaticSp(pub u32);

impl ElasticPolicy for StaticSp {
    fn name(&self) -> String {
        format!("static-sp{}", self.0)
    }

    fn assign(&mut self, view: &View, ready: &[Ready]) -> Vec<(usize, u32)> {
        let k = self.0.min(view.free.max(1));
        let mut order: Vec<&Ready> = ready.iter().collect();
        order.sort_by(|a, b| {
            (a.degree == 0, a.arrival)
                .partial_cmp(&(b.degree == 0, b.arrival))
                .expect("finite")
        });
        let mut free = view.free;
        let mut out = Vec::new();
        for task in order {
            if free < k {
                break;
            }
            out.push((task.id, k));
            free -= k;
        }
        out
    }
}

/// The order an elastic policy serves ready tasks in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    Fcfs,
    /// Shortest remaining trajectory work first.
    Srtf,
    /// Earliest deadline first, with best-fit degrees.
    Edf,
}

/// FCFS / SRTF with an elastic degree (each task, in order, takes the degree that runs its
/// step fastest within the ranks left after one for every task behind it), or GF-DiT's EDF
/// with best fit (the smallest degree predicted to meet the deadline; the fastest when none
/// does).
pub struct Elastic(pub Order);

impl Elastic {
    fn sorted<'a>(&self, view: &View, ready: &'a [Ready]) -> Vec<&'a Ready> {
        let mut order: Vec<&Ready> = ready.iter().collect();
        let key = |t: &Ready| match self.0 {
            Order::Fcfs => t.arrival,
            Order::Srtf => view.remaining_s(t, 1),
            Order::Edf => t.deadline,
        };
        order.sort_by(|a, b| key(a).total_cmp(&key(b)));
        order
    }
}

impl ElasticPolicy for Elastic {
    fn name(&self) -> String {
        match self.0 {
            Order::Fcfs => "fcfs-elastic",
            Order::Srtf => "srtf-elastic",
            Order::Edf => "edf-bestfit",
        }
        .into()
    }

    fn assign(&mut self, view: &View, ready: &[Ready]) -> Vec<(usize, u32)> {
        let order = self.sorted(view, ready);
        let mut free = view.free;
        let mut out = Vec::new();
        for (i, task) in order.iter().enumerate() {
            if free == 0 {
                break;
            }
            let behind = (order.len() - i - 1) as u32;
            let room = pow2_floor(free.saturating_sub(behind).max(1));
            let class = &view.classes[task.class];
            let fastest = view.cost.best_degree(class, room);
            let k = match self.0 {
                Order::Edf => {
                    let slack = task.deadline - view.now;
                    let mut k = 1;
                    while k < fastest && view.remaining_s(task, k) > slack {
                        k *= 2;
                    }
                    k
                }
                _ => fastest,
            };
            out.push((task.id, k));
            free -= k;
        }
        out
    }
}

/// This project's SLO-aware elastic policy. EDF over the tasks that can still meet their
/// deadline with every free rank; each takes the smallest degree that meets it with 10%
/// margin, so running requests with slack shrink at their step boundaries and urgent ones get
/// the ranks. Tasks that can no longer make it are not rescued with large groups (what makes
/// EDF collapse under overload): they run on one rank each with what is left, the oldest
/// first. Ranks still free then go to the feasible tasks, earliest deadline first, up to the
/// degree that runs them fastest, to build slack.
pub struct SloElastic;

impl ElasticPolicy for SloElastic {
    fn name(&self) -> String {
        "slo-elastic".into()
    }

    fn assign(&mut self, view: &View, ready: &[Ready]) -> Vec<(usize, u32)> {
        let best = |t: &Ready, max: u32| view.cost.best_degree(&view.classes[t.class], max);
        let (mut feasible, mut lost): (Vec<&Ready>, Vec<&Ready>) = ready.iter().partition(|t| {
            let k = best(t, pow2_floor(view.free.max(1)));
            view.now + view.remaining_s(t, k) <= t.deadline
        });
        feasible.sort_by(|a, b| a.deadline.total_cmp(&b.deadline));
        lost.sort_by(|a, b| a.arrival.total_cmp(&b.arrival));
        let mut free = view.free;
        let mut degrees: Vec<(usize, u32, u32)> = Vec::new(); // (id, k, fastest)
        for task in &feasible {
            if free == 0 {
                break;
            }
            let fastest = best(task, pow2_floor(free));
            let slack = (task.deadline - view.now) / 1.1;
            let mut k = 1;
            while k < fastest && view.remaining_s(task, k) > slack {
                k *= 2;
            }
            degrees.push((task.id, k, fastest));
            free -= k;
        }
        for task in &lost {
            if free == 0 {
                break;
            }
            degrees.push((task.id, 1, 1));
            free -= 1;
        }
        // Spare ranks: double the earliest deadlines' degrees while it helps.
        for entry in degrees.iter_mut() {
            while entry.1 < entry.2 && free >= entry.1 {
                free -= entry.1;
                entry.1 *= 2;
            }
        }
        degrees.into_iter().map(|(id, k, _)| (id, k)).collect()
    }
}

/// A policy by name: `static-sp<k>`, `fcfs-elastic`, `srtf-elastic`, `edf-bestfit`,
/// `slo-elastic`.
pub fn by_name(name: &str) -> Option<Box<dyn ElasticPolicy>> {
    if let Some(k) = name.strip_prefix("static-sp") {
        let k: u32 = k.parse().ok().filter(|k: &u32| k.is_power_of_two())?;
        return Some(Box::new(StaticSp(k)));
    }
    Some(match name {
        "fcfs-elastic" => Box::new(Elastic(Order::Fcfs)),
        "srtf-elastic" => Box::new(Elastic(Order::Srtf)),
        "edf-bestfit" => Box::new(Elastic(Order::Edf)),
        "slo-elastic" => Box::new(SloElastic),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::super::cost::image_classes;
    use super::*;

    fn task(id: usize, class: usize, deadline: f64, steps_left: u32) -> Ready {
        Ready {
            id,
            class,
            arrival: id as f64,
            deadline,
            steps_left,
            degree: 0,
        }
    }

    #[test]
    fn static_sp_is_fcfs_with_head_of_line_blocking() {
        let (classes, cost) = (image_classes(), StepCost::h100_flux());
        let view = View {
            now: 0.0,
            free: 6,
            classes: &classes,
            cost: &cost,
        };
        let ready = [
            task(0, 2, 9.0, 28),
            task(1, 0, 9.0, 28),
            task(2, 0, 9.0, 28),
        ];
        assert_eq!(StaticSp(4).assign(&view, &ready), [(0, 4)]);
        assert_eq!(StaticSp(2).assign(&view, &ready), [(0, 2), (1, 2), (2, 2)]);
    }

    #[test]
    fn edf_takes_the_smallest_degree_that_meets_the_deadline() {
        let (classes, cost) = (image_classes(), StepCost::h100_flux());
        let view = View {
            now: 0.0,
            free: 8,
            classes: &classes,
            cost: &cost,
        };
        let l = &classes[2];
        let one = 28.0 * cost.step_s(l, 1);
        let loose = task(0, 2, one * 1.01, 28);
        let tight = task(1, 2, 28.0 * cost.step_s(l, 4) * 1.01, 28);
        let got = Elastic(Order::Edf).assign(&view, &[loose, tight]);
        // The tighter deadline first, on 4; the loose one on the rank left after it... fits 1.
        assert_eq!(got, [(1, 4), (0, 1)]);
    }

    #[test]
    fn slo_elastic_does_not_rescue_lost_causes_with_large_groups() {
        let (classes, cost) = (image_classes(), StepCost::h100_flux());
        let view = View {
            now: 100.0,
            free: 8,
            classes: &classes,
            cost: &cost,
        };
        let lost = task(0, 2, 100.5, 28); // cannot finish 28 L steps in 0.5 s
        let urgent = task(1, 1, 100.0 + 28.0 * cost.step_s(&classes[1], 2) * 1.2, 28);
        let got = SloElastic.assign(&view, &[lost, urgent]);
        assert_eq!(got[0].0, 1, "the feasible one first: {got:?}");
        assert!(got.contains(&(0, 1)), "the lost one on one rank: {got:?}");
        assert!(got.iter().map(|g| g.1).sum::<u32>() <= 8);
    }

    #[test]
    fn names_round_trip() {
        for name in [
            "static-sp1",
            "static-sp8",
            "fcfs-elastic",
            "srtf-elastic",
            "edf-bestfit",
            "slo-elastic",
        ] {
            assert_eq!(by_name(name).unwrap().name(), name);
        }
        assert!(by_name("static-sp3").is_none() && by_name("nope").is_none());
    }
}
